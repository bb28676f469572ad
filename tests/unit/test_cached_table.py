"""A cache in front of a backing store: HPS hit-rate-threshold semantics, refresh, warm-up.

Runs against both real cache implementations (the native shared-memory CPU cache and
the numpy run of the array-API device cache)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from triton_rec.cache.array_cache import ArrayEmbeddingCache
from triton_rec.cache.cached_table import BackgroundInserter, CachedTable, Refresher
from triton_rec.cache.shm_cache import SharedEmbeddingCache
from triton_rec.storage.backing_store import LocalTableStore
from triton_rec.storage.table import EmbeddingTable

VEC = 8
ROWS = 2000
DEFAULT = -3.0


def _truth(keys):
    return (np.asarray(keys, np.float64)[:, None] * 1e-3 + np.arange(VEC)).astype(np.float32)


@pytest.fixture
def table():
    keys = np.random.default_rng(0).permutation(np.arange(ROWS, dtype=np.int64) * 3 + 1)
    return EmbeddingTable("t", keys, _truth(keys), DEFAULT)


class _ArrayCache:
    """The array-API cache's numpy view, with the capacity/size the session uses."""

    def __init__(self, capacity):
        self.cache = ArrayEmbeddingCache(capacity, VEC, ways=8, policy="lru")
        self.view = self.cache.host_view()
        self.capacity = self.cache.capacity
        self.vec_size = VEC

    def __getattr__(self, name):
        return getattr(self.view, name)

    def size(self):
        return self.cache.size()

    def close(self):
        pass


@pytest.fixture(params=["shm", "array"])
def make_cache(request):
    opened = []

    def make(capacity):
        if request.param == "shm":
            c = SharedEmbeddingCache.open(f"test-ct-{uuid.uuid4().hex[:10]}", capacity, VEC)
        else:
            c = _ArrayCache(capacity)
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.close()


def test_below_the_threshold_misses_are_fetched_and_answered_correctly(table, make_cache):
    cache = make_cache(ROWS)
    ct = CachedTable("t", LocalTableStore(table), cache, hit_rate_threshold=1.1)
    keys = table.keys[:50].copy()
    out = np.empty((50, VEC), np.float32)
    assert ct.lookup(keys, out) == 0  # all misses, fetched synchronously
    np.testing.assert_array_equal(out, _truth(keys))
    out2 = np.zeros_like(out)
    assert ct.lookup(keys, out2) == 50  # inserted before returning: now all hits
    np.testing.assert_array_equal(out2, _truth(keys))
    s = ct.stats.snapshot()
    assert (s["lookups"], s["hits"], s["misses"], s["sync_fetched"]) == (100, 50, 50, 50)


def test_at_or_above_the_threshold_misses_get_defaults_and_are_inserted_behind(table, make_cache):
    cache = make_cache(ROWS)
    inserter = BackgroundInserter()
    try:
        ct = CachedTable(
            "t", LocalTableStore(table), cache, hit_rate_threshold=0.5, inserter=inserter
        )
        warm = table.keys[:30].copy()
        ct.lookup(warm, np.empty((30, VEC), np.float32))  # 0% hit rate < 0.5: synchronous
        assert inserter.drain()
        cold = table.keys[30:40].copy()
        keys = np.concatenate([warm, cold])  # 75% hit rate >= 0.5
        out = np.empty((40, VEC), np.float32)
        assert ct.lookup(keys, out) == 30
        np.testing.assert_array_equal(out[:30], _truth(warm))
        assert np.all(out[30:] == DEFAULT)  # answered at once with the default value
        assert inserter.drain()
        out[:] = 0
        assert ct.lookup(keys, out) == 40  # the background inserter put them in
        np.testing.assert_array_equal(out, _truth(keys))
        s = ct.stats.snapshot()
        assert s["default_answered"] == 10 and s["queued"] == 10 and s["dropped"] == 0
    finally:
        inserter.close()


