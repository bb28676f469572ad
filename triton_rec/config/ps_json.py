"""Parsing of HugeCTR/HPS parameter-server configuration files (``ps.json``, a.k.a. ``hps.json``).

There is exactly one parser for this file in the project; everything that needs a
value from ps.json goes through :func:`load_ps_config` / :func:`parse_ps_config`.

Compatibility rules (see ``docs/upstream-notes.md`` for where they come from):

- Every documented key is accepted. Keys the engine does not act on yet are kept in
  ``extra`` so nothing is lost; keys nobody has documented are reported through
  ``unknown_keys`` (the backends log them) instead of failing the load, because real
  files carry obsolete keys such as ``max_get_batch_size``.
- Relative paths (``sparse_files``, ``dense_file``, ``network_file``) resolve against
  the directory of the ps.json that names them.
- Per-table lists must all have one entry per sparse file; a mismatch is a
  :class:`~triton_rec.errors.ConfigError` naming the model and the key.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from triton_rec import _native
from triton_rec.config.model_files import ConfigFileError, read_json
from triton_rec.errors import ConfigError
from triton_rec.precision import DEFAULT_PRECISION, PRECISIONS

# Model keys documented for HPS / HugeCTR (hps-compat.md, upstream parsers).
_MODEL_KEYS_USED = {
    "model",
    "sparse_files",
    "dense_file",
    "network_file",
    "non_trainable_params_file",
    "embedding_table_names",
    "embedding_vecsize_per_table",
    "maxnum_catfeature_query_per_table_per_sample",
    "default_value_for_each_table",
    "max_batch_size",
    "deployed_device_list",
    "gpucache",
    "gpucacheper",
    "hit_rate_threshold",
    "cache_refresh_percentage_per_iteration",
    "refresh_interval",
    "refresh_delay",
    "init_ec",
    "cache_policy",
    "cache_ways",
    "freeze_sparse",
    "embedding_cache_type",
    "use_static_table",
    "embedding_precision",  # our extension (triton_rec.precision)
}
_MODEL_KEYS_KNOWN = _MODEL_KEYS_USED | {
    "num_of_worker_buffer_in_pool",
    "num_of_refresher_buffer_in_pool",
    "label_dim",
    "slot_num",
    "maxnum_des_feature_per_sample",
    "use_context_stream",
    "fp8_quant",
    "enable_pagelock",
    "fuse_embedding_table",
    "sparse_model_files",
    "use_mixed_precision",
    "scaler",
    "use_algorithm_search",
    "use_cuda_graph",
    "des_feature_num",
    "cat_feature_num",
    "embedding_vector_size",
    "dense_model_file",
    "network_file_path",
    "thread_pool_size",
    "use_hctr_cache_implementation",
    "gpucache_type",
}
#: Model keys that steer HPS's GPU machinery and what each means on this node; the
#: backends log one line per key a model sets (:func:`config_warnings`).
GPU_ONLY_OPTIONS = {
    "num_of_worker_buffer_in_pool": "HPS's pool of GPU lookup workspaces; instances here "
    "need none (each lookup writes straight into its response)",
    "num_of_refresher_buffer_in_pool": "GPU workspaces of HPS's refresher; the refresher "
    "here reads the store into host memory",
    "use_context_stream": "CUDA stream selection; no CUDA stream is used on this node",
    "thread_pool_size": "HPS's insert/lookup thread pool; here one background inserter "
    "thread per instance (2-core nodes)",
    "use_hctr_cache_implementation": "choice between HPS's two GPU cache kernels; the "
    "cache here is the shared-memory CPU cache (or the CuPy cache with a GPU)",
    "enable_pagelock": "pinned host memory for static GPU tables; tables here are "
    "memory-mapped files in the node-local store",
    "fp8_quant": "fp8 storage of static GPU tables; tables here stay fp32",
    "use_cuda_graph": "CUDA graphs for the dense network; the dense part runs on the CPU",
    "use_algorithm_search": "cuBLAS algorithm search; the dense part runs on the CPU",
    "use_mixed_precision": "fp16 dense layers on the GPU; the dense part runs in fp32",
    "scaler": "the loss scaler of mixed precision; unused at inference here",
}
#: Limits of ps.json values (docs/operations.md, "Configuration limits"). The cache
#: limits are the native cache's own (src/native/shm_cache.hpp).
MAX_CACHE_WAYS = int(_native.SHM_CACHE_MAX_WAYS)
MAX_VEC_SIZE = int(_native.SHM_CACHE_MAX_VEC_SIZE)
#: A model's ``max_batch_size`` and ``max_batch_size x keys per sample``: Triton's
#: max_batch_size is an int32, and so are the key offsets of a request (NUMKEYS, ROWINDEX).
MAX_BATCH_SIZE = 2**31 - 1
MAX_KEYS_PER_REQUEST = 2**31 - 1
#: Keys per command/batch of a tier or the update consumer (``max_batch_size`` of the
#: ``volatile_db``, ``persistent_db`` and ``update_source`` sections).
MAX_TIER_BATCH_SIZE = 1 << 20
#: ``num_partitions``, ``num_threads`` and ``num_node_connections`` of the tier sections.
MAX_TIER_COUNT = 4096
#: Millisecond settings of ``update_source`` (poll, backoff, Kafka timeouts): one hour at most.
MAX_TIER_MS = 3_600_000
#: ``update_source.receive_buffer_size``: librdkafka's largest ``message.max.bytes``
#: (1e9) less the 1024 bytes HPS adds to it.
MAX_KAFKA_MESSAGE_BYTES = 1_000_000_000 - 1024


class StrEnum(str, enum.Enum):
    """A string enum whose members are their value wherever a string is expected:
    ``==``, hashing, ``str()``, f-strings, ``%s`` and JSON give ``"lru"``, never
    ``"CachePolicy.LRU"`` (what ``(str, Enum)`` formats as on Python 3.11+)."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class CachePolicy(StrEnum):
    """Embedding-cache policies, the ``cache_policy`` key of a ps.json model (our
    extension). The one list of them: the CPU cache (:mod:`triton_rec.cache.shm_cache`), the
    array cache (:mod:`triton_rec.cache.array_cache`, which stores a policy as its index in
    this order) and ``benchmarks/cache_sim.py`` (same names) all use it.

    ``lru``: evict the least recently used way of the key's set (HPS).
    ``tinylfu``: the same victim, plus TinyLFU admission (a new key replaces the victim
    only if its estimated recent frequency is higher).
    """

    LRU = "lru"
    TINYLFU = "tinylfu"


