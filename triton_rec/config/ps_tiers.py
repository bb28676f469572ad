"""The storage tiers of a ps.json: its top-level ``volatile_db``, ``persistent_db`` and
``update_source`` sections, their parameters and the combinations refused.

Part of :mod:`triton_rec.config.ps_json` (the one parser of the file), which re-exports
the public names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from triton_rec.config.ps_values import (
    MAX_KAFKA_MESSAGE_BYTES,
    MAX_TIER_BATCH_SIZE,
    MAX_TIER_COUNT,
    MAX_TIER_MS,
    OverflowPolicy,
    as_bool,
    as_float,
    as_int,
    choice,
    fail,
    regex_list,
    resolve_path,
)

#: ``volatile_db.type`` spellings HPS accepts (HugeCTR v23.09 inference_utils.cpp L849-902,
#: ``get_hps_database_type``; matched here without regard to case, as hugectr_backend's
#: triton_helpers.cpp does) and what serves them here: every HPS in-memory hash map type
#: is the node-local store (one memory-mapped copy per node, read-only).
VOLATILE_TYPES = {
    **dict.fromkeys(("disabled", "disable", "none"), "disabled"),
    **dict.fromkeys(("hash_map", "hashmap", "hash", "map"), "hash_map"),
    **dict.fromkeys(
        ("parallel_hash_map", "parallel_hashmap", "parallel_hash", "parallel_map"), "hash_map"
    ),
    **dict.fromkeys(
        (
            "multi_process_hash_map",
            "multi_process_hashmap",
            "multi_process_hash",
            "multi_process_map",
        ),
        "hash_map",
    ),
    **dict.fromkeys(("redis_cluster", "redis"), "redis_cluster"),
}
#: ``persistent_db.type`` spellings (the same upstream function).
PERSISTENT_TYPES = {
    **dict.fromkeys(("disabled", "disable", "none"), "disabled"),
    **dict.fromkeys(("rocks_db", "rocksdb", "rocks"), "rocks_db"),
}
#: ``update_source.type`` spellings (HPS's, inference_utils.cpp L904-928, and ours).
UPDATE_SOURCE_TYPES = {
    **dict.fromkeys(("null", "none"), "null"),
    **dict.fromkeys(("kafka_message_queue", "kafka_mq", "kafka"), "kafka_message_queue"),
    "redis_stream": "redis_stream",
}
#: ``volatile_db.overflow_policy`` spellings (inference_utils.cpp L962-993).
OVERFLOW_POLICY_NAMES = {
    **dict.fromkeys(("evict_random", "random"), "evict_random"),
    **dict.fromkeys(("evict_least_used", "least_used"), "evict_least_used"),
    **dict.fromkeys(("evict_oldest", "oldest"), "evict_oldest"),
}
OVERFLOW_POLICIES = tuple(p.value for p in OverflowPolicy)
#: what a lookup does when a tier cannot be reached: raise (the request fails with an
#: error naming the tier) or go on with the next tier (then the default value).
ON_UNAVAILABLE = ("fail", "next_tier")

_REDIS_KEYS = {
    "address",
    "user_name",
    "password",
    "num_partitions",
    "num_node_connections",
    "enable_tls",
    "tls_ca_certificate",
    "tls_client_certificate",
    "tls_client_key",
    "tls_server_name_identification",
    "max_batch_size",
    "connect_timeout",
    "socket_timeout",
}
_VOLATILE_KEYS_USED = _REDIS_KEYS | {
    "type",
    "overflow_margin",
    "overflow_policy",
    "overflow_resolution_target",
    "initial_cache_rate",
    "cache_missed_embeddings",
    "update_filters",
    "refresh_time_after_fetch",
    "on_unavailable",
}
# Documented for HPS but meaningless here (hash map internals) or obsolete: accepted.
_VOLATILE_KEYS_KNOWN = _VOLATILE_KEYS_USED | {
    "algorithm",
    "allocation_rate",
    "shared_memory_size",
    "shared_memory_name",
    "max_get_batch_size",
    "max_set_batch_size",
    "initialize_after_startup",
}
_PERSISTENT_KEYS_USED = {
    "type",
    "path",
    "num_threads",
    "read_only",
    "max_batch_size",
    "update_filters",
    "on_unavailable",
}
_PERSISTENT_KEYS_KNOWN = _PERSISTENT_KEYS_USED | {"max_get_batch_size", "max_set_batch_size"}
#: ``update_source`` keys of the Kafka consumer (HPS's, plus two group timeouts of ours).
_KAFKA_KEYS = {
    "brokers",
    "metadata_refresh_interval_ms",
    "receive_buffer_size",
    "max_commit_interval",
    "session_timeout_ms",
    "max_poll_interval_ms",
}
_UPDATE_KEYS_USED = (
    _REDIS_KEYS
    | _KAFKA_KEYS
    | {
        "type",
        "group",
        "poll_timeout_ms",
        "max_batch_size",
        "failure_backoff_ms",
        "start",
    }
)
# send_buffer_size: HPS's producer (KafkaMessageSink) setting; the consumer has no use for it.
_UPDATE_KEYS_KNOWN = _UPDATE_KEYS_USED | {"send_buffer_size"}
_DEFAULT_UPDATE_FILTERS = ("^hps_.+$",)


@dataclass(frozen=True)
class RedisParams:
    """How to reach a Redis Cluster (``volatile_db`` of type ``redis_cluster``, and
    ``update_source`` of type ``redis_stream``); HPS names and defaults."""

    address: str = "127.0.0.1:7000"
    user_name: str = "default"
    password: str = ""
    num_node_connections: int = 5
    enable_tls: bool = False
    tls_ca_certificate: Optional[str] = None
    tls_client_certificate: Optional[str] = None
    tls_client_key: Optional[str] = None
    tls_server_name_identification: Optional[str] = None
    connect_timeout: float = 2.0
    socket_timeout: float = 2.0

    def client_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of :class:`~triton_rec.storage.redis_store.RedisClusterStore` (and
        the update producer/consumer) for these settings."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "address"}


@dataclass(frozen=True)
class VolatileDBParams:
    """``volatile_db``: the first tier behind the embedding cache.

    Args:
        type: ``hash_map`` (every HPS hash map type: the node-local store), ``redis_cluster``
            or ``disabled``. HPS reads a ``volatile_db`` section without ``type`` as
            ``disabled`` (and a missing section as ``parallel_hash_map``); so do we.
        redis: connection settings (``redis_cluster``).
        num_partitions: Redis hashes per table. None (the key absent): the count of a table
            the cluster already holds, detected from its hashes
            (:meth:`~triton_rec.storage.redis_store.RedisClusterStore`); for a new table
            HPS's default, :func:`default_num_partitions`.
        max_batch_size: most keys per Redis command (``max_get/set_batch_size`` are read
            as its older spelling).
        overflow_margin: most rows per partition (None: unbounded). For
            ``redis_cluster`` only with a ``persistent_db`` behind, which holds every row;
            ignored (and logged) for the hash map types, which hold whole tables.
        overflow_policy: ``evict_oldest`` (by write time, or access time with
            ``refresh_time_after_fetch``), ``evict_random``, ``evict_least_used``.
        overflow_resolution_target: a partition past the margin is pruned to
            ``margin * target`` rows.
        initial_cache_rate: fraction of each table imported into this tier at load (< 1
            only with a persistent tier holding the rest).
        cache_missed_embeddings: rows found in the persistent tier are copied here.
        update_filters: regexes; online updates of topics matching one are written here.
        on_unavailable: ``fail`` or ``next_tier`` (see :data:`ON_UNAVAILABLE`).
        extra: documented keys not acted on (hash map internals), as given.
        unknown_keys: undocumented keys.
    """

    type: str = "hash_map"
    redis: RedisParams = field(default_factory=RedisParams)
    num_partitions: Optional[int] = None
    max_batch_size: int = 65536
    overflow_margin: Optional[int] = None
    overflow_policy: OverflowPolicy = OverflowPolicy.EVICT_RANDOM
    overflow_resolution_target: float = 0.8
    initial_cache_rate: float = 1.0
    cache_missed_embeddings: bool = False
    refresh_time_after_fetch: bool = False
    update_filters: Tuple[str, ...] = _DEFAULT_UPDATE_FILTERS
    on_unavailable: str = "fail"
    extra: Dict[str, Any] = field(default_factory=dict)
    unknown_keys: Tuple[str, ...] = ()

    def ignored_settings(self) -> Tuple[str, ...]:
        """Settings given for a hash map type that do nothing here (the backends log them):
        the node-local store holds whole tables, so it never overflows or caches part."""
        if self.type != "hash_map":
            return ()
        out = []
        if self.overflow_margin is not None:
            out.append(f"overflow_margin={self.overflow_margin}")
        if self.initial_cache_rate < 1.0:
            out.append(f"initial_cache_rate={self.initial_cache_rate}")
        return tuple(out)


@dataclass(frozen=True)
class PersistentDBParams:
    """``persistent_db``: the tier behind the volatile one (RocksDB on local disk).

    Args:
        type: ``rocks_db`` or ``disabled`` (the HPS default).
        path: the database directory (relative paths resolve against ps.json's directory).
        num_threads: RocksDB background threads.
        read_only: open read-only (no import, no updates; the database must hold the tables).
        max_batch_size: most keys per RocksDB batch.
        update_filters, on_unavailable: as for :class:`VolatileDBParams`.
    """

    type: str = "disabled"
    path: str = "/tmp/rocksdb"
    num_threads: int = 16
    read_only: bool = False
    max_batch_size: int = 65536
    update_filters: Tuple[str, ...] = _DEFAULT_UPDATE_FILTERS
    on_unavailable: str = "fail"
    unknown_keys: Tuple[str, ...] = ()


@dataclass(frozen=True)
class UpdateSourceParams:
    """``update_source``: where online updates come from.

    Args:
        type: ``null`` (none), ``kafka_message_queue`` (HPS's: Kafka topics
            ``hps_et.<model>.<table>`` on ``brokers``; spellings ``kafka_mq``, ``kafka``) or
            ``redis_stream`` (Redis Streams in a Redis Cluster, one stream per topic). Both
            carry HPS's message format.
        redis: connection settings of the cluster holding the streams (``redis_stream``).
        group: consumer group; one per inference node, so every node sees every update.
            Default: the host name (``redis_stream``); ``hps.persistent.<host>`` with a
            writable ``persistent_db``, else ``hps.volatile.<host>`` (``kafka_message_queue``,
            :func:`triton_rec.updates.online.default_group`).
        poll_timeout_ms, max_batch_size, failure_backoff_ms: HPS names and defaults.
        start: where a new group starts: ``earliest`` (everything the topic or stream
            holds; HPS's ``auto.offset.reset=smallest``) or ``latest`` (only what is
            published from now on).
        brokers: Kafka bootstrap servers, ``host:port[,host:port...]`` (HPS's default).
        metadata_refresh_interval_ms: how often the Kafka consumer re-reads the topic
            list (librdkafka ``topic.metadata.refresh.interval.ms``; a topic created later
            is followed from then on).
        receive_buffer_size: largest Kafka message accepted, in bytes (HPS sets
            ``message.max.bytes`` to this + 1024).
        max_commit_interval: most Kafka messages read, applied and then committed at once.
        session_timeout_ms, max_poll_interval_ms: the Kafka group's timeouts (librdkafka
            ``session.timeout.ms``, HPS's 30 s; ``max.poll.interval.ms``, librdkafka's
            5 min). Not HPS keys: a consumer that joins a group waits up to about half
            the session timeout, and tests shorten both.
    """

    type: str = "null"
    redis: RedisParams = field(default_factory=RedisParams)
    group: Optional[str] = None
    poll_timeout_ms: int = 500
    max_batch_size: int = 8192
    failure_backoff_ms: int = 50
    start: str = "earliest"
    brokers: str = "127.0.0.1:9092"
    metadata_refresh_interval_ms: int = 30000
    receive_buffer_size: int = 262144
    max_commit_interval: int = 32
    session_timeout_ms: int = 30000
    max_poll_interval_ms: int = 300000
    unknown_keys: Tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        """Whether an update source is configured (type is not ``"null"``)."""
        return self.type != "null"


def _batch_size(sec: dict, where: str, default: int) -> int:
    # max_batch_size, or the older max_get/set_batch_size pair (the smaller wins).
    for key in ("max_batch_size", "max_get_batch_size", "max_set_batch_size"):
        if key in sec:
            as_int(sec[key], f"{where}.{key}", 1, MAX_TIER_BATCH_SIZE)
    if "max_batch_size" in sec:
        return int(sec["max_batch_size"])
    old = [int(sec[k]) for k in ("max_get_batch_size", "max_set_batch_size") if k in sec]
    return min(old) if old else default


def _redis_params(sec: dict, where: str, base_dir: str) -> RedisParams:
    d = RedisParams()

    def opt_str(key):
        v = sec.get(key)
        if v is None or v == "":
            return None
        if not isinstance(v, str):
            raise fail(f"{where}.{key}", f"expected a string, got {v!r}")
        return v

    def opt_file(key):
        v = opt_str(key)
        return None if v is None else resolve_path(v, base_dir)

    timeouts = {}
    for key in ("connect_timeout", "socket_timeout"):
        timeouts[key] = as_float(sec.get(key, getattr(d, key)), f"{where}.{key}")
        if timeouts[key] <= 0:
            raise fail(f"{where}.{key}", f"must be > 0 seconds, got {timeouts[key]}")
    address = sec.get("address", d.address)
    if not isinstance(address, str) or not address.strip():
        raise fail(f"{where}.address", f"expected 'host:port[,host:port...]', got {address!r}")
    return RedisParams(
        address=address,
        user_name=opt_str("user_name") or d.user_name,
        password=opt_str("password") or "",
        num_node_connections=as_int(
            sec.get("num_node_connections", d.num_node_connections),
            f"{where}.num_node_connections",
            1,
            MAX_TIER_COUNT,
        ),
        enable_tls=as_bool(sec.get("enable_tls", d.enable_tls), f"{where}.enable_tls"),
        tls_ca_certificate=opt_file("tls_ca_certificate"),
        tls_client_certificate=opt_file("tls_client_certificate"),
        tls_client_key=opt_file("tls_client_key"),
        tls_server_name_identification=opt_str("tls_server_name_identification"),
        **timeouts,
    )


def default_num_partitions() -> int:
    """HPS's ``num_partitions`` when ps.json has none: min(16, hardware threads)
    (HugeCTR v23.09 inference_utils.cpp L83-86), at least 1."""
    return max(1, min(16, os.cpu_count() or 1))


def parse_volatile(sec: Optional[dict], base_dir: str, source: str) -> VolatileDBParams:
    """The ``volatile_db`` section (None: absent, HPS's default hash map)."""
    where = f"{source}: volatile_db"
    d = VolatileDBParams()
    if sec is None:  # no volatile_db section: HPS's struct default (parallel_hash_map)
        return d
    # A section without "type" is "disabled" in HPS (inference_utils.cpp L439-441).
    typ = choice(sec["type"], VOLATILE_TYPES, f"{where}.type") if "type" in sec else "disabled"
    margin = sec.get("overflow_margin")
    if margin is not None:
        margin = as_int(margin, f"{where}.overflow_margin", 1)
        if margin >= 2**63:  # HPS's default is SIZE_MAX: unbounded
            margin = None
    target = as_float(
        sec.get("overflow_resolution_target", d.overflow_resolution_target),
        f"{where}.overflow_resolution_target",
    )
    if not 0.0 < target < 1.0:
        raise fail(f"{where}.overflow_resolution_target", f"must be within ]0, 1[, got {target}")
    rate = as_float(
        sec.get("initial_cache_rate", d.initial_cache_rate), f"{where}.initial_cache_rate"
    )
    if not 0.0 <= rate <= 1.0:
        raise fail(f"{where}.initial_cache_rate", f"must be within [0, 1], got {rate}")
    return VolatileDBParams(
        type=typ,
        redis=_redis_params(sec, where, base_dir),
        num_partitions=None
        if sec.get("num_partitions") is None
        else as_int(sec["num_partitions"], f"{where}.num_partitions", 1, MAX_TIER_COUNT),
        max_batch_size=_batch_size(sec, where, d.max_batch_size),
        overflow_margin=margin,
        overflow_policy=OverflowPolicy(
            choice(
                sec.get("overflow_policy", d.overflow_policy),
                OVERFLOW_POLICY_NAMES,
                f"{where}.overflow_policy",
            )
        ),
        overflow_resolution_target=target,
        initial_cache_rate=rate,
        cache_missed_embeddings=as_bool(
            sec.get("cache_missed_embeddings", d.cache_missed_embeddings),
            f"{where}.cache_missed_embeddings",
        ),
        refresh_time_after_fetch=as_bool(
            sec.get("refresh_time_after_fetch", d.refresh_time_after_fetch),
            f"{where}.refresh_time_after_fetch",
        ),
        update_filters=regex_list(
            sec.get("update_filters", list(d.update_filters)), f"{where}.update_filters"
        ),
        on_unavailable=choice(
            sec.get("on_unavailable", d.on_unavailable), ON_UNAVAILABLE, f"{where}.on_unavailable"
        ),
        extra={k: v for k, v in sec.items() if k in _VOLATILE_KEYS_KNOWN - _VOLATILE_KEYS_USED},
        unknown_keys=tuple(sorted(k for k in sec if k not in _VOLATILE_KEYS_KNOWN)),
    )


def parse_persistent(sec: dict, base_dir: str, source: str) -> PersistentDBParams:
    """The ``persistent_db`` section (empty: disabled)."""
    where = f"{source}: persistent_db"
    d = PersistentDBParams()
    path = sec.get("path", d.path)
    if not isinstance(path, str) or not path:
        raise fail(f"{where}.path", f"expected a directory path, got {path!r}")
    return PersistentDBParams(
        type=choice(sec.get("type", d.type), PERSISTENT_TYPES, f"{where}.type"),
        path=resolve_path(path, base_dir),
        num_threads=as_int(
            sec.get("num_threads", d.num_threads), f"{where}.num_threads", 1, MAX_TIER_COUNT
        ),
        read_only=as_bool(sec.get("read_only", d.read_only), f"{where}.read_only"),
        max_batch_size=_batch_size(sec, where, d.max_batch_size),
        update_filters=regex_list(
            sec.get("update_filters", list(d.update_filters)), f"{where}.update_filters"
        ),
        on_unavailable=choice(
            sec.get("on_unavailable", d.on_unavailable), ON_UNAVAILABLE, f"{where}.on_unavailable"
        ),
        unknown_keys=tuple(sorted(k for k in sec if k not in _PERSISTENT_KEYS_KNOWN)),
    )


def parse_update_source(sec: dict, base_dir: str, source: str) -> UpdateSourceParams:
    """The ``update_source`` section (empty: no online updates)."""
    where = f"{source}: update_source"
    d = UpdateSourceParams()
    raw = sec.get("type", "null")
    if raw is None:
        raw = "null"
    group = sec.get("group")
    if group is not None and (not isinstance(group, str) or not group):
        raise fail(f"{where}.group", f"expected a non-empty string, got {group!r}")
    brokers = sec.get("brokers", d.brokers)
    if not isinstance(brokers, str) or not brokers.strip():
        raise fail(f"{where}.brokers", f"expected 'host:port[,host:port...]', got {brokers!r}")

    def ms(key: str, low: int, high: int = MAX_TIER_MS) -> int:
        return as_int(sec.get(key, getattr(d, key)), f"{where}.{key}", low, high)

    session = ms("session_timeout_ms", 1)
    max_poll = ms("max_poll_interval_ms", 1, 2**31 - 1)
    if max_poll < session:  # librdkafka refuses this combination
        raise fail(
            f"{where}.max_poll_interval_ms",
            f"must be >= session_timeout_ms ({session}), got {max_poll}",
        )
    return UpdateSourceParams(
        type=choice(raw, UPDATE_SOURCE_TYPES, f"{where}.type"),
        redis=_redis_params(sec, where, base_dir),
        group=group,
        poll_timeout_ms=ms("poll_timeout_ms", 1),
        max_batch_size=as_int(
            sec.get("max_batch_size", d.max_batch_size),
            f"{where}.max_batch_size",
            1,
            MAX_TIER_BATCH_SIZE,
        ),
        failure_backoff_ms=ms("failure_backoff_ms", 1),
        start=choice(sec.get("start", d.start), ("earliest", "latest"), f"{where}.start"),
        brokers=brokers.strip(),
        # HPS's sanity checks (kafka_message.cpp L437-445)
        metadata_refresh_interval_ms=ms("metadata_refresh_interval_ms", 10),
        receive_buffer_size=as_int(
            sec.get("receive_buffer_size", d.receive_buffer_size),
            f"{where}.receive_buffer_size",
            1024,
            MAX_KAFKA_MESSAGE_BYTES,
        ),
        max_commit_interval=as_int(
            sec.get("max_commit_interval", d.max_commit_interval),
            f"{where}.max_commit_interval",
            1,
            MAX_TIER_BATCH_SIZE,
        ),
        session_timeout_ms=session,
        max_poll_interval_ms=max_poll,
        unknown_keys=tuple(sorted(k for k in sec if k not in _UPDATE_KEYS_KNOWN)),
    )


def check_tiers(
    vol: VolatileDBParams, per: PersistentDBParams, upd: UpdateSourceParams, source: str
) -> None:
    """Combinations that would lose rows or updates without saying so."""
    if vol.type == "disabled" and per.type == "disabled":
        raise fail(
            source,
            "volatile_db and persistent_db are both disabled: no tier would hold the embeddings",
        )
    if per.type == "disabled" and vol.type == "redis_cluster":
        if vol.overflow_margin is not None:
            raise fail(
                f"{source}: volatile_db.overflow_margin",
                "evicting from the only tier would lose embeddings: "
                "set a persistent_db or remove overflow_margin",
            )
        if vol.initial_cache_rate < 1.0:
            raise fail(
                f"{source}: volatile_db.initial_cache_rate",
                f"{vol.initial_cache_rate} < 1 without a persistent_db would leave rows in no tier",
            )
    if upd.enabled:
        if vol.type == "hash_map":
            raise fail(
                f"{source}: update_source",
                "online updates need writable tiers: the hash map volatile_db types "
                "are the read-only node-local store; use volatile_db redis_cluster "
                "and/or persistent_db rocks_db with volatile_db disabled",
            )
        if (vol.type == "disabled" or vol.type == "hash_map") and per.read_only:
            raise fail(
                f"{source}: update_source",
                "online updates need a writable tier: persistent_db is read_only "
                "and there is no redis_cluster volatile_db",
            )
