"""triton_rec.util.procfs against real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from triton_rec.util import procfs

# A child whose command name contains ") " and "(": /proc/<pid>/stat must be cut at
# the LAST ")" to find its fields.
TRICKY_NAME = "a) b (c"
CHILD = (
    f"import ctypes, time; ctypes.CDLL(None).prctl(15, {TRICKY_NAME.encode()!r}, 0, 0, 0); "
    "print('ok', flush=True); time.sleep(60)"
)


def _child():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ok"
    return p


def test_own_stat_names_our_parent_group_and_a_running_state():
    st = procfs.proc_stat(os.getpid())
    assert st.ppid == os.getppid() and st.pgid == os.getpgrp()
    assert st.alive and st.state in "RS"
    assert st.starttime > 0 and st.cpu_seconds > 0


def test_a_command_name_with_parentheses_and_spaces_is_parsed_from_the_last_paren():
    p = _child()
    try:
        with open(f"/proc/{p.pid}/comm") as f:
            assert f.read().strip() == TRICKY_NAME  # the name really is tricky
        st = procfs.proc_stat(p.pid)
        assert st.ppid == os.getpid() and st.pgid == os.getpgrp() and st.alive
        assert p.pid in procfs.children(os.getpid())
        assert p.pid in procfs.group_members(os.getpgrp())
        assert procfs.cmdline(p.pid)[:2] == [sys.executable, "-c"]
    finally:
        p.kill()
        p.wait()


def test_a_killed_child_is_gone_while_still_a_zombie_and_after_it_is_reaped():
    p = _child()
    os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not procfs.is_gone(p.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    st = procfs.proc_stat(p.pid)
    assert st is not None and st.state == "Z"  # not reaped yet: a zombie, and gone
    assert procfs.is_gone(p.pid)
    assert p.pid not in procfs.children(os.getpid())
    assert p.pid in procfs.children(os.getpid(), alive_only=False)
    p.wait()
    assert procfs.proc_stat(p.pid) is None and procfs.is_gone(p.pid)
    assert procfs.cmdline(p.pid) == []


def test_the_owner_check_tells_a_recycled_pid_and_a_zombie_from_the_owner():
    me = os.getpid()
    start = procfs.start_time(me)
    assert start > 0
    assert procfs.process_alive(me) and procfs.process_alive(me, start)
    assert not procfs.process_alive(me, start + 1)  # another process under our pid
    assert not procfs.process_alive(0) and not procfs.process_alive(-1)
    p = _child()
    started = procfs.start_time(p.pid)
    assert procfs.process_alive(p.pid, started)
    os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while procfs.process_alive(p.pid, started) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not procfs.process_alive(p.pid, started)  # a zombie counts as gone
    p.wait()
    assert not procfs.process_alive(p.pid) and procfs.start_time(p.pid) == 0


def test_flock_exclusive_waits_until_the_deadline_then_raises_the_callers_error(tmp_path):
    import threading

    path = str(tmp_path / "lock")
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    waiter = os.open(path, os.O_RDWR)
    try:
        procfs.flock_exclusive(holder, time.monotonic() + 1)
        waits = []
        t0 = time.monotonic()
        with pytest.raises(LookupError, match="held"):
            procfs.flock_exclusive(
                waiter, t0 + 0.2, lambda: LookupError("held"), on_wait=lambda: waits.append(1)
            )
        assert 0.2 <= time.monotonic() - t0 < 5 and waits == [1]
        with pytest.raises(TimeoutError):
            procfs.flock_exclusive(waiter, time.monotonic())
        # no deadline: blocks until the holder lets go
        threading.Timer(0.1, os.close, (holder,)).start()
        holder = -1
        procfs.flock_exclusive(waiter, None)
    finally:
        os.close(waiter)
        if holder >= 0:
            os.close(holder)


def test_smaps_rollup_reports_bytes_and_raises_for_a_gone_process():
    mem = procfs.smaps_rollup(os.getpid())
    assert mem["Rss"] >= mem["Pss"] > 0 and mem["Rss"] % 1024 == 0
    p = _child()
    p.kill()
    p.wait()
    with pytest.raises(OSError):
        procfs.smaps_rollup(p.pid)