def test_the_threshold_is_inclusive(table, make_cache):
    cache = make_cache(ROWS)
    inserter = BackgroundInserter()
    try:
        ct = CachedTable(
            "t", LocalTableStore(table), cache, hit_rate_threshold=0.5, inserter=inserter
        )
        ct.lookup(table.keys[:2].copy(), np.empty((2, VEC), np.float32))
        keys = table.keys[:4].copy()  # exactly 50% hits
        out = np.empty((4, VEC), np.float32)
        ct.lookup(keys, out)
        assert np.all(out[2:] == DEFAULT)
    finally:
        inserter.close()


def test_a_cold_request_merged_with_warm_ones_is_judged_on_its_own(table, make_cache):
    # HPS computes the hit rate per request: merged in one lookup (one execute), the cold
    # request (0% hits) is fetched synchronously, the warm one (90%) gets defaults.
    cache = make_cache(ROWS)
    inserter = BackgroundInserter()
    try:
        ct = CachedTable(
            "t", LocalTableStore(table), cache, hit_rate_threshold=0.8, inserter=inserter
        )
        ct.lookup(table.keys[:90].copy(), np.empty((90, VEC), np.float32))  # warm 90 keys
        warm = table.keys[:100].copy()  # 90 cached + 10 not: 90%
        cold = table.keys[500:510].copy()  # none cached: 0%
        keys = np.concatenate([warm, cold])  # 90 / 110 = 82% over the merged batch
        out = np.empty((110, VEC), np.float32)
        ct.lookup(keys, out, segments=[100, 10])
        np.testing.assert_array_equal(out[:90], _truth(warm[:90]))
        assert np.all(out[90:100] == DEFAULT)  # warm request: its misses deferred
        np.testing.assert_array_equal(out[100:], _truth(cold))  # cold one: fetched now
        s = ct.stats.snapshot()
        assert s["default_answered"] == 10 and s["sync_fetched"] == 10 + 90
    finally:
        inserter.close()


def test_the_hit_rate_counts_each_key_of_a_request_once(table, make_cache):
    # 1 cached key asked 9 times + 1 uncached key: 90% of the keys, 50% of the unique
    # keys. HPS counts unique keys, so with threshold 0.6 the miss is fetched.
    cache = make_cache(ROWS)
    inserter = BackgroundInserter()
    try:
        ct = CachedTable(
            "t", LocalTableStore(table), cache, hit_rate_threshold=0.6, inserter=inserter
        )
        ct.lookup(table.keys[:1].copy(), np.empty((1, VEC), np.float32))
        keys = np.array([table.keys[0]] * 9 + [table.keys[1]], np.int64)
        out = np.empty((10, VEC), np.float32)
        ct.lookup(keys, out)
        np.testing.assert_array_equal(out, _truth(keys))
        assert ct.stats.snapshot()["default_answered"] == 0
    finally:
        inserter.close()


def test_an_exact_table_never_answers_a_stored_key_with_the_default(table, make_cache):
    # static tables (embedding_cache_type static): misses are always fetched, also with a
    # hit rate far above the threshold
    cache = make_cache(ROWS)
    inserter = BackgroundInserter()
    try:
        ct = CachedTable(
            "t",
            LocalTableStore(table),
            cache,
            hit_rate_threshold=0.0,
            inserter=inserter,
            exact=True,
        )
        ct.lookup(table.keys[:99].copy(), np.empty((99, VEC), np.float32))
        keys = table.keys[:100].copy()
        out = np.empty((100, VEC), np.float32)
        ct.lookup(keys, out)
        np.testing.assert_array_equal(out, _truth(keys))
        assert ct.stats.snapshot()["default_answered"] == 0
    finally:
        inserter.close()


def test_unknown_keys_get_the_default_in_both_paths(table, make_cache):
    cache = make_cache(ROWS)
    ct = CachedTable("t", LocalTableStore(table), cache, hit_rate_threshold=1.1)
    keys = np.array([0, 2, int(table.keys[0])], np.int64)  # 0 and 2 are in no table
    out = np.empty((3, VEC), np.float32)
    ct.lookup(keys, out)
    assert np.all(out[:2] == DEFAULT)
    np.testing.assert_array_equal(out[2], _truth(keys[2:])[0])


