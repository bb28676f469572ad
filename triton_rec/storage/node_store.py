"""Node-local table layouts: converted once per table content, mapped by every instance.

Every Triton model instance is its own process. Reading the sparse files and building a
hash index in each of them costs N private indexes and N index builds. Instead,
:func:`load_table` converts a table once into a single *layout file* holding keys, rows
and the ready hash index, and every instance memory-maps that file read-only: the page
cache holds one copy of everything, shared by all processes, and a later load only
stats the source and maps the layout (milliseconds, whatever the table size).

Store directory
---------------
``store_dir`` (a parameter everywhere; default: the ``TRITON_REC_STORE`` environment
variable, else ``~/.cache/triton-rec/store``; see :func:`default_store_dir`)::

    layouts/<digest>.tbl      one layout per table *content*; <digest> = content digest
                              (64 hex digits). Read-only (mode 0444), never modified in place.
    layouts/.tmp-<fp>-*       layouts being written; readers never open them
    sources/<fp>              symlink -> ../layouts/<digest>.tbl: "the source whose
                              fingerprint is <fp> holds this content"
    locks/<fp>.lock           flock(2) lock files: one converter per source at a time

Finding the layout of a source (:func:`ensure_layout`, used by :func:`load_table`):

1. fast path: ``sources/<fp>`` exists and its layout is valid -> reuse it. Only the
   source files' metadata is read (``stat``), never their data.
2. otherwise, under an exclusive ``flock`` on ``locks/<fp>.lock`` (concurrent loaders
   of the same source wait there, then take the fast path): if a layout of the same
   shape exists, compute the source's content digest; a layout with that digest is
   reused and ``sources/<fp>`` is pointed at it (a touched or copied file costs one
   read, no conversion);
3. otherwise convert: read the source (:func:`triton_rec.formats.tables.read_table`), build the
   index,
   write the layout to a temporary file in the store, then publish it atomically
   (``link``, or ``os.replace``), so nobody ever sees a partial file.

The source fingerprint (32 hex digits) is blake2b-128 of: the layout format version,
the realpath of the source, vec_size, the precision, and for each source file (``key`` and
``emb_vector`` of a HugeCTR directory, or the ``.npz``): name, size, mtime_ns, inode and
device. A file rewritten in place with the same size and a restored mtime is not
noticed: convert with ``force=True`` (CLI ``--force``) after such a rewrite.

Content digest (64 hex digits): a blake2b-256 tree hash, so that it runs on all cores.
The keys bytes (int64 little-endian, source row order) and then the row bytes
(float32 little-endian for ``fp32``; the encoded rows otherwise) are cut, each from
its own start, into chunks of
``HASH_CHUNK`` (64 MiB) bytes; ``leaf = blake2b(chunk, digest_size=32,
person=b"trec-leaf")``; ``digest = blake2b(pack("<QQQ", HASH_CHUNK, N, D) + leaf_0 +
leaf_1 + ..., digest_size=32, person=b"trec-content")`` (``person=b"trec-cont-fp16"``
/ ``b"trec-cont-int8"`` for encoded rows). It depends on the stored content only (not
on the file format: the same table as a HugeCTR directory or an ``.npz`` has the same
digest); the same table in two precisions has two digests, and two layouts. The
index digest is the same construction over the index section, with
``pack("<QQQ", HASH_CHUNK, capacity, 2)`` and ``person=b"trec-index"``.

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

:func:`open_table` checks the header (magic, version, checksum, that sizes and offsets
follow from N, D, capacity), that the file is exactly ``file_size`` bytes long, and
probes 16 evenly spaced keys through the index (~32 page reads: ~0.1 s when the
layout is not in the page cache, microseconds when it is); it does not read the data.
:func:`verify_layout` recomputes both digests (reads everything).

Crash safety: layouts are written to a temporary name and published atomically; a
writer that dies leaves a ``.tmp-*`` file, removed by the next converter of that
source. Without ``fsync=True`` a power loss right after a conversion may leave a
published layout whose data never reached the disk (the header checksum and size
check catch most such files; :func:`verify_layout` catches all).

Never truncate or rewrite a layout in place: processes mapping it would get SIGBUS.
Delete it (``unlink`` is safe, mapped copies live on) and let the next load reconvert.

Limits: the lock is per source fingerprint, so two *different* sources with the same
content converted at the same moment are both converted (the first layout published
is kept, the other discarded). Nothing deletes old layouts yet: a store grows by one
layout per table content ever loaded; removing ``layouts/*.tbl`` and ``sources/*`` by
hand is safe while no load is running (mapped files live on until unmapped).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import mmap
import os
import secrets
import stat
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.config.model_files import confine
from triton_rec.errors import (  # noqa: F401  (re-exported)
    CorruptLayoutError,
    DuplicateKeyError,
    ModelFileError,
    StoreError,
)
from triton_rec.formats.hugectr_sparse import KEY_FILE, VECTOR_FILE
from triton_rec.formats.tables import is_npz, read_table, read_table_rows
from triton_rec.precision import DEFAULT_PRECISION, RowCodec, transcode
from triton_rec.storage.table import MADV_POPULATE_READ, EmbeddingTable, mapping_of
from triton_rec.util.procfs import flock_exclusive

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
#: older versions this one still reads (version 1: no precision field, always fp32)
_READS_VERSIONS = (1, 2)
MAGIC = b"TRECTBL\0"
ALIGN = 4096
HEADER_SIZE = 4096
HASH_CHUNK = 64 << 20  # bytes per digest leaf, and per write
STORE_ENV = "TRITON_REC_STORE"
SUFFIX = ".tbl"

# Fixed header fields (see the module docstring); the checksum sits at _CHECKSUM_AT.
_HDR = struct.Struct("<8sIIQQQQQQQQq32s32s16sH")
_SOURCE_AT = _HDR.size  # 170
_SOURCE_MAX = 2048
_PRECISION_AT = 2224  # uint32 precision code (format version 2)
_CHECKSUM_AT = HEADER_SIZE - 32
_SPOT_CHECKS = 16

#: ``progress(done_bytes, total_bytes)``
Progress = Callable[[int, int], None]


def default_store_dir() -> str:
    """``$TRITON_REC_STORE`` if set and non-empty, else ``~/.cache/triton-rec/store``."""
    env = os.environ.get(STORE_ENV, "").strip()
    return os.path.abspath(os.path.expanduser(env or "~/.cache/triton-rec/store"))


# -- header ----------------------------------------------------------------------------


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


def _offsets(n: int, codec: RowCodec, capacity: int) -> Tuple[int, int, int, int]:
    keys_off = HEADER_SIZE
    vec_off = _align(keys_off + 8 * n)
    idx_off = _align(vec_off + codec.row_bytes * n)
    return keys_off, vec_off, idx_off, idx_off + 16 * capacity


def _pack_header(
    n: int,
    codec: RowCodec,
    capacity: int,
    content: str,
    index: str,
    fingerprint: str,
    source: str,
) -> bytes:
    d = codec.dim
    ko, vo, io, size = _offsets(n, codec, capacity)
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
    if hsize != HEADER_SIZE or (ko, vo, io, size) != _offsets(n, codec, cap):
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
class _Mapped:
    path: str
    header: LayoutHeader
    keys: np.ndarray
    vectors: np.ndarray
    index: np.ndarray


def _map_layout(path: str) -> _Mapped:
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
    return _Mapped(path, h, keys, vectors, index)


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


def open_table(
    layout_path: str, name: str, default_value: float = 0.0, *, source_path: Optional[str] = None
) -> EmbeddingTable:
    """Map a layout file read-only as an :class:`EmbeddingTable`: no copy, no index build.

    Args:
        layout_path: a ``.tbl`` layout file.
        name, default_value: as for :class:`EmbeddingTable`.
        source_path: the table's source, used as ``table.path`` in messages
            (default: ``layout_path``).

    The arrays (``keys``, ``vectors``, ``index``) are read-only views of one shared
    mapping. Checks the header, that the file is complete and 16 index probes; not
    the data (see :func:`verify_layout`).

    Raises:
        ModelFileError: the file is missing or unreadable; CorruptLayoutError (a
            ModelFileError) naming the file: truncated, incomplete or corrupt.
    """
    m = _map_layout(layout_path)
    return _table(m, name, default_value, source_path)


def _table(m: _Mapped, name: str, default_value: float, source: Optional[str]) -> EmbeddingTable:
    return EmbeddingTable.from_layout(
        name,
        m.keys,
        m.vectors,
        m.index,
        default_value,
        path=source or m.path,
        layout_path=m.path,
        codec=m.header.codec,
    )


def verify_layout(path: str, threads: Optional[int] = None) -> LayoutHeader:
    """Check a layout fully: recompute its content and index digests (reads the file).

    Raises:
        CorruptLayoutError: naming the file, if anything differs.
    """
    m = _map_layout(path)
    h = m.header
    if h.hash_chunk != HASH_CHUNK:
        raise CorruptLayoutError(path, f"digest chunk {h.hash_chunk}, expected {HASH_CHUNK}")
    with _hash_pool(threads) as pool:
        if content_digest(m.keys, m.vectors, pool=pool, codec=h.codec) != h.content_digest:
            raise CorruptLayoutError(path, "keys/vectors do not match the content digest")
        if _index_digest(m.index, pool) != h.index_digest:
            raise CorruptLayoutError(path, "the index does not match the index digest")
    return h


# -- digests ---------------------------------------------------------------------------


def _hash_threads(threads: Optional[int]) -> int:
    if threads:
        return max(1, int(threads))
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, min(8, os.cpu_count() or 1))


@contextlib.contextmanager
def _hash_pool(threads: Optional[int] = None) -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(_hash_threads(threads), thread_name_prefix="trec-hash")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _leaf(chunk: memoryview) -> bytes:
    # hashlib releases the GIL on large buffers: leaves hash in parallel.
    return hashlib.blake2b(chunk, digest_size=32, person=b"trec-leaf").digest()


class _TreeHash:
    """The tree hash of the module docstring; leaves hash in ``pool`` as chunks arrive."""

    def __init__(self, pool: ThreadPoolExecutor, person: bytes, *dims: int):
        self._root = hashlib.blake2b(digest_size=32, person=person)
        self._root.update(struct.pack("<QQQ", HASH_CHUNK, *dims))
        self._pool = pool
        self._pending: collections.deque = collections.deque()
        # Bounded backlog, so that progress reports hashed bytes, not just written ones.
        self._backlog = 2 * getattr(pool, "_max_workers", 4)

    def add(self, chunk: memoryview) -> None:
        self._pending.append(self._pool.submit(_leaf, chunk))
        while len(self._pending) > self._backlog:
            self._root.update(self._pending.popleft().result())

    def hexdigest(self) -> str:
        while self._pending:
            self._root.update(self._pending.popleft().result())
        return self._root.hexdigest()


def _chunks(a: np.ndarray) -> Iterator[memoryview]:
    """A C-contiguous array's bytes in HASH_CHUNK pieces (views, no copy)."""
    # ndarray has the buffer protocol; numpy's stubs declare __buffer__ for Python 3.12+ only
    flat = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    for start in range(0, flat.nbytes, HASH_CHUNK):
        yield flat[start : start + HASH_CHUNK]


