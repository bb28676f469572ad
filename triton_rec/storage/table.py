"""An embedding table in memory: keys, vectors and the native hash index over the keys.

A table whose keys are a range (``keys[i] == base + i``: the MLPerf DLRM's tables, any
table of row numbers) is looked up without its index (:attr:`EmbeddingTable.key_base`,
:attr:`EmbeddingTable.native_index`): a row is ``key - base``, one memory access a key
instead of two, and neither the index nor the keys are brought into memory.

Two ways to get one:

- ``EmbeddingTable(name, keys, vectors, ...)`` builds a private hash index over ``keys``
  (the per-instance way: every process that does this holds its own index);
- :meth:`EmbeddingTable.from_layout` wraps arrays that already include a ready index,
  typically read-only memory maps of a node-local layout file written once by
  :mod:`triton_rec.storage.node_store` and shared by every instance process through the page cache.
"""

from __future__ import annotations

import mmap
from typing import Iterator, Optional, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.errors import DuplicateKeyError
from triton_rec.precision import RowCodec

PAGE_SIZE = mmap.PAGESIZE
# madvise(2) MADV_POPULATE_READ (Linux >= 5.14): fault every page of a range in, in the
# kernel, without copying anything. Not exported by Python's mmap module (3.11).
MADV_POPULATE_READ = 22


