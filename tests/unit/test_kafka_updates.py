"""HPS's Kafka update source (``update_source`` type ``kafka_message_queue``) against a
real Kafka-protocol broker (the ``kafka_broker`` fixture: Tansu, started by the test
session), never a mock.

The consumers here use short group timeouts (``GROUP``): joining a group takes about half
the session timeout on this broker, and a consumer restarted in a group resumes at once.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.storage_fixtures import kafka_broker, rocksdb_dir  # noqa: F401  (fixtures)
from triton_rec.config.ps_json import UpdateSourceParams, parse_ps_config
from triton_rec.errors import ConfigError
from triton_rec.serving.deployment import InstanceSpec, open_session
from triton_rec.updates import (
    MAGIC,
    KafkaUpdateConsumer,
    KafkaUpdateProducer,
    encode_message,
    kafka_info,
    topic_name,
)
from triton_rec.updates.online import default_group

#: group timeouts of every consumer here (the defaults are HPS's 30 s and 5 min)
GROUP = dict(session_timeout_ms=6000, max_poll_interval_ms=6000)


def rows(n, d, seed=0, low=0):
    rng = np.random.default_rng(seed)
    return (
        np.arange(low, low + n, dtype=np.int64) * 7919 + int(rng.integers(1, 1000)),
        rng.standard_normal((n, d)).astype(np.float32),
    )


def hps_message(keys, vecs):
    """An HPS message written by hand from the format: "HCTR", value size, (key, value)*."""
    d = vecs.shape[1]
    out = struct.pack("<II", MAGIC, 4 * d)
    for k, v in zip(keys.tolist(), vecs):
        out += struct.pack(f"<q{d}f", k, *v.tolist())
    return out


class Collector:
    """``apply`` that records rows (and every call), failing its first ``fail_times`` calls."""

    def __init__(self, fail_times=0):
        self.rows = {}
        self.calls = []
        self.fail_times = fail_times

    def __call__(self, model, table, keys, vectors):
        if self.fail_times:
            self.fail_times -= 1
            raise RuntimeError("tier down")
        self.calls.append((model, table, keys.copy()))
        for k, v in zip(keys.tolist(), vectors):
            self.rows[(model, table, k)] = v.copy()

    def applied_keys(self):
        return [k for _, _, ks in self.calls for k in ks.tolist()]


def poll_until(consumer, cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out; stats {consumer.stats()}"
        consumer.poll_once(200)


@pytest.fixture
def names():
    tag = uuid.uuid4().hex[:8]
    return f"m{tag}", f"g{tag}"


def create_topic(brokers, topic, partitions):
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": brokers})
    for f in admin.create_topics([NewTopic(topic, num_partitions=partitions)]).values():
        f.result(10)


def read_raw(brokers, topic, n, timeout=10.0):
    """The first ``n`` messages of ``topic`` read without a group (assigned partitions)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": brokers, "group.id": "raw", "enable.auto.commit": False})
    try:
        md = c.list_topics(topic, timeout=timeout).topics[topic]
        c.assign([TopicPartition(topic, p, 0) for p in md.partitions])
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            out += [m for m in c.consume(n, 0.2) if m.error() is None]
        return out
    finally:
        c.close()


# ---- the format on the wire ------------------------------------------------------------


def test_published_messages_are_hps_sink_messages_byte_for_byte(kafka_broker, names):  # noqa: F811
    model, _ = names
    topic = topic_name(model, "t0")
    create_topic(kafka_broker.brokers, topic, 1)
    keys, vecs = rows(5, 3)
    with KafkaUpdateProducer(kafka_broker.brokers, max_batch_size=2) as p:
        assert p.publish(model, "t0", keys, vecs) == 3  # 2 + 2 + 1 pairs
    msgs = read_raw(kafka_broker.brokers, topic, 3)
    assert [m.topic() for m in msgs] == [topic] * 3 == ["hps_et." + model + ".t0"] * 3
    assert all(m.key() is None for m in msgs)  # HPS's messages have an empty key
    want = [hps_message(keys[s : s + 2], vecs[s : s + 2]) for s in (0, 2, 4)]
    assert [m.value() for m in msgs] == want
    assert want[0][:4] == b"HCTR"


