"""The state of an :class:`~triton_rec.cache.array_cache.ArrayEmbeddingCache`: its arrays'
layout, the constants it shares with the kernels and their CPU twin, the hashes that place
a key, and the array module (numpy or CuPy) it runs on.

State (all arrays; names as in :meth:`ArrayEmbeddingCache.state_arrays`)::

    keys     int64   [num_sets, ways]            key held by each way
    valid    bool    [num_sets, ways]            way holds a key
    ticks    int64   [num_sets, ways]            clock value of the way's last access
    vectors  rows [num_sets, ways, W]            the cached rows, encoded in the cache's
                                                 precision (float32 W = vec_size for
                                                 fp32; RowCodec.row_width/row_dtype)
    seq      int64   [num_sets]                  per-set version: odd while being written
    sketch   uint8   [4, width]                  TinyLFU count-min sketch (4 rows;
                                                 policy ``tinylfu`` only)
    meta     int64   [16]                        clock, sketch increments, geometry, magic,
                                                 node-wide writer counters

``num_sets`` is ``ceil(capacity / ways)`` (any integer: the slot count is what was asked
for, rounded up to a whole set, never to a power of two); a key lives in set
``(splitmix64(key) * num_sets) >> 64`` (multiply-shift, "fastrange":
:meth:`ArrayEmbeddingCache.set_of`). As for the CPU cache (:mod:`triton_rec.cache.shm_cache`,
which does round ``num_sets`` up to a power of two), ``capacity`` afterwards means the real
slot count ``num_sets * ways`` (the requested figure is ``requested_capacity``). The sketch
(``tinylfu`` only: an ``lru`` cache has no ``sketch`` array) has
``max(64, next power of two >= 8 * capacity)`` counters per row.

Concurrency (several processes sharing the arrays):

- Readers (:meth:`ArrayEmbeddingCache.query`) take no lock. Each set has a sequence
  number (a seqlock): a reader reads the ``seq`` of each key's set, gathers keys and
  vectors, reads ``seq`` again; a key whose set's ``seq`` was odd or changed is retried
  once and then reported as a miss. A concurrent writer can therefore never make a
  reader return a torn or foreign vector; at worst the reader misses.
- Writers (insert, update, erase, clear) here are serialized by the ``lock`` passed at
  construction, held exclusively, and bump ``seq`` of every set they touch to odd before
  writing and to even after (on a GPU these are kernels on one stream, hence ordered; the
  stream is synchronized before the lock is released). The native miss writes (the write
  kernel and its CPU twin, ``array_cache_rules.hpp`` ``begin_write``) hold the lock
  *shared* instead and take each set by a compare-and-swap of its ``seq`` from even to
  odd, so they write beside each other; a set another writer holds past a short wait is
  written again under the lock held exclusively.
- Readers also write: ``ticks`` of hits and the TinyLFU sketch, without a lock. Racing
  readers may lose a tick or a sketch increment (both are approximate by nature), never
  cached data.
- A writer that dies mid-write leaves its sets odd: readers miss on them, and the next
  write touching such a set under the lock held exclusively (no live writer is then in
  any set) first invalidates all its ways (its data may be torn) and makes its ``seq``
  even again (:meth:`ArrayEmbeddingCache.repair` does it for all sets).
"""

from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.config.ps_json import CACHE_POLICIES, CachePolicy
from triton_rec.errors import ConfigError, CupyUnavailableError
from triton_rec.precision import DEFAULT_PRECISION, RowCodec

#: cache policies (triton_rec.config.ps_json.CachePolicy); meta[META_POLICY] holds the index in
#: this order
POLICIES = CACHE_POLICIES

# The layout constants the kernels and their CPU twin share (src/native/array_cache_rules.hpp,
# exported by _native): defined there once.
SKETCH_ROWS = int(_native.ARRAY_CACHE_SKETCH_ROWS)
SKETCH_MAX = int(_native.ARRAY_CACHE_SKETCH_MAX)  # uint8 counters saturate here
AGING_FACTOR = int(_native.ARRAY_CACHE_AGING_FACTOR)  # halve after AGING_FACTOR * capacity keys
SKETCH_WIDTH_FACTOR = int(_native.ARRAY_CACHE_SKETCH_WIDTH_FACTOR)  # counters per row: >= 8/slot

# meta[] slots
META = _native.ARRAY_CACHE_META
META_CLOCK = META["clock"]
META_INCS = META["incs"]
META_CAPACITY = META["capacity"]
META_POLICY = META["policy"]
META_WAYS = META["ways"]
META_VEC = META["vec"]
META_MAGIC = META["magic"]
META_RECOVERED = META["recovered_sets"]
META_PRECISION = META["precision"]  # RowCodec.code of the rows (0, fp32, in older caches)
META_LEN = int(_native.ARRAY_CACHE_META_LEN)
#: node-wide counters kept in meta (written under the writer lock, so exact)
WRITER_COUNTERS = {
    k: META[k]
    for k in (
        "inserts",
        "updates",
        "evictions",
        "rejected",
        "overflow",
        "erased",
        "recovered_sets",
        "sketch_agings",
    )
}
STATUS_HIT = _native.ARRAY_CACHE_STATUS.index("hit")
STATUS_TORN = _native.ARRAY_CACHE_STATUS.index("torn")
WRITE_MODES = tuple(_native.ARRAY_CACHE_WRITE_MODES)
MAGIC = 0x5452454341434845  # "TRECACHE"

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# per-row seeds of the sketch hashes (odd 64-bit constants; row r adds SKETCH_SEEDS[r])
SKETCH_SEEDS = tuple(int(v) for v in _native.ARRAY_CACHE_SKETCH_SEEDS)
I64_MIN = np.int64(np.iinfo(np.int64).min)
I64_MAX = np.int64(np.iinfo(np.int64).max)
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
#: most sets a cache may have: :func:`fastrange` is exact for ``n < 2**32``
MAX_SETS = (1 << 32) - 1


def resolve_xp(xp: Any = None):
    """The array module for ``xp``: ``None``/``"numpy"``/numpy -> numpy, ``"cupy"``/cupy -> cupy.

    CuPy is imported here and only here (and in :mod:`triton_rec.cache.gpu_share`), when asked for.

    Raises:
        CupyUnavailableError: ``"cupy"`` was asked for and CuPy cannot be imported or sees
            no CUDA device.
        ConfigError: anything else.
    """
    if xp is None or xp is np or xp == "numpy":
        return np
    name = xp if isinstance(xp, str) else getattr(xp, "__name__", None)
    if name != "cupy":
        raise ConfigError(f"array module must be 'numpy' or 'cupy', got {xp!r}")
    if not isinstance(xp, str):
        return xp
    try:
        cupy = importlib.import_module("cupy")
    except ImportError as e:
        raise CupyUnavailableError(
            "a GPU embedding cache needs CuPy (pip install cupy-cuda12x) and a CUDA device; "
            f"CuPy cannot be imported here ({e}). Use a CPU cache on this node."
        ) from e
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when there is no driver / device
        raise CupyUnavailableError(f"CuPy is installed but sees no CUDA device ({e})") from e
    if n < 1:
        raise CupyUnavailableError("CuPy is installed but sees no CUDA device")
    return cupy


def is_cupy(xp) -> bool:
    """Whether the array module ``xp`` is CuPy."""
    return getattr(xp, "__name__", "") == "cupy"


def xp_of(array):
    """numpy or cupy, whichever owns ``array`` (without importing cupy for numpy arrays)."""
    if isinstance(array, np.ndarray):
        return np
    mod = type(array).__module__.split(".")[0]
    if mod == "cupy":
        return importlib.import_module("cupy")
    raise ConfigError(f"state arrays must be numpy or cupy arrays, got {type(array)!r}")


def host_array(a) -> np.ndarray:
    """``a`` in host memory (a CuPy array copied back)."""
    return a.get() if type(a).__module__.split(".")[0] == "cupy" else np.asarray(a)


def splitmix64(keys, xp=np):
    """splitmix64 finalizer of int64 ``keys`` as uint64 (wrapping arithmetic, works in xp)."""
    z = keys.astype(np.int64, copy=False).view(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def fastrange(h, n: int):
    """``floor(h * n / 2**64)`` of uint64 ``h``: an index in ``[0, n)`` from the high bits of
    ``h`` for any ``1 <= n <= MAX_SETS`` (no power of two needed). Exact in uint64
    arithmetic (numpy and CuPy have no 128-bit product): with ``h = hi * 2**32 + lo``,
    it is ``(hi * n + (lo * n >> 32)) >> 32``, and neither term overflows for ``n < 2**32``."""
    m = np.uint64(n)
    return ((h >> _SHIFT32) * m + (((h & _LOW32) * m) >> _SHIFT32)) >> _SHIFT32


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def stable_argsort(xp, a, axis=-1):
    """``argsort`` keeping equal elements in order, on numpy and CuPy."""
    # numpy: ask for a stable sort; CuPy's sorts are always stable (radix) and older
    # releases reject the ``kind`` argument.
    if xp is np:
        return np.argsort(a, axis=axis, kind="stable")
    return xp.argsort(a, axis=axis)


def num_sets_for(capacity: int, ways: int) -> int:
    """Sets of a cache asked to hold ``capacity`` vectors: ``ceil(capacity / ways)``
    (the slots, ``num_sets * ways``, exceed ``capacity`` by less than one set).

    Raises:
        ConfigError: more than :data:`MAX_SETS` sets.
    """
    num_sets = max(1, -(-int(capacity) // int(ways)))
    if num_sets > MAX_SETS:
        raise ConfigError(f"cache of {capacity} vectors needs more than {MAX_SETS} sets")
    return num_sets


def state_layout(
    capacity: int,
    vec_size: int,
    ways: int = 8,
    policy: str = CachePolicy.LRU,
    precision: str = DEFAULT_PRECISION,
) -> Dict[str, Tuple[tuple, Any]]:
    """``name -> (shape, dtype)`` of the state arrays of such a cache (``sketch`` only
    for ``tinylfu``)."""
    num_sets = num_sets_for(capacity, ways)
    codec = RowCodec(precision, int(vec_size))
    layout = {
        "keys": ((num_sets, ways), np.dtype(np.int64)),
        "valid": ((num_sets, ways), np.dtype(np.bool_)),
        "ticks": ((num_sets, ways), np.dtype(np.int64)),
        "vectors": ((num_sets, ways, codec.row_width), codec.row_dtype),
        "seq": ((num_sets,), np.dtype(np.int64)),
        "meta": ((META_LEN,), np.dtype(np.int64)),
    }
    if policy == CachePolicy.TINYLFU:
        width = max(64, next_pow2(SKETCH_WIDTH_FACTOR * num_sets * int(ways)))
        layout["sketch"] = ((SKETCH_ROWS, width), np.dtype(np.uint8))
    return layout


def check_layout(arrays, layout) -> None:
    """ConfigError unless ``arrays`` have the shapes and dtypes of ``layout``, C-contiguous."""
    for name, (shape, dt) in layout.items():
        a = arrays.get(name)
        if a is None:
            raise ConfigError(f"state array {name!r} missing")
        if tuple(a.shape) != tuple(shape) or np.dtype(a.dtype) != dt:
            raise ConfigError(
                f"state array {name!r} is {a.dtype}{tuple(a.shape)}, expected {dt}{tuple(shape)}"
            )
        if not a.flags.c_contiguous:
            raise ConfigError(f"state array {name!r} must be C-contiguous")


def sketch_index(xp, k, width: int):
    """Flat TinyLFU sketch indices ``[M, 4]`` of int64 keys ``k`` in a sketch of ``width``
    counters per row; row r: ``r * width + (splitmix64(k + seed_r) & (width - 1))``."""
    u = k.view(np.uint64)
    mask = np.uint64(width - 1)
    cols = [
        (splitmix64((u + np.uint64(seed)).view(np.int64), xp) & mask).astype(np.int64) + r * width
        for r, seed in enumerate(SKETCH_SEEDS)
    ]
    return xp.stack(cols, axis=1)


def dedupe_last(xp, k):
    """Positions of the last occurrence of each distinct key of ``k``, in batch order."""
    order = stable_argsort(xp, k)
    ks = k[order]
    last = xp.ones(k.shape[0], dtype=np.bool_)
    last[:-1] = ks[:-1] != ks[1:]
    return xp.sort(order[last])