class OverflowPolicy(StrEnum):
    """``volatile_db.overflow_policy``: which rows a Redis partition past its
    ``overflow_margin`` loses (HPS names; :mod:`triton_rec.storage.redis_store`)."""

    EVICT_OLDEST = "evict_oldest"
    EVICT_RANDOM = "evict_random"
    EVICT_LEAST_USED = "evict_least_used"


class EmbeddingCacheType(StrEnum):
    """``embedding_cache_type`` of a model (HPS names, inference_utils.cpp L930-960;
    ``use_static_table: true`` forces ``static``, L656-658). What each means here
    (docs/upstream-notes.md, "Embedding cache types"):

    ``dynamic``: the cache with ``hit_rate_threshold`` semantics (HPS's default).
    ``static``: HPS keeps the whole table on the GPU and never answers a stored key with
    the default value; here the cache fetches every miss synchronously (``exact``).
    ``uvm``: HPS keeps ``gpucacheper`` of the rows on the GPU, the rest in host memory,
    every answer exact: the same as ``static`` here.
    ``stochastic``: never selectable in HPS's backends (their lower-casing makes the
    branch unreachable); served as ``dynamic``.
    """

    DYNAMIC = "dynamic"
    STATIC = "static"
    UVM = "uvm"
    STOCHASTIC = "stochastic"

    @property
    def exact(self) -> bool:
        """Whether every miss is fetched synchronously (no default answers for stored keys)."""
        return self in (EmbeddingCacheType.STATIC, EmbeddingCacheType.UVM)


#: Cache policies a model may choose with the ``cache_policy`` key (our extension).
CACHE_POLICIES = tuple(p.value for p in CachePolicy)

#: HugeCTR's rule for model and table names (they end up in topic names, tier table
#: names and paths): the one definition; :data:`NAME_RE` is it compiled.
NAME_PATTERN = r"[A-Za-z0-9_-]{1,120}"
NAME_RE = re.compile(NAME_PATTERN)
_NAME_RE = NAME_RE
_TOP_KEYS_KNOWN = {
    "supportlonglong",
    "volatile_db",
    "persistent_db",
    "update_source",
    "models",
    "fuse_embedding_table",
}


def _fail(where: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {msg}")


def _as_bool(v: Any, where: str) -> bool:
    if isinstance(v, bool):
        return v
    # Upstream files sometimes spell booleans as strings.
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise _fail(where, f"expected a boolean, got {v!r}")


def _as_int(
    v: Any, where: str, minimum: Optional[int] = None, maximum: Optional[int] = None
) -> int:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and not math.isfinite(v))
        or int(v) != v
    ):
        raise _fail(where, f"expected an integer, got {v!r}")
    v = int(v)
    if maximum is not None and (v > maximum or (minimum is not None and v < minimum)):
        raise _fail(where, f"must be within [{minimum}, {maximum}], got {v}")
    if minimum is not None and v < minimum:
        raise _fail(where, f"must be >= {minimum}, got {v}")
    return v


def _as_float(v: Any, where: str) -> float:
    # NaN/Infinity are not JSON, but 1e999 decodes to inf: refused like any non-number.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _fail(where, f"expected a finite number, got {v!r}")
    return float(v)


def _as_list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise _fail(where, f"expected a list, got {type(v).__name__}")
    return v


def _resolve(path: str, base_dir: str) -> str:
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))


def model_relative_path(model_dir: str, parameter: Optional[str]) -> Optional[str]:
    """A path given by a config.pbtxt parameter (``ps``, ``store_dir``, ``config``): a
    relative value resolves against the model directory (the directory of the config
    that names it), never against the server's working directory. None stays None."""
    if not parameter:
        return None
    return _resolve(parameter, os.path.abspath(model_dir))


# ---- storage tiers (top-level volatile_db / persistent_db / update_source) -------------

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


def _choice(v: Any, choices, where: str) -> str:
    if not isinstance(v, str) or v.lower() not in choices:
        raise _fail(where, f"must be one of {sorted(set(choices))}, got {v!r}")
    return choices[v.lower()] if isinstance(choices, dict) else v.lower()


