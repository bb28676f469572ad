"""Sharing the embedding-cache state arrays between instance processes.

Every Triton model instance is its own process; the instances on one device share one
cache per table. The first instance to get there creates the state arrays and
*publishes* them under a name; the others *attach* to them by that name.

Two implementations of the same publish/attach flow:

- **GPU** (CUDA IPC, through CuPy): :func:`allocate_device_arrays` allocates each array
  with its own ``cudaMalloc``; :func:`export_arrays` takes a CUDA IPC handle of each,
  :func:`write_handles` publishes them as a small JSON file under ``/dev/shm``;
  :func:`read_handles` + :func:`import_arrays` open them in another process
  (``cudaIpcOpenMemHandle``) as ``cupy.ndarray`` views of the same device memory.
- **CPU**: :func:`share_numpy_arrays` lays the arrays out in one ``/dev/shm`` file and
  publishes it; :func:`attach_numpy_arrays` maps that file in another process (numpy
  arrays over an ``mmap``). This is the GPU flow runnable without a GPU, which is how the
  tests exercise it; the production CPU cache is the C++ one (:mod:`triton_rec.cache.shm_cache`).

:func:`open_shared_cache` runs the whole flow for one cache (create or attach, plus a
process-shared writer lock) on either kind of memory.

Ownership and lifetime (the same conventions as the CPU segment,
:mod:`triton_rec.cache.shm_cache`):

- **owner**: the creating process. Its identity is its pid **and start time**
  (:func:`triton_rec.util.procfs.process_alive`): a recycled pid is another process, a
  zombie is gone. Both are recorded in what it publishes (the handles file, the numpy
  file's manifest); state whose owner is gone (or whose record has no start time) is
  *stale*: :func:`open_shared_cache` removes it and creates a fresh cache.
- **attachments**: every process that opens the cache (the owner included) registers
  its (pid, start time) in the cache's writer-lock file, under that file's ``flock``;
  ``close`` removes it. Entries of processes that no longer exist are dropped whenever
  the table is read. The table lives in the lock file's inode, which every attached
  process holds open, so it outlives the lock file's name.
- **close of the owner**: it unpublishes the cache at once (handles / numpy file and
  lock file are unlinked: no process attaches any more), then frees the memory only
  once no other live process is attached: it waits up to ``linger`` seconds
  (:data:`OWNER_LINGER_S`) for them to detach, and if some are still attached it
  *retains* the memory instead of freeing it (logged), until :func:`release_retained`
  finds them gone. Ownership cannot pass to another process: device memory exported
  through CUDA IPC belongs to the exporting process and is freed when it **exits**,
  whatever is still attached (CUDA has no way to keep it); retaining only helps while
  the owner's process lives on. Attached processes should therefore be torn down
  together with the owner, which is what Triton does when it unloads a model.
- **names**: the deployment names a device cache after the model *version* and the
  server process (:func:`triton_rec.serving.deployment.cache_name`), so a new version
  of a model, or another server sharing the store, never attaches to the memory of an
  old one whose unload will free it.
- CUDA IPC needs all processes on the same node; a handle can be opened once per
  process, and not in the process that exported it.
- CPU twin: the data lives in the ``/dev/shm`` file, not in a process: unlinking it on
  the owner's ``close`` leaves the mappings working; "freeing" is closing the owner's
  mapping. Everything above is otherwise the same, which is how the tests exercise it.

The numpy half is tested in tests/unit; the CUDA IPC half ran on an H200 (tests/gpu:
a second process attaches and shares the cache). CuPy is imported inside the GPU
functions only.
"""

from __future__ import annotations

import atexit
import json
import logging
import mmap
import os
import re
import secrets
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union, cast

import numpy as np

from triton_rec import _native
from triton_rec.cache.array_cache import (
    ArrayEmbeddingCache,
    CupyUnavailableError,
    HostCacheView,
    resolve_xp,
)
from triton_rec.cache.shm_cache import shm_dir
from triton_rec.cache.shm_security import open_private_file, open_segment_dir, remove_namespace_dir
from triton_rec.config.ps_json import CachePolicy
from triton_rec.errors import ConfigError, StaleHandlesError
from triton_rec.gpu import SETUP_LOCK
from triton_rec.precision import DEFAULT_PRECISION
from triton_rec.util.procfs import process_alive, start_time

