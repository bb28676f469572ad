"""The layout file of the node-local store (:mod:`triton_rec.storage.node_store`): its
format, its header, and mapping one read-only (checked as ``open_table`` says).

Layout file, format version 2
-----------------------------
Little-endian; every section starts at a multiple of 4096 bytes (zero padding between)::

    offset size  header field
    0      8     magic b"TRECTBL\\0"
    8      4     uint32 format version (2; version 1 files, without a precision, are fp32)
    12     4     uint32 header size (4096)
    16     8     uint64 N, rows
    24     8     uint64 D, vec_size (values per decoded row)
    32     8     uint64 capacity, index slots (= _native.index_capacity(N))
    40     8     uint64 keys_offset    = 4096
    48     8     uint64 vectors_offset = keys_offset + 8 N, rounded up to 4096
    56     8     uint64 index_offset   = vectors_offset + R N, rounded up to 4096, where R
                       is the bytes of one encoded row (4 D for fp32; RowCodec.row_bytes)
    64     8     uint64 file_size      = index_offset + 16 capacity (the complete file)
    72     8     uint64 HASH_CHUNK used by the digests
    80     8     int64  creation time, ns since the epoch
    88     32    content digest (raw bytes)
    120    32    index digest
    152    16    fingerprint of the source it was converted from
    168    2     uint16 length of the source path below
    170    2048  source path, UTF-8 (for humans; truncated)
    2224   4     uint32 precision code (RowCodec.code: 0 fp32, 1 fp16, 2 int8), version 2
    4064   32    blake2b-256 (digest_size=32, no key/person) of header bytes [0, 4064)

    keys_offset     int64   [N]            keys, in the source's row order
    vectors_offset  rows [N]               row i belongs to keys[i]: float32 [N, D] for fp32,
                                           the RowCodec row array otherwise
                                           (triton_rec/precision.py)
    index_offset    int64   [capacity, 2]  exactly _native.build_index(keys)
                                           (persisted layout: src/native/hash_index.hpp)
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.errors import CorruptLayoutError, ModelFileError
from triton_rec.precision import DEFAULT_PRECISION, RowCodec

FORMAT_VERSION = 2
#: older versions this one still reads (version 1: no precision field, always fp32)
_READS_VERSIONS = (1, 2)
MAGIC = b"TRECTBL\0"
ALIGN = 4096
HEADER_SIZE = 4096
HASH_CHUNK = 64 << 20  # bytes per digest leaf, and per write
SUFFIX = ".tbl"

# Fixed header fields (see the module docstring); the checksum sits at _CHECKSUM_AT.
_HDR = struct.Struct("<8sIIQQQQQQQQq32s32s16sH")
_SOURCE_AT = _HDR.size  # 170
_SOURCE_MAX = 2048
_PRECISION_AT = 2224  # uint32 precision code (format version 2)
_CHECKSUM_AT = HEADER_SIZE - 32
_SPOT_CHECKS = 16


@dataclass(frozen=True)
class LayoutHeader:
    """The parsed header of a layout file (digests and fingerprint as hex)."""

    version: int
    n_rows: int
    vec_size: int
    capacity: int
    keys_offset: int
    vectors_offset: int
    index_offset: int
    file_size: int
    hash_chunk: int
    created_ns: int
    content_digest: str
    index_digest: str
    fingerprint: str
    source: str
    precision: str = DEFAULT_PRECISION

    @property
    def codec(self) -> RowCodec:
        """How the rows of the layout are encoded."""
        return RowCodec(self.precision, self.vec_size)

    @property
    def data_bytes(self) -> int:
        """Bytes of keys + rows + index (what a conversion writes, without padding)."""
        return 8 * self.n_rows + self.codec.row_bytes * self.n_rows + 16 * self.capacity


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout_offsets(n: int, codec: RowCodec, capacity: int) -> Tuple[int, int, int, int]:
    """``(keys, vectors, index offsets, file size)`` of a layout of this shape."""
    keys_off = HEADER_SIZE
    vec_off = _align(keys_off + 8 * n)
    idx_off = _align(vec_off + codec.row_bytes * n)
    return keys_off, vec_off, idx_off, idx_off + 16 * capacity


def pack_header(
    n: int,
    codec: RowCodec,
    capacity: int,
    content: str,
    index: str,
    fingerprint: str,
    source: str,
) -> bytes:
    """The header of a layout (its checksum included), as the file holds it."""
    d = codec.dim
    ko, vo, io, size = layout_offsets(n, codec, capacity)
    src = os.fsencode(source)[:_SOURCE_MAX]
    buf = bytearray(HEADER_SIZE)
    _HDR.pack_into(
        buf,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        n,
        d,
        capacity,
        ko,
        vo,
        io,
        size,
        HASH_CHUNK,
        time.time_ns(),
        bytes.fromhex(content),
        bytes.fromhex(index),
        bytes.fromhex(fingerprint),
        len(src),
    )
    buf[_SOURCE_AT : _SOURCE_AT + len(src)] = src
    struct.pack_into("<I", buf, _PRECISION_AT, codec.code)
    buf[_CHECKSUM_AT:] = hashlib.blake2b(bytes(buf[:_CHECKSUM_AT]), digest_size=32).digest()
    return bytes(buf)


def _parse_header(path: str, raw: bytes) -> LayoutHeader:
    bad = lambda problem: CorruptLayoutError(path, problem)  # noqa: E731
    if len(raw) < HEADER_SIZE:
        raise bad(f"truncated: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header")
    f = _HDR.unpack_from(raw)
    if f[0] != MAGIC:
        raise bad("not a triton-rec table layout (bad magic)")
    if f[1] not in _READS_VERSIONS:
        raise bad(f"layout format version {f[1]}, this version reads {list(_READS_VERSIONS)}")
    checksum = hashlib.blake2b(raw[:_CHECKSUM_AT], digest_size=32).digest()
    if checksum != raw[_CHECKSUM_AT:HEADER_SIZE]:
        raise bad("header checksum mismatch (corrupt header)")
    _, version, hsize, n, d, cap, ko, vo, io, size, chunk, created, cd, ix, fp, slen = f
    if d < 1 or n > (1 << 60) or cap != _native.index_capacity(n):
        raise bad(f"impossible shape: {n} rows x {d}, index capacity {cap}")
    code = struct.unpack_from("<I", raw, _PRECISION_AT)[0] if version >= 2 else 0
    try:
        codec = RowCodec.from_code(code, d)
    except ValueError as e:
        raise bad(str(e)) from None
    if hsize != HEADER_SIZE or (ko, vo, io, size) != layout_offsets(n, codec, cap):
        raise bad("section offsets do not follow from the table shape")
    source = raw[_SOURCE_AT : _SOURCE_AT + min(slen, _SOURCE_MAX)].decode("utf-8", "replace")
    return LayoutHeader(
        version,
        n,
        d,
        cap,
        ko,
        vo,
        io,
        size,
        chunk,
        created,
        cd.hex(),
        ix.hex(),
        fp.hex(),
        source,
        codec.precision,
    )


def read_header(path: str) -> LayoutHeader:
    """Parse and check the header of a layout file (not the data).

    Raises:
        ModelFileError: the file cannot be read; CorruptLayoutError: the header is bad.
    """
    with _open_ro(path) as fd:
        return _parse_header(path, os.pread(fd, HEADER_SIZE, 0))


@contextlib.contextmanager
def _open_ro(path: str) -> Iterator[int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ModelFileError(path, "table layout does not exist") from None
    except OSError as e:
        raise ModelFileError(path, f"cannot open table layout ({e.strerror})") from e
    try:
        yield fd
    finally:
        os.close(fd)


# -- mapping ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapped:
    """A layout mapped read-only: its header and its three sections as arrays."""

    path: str
    header: LayoutHeader
    keys: np.ndarray
    vectors: np.ndarray
    index: np.ndarray


def map_layout(path: str) -> Mapped:
    """Map a layout read-only and check it (header, completeness, index spot check)."""
    if sys.byteorder != "little":  # pragma: no cover - no such host in sight
        raise ModelFileError(path, "table layouts are little-endian; this host is not")
    with _open_ro(path) as fd:
        h = _parse_header(path, os.pread(fd, HEADER_SIZE, 0))
        size = os.fstat(fd).st_size
        if size != h.file_size:
            raise CorruptLayoutError(
                path, f"incomplete: {size} bytes, the header says {h.file_size} (truncated?)"
            )
        mm = mmap.mmap(fd, h.file_size, access=mmap.ACCESS_READ)
    n, codec, cap = h.n_rows, h.codec, h.capacity
    keys = np.frombuffer(mm, np.int64, n, h.keys_offset)
    w = codec.row_width
    vectors = np.frombuffer(mm, codec.row_dtype, n * w, h.vectors_offset).reshape(n, w)
    index = np.frombuffer(mm, np.int64, 2 * cap, h.index_offset).reshape(cap, 2)
    _spot_check(path, keys, index)
    return Mapped(path, h, keys, vectors, index)


def _spot_check(path: str, keys: np.ndarray, index: np.ndarray) -> None:
    """Probe a few evenly spaced keys: each must lead to its own row (touches ~32 pages)."""
    n = keys.shape[0]
    rows = np.unique(np.linspace(0, max(n - 1, 0), min(n, _SPOT_CHECKS)).astype(np.int64))
    found = np.empty(rows.shape[0], np.int64)
    try:
        _native.probe(index, keys[rows], found)
    except ValueError as e:  # CorruptIndexError: a slot holds an impossible row id
        raise CorruptLayoutError(path, f"corrupt index ({e})") from e
    if not np.array_equal(found, rows):
        raise CorruptLayoutError(path, "the index does not match the keys (corrupt data)")
