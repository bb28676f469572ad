"""The drained stop (issue 24; docs/operations.md, "Stopping").

Told to stop (SIGTERM, Ctrl-C), the launcher (:class:`~triton_rec.triton.runtime.TritonServer`)
takes the node out of service before it stops tritonserver:

1. it sets the *draining* word of a small shared file (:class:`DrainFile`, layout in
   src/native/drain.hpp) whose path every process of the server finds in
   ``$TRITON_REC_DRAIN_FILE``; from then on every execute of this project's backends
   (the native one and the Python-backend models) refuses its requests with
   ``UNAVAILABLE`` (HTTP 503, gRPC ``UNAVAILABLE``: retry on another node) before any work;
2. it waits until no execute is in flight (the file's second word): every request that
   reached a model before the stop has been answered;
3. it sends tritonserver SIGTERM, and closes the server's idle HTTP keep-alive
   connections and its gRPC endpoint (:func:`close_front_ends`). Triton 2.51 stops its
   HTTP endpoint first and waits, for its whole exit timeout, while any HTTP connection
   is open (server src/main.cc, ``StopEndpoints``; docs/upstream-notes.md), so a client
   that keeps a connection open would hold the server until it gave up and exited
   immediately, with inferences still running (the segfaults of issue 24); and it stops
   gRPC only after unloading the models, answering gRPC requests NOT_FOUND meanwhile.
"""

from __future__ import annotations

import ctypes
import os
import socket
from pathlib import Path
from typing import List, Optional, Union

from triton_rec import _native

#: Where every process of the server finds the drain file.
DRAIN_FILE_ENV = "TRITON_REC_DRAIN_FILE"

#: The longest the launcher waits for the requests already in a model to be answered
#: before it signals tritonserver anyway (which then waits for them up to its exit
#: timeout).
DRAIN_WAIT_S = 5.0

#: The message of a request refused because the server is stopping (src/native/drain.hpp).
STOPPING_MESSAGE: str = _native.STOPPING_MESSAGE


class DrainFile:
    """The shared words of the drained stop, mapped from ``path`` (see the module)."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        self._map = _native.DrainMap(str(self.path))

    @classmethod
    def create(cls, directory: Union[str, os.PathLike]) -> DrainFile:
        """A new drain file (serving, nothing in flight) in ``directory``."""
        path = Path(directory) / "drain"
        path.write_bytes(bytes(_native.DRAIN_FILE_BYTES))
        return cls(path)

    @property
    def draining(self) -> bool:
        """Whether the server has been told to stop."""
        return bool(self._map.draining)

    @property
    def in_flight(self) -> int:
        """Executes in progress, in every process of the server."""
        return int(self._map.in_flight)

    def start_draining(self) -> None:
        """From now on every execute refuses its requests (retryable)."""
        self._map.start_draining()

    def enter(self) -> bool:
        """Count an execute in flight; True if it must refuse its requests."""
        return bool(self._map.enter())

    def leave(self) -> None:
        """The execute counted by :meth:`enter` is done."""
        self._map.leave()


_PROCESS_DRAIN: List[Optional[DrainFile]] = []


def process_drain_file() -> Optional[DrainFile]:
    """This process's drain file (``$TRITON_REC_DRAIN_FILE``), mapped once; None where
    the server was not started by the launcher (or the file is gone)."""
    if not _PROCESS_DRAIN:
        path = os.environ.get(DRAIN_FILE_ENV)
        try:
            _PROCESS_DRAIN.append(DrainFile(path) if path else None)
        except RuntimeError:  # removed: the launcher has gone; nothing to drain for
            _PROCESS_DRAIN.append(None)
    return _PROCESS_DRAIN[0]


# -- closing idle HTTP connections of the server (step 3) -------------------------------

_SYS_PIDFD_GETFD = 438  # x86_64 and aarch64 (Linux >= 5.6)
_TCP_ESTABLISHED = "01"


def _socket_inodes(pid: int) -> dict:
    """The server's socket file descriptors by inode."""
    out = {}
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[link[8:-1]] = int(fd)
    return out


_TCP_LISTEN = "0A"


def server_sockets(pid: int, port: int, idle_only: bool, listening: bool) -> List[int]:
    """The server's (``pid``) TCP sockets on local ``port`` (``/proc/PID/net/tcp`` and
    ``tcp6``), as file descriptors in the server: its accepted connections (with
    ``idle_only``, only those with nothing to read and nothing left to send: a
    connection in the middle of a request has bytes queued one way or the other, or its
    request in an execute, and the launcher closes only once none is in flight) and, with
    ``listening``, the listening socket."""
    inodes = _socket_inodes(pid)
    fds = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) != port or f[9] not in inodes:
                continue
            tx, rx = (int(x, 16) for x in f[4].split(":"))
            if f[3] == _TCP_ESTABLISHED and (not idle_only or (tx == 0 and rx == 0)):
                fds.append(inodes[f[9]])
            elif f[3] == _TCP_LISTEN and listening:
                fds.append(inodes[f[9]])
    return fds


def shut_down_sockets(pid: int, fds: List[int]) -> int:
    """Shut down the server's sockets ``fds`` through a duplicate of each descriptor
    (``pidfd_getfd``, Linux >= 5.6; this process must be allowed to trace the server, as
    its parent is): the server sees the client gone (or, for a listening socket, no more
    connections). Returns how many were shut down (0 where the kernel refuses)."""
    if not fds:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return 0
    done = 0
    try:
        for fd in fds:
            dup = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
            if dup < 0:
                continue
            s = socket.socket(fileno=dup)
            try:
                s.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
            finally:
                s.close()
    finally:
        os.close(pidfd)
    return done


def close_front_ends(pid: int, http_port: int, grpc_port: int) -> int:
    """One pass of step 3 (module docstring), once nothing is in flight: the server's idle
    HTTP connections (Triton 2.51 waits for every one of them before it stops), and its
    gRPC endpoint, listener and connections: Triton stops gRPC last, after it has unloaded
    the models, and in between a gRPC request gets NOT_FOUND ("unknown model"), where a
    client whose connection is gone gets UNAVAILABLE and retries elsewhere. Returns how
    many sockets were shut down."""
    return shut_down_sockets(
        pid,
        server_sockets(pid, http_port, idle_only=True, listening=False)
        + server_sockets(pid, grpc_port, idle_only=False, listening=True),
    )
