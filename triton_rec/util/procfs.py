"""Process facts from Linux ``/proc``: the one reader of ``/proc/<pid>/stat`` that the
shared cache (liveness of attachers), the supervisor (instance processes), the
launcher, the benchmarks and the tests use.

Field positions are those of proc(5): after the command name in parentheses come
state (3), ppid (4), pgrp (5), minflt (10), majflt (12), utime (14), stime (15) and
starttime (22). The command name may itself contain ``)`` and spaces, so a line is cut
at its LAST ``)``.

Two helpers build on it for the processes of a node that share files: the owner check
(:func:`process_alive`: is the process that recorded ``(pid, starttime)`` still the one
running under that pid) and the exclusive ``flock`` with a deadline (:func:`flock_exclusive`).
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional


class ProcStat(NamedTuple):
    """One process's ``/proc/<pid>/stat``, the fields this project reads."""

    state: str  #: R, S, D, Z (zombie: exited, not reaped), X, ...
    ppid: int
    pgid: int
    minflt: int  #: minor page faults
    utime: int  #: user CPU, clock ticks
    stime: int  #: system CPU, clock ticks
    starttime: int  #: clock ticks after boot (with the pid: a process's identity)

    @property
    def alive(self) -> bool:
        """Running or sleeping: neither a zombie nor dead."""
        return self.state not in ("Z", "X")

    @property
    def cpu_seconds(self) -> float:
        """User plus system CPU time, in seconds."""
        return (self.utime + self.stime) / CLOCK_TICKS


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_stat(pid: int) -> Optional[ProcStat]:
    """The stat of ``pid``, or None when it does not exist (or /proc cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return ProcStat(
            fields[0].decode(),
            int(fields[1]),
            int(fields[2]),
            int(fields[7]),
            int(fields[11]),
            int(fields[12]),
            int(fields[19]),
        )
    except (IndexError, ValueError):
        return None


def pids() -> Iterator[int]:
    """Every process id in /proc."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def is_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts as exited)."""
    st = proc_stat(pid)
    return st is None or not st.alive


def children(pid: int, alive_only: bool = True) -> List[int]:
    """Child processes of ``pid`` (only live ones unless ``alive_only`` is False): from
    /proc/<pid>/task/*/children where the kernel has it (no scan of /proc), else a scan."""
    try:
        kids = [
            int(k)
            for task in os.listdir(f"/proc/{pid}/task")
            for k in open(f"/proc/{pid}/task/{task}/children").read().split()
        ]
    except FileNotFoundError:
        if not os.path.exists(f"/proc/{pid}"):
            return []
        kids = [p for p in pids() if (st := proc_stat(p)) and st.ppid == pid]
    except OSError:
        kids = [p for p in pids() if (st := proc_stat(p)) and st.ppid == pid]
    if not alive_only:
        return kids
    return [k for k in kids if (st := proc_stat(k)) and st.alive]


def group_members(pgid: int) -> List[int]:
    """Live processes of process group ``pgid``."""
    out = []
    for p in pids():
        st = proc_stat(p)
        if st and st.pgid == pgid and st.alive:
            out.append(p)
    return out


def cmdline(pid: int) -> List[str]:
    """The argv of ``pid`` ([] when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [os.fsdecode(a) for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (e.g. a server and its instance processes;
    a child that exited but was not reaped yet still counts)."""
    total = 0.0
    for p in pids():
        st = proc_stat(p)
        if st and (p == pid or st.ppid == pid):
            total += st.cpu_seconds
    return total


def start_time(pid: int) -> int:
    """The ``starttime`` of ``pid`` (0 when it cannot be read): recorded next to a pid, it
    tells the process apart from a later one that reuses the pid (:func:`process_alive`)."""
    st = proc_stat(pid)
    return st.starttime if st else 0


def process_alive(pid: int, starttime: Optional[int] = None) -> bool:
    """Whether the process ``pid`` still exists: the owner check of a shared file.

    Args:
        pid: the process id recorded by the owner.
        starttime: its :func:`start_time` recorded with it; when given (non-zero), a
            process now running under ``pid`` with another start time is a recycled pid,
            and the owner counts as gone.

    A zombie counts as gone; a process of another user counts as alive. Without /proc,
    only ``kill(pid, 0)`` decides.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    st = proc_stat(pid)
    if st is None:
        return True  # no /proc: kill() said it exists
    if not st.alive:
        return False
    return not (starttime and st.starttime != starttime)


def flock_exclusive(
    fd: int,
    deadline: Optional[float],
    timeout_error: Optional[Callable[[], BaseException]] = None,
    *,
    on_wait: Optional[Callable[[], None]] = None,
    min_delay: float = 0.001,
    max_delay: float = 0.05,
) -> None:
    """Take an exclusive ``flock`` of ``fd``, waiting for it at most until ``deadline``.

    Args:
        fd: an open file descriptor (closing it releases the lock; so does the holder's death).
        deadline: a ``time.monotonic()`` value; None waits without limit (a blocking flock).
        timeout_error: called to make the exception raised when the deadline passes
            (default: TimeoutError).
        on_wait: called once if the lock is held by another process (e.g. to log that).
        min_delay, max_delay: seconds between two attempts, doubling from the first to
            the second.
    """
    delay = min_delay
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if not waited:
            waited = True
            if on_wait is not None:
                on_wait()
        if deadline is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return
        if time.monotonic() > deadline:
            raise (
                timeout_error()
                if timeout_error is not None
                else TimeoutError(f"fd {fd}: timed out waiting for an exclusive flock")
            )
        time.sleep(delay)
        delay = min(delay * 2, max_delay)


def smaps_rollup(pid: int) -> Dict[str, int]:
    """The memory totals of ``pid`` from ``/proc/<pid>/smaps_rollup`` in bytes, by field
    (``Rss``, ``Pss``, ``Shared_Clean``, ...). Raises OSError when the process is gone."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def pss_by_mapping(pid: int) -> Dict[str, int]:
    """PSS of ``pid`` in bytes per mapped file (``/proc/<pid>/smaps``; anonymous memory,
    heap and stacks under ``""``). Raises OSError when the process is gone."""
    out: Dict[str, int] = {}
    name = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
                name = parts[5] if len(parts) > 5 and parts[5].startswith("/") else ""
            elif parts[0] == "Pss:":
                out[name] = out.get(name, 0) + int(parts[1]) * 1024
    return out
