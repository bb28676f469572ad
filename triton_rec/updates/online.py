"""Online updates inside a model instance: consume the model's topics, write the rows to
the tiers, refresh the shared cache.

A process runs one consumer per model (:func:`start_update_consumer`), shared by every
instance of the model in it, in the node's consumer group (``update_source.group``,
default :func:`default_group`), reading Redis Streams or Kafka topics
(``update_source.type``), so each node sees every update once. One reader per process
keeps a topic's updates in order: two consumers of one group split a stream's entries
between them, and the later of two updates of a key could land first (and stay).
An update of table T of model M (topic ``hps_et.M.T``) is

1. written to the tiers whose ``update_filters`` match the topic, persistent tier
   first (:meth:`triton_rec.storage.tiers.TieredStore.apply_update`), once;
2. written over the rows each of the instances' caches holds for those keys (``update``:
   rows that are not cached stay uncached; a cache shared by several instances, once),
   so every instance of the model serves it at once, on every device. Rows a lookup was
   fetching from a tier while the update landed may be cached with the old value; the
   periodic refresh (``refresh_interval``, ``cache_refresh_percentage_per_iteration``)
   re-reads them.

The shared caches never hand out a torn row (seqlock in the CPU cache), and the tiers
write whole values, so a reader sees a row either before or after an update.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from triton_rec.cache.cached_table import CachedTable
from triton_rec.config.ps_json import ModelParams
from triton_rec.errors import ConfigError

log = logging.getLogger(__name__)


class UpdateApplier:
    """``apply(model, table, keys, vectors)`` for the consumer: tiers, then the cache.

    Args:
        model: the model whose tables are updated.
        tables: the instance's tables.
        tier_names: each table's name in the tiers and topics (default: its own name;
            with HPS's table fusion several tables share one, ``fused_embedding<k>``).
    """

    def __init__(
        self,
        model: str,
        tables: Sequence[CachedTable],
        tier_names: Optional[Sequence[str]] = None,
    ):
        self.model = model
        self.tables: Dict[str, List[CachedTable]] = {}
        for t, name in zip(tables, tier_names or [t.name for t in tables]):
            self.tables.setdefault(name, []).append(t)

    def __call__(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Apply one update to the table's tiers, then to its cache(s); ignores other
        models. ``table`` is the tier name (a fused table's update reaches every member's
        cache: only rows a cache holds are overwritten, and keys are unique across members)."""
        if self.write_tiers(model, table, keys, vectors):
            self.update_caches(model, table, keys, vectors)

    def write_tiers(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray) -> bool:
        """Write an update to the table's tiers; whether the caches must follow (False:
        not this model's table, or no tier's ``update_filters`` take the topic)."""
        from triton_rec.updates.codec import topic_name

        members = self.tables.get(table)
        if model != self.model or not members:
            return False  # not ours (the consumer only subscribes to our topics)
        topic = topic_name(model, table)
        apply_update = getattr(members[0].store, "apply_update", None)
        if apply_update is None:
            raise ConfigError(f"{topic}: table {table!r} has no writable tier")
        return apply_update(keys, vectors, topic) != 0

    def update_caches(
        self,
        model: str,
        table: str,
        keys: np.ndarray,
        vectors: np.ndarray,
        done: Optional[set] = None,
    ) -> None:
        """Write an update over the rows the table's caches hold. ``done``: the caches
        already written (:func:`cache_identity`), skipped and added to."""
        from triton_rec.updates.codec import topic_name

        if model != self.model:
            return
        topic = topic_name(model, table)
        for ct in self.tables.get(table, ()):
            if ct.cache is None:
                continue
            if done is not None:
                ident = cache_identity(ct.cache)
                if ident in done:
                    continue
                done.add(ident)
            ct.cache.update(  # in the cache's precision: encoded once per member
                np.ascontiguousarray(keys, dtype=np.int64),
                ct.codec.as_rows(np.ascontiguousarray(vectors, dtype=np.float32), topic),
            )


def cache_identity(cache: Any) -> Tuple[str, Any]:
    """What tells caches apart: a shared cache's name (it names the model, the device and
    the table's layout; every instance attached to it shares it), else the object."""
    name = getattr(cache, "name", None)
    return (type(cache).__name__, name if isinstance(name, str) else id(cache))


