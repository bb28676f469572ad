"""The HPS update message and topic names.

Message format (HPS ``KafkaMessageSink``; see docs/upstream-notes.md, "Online updates"):

- ``uint32`` magic ``0x52544348`` (the bytes ``"HCTR"``), little-endian;
- ``uint32`` value size in bytes (``4 * vec_size`` for float32 vectors), per message;
- then pairs of (key: int64 little-endian, value: ``value size`` bytes), nothing else.

A message with no pair is a beacon: it carries no update and its value size means
nothing (HPS sends ``sizeof(size_t)``). One message holds rows of one table; the table
is named by the topic ``hps_et.<model>.<table>``.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

import numpy as np

from triton_rec.config.ps_json import NAME_PATTERN
from triton_rec.errors import UpdateMessageError
from triton_rec.storage.backing_store import tier_table_name

MAGIC = 0x52544348  # b"HCTR" read as a little-endian uint32
HEADER_SIZE = 8  # magic + value size
_HEADER = np.dtype([("magic", "<u4"), ("value_size", "<u4")])
_TOPIC_RE = re.compile(rf"hps_et\.({NAME_PATTERN})\.({NAME_PATTERN})")


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


def check_update_rows(keys, vectors) -> Tuple[np.ndarray, np.ndarray]:
    """The rows a producer publishes, checked: ``keys`` 1-D integers in the int64 range,
    ``vectors`` ``[len(keys), D >= 1]`` floats (ValueError naming what is wrong otherwise).
    Returns them as arrays (keys not yet converted, so a caller can chunk a large mapped
    table without copying it whole)."""
    keys = np.asarray(keys)
    vectors = np.asarray(vectors)
    if keys.ndim != 1 or not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"keys must be a 1-D integer array, got {keys.dtype} {keys.shape}")
    if keys.dtype == np.uint64 and keys.size and int(keys.max()) >= 2**63:
        raise ValueError("keys must fit in int64")
    if (
        vectors.ndim != 2
        or not np.issubdtype(vectors.dtype, np.floating)
        or vectors.shape[0] != keys.shape[0]
        or vectors.shape[1] < 1
    ):
        raise ValueError(
            f"vectors must be floats [{keys.shape[0]}, D >= 1], got {vectors.dtype} {vectors.shape}"
        )
    return keys, vectors


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
        raise ValueError(
            f"vectors must be float32 [{keys.shape[0]}, D], got {vectors.dtype} {vectors.shape}"
        )
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
        raise UpdateMessageError(
            f"value size {value_size} bytes is not a positive multiple of 4 (float32 vectors)"
        )
    d = value_size // 4
    if vec_size is not None and d != vec_size:
        raise UpdateMessageError(
            f"value size {value_size} bytes = {d} floats, the table has vec_size {vec_size}"
        )
    pair = 8 + value_size
    if body % pair:
        raise UpdateMessageError(
            f"body of {body} bytes is not a whole number of {pair}-byte key/value pairs"
        )
    pairs = np.frombuffer(data, dtype=[("k", "<i8"), ("v", "<f4", (d,))], offset=HEADER_SIZE)
    return pairs["k"].astype(np.int64), np.ascontiguousarray(pairs["v"], dtype=np.float32)
