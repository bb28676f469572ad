"""triton_rec._native.start_parent_watchdog: an orphan whose every Python thread is stuck
(the GIL held forever, as by a Metric.set that the dead server never answers) still exits.

Each case starts a short-lived "parent" process that starts the "instance" and exits;
the instance then blocks in a C call that holds the GIL. The control case (no watchdog)
shows the instance would stay alive: the test can fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from triton_rec.util.procfs import is_gone

INSTANCE = textwrap.dedent("""
    import ctypes, sys
    from triton_rec import _native
    if sys.argv[1] == "watch":
        assert _native.start_parent_watchdog(0.5, exit_code=3, poll_ms=20)
        assert not _native.start_parent_watchdog(0.5)  # once per process
    print("ready", flush=True)
    ctypes.PyDLL(None).pause()  # PyDLL keeps the GIL: no Python thread can run again
""")

PARENT = textwrap.dedent("""
    import subprocess, sys
    # The instance must not hold the test's pipes open after this process is gone.
    p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    assert p.stdout.readline().strip() == b"ready"
    print(p.pid, flush=True)
""")


def orphan(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PARENT, INSTANCE, mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(out.stdout.strip())


def wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if is_gone(pid):
            return True
        time.sleep(0.05)
    return is_gone(pid)


def test_an_orphan_with_every_thread_stuck_exits_after_the_grace_period():
    pid = orphan("watch")
    assert wait_gone(pid, 10.0), "the watchdog did not end the orphaned process"


def test_control_without_the_watchdog_the_orphan_stays():
    pid = orphan("none")
    try:
        assert not wait_gone(pid, 1.5), "the orphan exited by itself: the test above proves nothing"
    finally:
        os.kill(pid, signal.SIGKILL)