log = logging.getLogger(__name__)

__all__ = [
    "OWNER_LINGER_S",
    "allocation_bytes",
    "device_cache_bytes",
    "CupyUnavailableError",
    "FileLock",
    "SharedArrays",
    "SharedCache",
    "StaleHandlesError",
    "allocate_device_arrays",
    "attach_numpy_arrays",
    "export_arrays",
    "import_arrays",
    "open_shared_cache",
    "read_handles",
    "release_retained",
    "retained_caches",
    "share_numpy_arrays",
    "shared_path",
    "shm_dir",
    "write_handles",
]

HANDLES_FORMAT = "triton-rec-cuda-ipc/1"
SHM_MAGIC = b"TRECSHM1"
_HEADER = 4096  # bytes before the first array: magic, JSON length, JSON manifest
_ALIGN = 256
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
#: seconds the owner's ``close`` waits for the other attached processes to detach before
#: it retains the memory instead of freeing it (Triton finalizes a model's instances
#: together: the others normally detach within this time)
OWNER_LINGER_S = 10.0
_POLL_S = 0.05

#: a process as the attachment table and the owner records know it: (pid, start time)
ProcessToken = Tuple[int, int]


def _self_token() -> ProcessToken:
    pid = os.getpid()
    return pid, start_time(pid)


def _elsewhere(tokens: List[ProcessToken]) -> List[ProcessToken]:
    """The attachments of other processes than this one."""
    me = os.getpid()
    return [t for t in tokens if t[0] != me]


def _token_alive(pid: int, starttime: int) -> bool:
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


def _path(name: str, directory: Optional[str], suffix: str = "") -> str:
    return shared_path(name, suffix, directory)


