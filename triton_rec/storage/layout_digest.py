"""The fingerprint of a table source and the content digest of a table, the two names
under which the node-local store (:mod:`triton_rec.storage.node_store`) finds a layout.

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
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import stat
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional, Tuple

import numpy as np

from triton_rec.config.model_files import confine
from triton_rec.errors import ModelFileError
from triton_rec.formats.hugectr_sparse import KEY_FILE, VECTOR_FILE
from triton_rec.formats.tables import is_npz, read_table
from triton_rec.precision import DEFAULT_PRECISION, RowCodec
from triton_rec.storage.layout_file import FORMAT_VERSION, HASH_CHUNK

#: ``progress(done_bytes, total_bytes)``
Progress = Callable[[int, int], None]


# -- digests ---------------------------------------------------------------------------


def _hash_threads(threads: Optional[int]) -> int:
    if threads:
        return max(1, int(threads))
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, min(8, os.cpu_count() or 1))


@contextlib.contextmanager
def hash_pool(threads: Optional[int] = None) -> Iterator[ThreadPoolExecutor]:
    """Worker threads for the leaves of the tree hashes (``threads``, else up to 8 cores)."""
    pool = ThreadPoolExecutor(_hash_threads(threads), thread_name_prefix="trec-hash")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _leaf(chunk: memoryview) -> bytes:
    # hashlib releases the GIL on large buffers: leaves hash in parallel.
    return hashlib.blake2b(chunk, digest_size=32, person=b"trec-leaf").digest()


class TreeHash:
    """The tree hash of the module docstring; leaves hash in ``pool`` as chunks arrive."""

    def __init__(self, pool: ThreadPoolExecutor, person: bytes, *dims: int):
        self._root = hashlib.blake2b(digest_size=32, person=person)
        self._root.update(struct.pack("<QQQ", HASH_CHUNK, *dims))
        self._pool = pool
        self._pending: collections.deque = collections.deque()
        # Bounded backlog, so that progress reports hashed bytes, not just written ones.
        self._backlog = 2 * getattr(pool, "_max_workers", 4)

    def add(self, chunk: memoryview) -> None:
        """Hash one chunk (a leaf), in the pool."""
        self._pending.append(self._pool.submit(_leaf, chunk))
        while len(self._pending) > self._backlog:
            self._root.update(self._pending.popleft().result())

    def hexdigest(self) -> str:
        """The root digest over every leaf added, in order."""
        while self._pending:
            self._root.update(self._pending.popleft().result())
        return self._root.hexdigest()


def chunks(a: np.ndarray) -> Iterator[memoryview]:
    """A C-contiguous array's bytes in HASH_CHUNK pieces (views, no copy)."""
    # ndarray has the buffer protocol; numpy's stubs declare __buffer__ for Python 3.12+ only
    flat = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    for start in range(0, flat.nbytes, HASH_CHUNK):
        yield flat[start : start + HASH_CHUNK]


def content_person(codec: RowCodec) -> bytes:
    """The blake2b personalization of the content digest of rows in ``codec``."""
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
        with hash_pool() as p:
            return content_digest(keys, vectors, progress, pool=p, codec=codec)
    codec = codec or RowCodec(DEFAULT_PRECISION, int(vectors.shape[1]))
    n, d = vectors.shape[0], codec.dim
    tree = TreeHash(pool, content_person(codec), n, d)
    total, done = keys.nbytes + vectors.nbytes, 0
    if progress:
        progress(0, total)
    for a in (keys, vectors):
        for c in chunks(a):
            tree.add(c)
            done += c.nbytes
            if progress:
                progress(done, total)
    return tree.hexdigest()


def index_digest(index: np.ndarray, pool: ThreadPoolExecutor) -> str:
    """The index digest (module docstring) of a layout's index section."""
    tree = TreeHash(pool, b"trec-index", index.shape[0], 2)
    for c in chunks(index):
        tree.add(c)
    return tree.hexdigest()


# -- fingerprint -----------------------------------------------------------------------


def fingerprint(
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
    return fingerprint(source_path, vec_size, precision)[0]
