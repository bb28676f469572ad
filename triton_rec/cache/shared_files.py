"""The files a shared cache is published in (:mod:`triton_rec.cache.gpu_share` says the
flow and the ownership rules): their names, atomic publishing, the writer lock with its
table of attached processes (:class:`FileLock`), and the CPU twin's state arrays in one
``/dev/shm`` file (:func:`share_numpy_arrays`, :func:`attach_numpy_arrays`)."""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import secrets
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.cache.shm_cache import shm_dir
from triton_rec.cache.shm_security import open_private_file
from triton_rec.errors import ConfigError
from triton_rec.util.procfs import process_alive, start_time

log = logging.getLogger("triton_rec.cache.gpu_share")  # the shared caches' log

HANDLES_FORMAT = "triton-rec-cuda-ipc/1"
SHM_MAGIC = b"TRECSHM1"
_HEADER = 4096  # bytes before the first array: magic, JSON length, JSON manifest
_ALIGN = 256
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
#: a process as the attachment table and the owner records know it: (pid, start time)
ProcessToken = Tuple[int, int]


def self_token() -> ProcessToken:
    """This process as the attachment table and the owner records know it."""
    pid = os.getpid()
    return pid, start_time(pid)


def elsewhere(tokens: List[ProcessToken]) -> List[ProcessToken]:
    """The attachments of other processes than this one."""
    me = os.getpid()
    return [t for t in tokens if t[0] != me]


def token_alive(pid: int, starttime: int) -> bool:
    """The owner / attachment check: the process ``pid`` that started at ``starttime``
    still runs. Without a start time the recorded process cannot be told apart from a
    later one under the same pid (the bare-pid check), so it counts as gone."""
    return starttime > 0 and process_alive(pid, starttime)


#: prefix of every file this module publishes (the CPU cache's segments use ``trec_``)
FILE_PREFIX = "trec_xp_"


def shared_path(name: str, suffix: str = "", directory: Optional[str] = None) -> str:
    """The file published for ``name``: ``<shm_dir>/trec_xp_<name><suffix>``
    (suffixes: ``""`` numpy arrays, ``".lock"`` writer lock, ``".cudaipc.json"`` handles)."""
    if not _NAME_RE.fullmatch(name):
        raise ConfigError(f"shared name must match [A-Za-z0-9_.-]{{1,200}}, got {name!r}")
    return os.path.join(shm_dir(directory), FILE_PREFIX + name + suffix)


def path_of(name: str, directory: Optional[str], suffix: str = "") -> str:
    """:func:`shared_path` with the directory before the suffix."""
    return shared_path(name, suffix, directory)


def publish_file(
    path: str, write: Callable[[int], object], size: int = 0, exclusive: bool = True
) -> None:
    """Create ``path`` atomically: write a temp file in the same directory, then link it
    in place (``exclusive``: fails with FileExistsError if ``path`` exists) or rename it
    over ``path``. Readers never see a partly written file."""
    d = os.path.dirname(path)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        if size:
            os.ftruncate(fd, size)
        write(fd)
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


class FileLock:
    """Process-shared writer lock: ``flock`` on a file, plus a thread lock (``flock``
    does not exclude threads sharing one open file). Pass it as the cache's ``lock``.
    Both are :attr:`native` (``_native.WriterLock``), which the native writers of the
    cache take too (:meth:`ArrayEmbeddingCache.miss_cache`).

    The lock file is created if needed (mode 0600); an existing one is used only if it is
    private to our user (:mod:`triton_rec.cache.shm_security`). :meth:`unlink` removes it
    (owner's cleanup). A lock held by a process that dies is released by the kernel.
    """

    def __init__(self, path: str):
        self.path = path
        self._fd = open_private_file(path, os.O_RDWR | os.O_CREAT, "writer lock file")
        #: the lock itself (a duplicate of the file's descriptor: usable after close())
        self.native = _native.WriterLock(self._fd)

    def __enter__(self):
        self.native.acquire()  # the GIL released while it waits
        return self

    def __exit__(self, *exc) -> None:
        self.native.release()

    def close(self) -> None:
        """Close the lock file's descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def is_published(self) -> bool:
        """Whether ``path`` still names the file this lock holds open (the owner's
        ``close`` unlinks it: a lock taken on the old file guards nothing new)."""
        try:
            a, b = os.fstat(self._fd), os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    # The attachment table: int64 (pid, start time) pairs, the whole content of the lock
    # file. Read and written only while the lock is held.
    def _read_tokens(self) -> List[ProcessToken]:
        data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        pairs = np.frombuffer(data[: len(data) // 16 * 16], dtype="<i8").reshape(-1, 2)
        return [(int(p), int(t)) for p, t in pairs]

    def _write_tokens(self, tokens: List[ProcessToken]) -> None:
        blob = np.asarray(tokens, dtype="<i8").reshape(-1, 2).tobytes()
        os.pwrite(self._fd, blob, 0)
        os.ftruncate(self._fd, len(blob))

    def attached(self) -> List[ProcessToken]:
        """Live processes attached (one entry per open, duplicates included); drops the
        entries of processes that are gone. Caller holds the lock."""
        tokens = self._read_tokens()
        live = [t for t in tokens if token_alive(*t)]
        if len(live) != len(tokens):
            self._write_tokens(live)
        return live

    def register(self, token: ProcessToken, fresh: bool = False) -> None:
        """Add an attachment (``fresh``: a new cache, the table restarts with it).
        Caller holds the lock."""
        self._write_tokens([token] if fresh else self.attached() + [token])

    def unregister(self, token: ProcessToken) -> List[ProcessToken]:
        """Remove one attachment of ``token``; returns the live ones left. Caller holds
        the lock."""
        live = self.attached()
        if token in live:
            live.remove(token)
            self._write_tokens(live)
        return live

    def unlink(self) -> None:
        """Remove the lock file, if it still exists."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# ============================================================ CPU: numpy over /dev/shm
