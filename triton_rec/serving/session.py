"""HPS-style lookup sessions: validate ``KEYS``/``NUMKEYS`` requests and answer them.

Request layout (HPS backend, see docs/upstream-notes.md): ``KEYS`` holds every key of
table 0, then every key of table 1, ...; ``NUMKEYS`` says how many keys each table
has. The answer is one flat float32 array: the vectors of the keys in the same order,
``sum_t numkeys[t] * vec_size[t]`` floats long.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np

from triton_rec.cache.cached_table import (
    DEFAULT_CAUSES,
    BackgroundInserter,
    CachedTable,
    EmbeddingCache,
    Refresher,
    new_default_counts,
)
from triton_rec.config.ps_json import EmbeddingCacheType, ModelParams, TableParams
from triton_rec.errors import RequestError
from triton_rec.formats.tables import read_table
from triton_rec.serving.native_plan import NativePlan, gpu_plan, table_plans
from triton_rec.storage.backing_store import BackingStore, LocalTableStore
from triton_rec.storage.table import EmbeddingTable

#: ``(table params, loaded table) -> cache or None``: how a session gets its caches.
CacheOpener = Callable[[TableParams, EmbeddingTable], Optional[EmbeddingCache]]
#: ``table params -> EmbeddingTable``: how a session loads its tables.
TableLoader = Callable[[TableParams], EmbeddingTable]
#: ``(table params, loaded table) -> BackingStore``: what the cache of a table sits in
#: front of (default: the loaded table itself).
StoreOpener = Callable[[TableParams, EmbeddingTable], BackingStore]


def warm_up_at_load(params: ModelParams) -> bool:
    """Whether a model's caches are filled at load: HPS runs ``init_ec`` only with a
    refresh percentage > 0, and always for a non-dynamic cache type
    (hier_parameter_server.cpp L221-232)."""
    if params.embedding_cache_type != EmbeddingCacheType.DYNAMIC:
        return True
    return params.init_ec and params.cache_refresh_percentage_per_iteration > 0


def read_table_privately(t: TableParams) -> EmbeddingTable:
    """Map the sparse files and build a private index (no node-local store)."""
    keys, vectors = read_table(t.sparse_file, t.vec_size)
    return EmbeddingTable(t.name, keys, vectors, t.default_value, t.sparse_file)


@dataclass
class TableSet:
    """The tables of one model instance and the background threads that serve them.

    Args:
        tables: one :class:`CachedTable` per table of the model, in ps.json order.
        inserter: background inserter shared by the tables (None without caches).
        refresher: periodic cache refresher (None unless ``refresh_interval > 0``).
    """

    tables: List[CachedTable]
    inserter: Optional[BackgroundInserter] = None
    refresher: Optional[Refresher] = None
    #: other background services the set owns (e.g. the online-update consumer): closed first
    services: List = field(default_factory=list)

    @classmethod
    def open(
        cls,
        params: ModelParams,
        load_table: TableLoader = read_table_privately,
        open_cache: Optional[CacheOpener] = None,
        open_store: StoreOpener = lambda tp, table: LocalTableStore(table),
    ) -> TableSet:
        """Load every table of ``params`` and put a cache in front when ``gpucache`` is on.

        Args:
            params: the model's ps.json entry.
            load_table: loads one table (ModelFileError names a bad file).
            open_cache: opens (creates or attaches) the shared cache of one table;
                None or ``gpucache: false`` means no cache.
            open_store: what the cache sits in front of (default: the loaded table).
        """
        use_cache = params.gpucache and open_cache is not None
        # static/uvm tables fetch every miss themselves: no background inserter thread
        exact = params.embedding_cache_type.exact
        inserter = BackgroundInserter() if use_cache and not exact else None
        cached: List[CachedTable] = []
        try:
            for tp in params.tables:
                table = load_table(tp)
                store = open_store(tp, table)
                try:
                    cache = open_cache(tp, table) if use_cache and open_cache is not None else None
                except BaseException:
                    store.close()
                    raise
                ct = CachedTable(
                    tp.name,
                    store,
                    cache,
                    params.hit_rate_threshold,
                    inserter,
                    # a table held whole misses only keys that no tier holds: fetched now
                    exact=exact or getattr(cache, "whole", False),
                )
                cached.append(ct)
                if cache is not None and warm_up_at_load(params) and cache.size() == 0:
                    # init_ec: the first instance to find the shared cache empty fills it
                    # (two instances starting together may both do it; same rows).
                    ct.warm_up(int(cache.capacity))
        except BaseException:
            cls(cached, inserter).close()
            raise
        refresher = None
        # HPS refreshes only with a percentage > 0 (hier_parameter_server.cpp L875-881)
        if (
            use_cache
            and params.refresh_interval > 0
            and params.cache_refresh_percentage_per_iteration > 0
        ):
            refresher = Refresher(
                cached,
                params.refresh_interval,
                params.cache_refresh_percentage_per_iteration,
                delay=params.refresh_delay,
            )
        return cls(cached, inserter, refresher)

    def close(self) -> None:
        """Stop the background threads, detach from the shared caches, close the stores."""
        for service in self.services:
            service.close()
        self.services = []
        if self.refresher is not None:
            self.refresher.close()
        if self.inserter is not None:
            self.inserter.drain(5.0)
            self.inserter.close()
        for ct in self.tables:
            close = getattr(ct.cache, "close", None)
            if close is not None:
                close()
            ct.cache = None
            ct.store.close()


@dataclass(frozen=True)
class LookupRequest:
    """A validated request.

    Args:
        keys: int64 ``[sum(counts)]``, table-major.
        counts: keys per table.
        num_samples: samples the request holds (the ``NumSample`` response parameter).
        exact: fetch every cache miss now (the request parameter ``exact``).
        defaults: int64 ``[len(DEFAULT_CAUSES)]``: the request's keys answered with the
            default value, by cause, filled in by the lookup.
    """

    keys: np.ndarray
    counts: Tuple[int, ...]
    num_samples: int
    exact: bool = False
    defaults: np.ndarray = field(default_factory=new_default_counts, compare=False)


class LookupSession:
    """Answers lookups for one model (one per model instance).

    Args:
        params: the model's ps.json entry.
        tables: one entry per ``params.tables``: an :class:`EmbeddingTable` (read
            directly, no cache) or a :class:`CachedTable` (cache in front of a store).
        inserter, refresher, services: background threads the session owns and closes.

    Thread-safety: :meth:`lookup_many` may run in several threads at once.
    """

    def __init__(
        self,
        params: ModelParams,
        tables: Sequence[Union[EmbeddingTable, CachedTable]],
        inserter: Optional[BackgroundInserter] = None,
        refresher: Optional[Refresher] = None,
        services: Sequence = (),
    ):
        if len(tables) != params.num_tables:
            raise ValueError(
                f"{params.model}: {len(tables)} tables given, ps.json has {params.num_tables}"
            )
        for p, t in zip(params.tables, tables):
            if t.vec_size != p.vec_size:
                raise ValueError(f"{params.model}.{p.name}: vec_size {t.vec_size} != {p.vec_size}")
        self.params = params
        self.cached_tables = [
            t if isinstance(t, CachedTable) else CachedTable(t.name, LocalTableStore(t))
            for t in tables
        ]
        self.inserter = inserter
        self.refresher = refresher
        self.services = list(services)
        self._vec = [int(t.vec_size) for t in params.tables]
        self._maxnum = [int(t.max_keys_per_sample) for t in params.tables]

    @property
    def tables(self) -> List[EmbeddingTable]:
        """The node-local tables behind the caches (local stores only)."""
        return [t.store.table for t in self.cached_tables if isinstance(t.store, LocalTableStore)]

    def describe(self) -> str:
        """One line per table: what serves it (cache, stores), for the load log."""
        return "; ".join(
            f"{t.name}: {t.codec.precision} cache={'yes' if t.cache is not None else 'no'} "
            f"store={t.store!r}"
            for t in self.cached_tables
        )

    @classmethod
    def from_params(
        cls,
        params: ModelParams,
        load_table: TableLoader = read_table_privately,
        open_cache: Optional[CacheOpener] = None,
    ) -> LookupSession:
        """Load every table of ``params`` (see :meth:`TableSet.open`)."""
        ts = TableSet.open(params, load_table, open_cache)
        return cls(params, ts.tables, ts.inserter, ts.refresher)

    def close(self) -> None:
        """Stop background threads and detach from the shared caches."""
        TableSet(self.cached_tables, self.inserter, self.refresher, self.services).close()
        self.services = []

    def native_plan(self) -> Optional[NativePlan]:
        """What the native backend needs to answer this session's requests without
        Python (``src/triton_backend/trec/``), or None if a table needs Python
        for every lookup: the tables (:func:`~triton_rec.serving.native_plan.table_plans`),
        ``max_batch_size`` and the most keys per sample of each table (``maxnum``)."""
        tables = table_plans(self.cached_tables)
        if tables is None:
            return None
        return NativePlan(
            kind="hps",
            tables=tables,
            max_batch_size=int(self.params.max_batch_size),
            gpu=gpu_plan(tables),
            maxnum=list(self._maxnum),
        )

    # -- validation -------------------------------------------------------------------
    def input_limits(self):
        """The most elements each input of a valid request holds (see
        :data:`triton_rec.triton.request_loop.InputLimits`): ``KEYS`` max_batch_size x the sum of
        ``maxnum_catfeature_query_per_table_per_sample``, ``NUMKEYS`` one count per table."""
        mbs, per_sample = self.params.max_batch_size, sum(self._maxnum)
        return {
            "KEYS": (mbs * per_sample, 8, f"max_batch_size {mbs} x {per_sample} keys per sample"),
            "NUMKEYS": (self.params.num_tables, 4, f"{self.params.num_tables} tables"),
        }

    def parse_request(self, keys: np.ndarray, numkeys: np.ndarray) -> LookupRequest:
        """Check a request's tensors against the model; RequestError says what is wrong.

        Args:
            keys: ``KEYS`` as received (int64, any shape; read flat).
            numkeys: ``NUMKEYS`` as received: int32 of shape ``[T]`` or ``[1, T]``.
        """
        name = self.params.model
        if keys.dtype != np.int64:
            raise RequestError(f"model '{name}': KEYS must be INT64, got {keys.dtype}")
        if numkeys.dtype.kind not in "iu":
            raise RequestError(f"model '{name}': NUMKEYS must be INT32, got {numkeys.dtype}")
        n_tables = self.params.num_tables
        if numkeys.ndim == 2 and numkeys.shape[0] == 1:
            numkeys = numkeys[0]
        if numkeys.ndim != 1:
            raise RequestError(
                f"model '{name}': NUMKEYS must have shape [{n_tables}] or [1, {n_tables}], "
                f"got {list(numkeys.shape)}"
            )
        if numkeys.shape[0] != n_tables:
            raise RequestError(
                f"model '{name}': NUMKEYS has {numkeys.shape[0]} counts but the model has "
                f"{n_tables} tables ({', '.join(t.name for t in self.params.tables)})"
            )
        # A handful of counts: plain Python ints are cheaper than numpy calls here.
        counts = tuple(numkeys.tolist())
        for t, c in enumerate(counts):
            if c < 0:
                raise RequestError(
                    f"model '{name}': NUMKEYS[{t}] (table '{self.params.tables[t].name}') is "
                    f"negative: {c}"
                )
        flat = keys.reshape(-1)
        total = sum(counts)
        if flat.shape[0] == 0:
            raise RequestError(f"model '{name}': empty request, KEYS has no elements")
        if total != flat.shape[0]:
            raise RequestError(
                f"model '{name}': NUMKEYS sums to {total} but KEYS has {flat.shape[0]} keys"
            )
        # Samples = the fewest that can hold every table's keys; equals upstream's
        # len(KEYS) / sum(maxnum) for full requests (docs/upstream-notes.md).
        per_table = [-(-c // m) for c, m in zip(counts, self._maxnum)]
        num_samples = max(per_table)
        if num_samples > self.params.max_batch_size:
            worst = per_table.index(num_samples)
            raise RequestError(
                f"model '{name}': request holds {num_samples} samples (table "
                f"'{self.params.tables[worst].name}': {counts[worst]} keys at most "
                f"{self._maxnum[worst]} per sample), more than max_batch_size "
                f"{self.params.max_batch_size}"
            )
        return LookupRequest(np.ascontiguousarray(flat), counts, num_samples)

    def output_size(self, request: LookupRequest) -> int:
        """Floats in the answer: ``sum_t counts[t] * vec_size[t]``."""
        return sum(c * v for c, v in zip(request.counts, self._vec))

    # -- lookup -------------------------------------------------------------------------
    def lookup(self, request: LookupRequest) -> np.ndarray:
        """The flat float32 answer to one request."""
        return self.lookup_many([request])[0]

    def lookup_many(self, requests: Sequence[LookupRequest]) -> List[np.ndarray]:
        """Answer several requests with one native lookup per table.

        The keys every request holds for table t are gathered into one array and looked
        up in one call (the cache's hit rate still judged per request); each request's
        answer is then assembled from its slices.
        """
        if not requests:
            return []
        if len(requests) == 1:
            return [self._lookup_one(requests[0])]
        offsets = np.zeros((len(requests), self.params.num_tables + 1), dtype=np.int64)
        offsets[:, 1:] = np.cumsum([r.counts for r in requests], axis=1)
        per_table = []
        exact = [r.exact for r in requests]
        defaults = np.zeros((len(requests), len(DEFAULT_CAUSES)), dtype=np.int64)
        for t, table in enumerate(self.cached_tables):
            keys = np.concatenate(
                [r.keys[offsets[i, t] : offsets[i, t + 1]] for i, r in enumerate(requests)]
            )
            buf = np.empty((keys.shape[0], table.vec_size), dtype=np.float32)
            table.lookup(keys, buf, [r.counts[t] for r in requests], exact, defaults)
            per_table.append(buf)
        for r, d in zip(requests, defaults):
            r.defaults[:] = d
        answers = []
        starts = np.zeros(self.params.num_tables, dtype=np.int64)
        for r in requests:
            out = np.empty(self.output_size(r), dtype=np.float32)
            pos = 0
            for t in range(self.params.num_tables):
                n = r.counts[t]
                block = per_table[t][starts[t] : starts[t] + n]
                out[pos : pos + block.size] = block.reshape(-1)
                pos += block.size
                starts[t] += n
            answers.append(out)
        return answers

    def _lookup_one(self, r: LookupRequest) -> np.ndarray:
        # One request: look up straight into the response buffer, table by table.
        out = np.empty(self.output_size(r), dtype=np.float32)
        pos = key_pos = 0
        for t, table in enumerate(self.cached_tables):
            n = r.counts[t]
            size = n * table.vec_size
            table.lookup(
                r.keys[key_pos : key_pos + n],
                out[pos : pos + size].reshape(n, table.vec_size),
                None,
                (r.exact,),
                r.defaults.reshape(1, -1),  # a view: the counts land in the request
            )
            pos += size
            key_pos += n
        return out
