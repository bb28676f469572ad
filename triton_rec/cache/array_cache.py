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
The state (its arrays, their layout, the hashes that place a key):
:mod:`triton_rec.cache.array_cache_state`; the numpy interface of the CPU cache over it:
:mod:`triton_rec.cache.host_cache_view`.

Policies: ``lru`` (HPS): a new key takes a free way of its set, else evicts the least
recently used way. ``tinylfu``: the same eviction, plus TinyLFU admission: every looked-up
key is counted in a count-min sketch (saturating 8-bit counters, all halved every
``10 * capacity`` counted keys); a new key that would evict a valid way is admitted only
if its estimated frequency is strictly greater than the victim's. Free ways always admit.

Concurrency (several processes sharing the arrays): readers take no lock, validated by a
per-set seqlock; writers are serialized by one lock; a dead writer's sets are healed by
the next write (:mod:`triton_rec.cache.array_cache_state`, "Concurrency").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Dict, Optional

import numpy as np

from triton_rec import _native
from triton_rec.cache.array_cache_state import (
    AGING_FACTOR,
    I64_MAX,
    I64_MIN,
    MAGIC,
    MAX_SETS,
    META_CAPACITY,
    META_CLOCK,
    META_INCS,
    META_LEN,
    META_MAGIC,
    META_POLICY,
    META_PRECISION,
    META_RECOVERED,
    META_VEC,
    META_WAYS,
    POLICIES,
    SKETCH_MAX,
    SKETCH_ROWS,
    SKETCH_WIDTH_FACTOR,
    STATUS_HIT,
    STATUS_TORN,
    WRITE_MODES,
    WRITER_COUNTERS,
    check_layout,
    dedupe_last,
    fastrange,
    host_array,
    is_cupy,
    num_sets_for,
    resolve_xp,
    sketch_index,
    splitmix64,
    stable_argsort,
    state_layout,
    xp_of,
)
from triton_rec.cache.device_plans import DeviceCachePlan
from triton_rec.cache.host_cache_view import HostCacheView
from triton_rec.config.ps_json import CachePolicy
from triton_rec.errors import ConfigError, CupyUnavailableError
from triton_rec.precision import DEFAULT_PRECISION, RowCodec

__all__ = [
    "MAX_SETS",
    "META_LEN",
    "SKETCH_ROWS",
    "SKETCH_WIDTH_FACTOR",
    "ArrayEmbeddingCache",
    "CupyUnavailableError",
    "HostCacheView",
    "POLICIES",
    "resolve_xp",
    "splitmix64",
]


