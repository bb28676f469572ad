"""One table as a lookup session sees it: an embedding cache in front of a backing store.

Lookup (HPS semantics, ``hit_rate_threshold`` of ps.json):

1. the cache answers the keys it holds;
2. the hit rate is HPS's: per request and per table, over the request's *unique* keys
   (a request without keys for the table counts as 1.0). Several requests merged into one
   lookup (one ``execute``) are judged each on its own (``segments``), so a cold request
   is never answered with defaults because warm ones were batched with it;
3. a request whose hit rate is **at or above** the threshold gets its misses answered
   with the table's default value right away; they go to a background inserter that
   fetches them from the store and inserts them (later lookups hit);
4. below the threshold the request's misses are fetched from the store synchronously,
   answered correctly and inserted before returning. A threshold above 1.0 therefore
   means "always synchronous", 0.0 "never wait". ``static`` tables (``exact=True``) always
   fetch (HPS's static embedding cache never answers a stored key with the default), and
   so does a request that asks for it (per-request ``exact``, the request parameter
   ``exact: true`` of the ``hps`` and ``hugectr`` backends).

Default answers are counted, per request and by cause (:data:`DEFAULT_CAUSES`):
``not_found``: the key was looked up in every tier and none holds it; ``async``: a cache
miss answered with the default by rule 3 (the tiers were not asked). The backends report
both with every response; :class:`TableStats` counts them per table (Prometheus).

The cache is shared by every instance on the node (one per model, device and table);
each instance has its own :class:`CachedTable`, statistics and background threads.

The rules are written twice, on purpose: here in Python for every store, and in C++ for
a shared cache in front of the node-local table (:class:`~triton_rec._native.LocalMisses`,
src/native/local_misses.hpp), which both request paths use for such tables;
tests/unit/test_local_misses.py holds the two to the same answers, counts and cache
contents.

Rows travel between the store and the cache encoded in the table's precision
(:attr:`CachedTable.codec`, :mod:`triton_rec.precision`): a miss is fetched as
the store holds it, inserted as it is, and decoded once into the answer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.config.ps_json import MODEL_DEFAULTS
from triton_rec.storage.backing_store import BackingStore
from triton_rec.util.log_throttle import LogThrottle

log = logging.getLogger(__name__)


class EmbeddingCache(Protocol):
    """What :class:`CachedTable` needs of a cache (CPU shared memory or device arrays)."""

    vec_size: int
    capacity: int

    def size(self) -> int:
        """Rows held now."""

    def query(self, keys: np.ndarray, out: np.ndarray, hit_mask: np.ndarray) -> int:
        """Write the cached vectors of ``keys`` into ``out``, set ``hit_mask``; returns hits."""

    def insert(self, keys: np.ndarray, vectors: np.ndarray):
        """Insert (or overwrite) ``keys`` with ``vectors`` (rows in the cache's precision),
        evicting per the cache's policy."""

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Overwrite the rows of the ``keys`` already cached; returns how many were."""

    def keys(self) -> np.ndarray:
        """The keys cached now."""

    def stats(self) -> Dict[str, int]:
        """The cache's counters (lookups, hits, inserts, evictions, ...)."""


#: The counters native code keeps (``TableStats.native``), in order: the hot path of the
#: native backend and :class:`~triton_rec._native.LocalMisses` (defined in
#: src/native/seam.hpp, ``TableStat``).
NATIVE_FIELDS: Tuple[str, ...] = tuple(_native.TABLE_STAT_FIELDS)

#: Why a key was answered with the default value: the columns of a ``defaults`` array
#: (:meth:`CachedTable.lookup`), in order. ``not_found``: no tier holds the key;
#: ``async``: a cache miss answered at once, fetched in the background (hit rate rule).
#: Defined in src/native/seam.hpp (``DefaultCause``).
DEFAULT_CAUSES: Tuple[str, ...] = tuple(_native.DEFAULT_CAUSES)


def new_default_counts() -> np.ndarray:
    """A request's default-answer counters: int64 zeros, one per :data:`DEFAULT_CAUSES`."""
    return np.zeros(len(DEFAULT_CAUSES), dtype=np.int64)


@dataclass
class TableStats:
    """Per-instance counters of one table (monotonic; exported as Triton metrics)."""

    lookups: int = 0  # keys looked up
    hits: int = 0  # keys answered by the cache
    misses: int = 0  # keys the cache did not hold
    sync_fetched: int = 0  # misses fetched from the store before answering
    default_answered: int = 0  # misses answered with the default value (hit rate >= threshold)
    not_found: int = 0  # keys no tier holds (answered with the default value)
    queued: int = 0  # misses handed to the background inserter
    dropped: int = 0  # misses the background inserter had no room for
    refreshed: int = 0  # cached rows re-read from the store by the refresher
    cache_ns: int = 0  # time spent in the cache
    store_ns: int = 0  # time spent in the backing store (synchronous path)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    #: what the native backend's hot path counted (it adds to these atomically, without
    #: the GIL; :data:`NATIVE_FIELDS` order); :meth:`snapshot` adds them in
    native: np.ndarray = field(
        default_factory=lambda: np.zeros(len(NATIVE_FIELDS), np.int64), repr=False, compare=False
    )

    def add(self, **deltas: int) -> None:
        """Add ``deltas`` to the named counters (under the lock)."""
        with self.lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> Dict[str, int]:
        """A copy of every counter (the native hot path's counts added in)."""
        with self.lock:
            snap = {k: v for k, v in self.__dict__.items() if k not in ("lock", "native")}
        for k, v in zip(NATIVE_FIELDS, self.native.tolist()):
            snap[k] += v
        return snap


class CachedTable:
    """Cache + backing store for one table of one instance.

    Args:
        name: table name (for messages and metrics).
        store: the backing store (source of truth).
        cache: the shared embedding cache, or None to read the store directly.
        hit_rate_threshold: see the module docstring.
        inserter: background inserter used when the hit rate is at or above the threshold.

    Thread-safety: :meth:`lookup` may run in several threads at once.
    """

    def __init__(
        self,
        name: str,
        store: BackingStore,
        cache: Optional[EmbeddingCache] = None,
        hit_rate_threshold: float = MODEL_DEFAULTS["hit_rate_threshold"],
        inserter: Optional[BackgroundInserter] = None,
        exact: bool = False,
    ):
        self.name = name
        self.store = store
        self.cache = cache
        self.hit_rate_threshold = float(hit_rate_threshold)
        # exact: every miss is fetched synchronously (static tables), whatever the threshold
        self.inserter = None if exact else inserter
        self.vec_size = store.vec_size
        self.default_value = store.default_value
        self.codec = store.codec
        cache_codec = getattr(cache, "codec", self.codec)
        if cache_codec != self.codec:
            raise ValueError(
                f"table {name}: the cache holds {cache_codec.precision} rows of "
                f"{cache_codec.dim}, the store {self.codec.precision} rows of {self.codec.dim}"
            )
        self.stats = TableStats()
        #: the misses in C++ when the cache sits in front of a node-local table (else None)
        self.local_misses = self._open_local_misses()

    def _open_local_misses(self) -> Optional[_native.LocalMisses]:
        """A :class:`~triton_rec._native.LocalMisses` for a cache in front of a node-local
        table (the shared-memory cache, or a device cache: ``miss_cache``): its misses are
        answered by this module's rules in C++ without the GIL, on both request paths
        (src/native/local_misses.hpp). None otherwise."""
        table = self.store.native_table()
        if self.cache is None or table is None:
            return None
        shm_view = getattr(self.cache, "shm_view", None)
        miss_cache = getattr(self.cache, "miss_cache", None)
        cache = shm_view() if shm_view is not None else miss_cache() if miss_cache else None
        if cache is None:
            return None
        index, vectors = table
        return _native.LocalMisses(
            cache,
            index,
            vectors,
            self.codec.code,
            self.default_value,
            self.hit_rate_threshold,
            self.inserter is not None,
            None if self.inserter is None else self.inserter.native,
            self.stats.native,
        )

    def lookup(
        self,
        keys: np.ndarray,
        out: np.ndarray,
        segments: Optional[Sequence[int]] = None,
        exact: Optional[Sequence[bool]] = None,
        defaults: Optional[np.ndarray] = None,
    ) -> int:
        """Fill ``out`` (float32 ``[M, D]``) with the vectors of ``keys``; returns cache hits.

        Args:
            segments: the number of keys of each request merged into ``keys``, in order
                (None: one request); the hit rate is judged per request (module docstring).
            exact: per request, whether its misses are all fetched now whatever the hit
                rate (None: no request asks).
            defaults: int64 ``[requests, len(DEFAULT_CAUSES)]``: each request's keys
                answered with the default value are *added* here, by cause.
        """
        m = keys.shape[0]
        if m == 0:
            return 0
        if self.cache is None:
            t0 = time.perf_counter_ns()
            found = self.store.fetch(keys, out)
            absent = m - int(np.count_nonzero(found))
            self.stats.add(
                lookups=m,
                misses=m,
                sync_fetched=m,
                not_found=absent,
                store_ns=time.perf_counter_ns() - t0,
            )
            if absent and defaults is not None:
                _count_by_request(defaults, 0, ~found, segments)
            return 0
        hit = np.empty(m, dtype=np.uint8)  # query writes every entry
        t0 = time.perf_counter_ns()
        hits = int(self.cache.query(keys, out, hit))
        return self.finish_query(
            keys, out, hit, hits, time.perf_counter_ns() - t0, segments, exact, defaults
        )

    def finish_query(
        self,
        keys: np.ndarray,
        out: np.ndarray,
        hit: np.ndarray,
        hits: int,
        query_ns: int,
        segments: Optional[Sequence[int]] = None,
        exact: Optional[Sequence[bool]] = None,
        defaults: Optional[np.ndarray] = None,
    ) -> int:
        """The rest of :meth:`lookup` once the cache has answered: count the lookup and
        answer the misses (``hit[i] == 0``) by the rules of the module docstring: in C++
        for a node-local table (:attr:`local_misses`), else here. The native backend
        queries the cache itself and hands the misses to ``local_misses`` directly, or
        here through :meth:`native_finish`. ``segments``, ``exact``, ``defaults``: as for
        :meth:`lookup`. Returns ``hits``."""
        assert self.cache is not None  # a query was answered by it
        m = keys.shape[0]
        if self.local_misses is not None:
            bounds = _segment_bounds(m, segments)
            n = bounds.shape[0] - 1
            wants = np.zeros(n, np.uint8) if exact is None else np.asarray(exact, np.uint8)
            if defaults is None:
                defaults = np.zeros((n, len(DEFAULT_CAUSES)), np.int64)
            self.local_misses.finish(keys, out, hit, hits, query_ns, bounds, wants, defaults)
            return hits
        misses = m - hits
        if misses == 0:
            self.stats.add(lookups=m, hits=hits, cache_ns=query_ns)
            return hits
        miss_idx = np.flatnonzero(hit == 0)
        counts = {"lookups": m, "hits": hits, "misses": misses}
        defer = self._deferred(keys, hit, segments, exact)
        if defer is not None:
            deferred = miss_idx[defer[miss_idx]]
            miss_idx = miss_idx[~defer[miss_idx]]
            out[deferred] = self.default_value
            if defaults is not None:
                _count_by_request(defaults, 1, _mask(m, deferred), segments)
            assert self.inserter is not None  # _deferred returns None without one
            accepted = self.inserter.submit(self, keys[deferred])
            n = int(deferred.shape[0])
            counts.update(
                default_answered=n, queued=n if accepted else 0, dropped=0 if accepted else n
            )
        fetched_n = int(miss_idx.shape[0])
        if fetched_n == 0:
            self.stats.add(cache_ns=query_ns, **counts)
            return hits
        miss_keys = keys[miss_idx]
        fetched = self.codec.empty(fetched_n)  # as the store holds them
        t1 = time.perf_counter_ns()
        found = self.store.fetch(miss_keys, fetched)
        absent_n = fetched_n - int(np.count_nonzero(found))
        if absent_n:
            counts["not_found"] = absent_n
            if defaults is not None:
                _count_by_request(defaults, 0, _mask(m, miss_idx[~found]), segments)
        if self.codec.precision == "fp32":
            out[miss_idx] = fetched
        else:
            out[miss_idx] = self.codec.decode(fetched)
            absent = miss_idx[~found]
            out[absent] = self.default_value  # exactly the default, not its encoding
        t2 = time.perf_counter_ns()
        # Keys no tier holds are not cached: each later lookup asks the store again and
        # is counted (a cached default would be answered silently, and never fixed by an
        # online update of a key the cache does not hold).
        if found.all():
            self.cache.insert(miss_keys, fetched)
        elif found.any():
            self.cache.insert(miss_keys[found], fetched[found])
        t3 = time.perf_counter_ns()
        self.stats.add(
            sync_fetched=fetched_n,
            cache_ns=query_ns + (t3 - t2),
            store_ns=t2 - t1,
            **counts,
        )
        return hits

    def native_finish(
        self, keys, out, hit, hits: int, query_ns: int, exact: bool
    ) -> Tuple[int, int]:
        """:meth:`finish_query` of one request on the native backend's buffers (``keys``,
        its answer block ``out`` and the hit mask: memoryviews, written in place); the
        handler a table's native plan gives the hot path when its misses need Python (a
        tier store, a device cache). Returns the keys answered with the default value, by
        cause (:data:`DEFAULT_CAUSES`)."""
        k = np.frombuffer(keys, dtype=np.int64)
        o = np.frombuffer(out, dtype=np.float32).reshape(k.shape[0], self.vec_size)
        counts = np.zeros((1, len(DEFAULT_CAUSES)), dtype=np.int64)
        mask = np.frombuffer(hit, dtype=np.uint8)
        self.finish_query(k, o, mask, hits, query_ns, None, (exact,), counts)
        return int(counts[0, 0]), int(counts[0, 1])

    def _deferred(
        self,
        keys: np.ndarray,
        hit: np.ndarray,
        segments: Optional[Sequence[int]],
        exact: Optional[Sequence[bool]] = None,
    ) -> Optional[np.ndarray]:
        """Per key, whether its request's hit rate is at or above the threshold (its misses
        are answered with the default and inserted in the background) and the request did
        not ask for ``exact`` answers; None when every miss is fetched now."""
        if self.inserter is None or self.hit_rate_threshold > 1.0:
            return None
        lengths = np.asarray(segments if segments is not None else (keys.shape[0],), np.int64)
        wants = None if exact is None else np.asarray(exact, dtype=bool)
        if wants is not None and wants.any():
            if wants.all():
                return None
            defer = self._deferred(keys, hit, segments)
            if defer is None:
                return None
            defer &= ~np.repeat(wants, lengths)
            return defer if defer.any() else None
        if self.hit_rate_threshold <= 0.0:
            return np.ones(keys.shape[0], dtype=bool)
        bounds = _segment_bounds(keys.shape[0], segments)
        # (distinct keys, distinct keys that hit) per request: a key asked twice counts once
        counts = _native.distinct_hit_counts(keys, hit, bounds)
        # at or above the threshold (an empty request counts as 1.0): misses deferred
        per_request = counts[:, 1] >= self.hit_rate_threshold * counts[:, 0]
        defer = np.repeat(per_request, lengths)
        return defer if defer.any() else None

    def fill_from_store(self, keys: np.ndarray) -> None:
        """Fetch ``keys`` from the store and insert them in the cache (background path)."""
        assert self.cache is not None  # the background path exists only with a cache
        keys = np.unique(keys)
        rows = self.codec.empty(keys.shape[0])
        found = self.store.fetch(keys, rows)
        self.cache.insert(keys[found], rows[found])  # keys no tier holds stay out

    def refresh(self, fraction: float) -> int:
        """One refresh pass as HPS does it (hier_parameter_server.cpp L862-943): re-read
        *every* cached row from the store, in chunks of ``fraction`` of the cache; only rows
        still cached are overwritten (``update``). Returns the rows re-read."""
        if self.cache is None or fraction <= 0:
            return 0
        cached = np.asarray(self.cache.keys())
        n = int(cached.shape[0])
        chunk = max(1, int(np.ceil(n * fraction)))
        for start in range(0, n, chunk):
            batch = np.ascontiguousarray(cached[start : start + chunk])
            rows = self.codec.empty(batch.shape[0])
            self.store.fetch(batch, rows)
            self.cache.update(batch, rows)
        self.stats.add(refreshed=n)
        return n

    def warm_up(self, max_rows: int) -> int:
        """``init_ec``: insert up to ``max_rows`` rows of the store into the cache."""
        if self.cache is None or max_rows <= 0:
            return 0
        keys = np.ascontiguousarray(self.store.sample_keys(max_rows), dtype=np.int64)
        rows = self.codec.empty(keys.shape[0])
        self.store.fetch(keys, rows)
        self.cache.insert(keys, rows)
        return int(keys.shape[0])


def _segment_bounds(m: int, segments: Optional[Sequence[int]]) -> np.ndarray:
    """int64 ``[requests + 1]``: where each merged request's keys start, then ``m``
    (``segments`` None: one request of all ``m`` keys)."""
    lengths = np.asarray(segments if segments is not None else (m,), np.int64)
    bounds = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    return bounds


def _mask(m: int, idx: np.ndarray) -> np.ndarray:
    """A bool ``[m]`` mask set at ``idx``."""
    mask = np.zeros(m, dtype=bool)
    mask[idx] = True
    return mask


def _count_by_request(
    defaults: np.ndarray, cause: int, mask: np.ndarray, segments: Optional[Sequence[int]]
) -> None:
    """Add, per request, the keys set in ``mask`` to column ``cause`` of ``defaults``."""
    if segments is None:
        defaults[0, cause] += int(np.count_nonzero(mask))
        return
    lengths = np.asarray(segments, np.int64)
    request_of = np.repeat(np.arange(lengths.shape[0]), lengths)
    defaults[:, cause] += np.bincount(request_of[mask], minlength=lengths.shape[0])


class BackgroundInserter:
    """A daemon thread that fetches missed keys from the store and inserts them.

    Bounded: at most ``max_pending`` batches wait; beyond that new batches are dropped
    (counted in ``TableStats.dropped``) rather than slowing down the serving path.
    """

    def __init__(self, max_pending: int = 64, name: str = "trec-inserter"):
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        #: the queue of the node-local tables' misses (CachedTable.local_misses): a native
        #: thread, as bounded as this one
        self.native = _native.InsertQueue(max_pending)
        self._throttle = LogThrottle()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, table: CachedTable, keys: np.ndarray) -> bool:
        """Queue the missed ``keys`` of ``table`` for insertion; False when the queue is full."""
        try:
            self._queue.put_nowait((table, np.array(keys, dtype=np.int64, copy=True)))
            return True
        except queue.Full:
            return False

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every submitted batch is inserted (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return bool(self.native.drain(max(0.0, deadline - time.monotonic())))
            time.sleep(0.005)
        return False

    def _run(self) -> None:
        native_failures = 0
        while not self._stop.is_set():
            native_failures = self._report_native_failures(native_failures)
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:  # close()'s wake-up
                self._queue.task_done()
                continue
            table, keys = item
            try:
                table.fill_from_store(keys)
            except Exception:  # keep serving; the next miss retries
                allowed, held = self._throttle.allow()
                if allowed:
                    log.exception(
                        "background insert into table %s failed (%d more failures "
                        "since the last line)",
                        table.name,
                        held,
                    )
            finally:
                self._queue.task_done()

    def _report_native_failures(self, seen: int) -> int:
        """Log (throttled) the native queue's failed inserts since ``seen``; returns the
        count now."""
        failed, last = self.native.failures
        if failed > seen:
            allowed, held = self._throttle.allow()
            if allowed:
                log.error(
                    "background insert failed: %s (%d failures so far, %d more lines held)",
                    last,
                    failed,
                    held,
                )
        return failed

    def close(self) -> None:
        """Stop the threads (waits up to 5 s for the batch in progress). The thread is
        woken rather than left to its next poll: a model's unload waited up to 0.1 s here."""
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:  # busy: it sees the stop after its batch
            pass
        self._thread.join(timeout=5)
        self.native.close()


class Refresher:
    """Every ``interval`` seconds, re-read each table's cached rows (in chunks of
    ``fraction`` of the cache, :meth:`CachedTable.refresh`).

    HPS's ``refresh_interval`` / ``cache_refresh_percentage_per_iteration``: keeps
    cached rows in step with a store that receives online updates.
    """

    def __init__(
        self, tables: List[CachedTable], interval: float, fraction: float, delay: float = 0.0
    ):
        self.tables = tables
        self.interval = float(interval)
        self.delay = float(delay)
        self.fraction = float(fraction)
        self._throttle = LogThrottle()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trec-refresher", daemon=True)
        self._thread.start()

    def run_once(self) -> None:
        """One refresh pass over every table (what each interval does)."""
        for t in self.tables:
            try:
                t.refresh(self.fraction)
            except Exception:
                allowed, held = self._throttle.allow()
                if allowed:
                    log.exception(
                        "refresh of table %s failed (%d more failures since the last line)",
                        t.name,
                        held,
                    )

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        while not self._stop.wait(self.interval):
            self.run_once()

    def close(self) -> None:
        """Stop the thread (waits up to 5 s)."""
        self._stop.set()
        self._thread.join(timeout=5)
