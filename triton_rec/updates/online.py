"""Online updates inside a model instance: consume the model's topics, write the rows to
the tiers, refresh the shared cache.

Every instance of a model runs one consumer of the node's consumer group
(``update_source.group``, default :func:`default_group`), reading Redis Streams or Kafka
topics (``update_source.type``), so each node sees every update once and its instances
share the work. An update of table T of model M (topic
``hps_et.M.T``) is

1. written to the tiers whose ``update_filters`` match the topic, persistent tier
   first (:meth:`triton_rec.storage.tiers.TieredStore.apply_update`);
2. written over the rows the node's shared cache holds for those keys (``update``:
   rows that are not cached stay uncached), so every instance of the model on the
   node serves it at once. Rows a lookup was fetching from a tier while the update
   landed may be cached with the old value; the periodic refresh
   (``refresh_interval``, ``cache_refresh_percentage_per_iteration``) re-reads them.

The shared caches never hand out a torn row (seqlock in the CPU cache), and the tiers
write whole values, so a reader sees a row either before or after an update.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Dict, List, Optional, Sequence

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
        from triton_rec.updates.codec import topic_name

        members = self.tables.get(table)
        if model != self.model or not members:
            return  # not ours (the consumer only subscribes to our topics)
        topic = topic_name(model, table)
        apply_update = getattr(members[0].store, "apply_update", None)
        if apply_update is None:
            raise ConfigError(f"{topic}: table {table!r} has no writable tier")
        if apply_update(keys, vectors, topic) == 0:
            return  # no tier's update_filters take this topic: the cache follows the tiers
        for ct in members:
            if ct.cache is not None:
                ct.cache.update(  # in the cache's precision: encoded once per member
                    np.ascontiguousarray(keys, dtype=np.int64),
                    ct.codec.as_rows(np.ascontiguousarray(vectors, dtype=np.float32), topic),
                )


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


def start_update_consumer(params: ModelParams, tables: Sequence[CachedTable]):
    """Start consuming the model's topics in the background (Redis Streams or Kafka, by
    ``update_source.type``); returns the consumer (``close()`` stops it)."""
    from triton_rec.updates.codec import topic_name

    src = params.update_source
    topics = {topic_name(params.model, tp.tier_name): tp.vec_size for tp in params.tables}
    apply = UpdateApplier(params.model, tables, [tp.tier_name for tp in params.tables])
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
    consumer.start()
    return consumer
