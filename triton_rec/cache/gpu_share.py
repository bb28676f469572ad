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

Its parts: :mod:`triton_rec.cache.shared_files` (names, publishing, the writer lock and its
attachment table, the numpy arrays in ``/dev/shm``), :mod:`triton_rec.cache.cuda_ipc` (the
device arrays and their handles); here the shared cache and its life cycle. Their public
names are importable from here.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import numpy as np

from triton_rec.cache.array_cache import ArrayEmbeddingCache, CupyUnavailableError, HostCacheView
from triton_rec.cache.cuda_ipc import (
    allocate_device_arrays,
    allocation_bytes,
    device_cache_bytes,
    export_arrays,
    import_arrays,
    import_cupy,
    read_handles,
    write_handles,
)
from triton_rec.cache.shared_files import (
    FILE_PREFIX,
    HANDLES_FORMAT,
    SHM_MAGIC,
    FileLock,
    ProcessToken,
    SharedArrays,
    attach_numpy_arrays,
    elsewhere,
    path_of,
    self_token,
    share_numpy_arrays,
    shared_path,
)
from triton_rec.cache.shm_cache import shm_dir
from triton_rec.cache.shm_security import open_segment_dir, remove_namespace_dir
from triton_rec.config.ps_json import CachePolicy
from triton_rec.errors import ConfigError, StaleHandlesError
from triton_rec.gpu import SETUP_LOCK
from triton_rec.precision import DEFAULT_PRECISION

log = logging.getLogger(__name__)

__all__ = [
    "FILE_PREFIX",
    "HANDLES_FORMAT",
    "OWNER_LINGER_S",
    "SHM_MAGIC",
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

#: seconds the owner's ``close`` waits for the other attached processes to detach before
#: it retains the memory instead of freeing it (Triton finalizes a model's instances
#: together: the others normally detach within this time)
OWNER_LINGER_S = 10.0
_POLL_S = 0.05


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
        self._token = self_token()
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
            while elsewhere(others) and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                others = self.attached()
        if self.owner and others:
            if elsewhere(others):
                log.warning(
                    "shared cache %s: closed by its owner while processes %s are still "
                    "attached; its memory is retained until they detach",
                    self.name,
                    sorted({pid for pid, _ in elsewhere(others)}),
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
        import_cupy()  # fail before leaving any file behind
    release_retained()
    if namespace is not None:
        dfd, directory = open_segment_dir(shm_dir(directory), namespace)
        os.close(dfd)
    while True:
        try:
            lock = FileLock(path_of(name, directory, ".lock"))
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
    path = path_of(name, directory)
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
    cupy = import_cupy()
    hpath = path_of(name, directory, ".cudaipc.json")
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