def _filters(v: Any, where: str) -> Tuple[str, ...]:
    items = _as_list(v, where)
    for i, f in enumerate(items):
        if not isinstance(f, str):
            raise _fail(f"{where}[{i}]", f"expected a regular expression string, got {f!r}")
        try:
            re.compile(f)
        except re.error as e:
            raise _fail(f"{where}[{i}]", f"not a valid regular expression: {e}") from e
    return tuple(items)


def _batch_size(sec: dict, where: str, default: int) -> int:
    # max_batch_size, or the older max_get/set_batch_size pair (the smaller wins).
    for key in ("max_batch_size", "max_get_batch_size", "max_set_batch_size"):
        if key in sec:
            _as_int(sec[key], f"{where}.{key}", 1, MAX_TIER_BATCH_SIZE)
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
            raise _fail(f"{where}.{key}", f"expected a string, got {v!r}")
        return v

    def opt_file(key):
        v = opt_str(key)
        return None if v is None else _resolve(v, base_dir)

    timeouts = {}
    for key in ("connect_timeout", "socket_timeout"):
        timeouts[key] = _as_float(sec.get(key, getattr(d, key)), f"{where}.{key}")
        if timeouts[key] <= 0:
            raise _fail(f"{where}.{key}", f"must be > 0 seconds, got {timeouts[key]}")
    address = sec.get("address", d.address)
    if not isinstance(address, str) or not address.strip():
        raise _fail(f"{where}.address", f"expected 'host:port[,host:port...]', got {address!r}")
    return RedisParams(
        address=address,
        user_name=opt_str("user_name") or d.user_name,
        password=opt_str("password") or "",
        num_node_connections=_as_int(
            sec.get("num_node_connections", d.num_node_connections),
            f"{where}.num_node_connections",
            1,
            MAX_TIER_COUNT,
        ),
        enable_tls=_as_bool(sec.get("enable_tls", d.enable_tls), f"{where}.enable_tls"),
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


def _parse_volatile(sec: Optional[dict], base_dir: str, source: str) -> VolatileDBParams:
    where = f"{source}: volatile_db"
    d = VolatileDBParams()
    if sec is None:  # no volatile_db section: HPS's struct default (parallel_hash_map)
        return d
    # A section without "type" is "disabled" in HPS (inference_utils.cpp L439-441).
    typ = _choice(sec["type"], VOLATILE_TYPES, f"{where}.type") if "type" in sec else "disabled"
    margin = sec.get("overflow_margin")
    if margin is not None:
        margin = _as_int(margin, f"{where}.overflow_margin", 1)
        if margin >= 2**63:  # HPS's default is SIZE_MAX: unbounded
            margin = None
    target = _as_float(
        sec.get("overflow_resolution_target", d.overflow_resolution_target),
        f"{where}.overflow_resolution_target",
    )
    if not 0.0 < target < 1.0:
        raise _fail(f"{where}.overflow_resolution_target", f"must be within ]0, 1[, got {target}")
    rate = _as_float(
        sec.get("initial_cache_rate", d.initial_cache_rate), f"{where}.initial_cache_rate"
    )
    if not 0.0 <= rate <= 1.0:
        raise _fail(f"{where}.initial_cache_rate", f"must be within [0, 1], got {rate}")
    return VolatileDBParams(
        type=typ,
        redis=_redis_params(sec, where, base_dir),
        num_partitions=None
        if sec.get("num_partitions") is None
        else _as_int(sec["num_partitions"], f"{where}.num_partitions", 1, MAX_TIER_COUNT),
        max_batch_size=_batch_size(sec, where, d.max_batch_size),
        overflow_margin=margin,
        overflow_policy=OverflowPolicy(
            _choice(
                sec.get("overflow_policy", d.overflow_policy),
                OVERFLOW_POLICY_NAMES,
                f"{where}.overflow_policy",
            )
        ),
        overflow_resolution_target=target,
        initial_cache_rate=rate,
        cache_missed_embeddings=_as_bool(
            sec.get("cache_missed_embeddings", d.cache_missed_embeddings),
            f"{where}.cache_missed_embeddings",
        ),
        refresh_time_after_fetch=_as_bool(
            sec.get("refresh_time_after_fetch", d.refresh_time_after_fetch),
            f"{where}.refresh_time_after_fetch",
        ),
        update_filters=_filters(
            sec.get("update_filters", list(d.update_filters)), f"{where}.update_filters"
        ),
        on_unavailable=_choice(
            sec.get("on_unavailable", d.on_unavailable), ON_UNAVAILABLE, f"{where}.on_unavailable"
        ),
        extra={k: v for k, v in sec.items() if k in _VOLATILE_KEYS_KNOWN - _VOLATILE_KEYS_USED},
        unknown_keys=tuple(sorted(k for k in sec if k not in _VOLATILE_KEYS_KNOWN)),
    )


def _parse_persistent(sec: dict, base_dir: str, source: str) -> PersistentDBParams:
    where = f"{source}: persistent_db"
    d = PersistentDBParams()
    path = sec.get("path", d.path)
    if not isinstance(path, str) or not path:
        raise _fail(f"{where}.path", f"expected a directory path, got {path!r}")
    return PersistentDBParams(
        type=_choice(sec.get("type", d.type), PERSISTENT_TYPES, f"{where}.type"),
        path=_resolve(path, base_dir),
        num_threads=_as_int(
            sec.get("num_threads", d.num_threads), f"{where}.num_threads", 1, MAX_TIER_COUNT
        ),
        read_only=_as_bool(sec.get("read_only", d.read_only), f"{where}.read_only"),
        max_batch_size=_batch_size(sec, where, d.max_batch_size),
        update_filters=_filters(
            sec.get("update_filters", list(d.update_filters)), f"{where}.update_filters"
        ),
        on_unavailable=_choice(
            sec.get("on_unavailable", d.on_unavailable), ON_UNAVAILABLE, f"{where}.on_unavailable"
        ),
        unknown_keys=tuple(sorted(k for k in sec if k not in _PERSISTENT_KEYS_KNOWN)),
    )


def _parse_update_source(sec: dict, base_dir: str, source: str) -> UpdateSourceParams:
    where = f"{source}: update_source"
    d = UpdateSourceParams()
    raw = sec.get("type", "null")
    if raw is None:
        raw = "null"
    group = sec.get("group")
    if group is not None and (not isinstance(group, str) or not group):
        raise _fail(f"{where}.group", f"expected a non-empty string, got {group!r}")
    brokers = sec.get("brokers", d.brokers)
    if not isinstance(brokers, str) or not brokers.strip():
        raise _fail(f"{where}.brokers", f"expected 'host:port[,host:port...]', got {brokers!r}")

    def ms(key: str, low: int, high: int = MAX_TIER_MS) -> int:
        return _as_int(sec.get(key, getattr(d, key)), f"{where}.{key}", low, high)

    session = ms("session_timeout_ms", 1)
    max_poll = ms("max_poll_interval_ms", 1, 2**31 - 1)
    if max_poll < session:  # librdkafka refuses this combination
        raise _fail(
            f"{where}.max_poll_interval_ms",
            f"must be >= session_timeout_ms ({session}), got {max_poll}",
        )
    return UpdateSourceParams(
        type=_choice(raw, UPDATE_SOURCE_TYPES, f"{where}.type"),
        redis=_redis_params(sec, where, base_dir),
        group=group,
        poll_timeout_ms=ms("poll_timeout_ms", 1),
        max_batch_size=_as_int(
            sec.get("max_batch_size", d.max_batch_size),
            f"{where}.max_batch_size",
            1,
            MAX_TIER_BATCH_SIZE,
        ),
        failure_backoff_ms=ms("failure_backoff_ms", 1),
        start=_choice(sec.get("start", d.start), ("earliest", "latest"), f"{where}.start"),
        brokers=brokers.strip(),
        # HPS's sanity checks (kafka_message.cpp L437-445)
        metadata_refresh_interval_ms=ms("metadata_refresh_interval_ms", 10),
        receive_buffer_size=_as_int(
            sec.get("receive_buffer_size", d.receive_buffer_size),
            f"{where}.receive_buffer_size",
            1024,
            MAX_KAFKA_MESSAGE_BYTES,
        ),
        max_commit_interval=_as_int(
            sec.get("max_commit_interval", d.max_commit_interval),
            f"{where}.max_commit_interval",
            1,
            MAX_TIER_BATCH_SIZE,
        ),
        session_timeout_ms=session,
        max_poll_interval_ms=max_poll,
        unknown_keys=tuple(sorted(k for k in sec if k not in _UPDATE_KEYS_KNOWN)),
    )


def _check_tiers(
    vol: VolatileDBParams, per: PersistentDBParams, upd: UpdateSourceParams, source: str
) -> None:
    """Combinations that would lose rows or updates without saying so."""
    if vol.type == "disabled" and per.type == "disabled":
        raise _fail(
            source,
            "volatile_db and persistent_db are both disabled: no tier would hold the embeddings",
        )
    if per.type == "disabled" and vol.type == "redis_cluster":
        if vol.overflow_margin is not None:
            raise _fail(
                f"{source}: volatile_db.overflow_margin",
                "evicting from the only tier would lose embeddings: "
                "set a persistent_db or remove overflow_margin",
            )
        if vol.initial_cache_rate < 1.0:
            raise _fail(
                f"{source}: volatile_db.initial_cache_rate",
                f"{vol.initial_cache_rate} < 1 without a persistent_db would leave rows in no tier",
            )
    if upd.enabled:
        if vol.type == "hash_map":
            raise _fail(
                f"{source}: update_source",
                "online updates need writable tiers: the hash map volatile_db types "
                "are the read-only node-local store; use volatile_db redis_cluster "
                "and/or persistent_db rocks_db with volatile_db disabled",
            )
        if (vol.type == "disabled" or vol.type == "hash_map") and per.read_only:
            raise _fail(
                f"{source}: update_source",
                "online updates need a writable tier: persistent_db is read_only "
                "and there is no redis_cluster volatile_db",
            )


@dataclass(frozen=True)
class TableParams:
    """One embedding table of a model.

    Args:
        name: table name (``embedding_table_names[i]``).
        sparse_file: resolved path of the HugeCTR sparse directory or ``.npz`` file.
        vec_size: floats per embedding vector.
        max_keys_per_sample: ``maxnum_catfeature_query_per_table_per_sample[i]``.
        default_value: value of every element of a vector whose key is unknown.
        precision: how the node store, the cache and the tiers hold the rows (ps.json
            ``embedding_precision[i]``, our extension; :data:`PRECISIONS`).
        fused_into: with HPS's table fusion (top-level ``fuse_embedding_table``), the
            fused table ``fused_embedding<k>`` whose Redis/RocksDB table and update topic
            hold this table's rows (:func:`fused_table_names`); None otherwise.
    """

    name: str
    sparse_file: str
    vec_size: int
    max_keys_per_sample: int
    default_value: float = 0.0
    fused_into: Optional[str] = None
    precision: str = DEFAULT_PRECISION

    @property
    def tier_name(self) -> str:
        """The table's name in the Redis/RocksDB tiers and update topics: the fused
        table's with table fusion, else its own."""
        return self.fused_into or self.name


@dataclass(frozen=True)
class ModelParams:
    """The ``models[]`` entry of one model.

    Args:
        model: model name; equals the Triton model name.
        tables: one :class:`TableParams` per sparse file, in file order.
        max_batch_size: most samples one request may hold.
        dense_file: resolved dense weight file, if any.
        network_file: resolved network JSON, if any.
        non_trainable_params_file: resolved JSON of BatchNorm running statistics, if any
            (our extension; HugeCTR's inference parser takes it as a separate argument).
        deployed_device_list: devices the model is deployed on.
        gpucache: whether an embedding cache is used.
        gpucacheper: cache size as a fraction of each table's rows.
        hit_rate_threshold: below it, misses are fetched synchronously.
        cache_policy: ``lru`` (HPS) or ``tinylfu`` (LRU eviction + TinyLFU admission).
        cache_ways: ways per set of the set-associative cache.
        init_ec: fill the cache from the table when it is created; as in HPS only with a
            refresh percentage > 0, or for a non-dynamic ``embedding_cache_type``.
        refresh_interval: seconds between cache refreshes (0 = never).
        refresh_delay: seconds before the first refresh.
        cache_refresh_percentage_per_iteration: each refresh re-reads every cached row, in
            chunks of this fraction of the cache; 0 (HPS's default) disables refresh.
        embedding_cache_type: see :class:`EmbeddingCacheType`.
        freeze_sparse: keep what the writable tiers hold when the model is loaded again
            (no re-import of changed sparse files; online updates stay).
        volatile_db, persistent_db, update_source: the file's tier sections (shared by
            every model of the file).
        extra: documented keys this version does not act on, as given.
        unknown_keys: keys that nobody documented (kept for warnings).
        notes: what the parser did that the file does not say (logged at load).
    """

    model: str
    tables: Tuple[TableParams, ...]
    max_batch_size: int = 64
    dense_file: Optional[str] = None
    network_file: Optional[str] = None
    non_trainable_params_file: Optional[str] = None
    deployed_device_list: Tuple[int, ...] = (0,)
    gpucache: bool = True
    gpucacheper: float = 0.2
    hit_rate_threshold: float = 0.9
    cache_policy: CachePolicy = CachePolicy.LRU
    cache_ways: int = 8
    init_ec: bool = True
    refresh_interval: float = 0.0
    refresh_delay: float = 0.0
    cache_refresh_percentage_per_iteration: float = 0.0
    freeze_sparse: bool = False
    embedding_cache_type: EmbeddingCacheType = EmbeddingCacheType.DYNAMIC
    volatile_db: VolatileDBParams = field(default_factory=VolatileDBParams)
    persistent_db: PersistentDBParams = field(default_factory=PersistentDBParams)
    update_source: UpdateSourceParams = field(default_factory=UpdateSourceParams)
    extra: Dict[str, Any] = field(default_factory=dict)
    unknown_keys: Tuple[str, ...] = ()
    notes: Tuple[str, ...] = ()

    @property
    def num_tables(self) -> int:
        """Number of embedding tables of the model."""
        return len(self.tables)

    @property
    def keys_per_sample(self) -> int:
        """Sum over tables of the most keys one sample may hold."""
        return sum(t.max_keys_per_sample for t in self.tables)


def field_defaults(cls) -> Dict[str, Any]:
    """``{field name: default}`` of a config dataclass, for the fields with a plain default
    (not those with a ``default_factory``): the one place a ps.json default is written
    is its dataclass field; the parser and other users read it from here."""
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


#: Defaults of a ``models[]`` entry (:class:`ModelParams`) and of a table (:class:`TableParams`).
MODEL_DEFAULTS = field_defaults(ModelParams)
TABLE_DEFAULTS = field_defaults(TableParams)


@dataclass(frozen=True)
class PSConfig:
    """A parsed ps.json.

    Args:
        path: the file it came from ("<memory>" when parsed from a dict).
        supportlonglong: whether keys are 64-bit (``KEYS`` is always INT64 here).
        models: the model entries, by order of appearance.
        volatile_db, persistent_db, update_source: the parsed tier sections (also copied
            into every :class:`ModelParams`).
        unknown_keys: undocumented top-level keys.
    """

    path: str
    supportlonglong: bool
    models: Tuple[ModelParams, ...]
    volatile_db: VolatileDBParams = field(default_factory=VolatileDBParams)
    persistent_db: PersistentDBParams = field(default_factory=PersistentDBParams)
    update_source: UpdateSourceParams = field(default_factory=UpdateSourceParams)
    unknown_keys: Tuple[str, ...] = ()

    def model(self, name: str) -> ModelParams:
        """The entry whose ``model`` equals ``name``; ConfigError listing the others if none."""
        for m in self.models:
            if m.model == name:
                return m
        names = ", ".join(repr(m.model) for m in self.models) or "none"
        raise ConfigError(f"{self.path}: no entry in 'models' for model {name!r} (found: {names})")


def _per_table(obj: dict, key: str, n: int, where: str, default: Optional[Sequence] = None) -> list:
    if key not in obj:
        if default is None:
            raise _fail(where, f"missing required key '{key}'")
        return list(default)
    values = _as_list(obj[key], f"{where}.{key}")
    if len(values) != n:
        raise _fail(where, f"'{key}' has {len(values)} entries but 'sparse_files' names {n} tables")
    return values


def _parse_model(obj: Any, index: int, base_dir: str, source: str) -> ModelParams:  # noqa: C901  (flat per-key checks)
    where = f"{source}: models[{index}]"
    dft = MODEL_DEFAULTS
    if not isinstance(obj, dict):
        raise _fail(where, f"expected an object, got {type(obj).__name__}")
    if "model" not in obj or not isinstance(obj["model"], str) or not obj["model"]:
        raise _fail(where, "missing required key 'model' (a non-empty string)")
    name = obj["model"]
    where = f"{source}: model {name!r}"
    if not _NAME_RE.fullmatch(name):
        raise _fail(where, "model names may only hold letters, digits, '_' and '-' (1-120)")

    if "sparse_files" not in obj:
        raise _fail(where, "missing required key 'sparse_files'")
    sparse = _as_list(obj["sparse_files"], f"{where}.sparse_files")
    if not sparse or not all(isinstance(s, str) and s for s in sparse):
        raise _fail(where, "'sparse_files' must be a non-empty list of paths")
    n = len(sparse)

    names = _per_table(
        obj, "embedding_table_names", n, where, [f"sparse_embedding{i}" for i in range(n)]
    )
    if not all(isinstance(s, str) and _NAME_RE.fullmatch(s) for s in names):
        raise _fail(
            where,
            f"'embedding_table_names' must be letters, digits, '_' or '-' (1-120): {names}",
        )
    if len(set(names)) != n:
        raise _fail(where, f"'embedding_table_names' has duplicates: {names}")

    def table_key(key: str, i: int) -> str:
        return f"{where}: table {names[i]!r}: {key}[{i}]"

    vec = [
        _as_int(v, table_key("embedding_vecsize_per_table", i), 1, MAX_VEC_SIZE)
        for i, v in enumerate(_per_table(obj, "embedding_vecsize_per_table", n, where))
    ]
    maxnum = [
        _as_int(
            v, table_key("maxnum_catfeature_query_per_table_per_sample", i), 1, MAX_KEYS_PER_REQUEST
        )
        for i, v in enumerate(
            _per_table(obj, "maxnum_catfeature_query_per_table_per_sample", n, where)
        )
    ]
    precisions = [
        _choice(v, {p: p for p in PRECISIONS}, table_key("embedding_precision", i))
        for i, v in enumerate(
            _per_table(obj, "embedding_precision", n, where, [DEFAULT_PRECISION] * n)
        )
    ]
    defaults, notes = _default_values(obj, n, where, table_key)
    max_batch = _as_int(
        obj.get("max_batch_size", dft["max_batch_size"]),
        f"{where}.max_batch_size",
        1,
        MAX_BATCH_SIZE,
    )
    if max_batch * sum(maxnum) > MAX_KEYS_PER_REQUEST:
        raise _fail(
            f"{where}.max_batch_size",
            f"{max_batch} samples x {sum(maxnum)} keys per sample "
            f"(maxnum_catfeature_query_per_table_per_sample) = {max_batch * sum(maxnum)} "
            f"keys per request, more than the limit of {MAX_KEYS_PER_REQUEST}",
        )

    devices = tuple(
        _as_int(d, f"{where}.deployed_device_list[{i}]", 0)
        for i, d in enumerate(
            _as_list(obj.get("deployed_device_list", list(dft["deployed_device_list"])), where)
        )
    ) or (0,)

    def opt_path(key: str) -> Optional[str]:
        v = obj.get(key)
        if v is None or v == "":
            return None
        if not isinstance(v, str):
            raise _fail(where, f"'{key}' must be a path string, got {v!r}")
        return _resolve(v, base_dir)

    tables = tuple(
        TableParams(
            name=names[i],
            sparse_file=_resolve(sparse[i], base_dir),
            vec_size=vec[i],
            max_keys_per_sample=maxnum[i],
            default_value=defaults[i],
            precision=precisions[i],
        )
        for i in range(n)
    )
    gpucacheper = _as_float(obj.get("gpucacheper", dft["gpucacheper"]), f"{where}.gpucacheper")
    if not 0.0 <= gpucacheper <= 1.0:
        raise _fail(where, f"'gpucacheper' must be within [0, 1], got {gpucacheper}")
    policy = obj.get("cache_policy", dft["cache_policy"])
    if policy not in CACHE_POLICIES:
        raise _fail(where, f"'cache_policy' must be one of {list(CACHE_POLICIES)}, got {policy!r}")
    refresh_fraction = _as_float(
        obj.get(
            "cache_refresh_percentage_per_iteration", dft["cache_refresh_percentage_per_iteration"]
        ),
        f"{where}.cache_refresh_percentage_per_iteration",
    )
    if not 0.0 <= refresh_fraction <= 1.0:
        raise _fail(
            where,
            "'cache_refresh_percentage_per_iteration' must be within [0, 1], "
            f"got {refresh_fraction}",
        )
    cache_type = EmbeddingCacheType(
        _choice(
            obj.get("embedding_cache_type", dft["embedding_cache_type"]),
            {t.value: t.value for t in EmbeddingCacheType},
            f"{where}.embedding_cache_type",
        )
    )
    if _as_bool(obj.get("use_static_table", False), f"{where}.use_static_table"):
        cache_type = EmbeddingCacheType.STATIC  # HPS: use_static_table forces static (L656-658)
    seconds = {}
    for key in ("refresh_interval", "refresh_delay"):
        seconds[key] = _as_float(obj.get(key, dft[key]), f"{where}.{key}")
        if seconds[key] < 0:
            raise _fail(where, f"'{key}' must be >= 0 seconds, got {seconds[key]}")
    return ModelParams(
        model=name,
        tables=tables,
        max_batch_size=max_batch,
        dense_file=opt_path("dense_file"),
        network_file=opt_path("network_file"),
        non_trainable_params_file=opt_path("non_trainable_params_file"),
        deployed_device_list=devices,
        gpucache=_as_bool(obj.get("gpucache", dft["gpucache"]), f"{where}.gpucache"),
        gpucacheper=gpucacheper,
        hit_rate_threshold=_as_float(
            obj.get("hit_rate_threshold", dft["hit_rate_threshold"]), f"{where}.hit_rate_threshold"
        ),
        cache_policy=CachePolicy(policy),
        cache_ways=_as_int(
            obj.get("cache_ways", dft["cache_ways"]), f"{where}.cache_ways", 1, MAX_CACHE_WAYS
        ),
        init_ec=_as_bool(obj.get("init_ec", dft["init_ec"]), f"{where}.init_ec"),
        refresh_interval=seconds["refresh_interval"],
        refresh_delay=seconds["refresh_delay"],
        cache_refresh_percentage_per_iteration=refresh_fraction,
        freeze_sparse=_as_bool(
            obj.get("freeze_sparse", dft["freeze_sparse"]), f"{where}.freeze_sparse"
        ),
        embedding_cache_type=cache_type,
        extra={k: v for k, v in obj.items() if k in _MODEL_KEYS_KNOWN - _MODEL_KEYS_USED},
        unknown_keys=tuple(sorted(k for k in obj if k not in _MODEL_KEYS_KNOWN)),
        notes=tuple(notes),
    )


def fused_table_names(vec_sizes: Sequence[int]) -> List[str]:
    """HPS's table fusion (inference_utils.cpp L260-364): the tables of a model are grouped
    by vector size, groups in ascending vector size, the k-th named ``fused_embedding<k>``;
    returns each table's fused name. (HPS then looks the keys of every member up in the
    one fused table: keys must not repeat across its members.)"""
    order = {v: k for k, v in enumerate(sorted(set(vec_sizes)))}
    return [f"fused_embedding{order[v]}" for v in vec_sizes]


def _default_values(obj: dict, n: int, where: str, table_key) -> Tuple[List[float], List[str]]:
    """``default_value_for_each_table`` as HPS reads it (inference_utils.cpp L590-605): a
    short list is padded with 0, entries past the number of tables are ignored; both are
    noted for the load log. Absent: every table's default is 0 (HPS requires the key)."""
    key = "default_value_for_each_table"
    if key not in obj:
        return [TABLE_DEFAULTS["default_value"]] * n, []
    given = _as_list(obj[key], f"{where}.{key}")
    values = [_as_float(v, table_key(key, i)) for i, v in enumerate(given[:n])]
    notes = []
    if len(given) < n:
        notes.append(
            f"{where}: '{key}' has {len(given)} entries for {n} tables: the last "
            f"{n - len(given)} tables default to 0.0 (as HPS pads it)"
        )
        values += [0.0] * (n - len(given))
    elif len(given) > n:
        notes.append(
            f"{where}: '{key}' has {len(given)} entries for {n} tables: the extra "
            f"{len(given) - n} are ignored (as in HPS)"
        )
    return values, notes


def _section(obj: dict, key: str, source: str) -> Dict[str, Any]:
    v = obj.get(key, {})
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _fail(source, f"'{key}' must be an object, got {type(v).__name__}")
    return dict(v)


def _fused(m: ModelParams, where: str) -> ModelParams:
    if not _as_bool(m.extra.get("fuse_embedding_table", True), where):
        return m
    names = fused_table_names([t.vec_size for t in m.tables])
    precision_of: Dict[str, str] = {}
    for t, f in zip(m.tables, names):
        if precision_of.setdefault(f, t.precision) != t.precision:
            raise _fail(
                where,
                f"table {t.name!r} ({t.precision}) would be fused into {f} with tables stored "
                f"in {precision_of[f]}: tables of one vec_size need one 'embedding_precision' "
                "while 'fuse_embedding_table' is on (or set it to false)",
            )
    return dataclasses.replace(
        m,
        tables=tuple(dataclasses.replace(t, fused_into=f) for t, f in zip(m.tables, names)),
    )


def parse_ps_config(obj: Any, base_dir: str = ".", source: str = "<memory>") -> PSConfig:
    """Validate a decoded ps.json document.

    Args:
        obj: the decoded JSON value.
        base_dir: directory that relative paths resolve against.
        source: name used in error messages (normally the file path).

    Raises:
        ConfigError: naming the file, the model and the key at fault.
    """
    if not isinstance(obj, dict):
        raise _fail(source, f"top level must be a JSON object, got {type(obj).__name__}")
    if "supportlonglong" not in obj:
        raise _fail(source, "missing required key 'supportlonglong'")
    models_raw = obj.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        raise _fail(source, "'models' must be a non-empty list")
    models = tuple(_parse_model(m, i, base_dir, source) for i, m in enumerate(models_raw))
    # top-level fuse_embedding_table (HPS default false); a model opts out with its own
    # fuse_embedding_table: false (default true), inference_utils.cpp L376-381, L635-647
    if _as_bool(obj.get("fuse_embedding_table", False), f"{source}: fuse_embedding_table"):
        models = tuple(
            _fused(m, f"{source}: model {m.model!r}.fuse_embedding_table") for m in models
        )
    seen = set()
    for m in models:
        if m.model in seen:
            raise _fail(source, f"model {m.model!r} appears twice in 'models'")
        seen.add(m.model)
    vol_section = (
        _section(obj, "volatile_db", source) if obj.get("volatile_db") is not None else None
    )
    vol = _parse_volatile(vol_section, base_dir, source)
    per = _parse_persistent(_section(obj, "persistent_db", source), base_dir, source)
    upd = _parse_update_source(_section(obj, "update_source", source), base_dir, source)
    if vol_section is not None and "type" not in vol_section and per.type == "disabled":
        raise _fail(
            f"{source}: volatile_db",
            "has no 'type': HPS reads that as disabled, and with persistent_db disabled too no "
            'tier would hold the embeddings: add "type": "parallel_hash_map" (the node-local '
            'store) or "redis_cluster"',
        )
    _check_tiers(vol, per, upd, source)
    models = tuple(
        dataclasses.replace(m, volatile_db=vol, persistent_db=per, update_source=upd)
        for m in models
    )
    return PSConfig(
        path=source,
        supportlonglong=_as_bool(obj["supportlonglong"], f"{source}: supportlonglong"),
        models=models,
        volatile_db=vol,
        persistent_db=per,
        update_source=upd,
        unknown_keys=tuple(sorted(k for k in obj if k not in _TOP_KEYS_KNOWN)),
    )


def load_ps_config(path: str) -> PSConfig:
    """Read and validate a ps.json file; relative paths resolve against its directory."""
    path = os.path.abspath(path)
    obj = read_json(path, "ps.json", ConfigFileError)
    return parse_ps_config(obj, os.path.dirname(path), path)


def find_ps_config(model_dir: str, parameter: Optional[str]) -> str:
    """Where a model's ps.json is.

    Args:
        model_dir: the model's directory in the Triton model repository.
        parameter: the ``ps`` parameter of its config.pbtxt, if set; a relative value
            resolves against ``model_dir`` (the directory of the config that names it).

    Returns the path of ``parameter`` if given, else ``<repository root>/ps.json``.
    """
    if parameter:
        # not None: model_relative_path returns None only for an empty parameter
        return cast(str, model_relative_path(model_dir, parameter))
    return os.path.join(os.path.dirname(os.path.abspath(model_dir)), "ps.json")


def config_warnings(source: str, params: ModelParams) -> Tuple[str, ...]:
    """What a backend logs at load about a model's ps.json: unknown keys (ignored) and
    tier settings that do nothing here."""
    out = [
        f"{source}: model '{params.model}': unknown key '{k}' ignored" for k in params.unknown_keys
    ]
    out += list(params.notes)
    out += [
        f"{source}: model '{params.model}': '{k}' has no effect on this node: {meaning}"
        for k, meaning in GPU_ONLY_OPTIONS.items()
        if k in params.extra
    ]
    if params.embedding_cache_type in (EmbeddingCacheType.UVM, EmbeddingCacheType.STOCHASTIC):
        served = "static (every miss fetched)" if params.embedding_cache_type.exact else "dynamic"
        out.append(
            f"{source}: model '{params.model}': embedding_cache_type "
            f"'{params.embedding_cache_type}' is served as {served}"
        )
    for section, keys in (
        ("volatile_db", params.volatile_db.unknown_keys),
        ("persistent_db", params.persistent_db.unknown_keys),
        ("update_source", params.update_source.unknown_keys),
    ):
        out += [f"{source}: {section}: unknown key '{k}' ignored" for k in keys]
    out += [
        f"{source}: volatile_db: {s} ignored: the node-local store of the hash map types "
        "holds whole tables"
        for s in params.volatile_db.ignored_settings()
    ]
    return tuple(out)