def _content_person(codec: RowCodec) -> bytes:
    return (
        b"trec-content" if codec.precision == "fp32" else b"trec-cont-" + codec.precision.encode()
    )


def content_digest(
    keys: np.ndarray,
    vectors: np.ndarray,
    progress: Optional[Progress] = None,
    *,
    pool: Optional[ThreadPoolExecutor] = None,
    codec: Optional[RowCodec] = None,
) -> str:
    """The content digest of a table (module docstring), hashing on all cores.
    ``vectors``: float32 vectors, or the row array of ``codec``."""
    if pool is None:
        with _hash_pool() as p:
            return content_digest(keys, vectors, progress, pool=p, codec=codec)
    codec = codec or RowCodec(DEFAULT_PRECISION, int(vectors.shape[1]))
    n, d = vectors.shape[0], codec.dim
    tree = _TreeHash(pool, _content_person(codec), n, d)
    total, done = keys.nbytes + vectors.nbytes, 0
    if progress:
        progress(0, total)
    for a in (keys, vectors):
        for c in _chunks(a):
            tree.add(c)
            done += c.nbytes
            if progress:
                progress(done, total)
    return tree.hexdigest()


def _index_digest(index: np.ndarray, pool: ThreadPoolExecutor) -> str:
    tree = _TreeHash(pool, b"trec-index", index.shape[0], 2)
    for c in _chunks(index):
        tree.add(c)
    return tree.hexdigest()


