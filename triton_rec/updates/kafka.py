"""Online updates over Kafka, as HPS sends and reads them (``update_source`` of type
``kafka_message_queue``).

- :class:`KafkaUpdateProducer`: HPS's ``KafkaMessageSink``: one topic per table,
  ``hps_et.<model>.<table>``; each message value is the HPS message
  (:mod:`triton_rec.updates.codec`) and its Kafka key is empty; the rows of a batch go to
  partitions by a hash of the key, so the updates of one key keep their order.
- :class:`KafkaUpdateConsumer`: HPS's ``KafkaMessageSource``: a consumer group, automatic
  commits off, a new group starts at the earliest offset; the offsets of a batch are
  committed synchronously only after it was applied (or dropped as malformed). A consumer
  restarted in the same group resumes after the last committed offset. Delivery is at
  least once: a consumer that stops between an apply and its commit (a crash, a lost
  group membership) has that batch applied again by whoever reads the partition next,
  which upserts make harmless.
- :func:`kafka_info`: a topic's partitions, their offsets and a group's committed offsets.

The client is ``confluent-kafka`` (librdkafka, the library HPS links), imported when
first used: it is in the ``tiers`` extra. Upstream's code and what differs here:
docs/upstream-notes.md, "Online updates".
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from triton_rec.config.ps_json import UpdateSourceParams, field_defaults
from triton_rec.errors import ConfigError
from triton_rec.storage.backing_store import StoreError, StoreUnavailableError, chunks
from triton_rec.storage.redis_store import partition_of
from triton_rec.updates.codec import HEADER_SIZE, check_update_rows, encode_message, topic_name
from triton_rec.updates.consumer import LOG_EVERY, ApplyFn, ConsumerCore
from triton_rec.util.log_throttle import LogThrottle

log = logging.getLogger(__name__)

#: the ``update_source`` defaults (one source: the ps.json dataclass)
_DEFAULTS = field_defaults(UpdateSourceParams)
#: HPS's ``heartbeat.interval.ms`` (kafka_message.cpp); kept below a third of the session
#: timeout when that is shorter.
HEARTBEAT_INTERVAL_MS = 3000
#: HPS's sink: key groups per batch (``num_partitions``, kafka_message.hpp) and the largest
#: message in bytes (``send_buffer_size``, 256 KiB).
SINK_KEY_GROUPS = 8
SINK_SEND_BUFFER_SIZE = 262144
#: seconds a publish waits for the broker to acknowledge its messages
FLUSH_TIMEOUT = 30.0


def _kafka():
    try:
        import confluent_kafka
    except ImportError as e:  # pragma: no cover - the tiers extra installs it
        raise ConfigError(
            "update_source of type kafka_message_queue needs the confluent-kafka package "
            "(pip install 'triton-rec[tiers]')"
        ) from e
    return confluent_kafka


def _check_brokers(brokers: str) -> str:
    if not isinstance(brokers, str) or not brokers.strip():
        raise ConfigError(f"Kafka brokers must be 'host:port[,host:port...]', got {brokers!r}")
    return brokers.strip()


class KafkaUpdateProducer:
    """Publishes updates (the trainer side) to Kafka the way HPS's ``KafkaMessageSink`` does.

    Args:
        brokers: ``host:port[,host:port...]`` bootstrap servers.
        max_batch_size: most key/value pairs per message.
        send_buffer_size: most bytes per message (HPS's default 256 KiB); a batch is split
            into as many messages as these two limits need.
        config: more librdkafka producer settings (they win over ours).

    Producer settings as HPS: ``enable.idempotence`` true, ``message.max.bytes`` =
    ``send_buffer_size`` + 1024. A row goes to partition
    ``(mix64(key) % 8) % partitions`` (HPS's key groups), so one key's updates stay in
    order; a topic that does not exist yet is created by the broker on the first message
    (if it allows that), all of that first batch in one partition.

    Raises:
        ConfigError: empty brokers, or confluent-kafka missing; ValueError: bad sizes.

    Thread-safety: :meth:`publish` may be called from several threads.
    """

    def __init__(
        self,
        brokers: str,
        max_batch_size: int = _DEFAULTS["max_batch_size"],
        send_buffer_size: int = SINK_SEND_BUFFER_SIZE,
        config: Optional[Dict[str, Any]] = None,
    ):
        if int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if int(send_buffer_size) < HEADER_SIZE + 12:
            raise ValueError(f"send_buffer_size must be >= 20 bytes, got {send_buffer_size}")
        self.brokers = _check_brokers(brokers)
        self.max_batch_size = int(max_batch_size)
        self.send_buffer_size = int(send_buffer_size)
        conf = {
            "bootstrap.servers": self.brokers,
            "enable.idempotence": True,
            "message.max.bytes": self.send_buffer_size + 1024,
            "logger": logging.getLogger(__name__ + ".librdkafka"),
            **(config or {}),
        }
        self._producer = _kafka().Producer(conf)
        self._partitions: Dict[str, int] = {}

    def _partition_count(self, topic: str) -> int:
        n = self._partitions.get(topic)
        if n:
            return n
        try:
            md = self._producer.list_topics(topic, timeout=5.0).topics.get(topic)
        except Exception as e:  # KafkaException: brokers unreachable
            raise StoreUnavailableError(f"Kafka {self.brokers}: {e}") from e
        n = len(md.partitions) if md is not None and md.error is None else 0
        if n:
            self._partitions[topic] = n
        return n

    def publish(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Send the rows to topic ``hps_et.<model>.<table>`` and wait until the broker
        has them; returns the number of messages.

        ``keys``: 1-D integers (int64 range); ``vectors``: ``[M, D]`` floats (sent as
        float32). Raises ValueError for other shapes or dtypes, ConfigError for bad names,
        StoreUnavailableError if the brokers do not take the messages in
        ``FLUSH_TIMEOUT`` s (messages delivered before stay).
        """
        topic = topic_name(model, table)
        keys, vectors = check_update_rows(keys, vectors)
        keys = keys.astype(np.int64, copy=False)
        pair = 8 + 4 * vectors.shape[1]
        per_message = min(self.max_batch_size, (self.send_buffer_size - HEADER_SIZE) // pair)
        if per_message < 1:
            raise ValueError(
                f"one key/value pair ({pair} bytes) and the header do not fit in "
                f"send_buffer_size {self.send_buffer_size}"
            )
        partitions = self._partition_count(topic)
        if partitions:  # HPS's key groups, then the group modulo the topic's partitions
            part = partition_of(keys, SINK_KEY_GROUPS) % partitions
            groups = [(int(p), np.flatnonzero(part == p)) for p in np.unique(part)]
        else:  # a new topic: the broker creates it with the first message
            groups = [(-1, np.arange(keys.shape[0]))]
        errors: List[str] = []

        def delivered(err, msg):
            if err is not None:
                errors.append(str(err))

        sent = 0
        for p, rows in groups:
            for s, e in chunks(rows.shape[0], per_message):
                idx = rows[s:e]
                m = encode_message(keys[idx], np.ascontiguousarray(vectors[idx], dtype=np.float32))
                kwargs = {} if p < 0 else {"partition": p}
                self._produce(topic, m, delivered, kwargs)
                sent += 1
        left = self._producer.flush(FLUSH_TIMEOUT)
        if left or errors:
            raise StoreUnavailableError(
                f"Kafka {self.brokers} topic {topic}: "
                + (f"{left} message(s) not delivered in {FLUSH_TIMEOUT:.0f} s" if left else "")
                + ("; " if left and errors else "")
                + (f"delivery failed: {errors[0]}" if errors else "")
            )
        return sent

    def publish_raw(self, topic: str, value: Optional[bytes], key: Optional[bytes] = None) -> None:
        """Send one message as given (any value, a Kafka key) and wait for it: for tests
        and tools that need a message HPS would never send."""
        self._produce(topic, value, None, {} if key is None else {"key": key})
        if self._producer.flush(FLUSH_TIMEOUT):
            raise StoreUnavailableError(f"Kafka {self.brokers} topic {topic}: not delivered")

    def _produce(self, topic: str, value, callback, kwargs) -> None:
        while True:
            try:
                self._producer.produce(topic, value=value, on_delivery=callback, **kwargs)
                return
            except BufferError:  # the local queue is full: let it drain
                self._producer.poll(0.1)

    def close(self) -> None:
        """Send what is queued (at most ``FLUSH_TIMEOUT`` s); idempotent."""
        self._producer.flush(FLUSH_TIMEOUT)

    def __enter__(self) -> KafkaUpdateProducer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def consumer_config(
    brokers: str,
    group: str,
    start: str = _DEFAULTS["start"],
    metadata_refresh_interval_ms: int = _DEFAULTS["metadata_refresh_interval_ms"],
    receive_buffer_size: int = _DEFAULTS["receive_buffer_size"],
    session_timeout_ms: int = _DEFAULTS["session_timeout_ms"],
    max_poll_interval_ms: int = _DEFAULTS["max_poll_interval_ms"],
) -> Dict[str, Any]:
    """The librdkafka settings of a consumer, HPS's (``KafkaMessageSource``'s constructor)
    where it sets one: a group, no automatic commit, ``auto.offset.reset`` smallest
    (``start="earliest"``) or largest (``"latest"``)."""
    if start not in ("earliest", "latest"):
        raise ValueError(f"start must be 'earliest' or 'latest', got {start!r}")
    return {
        "bootstrap.servers": _check_brokers(brokers),
        "group.id": group,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,  # we commit explicit offsets
        "auto.offset.reset": "smallest" if start == "earliest" else "largest",
        "allow.auto.create.topics": True,
        "topic.metadata.refresh.interval.ms": int(metadata_refresh_interval_ms),
        "message.max.bytes": int(receive_buffer_size) + 1024,
        "session.timeout.ms": int(session_timeout_ms),
        "heartbeat.interval.ms": max(1, min(HEARTBEAT_INTERVAL_MS, int(session_timeout_ms) // 3)),
        "max.poll.interval.ms": int(max_poll_interval_ms),
        "logger": logging.getLogger(__name__ + ".librdkafka"),
    }


class KafkaUpdateConsumer(ConsumerCore):
    """Consumes Kafka topics in a consumer group and applies them (HPS's
    ``KafkaMessageSource``; the module docstring says what that means).

    Args:
        brokers: ``host:port[,host:port...]`` bootstrap servers.
        group: consumer group id (one per node: every group sees every update; the
            instances of a node share the partitions).
        topics: ``{topic: vec_size}`` to follow (``hps_et.<model>.<table>``); a topic that
            does not exist yet is followed once it does (``metadata_refresh_interval_ms``).
        apply: as for :class:`~triton_rec.updates.consumer.ConsumerCore`; the offsets of
            what it was given are committed after it returns.
        count: most rows per ``apply`` call (HPS ``max_batch_size``).
        poll_timeout_ms: longest wait for messages in one :meth:`poll_once`.
        backoff_ms: first wait after a failure (``apply`` raised): the messages not
            applied are read again from Kafka after it.
        max_commit_interval: most messages read, applied and committed at once.
        start, metadata_refresh_interval_ms, receive_buffer_size, session_timeout_ms,
            max_poll_interval_ms: :func:`consumer_config`.
        config: more librdkafka settings (they win over ours).

    Dropped and counted as ``malformed`` (offsets committed past them): a message with a
    Kafka key, shorter than the 8-byte header, with another magic, a value size not
    ``4 * vec_size``, or a body that is not a whole number of pairs. Skipped without a
    count: tombstones (no value) and beacons (a header only), as HPS. Messages of a topic
    not in ``topics`` are skipped and counted as ``ignored``. Kafka errors are logged (once
    per ``LOG_EVERY`` s) and counted (``kafka_errors``); librdkafka retries them itself.
    A topic that does not exist yet is logged once, not counted.

    Raises:
        ConfigError: empty brokers, or confluent-kafka missing; ValueError: bad
            arguments; UpdateMessageError: a topic that is not ``hps_et.<model>.<table>``.

    Thread-safety: use either :meth:`start` or calls of :meth:`poll_once` from one
    thread; :meth:`stats` and :meth:`close` may be called from any thread.
    """

    def __init__(
        self,
        brokers: str,
        group: str,
        topics: Dict[str, int],
        apply: ApplyFn,
        count: int = _DEFAULTS["max_batch_size"],
        poll_timeout_ms: int = _DEFAULTS["poll_timeout_ms"],
        backoff_ms: int = _DEFAULTS["failure_backoff_ms"],
        max_commit_interval: int = _DEFAULTS["max_commit_interval"],
        start: str = _DEFAULTS["start"],
        metadata_refresh_interval_ms: int = _DEFAULTS["metadata_refresh_interval_ms"],
        receive_buffer_size: int = _DEFAULTS["receive_buffer_size"],
        session_timeout_ms: int = _DEFAULTS["session_timeout_ms"],
        max_poll_interval_ms: int = _DEFAULTS["max_poll_interval_ms"],
        config: Optional[Dict[str, Any]] = None,
    ):
        super().__init__(topics, apply, count, backoff_ms, counters=("kafka_errors", "ignored"))
        if not isinstance(group, str) or not group:
            raise ValueError(f"group must be a non-empty string, got {group!r}")
        for what, n, low in (
            ("poll_timeout_ms", poll_timeout_ms, 0),
            ("max_commit_interval", max_commit_interval, 1),
        ):
            if int(n) < low:
                raise ValueError(f"{what} must be >= {low}, got {n}")
        self.group = group
        self.poll_timeout_ms = int(poll_timeout_ms)
        self.max_commit_interval = int(max_commit_interval)
        ck = _kafka()
        self._ck = ck
        conf = consumer_config(
            brokers,
            group,
            start,
            metadata_refresh_interval_ms,
            receive_buffer_size,
            session_timeout_ms,
            max_poll_interval_ms,
        )
        conf["error_cb"] = self._on_error
        conf.update(config or {})
        self.brokers = conf["bootstrap.servers"]
        self._kafka_log = LogThrottle(LOG_EVERY)
        self._missing_logged: set = set()
        self._retry_at = 0.0  # monotonic time before which nothing is read (after a failure)
        self._consumer = ck.Consumer(conf)
        self._closed = False
        self._consumer.subscribe(list(self.topics))

    # -- bookkeeping ------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters: ``messages`` and ``vectors`` applied, ``malformed`` (dropped),
        ``apply_errors``, ``kafka_errors``, ``ignored`` (messages of topics not followed),
        ``last_error`` (text of the last failure, "" if none)."""
        return super().stats()

    def _kafka_error(self, err) -> None:
        self._count(error=f"Kafka {self.brokers}: {err}", kafka_errors=1)
        allowed, held = self._kafka_log.allow()
        if allowed:
            log.warning(
                "updates from Kafka %s (group %s)%s: %s",
                self.brokers,
                self.group,
                f", {held} more errors not logged" if held else "",
                err,
            )

    def _on_error(self, err) -> None:
        """librdkafka's error callback (called from :meth:`poll_once`'s thread)."""
        self._kafka_error(err)

    # -- consuming --------------------------------------------------------------------

    def poll_once(self, timeout_ms: Optional[int] = None) -> int:
        """Read at most ``max_commit_interval`` messages (waiting at most ``timeout_ms``,
        default ``poll_timeout_ms``), apply them, commit their offsets; returns the
        vectors applied. Failures are logged and counted, never raised."""
        budget = (self.poll_timeout_ms if timeout_ms is None else max(0, int(timeout_ms))) / 1e3
        wait = self._retry_at - time.monotonic()
        if wait > 0:  # after a failed apply: keep polling (group membership), read nothing
            self._stop.wait(min(wait, budget))
            return 0
        msgs = self._consumer.consume(num_messages=self.max_commit_interval, timeout=budget)
        if not msgs:
            return 0
        by_topic: Dict[str, List[Tuple[Tuple[int, int], Optional[bytes]]]] = {}
        handled: Dict[Tuple[str, int], List[int]] = {}  # (topic, partition) -> offsets read
        done: set = set()  # (topic, partition, offset) applied, dropped or skipped
        for m in msgs:
            err = m.error()
            if err is not None:
                self._message_error(m, err)
                continue
            topic, key = m.topic(), (m.partition(), m.offset())
            handled.setdefault((topic, key[0]), []).append(key[1])
            value = m.value()
            if topic not in self.topics:
                self._count(ignored=1)
                done.add((topic, *key))
            elif value is None:  # a tombstone: nothing to apply (HPS ignores them)
                done.add((topic, *key))
            elif m.key():  # HPS's messages have no key; HPS discards those that do
                self._drop_malformed(
                    topic, key, ValueError(f"message has a {len(m.key())}-byte Kafka key")
                )
                done.add((topic, *key))
            else:
                by_topic.setdefault(topic, []).append((key, value))
        applied = 0
        for topic, messages in by_topic.items():
            ok, n, failures = self._apply_messages(topic, messages)
            applied += n
            done.update((topic, p, o) for p, o in ok)
            if failures:
                self._retry_at = max(self._retry_at, time.monotonic() + self._backoff(failures))
        self._commit(handled, done)
        return applied

    def _message_error(self, m, err) -> None:
        codes = self._ck.KafkaError
        if err.code() == codes._PARTITION_EOF:
            return
        if err.code() == codes.UNKNOWN_TOPIC_OR_PART:
            # subscribed before the trainer published: followed once the topic exists
            topic = m.topic()
            if topic not in self._missing_logged:
                self._missing_logged.add(topic)
                log.info("updates: Kafka topic %s does not exist yet; followed once it does", topic)
            return
        self._kafka_error(err)

    def _commit(self, handled: Dict[Tuple[str, int], List[int]], done: set) -> None:
        """Commit, per partition, the offset after the longest run of done messages; seek
        back to the first message not done (delivered again after the backoff)."""
        tp = self._ck.TopicPartition
        commits = []
        for (topic, p), offsets in handled.items():
            offsets.sort()
            first_not_done = next((o for o in offsets if (topic, p, o) not in done), None)
            if first_not_done is None:
                commits.append(tp(topic, p, offsets[-1] + 1))
                continue
            if first_not_done > offsets[0]:
                commits.append(tp(topic, p, first_not_done))
            try:
                self._consumer.seek(tp(topic, p, first_not_done))
            except self._ck.KafkaException as e:  # not assigned anymore: its next owner reads it
                log.info("updates: seek %s[%d] to %d: %s", topic, p, first_not_done, e)
        if not commits:
            return
        try:
            self._consumer.commit(offsets=commits, asynchronous=False)
        except self._ck.KafkaException as e:
            # e.g. a rebalance took the partitions: their next owner applies them again
            self._kafka_error(f"commit failed (the batch will be delivered again): {e}")

    def start(self) -> KafkaUpdateConsumer:
        """Poll in a daemon thread until :meth:`close`; returns self."""
        self._start_polling("trec-kafka-updates", f"update consumer of group {self.group}")
        return self

    def _poll_failed(self, e: Exception) -> None:
        self._kafka_error(repr(e))

    def _polling_ended(self) -> None:
        self._close_consumer()

    def _close_consumer(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._consumer.close()  # leaves the group: its partitions move on at once
        except Exception as e:  # already closed, or the brokers are gone
            log.info("update consumer of group %s: close: %s", self.group, e)

    def close(self) -> None:
        """Stop and leave the group; returns within about ``poll_timeout_ms`` + the
        commit and close calls. Offsets of what was applied are committed already."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.poll_timeout_ms / 1000.0 + 10.0)
            if t.is_alive():
                log.info("update consumer of group %s: still in a Kafka call", self.group)
            return
        self._close_consumer()

    def __enter__(self) -> KafkaUpdateConsumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def kafka_info(
    brokers: str, model: str, table: str, group: Optional[str] = None, timeout: float = 10.0
) -> dict:
    """``{"topic", "partitions": [{"partition", "low", "high", "committed"}]}`` of a
    topic (``committed``: the offset ``group`` resumes at, None without a group or a
    commit; no partitions if the topic does not exist)."""
    ck = _kafka()
    topic = topic_name(model, table)
    conf = {
        "bootstrap.servers": _check_brokers(brokers),
        "group.id": group or "trec-kafka-info",
        "enable.auto.commit": False,
        "allow.auto.create.topics": False,
        "logger": logging.getLogger(__name__ + ".librdkafka"),
    }
    c = ck.Consumer(conf)
    try:
        md = c.list_topics(topic, timeout=timeout).topics.get(topic)
        parts = sorted(md.partitions) if md is not None and md.error is None else []
        tps = [ck.TopicPartition(topic, p) for p in parts]
        committed = c.committed(tps, timeout=timeout) if group and tps else []
        out = []
        for i, p in enumerate(parts):
            low, high = c.get_watermark_offsets(tps[i], timeout=timeout)
            off = committed[i].offset if committed else -1001
            out.append(
                {"partition": p, "low": low, "high": high, "committed": off if off >= 0 else None}
            )
    except ck.KafkaException as e:
        raise StoreError(f"Kafka {brokers}: {e}") from e
    finally:
        c.close()
    return {"topic": topic, "group": group, "partitions": out}
