"""The GPU half of sharing a cache's state arrays (:mod:`triton_rec.cache.gpu_share`): each
array its own ``cudaMalloc``, exported as CUDA IPC handles, published as a small JSON file,
imported in another process as ``cupy.ndarray`` views of the same device memory. CuPy is
imported inside these functions only."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np

from triton_rec.cache.array_cache import ArrayEmbeddingCache, resolve_xp
from triton_rec.cache.shared_files import HANDLES_FORMAT, publish_file, self_token, token_alive
from triton_rec.cache.shm_security import open_private_file
from triton_rec.config.ps_json import CachePolicy
from triton_rec.errors import ConfigError, StaleHandlesError
from triton_rec.precision import DEFAULT_PRECISION

log = logging.getLogger("triton_rec.cache.gpu_share")  # the shared caches' log


def import_cupy():
    """CuPy, imported here (CupyUnavailableError saying why it cannot be)."""
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
    cupy = import_cupy()
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
    cupy = import_cupy()
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
    cupy = import_cupy()
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
    pid, starttime = self_token()
    doc = json.dumps(
        {"format": HANDLES_FORMAT, "pid": pid, "starttime": starttime, "arrays": handles}
    ).encode()
    publish_file(path, lambda fd: os.write(fd, doc), exclusive=exclusive)


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
    if check_owner and not token_alive(int(doc["pid"]), int(doc.get("starttime") or 0)):
        raise StaleHandlesError(
            f"{path}: published by pid {doc['pid']} (start time {doc.get('starttime')}), "
            "which is no longer running"
        )
    return doc["arrays"]


# ============================================================ one shared cache, create or attach
