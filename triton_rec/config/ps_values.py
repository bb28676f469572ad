"""The values of a ps.json: its limits, its enumerations, names, and the checks of one
value (a boolean, an integer within limits, a choice...) with errors naming where it is.

Part of :mod:`triton_rec.config.ps_json` (the one parser of the file), which re-exports
the public names.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
from typing import Any, Dict, Optional, Tuple

from triton_rec import _native
from triton_rec.errors import ConfigError

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


def field_defaults(cls) -> Dict[str, Any]:
    """``{field name: default}`` of a config dataclass, for the fields with a plain default
    (not those with a ``default_factory``): the one place a ps.json default is written
    is its dataclass field; the parser and other users read it from here."""
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


def fail(where: str, msg: str) -> ConfigError:
    """The ConfigError ``<where>: <msg>`` (for the caller to raise)."""
    return ConfigError(f"{where}: {msg}")


def as_bool(v: Any, where: str) -> bool:
    """A boolean (``"true"``/``"false"`` strings too, as upstream files spell them)."""
    if isinstance(v, bool):
        return v
    # Upstream files sometimes spell booleans as strings.
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise fail(where, f"expected a boolean, got {v!r}")


def as_int(v: Any, where: str, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """An integer (an integral float too) within ``[minimum, maximum]``."""
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (isinstance(v, float) and not math.isfinite(v))
        or int(v) != v
    ):
        raise fail(where, f"expected an integer, got {v!r}")
    v = int(v)
    if maximum is not None and (v > maximum or (minimum is not None and v < minimum)):
        raise fail(where, f"must be within [{minimum}, {maximum}], got {v}")
    if minimum is not None and v < minimum:
        raise fail(where, f"must be >= {minimum}, got {v}")
    return v


def as_float(v: Any, where: str) -> float:
    """A finite number, as a float."""
    # NaN/Infinity are not JSON, but 1e999 decodes to inf: refused like any non-number.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise fail(where, f"expected a finite number, got {v!r}")
    return float(v)


def as_list(v: Any, where: str) -> list:
    """A JSON array."""
    if not isinstance(v, list):
        raise fail(where, f"expected a list, got {type(v).__name__}")
    return v


def resolve_path(path: str, base_dir: str) -> str:
    """``path``, or ``base_dir/path`` when it is relative."""
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))


def model_relative_path(model_dir: str, parameter: Optional[str]) -> Optional[str]:
    """A path given by a config.pbtxt parameter (``ps``, ``store_dir``, ``config``): a
    relative value resolves against the model directory (the directory of the config
    that names it), never against the server's working directory. None stays None."""
    if not parameter:
        return None
    return resolve_path(parameter, os.path.abspath(model_dir))


def choice(v: Any, choices, where: str) -> str:
    """One of ``choices`` (matched without regard to case; a dict maps a spelling to its
    meaning)."""
    if not isinstance(v, str) or v.lower() not in choices:
        raise fail(where, f"must be one of {sorted(set(choices))}, got {v!r}")
    return choices[v.lower()] if isinstance(choices, dict) else v.lower()


def regex_list(v: Any, where: str) -> Tuple[str, ...]:
    """A list of valid regular expressions."""
    items = as_list(v, where)
    for i, f in enumerate(items):
        if not isinstance(f, str):
            raise fail(f"{where}[{i}]", f"expected a regular expression string, got {f!r}")
        try:
            re.compile(f)
        except re.error as e:
            raise fail(f"{where}[{i}]", f"not a valid regular expression: {e}") from e
    return tuple(items)