class EmbeddingTable:
    """Read-only table answering batched key lookups with the fused native kernel.

    Args:
        name: table name, used in messages.
        keys: int64 ``[N]`` unique keys (may be a read-only memmap).
        vectors: ``[N, ...]`` rows; row i belongs to ``keys[i]`` (may be a memmap): float32
            ``[N, D]`` vectors, or a row array of ``codec``
            (:mod:`triton_rec.precision`).
        default_value: value of every element returned for an unknown key.
        path: where the table came from, for error messages.
        codec: how the rows are encoded (default: float32 rows of ``vectors.shape[1]``).

    Attributes:
        name, path, keys, vectors, default_value, codec: as given.
        index: int64 ``[capacity, 2]`` hash index (layout: src/native/hash_index.hpp).
        native_index: what the native calls take: ``index``, or where the keys are a
            range (:attr:`key_base`) the direct index ``[[base, rows]]``
            (src/native/hash_index.hpp), which reads no slot; it lives as long as the table
            (native plans hold its address).
        layout_path: the node-local layout file the arrays map, or None (private arrays).

    Raises:
        DuplicateKeyError: a key appears twice (the message names the file, key and rows).

    Thread-safety: :meth:`lookup` may be called from several threads at once; the
    table is never modified after construction.
    """

    layout_path: Optional[str] = None

    def __init__(
        self,
        name: str,
        keys: np.ndarray,
        vectors: np.ndarray,
        default_value: float = 0.0,
        path: Optional[str] = None,
        codec: Optional[RowCodec] = None,
    ):
        self.name = name
        self.path = path or f"<table {name}>"
        self.keys = keys
        self.codec = codec or RowCodec("fp32", int(vectors.shape[1]))
        self.codec.check_rows(vectors, keys.shape[0], f"{self.path}: vectors")
        self.vectors = vectors
        self.default_value = float(default_value)
        try:
            self.index = _native.build_index(keys)
        except ValueError as e:
            if "duplicate" in str(e):
                raise DuplicateKeyError(self.path, str(e)) from e
            raise
        self._set_native_index()

    @classmethod
    def from_layout(
        cls,
        name: str,
        keys: np.ndarray,
        vectors: np.ndarray,
        index: np.ndarray,
        default_value: float = 0.0,
        path: Optional[str] = None,
        layout_path: Optional[str] = None,
        codec: Optional[RowCodec] = None,
    ) -> EmbeddingTable:
        """A table over existing arrays and a ready index: nothing is copied or built.

        Args:
            keys, vectors: as for the constructor (typically read-only memory maps).
            index: int64 ``[capacity, 2]`` exactly as ``_native.build_index(keys)``
                returns it, with ``capacity == _native.index_capacity(len(keys))``.
            path: where the table came from (the source sparse file), for messages.
            layout_path: the layout file the arrays map, if any.

        Only shapes and dtypes are checked here (O(1)); that ``index`` really indexes
        ``keys`` is the caller's responsibility (``triton_rec.storage.node_store.open_table``
        spot-checks it). A wrong index gives wrong rows or ``CorruptIndexError``, never
        an out-of-bounds read: the native lookup checks every row id it follows.

        Raises:
            ValueError: dtypes, shapes or index capacity do not fit together.
        """
        n = _check_array(keys, "keys", np.int64, 1).shape[0]
        if codec is None:
            _check_array(vectors, "vectors", np.float32, 2)
            codec = RowCodec("fp32", int(vectors.shape[1]))
        _check_array(vectors, "vectors", codec.row_dtype, 2)
        if vectors.shape[1] != codec.row_width:
            raise ValueError(
                f"{name}: {codec.precision} rows of {codec.dim} values have "
                f"{codec.row_width} columns, got {vectors.shape[1]}"
            )
        _check_array(index, "index", np.int64, 2)
        if vectors.shape[0] != n:
            raise ValueError(f"{name}: {n} keys but {vectors.shape[0]} vectors")
        want = _native.index_capacity(n)
        if index.shape != (want, 2):
            raise ValueError(
                f"{name}: index has shape {index.shape}, expected ({want}, 2) for {n} keys"
            )
        table = cls.__new__(cls)
        table.name = name
        table.path = path or layout_path or f"<table {name}>"
        table.keys = keys
        table.vectors = vectors
        table.codec = codec
        table.index = index
        table.default_value = float(default_value)
        table.layout_path = layout_path
        table._set_native_index()
        # what no lookup reads leaves this process's memory: the keys (read once above;
        # the index holds them), and the index where they are a range (the load's spot
        # check touched pages of it, and the kernel mapped their neighbours)
        _release(keys)
        if table.key_base is not None:
            _release(index)
        return table

    @property
    def num_rows(self) -> int:
        """Rows of the table."""
        return int(self.vectors.shape[0])

    @property
    def vec_size(self) -> int:
        """Embedding vector size (values per decoded vector)."""
        return self.codec.dim

    @property
    def key_base(self) -> Optional[int]:
        """The first key when the keys are a range (:func:`key_range_base`), else None."""
        return None if self.native_index is self.index else int(self.native_index[0, 0])

    def _set_native_index(self) -> None:
        base = key_range_base(self.keys)
        self.native_index = self.index
        if base is not None:
            self.native_index = np.array([[base, self.keys.shape[0]]], dtype=np.int64)
            self.native_index.flags.writeable = False

    def lookup(self, keys: np.ndarray, out: Optional[np.ndarray] = None) -> Tuple[np.ndarray, int]:
        """Gather the vectors of ``keys`` (int64 ``[M]``) into ``out`` (float32 ``[M, D]``).

        Unknown keys get ``default_value`` in every element. Returns ``(out, misses)``.
        """
        if out is None:
            out = np.empty((keys.shape[0], self.vec_size), dtype=np.float32)
        misses = _native.lookup(
            self.native_index, self.vectors, keys, out, self.default_value,
            precision=self.codec.code,
        )  # fmt: skip
        return out, int(misses)

    def prefault(self) -> int:
        """Make every page a lookup reads resident and mapped, before serving: the vectors
        and the index, only the vectors when the keys are a range (:attr:`key_base`). The
        keys themselves are never read by a lookup (the index holds them) and stay out.

        Why: a memory-mapped table is read lazily. Without this, the first requests
        after a load take a page fault per row they touch (a disk read when the page is
        not cached, a minor fault otherwise), so tail latency is bad until the working
        set has been touched. Reading every page once moves that cost to load time.
        For layouts shared by several instance processes (``triton_rec.storage.node_store``) the
        pages land in the page cache once; later instances only map them (minor faults,
        no I/O), and all of them share one physical copy.

        How: ``madvise(MADV_WILLNEED)`` on each mapping (asynchronous readahead of the
        whole file), then ``madvise(MADV_POPULATE_READ)`` where the kernel has it
        (Linux >= 5.14), else a sequential read of one byte per page. Private in-memory
        arrays are touched the same way (harmless, cheap).

        Returns:
            bytes made resident (vectors, and the index unless the keys are a range).
        """
        wanted = (self.vectors,) if self.key_base is not None else (self.vectors, self.index)
        arrays = [a for a in wanted if a.nbytes]
        for a in arrays:
            span = _mapped_span(a)
            if span is not None:
                m, start, length = span
                try:
                    m.madvise(mmap.MADV_WILLNEED, start, length)
                except (OSError, ValueError):
                    pass
                try:
                    m.madvise(MADV_POPULATE_READ, start, length)
                    continue
                except (OSError, ValueError):
                    pass  # old kernel: touch the pages below
            _touch_pages(a)
        return int(sum(a.nbytes for a in arrays))

    def __repr__(self) -> str:
        return f"EmbeddingTable({self.name!r}, rows={self.num_rows}, vec_size={self.vec_size})"