def _publish_file(
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
        live = [t for t in tokens if _token_alive(*t)]
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
        return _token_alive(self.pid, self.starttime)

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
    path = _path(name, directory)
    specs, offset = {}, _HEADER
    for n, a in arrays.items():
        if isinstance(a, tuple):
            shape, dt = tuple(int(x) for x in a[0]), np.dtype(a[1])
        else:
            shape, dt = tuple(a.shape), np.dtype(a.dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        specs[n] = {"dtype": dt.str, "shape": list(shape), "offset": offset}
        offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    pid, starttime = _self_token()
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
        _publish_file(path, write, size=offset, exclusive=True)
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
    path = _path(name, directory)
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
def _cupy():
    return resolve_xp("cupy")  # raises CupyUnavailableError with a clear message


def allocation_bytes(shape: tuple, dtype: Any) -> int:
    """Bytes of the ``cudaMalloc`` that :func:`allocate_device_arrays` makes for one array
    (at least 1)."""
    return max(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, 1)


def device_cache_bytes(
    capacity: int,
    vec_size: int,
    ways: int = 8,
    policy: str = CachePolicy.LRU,
    precision: str = DEFAULT_PRECISION,
) -> int:
    """Device memory of the cache :func:`open_shared_cache` creates on a GPU for these
    arguments: its state arrays (:meth:`ArrayEmbeddingCache.state_layout`), one allocation
    each (:func:`allocation_bytes`). The one rule, which the node plan
    (:mod:`triton_rec.serving.sizing`) uses too."""
    layout = ArrayEmbeddingCache.state_layout(capacity, vec_size, ways, policy, precision)
    return sum(allocation_bytes(shape, dt) for shape, dt in layout.values())


def allocate_device_arrays(
    layout: Dict[str, Tuple[tuple, Any]], device: Optional[int] = None
) -> Dict[str, Any]:
    """Zeroed cupy arrays for ``layout`` (``name -> (shape, dtype)``), each in its own
    ``cudaMalloc`` allocation (not CuPy's memory pool), as CUDA IPC requires: an IPC
    handle names a whole allocation, and a pooled array may sit inside a larger one."""
    cupy = _cupy()
    out = {}
    with cupy.cuda.Device(device if device is not None else cupy.cuda.runtime.getDevice()):
        for n, (shape, dt) in layout.items():
            dt = np.dtype(dt)
            mem = cupy.cuda.memory.Memory(allocation_bytes(shape, dt))
            a = cupy.ndarray(tuple(shape), dtype=dt, memptr=cupy.cuda.memory.MemoryPointer(mem, 0))
            a.fill(0)
            out[n] = a
    return out


def export_arrays(arrays: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """CUDA IPC handles of ``arrays`` (cupy arrays from :func:`allocate_device_arrays`):
    ``name -> {handle (hex of the 64-byte cudaIpcMemHandle), shape, dtype, device, nbytes}``.

    Raises:
        ValueError: an array is not a whole, contiguous, non-pooled allocation.
    """
    cupy = _cupy()
    out = {}
    for n, a in arrays.items():
        if not isinstance(a, cupy.ndarray) or not a.flags.c_contiguous:
            raise ValueError(f"{n}: only C-contiguous cupy arrays can be exported")
        mem = a.data.mem
        if type(mem) is not cupy.cuda.memory.Memory or a.data.ptr != mem.ptr:
            raise ValueError(
                f"{n}: not the start of its own cudaMalloc allocation (pooled or a slice); "
                "allocate it with allocate_device_arrays()"
            )
        handle = cupy.cuda.runtime.ipcGetMemHandle(a.data.ptr)
        out[n] = {
            "handle": bytes(handle).hex(),
            "shape": [int(x) for x in a.shape],
            "dtype": a.dtype.str,
            "device": int(a.device.id),
            "nbytes": int(a.nbytes),
        }
    return out


class _IpcMapping:
    """Owner of one opened IPC mapping: closes it when the last array using it dies."""

    def __init__(self, runtime, ptr: int, device: int):
        self._runtime, self.ptr, self.device = runtime, ptr, device

    def __del__(self):
        try:
            self._runtime.ipcCloseMemHandle(self.ptr)
        except Exception:
            pass


def import_arrays(handles: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Open the IPC ``handles`` of :func:`export_arrays` (in another process) as cupy
    arrays over the exporter's device memory. The mapping is closed
    (``cudaIpcCloseMemHandle``) when the returned array is garbage-collected."""
    cupy = _cupy()
    rt = cupy.cuda.runtime
    out = {}
    for n, h in handles.items():
        dev = int(h["device"])
        with cupy.cuda.Device(dev):
            ptr = rt.ipcOpenMemHandle(bytes.fromhex(h["handle"]))  # flags: lazy peer access
            owner = _IpcMapping(rt, ptr, dev)
            mem = cupy.cuda.memory.UnownedMemory(ptr, int(h["nbytes"]), owner, dev)
            out[n] = cupy.ndarray(
                tuple(h["shape"]),
                dtype=np.dtype(h["dtype"]),
                memptr=cupy.cuda.memory.MemoryPointer(mem, 0),
            )
    return out


def write_handles(path: str, handles: Dict[str, Dict[str, Any]], exclusive: bool = True) -> None:
    """Publish ``handles`` (of :func:`export_arrays`) as JSON at ``path``, atomically,
    with this process (pid and start time) as the owner. ``exclusive``: FileExistsError
    if ``path`` exists (else it is replaced)."""
    pid, starttime = _self_token()
    doc = json.dumps(
        {"format": HANDLES_FORMAT, "pid": pid, "starttime": starttime, "arrays": handles}
    ).encode()
    _publish_file(path, lambda fd: os.write(fd, doc), exclusive=exclusive)


def read_handles(path: str, check_owner: bool = True) -> Dict[str, Dict[str, Any]]:
    """The handles published at ``path``.

    Raises:
        FileNotFoundError: nothing published there.
        StaleHandlesError: ``check_owner`` and the publishing process is gone (its device
            memory is freed: the handles must not be opened): exited, a zombie, or its
            pid now belongs to another process (:func:`triton_rec.util.procfs.process_alive`),
            or the file records no start time (the owner cannot be verified).
        ConfigError: not a handles file.
        SharedMemorySecurityError: the file is not private to our user (never read).
    """
    with os.fdopen(open_private_file(path, os.O_RDONLY, "CUDA IPC handles file"), "rb") as f:
        doc = json.loads(f.read().decode())
    if not isinstance(doc, dict) or doc.get("format") != HANDLES_FORMAT:
        raise ConfigError(f"{path}: not a triton-rec CUDA IPC handles file")
    if check_owner and not _token_alive(int(doc["pid"]), int(doc.get("starttime") or 0)):
        raise StaleHandlesError(
            f"{path}: published by pid {doc['pid']} (start time {doc.get('starttime')}), "
            "which is no longer running"
        )
    return doc["arrays"]


# ============================================================ one shared cache, create or attach
class _Retained:
    """State a closed owner keeps because other processes were still attached."""

    def __init__(self, name: str, lock: FileLock, state: Any):
        self.name, self.lock, self.state = name, lock, state

    def free(self) -> None:
        if hasattr(self.state, "close"):
            self.state.close()  # numpy twin: the owner's mapping
        self.state = None  # device arrays: freed (cudaFree) with the last reference
        self.lock.close()


_RETAINED: List[_Retained] = []
_RETAINED_LOCK = threading.Lock()


def retained_caches() -> List[str]:
    """Names of the caches this process created and closed whose memory it still holds
    because other processes were attached (see :func:`release_retained`)."""
    with _RETAINED_LOCK:
        return [r.name for r in _RETAINED]


def release_retained() -> int:
    """Free the retained memory of every cache no live process is attached to any more;
    returns how many were freed. Called by every :func:`open_shared_cache` and
    :meth:`SharedCache.close`; safe at any time."""
    with _RETAINED_LOCK:
        keep, freed = [], 0
        for r in _RETAINED:
            with r.lock:
                users = r.lock.attached()
            if users:
                keep.append(r)
            else:
                r.free()
                freed += 1
        _RETAINED[:] = keep
    return freed


@atexit.register
def _warn_retained_at_exit() -> None:  # pragma: no cover - exercised by process exit
    release_retained()
    for r in _RETAINED:
        log.warning(
            "shared cache %s: this process (its owner) exits while other processes are "
            "still attached; on a GPU its memory is freed now and their reads become undefined",
            r.name,
        )


class SharedCache(HostCacheView):
    """One process's handle on a shared cache (see :func:`open_shared_cache`).

    It is the cache as :class:`triton_rec.cache.cached_table.CachedTable` uses it (numpy in
    and out: ``query(keys, out, hit_mask)``, ``insert``, ``update``, ``keys``, ``size``,
    ``stats``, ``capacity``, ``vec_size``), plus :meth:`attached` and :meth:`close`.

    Attributes:
        cache: the :class:`ArrayEmbeddingCache` (writes take the shared ``lock``).
        owner: True in the process that created the state.
        name, kind (``"cpu"`` or ``"cuda"``), files: what was published.
    """

    def __init__(
        self, cache, owner: bool, name: str, kind: str, lock: FileLock, files, keepalive=None
    ):
        super().__init__(cache)
        self.owner, self.name, self.kind, self.lock = owner, name, kind, lock
        self.files = list(files)
        self._keepalive = keepalive
        self._token = _self_token()
        self._closed = False

    def memory_use(self) -> Tuple[str, int]:
        """``(where, bytes)`` of the cache's state arrays: ``gpu<N>`` (device memory, one
        allocation each: :func:`allocation_bytes`) or ``shm`` (the numpy twin's file)."""
        arrays = self.cache.state_arrays()
        size = sum(allocation_bytes(a.shape, a.dtype) for a in arrays.values())
        if self.kind == "cuda":
            return f"gpu{int(arrays['meta'].device.id)}", size
        return "shm", size

    def attached(self) -> List[ProcessToken]:
        """The live processes attached to this cache, as (pid, start time), one entry per
        open (this one included until :meth:`close`)."""
        with self.lock:
            return self.lock.attached()

    def close(self, linger: Optional[float] = None) -> bool:
        """Detach (idempotent). Returns True once this process holds none of the
        cache's memory any more, False if it retains it.

        The owner also unpublishes the cache (removes its files, and the namespace
        directory if that left it empty) and frees the memory (on a GPU: drops its
        device arrays, freed with their last reference) only when nothing else is attached:
        it waits up to ``linger`` seconds (default :data:`OWNER_LINGER_S`) for other
        processes (not for this process's own other handles), then, if some handle
        remains, retains the memory (logged when another process holds it) until
        :func:`release_retained` finds them all gone."""
        if self._closed:
            return True
        self._closed = True
        with self.lock:
            others = self.lock.unregister(self._token)
            if self.owner:
                for p in self.files:
                    _LOCAL_DEVICE_STATES.pop(p, None)
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass
        if self.owner and self.files:
            remove_namespace_dir(os.path.dirname(self.files[0]))
        if self.owner and others:
            # Wait only for other processes. Handles of this process (other instances of
            # the model) close later on the same unload, perhaps after this one returns:
            # waiting for them held every GPU model's unload for the whole linger, past
            # tritonserver's exit timeout (seen on an H200: "Exit timeout expired", then a
            # segfault at exit). Their memory is retained below and freed by the last.
            deadline = time.monotonic() + (OWNER_LINGER_S if linger is None else linger)
            while _elsewhere(others) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                others = self.attached()
        if self.owner and others:
            if _elsewhere(others):
                log.warning(
                    "shared cache %s: closed by its owner while processes %s are still "
                    "attached; its memory is retained until they detach",
                    self.name,
                    sorted({pid for pid, _ in _elsewhere(others)}),
                )
            with _RETAINED_LOCK:
                _RETAINED.append(_Retained(self.name, self.lock, self._keepalive))
            self._keepalive = None
            return False
        if self._keepalive is not None and hasattr(self._keepalive, "close"):
            self._keepalive.close()
        self._keepalive = None
        self.lock.close()
        release_retained()
        return True

    def __enter__(self) -> SharedCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_shared_cache(
    name: str,
    capacity: int,
    vec_size: int,
    ways: int = 8,
    policy: str = CachePolicy.LRU,
    device: Union[str, int] = "cpu",
    directory: Optional[str] = None,
    namespace: Optional[str] = None,
    precision: str = DEFAULT_PRECISION,
) -> SharedCache:
    """Create the cache published as ``name``, or attach to it if it exists.

    ``device="cpu"``: numpy arrays in ``<dir>/<name>``; an int: cupy arrays on that
    CUDA device, IPC handles in ``<dir>/<name>.cudaipc.json``. Creation is serialized by
    the writer lock file ``<dir>/<name>.lock``, which every process then passes to its
    cache as the process-shared writer lock, and which holds the attachment table.

    With a ``namespace`` (the node store's token) ``<dir>`` is that store's private
    directory ``<shm_dir>/trec-ns-<namespace>`` (mode 0700). Every file is used only if
    private to our user (:mod:`triton_rec.cache.shm_security`).

    State whose owner is gone (pid + start time, see the module docstring) is removed
    and a fresh cache created. An attached cache must have the same geometry and policy
    (ConfigError otherwise).
    """
    if device != "cpu":
        _cupy()  # fail before leaving any file behind
    release_retained()
    if namespace is not None:
        dfd, directory = open_segment_dir(shm_dir(directory), namespace)
        os.close(dfd)
    while True:
        try:
            lock = FileLock(_path(name, directory, ".lock"))
        except BaseException:
            if namespace is not None:
                remove_namespace_dir(cast(str, directory))  # set by open_segment_dir above
            raise
        try:
            with lock:
                # False if the owner closed the cache between our open and our flock
                published = lock.is_published()
                if published:
                    if device == "cpu":
                        shared = _create_or_attach_cpu(
                            name, capacity, vec_size, ways, policy, directory, lock, precision
                        )
                    else:
                        with SETUP_LOCK:  # not while another thread captures a graph
                            shared = _create_or_attach_cuda(
                                name,
                                capacity,
                                vec_size,
                                ways,
                                policy,
                                int(device),
                                directory,
                                lock,
                                precision,
                            )
                    lock.register(shared._token, fresh=shared.owner)
        except BaseException:
            lock.close()
            if namespace is not None:
                remove_namespace_dir(cast(str, directory))  # if this left it empty
            raise
        if published:
            break
        lock.close()
    if not shared.owner:
        # A writer that died mid-write left its sets odd; drop their (maybe torn) data.
        # Takes the writer lock, so only after the creation lock above is released.
        shared.cache.repair()
    want = ArrayEmbeddingCache.state_layout(capacity, vec_size, ways, policy, precision)
    c = shared.cache
    got = {n: (tuple(a.shape), np.dtype(a.dtype)) for n, a in c.state_arrays().items()}
    if (
        got != {n: (tuple(s), np.dtype(d)) for n, (s, d) in want.items()}
        or c.policy != policy
        or c.codec.precision != precision
    ):
        shared.owner = False  # not ours to remove
        shared.close()
        raise ConfigError(
            f"shared cache {name!r} exists with another geometry/policy "
            f"({c.num_sets} sets x {c.ways} ways, vec_size {c.vec_size}, {c.policy}, "
            f"{c.codec.precision})"
        )
    return shared


def _create_or_attach_cpu(
    name, capacity, vec_size, ways, policy, directory, lock, precision=DEFAULT_PRECISION
) -> SharedCache:
    path = _path(name, directory)
    try:
        sa = attach_numpy_arrays(name, directory)
    except FileNotFoundError:
        sa = None
    if sa is not None and not sa.owner_alive():
        sa.close()
        os.unlink(path)  # its owner is gone (on a GPU: and the memory): start over
    elif sa is not None:
        cache = ArrayEmbeddingCache.from_arrays(sa.arrays, lock=lock)
        return SharedCache(cache, False, name, "cpu", lock, [], keepalive=sa)
    layout = ArrayEmbeddingCache.state_layout(capacity, vec_size, ways, policy, precision)
    sa = share_numpy_arrays(name, layout, directory)
    cache = ArrayEmbeddingCache(
        capacity, vec_size, ways, policy, xp=np, arrays=sa.arrays, lock=lock, precision=precision
    )
    sa.owner = False  # SharedCache removes the files
    return SharedCache(cache, True, name, "cpu", lock, [path, lock.path], keepalive=sa)


#: device state arrays this process created, by handles path: CUDA IPC handles cannot be
#: opened in the process that exported them, so a second open here reuses the arrays
_LOCAL_DEVICE_STATES: Dict[str, Dict[str, Any]] = {}


def _create_or_attach_cuda(
    name, capacity, vec_size, ways, policy, device, directory, lock, precision=DEFAULT_PRECISION
):
    cupy = _cupy()
    hpath = _path(name, directory, ".cudaipc.json")
    local = _LOCAL_DEVICE_STATES.get(hpath)
    if local is not None and os.path.exists(hpath):
        return SharedCache(
            ArrayEmbeddingCache.from_arrays(local, xp=cupy, lock=lock),
            False,
            name,
            "cuda",
            lock,
            [],
            keepalive=local,
        )
    try:
        handles = read_handles(hpath)
        arrays = import_arrays(handles)
        with cupy.cuda.Device(device):
            cache = ArrayEmbeddingCache.from_arrays(arrays, xp=cupy, lock=lock)
        return SharedCache(cache, False, name, "cuda", lock, [], keepalive=arrays)
    except FileNotFoundError:
        pass
    except StaleHandlesError:
        os.unlink(hpath)  # its owner is gone and so is the memory: start over
    layout = ArrayEmbeddingCache.state_layout(capacity, vec_size, ways, policy, precision)
    arrays = allocate_device_arrays(layout, device)
    with cupy.cuda.Device(device):
        cache = ArrayEmbeddingCache(
            capacity,
            vec_size,
            ways,
            policy,
            xp=cupy,
            arrays=arrays,
            lock=lock,
            precision=precision,
        )
    write_handles(hpath, export_arrays(arrays))
    _LOCAL_DEVICE_STATES[hpath] = arrays
    return SharedCache(cache, True, name, "cuda", lock, [hpath, lock.path], keepalive=arrays)
