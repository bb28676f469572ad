"""Storage tiers behind the cache, through ``open_session`` as a model instance opens them:
a real 3-master Redis Cluster and RocksDB in a temporary directory.

Expected values always come from the sparse files' generator
(``ps_loader.synthetic.expected_vectors``), never from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.hps_layout import write_hps_redis, write_hps_rocksdb
from tests.storage_fixtures import redis_cluster, rocksdb_dir, start_redis_cluster  # noqa: F401
from triton_rec.config.ps_json import parse_ps_config
from triton_rec.errors import ConfigError
from triton_rec.serving.deployment import InstanceSpec, open_session
from triton_rec.storage.backing_store import DictStore, StoreUnavailableError, tier_table_name
from triton_rec.storage.redis_store import RedisClusterStore
from triton_rec.storage.tiers import SOURCE_META, Tier, TieredStore

SEED = 5
TABLES = [
    SyntheticTable("a", rows=2000, vec_size=8, max_keys_per_sample=2, default_value=-1.0),
    SyntheticTable("b", rows=300, vec_size=4, max_keys_per_sample=1, default_value=-2.0),
]
_counter = iter(range(10**6))


@pytest.fixture
def make(tmp_path, rocksdb_dir):  # noqa: F811
    """``make(volatile=..., persistent=..., seed=..., model=..., **model_keys) -> ModelParams``."""

    def make(volatile=None, persistent=None, seed=SEED, model=None, **over):
        model = model or f"tier{next(_counter)}"
        entry = write_model(str(tmp_path / "repo"), model, TABLES, seed)
        entry.update({"gpucacheper": 0.3, **over})
        doc = {"supportlonglong": True, "models": [entry]}
        if volatile is not None:
            doc["volatile_db"] = volatile
        if persistent is not None:
            doc["persistent_db"] = {"path": str(rocksdb_dir), **persistent}
        return parse_ps_config(doc, base_dir=str(tmp_path / "repo")).models[0]

    return make


@pytest.fixture
def spec(tmp_path):
    return InstanceSpec(store_dir=str(tmp_path / "store"))


def redis(cluster, **over):
    return {"type": "redis_cluster", "address": cluster.address, "num_partitions": 4, **over}


ROCKS = {"type": "rocks_db"}


def request(session, seed=0, samples=64, unknown=4):
    """Known keys of every table plus ``unknown`` keys no file holds."""
    rng = np.random.default_rng(seed)
    keys = []
    for t, s in enumerate(TABLES):
        k = rng.choice(table_keys(SEED, t, s.rows), samples * s.max_keys_per_sample - unknown)
        keys.append(np.concatenate([k, rng.integers(2**62, 2**63 - 1, unknown, dtype=np.int64)]))
    counts = np.array([len(k) for k in keys], np.int32)
    return keys, session.parse_request(np.concatenate(keys), counts)


def truth(keys, seed=SEED):
    out = []
    for t, k in enumerate(keys):
        v = expected_vectors(seed, t, k, TABLES[t].vec_size)
        v[k >= 2**62] = TABLES[t].default_value  # the unknown keys
        out.append(v.reshape(-1))
    return np.concatenate(out)


TIER_CONFIGS = {
    "redis": lambda c: dict(volatile=redis(c)),
    "rocksdb": lambda c: dict(volatile={"type": "disabled"}, persistent=ROCKS),
    "redis+rocksdb, 30% in redis, misses copied": lambda c: dict(
        volatile=redis(c, initial_cache_rate=0.3, cache_missed_embeddings=True), persistent=ROCKS
    ),
    "hash_map+rocksdb": lambda c: dict(volatile={"type": "hash_map"}, persistent=ROCKS),
}


@pytest.mark.parametrize("gpucache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("config", list(TIER_CONFIGS))
def test_lookups_through_each_tier_match_the_source_files(
    make,
    spec,
    redis_cluster,  # noqa: F811
    config,
    gpucache,
):
    params = make(gpucache=gpucache, hit_rate_threshold=2.0, **TIER_CONFIGS[config](redis_cluster))
    session = open_session(params, spec)
    try:
        assert all(isinstance(ct.store, TieredStore) for ct in session.cached_tables)
        for seed in range(3):  # the second and third pass partly hit the cache
            keys, req = request(session, seed)
            np.testing.assert_array_equal(session.lookup(req), truth(keys))
        counters = session.cached_tables[0].store.counters()
        if config.startswith("redis+rocksdb"):
            assert counters["persistent_found"] > 0 and counters["promoted"] > 0
    finally:
        session.close()


def test_rows_copied_from_the_persistent_tier_are_then_served_by_redis(make, spec, redis_cluster):  # noqa: F811
    params = make(
        gpucache=False,
        volatile=redis(redis_cluster, initial_cache_rate=0.0, cache_missed_embeddings=True),
        persistent=ROCKS,
    )
    session = open_session(params, spec)
    try:
        keys, req = request(session, 1)
        np.testing.assert_array_equal(session.lookup(req), truth(keys))
        store = session.cached_tables[0].store
        first = store.counters()
        np.testing.assert_array_equal(session.lookup(req), truth(keys))
        second = store.counters()
        known = int((keys[0] < 2**62).sum())
        assert first.get("volatile_found", 0) == 0 and first["persistent_found"] == known
        assert second["volatile_found"] == known  # now in Redis
        assert second["persistent_found"] == known  # not asked again
    finally:
        session.close()


def test_import_runs_once_per_content_and_freeze_sparse_keeps_what_the_tier_holds(
    make, spec, redis_cluster, tmp_path
):  # noqa: F811
    model = f"imp{next(_counter)}"
    table = tier_table_name(model, "a")
    key = table_keys(SEED, 0, TABLES[0].rows)[:1]
    sentinel = np.full((1, 8), 42.0, np.float32)
    direct = RedisClusterStore(redis_cluster.address, table, 8, num_partitions=4)
    got = np.empty((1, 8), np.float32)
    try:
        open_session(make(model=model, gpucache=False, volatile=redis(redis_cluster)), spec).close()
        digest = direct.get_meta(SOURCE_META)
        assert digest
        direct.upsert(key, sentinel)  # an "online update" after the import
        # same files: no re-import, the update stays
        open_session(make(model=model, gpucache=False, volatile=redis(redis_cluster)), spec).close()
        direct.fetch(key, got)
        np.testing.assert_array_equal(got, sentinel)
        # new files + freeze_sparse: still no re-import
        p = make(
            model=model,
            seed=SEED + 1,
            gpucache=False,
            freeze_sparse=True,
            volatile=redis(redis_cluster),
        )
        open_session(p, spec).close()
        new_key = table_keys(SEED + 1, 0, TABLES[0].rows)[:1]
        assert not direct.fetch(new_key, got)[0]  # the new files' rows were not imported
        assert direct.get_meta(SOURCE_META) == digest
        # new files without freeze: re-imported (an upsert, as in HPS: rows of keys the
        # new files lack stay)
        p = make(model=model, seed=SEED + 1, gpucache=False, volatile=redis(redis_cluster))
        open_session(p, spec).close()
        assert direct.fetch(new_key, got)[0]
        np.testing.assert_array_equal(got, expected_vectors(SEED + 1, 0, new_key, 8))
        assert direct.get_meta(SOURCE_META) not in (None, digest)
    finally:
        direct.close()


@pytest.mark.parametrize("policy", ["evict_oldest", "evict_random", "evict_least_used"])
def test_redis_overflow_is_pruned_and_lookups_stay_exact(make, spec, redis_cluster, policy):  # noqa: F811
    margin = 100  # per partition; 4 partitions hold at most 400 of 2000 rows
    params = make(
        gpucache=False,
        volatile=redis(
            redis_cluster,
            overflow_margin=margin,
            overflow_policy=policy,
            overflow_resolution_target=0.5,
            cache_missed_embeddings=True,
            max_batch_size=50,
        ),
        persistent=ROCKS,
    )
    session = open_session(params, spec)
    try:
        vol = session.cached_tables[0].store.tiers[0].store
        assert vol.num_rows() <= 4 * margin
        for seed in range(3):
            keys, req = request(session, seed)
            np.testing.assert_array_equal(session.lookup(req), truth(keys))
        assert vol.num_rows() <= 4 * margin and vol.evicted > 0
    finally:
        session.close()


@pytest.mark.redis
def test_a_killed_redis_master_fails_requests_or_falls_through_per_config(make, spec, tmp_path):
    with start_redis_cluster(3) as cluster:
        fail = make(gpucache=False, volatile=redis(cluster, socket_timeout=0.5), persistent=ROCKS)
        skip = make(
            gpucache=False,
            volatile=redis(cluster, socket_timeout=0.5, on_unavailable="next_tier"),
            persistent=ROCKS,
        )
        a, b = open_session(fail, spec), open_session(skip, spec)
        try:
            keys, req = request(a, 3)
            cluster.kill(1)
            with pytest.raises(StoreUnavailableError, match=cluster.address.split(",")[0]):
                a.lookup(req)
            np.testing.assert_array_equal(b.lookup(req), truth(keys))  # from RocksDB
            cluster.restart(1)  # back, empty: RocksDB answers what it lost
            np.testing.assert_array_equal(a.lookup(req), truth(keys))
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"volatile_db": {"type": "disabled"}}, "both disabled"),
        ({"volatile_db": {"type": "redis_cluster", "overflow_margin": 10}}, "lose embeddings"),
        ({"volatile_db": {"type": "redis_cluster", "initial_cache_rate": 0.5}}, "no tier"),
        ({"update_source": {"type": "kafka_message_queue"}}, "need writable tiers"),
        ({"update_source": {"type": "redis_stream"}}, "need writable tiers"),
        ({"volatile_db": {"type": "memcached"}}, "volatile_db.type"),
        ({"volatile_db": {"type": "redis_cluster", "update_filters": ["("]}}, "regular expression"),
        ({"volatile_db": {"type": "redis_cluster", "overflow_resolution_target": 1.0}}, "]0, 1["),
        ({"persistent_db": {"type": "rocks_db", "on_unavailable": "retry"}}, "on_unavailable"),
    ],
)
def test_tier_combinations_that_would_lose_rows_are_refused(doc, message):
    entry = {
        "model": "m",
        "sparse_files": ["x"],
        "embedding_vecsize_per_table": [4],
        "maxnum_catfeature_query_per_table_per_sample": [1],
        "max_batch_size": 8,
    }
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_ps_config({"supportlonglong": True, "models": [entry], **doc})


def test_an_unreachable_redis_fails_the_load_naming_the_address(make, spec):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = make(
        volatile={
            "type": "redis_cluster",
            "address": f"127.0.0.1:{port}",
            "connect_timeout": 0.3,
            "socket_timeout": 0.3,
        }
    )
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}"):
        open_session(params, spec)


def test_tables_added_to_a_node_database_later_are_followed_by_the_open_tables(tmp_path):
    """One database holds every table (HPS's layout). A secondary handle cannot follow
    a column family created after it opened: the open tables reopen theirs."""
    from triton_rec.storage.rocksdb_store import NodeRocksDBTable

    db = tmp_path / "db"
    keys = np.arange(1, 51, dtype=np.int64)
    a = NodeRocksDBTable(db, "hps_et.m.a", 4)
    b = c = None
    try:
        a.upsert(keys, np.repeat(keys[:, None], 4, axis=1).astype(np.float32))
        b = NodeRocksDBTable(db, "hps_et.m.b", 2)  # a table added to the database
        c = NodeRocksDBTable(db, "hps_et.other.c", 3)  # and another model's
        assert a._writer is b._writer is c._writer  # one read-write side per process
        b.upsert(keys, np.full((50, 2), -1.0, np.float32))
        a.upsert(keys[:5], np.zeros((5, 4), np.float32))  # a writes again, then catches up
        out = np.empty((50, 4), np.float32)
        assert a.fetch(keys, out).all()
        np.testing.assert_array_equal(out[:5], 0.0)
        np.testing.assert_array_equal(out[5:], np.repeat(keys[5:, None], 4, axis=1))
        assert a.reopened >= 1
        out2 = np.empty((50, 2), np.float32)
        assert b.fetch(keys, out2).all()
        np.testing.assert_array_equal(out2, -1.0)
        assert not c.fetch(keys, np.empty((50, 3), np.float32)).any()
    finally:
        for t in (a, b, c):
            if t is not None:
                t.close()
    import rocksdict

    assert {"hps_et.m.a", "hps_et.m.b", "hps_et.other.c"} <= set(rocksdict.Rdict.list_cf(str(db)))


def test_a_rocksdb_written_by_hps_is_served_read_only(make, spec, rocksdb_dir):  # noqa: F811
    """HPS's layout, written here by hand from its source (HugeCTR v23.09
    rocksdb_backend.cpp, hier_parameter_server.cpp): one database at persistent_db.path,
    a column family hps_et.<model>.<table> per table, keys as 8 raw little-endian bytes,
    values as raw float32."""
    model = "hpsmodel"
    for t, s in enumerate(TABLES):
        k = table_keys(SEED, t, s.rows)
        write_hps_rocksdb(
            rocksdb_dir,
            tier_table_name(model, s.name),
            k,
            -3.0 * expected_vectors(SEED, t, k, s.vec_size),
        )
    params = make(
        model=model,
        gpucache=False,
        volatile={"type": "disabled"},
        persistent={"type": "rocks_db", "read_only": True},
    )
    session = open_session(params, spec)
    try:
        keys, req = request(session, 3)
        want = truth(keys)
        known = np.concatenate(
            [np.repeat(k < 2**62, TABLES[t].vec_size) for t, k in enumerate(keys)]
        )
        want[known] *= -3.0  # the database's rows, not the model files'
        np.testing.assert_array_equal(session.lookup(req), want)
    finally:
        session.close()


@pytest.mark.parametrize("freeze", [True, False], ids=["freeze_sparse", "re-import"])
def test_a_redis_cluster_hps_filled_is_served_as_is_with_freeze_sparse(
    make, spec, redis_cluster, freeze
):  # noqa: F811
    """HPS's Redis layout written by hand (tests/hps_layout.py). With freeze_sparse the
    rows are served as they are; without it the model files are imported over them, as
    HPS does at every start."""
    model = f"hpsredis{int(freeze)}"
    for t, s in enumerate(TABLES):
        k = table_keys(SEED, t, s.rows)
        write_hps_redis(
            redis_cluster,
            tier_table_name(model, s.name),
            k,
            -3.0 * expected_vectors(SEED, t, k, s.vec_size),
            num_partitions=4,
        )
    params = make(model=model, gpucache=False, freeze_sparse=freeze, volatile=redis(redis_cluster))
    session = open_session(params, spec)
    try:
        keys, req = request(session, 4)
        want = truth(keys)
        if freeze:
            known = np.concatenate(
                [np.repeat(k < 2**62, TABLES[t].vec_size) for t, k in enumerate(keys)]
            )
            want[known] *= -3.0  # HPS's rows, not the model files'
        np.testing.assert_array_equal(session.lookup(req), want)
    finally:
        session.close()


def test_secondary_directories_of_dead_processes_are_removed(tmp_path):
    import os
    import subprocess
    import sys

    from triton_rec.storage.rocksdb_store import NodeRocksDBTable

    db = tmp_path / "db"
    # a process that opens the table and is killed without closing it
    code = (
        "import os, sys; from triton_rec.storage.rocksdb_store import NodeRocksDBTable as T; "
        f"T({str(db)!r}, 'm.t', 4); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    left = os.listdir(str(db) + ".secondary")
    assert len(left) == 1  # the dead process's directory
    t = NodeRocksDBTable(db, "m.t", 4)
    try:
        assert os.listdir(str(db) + ".secondary") == [os.path.basename(t._secondary_dir)]
    finally:
        t.close()


def test_processes_of_a_node_write_one_rocksdb_table_in_turn_and_read_each_others_rows(tmp_path):
    """Two writer processes at once (each holds the writer lock while its writes keep
    coming, then lets the other in); a third process reads everything through its
    secondary handle."""
    import subprocess
    import sys

    from triton_rec.storage.rocksdb_store import NodeRocksDBTable

    db = tmp_path / "db"
    reader = NodeRocksDBTable(db, "m.t", 4)
    code = """