# -- fingerprint -----------------------------------------------------------------------


def _fingerprint(
    source_path: str, vec_size: int, precision: str = DEFAULT_PRECISION
) -> Tuple[str, Optional[int]]:
    """(fingerprint, rows implied by the file sizes or None): metadata only, no data read."""
    real = os.path.realpath(source_path)
    npz = is_npz(source_path)
    files = [real] if npz else [os.path.join(real, KEY_FILE), os.path.join(real, VECTOR_FILE)]
    parts: list = [FORMAT_VERSION, real, int(vec_size), precision]
    sizes = []
    for f in files:
        # The operator's allowed roots (realpath), if set; named as ps.json names it.
        confine(
            source_path if npz else os.path.join(source_path, os.path.basename(f)), "sparse file"
        )
        try:
            st = os.stat(f)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            read_table(source_path, vec_size)  # raises ModelFileError saying what is wrong
            raise ModelFileError(f, "not a regular file")
        parts += [os.path.basename(f), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]
        sizes.append(st.st_size)
    rows = None
    if not npz and sizes[0] % 8 == 0 and sizes[1] == sizes[0] // 8 * 4 * vec_size:
        rows = sizes[0] // 8
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest(), rows


def source_fingerprint(source_path: str, vec_size: int, precision: str = DEFAULT_PRECISION) -> str:
    """The fingerprint of a table source (module docstring): ``stat`` calls only."""
    return _fingerprint(source_path, vec_size, precision)[0]


