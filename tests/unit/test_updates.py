"""HPS update messages and their Redis Streams transport, against a real Redis Cluster."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from tests.storage_fixtures import redis_cluster  # noqa: F401  (fixture)
from triton_rec.errors import ConfigError, TritonRecError
from triton_rec.formats.tables import write_table
from triton_rec.storage.backing_store import StoreError
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
    return (
        rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),
        rng.standard_normal((n, d)).astype(np.float32),
    )


def test_the_message_layout_is_the_hps_one_byte_for_byte():
    keys = np.array([-2, 7], np.int64)
    vecs = np.array([[1.0, 2.0], [3.0, -4.0]], np.float32)
    # written by hand from the format: "HCTR", value size, (int64 key, float32 values)*
    want = (
        b"HCTR"
        + struct.pack("<I", 8)
        + struct.pack("<q2f", -2, 1.0, 2.0)
        + struct.pack("<q2f", 7, 3.0, -4.0)
    )
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


ONE_PAIR = struct.pack("<q2f", 5, 1.0, 2.0)  # a valid (key, 2-float value) pair


@pytest.mark.parametrize(
    "data, vec, message",
    [
        (b"", 2, "shorter than the 8-byte header"),
        (b"HCT", 2, "shorter than the 8-byte header"),
        (b"HCTR\x08\0\0", None, "shorter than the 8-byte header"),
        (b"XXXX" + struct.pack("<I", 8) + ONE_PAIR, 2, "bad magic 0x58585858"),
        (struct.pack(">I", MAGIC) + struct.pack("<I", 8) + ONE_PAIR, 2, "bad magic"),  # big-endian
        (b"HCTR" + struct.pack("<I", 6) + b"\0" * 14, None, "value size 6 bytes is not a positive"),
        (b"HCTR" + struct.pack("<I", 0) + b"\0" * 16, None, "value size 0 bytes is not a positive"),
        (b"HCTR" + struct.pack("<I", 12) + b"\0" * 20, 2, "3 floats, the table has vec_size 2"),
        (
            b"HCTR" + struct.pack("<I", 8) + ONE_PAIR[:-1],
            2,
            "body of 15 bytes is not a whole number",
        ),
        (b"HCTR" + struct.pack("<I", 8) + ONE_PAIR + b"\0", None, "of 16-byte key/value pairs"),
    ],
)
def test_malformed_messages_are_refused_saying_why(data, vec, message):
    with pytest.raises(UpdateMessageError, match=message):
        decode_message(data, vec)
    assert issubclass(UpdateMessageError, TritonRecError)


@pytest.mark.parametrize("value_size", [0, 6, 8, 64])
def test_a_header_only_message_is_a_beacon_whatever_its_value_size(value_size):
    # HPS sends beacons with value size sizeof(size_t) and skips them before any check
    k, v = decode_message(b"HCTR" + struct.pack("<I", value_size), 16)
    assert k.dtype == np.int64 and k.shape == (0,)
    assert v.dtype == np.float32 and v.shape == (0, 16)


def test_encode_refuses_wrong_dtypes_and_shapes():
    keys, vecs = rows(3, 2)
    for bad_keys, bad_vecs in [
        (keys.astype(np.float64), vecs),
        (keys, vecs.astype(np.float64)),
        (keys[:2], vecs),
        (keys, vecs[:, :0]),
        (keys[None], vecs),
    ]:
        with pytest.raises(ValueError):
            encode_message(bad_keys, bad_vecs)


def test_topic_names():
    assert topic_name("dlrm", "t0") == "hps_et.dlrm.t0"
    assert topic_name("a-b_1", "C_2-x") == "hps_et.a-b_1.C_2-x"
    assert parse_topic("hps_et.dlrm.t0") == ("dlrm", "t0")
    for bad in ("hps_et.a.b.c", "hps_et.a", "hps.a.b", "hps_et.a{x}.b", "xhps_et.a.b", ""):
        with pytest.raises(UpdateMessageError):
            parse_topic(bad)
    for model, table in (("a.b", "t"), ("m", ""), ("m", "t/1"), ("{m}", "t"), ("m" * 121, "t")):
        with pytest.raises(ConfigError):
            topic_name(model, table)


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
            consume_until(c, lambda c=c: len(c.apply.rows) == 250)
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
    dead = UpdateConsumer(
        redis_cluster.address, "g", "dead", {topic: 2}, Collector(fail_times=99), backoff_ms=1
    )
    dead.poll_once(50)
    assert dead.stats()["apply_errors"] == 1
    dead.close()
    assert stream_info(redis_cluster.address, model, table)["groups"][0]["pending"] == 1
    # another consumer of the group takes it over once it has been idle long enough
    other = UpdateConsumer(
        redis_cluster.address, "g", "other", {topic: 2}, Collector(), claim_idle_ms=200
    )
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
    again = UpdateConsumer(
        redis_cluster.address, "g", "same", {topic: 2}, Collector(), claim_idle_ms=10**7
    )
    try:
        consume_until(again, lambda: len(again.apply.rows) == 3)
        assert again.stats()["claimed"] == 0
    finally:
        again.close()


class Landed:
    """Records the value of every applied row in the order the applies end (shared by
    consumers); each apply takes ``delay`` s, so two concurrent ones would overlap."""

    def __init__(self, order, lock, delay=0.01, fail_times=0):
        self.order, self.lock, self.delay, self.fail_times = order, lock, delay, fail_times

    def __call__(self, model, table, keys, vectors):
        if self.fail_times:
            self.fail_times -= 1
            raise RuntimeError("tier down")
        time.sleep(self.delay)
        with self.lock:
            self.order.extend(vectors[:, 0].tolist())


def publish_versions(address, model, table, versions):
    key = np.array([7], np.int64)
    with UpdateProducer(address) as p:
        for v in versions:
            p.publish(model, table, key, np.full((1, 2), float(v), np.float32))


def test_one_consumer_of_a_group_reads_a_topic_at_a_time_so_updates_land_in_order(
    redis_cluster,  # noqa: F811
    names,
):
    """Two consumers of one group (two processes of a node) would split the stream's
    entries and apply them side by side, so a key's later update could land first."""
    import threading

    model, table, topic = names
    order, lock = [], threading.Lock()
    a, b = (
        UpdateConsumer(
            redis_cluster.address, "g", name, {topic: 2}, Landed(order, lock), read_count=1
        )
        for name in ("a", "b")
    )
    a.start()
    b.start()
    try:
        time.sleep(0.3)  # both wait for entries now
        publish_versions(redis_cluster.address, model, table, range(1, 31))
        deadline = time.monotonic() + 20
        while len(order) < 30:
            assert time.monotonic() < deadline, (a.stats(), b.stats())
            time.sleep(0.02)
        assert order == list(range(1, 31))
        done = {c.consumer: c.stats()["messages"] for c in (a, b)}
        assert sorted(done.values()) == [0, 30], done
        holder, other = (a, b) if done[b"a"] else (b, a)
        # the holder gives the lease back when it closes: the other reads on at once
        holder.close()
        publish_versions(redis_cluster.address, model, table, range(31, 41))
        while len(order) < 40:
            assert time.monotonic() < deadline, other.stats()
            time.sleep(0.02)
        assert order == list(range(1, 41))
        assert other.stats()["messages"] == 10
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("end", ["crashed", "closed"])
def test_a_new_holder_applies_what_an_earlier_one_left_pending_before_newer_entries(
    redis_cluster,  # noqa: F811
    names,
    end,
):
    """Crashed: the lease expires. Closed: it is given back at once, before the entries
    it left are idle long enough to be claimed; the new holder waits for them."""
    import threading

    model, table, topic = names
    publish_versions(redis_cluster.address, model, table, range(1, 4))
    order, lock = [], threading.Lock()
    # it reads the three entries, its tier is down, and it ends
    dead = UpdateConsumer(
        redis_cluster.address,
        "g",
        "dead",
        {topic: 2},
        Landed(order, lock, fail_times=99),
        claim_idle_ms=400,
        backoff_ms=1,
    )
    dead.poll_once(50)
    assert dead.stats()["apply_errors"] == 1
    if end == "crashed":
        dead._redis.close()  # no close(): the lease stays until it expires
    else:
        dead.close()
    publish_versions(redis_cluster.address, model, table, [4])
    nxt = UpdateConsumer(
        redis_cluster.address, "g", "next", {topic: 2}, Landed(order, lock), claim_idle_ms=400
    )
    try:
        t0 = time.monotonic()
        consume_until(nxt, lambda: nxt.stats()["messages"] == 4)
        # the three claimed entries are applied in one call, the key's last version kept
        assert order == [3.0, 4.0]
        assert time.monotonic() - t0 >= 0.2  # it waited for the lease to expire
        assert nxt.stats()["claimed"] == 3
    finally:
        nxt.close()
    assert stream_info(redis_cluster.address, model, table)["groups"][0]["pending"] == 0


