"""HPS update messages and their Redis Streams transport, against a real Redis Cluster."""

from __future__ import annotations

import struct
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from ps_loader import write_table
from tests.storage_fixtures import redis_cluster  # noqa: F401  (fixture)
from triton_rec.updates import (
    MAGIC,
    UpdateConsumer,
    UpdateMessageError,
    UpdateProducer,
    decode_message,
    encode_message,
    parse_topic,
    stream_info,
    topic_name,
)


def rows(n, d, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),
            rng.standard_normal((n, d)).astype(np.float32))


def test_the_message_layout_is_the_hps_one_byte_for_byte():
    keys = np.array([-2, 7], np.int64)
    vecs = np.array([[1.0, 2.0], [3.0, -4.0]], np.float32)
    # written by hand from the format: "HCTR", value size, (int64 key, float32 values)*
    want = (b"HCTR" + struct.pack("<I", 8) + struct.pack("<q2f", -2, 1.0, 2.0)
            + struct.pack("<q2f", 7, 3.0, -4.0))
    assert struct.pack("<I", MAGIC) == b"HCTR"
    assert encode_message(keys, vecs) == want
    k, v = decode_message(want, 2)
    np.testing.assert_array_equal(k, keys)
    np.testing.assert_array_equal(v, vecs)


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_round_trip(n):
    keys, vecs = rows(n, 5)
    k, v = decode_message(encode_message(keys, vecs), 5)
    np.testing.assert_array_equal(k, keys)
    np.testing.assert_array_equal(v, vecs)


@pytest.mark.parametrize("data, vec, message", [
    (b"HCT", 2, "shorter than the 8-byte header"),
    (b"XXXX" + struct.pack("<I", 8), 2, "bad magic"),
    (b"HCTR" + struct.pack("<I", 6), None, "multiple of 4"),
    (b"HCTR" + struct.pack("<I", 0), None, "multiple of 4"),
    (b"HCTR" + struct.pack("<I", 12), 2, "vec_size 2"),
    (b"HCTR" + struct.pack("<I", 8) + b"\0" * 15, 2, "whole number"),
])
def test_malformed_messages_are_refused_saying_why(data, vec, message):
    with pytest.raises(UpdateMessageError, match=message):
        decode_message(data, vec)


def test_topic_names():
    assert topic_name("dlrm", "t0") == "hps_et.dlrm.t0"
    assert parse_topic("hps_et.dlrm.t0") == ("dlrm", "t0")
    with pytest.raises(UpdateMessageError):
        parse_topic("hps_et.a.b.c")


class Collector:
    def __init__(self, fail_times=0):
        self.rows = {}
        self.fail_times = fail_times

    def __call__(self, model, table, keys, vectors):
        if self.fail_times:
            self.fail_times -= 1
            raise RuntimeError("tier down")
        for k, v in zip(keys.tolist(), vectors):
            self.rows[(model, table, k)] = v.copy()