def test_rows_go_to_partitions_by_hps_key_groups_and_send_buffer_size_splits(
    kafka_broker,  # noqa: F811
    names,
):
    from triton_rec.storage.redis_store import partition_of

    model, _ = names
    topic = topic_name(model, "t")
    create_topic(kafka_broker.brokers, topic, 3)
    keys, vecs = rows(200, 4)
    # 8 + 10 pairs of 24 bytes: 10 pairs per message
    with KafkaUpdateProducer(kafka_broker.brokers, send_buffer_size=8 + 10 * 24) as p:
        n = p.publish(model, "t", keys, vecs)
    msgs = read_raw(kafka_broker.brokers, topic, n)
    assert len(msgs) == n
    seen = {}
    for m in msgs:
        assert len(m.value()) <= 8 + 10 * 24
        body = np.frombuffer(m.value(), [("k", "<i8"), ("v", "<f4", (4,))], offset=8)
        for k in body["k"].tolist():
            seen[k] = m.partition()
    assert sorted(seen) == sorted(keys.tolist())
    want = partition_of(keys, 8) % 3  # HPS: key group (8 per sink), then mod partitions
    assert [seen[k] for k in keys.tolist()] == want.tolist()


# ---- consuming ---------------------------------------------------------------------------


def test_offsets_are_committed_after_apply_and_a_restarted_consumer_resumes_after_them(
    kafka_broker,  # noqa: F811
    names,
):
    model, group = names
    topic = topic_name(model, "t")
    create_topic(kafka_broker.brokers, topic, 2)
    brokers = kafka_broker.brokers
    first, first_v = rows(40, 2, seed=1)
    more, more_v = rows(30, 2, seed=2, low=1000)
    with KafkaUpdateProducer(brokers, max_batch_size=4) as p:
        p.publish(model, "t", first, first_v)
        # nothing is committed while the apply fails
        c = KafkaUpdateConsumer(brokers, group, {topic: 2}, Collector(fail_times=2), **GROUP)
        collect = c.apply
        try:
            poll_until(c, lambda: c.stats()["apply_errors"] >= 1)
            info = kafka_info(brokers, model, "t", group=group)
            assert all(part["committed"] is None for part in info["partitions"])
            poll_until(c, lambda: len(collect.rows) == 40)
            # every offset is committed once applied: the one after each partition's last
            # message (read here; this broker's high watermark is wrong after a batch of
            # several messages, so it is not asked)
            info = kafka_info(brokers, model, "t", group=group)
            ends = {}
            for m in read_raw(brokers, topic, c.stats()["messages"]):
                ends[m.partition()] = max(ends.get(m.partition(), 0), m.offset() + 1)
            assert {q["partition"]: q["committed"] for q in info["partitions"]} == ends
            assert sum(ends.values()) == c.stats()["messages"]
        finally:
            c.close()
        assert sorted(collect.applied_keys()) == sorted(first.tolist())  # each once
        assert c.stats()["vectors"] == 40 and c.stats()["apply_errors"] == 2
        # stopped: M more are published; a new consumer of the group applies exactly those
        p.publish(model, "t", more, more_v)
    again = Collector()
    c2 = KafkaUpdateConsumer(brokers, group, {topic: 2}, again, **GROUP)
    try:
        poll_until(c2, lambda: len(again.rows) == 30)
        c2.poll_once(300)  # nothing else comes
    finally:
        c2.close()
    assert sorted(again.applied_keys()) == sorted(more.tolist())
    for k, v in zip(more.tolist(), more_v):
        np.testing.assert_array_equal(again.rows[(model, "t", k)], v)
    # a new group starts at the earliest offset (HPS: auto.offset.reset=smallest)
    fresh = Collector()
    c3 = KafkaUpdateConsumer(brokers, group + "x", {topic: 2}, fresh, **GROUP)
    try:
        poll_until(c3, lambda: len(fresh.rows) == 70)
    finally:
        c3.close()


def test_malformed_messages_are_dropped_and_counted_and_the_good_ones_around_them_applied(
    kafka_broker,  # noqa: F811
    names,
):
    model, group = names
    topic = topic_name(model, "t")
    create_topic(kafka_broker.brokers, topic, 1)  # one partition: the order is kept
    k1, v1 = rows(3, 2, seed=3)
    k2, v2 = rows(3, 2, seed=4, low=100)
    good1, good2 = hps_message(k1, v1), hps_message(k2, v2)
    pair = struct.pack("<q2f", 5, 1.0, 2.0)
    sent = [
        (good1, None),
        (b"XXXX" + struct.pack("<I", 8) + pair, None),  # wrong magic
        (good1, b"k"),  # a Kafka key: HPS never sends one
        (b"HCT", None),  # shorter than the header
        (b"HCTR" + struct.pack("<I", 8) + pair[:-1], None),  # not a whole number of pairs
        (b"HCTR" + struct.pack("<I", 12) + b"\0" * 20, None),  # 3 floats, the table has 2
        (b"HCTR" + struct.pack("<I", 8), None),  # a beacon: skipped, not counted
        (None, None),  # a tombstone: skipped, not counted
        (good2, None),
    ]
    with KafkaUpdateProducer(kafka_broker.brokers) as p:
        for value, key in sent:
            p.publish_raw(topic, value, key)
    collect = Collector()
    c = KafkaUpdateConsumer(kafka_broker.brokers, group, {topic: 2}, collect, **GROUP)
    try:
        poll_until(c, lambda: len(collect.rows) == 6)
        poll_until(
            c,
            lambda: (
                kafka_info(kafka_broker.brokers, model, "t", group=group)["partitions"][0][
                    "committed"
                ]
                == len(sent)
            ),
        )
    finally:
        c.close()
    st = c.stats()
    assert st["malformed"] == 5 and st["messages"] == 2 and st["vectors"] == 6
    assert "bytes" in st["last_error"] or "floats" in st["last_error"]
    for k, v in list(zip(k1.tolist(), v1)) + list(zip(k2.tolist(), v2)):
        np.testing.assert_array_equal(collect.rows[(model, "t", k)], v)


