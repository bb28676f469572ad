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

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

from triton_rec.errors import ConfigError

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
}
_MODEL_KEYS_KNOWN = _MODEL_KEYS_USED | {
    "num_of_worker_buffer_in_pool",
    "num_of_refresher_buffer_in_pool",
    "embedding_cache_type",
    "label_dim",
    "slot_num",
    "maxnum_des_feature_per_sample",
    "use_static_table",
    "use_context_stream",
    "fuse_embedding_table",
    "sparse_model_files",
    "freeze_sparse",
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
#: Cache policies a model may choose with the ``cache_policy`` key (our extension).
CACHE_POLICIES = ("lru", "tinylfu")

# HugeCTR's rule for model and table names (they end up in topic names and paths).
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,120}")
_TOP_KEYS_KNOWN = {"supportlonglong", "volatile_db", "persistent_db", "update_source", "models"}


def _fail(where: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {msg}")


def _as_bool(v: Any, where: str) -> bool:
    if isinstance(v, bool):
        return v
    # Upstream files sometimes spell booleans as strings.
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise _fail(where, f"expected a boolean, got {v!r}")


def _as_int(v: Any, where: str, minimum: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise _fail(where, f"expected an integer, got {v!r}")
    v = int(v)
    if minimum is not None and v < minimum:
        raise _fail(where, f"must be >= {minimum}, got {v}")
    return v


def _as_float(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail(where, f"expected a number, got {v!r}")
    return float(v)


def _as_list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise _fail(where, f"expected a list, got {type(v).__name__}")
    return v


def _resolve(path: str, base_dir: str) -> str:
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))


@dataclass(frozen=True)
class TableParams:
    """One embedding table of a model.

    Args:
        name: table name (``embedding_table_names[i]``).
        sparse_file: resolved path of the HugeCTR sparse directory or ``.npz`` file.
        vec_size: floats per embedding vector.
        max_keys_per_sample: ``maxnum_catfeature_query_per_table_per_sample[i]``.
        default_value: value of every element of a vector whose key is unknown.
    """

    name: str
    sparse_file: str
    vec_size: int
    max_keys_per_sample: int
    default_value: float = 0.0


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
        init_ec: fill the cache from the table when it is created.
        refresh_interval: seconds between cache refreshes (0 = never).
        refresh_delay: seconds before the first refresh.
        cache_refresh_percentage_per_iteration: fraction of cached rows per refresh.
        extra: documented keys this version does not act on, as given.
        unknown_keys: keys that nobody documented (kept for warnings).
    """

    model: str
    tables: Tuple[TableParams, ...]
    max_batch_size: int
    dense_file: Optional[str] = None
    network_file: Optional[str] = None
    non_trainable_params_file: Optional[str] = None
    deployed_device_list: Tuple[int, ...] = (0,)
    gpucache: bool = True
    gpucacheper: float = 0.2
    hit_rate_threshold: float = 0.9
    cache_policy: str = "lru"
    cache_ways: int = 8
    init_ec: bool = False
    refresh_interval: float = 0.0
    refresh_delay: float = 0.0
    cache_refresh_percentage_per_iteration: float = 0.1
    extra: Dict[str, Any] = field(default_factory=dict)
    unknown_keys: Tuple[str, ...] = ()

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    @property
    def keys_per_sample(self) -> int:
        """Sum over tables of the most keys one sample may hold."""
        return sum(t.max_keys_per_sample for t in self.tables)


@dataclass(frozen=True)
class PSConfig:
    """A parsed ps.json.

    Args:
        path: the file it came from ("<memory>" when parsed from a dict).
        supportlonglong: whether keys are 64-bit (``KEYS`` is always INT64 here).
        models: the model entries, by order of appearance.
        volatile_db, persistent_db, update_source: the tier sections as given.
        unknown_keys: undocumented top-level keys.
    """

    path: str
    supportlonglong: bool
    models: Tuple[ModelParams, ...]
    volatile_db: Dict[str, Any] = field(default_factory=dict)
    persistent_db: Dict[str, Any] = field(default_factory=dict)
    update_source: Dict[str, Any] = field(default_factory=dict)
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
        raise _fail(
            where, f"'{key}' has {len(values)} entries but 'sparse_files' names {n} tables"
        )
    return values


def _parse_model(obj: Any, index: int, base_dir: str, source: str) -> ModelParams:
    where = f"{source}: models[{index}]"
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

    vec = [
        _as_int(v, f"{where}.embedding_vecsize_per_table[{i}]", 1)
        for i, v in enumerate(_per_table(obj, "embedding_vecsize_per_table", n, where))
    ]
    maxnum = [
        _as_int(v, f"{where}.maxnum_catfeature_query_per_table_per_sample[{i}]", 1)
        for i, v in enumerate(
            _per_table(obj, "maxnum_catfeature_query_per_table_per_sample", n, where)
        )
    ]
    defaults = [
        _as_float(v, f"{where}.default_value_for_each_table[{i}]")
        for i, v in enumerate(_per_table(obj, "default_value_for_each_table", n, where, [0.0] * n))
    ]
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

    if "max_batch_size" not in obj:
        raise _fail(where, "missing required key 'max_batch_size'")
    max_batch = _as_int(obj["max_batch_size"], f"{where}.max_batch_size", 1)

    devices = tuple(
        _as_int(d, f"{where}.deployed_device_list[{i}]", 0)
        for i, d in enumerate(_as_list(obj.get("deployed_device_list", [0]), where))
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
        )
        for i in range(n)
    )
    gpucacheper = _as_float(obj.get("gpucacheper", 0.2), f"{where}.gpucacheper")
    if not 0.0 <= gpucacheper <= 1.0:
        raise _fail(where, f"'gpucacheper' must be within [0, 1], got {gpucacheper}")
    policy = obj.get("cache_policy", "lru")
    if policy not in CACHE_POLICIES:
        raise _fail(where, f"'cache_policy' must be one of {list(CACHE_POLICIES)}, got {policy!r}")
    refresh_fraction = _as_float(
        obj.get("cache_refresh_percentage_per_iteration", 0.1),
        f"{where}.cache_refresh_percentage_per_iteration",
    )
    if not 0.0 <= refresh_fraction <= 1.0:
        raise _fail(
            where,
            f"'cache_refresh_percentage_per_iteration' must be within [0, 1], got {refresh_fraction}",
        )
    seconds = {}
    for key in ("refresh_interval", "refresh_delay"):
        seconds[key] = _as_float(obj.get(key, 0.0), f"{where}.{key}")
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
        gpucache=_as_bool(obj.get("gpucache", True), f"{where}.gpucache"),
        gpucacheper=gpucacheper,
        hit_rate_threshold=_as_float(
            obj.get("hit_rate_threshold", 0.9), f"{where}.hit_rate_threshold"
        ),
        cache_policy=policy,
        cache_ways=_as_int(obj.get("cache_ways", 8), f"{where}.cache_ways", 1),
        init_ec=_as_bool(obj.get("init_ec", False), f"{where}.init_ec"),
        refresh_interval=seconds["refresh_interval"],
        refresh_delay=seconds["refresh_delay"],
        cache_refresh_percentage_per_iteration=refresh_fraction,
        extra={k: v for k, v in obj.items() if k in _MODEL_KEYS_KNOWN - _MODEL_KEYS_USED},
        unknown_keys=tuple(sorted(k for k in obj if k not in _MODEL_KEYS_KNOWN)),
    )


def _section(obj: dict, key: str, source: str) -> Dict[str, Any]:
    v = obj.get(key, {})
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _fail(source, f"'{key}' must be an object, got {type(v).__name__}")
    return dict(v)


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
    seen = set()
    for m in models:
        if m.model in seen:
            raise _fail(source, f"model {m.model!r} appears twice in 'models'")
        seen.add(m.model)
    return PSConfig(
        path=source,
        supportlonglong=_as_bool(obj["supportlonglong"], f"{source}: supportlonglong"),
        models=models,
        volatile_db=_section(obj, "volatile_db", source),
        persistent_db=_section(obj, "persistent_db", source),
        update_source=_section(obj, "update_source", source),
        unknown_keys=tuple(sorted(k for k in obj if k not in _TOP_KEYS_KNOWN)),
    )


def load_ps_config(path: str) -> PSConfig:
    """Read and validate a ps.json file; relative paths resolve against its directory."""
    path = os.path.abspath(path)
    try:
        with open(path, "r", encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: ps.json not found") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
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
        return _resolve(parameter, os.path.abspath(model_dir))
    return os.path.join(os.path.dirname(os.path.abspath(model_dir)), "ps.json")