def _on_device(method):
    """Run a method with the cache's device current (CuPy); no-op for numpy."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._device_id is None:
            return method(self, *args, **kwargs)
        with self.xp.cuda.Device(self._device_id):
            return method(self, *args, **kwargs)

    return wrapper


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
        meta[META_CAPACITY] = capacity
        meta[META_POLICY] = POLICIES.index(policy)
        meta[META_WAYS] = ways
        meta[META_VEC] = vec_size
        meta[META_PRECISION] = codec.code
        meta[META_MAGIC] = MAGIC
        self._attach(arrays, lock)

    # ----------------------------------------------------------------- construction
    #: :func:`~triton_rec.cache.array_cache_state.num_sets_for` and
    #: :func:`~triton_rec.cache.array_cache_state.state_layout`, here too
    num_sets_for = staticmethod(num_sets_for)
    state_layout = staticmethod(state_layout)

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
        xp = resolve_xp(xp) if xp is not None else xp_of(meta)
        m = [int(v) for v in (meta.get() if is_cupy(xp) else meta)]
        if m[META_MAGIC] != MAGIC:
            raise ConfigError("state arrays are not an initialized embedding cache (bad magic)")
        if not 0 <= m[META_POLICY] < len(POLICIES):
            raise ConfigError(f"state arrays carry an unknown policy code {m[META_POLICY]}")
        self = cls.__new__(cls)
        self.xp = xp
        policy = POLICIES[m[META_POLICY]]
        try:
            precision = RowCodec.from_code(m[META_PRECISION], max(1, m[META_VEC])).precision
        except ValueError as e:
            raise ConfigError(f"state arrays: {e}") from None
        cls._check_layout(
            arrays, cls.state_layout(m[META_CAPACITY], m[META_VEC], m[META_WAYS], policy, precision)
        )
        self._attach(arrays, lock)
        return self

    _check_layout = staticmethod(check_layout)

    def _attach(self, arrays, lock) -> None:
        self._arrays = dict(arrays)
        self.slot_keys = arrays["keys"]
        self.valid = arrays["valid"]
        self.ticks = arrays["ticks"]
        self.vectors = arrays["vectors"]
        self.seq = arrays["seq"]
        self.sketch = arrays.get("sketch")  # None for lru
        self.meta = arrays["meta"]
        m = self.meta.get() if is_cupy(self.xp) else self.meta
        self.requested_capacity = int(m[META_CAPACITY])
        self.policy = POLICIES[int(m[META_POLICY])]
        self.num_sets, self.ways = (int(v) for v in self.slot_keys.shape)
        self.capacity = self.num_sets * self.ways
        self.vec_size = int(m[META_VEC])
        self.codec = RowCodec.from_code(int(m[META_PRECISION]), self.vec_size)
        self.sketch_width = int(self.sketch.shape[1]) if self.sketch is not None else 0
        # the writer lock; by default one for this process's threads, which native writers
        # (miss_cache) take too
        self.lock = lock if lock is not None else _native.WriterLock(-1)
        # CuPy: the device holding the arrays, made current around every operation
        self._device_id = int(self.meta.device.id) if is_cupy(self.xp) else None
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
        if is_cupy(self.xp):
            return {n: int(a.data.ptr) for n, a in self._arrays.items()}
        return {n: int(a.ctypes.data) for n, a in self._arrays.items()}

    def native_view(self):
        """The state as the kernels and their CPU twin read it (``_native.CacheView``;
        valid while this cache's arrays live)."""
        return _native.CacheView(**dataclasses.asdict(self.native_plan()))

    def native_plan(self) -> DeviceCachePlan:
        """What the native backend's GPU path reads this cache with: the state arrays'
        addresses (``arrays``) and the geometry, as :class:`_native.CacheView` takes them
        (its device: ``_device_id``)."""
        return DeviceCachePlan(
            arrays=self.addresses(),
            num_sets=self.num_sets,
            ways=self.ways,
            dim=self.vec_size,
            precision=self.codec.code,
            policy=POLICIES.index(self.policy),
            sketch_width=self.sketch_width,
        )

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
        """Flat sketch indices ``[M, 4]`` of int64 keys (:func:`~triton_rec.cache.
        array_cache_state.sketch_index`)."""
        return sketch_index(self.xp, k, self.sketch_width)

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
        idx, counts = xp.unique(
            sketch_index(self.xp, k, self.sketch_width).reshape(-1), return_counts=True
        )
        flat = self.sketch.reshape(-1)  # a view: the state arrays are C-contiguous
        flat[idx] = xp.minimum(flat[idx].astype(np.int64) + counts, SKETCH_MAX).astype(np.uint8)
        self.meta[META_INCS] += int(k.shape[0])
        if int(self.meta[META_INCS]) >= AGING_FACTOR * self.capacity:
            self.sketch >>= 1
            self.meta[META_INCS] = 0
            self.meta[WRITER_COUNTERS["sketch_agings"]] += 1

    def _tick(self):
        """Advance the shared clock; returns its new value as a 1-element xp array."""
        self.meta[META_CLOCK] += 1
        return self.meta[META_CLOCK : META_CLOCK + 1].copy()

    def _sync(self) -> None:
        if is_cupy(self.xp):  # writes must be done on the device before the lock is released
            self.xp.cuda.get_current_stream().synchronize()

    def _count(self, **deltas) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += int(v)

    def _count_writes(self, **deltas) -> None:
        """Add to the node-wide writer counters (caller holds the writer lock)."""
        for k, v in deltas.items():
            if v:
                self.meta[WRITER_COUNTERS[k]] += int(v)

    def _begin_write(self, sets) -> None:
        """Under the lock: heal sets a dead writer left odd, then make ``sets`` odd.

        ``sets`` must be unique (``_end_write`` adds 1 to each entry)."""
        odd = (self.seq[sets] & 1).astype(np.bool_)
        self.valid[sets] &= ~odd[:, None]  # their data may be torn: drop it
        self.meta[META_RECOVERED : META_RECOVERED + 1] += odd.sum()
        self.seq[sets] |= 1

    def _end_write(self, sets) -> None:
        self.seq[sets] += 1
        self._sync()

    def _find(self, k, s):
        """(found, way) of each key in its set (no validation; writers hold the lock)."""
        match = self.valid[s] & (self.slot_keys[s] == k[:, None])
        return match.any(axis=1), match.argmax(axis=1)

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
        hit = status == STATUS_HIT
        hits = int(hit.sum())
        torn = int((status == STATUS_TORN).sum())
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
            status[status == STATUS_TORN] = 0
        self._count(lookups=m, hits=hits, misses=m - hits, torn=torn)
        return int(hits)

    def _write_kernel(self, mode: str, keys, vectors=None) -> Dict[str, int]:
        """insert / update / erase by the write kernel (CuPy), under the writer lock."""
        k = np.ascontiguousarray(host_array(keys), dtype=np.int64).reshape(-1)
        rows = None
        if vectors is not None:
            rows = self.codec.as_rows(host_array(vectors), "vectors")
            if rows.shape[0] != k.shape[0]:
                raise ValueError(f"vectors must hold {k.shape[0]} rows, got {tuple(rows.shape)}")
        with self.lock:
            counts = self._gpu.write(WRITE_MODES.index(mode), k, rows)
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
        pos = dedupe_last(self.xp, k)
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
        o = stable_argsort(xp, ns)
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
        order_key = xp.where(tv, xp.where(pinned, I64_MAX, self.ticks[ts]), I64_MIN)
        way_order = stable_argsort(xp, order_key, axis=1)
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
        pos = dedupe_last(self.xp, k)
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
        uk = k[dedupe_last(self.xp, k)]
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
                self.meta[META_INCS] = 0
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
        m = self.meta.get() if is_cupy(self.xp) else self.meta
        d.update({k: int(m[i]) for k, i in WRITER_COUNTERS.items()})
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


#: A no-op writer lock, for a cache written by one thread of one process only.
NO_LOCK = contextlib.nullcontext()
