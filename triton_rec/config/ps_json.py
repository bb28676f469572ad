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

The file's parts: :mod:`triton_rec.config.ps_values` (limits, enumerations, the checks of
one value), :mod:`triton_rec.config.ps_tiers` (the tier sections); here the model entries
and the file. Every public name of those modules is importable from here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from triton_rec.config.model_files import ConfigFileError, read_json
from triton_rec.config.ps_tiers import (
    ON_UNAVAILABLE,
    OVERFLOW_POLICIES,
    OVERFLOW_POLICY_NAMES,
    PERSISTENT_TYPES,
    UPDATE_SOURCE_TYPES,
    VOLATILE_TYPES,
    PersistentDBParams,
    RedisParams,
    UpdateSourceParams,
    VolatileDBParams,
    check_tiers,
    default_num_partitions,
    parse_persistent,
    parse_update_source,
    parse_volatile,
)
from triton_rec.config.ps_values import (
    CACHE_POLICIES,
    MAX_BATCH_SIZE,
    MAX_CACHE_WAYS,
    MAX_KAFKA_MESSAGE_BYTES,
    MAX_KEYS_PER_REQUEST,
    MAX_TIER_BATCH_SIZE,
    MAX_TIER_COUNT,
    MAX_TIER_MS,
    MAX_VEC_SIZE,
    NAME_PATTERN,
    NAME_RE,
    CachePolicy,
    EmbeddingCacheType,
    OverflowPolicy,
    StrEnum,
    as_bool,
    as_float,
    as_int,
    as_list,
    choice,
    fail,
    field_defaults,
    model_relative_path,
    resolve_path,
)
from triton_rec.errors import ConfigError
from triton_rec.precision import DEFAULT_PRECISION, PRECISIONS