def test_consumers_of_ended_processes_are_removed_from_the_group_unless_entries_wait(
    redis_cluster, names
):  # noqa: F811
    model, table, topic = names
    keys, vecs = rows(4, 2, seed=2)
    with UpdateProducer(redis_cluster.address) as p:
        p.publish(model, table, keys, vecs)
        p.publish(model, table, keys, vecs)
    # one ended process applied its entry, another one died holding one
    done = UpdateConsumer(
        redis_cluster.address, "g", "host-1", {topic: 2}, Collector(), read_count=1
    )
    done.poll_once(50)
    done.close()
    held = UpdateConsumer(
        redis_cluster.address,
        "g",
        "host-2",
        {topic: 2},
        Collector(fail_times=99),
        read_count=1,
        backoff_ms=1,
    )
    held.poll_once(50)
    held.close()

    def members():
        (group,) = stream_info(redis_cluster.address, model, table)["groups"]
        return {m["name"]: m["pending"] for m in group["members"]}

    assert members() == {"host-1": 0, "host-2": 1}
    time.sleep(0.4)
    live = UpdateConsumer(
        redis_cluster.address,
        "g",
        "host-3",
        {topic: 2},
        Collector(),
        claim_idle_ms=10**7,
        prune_idle_ms=300,
    )
    try:
        live.poll_once(50)
        assert live.stats()["pruned"] == 1
        assert members() == {"host-2": 1, "host-3": 0}
    finally:
        live.close()
    # 0 keeps every consumer
    time.sleep(0.4)
    keep = UpdateConsumer(
        redis_cluster.address,
        "g",
        "host-4",
        {topic: 2},
        Collector(),
        claim_idle_ms=10**7,
        prune_idle_ms=0,
    )
    try:
        keep.poll_once(50)
        assert keep.stats()["pruned"] == 0
        assert set(members()) == {"host-2", "host-3", "host-4"}
    finally:
        keep.close()