# -- the store -------------------------------------------------------------------------


class _Store:
    def __init__(self, store_dir: Optional[str]):
        self.root = os.path.abspath(os.path.expanduser(store_dir or default_store_dir()))
        self.layouts = os.path.join(self.root, "layouts")
        self.sources = os.path.join(self.root, "sources")
        self.locks = os.path.join(self.root, "locks")
        try:
            for d in (self.layouts, self.sources, self.locks):
                os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.root}: cannot create the table store ({e.strerror})") from e

    def layout(self, digest: str) -> str:
        return os.path.join(self.layouts, digest + SUFFIX)

    def alias(self, fp: str) -> str:
        return os.path.join(self.sources, fp)

    def read_alias(self, fp: str) -> Optional[str]:
        try:
            target = os.readlink(self.alias(fp))
        except OSError:
            return None
        name = os.path.basename(target)
        return self.layout(name[: -len(SUFFIX)]) if name.endswith(SUFFIX) else None

    def set_alias(self, fp: str, digest: str, fsync: bool = False) -> None:
        tmp = f"{self.alias(fp)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        os.symlink(os.path.join("..", "layouts", digest + SUFFIX), tmp)
        os.replace(tmp, self.alias(fp))
        if fsync:
            _fsync_dir(self.sources)

    def drop_alias(self, fp: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.alias(fp))

    @contextlib.contextmanager
    def lock(self, fp: str) -> Iterator[None]:
        path = os.path.join(self.locks, fp + ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            flock_exclusive(
                fd,
                None,
                on_wait=lambda: log.info(
                    "waiting for another process converting the same table (%s)", path
                ),
            )
            yield
        finally:
            os.close(fd)  # releases the lock

    def same_shape_exists(self, n: int, d: int, precision: str) -> bool:
        """Is there a layout of N rows x D in ``precision`` (worth computing the source's
        digest for)?"""
        try:
            names = os.listdir(self.layouts)
        except OSError:
            return False
        for name in names:
            if name.startswith(".") or not name.endswith(SUFFIX):
                continue
            try:
                h = read_header(os.path.join(self.layouts, name))
            except ModelFileError:
                continue
            if (h.n_rows, h.vec_size, h.precision) == (n, d, precision):
                return True
        return False

    def remove_stale_temps(self, fp: str) -> None:
        """Temporary files of this source: their writer is dead (we hold its lock)."""
        prefix = f".tmp-{fp}-"
        for name in os.listdir(self.layouts):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.layouts, name))
                    log.warning("removed %s, left by an interrupted conversion", name)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- conversion ------------------------------------------------------------------------


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf.nbytes:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


