"""triton_rec.procfs against real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from triton_rec import procfs

# A child whose command name contains ") " and "(": /proc/<pid>/stat must be cut at
# the LAST ")" to find its fields.
TRICKY_NAME = "a) b (c"
CHILD = (f"import ctypes, time; ctypes.CDLL(None).prctl(15, {TRICKY_NAME.encode()!r}, 0, 0, 0); "
         "print('ok', flush=True); time.sleep(60)")


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
