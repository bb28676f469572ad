"""open_session: node-local tables and one shared cache per (model, device, table)."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from triton_rec.cache.array_cache import CupyUnavailableError
from triton_rec.config.ps_json import parse_ps_config
from triton_rec.serving.deployment import InstanceSpec, cache_capacity, open_session

SEED = 9
TABLES = [
    SyntheticTable("a", rows=3000, vec_size=16, max_keys_per_sample=2, default_value=-1.0),
    SyntheticTable("b", rows=500, vec_size=4, max_keys_per_sample=1, default_value=-2.0),
]


@pytest.fixture
def params(tmp_path):
    def make(**over):
        entry = write_model(
            str(tmp_path / "repo"), f"m{abs(hash(tuple(over.items()))) % 10**6}", TABLES, SEED
        )
        entry.update({"gpucacheper": 0.5, **over})
        return parse_ps_config(
            {"supportlonglong": True, "models": [entry]}, base_dir=str(tmp_path / "repo")
        ).models[0]

    return make


def _request(session, rng, samples=2):
    keys = [
        rng.choice(table_keys(SEED, t, s.rows), samples * s.max_keys_per_sample)
        for t, s in enumerate(TABLES)
    ]
    counts = np.array([len(k) for k in keys], np.int32)
    return keys, session.parse_request(np.concatenate(keys), counts)


def _truth(keys):
    return np.concatenate(
        [expected_vectors(SEED, t, k, TABLES[t].vec_size).reshape(-1) for t, k in enumerate(keys)]
    )


def test_two_sessions_of_one_model_share_tables_and_caches(params, tmp_path):
    p = params(hit_rate_threshold=0.0)  # misses: default now, inserted in the background
    spec = InstanceSpec(store_dir=str(tmp_path / "store"))
    a, b = open_session(p, spec), open_session(p, spec)
    try:
        assert [t.layout_path for t in a.tables] == [t.layout_path for t in b.tables]
        assert [ct.cache.path for ct in a.cached_tables] == [
            ct.cache.path for ct in b.cached_tables
        ]
        keys, req = _request(a, np.random.default_rng(0))
        first = a.lookup(req)
        assert np.all(first[: len(keys[0]) * 16] == -1.0)  # cold: defaults
        assert a.inserter.drain()
        np.testing.assert_array_equal(b.lookup(req), _truth(keys))  # b hits what a inserted
        assert b.cached_tables[0].stats.snapshot()["hits"] == len(keys[0])
    finally:
        a.close()
        b.close()
    assert not glob.glob(f"/dev/shm/trec_{p.model}.*") + glob.glob(
        f"/dev/shm/trec-ns-*/trec_{p.model}.*"
    )


def test_a_new_table_content_gets_a_new_cache(params, tmp_path):
    spec = InstanceSpec(store_dir=str(tmp_path / "store"))
    p = params()
    s1 = open_session(p, spec)
    try:
        name1 = s1.cached_tables[0].cache.path
    finally:
        s1.close()
    # Rewrite the first table with other content (another seed): another digest, another cache.
    write_model(str(tmp_path / "repo"), p.model, TABLES, seed=SEED + 1)
    s2 = open_session(p, spec)
    try:
        assert s2.cached_tables[0].cache.path != name1
    finally:
        s2.close()


def test_init_ec_fills_an_empty_shared_cache(params, tmp_path):
    p = params(init_ec=True)
    s = open_session(p, InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        for t, (ct, spec) in enumerate(zip(s.cached_tables, TABLES)):
            # Set-associative: `capacity` random keys fill most, not all, of the ways.
            assert ct.cache.size() >= 0.8 * min(ct.cache.capacity, spec.rows)
            keys = np.asarray(ct.cache.keys())
            out = np.empty((keys.shape[0], spec.vec_size), np.float32)
            assert ct.cache.query(keys, out, np.zeros(keys.shape[0], np.uint8)) == keys.shape[0]
            np.testing.assert_array_equal(out, expected_vectors(SEED, t, keys, spec.vec_size))
    finally:
        s.close()


def test_gpucache_off_means_no_cache(params, tmp_path):
    s = open_session(params(gpucache=False), InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        assert all(ct.cache is None for ct in s.cached_tables)
        keys, req = _request(s, np.random.default_rng(1))
        np.testing.assert_array_equal(s.lookup(req), _truth(keys))
    finally:
        s.close()


def test_cache_capacity_follows_gpucacheper(params):
    class T:
        num_rows = 1001

    assert cache_capacity(params(gpucacheper=0.1), T) == 101
    assert cache_capacity(params(gpucacheper=0.0), T) == 0


def test_a_gpu_instance_without_cupy_fails_clearly_and_leaves_nothing(params, tmp_path):
    p = params()
    with pytest.raises(CupyUnavailableError, match="(?i)cupy"):
        open_session(p, InstanceSpec(kind="GPU", device_id=0, store_dir=str(tmp_path / "store")))
    assert not [e for e in os.listdir("/dev/shm") if p.model in e]
    assert not glob.glob(f"/dev/shm/trec-ns-*/*{p.model}*")


def test_a_device_cache_is_named_after_the_model_version_and_the_server(params, monkeypatch):
    from triton_rec.serving import deployment

    p = params()

    class T:
        path = "/store/layouts/0123456789abcdef0123.tbl"

    tp = p.tables[0]
    cpu = deployment.cache_name(p, InstanceSpec(model_version="1"), tp, T)
    assert cpu == deployment.cache_name(p, InstanceSpec(model_version="2"), tp, T)
    gpu = {
        v: deployment.cache_name(p, InstanceSpec(kind="GPU", model_version=v), tp, T)
        for v in ("1", "2")
    }
    assert gpu["1"] != gpu["2"] and ".v1.gpu0." in gpu["1"] and ".v2.gpu0." in gpu["2"]
    assert gpu["1"].endswith("." + deployment.server_token())
    monkeypatch.setattr(deployment, "server_token", lambda: "another-server")
    assert deployment.cache_name(p, InstanceSpec(kind="GPU", model_version="1"), tp, T) != gpu["1"]
