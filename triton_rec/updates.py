"""Online embedding updates: the HPS message format over Redis Streams.

Message format (HPS ``KafkaMessageSink``; see docs/upstream-notes.md, "Online updates"):

- ``uint32`` magic ``0x52544348`` (the bytes ``"HCTR"``), little-endian;
- ``uint32`` value size in bytes (``4 * vec_size`` for float32 vectors), per message;
- then pairs of (key: int64 little-endian, value: ``value size`` bytes), nothing else.

A message with no pair is a beacon: it carries no update and its value size means
nothing (HPS sends ``sizeof(size_t)``). One message holds rows of one table; the table
is named by the topic ``hps_et.<model>.<table>``.

Transport: HPS used Kafka topics; here each topic is a **Redis Stream** of that name in
a Redis Cluster, one entry per message (field ``v``). Consumers read in **consumer
groups** (``XREADGROUP``): each inference node uses its own group, so every node sees
every update; the instances of a node share the work. An entry is acknowledged
(``XACK``) only after it was applied, so delivery is at least once (an update may be
applied twice, which upserts make harmless): a consumer that dies leaves its entries
pending and another consumer of the group takes them over (``XAUTOCLAIM`` after
``claim_idle_ms``); a consumer restarted under the same name first re-reads its own
pending entries.

Each stream key lives in one hash slot, so a consumer reads its topics one
``XREADGROUP`` per stream (a multi-stream read would be refused with CROSSSLOT).

- :class:`UpdateProducer` publishes (the trainer side), :class:`UpdateConsumer` consumes
  (used by :mod:`triton_rec.online_updates` inside each model instance);
- CLI: ``python -m triton_rec.updates publish|info ...`` (``--help``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from triton_rec.storage.backing_store import (
    StoreError,
    StoreUnavailableError,
    chunks,
    last_occurrence,
    tier_table_name,
)
from triton_rec.errors import ConfigError, TritonRecError
from triton_rec.util.log_throttle import LogThrottle
from triton_rec.storage.redis_store import RedisClusterStore, parse_address

log = logging.getLogger(__name__)

MAGIC = 0x52544348  # b"HCTR" read as a little-endian uint32
HEADER_SIZE = 8  # magic + value size
_HEADER = np.dtype([("magic", "<u4"), ("value_size", "<u4")])
_TOPIC_RE = re.compile(r"hps_et\.([A-Za-z0-9_-]{1,120})\.([A-Za-z0-9_-]{1,120})")
FIELD = b"v"  # the stream entry field holding the message
MAX_BACKOFF = 5.0  # seconds: longest wait before retrying a topic after failures in a row
LOG_EVERY = 30.0  # seconds between two log lines about the same ongoing failure
PRUNE_EVERY = 60.0  # seconds between two looks for idle consumers of a topic's group
#: most bytes of messages sent in one pipeline by :meth:`UpdateProducer.publish`
PIPELINE_BYTES = 16 << 20


class UpdateMessageError(TritonRecError):
    """A message that is not a valid HPS update (the message says what is wrong)."""


def topic_name(model: str, table: str) -> str:
    """The topic (stream key) of ``table`` of ``model``: ``"hps_et.<model>.<table>"``.

    Raises:
        ConfigError: a name is empty or holds other characters than letters, digits,
            ``_`` and ``-`` (HPS's rule, :func:`~triton_rec.storage.backing_store.tier_table_name`).
    """
    return tier_table_name(model, table)


def parse_topic(topic: str) -> Tuple[str, str]:
    """``(model, table)`` of a topic name ``hps_et.<model>.<table>``.

    Raises:
        UpdateMessageError: ``topic`` is not such a name.
    """
    m = _TOPIC_RE.fullmatch(topic) if isinstance(topic, str) else None
    if not m:
        raise UpdateMessageError(f"{topic!r} is not a topic name hps_et.<model>.<table>")
    return m.group(1), m.group(2)


def encode_message(keys: np.ndarray, vectors: np.ndarray) -> bytes:
    """One HPS update message of ``keys`` (int64 ``[M]``) and ``vectors`` (float32 ``[M, D]``).

    ``M`` may be 0 (a header-only message). Raises ValueError for other dtypes or shapes
    or ``D == 0``.
    """
    keys = np.asarray(keys)
    vectors = np.asarray(vectors)
    if keys.ndim != 1 or keys.dtype != np.int64:
        raise ValueError(f"keys must be a 1-D int64 array, got {keys.dtype} {keys.shape}")
    if vectors.ndim != 2 or vectors.dtype != np.float32 or vectors.shape[0] != keys.shape[0]:
        raise ValueError(f"vectors must be float32 [{keys.shape[0]}, D], got "
                         f"{vectors.dtype} {vectors.shape}")
    d = vectors.shape[1]
    if not 0 < 4 * d < 2**32:
        raise ValueError(f"vectors must have 1 .. 2**30-1 floats, got {d}")
    # one structured copy writes the interleaved (key, value) pairs
    pairs = np.empty(keys.shape[0], dtype=[("k", "<i8"), ("v", "<f4", (d,))])
    pairs["k"] = keys
    pairs["v"] = vectors
    header = np.array([(MAGIC, 4 * d)], dtype=_HEADER)
    return header.tobytes() + pairs.tobytes()


def decode_message(data: bytes, vec_size: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """``(keys int64 [M], vectors float32 [M, D])`` of one message (fresh arrays).

    Args:
        data: the message.
        vec_size: floats per vector the table expects (None: take the message's).

    A header-only message (a beacon) gives ``M == 0`` whatever its value size says
    (``D`` is then ``vec_size``, or the message's value size / 4, or 0).

    Raises:
        UpdateMessageError: shorter than the 8-byte header, wrong magic, a value size
            that is not a positive multiple of 4 or not ``4 * vec_size``, or a body that
            is not a whole number of (8 + value size)-byte pairs.
    """
    data = bytes(data) if not isinstance(data, (bytes, bytearray, memoryview)) else data
    if len(data) < HEADER_SIZE:
        raise UpdateMessageError(f"message of {len(data)} bytes is shorter than the 8-byte header")
    header = np.frombuffer(data, dtype=_HEADER, count=1)[0]
    magic = int(header["magic"])
    if magic != MAGIC:
        raise UpdateMessageError(f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x}, 'HCTR')")
    value_size = int(header["value_size"])
    body = len(data) - HEADER_SIZE
    if body == 0:  # beacon (HPS skips these before looking at the value size)
        d = vec_size if vec_size is not None else (value_size // 4 if value_size % 4 == 0 else 0)
        return np.empty(0, np.int64), np.empty((0, d), np.float32)
    if value_size == 0 or value_size % 4:
        raise UpdateMessageError(f"value size {value_size} bytes is not a positive multiple of 4 "
                                 "(float32 vectors)")
    d = value_size // 4
    if vec_size is not None and d != vec_size:
        raise UpdateMessageError(f"value size {value_size} bytes = {d} floats, the table has "
                                 f"vec_size {vec_size}")
    pair = 8 + value_size
    if body % pair:
        raise UpdateMessageError(f"body of {body} bytes is not a whole number of "
                                 f"{pair}-byte key/value pairs")
    pairs = np.frombuffer(data, dtype=[("k", "<i8"), ("v", "<f4", (d,))], offset=HEADER_SIZE)
    return pairs["k"].astype(np.int64), np.ascontiguousarray(pairs["v"], dtype=np.float32)


def _is_response_error(e: BaseException, marker: str) -> bool:
    """Whether a StoreError comes from a Redis error reply holding ``marker``
    (BUSYGROUP, NOGROUP, ...)."""
    from redis.exceptions import ResponseError

    return isinstance(e.__cause__, ResponseError) and marker in str(e)


class _Redis:
    """A Redis Cluster connection with the store's settings and error translation (the
    update streams live in a cluster, usually the volatile tier's).

    A :class:`~triton_rec.storage.redis_store.RedisClusterStore` gives the connection handling,
    timeouts, TLS and errors naming the cluster; its table is never used. With
    ``connect=False`` the connection is made by the first command (and made again after
    :meth:`reset`), so an unreachable cluster fails commands, not the constructor.
    """

    def __init__(self, address: str, connect: bool = True, **kwargs):
        parse_address(address)  # a malformed address is a ConfigError now, not later
        self.address = address
        self._kwargs = kwargs
        self._store: Optional[RedisClusterStore] = None
        self._lock = threading.Lock()
        self._closed = False
        if connect:
            self._get()

    def _get(self) -> RedisClusterStore:
        with self._lock:
            if self._closed:
                raise StoreError(f"Redis Cluster {self.address}: connection closed")
            if self._store is not None:
                return self._store
        # connect outside the lock: close() must not wait for a connect timeout
        store = RedisClusterStore(self.address, "hps_et.updates", 1, **self._kwargs)
        with self._lock:
            if not self._closed and self._store is None:
                self._store = store
                return store
            current, closed = self._store, self._closed
        store.close()  # closed meanwhile, or another thread connected first
        if closed or current is None:
            raise StoreError(f"Redis Cluster {self.address}: connection closed")
        return current

    def run(self, what: str, commands) -> list:
        return self._get().run_commands(what, commands)

    def reset(self) -> None:
        """Drop the connection; the next command connects again (fresh slot map)."""
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()


class UpdateProducer:
    """Publishes updates (the trainer side) to the streams of a Redis Cluster.

    Args:
        address: ``host:port[,host:port...]`` of the Redis Cluster.
        user_name, password: ACL credentials (sent only with a password).
        maxlen: keep about this many entries per stream (``XADD MAXLEN ~``; None: all).
            Trimmed entries that a consumer group has not read yet are lost to it.
        max_batch_size: most key/value pairs per message (a larger batch becomes
            several messages).
        **kwargs: the other connection settings of
            :class:`~triton_rec.storage.redis_store.RedisClusterStore` (TLS, timeouts, retries).

    Raises:
        ConfigError: a malformed address. StoreUnavailableError: the cluster cannot be
            reached.

    Thread-safety: :meth:`publish` may be called from several threads.
    """

    def __init__(self, address: str, user_name: Optional[str] = None,
                 password: Optional[str] = None, maxlen: Optional[int] = None,
                 max_batch_size: int = 8192, **kwargs):
        if int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if maxlen is not None and int(maxlen) < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self.maxlen = None if maxlen is None else int(maxlen)
        self.max_batch_size = int(max_batch_size)
        self._redis = _Redis(address, user_name=user_name, password=password, **kwargs)

    def publish(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Append the rows to the stream ``hps_et.<model>.<table>``, one entry per
        ``max_batch_size`` rows (in order); returns the number of entries (messages).

        ``keys``: 1-D integers (int64 range); ``vectors``: ``[M, D]`` floats (sent as
        float32). Raises ValueError for other shapes or dtypes, ConfigError for bad
        names, StoreError if Redis fails (entries sent before the failure stay).
        """
        topic = topic_name(model, table).encode()
        keys = np.asarray(keys)
        vectors = np.asarray(vectors)
        if keys.ndim != 1 or not np.issubdtype(keys.dtype, np.integer):
            raise ValueError(f"keys must be a 1-D integer array, got {keys.dtype} {keys.shape}")
        if keys.dtype == np.uint64 and keys.size and int(keys.max()) >= 2**63:
            raise ValueError("keys must fit in int64")
        if (vectors.ndim != 2 or not np.issubdtype(vectors.dtype, np.floating)
                or vectors.shape[0] != keys.shape[0] or vectors.shape[1] < 1):
            raise ValueError(f"vectors must be floats [{keys.shape[0]}, D >= 1], got "
                             f"{vectors.dtype} {vectors.shape}")
        sent = 0
        group: List[bytes] = []
        group_bytes = 0
        for s, e in chunks(keys.shape[0], self.max_batch_size):
            # encode chunk by chunk: a large table (e.g. a memory-mapped sparse file) is
            # never copied whole
            m = encode_message(keys[s:e].astype(np.int64, copy=False),
                               np.ascontiguousarray(vectors[s:e], dtype=np.float32))
            group.append(m)
            group_bytes += len(m)
            if group_bytes >= PIPELINE_BYTES:
                sent += self._send(topic, group)
                group, group_bytes = [], 0
        if group:
            sent += self._send(topic, group)
        return sent

    def _send(self, topic: bytes, messages: List[bytes]) -> int:
        def commands(pipe):
            for m in messages:
                pipe.xadd(topic, {FIELD: m}, maxlen=self.maxlen,
                          approximate=self.maxlen is not None)

        self._redis.run("XADD", commands)
        return len(messages)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self._redis.close()

    def __enter__(self) -> "UpdateProducer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: ``apply(model, table, keys, vectors)``; raising leaves the entries pending (retried).
ApplyFn = Callable[[str, str, np.ndarray, np.ndarray], None]


class UpdateConsumer:
    """Consumes topics in a consumer group and applies them.

    Args:
        address: the Redis Cluster (``host:port[,host:port...]``).
        group: consumer group (one per node: every group sees every update).
        consumer: this consumer's name in the group (e.g. ``<host>-<pid>``). A consumer
            started again under the same name first re-reads its pending entries.
        topics: ``{topic: vec_size}`` to follow (``hps_et.<model>.<table>``).
        apply: called with the rows of one or more consecutive entries of a topic (at
            most ``count`` rows, a key that repeats keeps its last row); the entries are
            acknowledged after it returns. If it raises, nothing of that call is
            acknowledged and the topic is retried after a backoff (``backoff_ms``,
            doubled per failure in a row, at most ``MAX_BACKOFF`` s; counted in
            ``apply_errors``, logged once per ``LOG_EVERY`` s).
        count: most rows per ``apply`` call (HPS ``update_source.max_batch_size``).
        read_count: most entries per read and topic (HPS ``max_commit_interval``; an
            entry holds up to the producer's ``max_batch_size`` rows).
        block_ms: longest wait for new entries in one :meth:`poll_once`.
        claim_idle_ms: entries pending this long on another consumer of the group (a
            dead instance) are taken over.
        backoff_ms: first wait after a failure (``apply`` raised, Redis unreachable).
        prune_idle_ms: other consumers of the group idle this long with nothing pending
            (processes that ended; a name is ``<host>-<pid>``) are removed from the
            group, checked at most once a minute per topic. Removing one loses nothing:
            a consumer that reads again is created again. 0 keeps them all.
        start: where a new group starts: ``"earliest"`` (the whole stream, as HPS's
            Kafka consumers) or ``"latest"`` (only what is added later).
        user_name, password, **kwargs: connection settings as for :class:`UpdateProducer`.
            A blocking read is kept shorter than ``socket_timeout``.

    A malformed message (or an entry trimmed away while pending) is logged, counted
    (``malformed``) and acknowledged, so it never blocks the stream. Redis failures are
    logged (once per ``LOG_EVERY`` s), counted (``redis_errors``) and retried per topic
    with the same backoff; they never raise from :meth:`poll_once` nor stop the thread.

    Raises:
        ConfigError: a malformed address; ValueError: bad arguments;
            UpdateMessageError: a topic that is not ``hps_et.<model>.<table>``. An
            unreachable cluster is not an error here: the consumer connects when it can.

    Thread-safety: use either :meth:`start` or calls of :meth:`poll_once` from one
    thread; :meth:`stats` and :meth:`close` may be called from any thread.
    """

    def __init__(self, address: str, group: str, consumer: str, topics: Dict[str, int],
                 apply: ApplyFn, count: int = 8192, block_ms: int = 500,
                 claim_idle_ms: int = 10000, backoff_ms: int = 50, start: str = "earliest",
                 read_count: int = 32, prune_idle_ms: int = 3_600_000,
                 user_name: Optional[str] = None, password: Optional[str] = None, **kwargs):
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', got {start!r}")
        if not topics:
            raise ValueError("no topics to consume")
        for what, v in (("group", group), ("consumer", consumer)):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{what} must be a non-empty string, got {v!r}")
        for what, v, low in (("count", count, 1), ("read_count", read_count, 1),
                             ("block_ms", block_ms, 0), ("claim_idle_ms", claim_idle_ms, 0),
                             ("backoff_ms", backoff_ms, 0), ("prune_idle_ms", prune_idle_ms, 0)):
            if int(v) < low:
                raise ValueError(f"{what} must be >= {low}, got {v}")
        self.group = group.encode()
        self.consumer = consumer.encode()
        self.topics: Dict[str, Tuple[Tuple[str, str], int]] = {}
        for t, d in topics.items():
            if int(d) < 1:
                raise ValueError(f"{t}: vec_size must be >= 1, got {d}")
            self.topics[t] = (parse_topic(t), int(d))
        self.apply = apply
        self.count = int(count)
        self.read_count = int(read_count)
        self.block_ms = int(block_ms)
        self.claim_idle_ms = int(claim_idle_ms)
        self.backoff = int(backoff_ms) / 1000.0
        self.start_id = b"0" if start == "earliest" else b"$"
        # BLOCK longer than the socket timeout would look like a dead connection
        socket_timeout = float(kwargs.get("socket_timeout", 2.0))
        self._max_block_ms = max(1, int(socket_timeout * 1000 * 0.8))
        # XAUTOCLAIM at most this often per topic (seconds)
        self._claim_every = min(5.0, max(0.05, self.claim_idle_ms / 2000.0))
        self.prune_idle_ms = int(prune_idle_ms)
        self._next_prune: Dict[str, float] = {}
        self._redis = _Redis(address, connect=False, user_name=user_name, password=password,
                             **kwargs)
        self._ready: set = set()  # topics whose group exists
        self._own_pending_done: set = set()  # topics whose own pending entries were re-read
        self._claim_cursor: Dict[str, bytes] = {}
        self._next_claim: Dict[str, float] = {}
        self._retry_at: Dict[str, float] = {}  # topic -> monotonic time of the next try
        self._redis_failures: Dict[str, int] = {}  # topic -> Redis failures in a row
        self._apply_failures: Dict[str, int] = {}  # topic -> apply failures in a row
        self._redis_log = LogThrottle(LOG_EVERY)
        self._apply_log = LogThrottle(LOG_EVERY)
        self._malformed_log = LogThrottle(LOG_EVERY)
        self._stats = dict(messages=0, vectors=0, malformed=0, apply_errors=0, redis_errors=0,
                           claimed=0, pruned=0, last_error="")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        try:  # connect now if we can; if not, poll_once keeps trying
            self._redis._get()
        except StoreUnavailableError as e:
            self._count(error=str(e), redis_errors=1)
            log.warning("updates: cannot connect yet (will retry): %s", e)

    # -- bookkeeping ------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters: ``messages`` and ``vectors`` applied, ``malformed`` (dropped),
        ``apply_errors``, ``redis_errors``, ``claimed`` (entries taken over from other
        consumers), ``pruned`` (idle consumers removed from the group), ``last_error`` (text of the last failure, "" if none)."""
        with self._lock:
            return dict(self._stats)

    def _count(self, error: str = "", **deltas) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] += v
            if error:
                self._stats["last_error"] = error

    def _backoff(self, failures: int) -> float:
        return min(MAX_BACKOFF, self.backoff * 2 ** min(failures - 1, 16))

    def _redis_failed(self, topic: str, e: BaseException) -> None:
        n = self._redis_failures.get(topic, 0) + 1
        self._redis_failures[topic] = n
        self._retry_at[topic] = time.monotonic() + self._backoff(n)
        self._count(error=f"{topic}: {e}", redis_errors=1)
        # entries read but not acknowledged before the failure: re-read them first
        self._own_pending_done.discard(topic)
        if isinstance(e, StoreError) and _is_response_error(e, "NOGROUP"):
            self._ready.discard(topic)  # stream or group deleted: create it again
        if n % 8 == 0 and isinstance(e, StoreUnavailableError):
            self._redis.reset()  # a long outage: reconnect from scratch (fresh slot map)
        allowed, held = self._redis_log.allow()
        if allowed:
            log.warning("updates from %s (%d failure(s) in a row%s): %s", topic, n,
                        f", {held} more not logged" if held else "", e,
                        exc_info=not isinstance(e, StoreError))

    def _redis_ok(self, topic: str) -> None:
        n = self._redis_failures.pop(topic, 0)
        if n:
            log.warning("updates from %s: Redis reachable again after %d failure(s)", topic, n)

    def _ensure_group(self, topic: str) -> None:
        if topic in self._ready:
            return
        try:
            self._redis.run("XGROUP CREATE", lambda p: p.xgroup_create(
                topic.encode(), self.group, id=self.start_id, mkstream=True))
        except StoreError as e:
            if not _is_response_error(e, "BUSYGROUP"):
                raise
        self._ready.add(topic)

    # -- consuming --------------------------------------------------------------------

    def poll_once(self, timeout_ms: Optional[int] = None) -> int:
        """Read, apply and acknowledge what is there, waiting at most ``timeout_ms``
        (default ``block_ms``) for new entries; returns the vectors applied.

        With several topics, each is first read without waiting; only if none had
        anything are they read again, blocking, the wait spread over them. Topics
        in backoff after a failure are skipped until their time. Redis failures are
        logged and counted, never raised.
        """
        budget = self.block_ms if timeout_ms is None else max(0, int(timeout_ms))
        deadline = time.monotonic() + budget / 1000.0
        topics = list(self.topics)
        applied = 0
        seen = 0
        for blocking in ((False, True) if len(topics) > 1 else (True,)):
            if blocking and seen:
                break
            now = time.monotonic()
            ready = [t for t in topics if self._retry_at.get(t, 0.0) <= now]
            if not ready:
                # every topic waits for its retry: sleep until the first (or the deadline)
                wake = min(self._retry_at.get(t, 0.0) for t in topics)
                self._stop.wait(max(0.0, min(wake, deadline) - now))
                break
            for i, topic in enumerate(ready):
                if self._stop.is_set():
                    return applied
                block = None
                if blocking:
                    left = (deadline - time.monotonic()) * 1000.0 / (len(ready) - i)
                    # never BLOCK 0 (= forever); None reads without waiting
                    block = min(self._max_block_ms, int(left)) if left >= 1 else None
                try:
                    n, a = self._poll_topic(topic, block)
                except Exception as e:  # StoreError, or a reply we did not expect
                    self._redis_failed(topic, e)
                    continue
                self._redis_ok(topic)
                seen += n
                applied += a
        return applied

    def _read(self, stream: bytes, entry_id: bytes, block: Optional[int]) -> list:
        reply = self._redis.run("XREADGROUP", lambda p: p.xreadgroup(
            self.group, self.consumer, {stream: entry_id}, count=self.read_count,
            block=block))[0]
        return reply[0][1] if reply else []

    def _poll_topic(self, topic: str, block: Optional[int]) -> Tuple[int, int]:
        """``(entries handled, vectors applied)`` of one read of ``topic``."""
        self._ensure_group(topic)
        stream = topic.encode()
        entries = []
        if topic not in self._own_pending_done:
            # after a restart under the same name, or a failed apply: our own
            # unacknowledged entries first
            entries = self._read(stream, b"0", None)
            if not entries:
                self._own_pending_done.add(topic)
        now = time.monotonic()
        if not entries and now >= self._next_claim.get(topic, 0.0):
            self._next_claim[topic] = now + self._claim_every
            reply = self._redis.run("XAUTOCLAIM", lambda p: p.xautoclaim(
                stream, self.group, self.consumer, self.claim_idle_ms,
                start_id=self._claim_cursor.get(topic, b"0-0"), count=self.read_count))[0]
            # reply: next cursor ("0-0" after a full pass), claimed entries, and (Redis 7)
            # ids of entries deleted from the stream, which Redis drops from the PEL itself
            self._claim_cursor[topic] = reply[0] if reply else b"0-0"
            entries = list(reply[1]) if reply else []
            if entries:
                self._count(claimed=len(entries))
                log.info("updates from %s: took over %d entries of a stalled consumer of "
                         "group %s", topic, len(entries), self.group.decode())
            elif self.prune_idle_ms and now >= self._next_prune.get(topic, 0.0):
                self._next_prune[topic] = now + PRUNE_EVERY
                self._prune_consumers(topic)
        if not entries:
            entries = self._read(stream, b">", block)
        return len(entries), self._apply_entries(topic, entries)

    def _prune_consumers(self, topic: str) -> None:
        """Remove the group's consumers idle for ``prune_idle_ms`` with nothing pending."""
        stream = topic.encode()
        consumers = self._redis.run("XINFO CONSUMERS", lambda p: p.xinfo_consumers(
            stream, self.group))[0]
        gone = [c["name"] for c in consumers
                if c["name"] != self.consumer and int(c["pending"]) == 0
                and int(c["idle"]) >= self.prune_idle_ms]
        if not gone:
            return

        def commands(pipe):
            for name in gone:
                pipe.xgroup_delconsumer(stream, self.group, name)

        self._redis.run("XGROUP DELCONSUMER", commands)
        self._count(pruned=len(gone))
        log.info("updates from %s: removed %d idle consumer(s) from group %s", topic, len(gone),
                 self.group.decode())

    def _apply_entries(self, topic: str, entries) -> int:
        """Apply ``entries`` in order, merging consecutive ones into calls of at most
        ``count`` rows; acknowledge what was applied or dropped. Returns vectors applied."""
        (model, table), vec_size = self.topics[topic]
        ack: List[bytes] = []
        applied = 0
        ids: List[bytes] = []
        keys_parts: List[np.ndarray] = []
        vec_parts: List[np.ndarray] = []
        rows = 0

        def flush() -> bool:
            nonlocal ids, keys_parts, vec_parts, rows, applied
            if not ids:
                return True
            if rows:
                keys = keys_parts[0] if len(keys_parts) == 1 else np.concatenate(keys_parts)
                vecs = vec_parts[0] if len(vec_parts) == 1 else np.concatenate(vec_parts)
                if len(keys_parts) > 1:  # a key in several entries: the last one wins
                    keep = last_occurrence(keys)
                    if keep.shape[0] != keys.shape[0]:
                        keys, vecs = keys[keep], vecs[keep]
                try:
                    # a message larger than count rows is applied in count-row slices
                    for lo, hi in chunks(keys.shape[0], self.count):
                        self.apply(model, table, keys[lo:hi], vecs[lo:hi])
                except Exception as e:  # retried later: the entries stay pending
                    self._apply_failed(topic, ids, e)
                    return False
            self._apply_failures.pop(topic, None)
            ack.extend(ids)
            applied += rows
            self._count(messages=len(ids), vectors=rows)
            ids, keys_parts, vec_parts, rows = [], [], [], 0
            return True

        for entry_id, fields in entries:
            data = fields.get(FIELD) if fields else None
            try:
                if data is None:
                    raise UpdateMessageError(
                        "entry has no field 'v' (deleted or trimmed while pending?)")
                keys, vecs = decode_message(data, vec_size)
            except UpdateMessageError as e:
                self._count(error=f"{topic} {entry_id!r}: {e}", malformed=1)
                allowed, held = self._malformed_log.allow()
                if allowed:
                    log.warning("update %s %r dropped%s: %s", topic, entry_id,
                                f" ({held} more dropped, not logged)" if held else "", e)
                ack.append(entry_id)
                continue
            if keys.shape[0] == 0:  # beacon: nothing to apply
                ack.append(entry_id)
                continue
            if rows and rows + keys.shape[0] > self.count and not flush():
                break
            ids.append(entry_id)
            keys_parts.append(keys)
            vec_parts.append(vecs)
            rows += keys.shape[0]
        else:
            flush()
        if ack:
            self._redis.run("XACK", lambda p: p.xack(topic.encode(), self.group, *ack))
        return applied

    def _apply_failed(self, topic: str, ids: List[bytes], e: Exception) -> None:
        n = self._apply_failures.get(topic, 0) + 1
        self._apply_failures[topic] = n
        self._retry_at[topic] = time.monotonic() + self._backoff(n)
        self._own_pending_done.discard(topic)  # re-read them from our pending entries
        self._count(error=f"{topic}: apply failed: {e}", apply_errors=1)
        allowed, held = self._apply_log.allow()
        if allowed:
            log.warning("updates from %s: %d entries not applied (failure %d in a row%s; "
                        "retried): %s", topic, len(ids), n,
                        f", {held} more not logged" if held else "", e)

    def start(self) -> "UpdateConsumer":
        """Poll in a daemon thread until :meth:`close`; returns self."""
        if self._thread is not None:
            return self

        def run():
            try:
                while not self._stop.is_set():
                    try:
                        self.poll_once()
                    except Exception as e:  # never let the thread die
                        self._count(error=repr(e), redis_errors=1)
                        log.exception("update consumer %s", self.consumer.decode())
                        self._stop.wait(max(self.backoff, 0.1))
            finally:
                if self._stop.is_set():
                    self._redis.close()

        self._thread = threading.Thread(target=run, name="trec-updates", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop and close the connection; returns within about ``block_ms`` + 1 s.

        If the thread is still inside a Redis call then (a stalled node: up to the
        socket timeout times the retries), it closes the connection itself when that
        call returns. Entries read but not applied stay pending for the group.
        """
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=self.block_ms / 1000.0 + 1.0)
            if t.is_alive():
                log.info("update consumer %s: still in a Redis call; it stops when the call "
                         "returns", self.consumer.decode())
                return
        self._redis.close()

    def __enter__(self) -> "UpdateConsumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stream_info(address: str, model: str, table: str, **kwargs) -> dict:
    """``{"topic", "length", "groups": [{"name", "consumers", "pending",
    "last-delivered-id", ..., "members": [{"name", "pending", "idle"}]}]}`` of a topic's
    stream (length 0 and no groups if the stream does not exist). ``members`` lists the
    group's consumers (``idle`` in ms). ``kwargs``: connection settings as for
    :class:`UpdateProducer`."""
    stream = topic_name(model, table).encode()
    r = _Redis(address, **kwargs)
    try:
        length = r.run("XLEN", lambda p: p.xlen(stream))[0]
        try:
            groups = r.run("XINFO GROUPS", lambda p: p.xinfo_groups(stream))[0]
        except StoreError as e:
            if "no such key" not in str(e).lower():
                raise
            groups = []
        members = []
        for g in groups:
            members.append(r.run("XINFO CONSUMERS", lambda p, g=g: p.xinfo_consumers(
                stream, g["name"]))[0])
    finally:
        r.close()

    def text(v):
        return v.decode() if isinstance(v, bytes) else v

    return {"topic": stream.decode(), "length": int(length),
            "groups": [{**{text(k): text(v) for k, v in g.items()},
                        "members": [{"name": text(c["name"]), "pending": int(c["pending"]),
                                     "idle": int(c["idle"])} for c in m]}
                       for g, m in zip(groups, members)]}


def _sparse_dir_rows(path: str, vec_size: Optional[int]):
    """``(keys, vectors)`` of a HugeCTR sparse directory; ``vec_size`` is inferred from
    the file sizes when not given."""
    import os

    from triton_rec.formats.hugectr_sparse import KEY_FILE, VECTOR_FILE, read_sparse_dir

    if vec_size is None:
        try:
            n = os.path.getsize(os.path.join(path, KEY_FILE)) // 8
            vec_bytes = os.path.getsize(os.path.join(path, VECTOR_FILE))
        except OSError as e:
            raise ValueError(f"{path}: not a HugeCTR sparse directory ({e})") from None
        if n == 0 or vec_bytes % (4 * n) or vec_bytes == 0:
            raise ValueError(f"{path}: cannot infer the vector size from {n} keys and "
                             f"{vec_bytes} vector bytes; give --vec-size")
        vec_size = vec_bytes // (4 * n)
    return read_sparse_dir(path, vec_size)


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m triton_rec.updates",
        description="Publish HPS embedding updates to Redis Streams (hps_et.<model>.<table>), "
                    "or show a stream's state.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, what in (("publish", "publish rows of one table"),
                       ("info", "length, consumer groups and pending entries of a topic")):
        p = sub.add_parser(name, help=what, description=what)
        p.add_argument("--address", required=True, help="host:port[,host:port...] of the cluster")
        p.add_argument("--model", required=True)
        p.add_argument("--table", required=True)
        p.add_argument("--user-name", default=None)
        p.add_argument("--password", default=None)
        if name == "publish":
            src = p.add_mutually_exclusive_group(required=True)
            src.add_argument("--npz", help="a .npz with arrays 'keys' (int64 [N]) and "
                                           "'vectors' (float32 [N, D])")
            src.add_argument("--sparse-dir", help="a HugeCTR sparse table directory "
                                                  "(files key, emb_vector)")
            p.add_argument("--vec-size", type=int, default=None,
                           help="floats per vector of --sparse-dir (default: from the file sizes)")
            p.add_argument("--batch-size", type=int, default=8192, help="pairs per message")
            p.add_argument("--maxlen", type=int, default=None,
                           help="trim the stream to about N entries")
    args = ap.parse_args(argv)
    conn = dict(user_name=args.user_name, password=args.password)
    try:
        topic = topic_name(args.model, args.table)
        if args.cmd == "info":
            print(json.dumps(stream_info(args.address, args.model, args.table, **conn),
                             indent=1, default=str))
            return 0
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        if args.npz:
            with np.load(args.npz, allow_pickle=False) as z:
                if "keys" not in z or "vectors" not in z:
                    raise ValueError(f"{args.npz}: needs arrays 'keys' and 'vectors', "
                                     f"has {sorted(z.files)}")
                keys, vectors = z["keys"], z["vectors"]
            if (keys.dtype != np.int64 or keys.ndim != 1 or vectors.dtype != np.float32
                    or vectors.ndim != 2 or vectors.shape[0] != keys.shape[0]):
                raise ValueError(f"{args.npz}: keys must be int64 [N] and vectors float32 [N, D], "
                                 f"got {keys.dtype} {keys.shape} and {vectors.dtype} {vectors.shape}")
        else:
            if args.vec_size is not None and args.vec_size < 1:
                raise ValueError(f"--vec-size must be >= 1, got {args.vec_size}")
            keys, vectors = _sparse_dir_rows(args.sparse_dir, args.vec_size)
        with UpdateProducer(args.address, maxlen=args.maxlen, max_batch_size=args.batch_size,
                            **conn) as producer:
            n = producer.publish(args.model, args.table, keys, vectors)
        print(f"published {len(keys)} vector(s) of size {vectors.shape[1]} in {n} message(s) "
              f"to {topic}")
        return 0
    except StoreError as e:  # Redis unreachable or refusing: not the input's fault
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError, ConfigError, TritonRecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_main())