def test_a_malformed_message_is_skipped_and_the_next_one_applied(redis_cluster, names):  # noqa: F811
    model, table, topic = names
    c = UpdateConsumer(redis_cluster.address, "g", "c", {topic: 2}, Collector())
    try:
        c.poll_once(10)  # creates the group
        with UpdateProducer(redis_cluster.address) as p:
            p._redis.run("XADD", lambda pipe: pipe.xadd(topic, {b"v": b"garbage!!"}))
            p._redis.run(
                "XADD", lambda pipe: pipe.xadd(topic, {b"v": encode_message(*rows(4, 3))})
            )  # wrong vec_size
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
    base = [
        sys.executable,
        "-m",
        "triton_rec.updates",
        "publish",
        "--address",
        redis_cluster.address,
        "--model",
        model,
        "--table",
        table,
    ]
    r = subprocess.run(base + ["--npz", str(tmp_path / "d.npz")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "20 vector(s) of size 4 in 1 message(s)" in r.stdout
    # the vector size comes from the file sizes, or from --vec-size
    r = subprocess.run(
        base + ["--sparse-dir", str(tmp_path / "sparse"), "--batch-size", "4"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "10 vector(s) of size 4 in 3 message(s)" in r.stdout
    np.savez(tmp_path / "wrong.npz", keys=keys.astype(np.int32), vectors=vecs)
    np.savez(tmp_path / "other.npz", k=keys, v=vecs)
    for args, message in [
        (["--npz", str(tmp_path / "missing.npz")], "missing.npz"),
        (["--npz", str(tmp_path / "wrong.npz")], "keys must be int64"),
        (["--npz", str(tmp_path / "other.npz")], "needs arrays 'keys' and 'vectors'"),
        (["--sparse-dir", str(tmp_path / "sparse"), "--vec-size", "3"], "not a multiple"),
        (["--sparse-dir", str(tmp_path / "nothing")], "nothing"),
        (["--npz", str(tmp_path / "d.npz"), "--batch-size", "0"], "--batch-size must be >= 1"),
    ]:
        bad = subprocess.run(base + args, capture_output=True, text=True)
        assert bad.returncode == 2 and message in bad.stderr, (args, bad.stderr)
    bad = subprocess.run(
        base[:5] + ["no-port"] + base[6:] + ["--npz", str(tmp_path / "d.npz")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "no-port" in bad.stderr
    bad = subprocess.run(
        base[:-1] + ["a.b", "--npz", str(tmp_path / "d.npz")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "'a.b'" in bad.stderr
    info_cmd = [sys.executable, "-m", "triton_rec.updates", "info", "--address"]
    info_cmd += [redis_cluster.address, "--model", model, "--table", table]
    r = subprocess.run(info_cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"topic": topic, "length": 4, "groups": []}
    c = UpdateConsumer(redis_cluster.address, "g", "c", {topic: 4}, Collector())
    try:
        consume_until(c, lambda: len(c.apply.rows) == 30)
    finally:
        c.close()
    np.testing.assert_array_equal(
        np.stack([c.apply.rows[(model, table, k)] for k in keys.tolist()]), vecs
    )
    r = subprocess.run(info_cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert [(g["name"], g["pending"]) for g in info["groups"]] == [("g", 0)]


def wait_for(cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_closed_for_good(c, closing):
    """What ``close()`` of a consumer whose Redis is unreachable must have done: returned
    (``closing`` seconds), and stopped its thread, which then released the connection.

    Catches a close that hangs (a join without a timeout on a thread that never stops), a
    thread that never sees the stop between failed attempts (it would retry the dead
    cluster for the rest of the process) and a connection left open. close() waits for
    the thread at most block_ms + 1 s by design, and here it takes milliseconds: the 30 s
    are a "does not hang" bound, not a speed requirement (none belongs in a test).
    """
    assert closing < 30, f"close() took {closing:.1f} s"
    wait_for(lambda: not c._thread.is_alive(), "the consumer's thread to end", timeout=30)
    assert c._redis._closed  # released by the thread as it ended (or by close itself)


@pytest.mark.redis
def test_an_unreachable_redis_is_retried_quietly_and_close_returns_promptly(names, caplog):
    from tests.storage_fixtures import start_redis_cluster

    model, table, topic = names
    with start_redis_cluster(3) as cluster:
        c = UpdateConsumer(
            cluster.address,
            "g",
            "c",
            {topic: 2},
            Collector(),
            block_ms=100,
            backoff_ms=10,
            socket_timeout=0.3,
            connect_timeout=0.3,
        )
        c.start()
        wait_for(lambda: stream_info(cluster.address, model, table)["groups"], "the group")
        with caplog.at_level(logging.WARNING, logger="triton_rec.updates"):
            for i in range(3):
                cluster.kill(i)
            # it keeps trying, with a growing backoff (10, 20, 40 ms ...)
            wait_for(lambda: c.stats()["redis_errors"] >= 5, "5 failed attempts")
            assert c._thread.is_alive()
            t0 = time.monotonic()
            c.close()
            closing = time.monotonic() - t0
        assert_closed_for_good(c, closing)
        lines = [r for r in caplog.records if "updates from" in r.getMessage()]
        assert 1 <= len(lines) <= 2, [r.getMessage() for r in lines]  # not one per attempt


def test_a_consumer_started_while_redis_is_down_connects_later_and_closes_promptly(
    redis_cluster, names
):  # noqa: F811
    from tests.storage_fixtures import free_cluster_ports

    model, table, topic = names
    dead = f"127.0.0.1:{free_cluster_ports(1)[0]}"
    c = UpdateConsumer(
        dead,
        "g",
        "c",
        {topic: 2},
        Collector(),
        block_ms=200,
        backoff_ms=10,
        connect_timeout=0.2,
        socket_timeout=0.3,
    )
    c.start()
    wait_for(lambda: c.stats()["redis_errors"] >= 3, "3 failed connection attempts")
    assert "cannot connect" in c.stats()["last_error"]
    t0 = time.monotonic()
    c.close()
    assert_closed_for_good(c, time.monotonic() - t0)
    with pytest.raises(ConfigError):
        UpdateConsumer("no-port", "g", "c", {topic: 2}, Collector())


def owns(cluster, i, key):
    try:
        return cluster.command(i, "EXISTS", key) == "1"
    except RuntimeError as e:  # MOVED: another master serves the key's slot
        assert "MOVED" in str(e)
        return False


@pytest.mark.redis
def test_the_consumer_recovers_when_a_node_comes_back_empty(names):
    """The master holding the stream restarts without its data (no persistence): the
    consumer creates its group again and applies what is published afterwards."""
    from tests.storage_fixtures import start_redis_cluster

    model, table, topic = names
    with start_redis_cluster(3) as cluster:
        c = UpdateConsumer(
            cluster.address,
            "g",
            "c",
            {topic: 2},
            Collector(),
            block_ms=100,
            backoff_ms=10,
            socket_timeout=0.5,
            connect_timeout=0.5,
        ).start()
        try:
            with UpdateProducer(cluster.address, socket_timeout=0.5, connect_timeout=0.5) as p:
                p.publish(model, table, *rows(3, 2, seed=5))
                wait_for(lambda: len(c.apply.rows) == 3, "the first rows")
                owner = next(i for i in range(3) if owns(cluster, i, topic))
                cluster.kill(owner)
                wait_for(lambda: c.stats()["redis_errors"] >= 2, "failures while it is down")
                cluster.restart(owner)
                keys, vecs = rows(4, 2, seed=6)

                def published():
                    try:
                        p.publish(model, table, keys, vecs)
                        return True
                    except StoreError:
                        return False

                wait_for(published, "a publish after the restart")
                wait_for(lambda: len(c.apply.rows) == 7, "the rows published after the restart")
            for k, v in zip(keys.tolist(), vecs):
                np.testing.assert_array_equal(c.apply.rows[(model, table, k)], v)
        finally:
            c.close()


def test_start_latest_skips_what_was_published_before(redis_cluster, names):  # noqa: F811
    model, table, topic = names
    with UpdateProducer(redis_cluster.address) as p:
        p.publish(model, table, *rows(5, 2, seed=7))
        c = UpdateConsumer(
            redis_cluster.address, "late", "c", {topic: 2}, Collector(), start="latest"
        )
        try:
            c.poll_once(10)  # creates the group at the end of the stream
            keys, vecs = rows(2, 2, seed=8)
            p.publish(model, table, keys, vecs)
            consume_until(c, lambda: len(c.apply.rows) == 2)
            assert sorted(k for _, _, k in c.apply.rows) == sorted(keys.tolist())
        finally:
            c.close()
    with pytest.raises(ValueError):
        UpdateConsumer(redis_cluster.address, "g", "c", {topic: 2}, Collector(), start="newest")


def test_small_messages_are_applied_in_batches_of_at_most_count_rows_last_row_wins(
    redis_cluster, names
):  # noqa: F811
    model, table, topic = names
    calls = []

    def apply(m, t, keys, vectors):
        calls.append((keys.copy(), vectors.copy()))

    keys = np.arange(40, dtype=np.int64) % 30  # keys 0..9 are sent twice
    vecs = np.arange(80, dtype=np.float32).reshape(40, 2)
    with UpdateProducer(redis_cluster.address, max_batch_size=4) as p:  # 10 messages
        assert p.publish(model, table, keys, vecs) == 10
    c = UpdateConsumer(redis_cluster.address, "g", "c", {topic: 2}, apply, count=12, read_count=32)
    try:
        consume_until(c, lambda: c.stats()["messages"] == 10)
    finally:
        c.close()
    assert all(len(k) <= 12 for k, _ in calls) and len(calls) < 10  # merged, bounded
    final = {}
    for k, v in calls:
        assert len(set(k.tolist())) == len(k)  # no key twice in one call
        for key, row in zip(k.tolist(), v):
            final[key] = row
    for i in range(30):
        np.testing.assert_array_equal(final[i], vecs[i + 30 if i < 10 else i])


def test_publish_refuses_bad_input_and_sends_nothing(redis_cluster, names):  # noqa: F811
    model, table, topic = names
    keys, vecs = rows(3, 2)
    with UpdateProducer(redis_cluster.address) as p:
        for bad_keys, bad_vecs in [
            (keys.astype(np.float32), vecs),
            (keys, vecs[:2]),
            (keys, vecs.astype(np.int64)),
            (keys, vecs[:, :0]),
        ]:
            with pytest.raises(ValueError):
                p.publish(model, table, bad_keys, bad_vecs)
        with pytest.raises(ConfigError):
            p.publish("a.b", table, keys, vecs)
        assert p.publish(model, table, keys[:0], vecs[:0]) == 0
        # other integer / float dtypes are converted
        assert p.publish(model, table, keys.astype(np.int32), vecs.astype(np.float64)) == 1
    assert stream_info(redis_cluster.address, model, table)["length"] == 1
    with pytest.raises(ValueError):
        UpdateProducer(redis_cluster.address, max_batch_size=0)


def test_the_thread_retries_a_failing_apply_with_backoff_until_it_succeeds(redis_cluster, names):  # noqa: F811
    model, table, topic = names
    keys, vecs = rows(6, 2, seed=9)
    with UpdateProducer(redis_cluster.address) as p:
        p.publish(model, table, keys, vecs)
    with UpdateConsumer(
        redis_cluster.address,
        "g",
        "c",
        {topic: 2},
        Collector(fail_times=3),
        block_ms=50,
        backoff_ms=5,
    ) as c:
        c.start()
        wait_for(lambda: len(c.apply.rows) == 6, "the rows after 3 failures")
        s = c.stats()
        assert s["apply_errors"] == 3 and s["messages"] == 1 and "tier down" in s["last_error"]
    assert stream_info(redis_cluster.address, model, table)["groups"][0]["pending"] == 0


def test_the_cli_exits_1_when_redis_is_unreachable(tmp_path):
    from tests.storage_fixtures import free_cluster_ports

    keys, vecs = rows(2, 2)
    np.savez(tmp_path / "d.npz", keys=keys, vectors=vecs)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "triton_rec.updates",
            "publish",
            "--address",
            f"127.0.0.1:{free_cluster_ports(1)[0]}",
            "--model",
            "m",
            "--table",
            "t",
            "--npz",
            str(tmp_path / "d.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "cannot connect" in r.stderr, r.stderr