def consume_until(consumer, cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out; stats {consumer.stats()}"
        consumer.poll_once(50)


@pytest.fixture
def names():
    m = f"m{uuid.uuid4().hex[:8]}"
    return m, "t", topic_name(m, "t")


def test_every_group_sees_every_update_and_batches_are_split_in_messages(redis_cluster, names):  # noqa: F811
    model, table, topic = names
    keys, vecs = rows(250, 3)
    with UpdateProducer(redis_cluster.address, max_batch_size=100) as p:
        assert p.publish(model, table, keys, vecs) == 3
    got = []
    for group in ("node1", "node2"):
        c = UpdateConsumer(redis_cluster.address, group, "c", {topic: 3}, Collector())
        try:
            consume_until(c, lambda: len(c.apply.rows) == 250)
            assert c.stats()["messages"] == 3 and c.stats()["vectors"] == 250
            got.append(c.apply.rows)
        finally:
            c.close()
    for r in got:
        np.testing.assert_array_equal(np.stack([r[(model, table, k)] for k in keys.tolist()]), vecs)
    info = stream_info(redis_cluster.address, model, table)
    assert info["length"] == 3 and {g["name"] for g in info["groups"]} == {"node1", "node2"}
    assert all(g["pending"] == 0 for g in info["groups"])


def test_entries_not_applied_are_retried_and_taken_over_after_a_crash(redis_cluster, names):  # noqa: F811
    model, table, topic = names
    keys, vecs = rows(10, 2, seed=1)
    with UpdateProducer(redis_cluster.address) as p:
        p.publish(model, table, keys, vecs)
    # consumer 1 reads the entry, its tier is down: nothing acknowledged; it then "dies"
    dead = UpdateConsumer(redis_cluster.address, "g", "dead", {topic: 2}, Collector(fail_times=99),
                          backoff_ms=1)
    dead.poll_once(50)
    assert dead.stats()["apply_errors"] == 1
    dead.close()
    assert stream_info(redis_cluster.address, model, table)["groups"][0]["pending"] == 1
    # another consumer of the group takes it over once it has been idle long enough
    other = UpdateConsumer(redis_cluster.address, "g", "other", {topic: 2}, Collector(),
                           claim_idle_ms=200)
    try:
        consume_until(other, lambda: len(other.apply.rows) == 10)
        assert other.stats()["claimed"] == 1
    finally:
        other.close()
    assert stream_info(redis_cluster.address, model, table)["groups"][0]["pending"] == 0
    # a consumer restarted under its old name re-reads its own pending entries first
    with UpdateProducer(redis_cluster.address) as p:
        p.publish(model, table, keys[:3], vecs[:3])
    first = UpdateConsumer(redis_cluster.address, "g", "same", {topic: 2}, Collector(fail_times=1))
    first.poll_once(50)
    first.close()
    again = UpdateConsumer(redis_cluster.address, "g", "same", {topic: 2}, Collector(),
                           claim_idle_ms=10**7)
    try:
        consume_until(again, lambda: len(again.apply.rows) == 3)
        assert again.stats()["claimed"] == 0
    finally:
        again.close()


def test_a_malformed_message_is_skipped_and_the_next_one_applied(redis_cluster, names):  # noqa: F811
    model, table, topic = names
    c = UpdateConsumer(redis_cluster.address, "g", "c", {topic: 2}, Collector())
    try:
        c.poll_once(10)  # creates the group
        with UpdateProducer(redis_cluster.address) as p:
            p._redis.run("XADD", lambda pipe: pipe.xadd(topic, {b"v": b"garbage!!"}))
            p._redis.run("XADD", lambda pipe: pipe.xadd(
                topic, {b"v": encode_message(*rows(4, 3))}))  # wrong vec_size
            p.publish(model, table, *rows(5, 2, seed=3))
        consume_until(c, lambda: len(c.apply.rows) == 5)
        assert c.stats()["malformed"] == 2
        assert "vec_size 2" in c.stats()["last_error"] or "magic" in c.stats()["last_error"]
    finally:
        c.close()
    assert stream_info(redis_cluster.address, model, table)["groups"][0]["pending"] == 0


def test_the_cli_publishes_npz_files_and_sparse_directories(redis_cluster, names, tmp_path):  # noqa: F811
    model, table, topic = names
    keys, vecs = rows(30, 4, seed=4)
    np.savez(tmp_path / "d.npz", keys=keys[:20], vectors=vecs[:20])
    write_table(str(tmp_path / "sparse"), keys[20:], vecs[20:])
    base = [sys.executable, "-m", "triton_rec.updates", "publish", "--address",
            redis_cluster.address, "--model", model, "--table", table]
    r = subprocess.run(base + ["--npz", str(tmp_path / "d.npz")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(base + ["--sparse-dir", str(tmp_path / "sparse"), "--vec-size", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    bad = subprocess.run(base + ["--npz", str(tmp_path / "missing.npz")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "missing.npz" in bad.stderr
    c = UpdateConsumer(redis_cluster.address, "g", "c", {topic: 4}, Collector())
    try:
        consume_until(c, lambda: len(c.apply.rows) == 30)
    finally:
        c.close()
    np.testing.assert_array_equal(np.stack([c.apply.rows[(model, table, k)] for k in keys.tolist()]),
                                  vecs)


def test_an_unreachable_redis_is_retried_quietly_and_close_returns_promptly(
        redis_cluster, names, caplog):  # noqa: F811
    import logging

    from tests.storage_fixtures import start_redis_cluster

    model, table, topic = names
    with start_redis_cluster(3) as cluster:
        c = UpdateConsumer(cluster.address, "g", "c", {topic: 2}, Collector(), block_ms=100,
                           backoff_ms=10, socket_timeout=0.3, connect_timeout=0.3)
        c.start()
        time.sleep(0.2)
        with caplog.at_level(logging.WARNING, logger="triton_rec.updates"):
            for i in range(3):
                cluster.kill(i)
            time.sleep(1.5)
            t0 = time.monotonic()
            c.close()
        assert time.monotonic() - t0 < 5
        assert c.stats()["redis_errors"] >= 3  # it kept trying (with a growing backoff)
        lines = [r for r in caplog.records if "updates from" in r.getMessage()]
        assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]  # not one per attempt
