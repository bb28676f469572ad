"""End to end: a real Triton server whose models keep their tables in a real 3-master
Redis Cluster (volatile tier) and RocksDB (persistent tier), fed online through Redis
Streams, reloaded with explicit model control, and losing a Redis master.

Expected values come from the sparse files' generator or from what the test itself
published, never from the code under test.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.e2e.conftest import hps_config, make_client
from tests.storage_fixtures import start_redis_cluster
from triton_rec.storage.backing_store import tier_table_name
from triton_rec.storage.redis_store import RedisClusterStore
from triton_rec.triton.runtime import TritonServer

SEED = 31
TABLES = [
    SyntheticTable("item", rows=4000, vec_size=16, max_keys_per_sample=2, default_value=-3.0),
    SyntheticTable("user", rows=800, vec_size=4, max_keys_per_sample=1, default_value=-4.0),
]
REFRESH = 0.5  # refresh_interval of the tiered models (seconds)


def ps_entry(repo: Path, model: str, seed: int, version: int = 1, **over):
    entry = write_model(str(repo), model, TABLES, seed=seed, version=version)
    entry.update(
        gpucache=True,
        gpucacheper=0.25,
        hit_rate_threshold=2.0,
        refresh_interval=REFRESH,
        cache_refresh_percentage_per_iteration=1.0,
        **over,
    )
    return entry


def write_ps(repo: Path, cluster, rocks: Path, models) -> None:
    (repo / "ps.json").write_text(
        json.dumps(
            {
                "supportlonglong": True,
                "volatile_db": {
                    "type": "redis_cluster",
                    "address": cluster.address,
                    "num_partitions": 6,
                    "socket_timeout": 0.5,
                    "connect_timeout": 0.5,
                    "update_filters": [".+"],
                },
                "persistent_db": {"type": "rocks_db", "path": str(rocks), "update_filters": [".+"]},
                "update_source": {
                    "type": "redis_stream",
                    "address": cluster.address,
                    "group": "node-a",
                    "poll_timeout_ms": 100,
                    "socket_timeout": 0.5,
                    "connect_timeout": 0.5,
                },
                "models": models,
            },
            indent=1,
        )
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory, nothing_left_in_dev_shm, store_dir):
    """A Redis Cluster, a RocksDB directory and a server with two tiered models:
    ``tier_a`` (2 instances) and ``tier_b`` (1 instance), explicit model control."""
    repo = tmp_path_factory.mktemp("tier-repo")
    rocks = tmp_path_factory.mktemp("tier-rocks")
    with start_redis_cluster(3) as cluster:
        models = [ps_entry(repo, "tier_a", SEED), ps_entry(repo, "tier_b", SEED + 1)]
        write_ps(repo, cluster, rocks, models)
        (repo / "tier_a" / "config.pbtxt").write_text(hps_config("tier_a", 2))
        (repo / "tier_b" / "config.pbtxt").write_text(hps_config("tier_b", 1))
        log = tmp_path_factory.mktemp("tier-logs") / "tritonserver.log"
        srv = TritonServer(
            repo,
            explicit=True,
            load_models=["tier_a", "tier_b"],
            log_path=log,
            env={"TRITON_REC_STORE": str(store_dir)},
        )
        srv.start()
        try:
            yield dict(server=srv, cluster=cluster, repo=repo, rocks=rocks, models=models)
        finally:
            srv.stop()


def lookup(client, tc, model, keys_per_table):
    keys = np.concatenate(keys_per_table).astype(np.int64)[None, :]
    numkeys = np.array([[len(k) for k in keys_per_table]], np.int32)
    ins = []
    for name, arr, dtype in (("KEYS", keys, "INT64"), ("NUMKEYS", numkeys, "INT32")):
        i = tc.InferInput(name, list(arr.shape), dtype)
        i.set_data_from_numpy(arr)
        ins.append(i)
    return client.infer(model, ins).as_numpy("OUTPUT0")


def rocks_rows(path, model, s, keys):
    """``(vectors, found)`` of ``keys`` in the RocksDB column family hps_et.<model>.<table>."""
    from triton_rec.storage.rocksdb_store import RocksDBStore

    store = RocksDBStore(path, f"hps_et.{model}.{s.name}", s.vec_size, read_only=True)
    try:
        out = np.empty((len(keys), s.vec_size), np.float32)
        return out, store.fetch(keys, out)
    finally:
        store.close()


def sample_keys(seed, rng, n=(40, 20), unknown=3):
    out = []
    for t, s in enumerate(TABLES):
        k = rng.choice(table_keys(seed, t, s.rows), n[t] - unknown, replace=False)
        out.append(np.concatenate([k, rng.integers(2**62, 2**63 - 1, unknown, dtype=np.int64)]))
    return out


def truth(seed, keys_per_table):
    parts = []
    for t, k in enumerate(keys_per_table):
        v = expected_vectors(seed, t, k, TABLES[t].vec_size)
        v[k >= 2**62] = TABLES[t].default_value
        parts.append(v.reshape(-1))
    return np.concatenate(parts)


def tc_module(protocol):
    import tritonclient.grpc as g
    import tritonclient.http as h

    return h if protocol == "http" else g


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_lookups_match_the_source_files(env, protocol):
    rng = np.random.default_rng(1)
    with make_client(env["server"], protocol) as client:
        for model, seed in (("tier_a", SEED), ("tier_b", SEED + 1)):
            for _ in range(3):
                keys = sample_keys(seed, rng)
                np.testing.assert_array_equal(
                    lookup(client, tc_module(protocol), model, keys), truth(seed, keys)
                )
    # the rows are in both tiers, named <model>.<table>
    c = env["cluster"]
    for t, s in enumerate(TABLES):
        store = RedisClusterStore(
            c.address, tier_table_name("tier_a", s.name), s.vec_size, num_partitions=6
        )
        try:
            assert store.num_rows() == s.rows
        finally:
            store.close()
        # RocksDB in HPS's layout: one database, column family hps_et.<model>.<table>
        got, found = rocks_rows(env["rocks"], "tier_a", s, table_keys(SEED, t, s.rows))
        assert found.all()
        np.testing.assert_array_equal(
            got, expected_vectors(SEED, t, table_keys(SEED, t, s.rows), s.vec_size)
        )
    # the engine's log lines reach Triton's log: one import per tier and table, the
    # other instance found it done
    text = env["server"].log_path.read_text(errors="replace")
    for role in ("persistent", "volatile"):
        assert f"tier_a.item: {role} tier" in text
    assert "imported" in text and ": present" in text


def test_updates_published_during_lookups_are_served_untorn(env):
    from triton_rec.updates import UpdateProducer

    srv, c = env["server"], env["cluster"]
    rng = np.random.default_rng(2)
    keys = [
        rng.choice(table_keys(SEED, t, s.rows), 30, replace=False) for t, s in enumerate(TABLES)
    ]
    versions = 12
    stop = threading.Event()
    seen, bad = [], []

    def reader():
        import tritonclient.grpc as tc

        with make_client(srv, "grpc") as client:
            while not stop.is_set():
                out = lookup(client, tc, "tier_a", keys)
                pos = 0
                for t, s in enumerate(TABLES):
                    block = out[pos : pos + len(keys[t]) * s.vec_size].reshape(-1, s.vec_size)
                    pos += block.size
                    # every published row is constant (v, v, ..., v); a file row is not
                    published = np.all(block == block[:, :1], axis=1)
                    if not np.all(np.isin(block[published, 0], np.arange(1, versions + 1))):
                        bad.append(block[published][:2].copy())
                    seen.append(int(published.sum()))

    with UpdateProducer(c.address) as producer, cf.ThreadPoolExecutor(2) as pool:
        readers = [pool.submit(reader) for _ in range(2)]
        try:
            for v in range(1, versions + 1):
                for t, s in enumerate(TABLES):
                    producer.publish(
                        "tier_a",
                        s.name,
                        keys[t],
                        np.full((len(keys[t]), s.vec_size), float(v), np.float32),
                    )
                time.sleep(0.05)
            published_at = time.monotonic()
            # The last version is served everywhere: applied over the cached rows at once,
            # and a row a lookup cached with an older value meanwhile is re-read by the next
            # refresh (every REFRESH s). The defects: updates that never reach the served
            # answers (not applied to the cache, no refresh): the old rows would be served
            # for good. 60 s (normally well under a second) only fails on that, never on a
            # busy machine (how fast updates are applied: benchmarks/bench_tiers.py).
            import tritonclient.grpc as tc

            want = np.concatenate(
                [
                    np.full(len(keys[t]) * s.vec_size, float(versions), np.float32)
                    for t, s in enumerate(TABLES)
                ]
            )
            with make_client(srv, "grpc") as client:
                while True:
                    got = lookup(client, tc, "tier_a", keys)
                    if np.array_equal(got, want):
                        break
                    assert time.monotonic() - published_at < 60, (
                        f"the last update was never served: {got[:8]}..."
                    )
                    time.sleep(0.05)
            waited = time.monotonic() - published_at
        finally:
            stop.set()
            for r in readers:
                r.result(timeout=30)
    assert not bad, f"torn or foreign vectors served: {bad[:3]}"
    assert sum(seen) > 0
    print(f"last update served {waited:.2f} s after it was published")
    # the tiers hold it too (another node would read it from there)
    store = RedisClusterStore(c.address, tier_table_name("tier_a", "user"), 4, num_partitions=6)
    got = np.empty((len(keys[1]), 4), np.float32)
    try:
        assert store.fetch(keys[1], got).all()
    finally:
        store.close()
    np.testing.assert_array_equal(got, float(versions))
    # What happened is visible on the metrics port, also for a model no request reaches:
    # each instance publishes its metrics every metrics_interval (default 1 s; execute
    # never does). Publish once more with no lookups running and wait for the count.
    import urllib.request

    def metric(text, name, **labels):
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    with UpdateProducer(c.address) as producer:
        producer.publish(
            "tier_a", "user", keys[1], np.full((len(keys[1]), 4), float(versions), np.float32)
        )
    want_vectors = versions * sum(len(k) for k in keys) + len(keys[1])
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
            text = r.read().decode()
        vectors = metric(text, "trec_updates_vectors_total", model="tier_a")
        if vectors >= want_vectors or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert vectors >= want_vectors, f"{vectors} update vectors counted, {want_vectors} published"
    # the two instances share the process's consumer: its counts are published once (an
    # update applied twice after a failure would be counted twice: none here)
    time.sleep(2.5)  # two more metrics_interval
    with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
        text = r.read().decode()
    assert metric(text, "trec_updates_errors_total", model="tier_a") == 0
    assert metric(text, "trec_updates_vectors_total", model="tier_a") == want_vectors
    assert metric(text, "trec_updates_malformed_total", model="tier_a") == 0
    assert metric(text, "trec_tier_keys_total", model="tier_a", tier="volatile") > 0


def test_a_new_version_reloads_under_load_without_failing_the_other_model(env):
    srv, repo = env["server"], env["repo"]
    import tritonclient.grpc as tc

    stop = threading.Event()
    counts = {"ok": 0, "failed": 0}
    errors = []
    rng = np.random.default_rng(3)
    b_keys = sample_keys(SEED + 1, rng)
    b_truth = truth(SEED + 1, b_keys)

    def load_b():
        with make_client(srv, "grpc") as client:
            while not stop.is_set():
                try:
                    ok = np.array_equal(lookup(client, tc, "tier_b", b_keys), b_truth)
                except Exception as e:  # counted, reported below
                    ok = False
                    errors.append(repr(e))
                counts["ok" if ok else "failed"] += 1

    with cf.ThreadPoolExecutor(2) as pool:
        loaders = [pool.submit(load_b) for _ in range(2)]
        try:
            time.sleep(0.5)
            # version 2 of tier_a: new files (another seed) in tier_a/2, ps.json points there
            new_a = ps_entry(repo, "tier_a", SEED + 7, version=2)
            write_ps(repo, env["cluster"], env["rocks"], [new_a, env["models"][1]])
            with make_client(srv, "grpc") as client:
                client.load_model("tier_a")
                assert client.is_model_ready("tier_a", "2")
                keys = sample_keys(SEED + 7, rng)
                np.testing.assert_array_equal(
                    lookup(client, tc, "tier_a", keys), truth(SEED + 7, keys)
                )
                # unload frees the caches, not the databases
                client.unload_model("tier_a")
                deadline = time.monotonic() + 30
                while [e for e in os.listdir("/dev/shm") if e.startswith("trec_tier_a.")]:
                    assert time.monotonic() < deadline, "tier_a's caches were not freed"
                    time.sleep(0.1)
            time.sleep(0.5)
        finally:
            stop.set()
            for f in loaders:
                f.result(timeout=30)
    assert counts["failed"] == 0, f"{counts}, {errors[:3]}"
    assert counts["ok"] > 20
    s = TABLES[0]
    store = RedisClusterStore(
        env["cluster"].address, tier_table_name("tier_a", s.name), s.vec_size, num_partitions=6
    )
    try:
        assert store.num_rows() >= s.rows
    finally:
        store.close()
    assert rocks_rows(env["rocks"], "tier_a", s, table_keys(SEED, 0, s.rows))[1].all()
    with make_client(srv, "grpc") as client:  # load it back for the tests after this one
        client.load_model("tier_a")


def test_a_second_node_shares_the_redis_cluster_skips_the_import_and_gets_updates(
    env, tmp_path_factory, store_dir
):
    """Node B: its own model repository, node-local store, RocksDB and consumer group;
    the same Redis Cluster and the same files as node A (the running server)."""
    import tritonclient.grpc as tc

    from triton_rec.updates import UpdateProducer, stream_info

    c, repo = env["cluster"], env["repo"]
    s = TABLES[0]
    key = table_keys(SEED + 1, 0, s.rows)[:1]
    sentinel = np.full((1, s.vec_size), 123.0, np.float32)
    direct = RedisClusterStore(
        c.address, tier_table_name("tier_b", s.name), s.vec_size, num_partitions=6
    )
    try:
        direct.upsert(key, sentinel)  # changed in Redis only, after node A's import
        repo_b = tmp_path_factory.mktemp("node-b-repo")
        entry = dict(env["models"][1])
        entry["sparse_files"] = [str(repo / f) for f in entry["sparse_files"]]
        write_ps(repo_b, c, tmp_path_factory.mktemp("node-b-rocks"), [entry])
        ps = json.loads((repo_b / "ps.json").read_text())
        ps["update_source"]["group"] = "node-b"
        (repo_b / "ps.json").write_text(json.dumps(ps))
        (repo_b / "tier_b" / "1").mkdir(parents=True)
        (repo_b / "tier_b" / "config.pbtxt").write_text(hps_config("tier_b", 1))
        log = tmp_path_factory.mktemp("node-b-logs") / "tritonserver.log"
        node_b = TritonServer(
            repo_b,
            log_path=log,
            env={"TRITON_REC_STORE": str(tmp_path_factory.mktemp("node-b-store"))},
        )
        with node_b:
            with make_client(node_b, "grpc") as client:
                # Redis was not re-imported by node B: the changed row is still there,
                # and node B serves it (Redis is asked before its own RocksDB)
                got = lookup(client, tc, "tier_b", [key, np.empty(0, np.int64)])
                np.testing.assert_array_equal(got, sentinel.reshape(-1))
                # an update reaches both nodes' consumer groups
                new = np.full((1, s.vec_size), 7.0, np.float32)
                with UpdateProducer(c.address) as producer:
                    producer.publish("tier_b", s.name, key, new)
                topic_len = None
                deadline = time.monotonic() + 10
                while True:
                    info = stream_info(c.address, "tier_b", s.name)
                    groups = {g["name"]: g for g in info["groups"]}
                    topic_len = info["length"]
                    done = set(groups) >= {"node-a", "node-b"} and all(
                        g["pending"] == 0 and g["last-delivered-id"] != "0-0"
                        for g in groups.values()
                    )
                    if done and np.array_equal(
                        lookup(client, tc, "tier_b", [key, np.empty(0, np.int64)]), new.reshape(-1)
                    ):
                        break
                    assert time.monotonic() < deadline, f"update not consumed by both: {info}"
                    time.sleep(0.05)
                assert topic_len >= 1
            with make_client(env["server"], "grpc") as client:
                np.testing.assert_array_equal(
                    lookup(client, tc, "tier_b", [key, np.empty(0, np.int64)]), new.reshape(-1)
                )
    finally:
        direct.close()


def test_a_killed_redis_master_gives_clear_errors_never_hangs_and_recovers(env):
    srv, c = env["server"], env["cluster"]
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    rng = np.random.default_rng(4)
    c.kill(2)
    try:
        outcomes = {"ok": 0, "error": 0}
        with make_client(srv, "grpc") as client:
            for _ in range(10):
                keys = sample_keys(SEED + 1, rng)  # fresh keys: most miss the cache
                t0 = time.monotonic()
                try:
                    out = lookup(client, tc, "tier_b", keys)
                    np.testing.assert_array_equal(out, truth(SEED + 1, keys))
                    outcomes["ok"] += 1
                except InferenceServerException as e:
                    assert "Redis Cluster" in str(e) and f":{c.ports[2]}" in str(e), str(e)
                    outcomes["error"] += 1
                assert time.monotonic() - t0 < 10, "a request hung"
            assert client.is_server_ready()
        assert outcomes["error"] > 0  # with on_unavailable "fail", misses on the lost master fail
    finally:
        c.restart(2)
    # back (empty): the persistent tier answers what Redis lost
    with make_client(srv, "grpc") as client:
        for _ in range(3):
            keys = sample_keys(SEED + 1, rng)
            np.testing.assert_array_equal(lookup(client, tc, "tier_b", keys), truth(SEED + 1, keys))