def test_a_small_cache_evicts_but_answers_stay_correct(table, make_cache):
    cache = make_cache(64)
    ct = CachedTable("t", LocalTableStore(table), cache, hit_rate_threshold=1.1)
    rng = np.random.default_rng(1)
    for _ in range(30):
        keys = rng.choice(table.keys, 100)
        out = np.empty((100, VEC), np.float32)
        ct.lookup(keys, out)
        np.testing.assert_array_equal(out, _truth(keys))
    assert cache.size() <= cache.capacity
    assert cache.stats()["evictions"] > 0


def test_refresh_rereads_cached_rows_from_the_store(table, make_cache):
    cache = make_cache(ROWS)
    keys = table.keys[:100].copy()
    # Put stale vectors in the cache, as if the store had been updated since.
    cache.insert(keys, np.zeros((100, VEC), np.float32))
    ct = CachedTable("t", LocalTableStore(table), cache, hit_rate_threshold=1.1)
    # one pass re-reads every cached row (HPS), in chunks of 25% of the cache
    assert ct.refresh(0.25) == 100
    out = np.empty((100, VEC), np.float32)
    assert ct.lookup(keys, out) == 100
    np.testing.assert_array_equal(out, _truth(keys))
    assert ct.stats.snapshot()["refreshed"] == 100
    assert ct.refresh(0.0) == 0  # <= 0 disables refresh (HPS)


def test_the_refresher_thread_runs_on_its_interval(table, make_cache):
    cache = make_cache(ROWS)
    keys = table.keys[:20].copy()
    cache.insert(keys, np.zeros((20, VEC), np.float32))
    ct = CachedTable("t", LocalTableStore(table), cache)
    r = Refresher([ct], interval=0.05, fraction=1.0)
    try:
        out = np.empty((20, VEC), np.float32)
        for _ in range(200):
            ct.cache.query(keys, out, np.zeros(20, np.uint8))
            if np.array_equal(out, _truth(keys)):
                break
            r._stop.wait(0.02)
        np.testing.assert_array_equal(out, _truth(keys))
    finally:
        r.close()


def test_warm_up_fills_the_cache_from_the_store(table, make_cache):
    cache = make_cache(256)
    ct = CachedTable("t", LocalTableStore(table), cache)
    n = ct.warm_up(cache.capacity)
    assert n == cache.capacity and cache.size() > 0
    keys = np.asarray(cache.keys())
    out = np.empty((keys.shape[0], VEC), np.float32)
    hit = np.zeros(keys.shape[0], np.uint8)
    assert cache.query(keys, out, hit) == keys.shape[0]
    np.testing.assert_array_equal(out, _truth(keys))


def test_no_cache_means_the_store_answers_everything(table):
    ct = CachedTable("t", LocalTableStore(table), None)
    keys = table.keys[:10].copy()
    out = np.empty((10, VEC), np.float32)
    assert ct.lookup(keys, out) == 0
    np.testing.assert_array_equal(out, _truth(keys))


@pytest.mark.parametrize("seed", range(4))
def test_distinct_hit_counts_match_numpy_unique_per_request(seed):
    # the native kernel behind the per-request hit rate: (distinct keys, distinct hits)
    from triton_rec import _native

    rng = np.random.default_rng(seed)
    keys = rng.integers(-50, 50, 3000).astype(np.int64)  # many repeats, negative keys too
    flags = rng.random(101) < 0.7
    hit = flags[keys + 50].astype(np.uint8)  # a key's copies share one flag
    lengths = rng.integers(0, 400, 12)
    lengths[-1] = 0  # an empty request
    keys, hit = keys[: lengths.sum()], hit[: lengths.sum()]
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    got = _native.distinct_hit_counts(keys, hit, bounds)
    for j in range(len(lengths)):
        seg = slice(bounds[j], bounds[j + 1])
        _, first = np.unique(keys[seg], return_index=True)
        assert got[j].tolist() == [first.size, int(hit[seg][first].sum())]
    past_the_end = bounds.copy()
    past_the_end[-1] += 1
    with pytest.raises(ValueError, match="bounds must run from 0 to len"):
        _native.distinct_hit_counts(keys, hit, past_the_end)