def _check_array(a: np.ndarray, what: str, dtype, ndim: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != ndim:
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise ValueError(f"{what} must be a {ndim}-D {np.dtype(dtype)} array, got {got}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    return a


def _bases(a) -> Iterator[object]:
    while a is not None:
        yield a
        a = getattr(a, "base", None) if isinstance(a, np.ndarray) else None


def mapping_of(a: np.ndarray) -> Optional[mmap.mmap]:
    """The mmap object an array views, if any (np.memmap or np.frombuffer over an mmap)."""
    for b in _bases(a):
        if isinstance(b, memoryview):  # np.frombuffer(mmap): the memoryview's object
            b = b.obj
        if isinstance(b, mmap.mmap):
            return b
        m = getattr(b, "_mmap", None)  # np.memmap keeps its mapping here
        if isinstance(m, mmap.mmap):
            return m
    return None


def key_range_base(keys: np.ndarray, chunk: int = 1 << 16) -> Optional[int]:
    """``keys[0]`` when ``keys[i] == keys[0] + i`` for every ``i`` (modulo 2^64, as the
    direct lookup computes ``key - base``), else None (and for no keys). Reads the keys
    once, a chunk at a time."""
    n = int(keys.shape[0])
    if n == 0:
        return None
    base = int(keys[0])
    steps = np.arange(min(n, chunk), dtype=np.int64)
    with np.errstate(over="ignore"):
        for start in range(0, n, chunk):
            part = np.asarray(keys[start : start + chunk])
            first = np.int64(base) + np.int64(start)  # wraps as the keys would
            if not (part - steps[: part.shape[0]] == first).all():
                return None
    return base


def page_span(m: mmap.mmap, address: int, nbytes: int) -> Tuple[int, int]:
    """(offset, length) in ``m`` of the pages that ``nbytes`` bytes at ``address`` (inside
    ``m``) occupy: the offset page-aligned, the length within ``m``, as madvise takes them."""
    start = address - np.frombuffer(m, dtype=np.uint8).ctypes.data
    aligned = start - start % PAGE_SIZE
    return aligned, min(len(m), start + nbytes) - aligned


def _mapped_span(a: np.ndarray) -> Optional[Tuple[mmap.mmap, int, int]]:
    """(mapping, offset, length) of the pages a C-contiguous array occupies in the mmap it
    views (:func:`page_span`), or None for an array in private memory."""
    m = mapping_of(a)
    if m is None or a.nbytes == 0:
        return None
    return (m, *page_span(m, a.ctypes.data, a.nbytes))


def _release(a: np.ndarray) -> None:
    """Unmap the pages a mapped array occupies from this process (MADV_DONTNEED: a file's
    pages stay in the page cache and come back on the next read); nothing for an array in
    private memory. For the keys once :func:`key_range_base` has read them: no lookup
    reads them again, and mapped they would count in the server's memory."""
    span = _mapped_span(a)
    if span is None:
        return
    m, start, length = span
    try:
        m.madvise(mmap.MADV_DONTNEED, start, length)
    except (OSError, ValueError):
        pass  # an mmap that refuses: the pages simply stay


def _touch_pages(a: np.ndarray) -> int:
    """Read one byte of every page of a C-contiguous array, sequentially (returns their sum)."""
    flat = a.reshape(-1).view(np.uint8)
    # The first element may sit anywhere in its page: step from the next page boundary.
    first = (-flat.ctypes.data) % PAGE_SIZE
    return int(flat[0]) + int(flat[first::PAGE_SIZE].sum(dtype=np.uint64)) + int(flat[-1])
