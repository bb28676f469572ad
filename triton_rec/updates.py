"""Online embedding updates: the HPS message format over Redis Streams.

Message format (HPS ``KafkaMessageSink``; see docs/upstream-notes.md, "Online updates"):

- ``uint32`` magic ``0x52544348`` (the bytes ``"HCTR"``), little-endian;
- ``uint32`` value size in bytes (``4 * vec_size`` for float32 vectors);
- then pairs of (key: int64 little-endian, value: ``value size`` bytes), nothing else.

A message with no pair is a beacon and carries no update. One message holds rows of
one table; the table is named by the topic ``hps_et.<model>.<table>``.

Transport: HPS used Kafka topics; here each topic is a **Redis Stream** of that name in
a Redis Cluster, one entry per message (field ``v``). Consumers read in **consumer
groups** (``XREADGROUP``): each inference node uses its own group, so every node sees
every update once; the instances of a node share the work. An entry is acknowledged
(``XACK``) only after it was applied, so a consumer that dies leaves it pending and
another consumer of the group takes it over (``XAUTOCLAIM`` after ``claim_idle_ms``);
a consumer restarted under the same name first re-reads its own pending entries.

- :class:`UpdateProducer` publishes (the trainer side), :class:`UpdateConsumer` consumes
  (used by :mod:`triton_rec.online_updates` inside each model instance);
- CLI: ``python -m triton_rec.updates publish|info ...`` (``--help``).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from triton_rec.backing_store import StoreError, StoreUnavailableError, chunks, tier_table_name
from triton_rec.errors import TritonRecError
from triton_rec.redis_store import RedisClusterStore

log = logging.getLogger(__name__)

MAGIC = 0x52544348  # b"HCTR" read as a little-endian uint32
_HEADER = np.dtype([("magic", "<u4"), ("value_size", "<u4")])
_TOPIC_RE = re.compile(r"hps_et\.([A-Za-z0-9_-]{1,120})\.([A-Za-z0-9_-]{1,120})")
FIELD = b"v"  # the stream entry field holding the message
MAX_BACKOFF = 5.0  # seconds: longest wait between two attempts while Redis is unreachable
LOG_EVERY = 30.0  # seconds between two log lines about the same ongoing failure


class UpdateMessageError(TritonRecError):
    """A message that is not a valid HPS update (the message says what is wrong)."""


def topic_name(model: str, table: str) -> str:
    """``hps_et.<model>.<table>`` (ConfigError if a name breaks the naming rule)."""
    return "hps_et." + tier_table_name(model, table)


def parse_topic(topic: str) -> Tuple[str, str]:
    """``(model, table)`` of a topic name (UpdateMessageError if it is not one)."""
    m = _TOPIC_RE.fullmatch(topic)
    if not m:
        raise UpdateMessageError(f"{topic!r} is not a topic name hps_et.<model>.<table>")
    return m.group(1), m.group(2)


def encode_message(keys: np.ndarray, vectors: np.ndarray) -> bytes:
    """One HPS update message of ``keys`` (int64 ``[M]``) and ``vectors`` (float32 ``[M, D]``)."""
    keys = np.asarray(keys)
    vectors = np.asarray(vectors)
    if keys.ndim != 1 or keys.dtype != np.int64:
        raise ValueError(f"keys must be a 1-D int64 array, got {keys.dtype} {keys.shape}")
    if vectors.ndim != 2 or vectors.dtype != np.float32 or vectors.shape[0] != keys.shape[0]:
        raise ValueError(f"vectors must be float32 [{keys.shape[0]}, D], got "
                         f"{vectors.dtype} {vectors.shape}")
    d = vectors.shape[1]
    pairs = np.empty(keys.shape[0], dtype=[("k", "<i8"), ("v", "<f4", (d,))])
    pairs["k"] = keys
    pairs["v"] = vectors
    header = np.array([(MAGIC, 4 * d)], dtype=_HEADER)
    return header.tobytes() + pairs.tobytes()


def decode_message(data: bytes, vec_size: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """``(keys int64 [M], vectors float32 [M, D])`` of one message.

    Args:
        data: the message.
        vec_size: floats per vector the table expects (None: take the message's).

    Raises:
        UpdateMessageError: shorter than the header, wrong magic, a value size that is
            not a positive multiple of 4 or not ``4 * vec_size``, or a body that is not
            a whole number of pairs.
    """
    if len(data) < _HEADER.itemsize:
        raise UpdateMessageError(f"message of {len(data)} bytes is shorter than the 8-byte header")
    header = np.frombuffer(data, dtype=_HEADER, count=1)[0]
    if int(header["magic"]) != MAGIC:
        raise UpdateMessageError(f"bad magic 0x{int(header['magic']):08x} (expected 0x{MAGIC:08x}, "
                                 "'HCTR')")
    value_size = int(header["value_size"])
    if value_size == 0 or value_size % 4:
        raise UpdateMessageError(f"value size {value_size} bytes is not a positive multiple of 4 "
                                 "(float32 vectors)")
    d = value_size // 4
    if vec_size is not None and d != vec_size:
        raise UpdateMessageError(f"value size {value_size} bytes = {d} floats, the table has "
                                 f"vec_size {vec_size}")
    body = len(data) - _HEADER.itemsize
    pair = 8 + value_size
    if body % pair:
        raise UpdateMessageError(f"body of {body} bytes is not a whole number of "
                                 f"{pair}-byte key/value pairs")
    pairs = np.frombuffer(data, dtype=[("k", "<i8"), ("v", "<f4", (d,))], offset=_HEADER.itemsize)
    return pairs["k"].astype(np.int64), np.ascontiguousarray(pairs["v"], dtype=np.float32)


class _Redis:
    """A Redis Cluster connection with the store's settings and error translation (the
    update streams live in a cluster, usually the volatile tier's)."""

    def __init__(self, address: str, **kwargs):
        # A RedisClusterStore gives us connection handling, timeouts, TLS and errors that
        # name the cluster; its table is never used.
        self._store = RedisClusterStore(address, "hps_et.updates", 1, **kwargs)
        self.address = address

    def run(self, what: str, commands) -> list:
        return self._store.run_commands(what, commands)

    def close(self) -> None:
        self._store.close()


class UpdateProducer:
    """Publishes updates (the trainer side).

    Args:
        address: ``host:port[,host:port...]`` of the Redis Cluster.
        maxlen: keep about this many entries per stream (``XADD MAXLEN ~``; None: all).
        max_batch_size: most pairs per message (a larger batch becomes several messages).
        **kwargs: connection settings as for
            :class:`~triton_rec.redis_store.RedisClusterStore` (``user_name``,
            ``password``, TLS, timeouts).

    Thread-safety: :meth:`publish` may be called from several threads.
    """

    def __init__(self, address: str, maxlen: Optional[int] = None, max_batch_size: int = 8192,
                 **kwargs):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.maxlen = maxlen
        self.max_batch_size = int(max_batch_size)
        self._redis = _Redis(address, **kwargs)

    def publish(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Append the rows to the stream ``hps_et.<model>.<table>``; returns messages sent."""
        topic = topic_name(model, table).encode()
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        messages = [encode_message(keys[s:e], vectors[s:e])
                    for s, e in chunks(keys.shape[0], self.max_batch_size)]

        def commands(pipe):
            for m in messages:
                pipe.xadd(topic, {FIELD: m}, maxlen=self.maxlen,
                          approximate=self.maxlen is not None)

        if messages:
            self._redis.run("XADD", commands)
        return len(messages)

    def close(self) -> None:
        self._redis.close()

    def __enter__(self) -> "UpdateProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: ``apply(model, table, keys, vectors)``; raising leaves the entry pending (retried).
ApplyFn = Callable[[str, str, np.ndarray, np.ndarray], None]


class UpdateConsumer:
    """Consumes topics in a consumer group and applies them.

    Args:
        address: the Redis Cluster.
        group: consumer group (one per node).
        consumer: this consumer's name in the group (e.g. ``<host>-<pid>``).
        topics: ``{topic: vec_size}`` to follow.
        apply: called with each message's rows; the entry is acknowledged after it
            returns. If it raises, nothing is acknowledged and the entry is retried after
            ``backoff_ms`` (counted in ``apply_errors``).
        count: most entries per read and topic.
        block_ms: longest wait for new entries in one :meth:`poll_once`.
        claim_idle_ms: entries pending this long on another consumer of the group (a
            dead instance) are taken over.
        backoff_ms: wait after a failure (``apply`` raised; Redis unreachable: doubled
            per failure in a row, at most ``MAX_BACKOFF`` s, logged once per ``LOG_EVERY`` s).
        start: where a new group starts: ``"earliest"`` (the whole stream, as HPS's
            Kafka consumers) or ``"latest"``.
        **kwargs: connection settings as for :class:`UpdateProducer`.

    A malformed message is logged, counted (``malformed``) and acknowledged, so it
    never blocks the stream.
    """

    def __init__(self, address: str, group: str, consumer: str, topics: Dict[str, int],
                 apply: ApplyFn, count: int = 8192, block_ms: int = 500,
                 claim_idle_ms: int = 10000, backoff_ms: int = 50, start: str = "earliest",
                 **kwargs):
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', got {start!r}")
        if not topics:
            raise ValueError("no topics to consume")
        self.group = group.encode()
        self.consumer = consumer.encode()
        self.topics = {t: (parse_topic(t), int(d)) for t, d in topics.items()}
        self.apply = apply
        self.count = int(count)
        self.block_ms = int(block_ms)
        self.claim_idle_ms = int(claim_idle_ms)
        self.backoff = backoff_ms / 1000.0
        self.start_id = b"0" if start == "earliest" else b"$"
        self._redis = _Redis(address, **kwargs)
        self._ready: set = set()  # topics whose group exists
        self._own_pending_done: set = set()  # topics whose own pending entries were re-read
        self._stats = dict(messages=0, vectors=0, malformed=0, apply_errors=0, redis_errors=0,
                           claimed=0, last_error="")
        self._lock = threading.Lock()
        self._failures = 0  # Redis failures in a row
        self._last_logged = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- bookkeeping ------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters: messages, vectors, malformed, apply_errors, redis_errors, claimed,
        last_error."""
        with self._lock:
            return dict(self._stats)

    def _count(self, error: str = "", **deltas) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] += v
            if error:
                self._stats["last_error"] = error

    def _ensure_group(self, topic: str) -> None:
        if topic in self._ready:
            return
        from redis.exceptions import ResponseError

        try:
            self._redis.run("XGROUP CREATE", lambda p: p.xgroup_create(
                topic.encode(), self.group, id=self.start_id, mkstream=True))
        except StoreError as e:
            if not isinstance(e.__cause__, ResponseError) or "BUSYGROUP" not in str(e):
                raise
        self._ready.add(topic)

    # -- consuming --------------------------------------------------------------------

    def poll_once(self, timeout_ms: Optional[int] = None) -> int:
        """Read, apply and acknowledge what is there (waiting at most ``timeout_ms``,
        default ``block_ms``, spread over the topics); returns the vectors applied.
        Redis failures are logged and counted, never raised."""
        applied = 0
        per_topic = max(1, (self.block_ms if timeout_ms is None else timeout_ms)
                        // max(1, len(self.topics)))
        for topic in self.topics:
            if self._stop.is_set():
                break
            try:
                self._ensure_group(topic)
                applied += self._poll_topic(topic, per_topic)
            except StoreError as e:
                self._count(error=str(e), redis_errors=1)
                self._failures += 1
                now = time.monotonic()
                # one line when it starts, then at most one every LOG_EVERY seconds
                if self._failures == 1 or now - self._last_logged >= LOG_EVERY:
                    log.warning("updates from %s (%d failure(s) in a row): %s", topic,
                                self._failures, e)
                    self._last_logged = now
                # exponential backoff while Redis stays unreachable, capped
                self._stop.wait(min(MAX_BACKOFF, self.backoff * 2 ** min(self._failures, 16)))
                continue
            if self._failures:
                log.warning("updates from %s: Redis reachable again after %d failure(s)",
                            topic, self._failures)
                self._failures = 0
        return applied

    def _poll_topic(self, topic: str, block_ms: int) -> int:
        stream = topic.encode()
        entries = []
        if topic not in self._own_pending_done:
            # after a restart under the same name: our own unacknowledged entries first
            reply = self._redis.run("XREADGROUP", lambda p: p.xreadgroup(
                self.group, self.consumer, {stream: b"0"}, count=self.count))[0]
            entries = reply[0][1] if reply else []
            if not entries:
                self._own_pending_done.add(topic)
        if not entries:
            claimed = self._redis.run("XAUTOCLAIM", lambda p: p.xautoclaim(
                stream, self.group, self.consumer, self.claim_idle_ms, start_id=b"0-0",
                count=self.count))[0]
            entries = [e for e in (claimed[1] if claimed else []) if e[1] is not None]
            if entries:
                self._count(claimed=len(entries))
        if not entries:
            reply = self._redis.run("XREADGROUP", lambda p: p.xreadgroup(
                self.group, self.consumer, {stream: b">"}, count=self.count, block=block_ms))[0]
            entries = reply[0][1] if reply else []
        return self._apply_entries(topic, entries)

    def _apply_entries(self, topic: str, entries) -> int:
        (model, table), vec_size = self.topics[topic]
        done: List[bytes] = []
        applied = 0
        for entry_id, fields in entries:
            try:
                keys, vectors = decode_message(fields.get(FIELD, b""), vec_size)
            except UpdateMessageError as e:
                self._count(error=f"{topic} {entry_id!r}: {e}", malformed=1)
                log.warning("update %s %r dropped: %s", topic, entry_id, e)
                done.append(entry_id)
                continue
            if keys.shape[0]:
                try:
                    self.apply(model, table, keys, vectors)
                except Exception as e:  # retried later: the entry stays pending
                    self._count(error=f"{topic}: {e}", apply_errors=1)
                    log.warning("update %s %r not applied (retried later): %s", topic, entry_id, e)
                    self._own_pending_done.discard(topic)
                    self._stop.wait(self.backoff)
                    break
            done.append(entry_id)
            applied += int(keys.shape[0])
            self._count(messages=1, vectors=int(keys.shape[0]))
        if done:
            self._redis.run("XACK", lambda p: p.xack(topic.encode(), self.group, *done))
        return applied

    def start(self) -> "UpdateConsumer":
        """Poll in a daemon thread until :meth:`close`."""
        def run():
            while not self._stop.is_set():
                try:
                    self.poll_once()
                except Exception as e:  # never let the thread die
                    self._count(error=repr(e), redis_errors=1)
                    log.exception("update consumer %s", self.consumer)
                    self._stop.wait(max(self.backoff, 0.1))

        self._thread = threading.Thread(target=run, name="trec-updates", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop (returns within about ``block_ms`` plus one socket timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.block_ms / 1000.0 + 10)
        self._redis.close()


def stream_info(address: str, model: str, table: str, **kwargs) -> dict:
    """Length, first/last entry and groups (with pending counts) of a topic's stream."""
    r = _Redis(address, **kwargs)
    stream = topic_name(model, table).encode()
    try:
        length = r.run("XLEN", lambda p: p.xlen(stream))[0]
        groups = r.run("XINFO GROUPS", lambda p: p.xinfo_groups(stream))[0] if length else []
    except StoreError as e:
        if "no such key" in str(e).lower():
            return {"topic": stream.decode(), "length": 0, "groups": []}
        raise
    finally:
        r.close()
    return {"topic": stream.decode(), "length": int(length),
            "groups": [{k.decode() if isinstance(k, bytes) else k:
                        v.decode() if isinstance(v, bytes) else v for k, v in g.items()}
                       for g in groups]}


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m triton_rec.updates",
                                 description="Publish HPS embedding updates to Redis Streams.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("publish", "info"):
        p = sub.add_parser(name)
        p.add_argument("--address", required=True, help="host:port[,host:port...] of the cluster")
        p.add_argument("--model", required=True)
        p.add_argument("--table", required=True)
        p.add_argument("--password", default=None)
        p.add_argument("--user-name", default=None)
        if name == "publish":
            src = p.add_mutually_exclusive_group(required=True)
            src.add_argument("--npz", help="a .npz with arrays 'keys' (int64) and 'vectors' (float32)")
            src.add_argument("--sparse-dir", help="a HugeCTR sparse table directory (key, emb_vector)")
            p.add_argument("--vec-size", type=int, help="floats per vector (with --sparse-dir)")
            p.add_argument("--batch-size", type=int, default=8192, help="pairs per message")
            p.add_argument("--maxlen", type=int, default=None, help="trim the stream to about N entries")
    args = ap.parse_args(argv)
    conn = dict(user_name=args.user_name, password=args.password)
    try:
        if args.cmd == "info":
            print(stream_info(args.address, args.model, args.table, **conn))
            return 0
        if args.npz:
            with np.load(args.npz) as z:
                if "keys" not in z or "vectors" not in z:
                    raise ValueError(f"{args.npz}: needs arrays 'keys' and 'vectors', has {list(z)}")
                keys, vectors = z["keys"], z["vectors"]
            if keys.dtype != np.int64 or vectors.dtype != np.float32 or vectors.ndim != 2:
                raise ValueError(f"{args.npz}: keys must be int64 [N] and vectors float32 [N, D], "
                                 f"got {keys.dtype} {keys.shape} and {vectors.dtype} {vectors.shape}")
        else:
            from ps_loader import read_table

            if not args.vec_size:
                raise ValueError("--sparse-dir needs --vec-size")
            keys, vectors = read_table(args.sparse_dir, args.vec_size)
        with UpdateProducer(args.address, maxlen=args.maxlen, max_batch_size=args.batch_size,
                            **conn) as producer:
            n = producer.publish(args.model, args.table, np.asarray(keys), np.asarray(vectors))
        print(f"published {len(keys)} vector(s) in {n} message(s) to "
              f"{topic_name(args.model, args.table)}")
        return 0
    except (ValueError, OSError, TritonRecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_main())
