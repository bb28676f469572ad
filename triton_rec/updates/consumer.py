"""The serving side: :class:`UpdateConsumer` reads topics in a consumer group and applies
them (delivery and take-over: :mod:`triton_rec.updates.transport`).

:class:`ConsumerCore` is what every transport's consumer shares (this Redis Streams one and
:class:`triton_rec.updates.kafka.KafkaUpdateConsumer`): the topics, decoding, merging
consecutive messages into ``apply`` calls, dropping and counting malformed messages,
counting and logging failures, the backoff, and the counters of :meth:`ConsumerCore.stats`.
A transport reads messages, hands them to :meth:`ConsumerCore._apply_messages` and
acknowledges (Redis ``XACK``, Kafka offset commit) only what that reports done."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from triton_rec.storage.backing_store import (
    StoreError,
    StoreUnavailableError,
    chunks,
    last_occurrence,
)
from triton_rec.updates.codec import UpdateMessageError, decode_message, parse_topic
from triton_rec.updates.transport import FIELD, StreamConnection, is_response_error
from triton_rec.util.log_throttle import LogThrottle

log = logging.getLogger(__name__)

MAX_BACKOFF = 5.0  # seconds: longest wait before retrying a topic after failures in a row
LOG_EVERY = 30.0  # seconds between two log lines about the same ongoing failure
PRUNE_EVERY = 60.0  # seconds between two looks for idle consumers of a topic's group

#: a topic's lease in its group (``KEYS[1]``) for ``ARGV[1]``: taken if free, renewed if
#: held (``ARGV[2]`` ms); 1 if held afterwards, else 0
LEASE_TAKE = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""
#: give a topic's lease back if ``ARGV[1]`` holds it
LEASE_GIVE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def lease_key(topic: str, group: bytes) -> bytes:
    """The Redis key of a topic's lease in a consumer group (in the stream's hash slot)."""
    return b"trec-updates-lease:{" + topic.encode() + b"}:" + group


#: ``apply(model, table, keys, vectors)``; raising leaves the entries pending (retried).
ApplyFn = Callable[[str, str, np.ndarray, np.ndarray], None]


class ConsumerCore:
    """What the consumers of every transport share (see the module docstring).

    Args:
        topics: ``{topic: vec_size}`` to follow (``hps_et.<model>.<table>``).
        apply: called with the rows of one or more consecutive messages of a topic (at
            most ``count`` rows, a key that repeats keeps its last row). If it raises,
            nothing of that call is done: the transport delivers it again after a backoff
            (``backoff_ms``, doubled per failure in a row, at most ``MAX_BACKOFF`` s;
            counted in ``apply_errors``, logged once per ``LOG_EVERY`` s).
        count: most rows per ``apply`` call (HPS ``update_source.max_batch_size``).
        backoff_ms: first wait after a failure.
        counters: the transport's own counters (e.g. ``redis_errors``), starting at 0.

    Raises:
        ValueError: no topics, a vec_size < 1, ``count`` < 1 or ``backoff_ms`` < 0;
        UpdateMessageError: a topic that is not ``hps_et.<model>.<table>``.
    """

    def __init__(
        self,
        topics: Dict[str, int],
        apply: ApplyFn,
        count: int,
        backoff_ms: int,
        counters: Tuple[str, ...] = (),
    ):
        if not topics:
            raise ValueError("no topics to consume")
        for what, n, low in (("count", count, 1), ("backoff_ms", backoff_ms, 0)):
            if int(n) < low:
                raise ValueError(f"{what} must be >= {low}, got {n}")
        self.topics: Dict[str, Tuple[Tuple[str, str], int]] = {}
        for t, d in topics.items():
            if int(d) < 1:
                raise ValueError(f"{t}: vec_size must be >= 1, got {d}")
            self.topics[t] = (parse_topic(t), int(d))
        self.apply = apply
        self.count = int(count)
        self.backoff = int(backoff_ms) / 1000.0
        self._apply_failures: Dict[str, int] = {}  # topic -> apply failures in a row
        self._apply_log = LogThrottle(LOG_EVERY)
        self._malformed_log = LogThrottle(LOG_EVERY)
        self._stats: Dict[str, Any] = dict(messages=0, vectors=0, malformed=0, apply_errors=0)
        self._stats.update(dict.fromkeys(counters, 0))
        self._stats["last_error"] = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poll_once(self, timeout_ms: Optional[int] = None) -> int:
        """Read and apply what is there (the transport's); returns the rows applied."""
        raise NotImplementedError

    def _poll_failed(self, e: Exception) -> None:
        """Count a failure of :meth:`poll_once` in the polling thread (the transport's)."""
        raise NotImplementedError

    def _polling_ended(self) -> None:
        """Release the transport when the polling thread ends (the transport's)."""

    def _start_polling(self, name: str, describe: str) -> None:
        """Run :meth:`poll_once` in a daemon thread until :meth:`close`. The thread never
        dies of a failure: it is counted (:meth:`_poll_failed`), logged and waited out
        (``backoff``); :meth:`_polling_ended` runs when it ends."""
        if self._thread is not None:
            return

        def run():
            try:
                while not self._stop.is_set():
                    try:
                        self.poll_once()
                    except Exception as e:  # never let the thread die
                        self._poll_failed(e)
                        log.exception(describe)
                        self._stop.wait(max(self.backoff, 0.1))
            finally:
                self._polling_ended()

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        """Counters: ``messages`` and ``vectors`` applied, ``malformed`` (dropped),
        ``apply_errors``, the transport's own (see its class), ``last_error`` (text of the
        last failure, "" if none)."""
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

    def _drop_malformed(self, topic: str, msg_id: Any, e: Exception) -> None:
        """Count and log (throttled) a message that is dropped as malformed."""
        self._count(error=f"{topic} {msg_id!r}: {e}", malformed=1)
        allowed, held = self._malformed_log.allow()
        if allowed:
            log.warning(
                "update %s %r dropped%s: %s",
                topic,
                msg_id,
                f" ({held} more dropped, not logged)" if held else "",
                e,
            )

    def _apply_messages(
        self, topic: str, messages: Iterable[Tuple[Any, Optional[bytes]]], missing: str = ""
    ) -> Tuple[List[Any], int, int]:
        """Decode and apply ``messages`` (``(id, data)`` in order) of ``topic``, merging
        consecutive ones into calls of at most ``count`` rows.

        ``data`` None is malformed, with the reason ``missing``. Malformed messages are
        dropped (counted, logged) and beacons skipped: both are done. The first ``apply``
        that raises stops the pass.

        Returns:
            ``(done, vectors applied, failures)``: the ids that were applied, dropped or
            skipped (in order), and 0, or the number of failed ``apply`` passes of the
            topic in a row (the transport waits :meth:`_backoff` of it and delivers the
            ids not done again).
        """
        (model, table), vec_size = self.topics[topic]
        done: List[Any] = []
        applied = 0
        failures = 0
        ids: List[Any] = []
        keys_parts: List[np.ndarray] = []
        vec_parts: List[np.ndarray] = []
        rows = 0

        def flush() -> bool:
            nonlocal ids, keys_parts, vec_parts, rows, applied, failures
            if not ids:
                return True
            if rows:
                keys = keys_parts[0] if len(keys_parts) == 1 else np.concatenate(keys_parts)
                vecs = vec_parts[0] if len(vec_parts) == 1 else np.concatenate(vec_parts)
                if len(keys_parts) > 1:  # a key in several messages: the last one wins
                    keep = last_occurrence(keys)
                    if keep.shape[0] != keys.shape[0]:
                        keys, vecs = keys[keep], vecs[keep]
                try:
                    # a message larger than count rows is applied in count-row slices
                    for lo, hi in chunks(keys.shape[0], self.count):
                        self.apply(model, table, keys[lo:hi], vecs[lo:hi])
                except Exception as e:  # delivered again later: not done
                    failures = self._apply_failed_count(topic, len(ids), e)
                    return False
            self._apply_failures.pop(topic, None)
            done.extend(ids)
            applied += rows
            self._count(messages=len(ids), vectors=rows)
            ids, keys_parts, vec_parts, rows = [], [], [], 0
            return True

        for msg_id, data in messages:
            try:
                if data is None:
                    raise UpdateMessageError(missing or "message without a value")
                keys, vecs = decode_message(data, vec_size)
            except UpdateMessageError as e:
                self._drop_malformed(topic, msg_id, e)
                done.append(msg_id)
                continue
            if keys.shape[0] == 0:  # beacon: nothing to apply
                done.append(msg_id)
                continue
            if rows and rows + keys.shape[0] > self.count and not flush():
                break
            ids.append(msg_id)
            keys_parts.append(keys)
            vec_parts.append(vecs)
            rows += keys.shape[0]
        else:
            flush()
        return done, applied, failures

    def _apply_failed_count(self, topic: str, n: int, e: Exception) -> int:
        """Count and log (throttled) a failed ``apply`` of ``n`` messages; returns the
        topic's failures in a row."""
        failures = self._apply_failures.get(topic, 0) + 1
        self._apply_failures[topic] = failures
        self._count(error=f"{topic}: apply failed: {e}", apply_errors=1)
        allowed, held = self._apply_log.allow()
        if allowed:
            log.warning(
                "updates from %s: %d message(s) not applied (failure %d in a row%s; retried): %s",
                topic,
                n,
                failures,
                f", {held} more not logged" if held else "",
                e,
            )
        return failures


class UpdateConsumer(ConsumerCore):
    """Consumes Redis Streams topics in a consumer group and applies them.

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
            dead instance) are taken over; also how long a topic's lease lasts after
            its holder last renewed it (see below).
        backoff_ms: first wait after a failure (``apply`` raised, Redis unreachable).
        prune_idle_ms: other consumers of the group idle this long with nothing pending
            (processes that ended; a name is ``<host>-<pid>``) are removed from the
            group, checked at most once a minute per topic. Removing one loses nothing:
            a consumer that reads again is created again. 0 keeps them all.
        start: where a new group starts: ``"earliest"`` (the whole stream, as HPS's
            Kafka consumers) or ``"latest"`` (only what is added later).
        user_name, password, **kwargs: connection settings as for :class:`UpdateProducer`.
            A blocking read is kept shorter than ``socket_timeout``.

    **One reader per topic and group.** Two consumers of a group split a stream's entries
    between them, so the later of two updates of a key could be applied first and stay.
    A consumer therefore reads a topic only while it holds the topic's lease in the group
    (the Redis key :func:`lease_key`, renewed at every read, expiring ``claim_idle_ms``
    after the last renewal, given back by :meth:`close`); the others look again every
    :attr:`lease_check` s. A new holder first applies the entries a previous holder left
    pending (its own at once, another's once idle ``claim_idle_ms``, in stream order)
    and reads new ones only after them. The topics of a model still spread over the
    processes of a node, one holder each.

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

    def __init__(
        self,
        address: str,
        group: str,
        consumer: str,
        topics: Dict[str, int],
        apply: ApplyFn,
        count: int = 8192,
        block_ms: int = 500,
        claim_idle_ms: int = 10000,
        backoff_ms: int = 50,
        start: str = "earliest",
        read_count: int = 32,
        prune_idle_ms: int = 3_600_000,
        user_name: Optional[str] = None,
        password: Optional[str] = None,
        **kwargs,
    ):
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', got {start!r}")
        super().__init__(
            topics,
            apply,
            count,
            backoff_ms,
            counters=("redis_errors", "claimed", "pruned"),
        )
        for what, v in (("group", group), ("consumer", consumer)):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{what} must be a non-empty string, got {v!r}")
        for what, n, low in (
            ("read_count", read_count, 1),
            ("block_ms", block_ms, 0),
            ("claim_idle_ms", claim_idle_ms, 0),
            ("prune_idle_ms", prune_idle_ms, 0),
        ):
            if int(n) < low:
                raise ValueError(f"{what} must be >= {low}, got {n}")
        self.group = group.encode()
        self.consumer = consumer.encode()
        self.read_count = int(read_count)
        self.block_ms = int(block_ms)
        self.claim_idle_ms = int(claim_idle_ms)
        self.start_id = b"0" if start == "earliest" else b"$"
        # BLOCK longer than the socket timeout would look like a dead connection
        socket_timeout = float(kwargs.get("socket_timeout", 2.0))
        self._max_block_ms = max(1, int(socket_timeout * 1000 * 0.8))
        # XAUTOCLAIM at most this often per topic (seconds)
        self._claim_every = min(5.0, max(0.05, self.claim_idle_ms / 2000.0))
        # a topic's lease: renewed after a third of it, blocking reads shorter than that
        self._lease_ms = max(1, self.claim_idle_ms)
        self._max_block_ms = max(1, min(self._max_block_ms, self._lease_ms // 3))
        #: seconds between two looks at a lease another consumer holds
        self.lease_check = min(1.0, max(0.02, self._lease_ms / 4000.0))
        self._leased: Dict[str, float] = {}  # topic -> monotonic time of the last renewal
        self._settled: set = set()  # topics held whose earlier holders' entries are done
        self.prune_idle_ms = int(prune_idle_ms)
        self._next_prune: Dict[str, float] = {}
        self._redis = StreamConnection(
            address, connect=False, user_name=user_name, password=password, **kwargs
        )
        self._ready: set = set()  # topics whose group exists
        self._own_pending_done: set = set()  # topics whose own pending entries were re-read
        self._claim_cursor: Dict[str, bytes] = {}
        self._next_claim: Dict[str, float] = {}
        self._retry_at: Dict[str, float] = {}  # topic -> monotonic time of the next try
        self._redis_failures: Dict[str, int] = {}  # topic -> Redis failures in a row
        self._redis_log = LogThrottle(LOG_EVERY)
        try:  # connect now if we can; if not, poll_once keeps trying
            self._redis._get()
        except StoreUnavailableError as e:
            self._count(error=str(e), redis_errors=1)
            log.warning("updates: cannot connect yet (will retry): %s", e)

    # -- bookkeeping ------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters: ``messages`` and ``vectors`` applied, ``malformed`` (dropped),
        ``apply_errors``, ``redis_errors``, ``claimed`` (entries taken over from other
        consumers), ``pruned`` (idle consumers removed from the group), ``last_error`` (text
        of the last failure, "" if none)."""
        return super().stats()

    def _redis_failed(self, topic: str, e: BaseException) -> None:
        n = self._redis_failures.get(topic, 0) + 1
        self._redis_failures[topic] = n
        self._retry_at[topic] = time.monotonic() + self._backoff(n)
        self._count(error=f"{topic}: {e}", redis_errors=1)
        # entries read but not acknowledged before the failure: re-read them first
        self._own_pending_done.discard(topic)
        if isinstance(e, StoreError) and is_response_error(e, "NOGROUP"):
            self._ready.discard(topic)  # stream or group deleted: create it again
        if n % 8 == 0 and isinstance(e, StoreUnavailableError):
            self._redis.reset()  # a long outage: reconnect from scratch (fresh slot map)
        allowed, held = self._redis_log.allow()
        if allowed:
            log.warning(
                "updates from %s (%d failure(s) in a row%s): %s",
                topic,
                n,
                f", {held} more not logged" if held else "",
                e,
                exc_info=not isinstance(e, StoreError),
            )

    def _redis_ok(self, topic: str) -> None:
        n = self._redis_failures.pop(topic, 0)
        if n:
            log.warning("updates from %s: Redis reachable again after %d failure(s)", topic, n)

    def _ensure_group(self, topic: str) -> None:
        if topic in self._ready:
            return
        try:
            self._redis.run(
                "XGROUP CREATE",
                lambda p: p.xgroup_create(
                    topic.encode(), self.group, id=self.start_id, mkstream=True
                ),
            )
        except StoreError as e:
            if not is_response_error(e, "BUSYGROUP"):
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
        for blocking in (False, True) if len(topics) > 1 else (True,):
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
        reply = self._redis.run(
            "XREADGROUP",
            lambda p: p.xreadgroup(
                self.group, self.consumer, {stream: entry_id}, count=self.read_count, block=block
            ),
        )[0]
        return reply[0][1] if reply else []

    def _hold_lease(self, topic: str) -> bool:
        """Take or renew ``topic``'s lease; whether this consumer holds it."""
        now = time.monotonic()
        last = self._leased.get(topic)
        if last is not None and now - last < self._lease_ms / 3000.0:
            return True
        key = lease_key(topic, self.group)
        held = self._redis.run(
            "lease",
            lambda p: p.execute_command("EVAL", LEASE_TAKE, 1, key, self.consumer, self._lease_ms),
        )[0]
        if int(held):
            if last is None:  # newly held: what earlier holders left pending, in order
                log.info("updates from %s: this consumer reads them now", topic)
                self._claim_cursor.pop(topic, None)
                self._own_pending_done.discard(topic)
            self._leased[topic] = now
            return True
        if last is not None:
            log.warning("updates from %s: lease lost to another consumer of the group", topic)
        self._leased.pop(topic, None)
        self._settled.discard(topic)
        return False

    def _others_pending(self, topic: str) -> int:
        """Entries of ``topic`` pending on other consumers of the group."""
        summary = self._redis.run("XPENDING", lambda p: p.xpending(topic.encode(), self.group))[0]
        return sum(
            int(c["pending"]) for c in summary.get("consumers") or () if c["name"] != self.consumer
        )

    def _give_back_leases(self) -> None:
        """Give back the leases this consumer holds (at close); failures only logged (the
        leases then expire)."""
        for topic in list(self._leased):
            key = lease_key(topic, self.group)
            try:
                self._redis.run(
                    "lease",
                    lambda p, key=key: p.execute_command("EVAL", LEASE_GIVE, 1, key, self.consumer),
                )
            except Exception as e:  # it expires by itself
                log.info("updates from %s: lease not given back (%s); it expires", topic, e)
        self._leased.clear()
        self._settled.clear()

    def _poll_topic(self, topic: str, block: Optional[int]) -> Tuple[int, int]:
        """``(entries handled, vectors applied)`` of one read of ``topic``."""
        self._ensure_group(topic)
        if not self._hold_lease(topic):
            self._retry_at[topic] = time.monotonic() + self.lease_check
            return 0, 0
        stream = topic.encode()
        entries = []
        if topic not in self._own_pending_done:
            # after a restart under the same name, or a failed apply: our own
            # unacknowledged entries first
            entries = self._read(stream, b"0", None)
            if not entries:
                self._own_pending_done.add(topic)
        now = time.monotonic()
        settling = topic not in self._settled
        if not entries and (settling or now >= self._next_claim.get(topic, 0.0)):
            self._next_claim[topic] = now + self._claim_every
            reply = self._redis.run(
                "XAUTOCLAIM",
                lambda p: p.xautoclaim(
                    stream,
                    self.group,
                    self.consumer,
                    self.claim_idle_ms,
                    start_id=self._claim_cursor.get(topic, b"0-0"),
                    count=self.read_count,
                ),
            )[0]
            # reply: next cursor ("0-0" after a full pass), claimed entries, and (Redis 7)
            # ids of entries deleted from the stream, which Redis drops from the PEL itself
            self._claim_cursor[topic] = reply[0] if reply else b"0-0"
            entries = list(reply[1]) if reply else []
            if entries:
                self._count(claimed=len(entries))
                log.info(
                    "updates from %s: took over %d entries of a stalled consumer of group %s",
                    topic,
                    len(entries),
                    self.group.decode(),
                )
            elif self.prune_idle_ms and now >= self._next_prune.get(topic, 0.0):
                self._next_prune[topic] = now + PRUNE_EVERY
                self._prune_consumers(topic)
            if not entries and settling:
                if self._others_pending(topic):
                    # entries an earlier holder left go first: claimed once idle
                    self._retry_at[topic] = now + self._claim_every
                    return 0, 0
                self._settled.add(topic)
        if not entries:
            entries = self._read(stream, b">", block)
        return len(entries), self._apply_entries(topic, entries)

    def _prune_consumers(self, topic: str) -> None:
        """Remove the group's consumers idle for ``prune_idle_ms`` with nothing pending."""
        stream = topic.encode()
        consumers = self._redis.run(
            "XINFO CONSUMERS", lambda p: p.xinfo_consumers(stream, self.group)
        )[0]
        gone = [
            c["name"]
            for c in consumers
            if c["name"] != self.consumer
            and int(c["pending"]) == 0
            and int(c["idle"]) >= self.prune_idle_ms
        ]
        if not gone:
            return

        def commands(pipe):
            for name in gone:
                pipe.xgroup_delconsumer(stream, self.group, name)

        self._redis.run("XGROUP DELCONSUMER", commands)
        self._count(pruned=len(gone))
        log.info(
            "updates from %s: removed %d idle consumer(s) from group %s",
            topic,
            len(gone),
            self.group.decode(),
        )

    def _apply_entries(self, topic: str, entries) -> int:
        """Apply ``entries`` in order (:meth:`ConsumerCore._apply_messages`); acknowledge
        what was applied or dropped. Returns vectors applied."""
        done, applied, failures = self._apply_messages(
            topic,
            [(entry_id, fields.get(FIELD) if fields else None) for entry_id, fields in entries],
            missing="entry has no field 'v' (deleted or trimmed while pending?)",
        )
        if failures:
            self._retry_at[topic] = time.monotonic() + self._backoff(failures)
            self._own_pending_done.discard(topic)  # re-read them from our pending entries
        if done:
            self._redis.run("XACK", lambda p: p.xack(topic.encode(), self.group, *done))
        return applied

    def start(self) -> UpdateConsumer:
        """Poll in a daemon thread until :meth:`close`; returns self."""
        self._start_polling("trec-updates", f"update consumer {self.consumer.decode()}")
        return self

    def _poll_failed(self, e: Exception) -> None:
        self._count(error=repr(e), redis_errors=1)

    def _polling_ended(self) -> None:
        if self._stop.is_set():
            self._give_back_leases()
            self._redis.close()

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
                log.info(
                    "update consumer %s: still in a Redis call; it stops when the call returns",
                    self.consumer.decode(),
                )
                return
        if t is None:  # polled by hand: the thread did not give the leases back
            self._give_back_leases()
        self._redis.close()

    def __enter__(self) -> UpdateConsumer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
