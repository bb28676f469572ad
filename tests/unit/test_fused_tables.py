"""HPS's table fusion (top-level ``fuse_embedding_table``, HugeCTR v23.09 inference_utils.cpp
L260-364): tables of one vector size share one Redis/RocksDB table and update topic,
``hps_et.<model>.fused_embedding<k>``, groups in ascending vector size. A database HPS
filled that way is served; our own import puts each member's rows into the fused table."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.hps_layout import write_hps_redis, write_hps_rocksdb
from tests.storage_fixtures import redis_cluster, rocksdb_dir  # noqa: F401
from triton_rec.config.ps_json import fused_table_names, parse_ps_config
from triton_rec.serving.deployment import InstanceSpec, open_session
from triton_rec.storage.backing_store import tier_table_name
from triton_rec.storage.redis_store import RedisClusterStore

SEED = 9
TABLES = [  # x and z share a vector size: one fused table
    SyntheticTable("x", rows=800, vec_size=8, max_keys_per_sample=2, default_value=-1.0),
    SyntheticTable("y", rows=300, vec_size=4, max_keys_per_sample=1, default_value=-2.0),
    SyntheticTable("z", rows=500, vec_size=8, max_keys_per_sample=3, default_value=-1.0),
]
_models = (f"fuse{i}" for i in itertools.count())


def test_fused_names_group_by_vector_size_in_ascending_order():
    assert fused_table_names([8, 4, 8, 16]) == [
        "fused_embedding1",
        "fused_embedding0",
        "fused_embedding1",
        "fused_embedding2",
    ]


def _params(tmp_path, model, top=True, **tiers):
    entry = write_model(str(tmp_path / "repo"), model, TABLES, SEED)
    entry.update(gpucache=False)
    doc = {"supportlonglong": True, "models": [entry], "fuse_embedding_table": top, **tiers}
    return parse_ps_config(doc, base_dir=str(tmp_path / "repo")).models[0]


def test_fusion_is_off_by_default_and_a_model_can_opt_out(tmp_path):
    assert [t.tier_name for t in _params(tmp_path, "m0", top=False).tables] == ["x", "y", "z"]
    p = _params(tmp_path, "m1")
    assert [t.tier_name for t in p.tables] == [
        "fused_embedding1",
        "fused_embedding0",
        "fused_embedding1",
    ]
    entry = write_model(str(tmp_path / "repo"), "m2", TABLES, SEED)
    entry["fuse_embedding_table"] = False
    doc = {"supportlonglong": True, "models": [entry], "fuse_embedding_table": True}
    assert [t.tier_name for t in parse_ps_config(doc, str(tmp_path)).models[0].tables] == [
        "x",
        "y",
        "z",
    ]


def _request(session, seed):
    rng = np.random.default_rng(seed)
    keys = [
        rng.choice(table_keys(SEED, t, s.rows), 32 * s.max_keys_per_sample)
        for t, s in enumerate(TABLES)
    ]
    counts = np.array([len(k) for k in keys], np.int32)
    return keys, session.parse_request(np.concatenate(keys), counts)


def _hps_rows(scale):
    """{fused table: (keys, vectors)} as HPS fills it: member rows concatenated raw."""
    names = fused_table_names([t.vec_size for t in TABLES])
    out = {}
    for t, (s, fused) in enumerate(zip(TABLES, names)):
        k = table_keys(SEED, t, s.rows)
        v = scale * expected_vectors(SEED, t, k, s.vec_size)
        ok, ov = out.get(fused, (np.empty(0, np.int64), np.empty((0, s.vec_size), np.float32)))
        out[fused] = (np.concatenate([ok, k]), np.concatenate([ov, v]))
    return out


def _truth(keys, scale=1.0):
    return np.concatenate(
        [
            scale * expected_vectors(SEED, t, k, TABLES[t].vec_size).reshape(-1)
            for t, k in enumerate(keys)
        ]
    )


def test_a_redis_hps_filled_with_fused_tables_is_served(tmp_path, redis_cluster):  # noqa: F811
    model = next(_models)
    for fused, (k, v) in _hps_rows(-3.0).items():
        write_hps_redis(redis_cluster, tier_table_name(model, fused), k, v, num_partitions=4)
    vol = {"type": "redis_cluster", "address": redis_cluster.address, "num_partitions": 4}
    p = _params(tmp_path, model, volatile_db=vol)
    p = dataclasses.replace(p, freeze_sparse=True)  # serve HPS's rows as they are
    session = open_session(p, InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        keys, req = _request(session, 1)
        np.testing.assert_array_equal(session.lookup(req), _truth(keys, -3.0))
    finally:
        session.close()


def test_a_rocksdb_hps_filled_with_fused_tables_is_served(tmp_path, rocksdb_dir):  # noqa: F811
    model = next(_models)
    for fused, (k, v) in _hps_rows(-3.0).items():
        write_hps_rocksdb(rocksdb_dir, tier_table_name(model, fused), k, v)
    per = {"type": "rocks_db", "path": str(rocksdb_dir), "read_only": True}
    p = _params(tmp_path, model, volatile_db={"type": "disabled"}, persistent_db=per)
    session = open_session(p, InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        keys, req = _request(session, 2)
        np.testing.assert_array_equal(session.lookup(req), _truth(keys, -3.0))
    finally:
        session.close()


@pytest.mark.parametrize("freeze", [False, True], ids=["import", "freeze_sparse"])
def test_our_import_puts_every_member_into_the_fused_table_once(
    tmp_path,
    redis_cluster,  # noqa: F811
    freeze,
):
    model = next(_models)
    vol = {"type": "redis_cluster", "address": redis_cluster.address, "num_partitions": 4}
    p = _params(tmp_path, model, volatile_db=vol)
    p = dataclasses.replace(p, freeze_sparse=freeze)
    spec = InstanceSpec(store_dir=str(tmp_path / "store"))
    for _ in range(2):  # the second load finds every member's marker
        session = open_session(p, spec)
        try:
            keys, req = _request(session, 3)
            np.testing.assert_array_equal(session.lookup(req), _truth(keys))
        finally:
            session.close()
    fused = RedisClusterStore(redis_cluster.address, tier_table_name(model, "fused_embedding1"), 8)
    try:
        assert fused.num_rows() == TABLES[0].rows + TABLES[2].rows
    finally:
        fused.close()


def test_an_update_of_a_fused_topic_reaches_the_fused_table_and_every_member_cache(
    tmp_path,
    redis_cluster,  # noqa: F811
):
    from triton_rec.updates.online import UpdateApplier

    model = next(_models)
    vol = {"type": "redis_cluster", "address": redis_cluster.address, "num_partitions": 4}
    p = _params(tmp_path, model, volatile_db=vol)
    p = dataclasses.replace(p, gpucache=True, hit_rate_threshold=2.0, gpucacheper=0.5)
    session = open_session(p, InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        keys, req = _request(session, 4)
        session.lookup(req)  # cached now
        kx, kz = keys[0][:2], keys[2][:2]
        k = np.concatenate([kx, kz])
        new = np.full((4, 8), 7.25, np.float32)
        apply = UpdateApplier(model, session.cached_tables, [t.tier_name for t in p.tables])
        apply(model, "fused_embedding1", k, new)  # one message of the fused topic
        for t, mk in ((0, kx), (2, kz)):
            ct = session.cached_tables[t]
            out = np.empty((2, 8), np.float32)
            assert ct.cache.query(mk, out, np.zeros(2, np.uint8)) == 2
            np.testing.assert_array_equal(out, 7.25)
            ct.store.fetch(mk, out)
            np.testing.assert_array_equal(out, 7.25)
    finally:
        session.close()