class _Populator:
    """Faults in the pages of chunks of a file-mapped array before they are written out.

    ``write(2)`` straight from mapped pages that are not yet faulted in copies in small
    steps, and the page cache of the layout gets 4 KiB folios, mapped later with 4 KiB
    TLB entries. With the source range populated first (``MADV_POPULATE_READ``), the
    copy goes in large steps into large folios, mapped with 2 MiB pages (ext4, Linux
    6.x). Measured here (2 vCPU VM): random lookups over a 2 GB layout 7.5 vs 5.2 M
    keys/s (median, 64k-key batches, D=64). The price is kernel CPU at conversion
    (large-folio allocation): 11-13 s instead of ~5 s of system time for 4.3 GB, once
    per table content. A layout read back from disk gets large folios either way
    (readahead). No-op for in-memory arrays and on kernels before 5.14.
    """

    def __init__(self, a: np.ndarray):
        self.mm = mapping_of(a)
        if self.mm is not None:
            self.base = np.frombuffer(self.mm, np.uint8).ctypes.data

    def __call__(self, chunk: memoryview) -> None:
        if self.mm is None:
            return
        start = np.frombuffer(chunk, np.uint8).ctypes.data - self.base
        lo = start - start % mmap.PAGESIZE
        hi = min(start + chunk.nbytes, len(self.mm))
        try:
            self.mm.madvise(MADV_POPULATE_READ, lo, hi - lo)
        except (OSError, ValueError):
            self.mm = None  # not supported here: plain writes, still correct


def _build_index(keys: np.ndarray, source_path: str) -> np.ndarray:
    try:
        return _native.build_index(keys)
    except ValueError as e:
        if "duplicate" in str(e):
            raise DuplicateKeyError(source_path, str(e)) from e
        raise


