"""Run a test's work in several threads at once and fail with every thread's error."""

from __future__ import annotations

import threading
from typing import Callable, Optional


def run_in_threads(work: Callable[[int], None], n: int, timeout: Optional[float] = None) -> None:
    """Start ``work(0) .. work(n - 1)`` in ``n`` threads, join each (within ``timeout``
    seconds, None: no limit) and assert that none raised; the assertion lists them all."""
    errors = []

    def run(i: int) -> None:
        try:
            work(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors
