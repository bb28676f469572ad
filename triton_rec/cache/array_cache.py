"""Set-associative embedding cache written once over the numpy/CuPy array API.

This is the **device** embedding cache: one cache per (model, device, table), its whole
state a handful of plain arrays so that it can live in GPU memory and be shared by every
model-instance process on that GPU through CUDA IPC (:mod:`triton_rec.cache.gpu_share`). The
algorithm only uses array operations that numpy and CuPy both provide, with ``xp`` the
array module, so the CPU test suite runs exactly the algorithm the GPU runs, with numpy.

With numpy this class *is* the algorithm, run as written: the reference. With CuPy the
same state lives in device memory and every query and write runs as a CUDA kernel
(``src/native/kernels/cache_kernels.cu`` through ``_native.DeviceCache``), whose rules are
C++ that the CPU twin also runs; both are held bit for bit to this reference
(tests/unit/test_gpu_kernels.py on the CPU, tests/gpu on a GPU, where they passed on an
H200). CuPy is an optional dependency, imported only when a device cache is requested
(``xp="cupy"``).

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

Policies: ``lru`` (HPS): a new key takes a free way of its set, else evicts the least
recently used way. ``tinylfu``: the same eviction, plus TinyLFU admission: every looked-up
key is counted in a count-min sketch (saturating 8-bit counters, all halved every
``10 * capacity`` counted keys); a new key that would evict a valid way is admitted only
if its estimated frequency is strictly greater than the victim's. Free ways always admit.

Concurrency (several processes sharing the arrays):

- Readers (:meth:`~ArrayEmbeddingCache.query`) take no lock. Each set has a sequence
  number (a seqlock): a reader reads the ``seq`` of each key's set, gathers keys and
  vectors, reads ``seq`` again; a key whose set's ``seq`` was odd or changed is retried
  once and then reported as a miss. A concurrent writer can therefore never make a
  reader return a torn or foreign vector; at worst the reader misses.
- Writers (insert, update, erase, clear) are serialized by the ``lock`` passed at
  construction and bump ``seq`` of every set they touch to odd before writing and to
  even after (on a GPU these are kernels on one stream, hence ordered; the stream is
  synchronized before the lock is released).
- Readers also write: ``ticks`` of hits and the TinyLFU sketch, without a lock. Racing
  readers may lose a tick or a sketch increment (both are approximate by nature), never
  cached data.
- A writer that dies mid-write leaves its sets odd: readers miss on them, and the next
  write touching such a set first invalidates all its ways (its data may be torn) and
  makes its ``seq`` even again (:meth:`~ArrayEmbeddingCache.repair` does it for all sets).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.config.ps_json import CACHE_POLICIES, CachePolicy
from triton_rec.errors import ConfigError, CupyUnavailableError
from triton_rec.precision import DEFAULT_PRECISION, RowCodec

__all__ = [
    "ArrayEmbeddingCache",
    "CupyUnavailableError",
    "HostCacheView",
    "POLICIES",
    "resolve_xp",
    "splitmix64",
]

#: cache policies (triton_rec.config.ps_json.CachePolicy); meta[_POLICY] holds the index in
#: this order
POLICIES = CACHE_POLICIES

# The layout constants the kernels and their CPU twin share (src/native/array_cache_rules.hpp,
# exported by _native): defined there once.
SKETCH_ROWS = int(_native.ARRAY_CACHE_SKETCH_ROWS)
SKETCH_MAX = int(_native.ARRAY_CACHE_SKETCH_MAX)  # uint8 counters saturate here
AGING_FACTOR = int(_native.ARRAY_CACHE_AGING_FACTOR)  # halve after AGING_FACTOR * capacity keys
SKETCH_WIDTH_FACTOR = int(_native.ARRAY_CACHE_SKETCH_WIDTH_FACTOR)  # counters per row: >= 8/slot

# meta[] slots
_META = _native.ARRAY_CACHE_META
_CLOCK = _META["clock"]
_INCS = _META["incs"]
_CAPACITY = _META["capacity"]
_POLICY = _META["policy"]
_WAYS = _META["ways"]
_VEC = _META["vec"]
_MAGIC = _META["magic"]
_RECOVERED = _META["recovered_sets"]
_PRECISION = _META["precision"]  # RowCodec.code of the rows (0, fp32, in older caches)
META_LEN = int(_native.ARRAY_CACHE_META_LEN)
#: node-wide counters kept in meta (written under the writer lock, so exact)
_WRITER_COUNTERS = {
    k: _META[k]
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
_STATUS_HIT = _native.ARRAY_CACHE_STATUS.index("hit")
_STATUS_TORN = _native.ARRAY_CACHE_STATUS.index("torn")
_WRITE_MODES = tuple(_native.ARRAY_CACHE_WRITE_MODES)
MAGIC = 0x5452454341434845  # "TRECACHE"

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# per-row seeds of the sketch hashes (odd 64-bit constants; row r adds _SEEDS[r])
_SEEDS = tuple(int(v) for v in _native.ARRAY_CACHE_SKETCH_SEEDS)
_I64_MIN = np.int64(np.iinfo(np.int64).min)
_I64_MAX = np.int64(np.iinfo(np.int64).max)
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


def _is_cupy(xp) -> bool:
    return getattr(xp, "__name__", "") == "cupy"


def _xp_of(array):
    """numpy or cupy, whichever owns ``array`` (without importing cupy for numpy arrays)."""
    if isinstance(array, np.ndarray):
        return np
    mod = type(array).__module__.split(".")[0]
    if mod == "cupy":
        return importlib.import_module("cupy")
    raise ConfigError(f"state arrays must be numpy or cupy arrays, got {type(array)!r}")


def _host(a) -> np.ndarray:
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


def _on_device(method):
    """Run a method with the cache's device current (CuPy); no-op for numpy."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._device_id is None:
            return method(self, *args, **kwargs)
        with self.xp.cuda.Device(self._device_id):
            return method(self, *args, **kwargs)

    return wrapper


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _stable_argsort(xp, a, axis=-1):
    # numpy: ask for a stable sort; CuPy's sorts are always stable (radix) and older
    # releases reject the ``kind`` argument.
    if xp is np:
        return np.argsort(a, axis=axis, kind="stable")
    return xp.argsort(a, axis=axis)


class ArrayEmbeddingCache:
    """Set-associative embedding cache over xp arrays (see the module docstring).

    Args:
        capacity: vectors the cache should hold; the real slot count is
            ``num_sets * ways`` with ``num_sets = ceil(capacity / ways)``: at least
            ``capacity``, less than ``capacity + ways``.
        vec_size: floats per vector.
        ways: ways per set.
        precision: how the rows are held (:mod:`triton_rec.precision`; kept in
            ``meta``): :meth:`insert`/:meth:`update` take rows in it (or float32 vectors,
            encoded once), :meth:`query` decodes with the same xp operations on numpy
            and CuPy.
        policy: ``"lru"`` or ``"tinylfu"``.
        xp: numpy (default), cupy, or their names. ``"cupy"`` imports CuPy (and raises
            :class:`CupyUnavailableError` without it); device arrays are allocated on
            CuPy's current device (``with cupy.cuda.Device(i): ...``).
        arrays: storage allocated elsewhere (shared memory, IPC-exportable device memory)
            with the shapes/dtypes of :meth:`state_layout`. They are zeroed and initialized:
            this is the *creating* side; other processes attach with :meth:`from_arrays`.
        lock: context manager serializing writers. Default: a ``_native.WriterLock(-1)``,
            which serializes the threads of this process only (its native writers too).
            **With several processes sharing the arrays, pass a process-shared lock**
            (e.g. :class:`triton_rec.cache.gpu_share.FileLock`).

    Attributes:
        capacity: slots, ``num_sets * ways`` (>= the requested capacity, by less than one set).
        requested_capacity, num_sets, ways, vec_size, policy, xp, lock.

    Thread-safety: any number of threads may :meth:`query` while one writes; writes are
    serialized by ``lock``. See :meth:`stats` for which counters are node-wide.
    """

    def __init__(
        self,
        capacity: int,
        vec_size: int,
        ways: int = 8,
        policy: str = CachePolicy.LRU,
        xp: Any = np,
        arrays: Optional[Dict[str, Any]] = None,
        lock: Any = None,
        precision: str = DEFAULT_PRECISION,
    ):
        capacity, vec_size, ways = int(capacity), int(vec_size), int(ways)
        if capacity < 1 or vec_size < 1 or ways < 1:
            raise ConfigError(
                "cache capacity, vec_size and ways must be >= 1, "
                f"got {capacity}, {vec_size}, {ways}"
            )
        if policy not in POLICIES:
            raise ConfigError(f"cache policy must be one of {list(POLICIES)}, got {policy!r}")
        self.xp = resolve_xp(xp)
        codec = RowCodec(precision, vec_size)
        layout = self.state_layout(capacity, vec_size, ways, policy, precision)
        if arrays is None:
            arrays = {n: self.xp.zeros(shape, dtype=dt) for n, (shape, dt) in layout.items()}
        else:
            self._check_layout(arrays, layout)
            for a in arrays.values():
                a[...] = 0
        meta = arrays["meta"]
        meta[_CAPACITY] = capacity
        meta[_POLICY] = POLICIES.index(policy)
        meta[_WAYS] = ways
        meta[_VEC] = vec_size
        meta[_PRECISION] = codec.code
        meta[_MAGIC] = MAGIC
        self._attach(arrays, lock)

    # ----------------------------------------------------------------- construction
    @staticmethod
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

    @staticmethod
    def state_layout(
        capacity: int,
        vec_size: int,
        ways: int = 8,
        policy: str = CachePolicy.LRU,
        precision: str = DEFAULT_PRECISION,
    ) -> Dict[str, Tuple[tuple, Any]]:
        """``name -> (shape, dtype)`` of the state arrays of such a cache (``sketch`` only
        for ``tinylfu``)."""
        num_sets = ArrayEmbeddingCache.num_sets_for(capacity, ways)
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
            width = max(64, _next_pow2(SKETCH_WIDTH_FACTOR * num_sets * int(ways)))
            layout["sketch"] = ((SKETCH_ROWS, width), np.dtype(np.uint8))
        return layout

    @classmethod
    def from_arrays(
        cls, arrays: Dict[str, Any], xp: Any = None, lock: Any = None
    ) -> ArrayEmbeddingCache:
        """Attach to the (already initialized) state arrays of a cache created elsewhere.

        Geometry and policy are read from the arrays. ``xp`` defaults to the module that
        owns the arrays. Nothing is written.
        """
        meta = arrays.get("meta")
        if meta is None:
            raise ConfigError("state arrays lack 'meta'")
        xp = resolve_xp(xp) if xp is not None else _xp_of(meta)
        m = [int(v) for v in (meta.get() if _is_cupy(xp) else meta)]
        if m[_MAGIC] != MAGIC:
            raise ConfigError("state arrays are not an initialized embedding cache (bad magic)")
        if not 0 <= m[_POLICY] < len(POLICIES):
            raise ConfigError(f"state arrays carry an unknown policy code {m[_POLICY]}")
        self = cls.__new__(cls)
        self.xp = xp
        policy = POLICIES[m[_POLICY]]
        try:
            precision = RowCodec.from_code(m[_PRECISION], max(1, m[_VEC])).precision
        except ValueError as e:
            raise ConfigError(f"state arrays: {e}") from None
        cls._check_layout(
            arrays, cls.state_layout(m[_CAPACITY], m[_VEC], m[_WAYS], policy, precision)
        )
        self._attach(arrays, lock)
        return self

    @staticmethod
    def _check_layout(arrays, layout) -> None:
        for name, (shape, dt) in layout.items():
            a = arrays.get(name)
            if a is None:
                raise ConfigError(f"state array {name!r} missing")
            if tuple(a.shape) != tuple(shape) or np.dtype(a.dtype) != dt:
                raise ConfigError(
                    f"state array {name!r} is {a.dtype}{tuple(a.shape)}, "
                    f"expected {dt}{tuple(shape)}"
                )
            if not a.flags.c_contiguous:
                raise ConfigError(f"state array {name!r} must be C-contiguous")

    def _attach(self, arrays, lock) -> None:
        self._arrays = dict(arrays)
        self.slot_keys = arrays["keys"]
        self.valid = arrays["valid"]
        self.ticks = arrays["ticks"]
        self.vectors = arrays["vectors"]
        self.seq = arrays["seq"]
        self.sketch = arrays.get("sketch")  # None for lru
        self.meta = arrays["meta"]
        m = self.meta.get() if _is_cupy(self.xp) else self.meta
        self.requested_capacity = int(m[_CAPACITY])
        self.policy = POLICIES[int(m[_POLICY])]
        self.num_sets, self.ways = (int(v) for v in self.slot_keys.shape)
        self.capacity = self.num_sets * self.ways
        self.vec_size = int(m[_VEC])
        self.codec = RowCodec.from_code(int(m[_PRECISION]), self.vec_size)
        self.sketch_width = int(self.sketch.shape[1]) if self.sketch is not None else 0
        # the writer lock; by default one for this process's threads, which native writers
        # (miss_cache) take too
        self.lock = lock if lock is not None else _native.WriterLock(-1)
        # CuPy: the device holding the arrays, made current around every operation
        self._device_id = int(self.meta.device.id) if _is_cupy(self.xp) else None
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(("lookups", "hits", "misses", "torn"), 0)  # this process
        # Test hook: called as hook(cache, sets) between the gather and the second read of
        # ``seq`` in a query (simulates a writer running concurrently with the reader).
        self._between_reads = None
        # CuPy: the kernels (src/native/kernels/cache_kernels.cu) do every query and write;
        # the array code of this class is their reference, run with numpy.
        self._gpu: Any = None
        if self._device_id is not None:
            from triton_rec.gpu.kernels import load_kernels

            self._gpu = _native.DeviceCache(load_kernels(self._device_id), self.native_view())

    def state_arrays(self) -> Dict[str, Any]:
        """The live state arrays, ``name -> array`` (to share them: IPC, shared memory)."""
        return dict(self._arrays)

    @property
    def slots(self) -> int:
        """Vectors the cache can hold (``num_sets * ways``)."""
        return self.num_sets * self.ways

    def addresses(self) -> Dict[str, int]:
        """The address of each state array (host memory for numpy, device memory for CuPy)."""
        if _is_cupy(self.xp):
            return {n: int(a.data.ptr) for n, a in self._arrays.items()}
        return {n: int(a.ctypes.data) for n, a in self._arrays.items()}

    def native_view(self):
        """The state as the kernels and their CPU twin read it (``_native.CacheView``;
        valid while this cache's arrays live)."""
        plan = self.native_plan()
        del plan["device"]
        return _native.CacheView(**plan)

    def native_plan(self) -> Dict[str, Any]:
        """What the native backend's GPU path reads this cache with: the state arrays'
        addresses (``arrays``) and the geometry, as :class:`_native.CacheView` takes them,
        and the ``device`` (None for numpy)."""
        return {
            "arrays": self.addresses(),
            "num_sets": self.num_sets,
            "ways": self.ways,
            "dim": self.vec_size,
            "precision": self.codec.code,
            "policy": POLICIES.index(self.policy),
            "sketch_width": self.sketch_width,
            "device": self._device_id,
        }

    # ----------------------------------------------------------------- helpers
    def _keys(self, keys):
        k = self.xp.asarray(keys)
        if k.ndim != 1:
            k = k.reshape(-1)
        if k.dtype != np.int64:
            if k.dtype.kind not in "iu" and k.size:
                raise ValueError(f"keys must be integers, got {k.dtype}")
            k = k.astype(np.int64)
        return k

    def _vectors(self, vectors, n):
        v = self.codec.as_rows(self.xp.asarray(vectors), "vectors")
        if v.shape[0] != n:
            raise ValueError(f"vectors must hold {n} rows, got {tuple(v.shape)}")
        return v

    @_on_device
    def set_of(self, keys):
        """Set index (int64) of each key: ``(splitmix64(key) * num_sets) >> 64``
        (:func:`fastrange`)."""
        return fastrange(splitmix64(self._keys(keys), self.xp), self.num_sets).astype(np.int64)

    def _sketch_index(self, k):
        """Flat sketch indices ``[M, 4]``; row r:
        ``r * width + (splitmix64(k + seed_r) & (width - 1))``."""
        xp = self.xp
        u = k.view(np.uint64)
        mask = np.uint64(self.sketch_width - 1)
        cols = [
            (splitmix64((u + np.uint64(seed)).view(np.int64), xp) & mask).astype(np.int64)
            + r * self.sketch_width
            for r, seed in enumerate(_SEEDS)
        ]
        return xp.stack(cols, axis=1)

    @_on_device
    def estimate(self, keys):
        """TinyLFU frequency estimate of each key (min over the sketch rows), int64.

        Raises:
            ConfigError: the cache's policy is not ``tinylfu`` (it has no sketch).
        """
        if self.sketch is None:
            raise ConfigError(f"a {self.policy} cache keeps no frequency sketch")
        k = self._keys(keys)
        flat = self.sketch.reshape(-1)
        return flat[self._sketch_index(k)].min(axis=1).astype(np.int64)

    def _sketch_add(self, k) -> None:
        xp = self.xp
        idx, counts = xp.unique(self._sketch_index(k).reshape(-1), return_counts=True)
        flat = self.sketch.reshape(-1)  # a view: the state arrays are C-contiguous
        flat[idx] = xp.minimum(flat[idx].astype(np.int64) + counts, SKETCH_MAX).astype(np.uint8)
        self.meta[_INCS] += int(k.shape[0])
        if int(self.meta[_INCS]) >= AGING_FACTOR * self.capacity:
            self.sketch >>= 1
            self.meta[_INCS] = 0
            self.meta[_WRITER_COUNTERS["sketch_agings"]] += 1

    def _tick(self):
        """Advance the shared clock; returns its new value as a 1-element xp array."""
        self.meta[_CLOCK] += 1
        return self.meta[_CLOCK : _CLOCK + 1].copy()

    def _sync(self) -> None:
        if _is_cupy(self.xp):  # writes must be done on the device before the lock is released
            self.xp.cuda.get_current_stream().synchronize()

    def _count(self, **deltas) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += int(v)

    def _count_writes(self, **deltas) -> None:
        """Add to the node-wide writer counters (caller holds the writer lock)."""
        for k, v in deltas.items():
            if v:
                self.meta[_WRITER_COUNTERS[k]] += int(v)

    def _begin_write(self, sets) -> None:
        """Under the lock: heal sets a dead writer left odd, then make ``sets`` odd.

        ``sets`` must be unique (``_end_write`` adds 1 to each entry)."""
        odd = (self.seq[sets] & 1).astype(np.bool_)
        self.valid[sets] &= ~odd[:, None]  # their data may be torn: drop it
        self.meta[_RECOVERED : _RECOVERED + 1] += odd.sum()
        self.seq[sets] |= 1

    def _end_write(self, sets) -> None:
        self.seq[sets] += 1
        self._sync()

    def _find(self, k, s):
        """(found, way) of each key in its set (no validation; writers hold the lock)."""
        match = self.valid[s] & (self.slot_keys[s] == k[:, None])
        return match.any(axis=1), match.argmax(axis=1)

    def _dedupe_last(self, k):
        """Positions of the last occurrence of each distinct key, in batch order."""
        xp = self.xp
        order = _stable_argsort(xp, k)
        ks = k[order]
        last = xp.ones(k.shape[0], dtype=np.bool_)
        last[:-1] = ks[:-1] != ks[1:]
        return xp.sort(order[last])

    # ----------------------------------------------------------------- reads
    def _read(self, k, s):
        seq0 = self.seq[s]  # fancy indexing copies: this is the "before" read
        found, way = self._find(k, s)
        vec = self.vectors[s, way]
        if self._between_reads is not None:
            self._between_reads(self, s)
        seq1 = self.seq[s]
        ok = (seq0 == seq1) & ((seq0 & 1) == 0)
        return found & ok, way, vec, ok

    @_on_device
    def query(self, keys):
        """Look ``keys`` up. Returns ``(out, hit_mask)``: float32 ``[M, D]`` (zeros for
        misses) and bool ``[M]``, both xp arrays. Lock-free, validated against writers."""
        xp = self.xp
        k = self._keys(keys)
        m = int(k.shape[0])
        if m == 0:
            return xp.zeros((0, self.vec_size), dtype=np.float32), xp.zeros(0, dtype=np.bool_)
        if self._gpu is not None:
            return self._query_kernel(xp.ascontiguousarray(k), m)
        s = self.set_of(k)
        hit, way, vec, ok = self._read(k, s)
        torn = 0
        retry = xp.flatnonzero(~ok)
        if retry.shape[0]:
            h2, w2, v2, ok2 = self._read(k[retry], s[retry])
            hit[retry], way[retry], vec[retry] = h2, w2, v2
            torn = int((~ok2).sum())
        if self.codec.precision != DEFAULT_PRECISION:
            vec = self.codec.decode(vec)  # the same xp operations on numpy and CuPy
        out = xp.where(hit[:, None], vec, np.float32(0))
        clk = self._tick()
        self.ticks[s[hit], way[hit]] = clk
        if self.policy == CachePolicy.TINYLFU:
            self._sketch_add(k)
        hits = int(hit.sum())
        self._count(lookups=m, hits=hits, misses=m - hits, torn=torn)
        return out, hit

    def _query_kernel(self, k, m: int):
        xp = self.xp
        out = xp.empty((m, self.vec_size), dtype=np.float32)
        status = xp.empty(m, dtype=np.uint8)
        xp.cuda.get_current_stream().synchronize()  # the keys may still be in flight
        self._gpu.query_device(k.data.ptr, m, out.data.ptr, status.data.ptr)
        hit = status == _STATUS_HIT
        hits = int(hit.sum())
        torn = int((status == _STATUS_TORN).sum())
        self._count(lookups=m, hits=hits, misses=m - hits, torn=torn)
        return out, hit

    def query_host(self, keys: np.ndarray, out: np.ndarray, status: np.ndarray) -> int:
        """Look host ``keys`` up into host memory: ``out`` float32 ``[M, D]`` (zeros for a
        miss), ``status`` uint8 ``[M]`` (1 hit, 0 miss); returns the hits. With CuPy one
        kernel launch (keys in and answers out through pinned staging); with numpy the
        reference :meth:`query`."""
        k = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
        m = int(k.shape[0])
        if self._gpu is None:
            vec, hit = self.query(k)
            out[...] = vec
            status[...] = hit
            return int(np.count_nonzero(hit))
        hits, torn = self._gpu.query(k, out, status)
        if torn:
            status[status == _STATUS_TORN] = 0
        self._count(lookups=m, hits=hits, misses=m - hits, torn=torn)
        return int(hits)

    def _write_kernel(self, mode: str, keys, vectors=None) -> Dict[str, int]:
        """insert / update / erase by the write kernel (CuPy), under the writer lock."""
        k = np.ascontiguousarray(_host(keys), dtype=np.int64).reshape(-1)
        rows = None
        if vectors is not None:
            rows = self.codec.as_rows(_host(vectors), "vectors")
            if rows.shape[0] != k.shape[0]:
                raise ValueError(f"vectors must hold {k.shape[0]} rows, got {tuple(rows.shape)}")
        with self.lock:
            counts = self._gpu.write(_WRITE_MODES.index(mode), k, rows)
        return dict(zip(_native.ARRAY_CACHE_WRITE_COUNTS, (int(c) for c in counts)))

    # ----------------------------------------------------------------- writes
    @_on_device
    def insert(self, keys, vectors) -> Dict[str, int]:
        """Insert (or update) ``keys`` with ``vectors`` (float32 ``[N, D]``).

        - Duplicate keys in the batch: the last occurrence wins.
        - Keys already cached are updated in place (and count as accessed).
        - New keys are grouped by set, in batch order (order of each key's last
          occurrence). In a set, the k-th new key takes the k-th free way (ascending way
          index), then the k-th least recently used way (ties: lower way index). Ways of
          keys updated by this same batch are never evicted by it.
        - If more new keys land in one set than it has ways to give (``ways`` minus the
          ways updated by this batch), the **first** ones in batch order are inserted; the
          others are dropped and counted as ``overflow``.
        - ``tinylfu``: a new key whose way holds a valid victim is admitted only if
          ``estimate(new) > estimate(victim)``, else it is dropped (``rejected``) and the
          victim stays. Free ways always admit.

        Returns ``{"inserted", "updated", "evicted", "rejected", "overflow"}``.
        """
        if self._gpu is not None:
            got = self._write_kernel("insert", keys, vectors)
            return {n: got[n] for n in ("inserted", "updated", "evicted", "rejected", "overflow")}
        k = self._keys(keys)
        v = self._vectors(vectors, int(k.shape[0]))
        res = dict(inserted=0, updated=0, evicted=0, rejected=0, overflow=0)
        if k.shape[0] == 0:
            return res
        pos = self._dedupe_last(k)
        uk, uv = k[pos], v[pos]
        with self._writing(uk) as s:
            res = self._insert_locked(uk, uv, s)
            self._count_writes(
                inserts=res["inserted"],
                updates=res["updated"],
                evictions=res["evicted"],
                rejected=res["rejected"],
                overflow=res["overflow"],
            )
        return res

    @contextlib.contextmanager
    def _writing(self, uk):
        """Hold the writer lock with the sets of the (distinct) keys ``uk`` marked as being
        written (their sequence counters odd, so readers retry); yields the keys' sets."""
        s = self.set_of(uk)
        touched = self.xp.unique(s)
        with self.lock:
            self._begin_write(touched)
            try:
                yield s
            finally:
                self._end_write(touched)

    def _insert_locked(self, uk, uv, s) -> Dict[str, int]:
        xp = self.xp
        W = self.ways
        clk = self._tick()
        present, pway = self._find(uk, s)
        # 1. keys already cached: update in place, mark accessed
        up = xp.flatnonzero(present)
        up_s, up_w = s[up], pway[up]
        self.vectors[up_s, up_w] = uv[up]
        self.ticks[up_s, up_w] = clk
        # 2. new keys, grouped by set (stable: batch order within a set)
        new = xp.flatnonzero(~present)
        n_new = int(new.shape[0])
        res = dict(inserted=0, updated=int(up.shape[0]), evicted=0, rejected=0, overflow=0)
        if n_new == 0:
            return res
        ns = s[new]
        o = _stable_argsort(xp, ns)
        ns, new = ns[o], new[o]
        first = xp.searchsorted(ns, ns, side="left")
        rank = xp.arange(n_new, dtype=np.int64) - first
        ts = ns[rank == 0]  # touched sets, ascending, unique
        t_of = xp.searchsorted(ts, ns)  # row of each new key in ts
        # 3. way order per touched set: free ways first (by index), then by last access;
        #    ways updated by this batch last (pinned) and excluded from the ways to give
        tv = self.valid[ts]
        pinned = xp.zeros(tv.shape, dtype=np.bool_)
        pt = xp.searchsorted(ts, up_s)
        in_ts = pt < ts.shape[0]
        pt, pw = pt[in_ts], up_w[in_ts]
        hit_ts = ts[pt] == up_s[in_ts]
        pinned[pt[hit_ts], pw[hit_ts]] = True
        order_key = xp.where(tv, xp.where(pinned, _I64_MAX, self.ticks[ts]), _I64_MIN)
        way_order = _stable_argsort(xp, order_key, axis=1)
        avail = W - pinned.sum(axis=1)
        fits = rank < avail[t_of]
        way = way_order[t_of, xp.minimum(rank, W - 1)]
        ws = ts[t_of]
        victim_valid = tv[t_of, way]
        admit = fits
        if self.policy == CachePolicy.TINYLFU:
            victim_keys = self.slot_keys[ws, way]
            better = self.estimate(uk[new]) > self.estimate(victim_keys)
            admit = fits & (~victim_valid | better)
        # 4. write the admitted keys
        a = xp.flatnonzero(admit)
        aw_s, aw_w = ws[a], way[a]
        self.slot_keys[aw_s, aw_w] = uk[new[a]]
        self.vectors[aw_s, aw_w] = uv[new[a]]
        self.ticks[aw_s, aw_w] = clk
        self.valid[aw_s, aw_w] = True
        res["inserted"] = int(a.shape[0])
        res["evicted"] = int((admit & victim_valid).sum())
        res["rejected"] = int((fits & ~admit).sum())
        res["overflow"] = int((~fits).sum())
        return res

    @_on_device
    def update(self, keys, vectors) -> int:
        """Overwrite the vectors of the ``keys`` that are cached (others are ignored;
        last occurrence wins). Does not count as an access. Returns keys updated."""
        if self._gpu is not None:
            return self._write_kernel("update", keys, vectors)["updated"]
        k = self._keys(keys)
        v = self._vectors(vectors, int(k.shape[0]))
        if k.shape[0] == 0:
            return 0
        pos = self._dedupe_last(k)
        uk, uv = k[pos], v[pos]
        with self._writing(uk) as s:
            found, way = self._find(uk, s)
            f = self.xp.flatnonzero(found)
            self.vectors[s[f], way[f]] = uv[f]
            n = int(f.shape[0])
            self._count_writes(updates=n)
        return n

    @_on_device
    def erase(self, keys) -> int:
        """Remove ``keys`` from the cache; returns how many were cached."""
        if self._gpu is not None:
            return self._write_kernel("erase", keys)["erased"]
        k = self._keys(keys)
        if k.shape[0] == 0:
            return 0
        uk = k[self._dedupe_last(k)]
        with self._writing(uk) as s:
            found, way = self._find(uk, s)
            f = self.xp.flatnonzero(found)
            self.valid[s[f], way[f]] = False
            n = int(f.shape[0])
            self._count_writes(erased=n)
        return n

    @_on_device
    def clear(self) -> None:
        """Empty the cache and reset the TinyLFU sketch (the clock keeps running)."""
        if self._gpu is not None:
            with self.lock:
                self._gpu.clear()
            return
        every = self.xp.arange(self.num_sets, dtype=np.int64)
        with self.lock:
            self._begin_write(every)
            try:
                self.valid[...] = False
                if self.sketch is not None:
                    self.sketch[...] = 0
                self.meta[_INCS] = 0
            finally:
                self._end_write(every)

    @_on_device
    def repair(self) -> int:
        """Invalidate every set a dead writer left odd and make it even; returns their
        number. Safe at any time (takes the writer lock)."""
        if self._gpu is not None:
            with self.lock:
                return int(self._gpu.repair())
        with self.lock:
            bad = self.xp.flatnonzero(self.seq & 1)
            n = int(bad.shape[0])
            if n:
                self._begin_write(bad)
                self._end_write(bad)
        return n

    # ----------------------------------------------------------------- inspection
    @_on_device
    def cached_keys(self):
        """Keys held now (xp int64 array, in slot order). Not a consistent snapshot under
        concurrent writes."""
        return self.slot_keys[self.valid]

    @_on_device
    def size(self) -> int:
        """Keys held now (all processes)."""
        return int(self.valid.sum())

    def stats(self) -> Dict[str, int]:
        """Counters. Of this object (readers share no atomic counters): lookups, hits,
        misses, torn (keys reported as misses because a writer was in their set). Node-wide,
        all processes since creation (kept in ``meta`` under the writer lock): inserts,
        updates, evictions, rejected (TinyLFU), overflow (over-full set in one batch),
        erased, recovered_sets (sets a dead writer left odd), sketch_agings. Plus ``size``."""
        with self._stats_lock:
            d = dict(self._stats)
        m = self.meta.get() if _is_cupy(self.xp) else self.meta
        d.update({k: int(m[i]) for k, i in _WRITER_COUNTERS.items()})
        d["size"] = self.size()
        return d

    def hit_rate(self) -> float:
        """Fraction of looked-up keys that were hits (0.0 before any lookup)."""
        with self._stats_lock:
            n, h = self._stats["lookups"], self._stats["hits"]
        return h / n if n else 0.0

    def miss_cache(self) -> Optional[_native.MissCache]:
        """This cache as the native miss path inserts into it
        (:class:`~triton_rec._native.LocalMisses`, src/native/local_misses.hpp): on a GPU
        the write kernel, with numpy the kernel's CPU twin, both under the writer lock
        (which must then be a native one: a ``WriterLock``, or a
        :class:`~triton_rec.cache.gpu_share.FileLock`). None when the lock is not."""
        lock = getattr(self.lock, "native", self.lock)
        if not isinstance(lock, _native.WriterLock):
            return None
        if self._gpu is not None:
            return self._gpu.miss_cache(lock)
        return _native.cache_twin_miss_cache(self.native_view(), lock)

    def host_view(self) -> HostCacheView:
        """This cache behind the numpy interface that
        :class:`triton_rec.cache.cached_table.CachedTable` uses."""
        return HostCacheView(self)


class HostCacheView:
    """The cache behind the ``EmbeddingCache`` protocol of :mod:`triton_rec.cache.cached_table`
    (the interface of the CPU cache, :class:`triton_rec.cache.shm_cache.SharedEmbeddingCache`):
    numpy in, numpy out; with CuPy, keys and vectors are copied to and from the device."""

    def __init__(self, cache: ArrayEmbeddingCache):
        self.cache = cache
        self.vec_size = cache.vec_size
        self.codec = cache.codec
        self.capacity = cache.capacity
        self.policy = cache.policy

    def query(self, keys: np.ndarray, out: np.ndarray, hit_mask: np.ndarray) -> int:
        """``out[i]`` = vector of ``keys[i]`` where ``hit_mask[i]`` is set (other rows
        unspecified: the device cache writes zeros); returns the hits. On a GPU one kernel
        launch, keys in and answers out through pinned staging
        (:meth:`ArrayEmbeddingCache.query_host`)."""
        if self.cache._gpu is not None:
            status = hit_mask if hit_mask.dtype == np.uint8 else np.empty(len(keys), np.uint8)
            hits = self.cache.query_host(keys, out, status)
            if status is not hit_mask:
                hit_mask[:] = status
            return hits
        vec, hit = self.cache.query(keys)
        hit = _host(hit)
        idx = np.flatnonzero(hit)
        out[idx] = _host(vec)[idx]
        hit_mask[:] = hit
        return int(idx.shape[0])

    def device_plan(self) -> Optional[dict]:
        """What the native backend's GPU path reads this cache with (``device_cache``:
        :meth:`ArrayEmbeddingCache.native_plan`), or None for a cache in host memory."""
        if self.cache._gpu is None:
            return None
        plan = self.cache.native_plan()
        return {"device": plan["device"], "device_cache": plan}

    def miss_cache(self) -> Optional[_native.MissCache]:
        """The wrapped cache as the native miss path inserts into it
        (:meth:`ArrayEmbeddingCache.miss_cache`)."""
        return self.cache.miss_cache()

    def insert(self, keys: np.ndarray, vectors: np.ndarray) -> Dict[str, int]:
        """Insert rows into the wrapped cache; returns its insert counters."""
        return self.cache.insert(keys, vectors)

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Overwrite the vectors of keys already cached; returns how many were updated."""
        return self.cache.update(keys, vectors)

    def erase(self, keys: np.ndarray) -> int:
        """Remove ``keys`` from the wrapped cache; returns how many were removed."""
        return self.cache.erase(keys)

    def clear(self) -> None:
        """Empty the wrapped cache."""
        self.cache.clear()

    def keys(self) -> np.ndarray:
        """The cached keys, as a host (numpy) array."""
        return _host(self.cache.cached_keys())

    def size(self) -> int:
        """Number of keys currently cached."""
        return self.cache.size()

    def stats(self) -> Dict[str, int]:
        """The wrapped cache's counters."""
        return self.cache.stats()

    def hit_rate(self) -> float:
        """The wrapped cache's hit rate."""
        return self.cache.hit_rate()


#: A no-op writer lock, for a cache written by one thread of one process only.
NO_LOCK = contextlib.nullcontext()