def _write_layout(
    store: _Store,
    fp: str,
    source_path: str,
    keys: np.ndarray,
    vectors: np.ndarray,
    index: np.ndarray,
    progress: Optional[Progress],
    fsync: bool,
    replace: bool,
    digest: Optional[str] = None,
    codec: Optional[RowCodec] = None,
) -> Tuple[str, str]:
    """Write and publish the layout of one table; returns ``(path, content digest)``.

    Keys, vectors and index are written sequentially in HASH_CHUNK pieces while worker
    threads hash the same pieces (the content is not hashed again if ``digest``, its
    content digest, is given).
    """
    codec = codec or RowCodec(DEFAULT_PRECISION, int(vectors.shape[1]))
    n, d = vectors.shape[0], codec.dim
    cap = index.shape[0]
    _, vec_off, idx_off, file_size = _offsets(n, codec, cap)
    total = keys.nbytes + vectors.nbytes + index.nbytes
    tmp = os.path.join(store.layouts, f".tmp-{fp}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}")
    # A full disk should fail now, not after gigabytes. (Not posix_fallocate: writing
    # into preallocated extents with large folios measured ~40% slower on ext4.)
    st = os.statvfs(store.layouts)
    if st.f_bavail * st.f_frsize < file_size:
        raise StoreError(
            f"{store.layouts}: {st.f_bavail * st.f_frsize / 1e9:.2f} GB free, the layout of "
            f"{source_path} needs {file_size / 1e9:.2f} GB"
        )
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StoreError(f"{store.layouts}: cannot create a layout file ({e.strerror})") from e
    try:
        if progress:
            progress(0, total)
        done = 0
        with _hash_pool() as pool:
            content = None if digest else _TreeHash(pool, _content_person(codec), n, d)
            index_tree = _TreeHash(pool, b"trec-index", cap, 2)
            for a, offset, tree in (
                (keys, HEADER_SIZE, content),
                (vectors, vec_off, content),
                (index, idx_off, index_tree),
            ):
                populate = _Populator(a)
                for c in _chunks(a):
                    populate(c)
                    if tree is not None:
                        tree.add(c)  # hashed from the source itself, in worker threads
                    _pwrite_all(fd, c, offset)
                    offset += c.nbytes
                    done += c.nbytes
                    if progress and done < total:
                        progress(done, total)
            if content is not None:
                digest = content.hexdigest()
            index_digest = index_tree.hexdigest()
        assert digest is not None  # given, or computed from the content just above
        os.pwrite(fd, _pack_header(n, codec, cap, digest, index_digest, fp, source_path), 0)
        os.fchmod(fd, 0o444)
        if fsync:
            os.fsync(fd)
    except BaseException as e:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise StoreError(f"{tmp}: cannot write the layout ({e.strerror or e})") from e
        raise
    os.close(fd)
    if progress:
        progress(total, total)
    final = store.layout(digest)
    _publish(tmp, final, replace)
    if fsync:
        _fsync_dir(store.layouts)
    return final, digest


def _publish(tmp: str, final: str, replace: bool) -> None:
    """Give ``tmp`` its final name atomically.

    A valid layout already there (same content, written by a concurrent converter of
    another source) is kept: processes may map it already, and a second inode would
    hold a second copy in the page cache. An invalid one is replaced.
    """
    if not replace:
        try:
            os.link(tmp, final)
        except FileExistsError:
            try:
                _map_layout(final)
            except ModelFileError:
                pass  # broken: replace below
            else:
                os.unlink(tmp)
                return
        except OSError:
            pass  # no hard links here: fall back to rename
        else:
            os.unlink(tmp)
            return
    os.replace(tmp, final)


# -- reuse or convert ------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutResult:
    """What :func:`ensure_layout` did.

    Attributes:
        path: the layout file.
        action: ``"reused"`` (fast path: source fingerprint known), ``"aliased"`` (new
            fingerprint, content digest of an existing layout) or ``"converted"``.
        fingerprint, digest: the source fingerprint and content digest (hex).
        n_rows, vec_size: table shape.
        data_bytes: keys + vectors + index bytes of the layout.
        seconds: wall time of the call.
    """

    path: str
    action: str
    fingerprint: str
    digest: str
    n_rows: int
    vec_size: int
    data_bytes: int
    seconds: float


