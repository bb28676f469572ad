"""Keep a failure that repeats on every request from flooding Triton's log."""

from __future__ import annotations

import threading
import time


class LogThrottle:
    """``allow()`` is True at most once per ``every`` seconds; it also returns how many
    calls were held back since the last allowed one (to say so in the next line).

    Thread-safety: may be called from any number of threads.
    """

    def __init__(self, every: float = 30.0):
        self.every = float(every)
        self._last = None
        self._held = 0
        self._lock = threading.Lock()

    def allow(self):
        """``(allowed, suppressed since the last allowed call)``."""
        now = time.monotonic()
        with self._lock:
            if self._last is None or now - self._last >= self.every:
                held, self._held, self._last = self._held, 0, now
                return True, held
            self._held += 1
            return False, 0