def test_topics_not_followed_are_ignored_and_a_topic_created_later_is_followed(
    kafka_broker,  # noqa: F811
    names,
):
    model, group = names
    brokers = kafka_broker.brokers
    a, later = topic_name(model, "a"), topic_name(model, "later")
    create_topic(brokers, a, 1)
    collect = Collector()
    c = KafkaUpdateConsumer(
        brokers,
        group,
        {a: 2, later: 2},  # "later" does not exist yet
        collect,
        metadata_refresh_interval_ms=200,
        **GROUP,
    )
    try:
        ka, va = rows(4, 2, seed=5)
        with KafkaUpdateProducer(brokers) as p:
            p.publish(model, "other", *rows(4, 2, seed=6))  # another table of the model
            p.publish("x" + model, "a", *rows(4, 2, seed=7))  # the same table of another model
            p.publish_raw("__hps_beacon", b"HCTR" + struct.pack("<I", 8))
            p.publish(model, "a", ka, va)
            poll_until(c, lambda: len(collect.rows) == 4)
            kl, vl = rows(3, 2, seed=8, low=500)
            p.publish(model, "later", kl, vl)  # the broker creates the topic now
            poll_until(c, lambda: len(collect.rows) == 7)
    finally:
        c.close()
    assert {(m, t) for m, t, _ in collect.calls} == {(model, "a"), (model, "later")}
    st = c.stats()
    assert st["malformed"] == 0 and st["apply_errors"] == 0 and st["vectors"] == 7


# ---- a model's consumer: RocksDB tier and the shared cache ---------------------------------

TABLES = [SyntheticTable("a", rows=500, vec_size=8, max_keys_per_sample=2, default_value=-1.0)]


def test_a_sessions_consumer_writes_rocksdb_and_the_cache_and_resumes_after_a_restart(
    kafka_broker,  # noqa: F811
    rocksdb_dir,  # noqa: F811
    names,
    tmp_path,
):
    model, group = names
    entry = write_model(str(tmp_path / "repo"), model, TABLES, 3)
    entry.update(gpucache=True, gpucacheper=0.5, hit_rate_threshold=2.0)
    doc = {
        "supportlonglong": True,
        "models": [entry],
        "volatile_db": {"type": "disabled"},
        "persistent_db": {"type": "rocks_db", "path": str(rocksdb_dir)},
        "update_source": {
            "type": "kafka",
            "brokers": kafka_broker.brokers,
            "group": group,
            "poll_timeout_ms": 100,
            **GROUP,
        },
    }
    params = parse_ps_config(doc, base_dir=str(tmp_path / "repo")).models[0]
    spec = InstanceSpec(store_dir=str(tmp_path / "store"))
    keys = table_keys(3, 0, 500)[:6]

    def looked_up(session, k):
        return session.lookup(session.parse_request(k, np.array([len(k)], np.int32)))

    session = open_session(params, spec)
    try:
        consumer = session.services[0].consumer
        assert consumer.group == group
        looked_up(session, keys)  # cached now: the update must reach the cache too
        new = np.full((3, 8), 4.5, np.float32)
        with KafkaUpdateProducer(kafka_broker.brokers) as p:
            p.publish(model, "a", keys[:3], new)
        want = expected_vectors(3, 0, keys, 8)
        want[:3] = new
        deadline = time.monotonic() + 20
        while not np.array_equal(looked_up(session, keys), want.reshape(-1)):
            assert time.monotonic() < deadline, consumer.stats()
            time.sleep(0.05)
        ct = session.cached_tables[0]
        cached, hit = np.empty((3, 8), np.float32), np.zeros(3, np.uint8)
        assert ct.cache.query(keys[:3], cached, hit) == 3
        np.testing.assert_array_equal(cached, new)
        stored = np.empty((3, 8), np.float32)
        ct.store.fetch(keys[:3], stored)
        np.testing.assert_array_equal(stored, new)
        assert consumer.stats()["vectors"] == 3
    finally:
        session.close()
    # stopped; an update published meanwhile is applied by the next session of the node
    newer = np.full((2, 8), -7.25, np.float32)
    with KafkaUpdateProducer(kafka_broker.brokers) as p:
        p.publish(model, "a", keys[3:5], newer)
    session = open_session(params, spec)
    try:
        consumer = session.services[0].consumer
        want[3:5] = newer
        deadline = time.monotonic() + 20
        while not np.array_equal(looked_up(session, keys), want.reshape(-1)):
            assert time.monotonic() < deadline, consumer.stats()
            time.sleep(0.05)
        time.sleep(0.3)
        assert consumer.stats()["vectors"] == 2  # only what came after the commit
    finally:
        session.close()


