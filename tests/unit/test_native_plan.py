"""What the native backend's hot path is handed (LookupSession.native_plan) and the
Python half it calls back (CachedTable.finish_query): checked through the addresses
themselves, as the C++ side reads them."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from triton_rec.cache.cached_table import NATIVE_FIELDS, CachedTable
from triton_rec.config.ps_json import parse_ps_config
from triton_rec.serving.deployment import InstanceSpec, open_session
from triton_rec.serving.session import LookupSession
from triton_rec.storage.backing_store import DictStore

SEED = 4
TABLES = [
    SyntheticTable("a", rows=2000, vec_size=8, max_keys_per_sample=3, default_value=-1.0),
    SyntheticTable("b", rows=300, vec_size=4, max_keys_per_sample=1, default_value=-2.0),
]


@pytest.fixture
def session(tmp_path, request):
    entry = write_model(str(tmp_path / "repo"), "m", TABLES, SEED)
    entry.update(request.param)
    params = parse_ps_config(
        {"supportlonglong": True, "models": [entry]}, base_dir=str(tmp_path / "repo")
    ).models[0]
    s = open_session(params, InstanceSpec(store_dir=str(tmp_path / "store")))
    yield s
    s.close()


def _floats(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(addr)).copy()


@pytest.mark.parametrize("session", [{"gpucache": False}], indirect=True)
def test_without_a_cache_the_plan_points_at_the_mapped_index_and_vectors(session):
    plan = session.native_plan()
    assert plan.max_batch_size == session.params.max_batch_size
    assert plan.maxnum == [3, 1]
    for entry, ct, spec in zip(plan.tables, session.cached_tables, TABLES):
        assert entry.cache is None and entry.misses is None and entry.finish is None
        table = ct.store.table
        vec_addr, rows = entry.vectors
        assert rows == spec.rows and entry.vec_size == spec.vec_size
        first_rows = _floats(vec_addr, 2 * spec.vec_size)
        np.testing.assert_array_equal(first_rows, table.vectors[:2].ravel())
        index_addr, capacity = entry.index
        assert capacity == table.index.shape[0]
        slots = np.ctypeslib.as_array((ctypes.c_int64 * 4).from_address(index_addr))
        np.testing.assert_array_equal(slots, table.index.ravel()[:4])
        assert entry.default_value == spec.default_value


@pytest.mark.parametrize("session", [{"gpucache": True, "gpucacheper": 0.5}], indirect=True)
def test_with_a_cache_the_plan_points_at_the_shared_segment(session):
    plan = session.native_plan()
    for entry, ct in zip(plan.tables, session.cached_tables):
        addr, size = entry.cache
        assert entry.index is None and entry.misses == ct.local_misses.address
        # the same bytes the session's own mapping holds (the segment's header)
        head = bytes((ctypes.c_char * 64).from_address(addr))
        assert head == bytes(ct.cache._mm[:64])
        assert size >= ct.cache.capacity * ct.vec_size * 4


@pytest.mark.parametrize("session", [{"gpucache": True}], indirect=True)
def test_what_the_hot_path_counts_shows_in_the_table_statistics(session):
    ct = session.cached_tables[0]
    addr = session.native_plan().tables[0].stats
    counters = np.ctypeslib.as_array((ctypes.c_int64 * len(NATIVE_FIELDS)).from_address(addr))
    before = ct.stats.snapshot()
    counters[NATIVE_FIELDS.index("lookups")] += 7
    counters[NATIVE_FIELDS.index("hits")] += 5
    after = ct.stats.snapshot()
    assert after["lookups"] - before["lookups"] == 7
    assert after["hits"] - before["hits"] == 5
    assert after["misses"] == before["misses"]


def test_a_store_that_is_not_node_local_and_has_no_cache_gets_no_plan():
    params = parse_ps_config(
        {
            "supportlonglong": True,
            "models": [
                {
                    "model": "d",
                    "sparse_files": ["x"],
                    "embedding_vecsize_per_table": [4],
                    "maxnum_catfeature_query_per_table_per_sample": [1],
                    "gpucache": False,
                }
            ],
        },
        base_dir=".",
    ).models[0]
    store = DictStore(4, default_value=0.0)
    s = LookupSession(params, [CachedTable("t", store)])
    assert s.native_plan() is None


@pytest.mark.parametrize("session", [{"gpucache": True, "hit_rate_threshold": 1.1}], indirect=True)
def test_finish_query_after_an_outside_query_answers_like_lookup(session):
    """The native path queries the cache itself, then hands the misses over."""
    ct = session.cached_tables[0]
    rng = np.random.default_rng(2)
    keys = rng.choice(table_keys(SEED, 0, TABLES[0].rows), 40, replace=False).astype(np.int64)
    ct.lookup(keys[:10], np.empty((10, 8), np.float32))  # some keys cached, the rest not
    out = np.empty((40, 8), np.float32)
    hit = np.empty(40, np.uint8)
    hits = ct.cache.query(keys, out, hit)
    assert 0 < hits < 40
    before = ct.stats.snapshot()
    assert ct.finish_query(keys, out, hit, hits, query_ns=1000) == hits
    np.testing.assert_array_equal(out, expected_vectors(SEED, 0, keys, 8))
    snap = {k: v - before[k] for k, v in ct.stats.snapshot().items()}
    assert (snap["lookups"], snap["hits"], snap["sync_fetched"]) == (40, hits, 40 - hits)
    assert snap["cache_ns"] >= 1000