def _valid(
    path: Optional[str],
    codec: RowCodec,
    rows: Optional[int],
    digest: Optional[str],
    repair: bool,
) -> Optional[_Mapped]:
    """Map ``path`` if it is a valid layout of the expected shape; else None.

    With ``repair`` (caller holds the source's lock), a corrupt layout is deleted.
    """
    if path is None:
        return None
    try:
        m = _map_layout(path)
    except CorruptLayoutError as e:
        log.warning("%s", e)
        if repair:
            with contextlib.suppress(OSError):
                os.unlink(path)
            log.warning("deleted corrupt layout %s; converting again", path)
        return None
    except ModelFileError:
        return None  # missing
    h = m.header
    name = os.path.basename(path)[: -len(SUFFIX)]
    if (
        h.codec != codec
        or (rows is not None and h.n_rows != rows)
        or h.content_digest != name
        or (digest is not None and h.content_digest != digest)
    ):
        return None
    return m


def _source_rows(
    source_path: str, codec: RowCodec, progress: Optional[Progress]
) -> Tuple[np.ndarray, np.ndarray]:
    """The keys and the rows of a source in ``codec``'s precision: as stored when the
    source holds that precision, else decoded and encoded (in chunks, with progress)."""
    keys, rows, src = read_table_rows(source_path, codec.dim)
    if src == codec:
        return keys, rows
    n = int(keys.shape[0])
    label = f"{src.precision} -> {codec.precision}"

    report = None
    if progress is not None:
        tell = progress

        def report(a: int, b: int, vectors: np.ndarray, encoded: np.ndarray) -> None:
            tell(b * codec.row_bytes, n * codec.row_bytes)

    out = transcode(rows, src, codec, HASH_CHUNK // 16, report)
    log.info("%s: encoded %d rows (%s)", source_path, n, label)
    return keys, out


def _resolve(
    source_path: str,
    vec_size: int,
    store_dir: Optional[str],
    progress: Optional[Progress],
    fsync: bool,
    force: bool,
    precision: str = DEFAULT_PRECISION,
) -> Tuple[LayoutResult, _Mapped]:
    t0 = time.perf_counter()
    store = _Store(store_dir)
    codec = RowCodec(precision, int(vec_size))
    fp, rows = _fingerprint(source_path, vec_size, precision)

    def result(action: str, m: _Mapped) -> Tuple[LayoutResult, _Mapped]:
        h = m.header
        took = time.perf_counter() - t0
        r = LayoutResult(
            m.path, action, fp, h.content_digest, h.n_rows, h.vec_size, h.data_bytes, took
        )
        return r, m

    if not force:  # fast path, no lock: an alias is only ever created for a finished layout
        m = _valid(store.read_alias(fp), codec, rows, None, repair=False)
        if m is not None:
            return result("reused", m)
    with store.lock(fp):
        if not force:  # someone may have converted it while we waited
            m = _valid(store.read_alias(fp), codec, rows, None, repair=True)
            if m is not None:
                return result("reused", m)
            store.drop_alias(fp)
        store.remove_stale_temps(fp)
        keys, vectors = _source_rows(source_path, codec, progress)
        n = int(keys.shape[0])
        digest = None
        if not force and store.same_shape_exists(n, vec_size, precision):
            digest = content_digest(keys, vectors, progress, codec=codec)
            m = _valid(store.layout(digest), codec, n, digest, repair=True)
            if m is not None:
                store.set_alias(fp, digest, fsync)
                log.info("%s: same content as %s (new fingerprint)", source_path, m.path)
                return result("aliased", m)
        index = _build_index(keys, source_path)  # duplicate keys fail before any write
        path, digest = _write_layout(
            store, fp, source_path, keys, vectors, index, progress, fsync, force, digest, codec
        )
        del index
        if _fingerprint(source_path, vec_size, precision)[0] == fp:
            store.set_alias(fp, digest, fsync)
        else:
            log.warning("%s changed while it was converted; not recording it", source_path)
        m = _map_layout(path)
        r = result("converted", m)
        log.info(
            "converted %s -> %s (%.1f MB in %.2f s)",
            source_path,
            path,
            r[0].data_bytes / 1e6,
            r[0].seconds,
        )
        return r


def ensure_layout(
    source_path: str,
    vec_size: int,
    store_dir: Optional[str] = None,
    progress: Optional[Progress] = None,
    *,
    fsync: bool = False,
    force: bool = False,
    precision: str = DEFAULT_PRECISION,
) -> LayoutResult:
    """Make sure the store holds the layout of a table source; say how it got there.

    Args:
        source_path: HugeCTR sparse directory or ``.npz`` (as in ps.json).
        vec_size: floats per vector (from ps.json).
        store_dir: the store (default :func:`default_store_dir`).
        progress: ``progress(done_bytes, total_bytes)``, called while converting or
            hashing (e.g. :class:`ProgressLogger`).
        fsync: flush the layout to disk before publishing it.
        force: ignore what the store knows about this source; convert and replace.
        precision: the precision the layout holds the rows in (ps.json
            ``embedding_precision``; :mod:`triton_rec.precision`). A source that
            holds another precision is decoded and encoded once, at conversion.

    Raises:
        ModelFileError: naming the source file (missing, wrong size, ...);
        DuplicateKeyError: naming the source; StoreError: the store is unusable.
    """
    return _resolve(source_path, vec_size, store_dir, progress, fsync, force, precision)[0]


def convert_table(
    source_path: str,
    vec_size: int,
    store_dir: Optional[str] = None,
    progress: Optional[Progress] = None,
    *,
    fsync: bool = False,
    force: bool = False,
    precision: str = DEFAULT_PRECISION,
) -> str:
    """Convert a table source into the store (once per content); the layout's path.

    Idempotent: a source already converted, or whose content is, is not converted
    again (see :func:`ensure_layout`, which also says what it did).
    """
    return ensure_layout(
        source_path, vec_size, store_dir, progress, fsync=fsync, force=force, precision=precision
    ).path


def load_table(
    table_params,
    store_dir: Optional[str] = None,
    *,
    progress: Optional[Progress] = None,
    prefault: bool = False,
    fsync: bool = False,
) -> EmbeddingTable:
    """Convert-if-needed, then map a table (``TableParams`` from ps.json) read-only.

    Safe to call from many processes at once: one converts, the others wait and map.
    ``table.path`` is the source (for messages), ``table.layout_path`` the layout.
    With ``prefault``, every page is made resident before returning
    (:meth:`EmbeddingTable.prefault`).
    """
    t = table_params
    _, m = _resolve(
        t.sparse_file, t.vec_size, store_dir, progress, fsync, force=False, precision=t.precision
    )
    table = _table(m, t.name, t.default_value, t.sparse_file)
    if prefault:
        table.prefault()
    return table


# -- progress --------------------------------------------------------------------------


class ProgressLogger:
    """A ``progress(done_bytes, total_bytes)`` callback: percentage, MB and MB/s.

    Args:
        label: prefix of every line (e.g. ``model.table``).
        stream: where to write (e.g. ``sys.stderr``); on a terminal the line is
            rewritten in place. Without a stream, lines go to this module's logger (INFO).
        interval: seconds between two lines (default 0.5 on a terminal, else 5).
    """

    def __init__(self, label: str = "converting", stream=None, interval: Optional[float] = None):
        self.label = label
        self.stream = stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.5 if self.tty else 5.0)
        self._t0: Optional[float] = None
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        """Report progress: write a line at most every ``interval`` seconds, and at the end."""
        now = time.perf_counter()
        if self._t0 is None or done == 0:
            self._t0, self._last = now, now
            return
        final = done >= total
        if not final and now - self._last < self.interval:
            return
        self._last = now
        rate = done / max(now - self._t0, 1e-9)
        pct = 100.0 * done / total if total else 100.0
        line = (
            f"{self.label}: {pct:5.1f}%  {done / 1e6:,.0f} / {total / 1e6:,.0f} MB  "
            f"{rate / 1e6:,.0f} MB/s"
        )
        if self.stream is None:
            log.info("%s", line)
        elif self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
            self.stream.flush()
        else:
            self.stream.write(line + "\n")
            self.stream.flush()
