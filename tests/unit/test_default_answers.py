"""Visible default answers (issue 15): per request and by cause, the keys answered with
the default value; ``exact`` requests; the per-table counter; the response fields."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from tests.fake_pb_utils import make_module
from triton_rec.cache.cached_table import (
    DEFAULT_CAUSES,
    BackgroundInserter,
    CachedTable,
    new_default_counts,
)
from triton_rec.cache.shm_cache import SharedEmbeddingCache
from triton_rec.config.model_config import DEFAULT_INFO, HPS_INFO_OUTPUTS
from triton_rec.errors import RequestError
from triton_rec.storage.backing_store import LocalTableStore
from triton_rec.storage.table import EmbeddingTable
from triton_rec.triton.request_loop import Responder, exact_requested

VEC = 4
UNKNOWN = np.array([-5, -6, -7], np.int64)  # in no table


@pytest.fixture
def store():
    keys = np.arange(1000, dtype=np.int64)
    vecs = (keys[:, None] + np.arange(VEC)).astype(np.float32)
    return LocalTableStore(EmbeddingTable("t", keys, vecs, default_value=-1.0))


@pytest.fixture
def cache():
    c = SharedEmbeddingCache.open(f"test-defaults-{uuid.uuid4().hex[:8]}", 4096, VEC)
    yield c
    c.close()


def _lookup(ct, requests, exact=None):
    keys = np.concatenate(requests)
    out = np.empty((keys.shape[0], VEC), np.float32)
    defaults = np.zeros((len(requests), len(DEFAULT_CAUSES)), np.int64)
    ct.lookup(keys, out, [len(r) for r in requests], exact, defaults)
    return out, defaults


def test_keys_in_no_tier_are_counted_per_request_without_a_cache(store):
    ct = CachedTable("t", store)
    out, d = _lookup(ct, [np.array([1, 2, -5]), np.array([3]), UNKNOWN])
    assert d.tolist() == [[1, 0], [0, 0], [3, 0]]
    assert (out[[2, 4, 5, 6]] == -1.0).all()
    assert ct.stats.snapshot()["not_found"] == 4


def test_each_cause_is_counted_for_its_own_request(store, cache):
    inserter = BackgroundInserter()
    ct = CachedTable("t", store, cache, hit_rate_threshold=0.5, inserter=inserter)
    warm = np.arange(100, 110)
    _lookup(ct, [warm])  # hit rate 0 < 0.5: fetched and cached
    # request 0: 10 hits + 1 new key (hit rate 10/11): the miss is answered at once
    # request 1: cold (hit rate 0): fetched now; one of its keys is in no table
    _, d = _lookup(ct, [np.append(warm, 500), np.array([600, 601, -5])])
    assert d.tolist() == [[0, 1], [1, 0]]
    assert inserter.drain()
    snap = ct.stats.snapshot()
    assert snap["default_answered"] == 1 and snap["not_found"] == 1
    inserter.close()


def test_an_exact_request_fetches_its_misses_whatever_the_hit_rate(store, cache):
    inserter = BackgroundInserter()
    ct = CachedTable("t", store, cache, hit_rate_threshold=0.0, inserter=inserter)  # never wait
    a, b = np.array([10, 11]), np.array([20, 21])
    out, d = _lookup(ct, [a, b], exact=[True, False])
    assert d.tolist() == [[0, 0], [0, 2]]
    np.testing.assert_array_equal(out[:2], store.table.vectors[[10, 11]])
    assert (out[2:] == -1.0).all()  # the other request's misses: the default, at once
    out, d = _lookup(ct, [np.array([30, -6])], exact=[True])
    assert d.tolist() == [[1, 0]]  # exact, and still not in any table: not_found
    inserter.close()


def test_keys_no_tier_holds_are_not_cached(store, cache):
    ct = CachedTable("t", store, cache, hit_rate_threshold=1.5)
    _lookup(ct, [np.array([1, -5])])
    _, d = _lookup(ct, [np.array([1, -5])])
    assert d.tolist() == [[1, 0]]  # asked again, counted again (never a silent default)
    assert -5 not in set(cache.keys().tolist())


class _Req:
    def __init__(self, params):
        self._p = params

    def parameters(self):
        return self._p


@pytest.mark.parametrize(
    "raw, want",
    [
        ("{}", False),
        (json.dumps({"exact": True}), True),
        (json.dumps({"exact": False, "other": 3}), False),
        (json.dumps({"exact": "TRUE"}), True),
        ({"exact": True}, True),
        (None, False),
    ],
)
def test_the_exact_parameter_is_a_bool_or_its_string(raw, want):
    assert exact_requested("m", _Req(raw)) is want


@pytest.mark.parametrize("bad", [1, "yes", None, [True]])
def test_a_malformed_exact_parameter_is_refused_by_name(bad):
    with pytest.raises(RequestError, match=r"model 'm': request parameter 'exact' must be a bool"):
        exact_requested("m", _Req(json.dumps({"exact": bad})))


def test_the_response_carries_the_counts_as_the_declared_outputs():
    pb = make_module()
    assert set(DEFAULT_INFO) <= set(HPS_INFO_OUTPUTS)

    class Parsed:
        num_samples = 3
        defaults = new_default_counts()

    Parsed.defaults[:] = [4, 2]
    resp = Responder(pb, "OUTPUT0", ("DefaultNotFound", "DefaultAsync"), 0)(
        Parsed(), np.zeros(6, np.float32)
    )
    assert resp.output("DefaultNotFound").tolist() == [4]
    assert resp.output("DefaultAsync").tolist() == [2]


def test_the_names_both_sides_use_come_from_the_native_core():
    """The response fields, the request parameter, the causes and the native counters are
    defined once (src/native/seam.hpp) and taken from there; each counter the native side
    keeps is one TableStats reports."""
    from triton_rec import _native
    from triton_rec.cache.cached_table import NATIVE_FIELDS, TableStats
    from triton_rec.config.model_config import EXACT_PARAMETER

    assert DEFAULT_INFO == _native.DEFAULT_INFO == ("DefaultNotFound", "DefaultAsync")
    assert EXACT_PARAMETER == _native.EXACT_PARAMETER == "exact"
    assert DEFAULT_CAUSES == _native.DEFAULT_CAUSES == ("not_found", "async")
    assert NATIVE_FIELDS == _native.TABLE_STAT_FIELDS
    stats = TableStats()
    stats.native[:] = np.arange(1, len(NATIVE_FIELDS) + 1)
    snap = stats.snapshot()
    assert [snap[f] for f in NATIVE_FIELDS] == list(range(1, len(NATIVE_FIELDS) + 1))
