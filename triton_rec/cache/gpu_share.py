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

Ownership and lifetime:

- GPU: the creating process **owns** the device memory. It must stay alive as long as
  any other process uses the cache: when it exits (or calls ``close``) the memory is
  freed, and what attached processes then read or write through their mappings is
  undefined (typically CUDA errors or garbage; nothing checks it for them). Attached
  processes should therefore be torn down together with the owner, which is what Triton
  does when it unloads a model. Handles published by a process that is gone are
  *stale*: :func:`read_handles` detects that (the file records the owner's pid) and
  :func:`open_shared_cache` then creates a fresh cache and publishes it instead.
  CUDA IPC needs all processes on the same node; a handle can be opened once per
  process, and not in the process that exported it.
- CPU: the data lives in the ``/dev/shm`` file, not in a process; it survives the
  creator. The creator (owner) unlinks the file on ``close``; mappings already open keep
  working, later processes would create a new cache.

.. warning::
   The CUDA IPC half of this module has **not run on GPU hardware**: the machines it was
   written on have no GPU and no CuPy. Only the numpy half is tested (tests/unit). CuPy
   is imported inside the GPU functions only.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import re
import secrets
import tempfile
import threading
from typing import Any, Callable, Dict, Optional, Tuple, Union, cast

import numpy as np

from triton_rec.cache.array_cache import (
    ArrayEmbeddingCache,
    CupyUnavailableError,
    HostCacheView,
    resolve_xp,
)
from triton_rec.cache.shm_security import open_private_file, open_segment_dir, remove_namespace_dir
from triton_rec.config.ps_json import CachePolicy
from triton_rec.errors import ConfigError, StaleHandlesError
from triton_rec.util.procfs import process_alive, start_time

__all__ = [
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


def shm_dir(directory: Optional[str] = None) -> str:
    """Where shared files go: ``directory``, else ``$TRITON_REC_SHM_DIR``, else ``/dev/shm``
    (the system temp directory where there is no /dev/shm)."""
    d = directory or os.environ.get("TRITON_REC_SHM_DIR")
    if d:
        return d
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


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

    The lock file is created if needed (mode 0600); an existing one is used only if it is
    private to our user (:mod:`triton_rec.cache.shm_security`). :meth:`unlink` removes it
    (owner's cleanup). A lock held by a process that dies is released by the kernel.
    """

    def __init__(self, path: str):
        self.path = path
        self._fd = open_private_file(path, os.O_RDWR | os.O_CREAT, "writer lock file")
        self._tlock = threading.Lock()

    def __enter__(self):
        self._tlock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._tlock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._tlock.release()

    def close(self) -> None:
        """Close the lock file's descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

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
        pid: the creator's pid (from the file).
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
    ):
        self.name, self.path, self._mm, self.arrays = name, path, mm, arrays
        self.owner, self.pid = owner, pid

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
    manifest = {"pid": os.getpid(), "arrays": specs}
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
    return SharedArrays(name, path, holder["mm"], holder["views"], owner=True, pid=os.getpid())


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
    return SharedArrays(name, path, mm, _views(mm, manifest), owner=False, pid=int(manifest["pid"]))


# ============================================================ GPU: CUDA IPC through CuPy
def _cupy():
    return resolve_xp("cupy")  # raises CupyUnavailableError with a clear message


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
            nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            mem = cupy.cuda.memory.Memory(max(nbytes, 1))
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
    pid = os.getpid()
    doc = json.dumps(
        {"format": HANDLES_FORMAT, "pid": pid, "starttime": start_time(pid), "arrays": handles}
    ).encode()
    _publish_file(path, lambda fd: os.write(fd, doc), exclusive=exclusive)


def read_handles(path: str, check_owner: bool = True) -> Dict[str, Dict[str, Any]]:
    """The handles published at ``path``.

    Raises:
        FileNotFoundError: nothing published there.
        StaleHandlesError: ``check_owner`` and the publishing process is gone (its device
            memory is freed: the handles must not be opened): exited, a zombie, or its
            pid now belongs to another process (:func:`triton_rec.util.procfs.process_alive`).
        ConfigError: not a handles file.
        SharedMemorySecurityError: the file is not private to our user (never read).
    """
    with os.fdopen(open_private_file(path, os.O_RDONLY, "CUDA IPC handles file"), "rb") as f:
        doc = json.loads(f.read().decode())
    if not isinstance(doc, dict) or doc.get("format") != HANDLES_FORMAT:
        raise ConfigError(f"{path}: not a triton-rec CUDA IPC handles file")
    if check_owner and not process_alive(int(doc["pid"]), int(doc.get("starttime") or 0)):
        raise StaleHandlesError(f"{path}: published by pid {doc['pid']}, which has exited")
    return doc["arrays"]


# ============================================================ one shared cache, create or attach
class SharedCache(HostCacheView):
    """One process's handle on a shared cache (see :func:`open_shared_cache`).

    It is the cache as :class:`triton_rec.cache.cached_table.CachedTable` uses it (numpy in
    and out: ``query(keys, out, hit_mask)``, ``insert``, ``update``, ``keys``, ``size``,
    ``stats``, ``capacity``, ``vec_size``), plus :meth:`close`.

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

    def close(self) -> None:
        """Detach. The owner also removes the published files (and, on a GPU, frees the
        memory once the cache object is gone: other processes must be done by then), and
        the namespace directory if that left it empty."""
        if self._keepalive is not None and hasattr(self._keepalive, "close"):
            self._keepalive.close()
        self._keepalive = None
        self.lock.close()
        if self.owner:
            for p in self.files:
                _LOCAL_DEVICE_STATES.pop(p, None)
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            if self.files:
                remove_namespace_dir(os.path.dirname(self.files[0]))

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
) -> SharedCache:
    """Create the cache published as ``name``, or attach to it if it exists.

    ``device="cpu"``: numpy arrays in ``<dir>/<name>``; an int: cupy arrays on that
    CUDA device, IPC handles in ``<dir>/<name>.cudaipc.json``. Creation is serialized by
    the writer lock file ``<dir>/<name>.lock``, which every process then passes to its
    cache as the process-shared writer lock.

    With a ``namespace`` (the node store's token) ``<dir>`` is that store's private
    directory ``<shm_dir>/trec-ns-<namespace>`` (mode 0700). Every file is used only if
    private to our user (:mod:`triton_rec.cache.shm_security`).

    An attached cache must have the same geometry and policy (ConfigError otherwise).
    """
    if device != "cpu":
        _cupy()  # fail before leaving any file behind
    if namespace is not None:
        dfd, directory = open_segment_dir(shm_dir(directory), namespace)
        os.close(dfd)
    try:
        lock = FileLock(_path(name, directory, ".lock"))
    except BaseException:
        if namespace is not None:
            remove_namespace_dir(cast(str, directory))  # set by open_segment_dir above
        raise
    try:
        with lock:
            if device == "cpu":
                shared = _create_or_attach_cpu(
                    name, capacity, vec_size, ways, policy, directory, lock
                )
            else:
                shared = _create_or_attach_cuda(
                    name, capacity, vec_size, ways, policy, int(device), directory, lock
                )
    except BaseException:
        lock.close()
        if namespace is not None:
            remove_namespace_dir(cast(str, directory))  # if this left it empty
        raise
    if not shared.owner:
        # A writer that died mid-write left its sets odd; drop their (maybe torn) data.
        # Takes the writer lock, so only after the creation lock above is released.
        shared.cache.repair()
    want = ArrayEmbeddingCache.state_layout(capacity, vec_size, ways, policy)
    c = shared.cache
    got = {n: (tuple(a.shape), np.dtype(a.dtype)) for n, a in c.state_arrays().items()}
    if got != {n: (tuple(s), np.dtype(d)) for n, (s, d) in want.items()} or c.policy != policy:
        shared.owner = False  # not ours to remove
        shared.close()
        raise ConfigError(
            f"shared cache {name!r} exists with another geometry/policy "
            f"({c.num_sets} sets x {c.ways} ways, vec_size {c.vec_size}, {c.policy})"
        )
    return shared


def _create_or_attach_cpu(name, capacity, vec_size, ways, policy, directory, lock) -> SharedCache:
    path = _path(name, directory)
    try:
        sa = attach_numpy_arrays(name, directory)
        cache = ArrayEmbeddingCache.from_arrays(sa.arrays, lock=lock)
        return SharedCache(cache, False, name, "cpu", lock, [], keepalive=sa)
    except FileNotFoundError:
        pass
    layout = ArrayEmbeddingCache.state_layout(capacity, vec_size, ways, policy)
    sa = share_numpy_arrays(name, layout, directory)
    cache = ArrayEmbeddingCache(
        capacity, vec_size, ways, policy, xp=np, arrays=sa.arrays, lock=lock
    )
    sa.owner = False  # SharedCache removes the files
    return SharedCache(cache, True, name, "cpu", lock, [path, lock.path], keepalive=sa)


#: device state arrays this process created, by handles path: CUDA IPC handles cannot be
#: opened in the process that exported them, so a second open here reuses the arrays
_LOCAL_DEVICE_STATES: Dict[str, Dict[str, Any]] = {}


def _create_or_attach_cuda(name, capacity, vec_size, ways, policy, device, directory, lock):
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
        )
    try:
        handles = read_handles(hpath)
        arrays = import_arrays(handles)
        with cupy.cuda.Device(device):
            cache = ArrayEmbeddingCache.from_arrays(arrays, xp=cupy, lock=lock)
        return SharedCache(cache, False, name, "cuda", lock, [])
    except FileNotFoundError:
        pass
    except StaleHandlesError:
        os.unlink(hpath)  # its owner is gone and so is the memory: start over
    layout = ArrayEmbeddingCache.state_layout(capacity, vec_size, ways, policy)
    arrays = allocate_device_arrays(layout, device)
    with cupy.cuda.Device(device):
        cache = ArrayEmbeddingCache(
            capacity, vec_size, ways, policy, xp=cupy, arrays=arrays, lock=lock
        )
    write_handles(hpath, export_arrays(arrays))
    _LOCAL_DEVICE_STATES[hpath] = arrays
    return SharedCache(cache, True, name, "cuda", lock, [hpath, lock.path])