class InstanceFanOut:
    """``apply`` of a process's shared consumer: an update goes to the tiers once (through
    the first instance attached) and to every attached instance's caches (a cache shared by
    several instances once). Attaching and detaching wait for an ``apply`` in progress, so
    an instance's tables are never written after it detached."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._appliers: List[UpdateApplier] = []
        self._taken_lock = threading.Lock()
        self._taken: Dict[str, int] = {}  # the consumer's counters as last taken

    def take(self, stats: Dict[str, Any]) -> Dict[str, int]:
        """How much each numeric counter of ``stats`` grew since the last call."""
        with self._taken_lock:
            grown = {}
            for k, v in stats.items():
                if isinstance(v, int):
                    grown[k] = v - self._taken.get(k, 0)
                    self._taken[k] = v
            return grown

    def attach(self, applier: UpdateApplier) -> None:
        """Attach an instance's tables (they get every update from now on)."""
        with self._lock:
            self._appliers.append(applier)

    def detach(self, applier: UpdateApplier) -> int:
        """Detach ``applier``; returns how many stay attached."""
        with self._lock:
            self._appliers = [a for a in self._appliers if a is not applier]
            return len(self._appliers)

    def __call__(self, model: str, table: str, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Apply one update: the tiers once, then every attached instance's caches."""
        with self._lock:
            if not self._appliers:
                # every instance detached while the consumer was reading: not applied, so
                # not acknowledged (the node's next consumer applies it)
                raise ConfigError(f"{model}: no instance left to apply updates to")
            if not self._appliers[0].write_tiers(model, table, keys, vectors):
                return
            done: set = set()
            for a in self._appliers:
                a.update_caches(model, table, keys, vectors, done)


class SharedUpdateConsumer:
    """An instance's handle on its process's consumer of a model's updates
    (:func:`start_update_consumer`); ``close()`` detaches the instance, and the last
    instance's ``close()`` stops the consumer."""

    def __init__(self, key: Tuple, consumer: Any, fan_out: InstanceFanOut, applier):
        self._key, self.consumer, self._fan_out, self._applier = key, consumer, fan_out, applier
        self._closed = False

    def stats(self) -> dict:
        """The consumer's counters (shared by every instance of the process)."""
        return self.consumer.stats()

    def counts_since_taken(self) -> Dict[str, int]:
        """How much the consumer's counters grew since an instance of the process last
        took them: instances that each publish what they take into one metric count
        every change once."""
        return self._fan_out.take(self.consumer.stats())

    def close(self) -> None:
        """Detach this instance (idempotent); the last one stops the consumer."""
        with _SHARED_LOCK:
            if self._closed:
                return
            self._closed = True
            left = self._fan_out.detach(self._applier)
            if left:
                return
            if _SHARED.get(self._key, (None,))[0] is self._fan_out:
                del _SHARED[self._key]
        self.consumer.close()


#: the process's consumers, by (model, update_source, topics): (fan-out, consumer)
_SHARED: Dict[Tuple, Tuple[InstanceFanOut, Any]] = {}
_SHARED_LOCK = threading.Lock()


def consumer_name() -> str:
    """This process's consumer name in the node's group: ``<host>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"


def default_group(params: ModelParams) -> str:
    """The node's consumer group when ``update_source.group`` is not set.

    ``redis_stream``: the host name. ``kafka_message_queue``: the group HPS gives the
    node's last writable tier (the one that holds every row), always with ``.<host>``:
    ``hps.persistent.<host>`` with a writable ``persistent_db``, else
    ``hps.volatile.<host>``. HPS shares ``hps.volatile`` among the nodes of one Redis;
    here every node reads every update, because every node's cache must follow it.
    """
    src = params.update_source
    host = socket.gethostname()
    if src.group:
        return src.group
    if src.type != "kafka_message_queue":
        return host
    per = params.persistent_db
    tier = "persistent" if per.type != "disabled" and not per.read_only else "volatile"
    return f"hps.{tier}.{host}"


def start_update_consumer(
    params: ModelParams, tables: Sequence[CachedTable]
) -> SharedUpdateConsumer:
    """Apply the model's updates to this instance's tables: through the process's consumer
    of the model's topics if another instance started it, else a new one consuming in the
    background (Redis Streams or Kafka, by ``update_source.type``). Returns the instance's
    handle (``close()`` detaches; the last instance's stops the consumer)."""
    from triton_rec.updates.codec import topic_name

    src = params.update_source
    topics = {topic_name(params.model, tp.tier_name): tp.vec_size for tp in params.tables}
    applier = UpdateApplier(params.model, tables, [tp.tier_name for tp in params.tables])
    key = (params.model, repr(src), tuple(sorted(topics.items())))
    with _SHARED_LOCK:
        if key in _SHARED:
            fan_out, consumer = _SHARED[key]
            fan_out.attach(applier)
            return SharedUpdateConsumer(key, consumer, fan_out, applier)
        fan_out = InstanceFanOut()
        fan_out.attach(applier)
        consumer = _new_consumer(params, topics, fan_out)
        _SHARED[key] = (fan_out, consumer)
    try:
        consumer.start()
    except BaseException:
        SharedUpdateConsumer(key, consumer, fan_out, applier).close()
        raise
    return SharedUpdateConsumer(key, consumer, fan_out, applier)


def _new_consumer(params: ModelParams, topics: Dict[str, int], apply: InstanceFanOut) -> Any:
    """The consumer of ``update_source.type`` (not started)."""
    src = params.update_source
    consumer: Any
    if src.type == "kafka_message_queue":
        from triton_rec.updates.kafka import KafkaUpdateConsumer

        consumer = KafkaUpdateConsumer(
            src.brokers,
            group=default_group(params),
            topics=topics,
            apply=apply,
            count=src.max_batch_size,
            poll_timeout_ms=src.poll_timeout_ms,
            backoff_ms=src.failure_backoff_ms,
            max_commit_interval=src.max_commit_interval,
            start=src.start,
            metadata_refresh_interval_ms=src.metadata_refresh_interval_ms,
            receive_buffer_size=src.receive_buffer_size,
            session_timeout_ms=src.session_timeout_ms,
            max_poll_interval_ms=src.max_poll_interval_ms,
        )
    else:
        from triton_rec.updates.consumer import UpdateConsumer

        consumer = UpdateConsumer(
            src.redis.address,
            group=default_group(params),
            consumer=consumer_name(),
            topics=topics,
            apply=apply,
            count=src.max_batch_size,
            block_ms=src.poll_timeout_ms,
            backoff_ms=src.failure_backoff_ms,
            start=src.start,
            read_count=src.max_commit_interval,
            **src.redis.client_kwargs(),
        )
    return consumer