# ---- configuration (no broker) -------------------------------------------------------------


def _entry():
    return {
        "model": "m",
        "sparse_files": ["x"],
        "embedding_vecsize_per_table": [4],
        "maxnum_catfeature_query_per_table_per_sample": [1],
        "max_batch_size": 8,
    }


def _update_source(**sec):
    doc = {
        "supportlonglong": True,
        "models": [_entry()],
        "volatile_db": {"type": "disabled"},
        "persistent_db": {"type": "rocks_db"},
        "update_source": sec,
    }
    return parse_ps_config(doc, base_dir="/r").models[0]


@pytest.mark.parametrize("spelling", ["kafka_message_queue", "kafka_mq", "kafka", "KAFKA"])
def test_kafka_update_source_keys_and_hps_defaults(spelling):
    p = _update_source(type=spelling)
    u = p.update_source
    assert u.type == "kafka_message_queue" and u.enabled
    # HPS's UpdateSourceParams defaults (inference_utils.hpp L242-263)
    assert (u.brokers, u.metadata_refresh_interval_ms, u.receive_buffer_size) == (
        "127.0.0.1:9092",
        30000,
        262144,
    )
    assert (u.poll_timeout_ms, u.max_batch_size, u.failure_backoff_ms) == (500, 8192, 50)
    assert (u.max_commit_interval, u.session_timeout_ms) == (32, 30000)
    assert u == UpdateSourceParams(type="kafka_message_queue")
    host = socket.gethostname()
    assert default_group(p) == f"hps.persistent.{host}"
    q = _update_source(type="kafka", brokers="k1:9092,k2:9092", max_commit_interval=4)
    assert q.update_source.brokers == "k1:9092,k2:9092"
    assert q.update_source.max_commit_interval == 4 and q.update_source.unknown_keys == ()
    assert default_group(_update_source(type="kafka", group="node7")) == "node7"
    assert default_group(_update_source(type="redis_stream")) == host


@pytest.mark.parametrize(
    "sec, message",
    [
        ({"brokers": ""}, "update_source.brokers"),
        ({"metadata_refresh_interval_ms": 5}, "metadata_refresh_interval_ms"),
        ({"receive_buffer_size": 1000}, "receive_buffer_size"),
        ({"max_commit_interval": 0}, "max_commit_interval"),
        ({"poll_timeout_ms": 0}, "poll_timeout_ms"),
        ({"session_timeout_ms": 6000, "max_poll_interval_ms": 5000}, "must be >= session"),
    ],
)
def test_bad_kafka_settings_are_refused_naming_the_key(sec, message):
    with pytest.raises(ConfigError, match=message):
        _update_source(type="kafka", **sec)


def test_the_message_codec_is_the_one_the_kafka_producer_sends():
    keys, vecs = rows(3, 2)
    assert encode_message(keys, vecs) == hps_message(keys, vecs)


# ---- the command line ------------------------------------------------------------------------


def test_the_cli_publishes_to_kafka_and_shows_a_groups_offsets(kafka_broker, names, tmp_path):  # noqa: F811
    model, group = names
    keys, vecs = rows(10, 3, seed=9)
    path = tmp_path / "d.npz"
    np.savez(path, keys=keys, vectors=vecs)
    create_topic(kafka_broker.brokers, topic_name(model, "t"), 1)  # 1 partition: 3 messages
    base = [sys.executable, "-m", "triton_rec.updates"]
    r = subprocess.run(
        [*base, "publish", "--brokers", kafka_broker.brokers, "--model", model, "--table", "t"]
        + ["--npz", str(path), "--batch-size", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert f"published 10 vector(s) of size 3 in 3 message(s) to hps_et.{model}.t" in r.stdout
    msgs = read_raw(kafka_broker.brokers, topic_name(model, "t"), 3)
    got = b"".join(m.value()[8:] for m in msgs)
    assert len(got) == 10 * (8 + 12)
    r = subprocess.run(
        [*base, "info", "--brokers", kafka_broker.brokers, "--model", model, "--table", "t"]
        + ["--group", group],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert '"committed": null' in r.stdout and f'"topic": "hps_et.{model}.t"' in r.stdout