class SharedArrays:
    """numpy arrays living in one shared-memory file, published under ``name``.

    Attributes:
        name, path: the published name and its file.
        arrays: ``name -> np.ndarray`` views of the mapping.
        owner: True in the process that created it (its :meth:`close` unlinks the file).
        pid, starttime: the creator's identity (from the file; starttime 0 if unrecorded).
    """

    _mm: Optional[mmap.mmap]  # None once closed

    def __init__(
        self,
        name: str,
        path: str,
        mm: mmap.mmap,
        arrays: Dict[str, np.ndarray],
        owner: bool,
        pid: int,
        starttime: int = 0,
    ):
        self.name, self.path, self._mm, self.arrays = name, path, mm, arrays
        self.owner, self.pid, self.starttime = owner, pid, starttime

    def owner_alive(self) -> bool:
        """Whether the creating process (pid + start time) still runs."""
        return token_alive(self.pid, self.starttime)

    def close(self) -> None:
        """Drop this process's mapping; the owner also unlinks the file. Arrays still
        referenced elsewhere stay valid until they are garbage-collected (the mapping
        is only unmapped once nothing uses it)."""
        self.arrays = {}
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views still alive elsewhere: unmapped when they die
                pass
            self._mm = None
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> SharedArrays:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _views(mm: mmap.mmap, manifest: Dict[str, Any]) -> Dict[str, np.ndarray]:
    out: Dict[str, np.ndarray] = {}
    for n, spec in manifest["arrays"].items():
        dt = np.dtype(spec["dtype"])
        shape = tuple(spec["shape"])
        out[n] = np.ndarray(shape, dtype=dt, buffer=mm, offset=int(spec["offset"]))
    return out


def share_numpy_arrays(
    name: str, arrays: Dict[str, Any], directory: Optional[str] = None
) -> SharedArrays:
    """Create a shared-memory file holding copies of ``arrays`` and publish it as ``name``.

    ``arrays`` maps names to numpy arrays, or to ``(shape, dtype)`` pairs for zeroed
    arrays (no copy). Returns the owner's :class:`SharedArrays`, whose ``arrays`` are the
    shared views (use those, not the inputs).

    Raises:
        FileExistsError: ``name`` is already published (attach to it instead).
    """
    path = path_of(name, directory)
    specs, offset = {}, _HEADER
    for n, a in arrays.items():
        if isinstance(a, tuple):
            shape, dt = tuple(int(x) for x in a[0]), np.dtype(a[1])
        else:
            shape, dt = tuple(a.shape), np.dtype(a.dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        specs[n] = {"dtype": dt.str, "shape": list(shape), "offset": offset}
        offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    pid, starttime = self_token()
    manifest = {"pid": pid, "starttime": starttime, "arrays": specs}
    blob = json.dumps(manifest).encode()
    if len(blob) + 16 > _HEADER:
        raise ConfigError(f"too many arrays to share under {name!r}")
    holder: Dict[str, Any] = {}

    def write(fd: int) -> None:
        mm = mmap.mmap(fd, offset, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        mm[: 16 + len(blob)] = SHM_MAGIC + len(blob).to_bytes(8, "little") + blob
        views = _views(mm, manifest)
        for n, a in arrays.items():
            if not isinstance(a, tuple):
                views[n][...] = a
        holder["mm"], holder["views"] = mm, views

    try:
        publish_file(path, write, size=offset, exclusive=True)
    except BaseException:
        if "mm" in holder:
            holder.pop("views")
            holder.pop("mm").close()
        raise
    return SharedArrays(
        name, path, holder["mm"], holder["views"], owner=True, pid=pid, starttime=starttime
    )


def attach_numpy_arrays(name: str, directory: Optional[str] = None) -> SharedArrays:
    """Map the shared-memory file published as ``name`` (read-write).

    Raises:
        FileNotFoundError: nothing is published under ``name``.
        ConfigError: the file is not one of ours.
        SharedMemorySecurityError: the file is not private to our user (never read).
    """
    path = path_of(name, directory)
    fd = open_private_file(path, os.O_RDWR, "shared array file")
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER:
            raise ConfigError(f"{path}: not a triton-rec shared-array file (too short)")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if mm[:8] != SHM_MAGIC:
        mm.close()
        raise ConfigError(f"{path}: not a triton-rec shared-array file (bad magic)")
    n = int.from_bytes(mm[8:16], "little")
    manifest = json.loads(mm[16 : 16 + n].decode())
    return SharedArrays(
        name,
        path,
        mm,
        _views(mm, manifest),
        owner=False,
        pid=int(manifest["pid"]),
        starttime=int(manifest.get("starttime") or 0),
    )


# ============================================================ GPU: CUDA IPC through CuPy