__all__ = [
    "CACHE_POLICIES",
    "GPU_ONLY_OPTIONS",
    "MAX_BATCH_SIZE",
    "MAX_CACHE_WAYS",
    "MAX_KAFKA_MESSAGE_BYTES",
    "MAX_KEYS_PER_REQUEST",
    "MAX_TIER_BATCH_SIZE",
    "MAX_TIER_COUNT",
    "MAX_TIER_MS",
    "MAX_VEC_SIZE",
    "MODEL_DEFAULTS",
    "NAME_PATTERN",
    "NAME_RE",
    "ON_UNAVAILABLE",
    "OVERFLOW_POLICIES",
    "OVERFLOW_POLICY_NAMES",
    "PERSISTENT_TYPES",
    "TABLE_DEFAULTS",
    "UPDATE_SOURCE_TYPES",
    "VOLATILE_TYPES",
    "CachePolicy",
    "EmbeddingCacheType",
    "ModelParams",
    "OverflowPolicy",
    "PSConfig",
    "PersistentDBParams",
    "RedisParams",
    "StrEnum",
    "TableParams",
    "UpdateSourceParams",
    "VolatileDBParams",
    "config_warnings",
    "default_num_partitions",
    "field_defaults",
    "find_ps_config",
    "fused_table_names",
    "load_ps_config",
    "model_relative_path",
    "parse_ps_config",
]

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
    "whole_table_max_bytes",  # our extension (deployment.device_table_mode)
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
    "use_mixed_precision": "fp16 dense layers on the GPU; here the config.pbtxt parameter "
    "dense_math (fp16, tf32) opts a KIND_GPU instance in",
    "scaler": "the loss scaler of mixed precision; unused at inference here",
}
_TOP_KEYS_KNOWN = {
    "supportlonglong",
    "volatile_db",
    "persistent_db",
    "update_source",
    "models",
    "fuse_embedding_table",
}


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
        whole_table_max_bytes: on a GPU, a table of a ``dynamic`` cache whose whole copy
            (index and rows) takes at most this many bytes is held whole on the device, as a
            ``static`` table, instead of in a cache of ``gpucacheper`` of its rows (our
            extension; 0, the default, never: HPS's behaviour).
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
    whole_table_max_bytes: int = 0
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
            raise fail(where, f"missing required key '{key}'")
        return list(default)
    values = as_list(obj[key], f"{where}.{key}")
    if len(values) != n:
        raise fail(where, f"'{key}' has {len(values)} entries but 'sparse_files' names {n} tables")
    return values


def _parse_model(obj: Any, index: int, base_dir: str, source: str) -> ModelParams:  # noqa: C901  (flat per-key checks)
    where = f"{source}: models[{index}]"
    dft = MODEL_DEFAULTS
    if not isinstance(obj, dict):
        raise fail(where, f"expected an object, got {type(obj).__name__}")
    if "model" not in obj or not isinstance(obj["model"], str) or not obj["model"]:
        raise fail(where, "missing required key 'model' (a non-empty string)")
    name = obj["model"]
    where = f"{source}: model {name!r}"
    if not NAME_RE.fullmatch(name):
        raise fail(where, "model names may only hold letters, digits, '_' and '-' (1-120)")

    if "sparse_files" not in obj:
        raise fail(where, "missing required key 'sparse_files'")
    sparse = as_list(obj["sparse_files"], f"{where}.sparse_files")
    if not sparse or not all(isinstance(s, str) and s for s in sparse):
        raise fail(where, "'sparse_files' must be a non-empty list of paths")
    n = len(sparse)

    names = _per_table(
        obj, "embedding_table_names", n, where, [f"sparse_embedding{i}" for i in range(n)]
    )
    if not all(isinstance(s, str) and NAME_RE.fullmatch(s) for s in names):
        raise fail(
            where,
            f"'embedding_table_names' must be letters, digits, '_' or '-' (1-120): {names}",
        )
    if len(set(names)) != n:
        raise fail(where, f"'embedding_table_names' has duplicates: {names}")

    def table_key(key: str, i: int) -> str:
        return f"{where}: table {names[i]!r}: {key}[{i}]"

    vec = [
        as_int(v, table_key("embedding_vecsize_per_table", i), 1, MAX_VEC_SIZE)
        for i, v in enumerate(_per_table(obj, "embedding_vecsize_per_table", n, where))
    ]
    maxnum = [
        as_int(
            v, table_key("maxnum_catfeature_query_per_table_per_sample", i), 1, MAX_KEYS_PER_REQUEST
        )
        for i, v in enumerate(
            _per_table(obj, "maxnum_catfeature_query_per_table_per_sample", n, where)
        )
    ]
    precisions = [
        choice(v, {p: p for p in PRECISIONS}, table_key("embedding_precision", i))
        for i, v in enumerate(
            _per_table(obj, "embedding_precision", n, where, [DEFAULT_PRECISION] * n)
        )
    ]
    defaults, notes = _default_values(obj, n, where, table_key)
    max_batch = as_int(
        obj.get("max_batch_size", dft["max_batch_size"]),
        f"{where}.max_batch_size",
        1,
        MAX_BATCH_SIZE,
    )
    if max_batch * sum(maxnum) > MAX_KEYS_PER_REQUEST:
        raise fail(
            f"{where}.max_batch_size",
            f"{max_batch} samples x {sum(maxnum)} keys per sample "
            f"(maxnum_catfeature_query_per_table_per_sample) = {max_batch * sum(maxnum)} "
            f"keys per request, more than the limit of {MAX_KEYS_PER_REQUEST}",
        )

    devices = tuple(
        as_int(d, f"{where}.deployed_device_list[{i}]", 0)
        for i, d in enumerate(
            as_list(obj.get("deployed_device_list", list(dft["deployed_device_list"])), where)
        )
    ) or (0,)

    def opt_path(key: str) -> Optional[str]:
        v = obj.get(key)
        if v is None or v == "":
            return None
        if not isinstance(v, str):
            raise fail(where, f"'{key}' must be a path string, got {v!r}")
        return resolve_path(v, base_dir)

    tables = tuple(
        TableParams(
            name=names[i],
            sparse_file=resolve_path(sparse[i], base_dir),
            vec_size=vec[i],
            max_keys_per_sample=maxnum[i],
            default_value=defaults[i],
            precision=precisions[i],
        )
        for i in range(n)
    )
    gpucacheper = as_float(obj.get("gpucacheper", dft["gpucacheper"]), f"{where}.gpucacheper")
    if not 0.0 <= gpucacheper <= 1.0:
        raise fail(where, f"'gpucacheper' must be within [0, 1], got {gpucacheper}")
    policy = obj.get("cache_policy", dft["cache_policy"])
    if policy not in CACHE_POLICIES:
        raise fail(where, f"'cache_policy' must be one of {list(CACHE_POLICIES)}, got {policy!r}")
    refresh_fraction = as_float(
        obj.get(
            "cache_refresh_percentage_per_iteration", dft["cache_refresh_percentage_per_iteration"]
        ),
        f"{where}.cache_refresh_percentage_per_iteration",
    )
    if not 0.0 <= refresh_fraction <= 1.0:
        raise fail(
            where,
            "'cache_refresh_percentage_per_iteration' must be within [0, 1], "
            f"got {refresh_fraction}",
        )
    cache_type = EmbeddingCacheType(
        choice(
            obj.get("embedding_cache_type", dft["embedding_cache_type"]),
            {t.value: t.value for t in EmbeddingCacheType},
            f"{where}.embedding_cache_type",
        )
    )
    if as_bool(obj.get("use_static_table", False), f"{where}.use_static_table"):
        cache_type = EmbeddingCacheType.STATIC  # HPS: use_static_table forces static (L656-658)
    seconds = {}
    for key in ("refresh_interval", "refresh_delay"):
        seconds[key] = as_float(obj.get(key, dft[key]), f"{where}.{key}")
        if seconds[key] < 0:
            raise fail(where, f"'{key}' must be >= 0 seconds, got {seconds[key]}")
    return ModelParams(
        model=name,
        tables=tables,
        max_batch_size=max_batch,
        dense_file=opt_path("dense_file"),
        network_file=opt_path("network_file"),
        non_trainable_params_file=opt_path("non_trainable_params_file"),
        deployed_device_list=devices,
        gpucache=as_bool(obj.get("gpucache", dft["gpucache"]), f"{where}.gpucache"),
        gpucacheper=gpucacheper,
        hit_rate_threshold=as_float(
            obj.get("hit_rate_threshold", dft["hit_rate_threshold"]), f"{where}.hit_rate_threshold"
        ),
        cache_policy=CachePolicy(policy),
        cache_ways=as_int(
            obj.get("cache_ways", dft["cache_ways"]), f"{where}.cache_ways", 1, MAX_CACHE_WAYS
        ),
        whole_table_max_bytes=as_int(
            obj.get("whole_table_max_bytes", dft["whole_table_max_bytes"]),
            f"{where}.whole_table_max_bytes",
            0,
        ),
        init_ec=as_bool(obj.get("init_ec", dft["init_ec"]), f"{where}.init_ec"),
        refresh_interval=seconds["refresh_interval"],
        refresh_delay=seconds["refresh_delay"],
        cache_refresh_percentage_per_iteration=refresh_fraction,
        freeze_sparse=as_bool(
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
    given = as_list(obj[key], f"{where}.{key}")
    values = [as_float(v, table_key(key, i)) for i, v in enumerate(given[:n])]
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
        raise fail(source, f"'{key}' must be an object, got {type(v).__name__}")
    return dict(v)


def _fused(m: ModelParams, where: str) -> ModelParams:
    if not as_bool(m.extra.get("fuse_embedding_table", True), where):
        return m
    names = fused_table_names([t.vec_size for t in m.tables])
    precision_of: Dict[str, str] = {}
    for t, f in zip(m.tables, names):
        if precision_of.setdefault(f, t.precision) != t.precision:
            raise fail(
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
        raise fail(source, f"top level must be a JSON object, got {type(obj).__name__}")
    if "supportlonglong" not in obj:
        raise fail(source, "missing required key 'supportlonglong'")
    models_raw = obj.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        raise fail(source, "'models' must be a non-empty list")
    models = tuple(_parse_model(m, i, base_dir, source) for i, m in enumerate(models_raw))
    # top-level fuse_embedding_table (HPS default false); a model opts out with its own
    # fuse_embedding_table: false (default true), inference_utils.cpp L376-381, L635-647
    if as_bool(obj.get("fuse_embedding_table", False), f"{source}: fuse_embedding_table"):
        models = tuple(
            _fused(m, f"{source}: model {m.model!r}.fuse_embedding_table") for m in models
        )
    seen = set()
    for m in models:
        if m.model in seen:
            raise fail(source, f"model {m.model!r} appears twice in 'models'")
        seen.add(m.model)
    vol_section = (
        _section(obj, "volatile_db", source) if obj.get("volatile_db") is not None else None
    )
    vol = parse_volatile(vol_section, base_dir, source)
    per = parse_persistent(_section(obj, "persistent_db", source), base_dir, source)
    upd = parse_update_source(_section(obj, "update_source", source), base_dir, source)
    if vol_section is not None and "type" not in vol_section and per.type == "disabled":
        raise fail(
            f"{source}: volatile_db",
            "has no 'type': HPS reads that as disabled, and with persistent_db disabled too no "
            'tier would hold the embeddings: add "type": "parallel_hash_map" (the node-local '
            'store) or "redis_cluster"',
        )
    check_tiers(vol, per, upd, source)
    models = tuple(
        dataclasses.replace(m, volatile_db=vol, persistent_db=per, update_source=upd)
        for m in models
    )
    return PSConfig(
        path=source,
        supportlonglong=as_bool(obj["supportlonglong"], f"{source}: supportlonglong"),
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
