"""MetricsPusher: periodic pushes, serialized with the pushes after execute, none after close.

The Triton side (metrics reaching the metrics port of an idle model) is checked end to
end in tests/e2e/test_tiers_server.py.
"""

from __future__ import annotations

import threading
import time
import types

from triton_rec.triton.metrics import MetricsPusher


class Counting:
    """A metrics object that records its pushes and whether two ever overlapped."""

    def __init__(self, fail=False):
        self.calls = 0
        self.overlap = False
        self.fail = fail
        self._busy = threading.Lock()

    def update(self):
        if not self._busy.acquire(blocking=False):
            self.overlap = True
            return
        try:
            self.calls += 1
            time.sleep(0.002)
            if self.fail:
                raise RuntimeError("metrics broke")
        finally:
            self._busy.release()


def pb_utils_logging_to(lines):
    logger = types.SimpleNamespace(log_warn=lines.append)
    return types.SimpleNamespace(Logger=logger)


def test_pushes_periodically_and_never_after_close():
    m = Counting()
    pusher = MetricsPusher(pb_utils_logging_to([]), "m", m, interval=0.01)
    deadline = time.monotonic() + 5
    while m.calls < 3:
        assert time.monotonic() < deadline, "no periodic push"
        time.sleep(0.01)
    pusher.close()
    after = m.calls
    time.sleep(0.05)
    pusher.push()
    assert m.calls == after
    pusher.close()  # idempotent


def test_pushes_from_execute_and_the_thread_never_overlap():
    m = Counting()
    pusher = MetricsPusher(pb_utils_logging_to([]), "m", m, interval=0.001)
    try:
        threads = [
            threading.Thread(target=lambda: [pusher.push() for _ in range(50)]) for _ in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        pusher.close()
    assert not m.overlap and m.calls >= 150


def test_interval_0_pushes_only_when_asked_and_a_failure_is_logged_not_raised():
    lines = []
    m = Counting(fail=True)
    pusher = MetricsPusher(pb_utils_logging_to(lines), "m", m, interval=0)
    time.sleep(0.05)
    assert m.calls == 0
    pusher.push()
    pusher.close()
    assert m.calls == 1
    assert len(lines) == 1 and "model 'm'" in lines[0] and "metrics broke" in lines[0]