import sys, numpy as np
from triton_rec.storage.rocksdb_store import NodeRocksDBTable
t = NodeRocksDBTable(sys.argv[1], "m.t", 4, lock_timeout=30)
base = int(sys.argv[2])
for i in range(40):
    k = np.arange(base + 10 * i, base + 10 * i + 10, dtype=np.int64)
    t.upsert(k, np.repeat(k[:, None].astype(np.float32), 4, axis=1))
t.close()
"""
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(db), str(base)]) for base in (0, 100000)
    ]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
        keys = np.concatenate([np.arange(0, 400), np.arange(100000, 100400)]).astype(np.int64)
        out = np.empty((keys.shape[0], 4), np.float32)
        reader.catch_up()
        assert reader.fetch(keys, out).all()
        np.testing.assert_array_equal(out, np.repeat(keys[:, None].astype(np.float32), 4, axis=1))
    finally:
        for p in procs:
            p.kill()
        reader.close()


@pytest.mark.parametrize(
    "filters, topic, taken",
    [
        (["^hps_.+$"], "hps_et.m1.t", True),  # HPS's default, as a whole-topic filter
        ([".+"], "hps_et.m1.t", True),  # HPS's examples: every model
        (["m1"], "hps_et.m1.t", True),  # HPS: a filter names the model
        (["m1"], "hps_et.m10.t", False),
        (["m[0-9]"], "hps_et.m2.t", True),
        (["other"], "hps_et.m1.t", False),
        (["^hps_et\\.other\\..+$"], "hps_et.m1.t", False),
        (["hps_et\\.m1\\.t"], "hps_et.m1.t", True),
        (["hps_et\\.m1\\.t"], "hps_et.m1.u", False),
        (["(?i)M1"], "hps_et.m1.t", False),  # a global flag: only the whole-topic form
        (["(?i)HPS_ET.M1.T"], "hps_et.m1.t", True),
    ],
)
def test_update_filters_match_the_whole_topic_or_the_model_name_as_hps_subscribes(
    filters, topic, taken
):
    tier = Tier("volatile", DictStore(4), update_filters=tuple(filters))
    assert tier.accepts(topic) is taken


@pytest.mark.parametrize("filters, applied", [([".+"], True), (["^hps_et\\.other\\..+$"], False)])
def test_online_updates_reach_the_tiers_and_the_cache_only_through_matching_filters(
    make, spec, redis_cluster, filters, applied
):  # noqa: F811
    from triton_rec.updates.online import UpdateApplier

    params = make(
        gpucache=True, hit_rate_threshold=2.0, volatile=redis(redis_cluster, update_filters=filters)
    )
    session = open_session(params, spec)
    try:
        keys, req = request(session, 5, unknown=0)
        session.lookup(req)  # the keys are cached now
        k = keys[0][:4]
        new = np.full((4, 8), 9.5, np.float32)
        UpdateApplier(params.model, session.cached_tables)(params.model, "a", k, new)
        ct = session.cached_tables[0]
        cached = np.empty((4, 8), np.float32)
        hit = np.zeros(4, np.uint8)
        assert ct.cache.query(k, cached, hit) == 4
        stored = np.empty((4, 8), np.float32)
        ct.store.fetch(k, stored)
        want = new if applied else expected_vectors(SEED, 0, k, 8)
        np.testing.assert_array_equal(cached, want)
        np.testing.assert_array_equal(stored, want)
    finally:
        session.close()


@pytest.mark.redis
def updates_running() -> int:
    import threading

    return sum(t.name == "trec-updates" for t in threading.enumerate())


def test_the_instances_of_a_model_in_a_process_share_one_consumer_that_applies_in_order(
    tmp_path,
    spec,
    redis_cluster,  # noqa: F811
):
    """Two consumers of one group split a stream's entries: the later of two updates of a
    key could be applied first and stay. The instances of a process share one consumer,
    which writes the tiers once and every instance's cache."""
    import time

    from triton_rec.updates import UpdateProducer

    model = f"tier{next(_counter)}"
    entry = write_model(str(tmp_path / "repo"), model, TABLES, SEED)
    entry.update(gpucache=True, gpucacheper=0.3, hit_rate_threshold=2.0)
    doc = {
        "supportlonglong": True,
        "models": [entry],
        "volatile_db": redis(redis_cluster, update_filters=[".+"]),
        "update_source": {
            "type": "redis_stream",
            "address": redis_cluster.address,
            "group": f"g-{model}",
            "poll_timeout_ms": 50,
            "max_commit_interval": 1,  # one entry per read: the most interleaving
        },
    }
    params = parse_ps_config(doc, base_dir=str(tmp_path / "repo")).models[0]
    k = table_keys(SEED, 0, TABLES[0].rows)[:6]
    kb = table_keys(SEED, 1, TABLES[1].rows)[:1]
    counts = np.array([len(k), len(kb)], np.int32)

    def served(session):
        out = session.lookup(session.parse_request(np.concatenate([k, kb]), counts))
        return out[: k.size * 8].reshape(-1, 8)

    def stored(session):
        out = np.empty((k.size, 8), np.float32)
        session.cached_tables[0].store.fetch(k, out)
        return out

    def wait_for(v, sessions):
        deadline = time.monotonic() + 30
        while not all(np.all(served(s) == v) and np.all(stored(s) == v) for s in sessions):
            assert time.monotonic() < deadline, [served(s)[:, 0] for s in sessions]
            time.sleep(0.05)

    before = updates_running()
    a = open_session(params, spec)
    b = open_session(params, spec)
    try:
        assert a.services[0].consumer is b.services[0].consumer
        assert updates_running() == before + 1
        served(a), served(b)  # the keys are cached now: updates overwrite them there
        with UpdateProducer(redis_cluster.address) as producer:
            for v in range(1, 41):
                producer.publish(model, "a", k, np.full((k.size, 8), float(v), np.float32))
            wait_for(40.0, [a, b])
            time.sleep(0.5)  # nothing older lands afterwards
            wait_for(40.0, [a, b])
            a.close()
            producer.publish(model, "a", k, np.full((k.size, 8), 41.0, np.float32))
            wait_for(41.0, [b])
            assert updates_running() == before + 1
            assert b.services[0].stats()["apply_errors"] == 0
    finally:
        a.close()
        b.close()
    deadline = time.monotonic() + 5
    while updates_running() != before:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_ps_json_tls_settings_reach_the_redis_tier(make, spec):
    from tests.storage_fixtures import start_tls_redis_cluster

    with start_tls_redis_cluster() as c:
        tls = {
            "enable_tls": True,
            "tls_ca_certificate": str(c.tls["ca"]),
            "tls_client_certificate": str(c.tls["client_cert"]),
            "tls_client_key": str(c.tls["client_key"]),
            "tls_server_name_identification": "redis.test",
        }
        session = open_session(make(gpucache=False, volatile=redis(c, **tls)), spec)
        try:
            keys, req = request(session, 6)
            np.testing.assert_array_equal(session.lookup(req), truth(keys))
        finally:
            session.close()
        # without the server name the certificate check refuses the connection
        del tls["tls_server_name_identification"]
        with pytest.raises(StoreUnavailableError, match="certificate"):
            open_session(make(gpucache=False, volatile=redis(c, **tls)), spec)


def test_log_throttle_lets_one_line_through_per_period_and_counts_the_rest():
    from triton_rec.util.log_throttle import LogThrottle

    t = LogThrottle(every=0.2)
    assert t.allow() == (True, 0)
    assert [t.allow()[0] for _ in range(5)] == [False] * 5
    import time as _time

    _time.sleep(0.25)
    assert t.allow() == (True, 5)
