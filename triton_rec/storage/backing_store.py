"""What an embedding cache sits in front of: the backing-store interface.

An embedding cache answers what it holds and asks a :class:`BackingStore` for the
rest. Implementations, one file each, all run by one contract suite
(``tests/unit/test_backing_store_contract.py``):

- :class:`LocalTableStore` (here): the node-local table, read-only;
- :class:`DictStore` (here): a Python dict, writable; the brute-force reference the
  contract suite compares every other store with;
- :class:`~triton_rec.storage.rocksdb_store.RocksDBStore`: a column family of a RocksDB
  database (HPS ``persistent_db``);
- :class:`~triton_rec.storage.redis_store.RedisClusterStore`: hashes in a Redis Cluster (HPS
  ``volatile_db`` of type ``redis_cluster``).

Rows are held in the table's precision (:attr:`BackingStore.codec`,
:mod:`triton_rec.precision`): :meth:`~BackingStore.fetch` answers decoded float32
vectors or, given a row array of the codec (:meth:`~BackingStore.fetch_rows`), the
encoded rows as stored, which is what a cache in the same precision inserts.
``upsert`` takes either form (float32 vectors are encoded once, by the store).

Reading (every store): :meth:`~BackingStore.fetch`, :meth:`~BackingStore.num_rows`,
:meth:`~BackingStore.sample_keys`, :meth:`~BackingStore.close`. Writing (writable tiers
only): :meth:`~BackingStore.upsert`, :meth:`~BackingStore.delete`; on a read-only store
both raise :class:`ReadOnlyStoreError`.

Tables in the remote tiers are named ``hps_et.<model>.<table>`` as in HPS
(:func:`tier_table_name`).
"""

from __future__ import annotations

import abc
import contextlib
import threading
from typing import Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from triton_rec import _native
from triton_rec.config.ps_json import NAME_RE
from triton_rec.errors import (  # noqa: F401  (the store errors are re-exported)
    ConfigError,
    ReadOnlyStoreError,
    StoreDataError,
    StoreError,
    StoreUnavailableError,
)
from triton_rec.precision import DEFAULT_PRECISION, RowCodec
from triton_rec.storage.table import EmbeddingTable

# Model and table names (config.py's rule): letters, digits, "_" and "-". "." joins them.
_NAME_RE = NAME_RE


def tier_table_name(model: str, table: str) -> str:
    """The name of ``table`` of ``model`` in the tiers: ``"hps_et.<model>.<table>"``.

    HPS's tag name (``HierParameterServerBase::make_tag_name``): the RocksDB column
    family, the core of the Redis hash keys and the online-update topic. Both parts
    are checked against HPS's naming rule, so the result never holds ``{``, ``}``,
    ``/`` or another ``.``.

    Raises:
        ConfigError: a part is empty or holds other characters.
    """
    for what, v in (("model", model), ("table", table)):
        if not isinstance(v, str) or not _NAME_RE.fullmatch(v):
            raise ConfigError(
                f"{what} name {v!r}: only letters, digits, '_' and '-' (1-120 characters)"
            )
    return f"hps_et.{model}.{table}"


def check_keys(keys: np.ndarray) -> np.ndarray:
    """``keys`` as a 1-D int64 array (ValueError naming the problem otherwise)."""
    keys = np.asarray(keys)
    if keys.ndim != 1 or keys.dtype != np.int64:
        raise ValueError(f"keys must be a 1-D int64 array, got {keys.dtype} {keys.shape}")
    return keys


def check_rows(
    keys: np.ndarray, vectors: np.ndarray, vec_size: int, codec: Optional[RowCodec] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Checked ``(keys, rows)`` of an upsert: int64 ``[M]`` and C-contiguous rows of
    ``codec`` (default float32): float32 ``[M, vec_size]`` vectors are encoded, a row
    array of the codec is taken as it is (ValueError naming the problem otherwise)."""
    keys = check_keys(keys)
    codec = codec or RowCodec(DEFAULT_PRECISION, vec_size)
    vectors = np.asarray(vectors)
    try:
        rows = codec.as_rows(vectors, "vectors")
    except ValueError:
        rows = None
    if rows is None or rows.shape[0] != keys.shape[0]:
        raise ValueError(
            f"vectors must be float32 [{keys.shape[0]}, {vec_size}]"
            + (f" or {codec.precision} rows" if codec.precision != "fp32" else "")
            + f", got {vectors.dtype} {vectors.shape}"
        )
    return keys, rows


def last_occurrence(keys: np.ndarray) -> np.ndarray:
    """Indices of the last occurrence of every distinct key (a batch that repeats a key:
    the last row wins, as with consecutive writes)."""
    m = keys.shape[0]
    _, first_in_reversed = np.unique(keys[::-1], return_index=True)
    return np.sort(m - 1 - first_in_reversed)


def decode_values(
    values: Sequence[Optional[bytes]],
    keys: np.ndarray,
    out: np.ndarray,
    found: np.ndarray,
    default_value: float,
    where: str,
    codec: Optional[RowCodec] = None,
) -> None:
    """Write raw encoded rows (``None`` = missing) into ``out`` and ``found``.

    Used by the byte-level stores, whose values are rows of ``codec`` (default float32
    rows of ``out``'s width). ``out`` takes decoded float32 vectors, or the rows as they
    are when it is a row array of the codec. A value whose length is not
    ``codec.row_bytes`` raises :class:`StoreDataError` naming ``where`` (the table) and
    the key, before anything is written to ``out`` for that batch.
    """
    codec = codec or RowCodec(DEFAULT_PRECISION, out.shape[1])
    if codec.precision != DEFAULT_PRECISION:
        rows = out if codec.is_rows(out) else codec.empty(out.shape[0])
        _decode_raw(values, keys, rows, found, default_value, codec, where)
        if rows is not out:
            codec.decode(rows, out=out)
            out[~found] = default_value  # exactly the default, not its encoding
        return
    _decode_raw(values, keys, out, found, default_value, codec, where)


def _decode_raw(
    values: Sequence[Optional[bytes]],
    keys: np.ndarray,
    out: np.ndarray,
    found: np.ndarray,
    default_value: float,
    codec: RowCodec,
    where: str,
) -> None:
    """:func:`decode_values` into a row array ``out`` of ``codec`` (missing keys get the
    encoded default row, see :meth:`RowCodec.default_row`)."""
    row_bytes = codec.row_bytes
    hit = [i for i, v in enumerate(values) if v is not None]
    present = cast(Sequence[bytes], values)  # at the indices in hit (all of them if no miss)
    bad = [i for i in hit if len(present[i]) != row_bytes]
    if bad:
        i = bad[0]
        raise StoreDataError(
            f"{where}: the value of key {int(keys[i])} has {len(present[i])} bytes, expected "
            f"{row_bytes} ({codec.dim} values in {codec.precision}); {len(bad)} bad value(s) "
            "in this batch"
        )
    found[:] = False
    dtype = codec.row_dtype.newbyteorder("<")
    if len(hit) == len(values):
        out[:] = np.frombuffer(b"".join(present), dtype=dtype).reshape(out.shape)
        found[:] = True
        return
    out[:] = codec.default_row(default_value) if codec.precision != "fp32" else default_value
    if hit:
        idx = np.asarray(hit, dtype=np.int64)
        rows = np.frombuffer(b"".join(present[i] for i in hit), dtype=dtype)
        out[idx] = rows.reshape(len(hit), -1)
        found[idx] = True


def encode_keys(keys: np.ndarray) -> List[bytes]:
    """Each key as 8 little-endian bytes (the on-store key format of every byte-level tier)."""
    return keys.astype("<i8", copy=False).view("V8").tolist()


def decode_keys(raw: Sequence[bytes], where: str) -> np.ndarray:
    """The int64 keys of 8-byte little-endian ``raw`` keys (StoreDataError naming ``where``
    if one is not 8 bytes)."""
    for r in raw:
        if len(r) != 8:
            raise StoreDataError(
                f"{where}: a stored key has {len(r)} bytes, expected 8 (int64): {r[:16]!r}"
            )
    return np.frombuffer(b"".join(raw), dtype="<i8").astype(np.int64)


def chunks(n: int, size: int):
    """``(start, stop)`` of consecutive chunks of at most ``size`` covering ``range(n)``."""
    for s in range(0, n, size):
        yield s, min(n, s + size)


class BackingStore(abc.ABC):
    """A source of truth for one embedding table.

    Implementations state their thread-safety; all of them must allow concurrent
    :meth:`fetch` calls.
    """

    #: floats per vector
    vec_size: int
    #: value of every element of a vector whose key the store does not hold
    default_value: float
    #: short name used in metrics labels ("local", "redis", "rocksdb", ...)
    tier: str
    #: whether :meth:`upsert` and :meth:`delete` raise :class:`ReadOnlyStoreError`
    read_only: bool = True
    #: whether :meth:`num_rows` is exact (False: an estimate)
    exact_num_rows: bool = True
    #: set by stores that hold encoded rows (see :attr:`codec`)
    _codec: Optional[RowCodec] = None

    @property
    def codec(self) -> RowCodec:
        """How the store holds the rows (float32 unless the store was opened with a
        precision, :mod:`triton_rec.precision`)."""
        return self._codec or RowCodec(DEFAULT_PRECISION, self.vec_size)

    @abc.abstractmethod
    def fetch(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Write the vectors of ``keys`` (int64 ``[M]``) into ``out``: float32 ``[M, D]``
        (decoded), or a row array of :attr:`codec` (the rows as stored).

        Keys the store does not hold get ``default_value`` in every element (as a row
        array: :meth:`RowCodec.default_row`). Returns a bool ``[M]`` mask of the keys
        that were found.
        """

    def fetch_rows(self, keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """:meth:`fetch` into a row array of :attr:`codec` (ValueError for another array):
        the encoded rows, for a cache that holds the same encoding."""
        self.codec.check_rows(rows, keys.shape[0], f"{self!r}: fetch_rows")
        return self.fetch(keys, rows)

    @abc.abstractmethod
    def num_rows(self) -> int:
        """Rows the store holds (may be an estimate for remote stores)."""

    @abc.abstractmethod
    def sample_keys(self, n: int) -> np.ndarray:
        """Up to ``n`` keys the store holds, for cache warm-up (``init_ec``)."""

    def upsert(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Insert or overwrite the rows of ``keys`` (int64 ``[M]``) with ``vectors``
        (float32 ``[M, D]``).

        A key repeated in one call gets its last row. Returns the number of distinct
        keys written. Raises :class:`ReadOnlyStoreError` on a read-only store.
        """
        raise ReadOnlyStoreError(f"store {self!r} is read-only: cannot upsert {len(keys)} key(s)")

    def delete(self, keys: np.ndarray) -> int:
        """Remove the rows of ``keys``; returns how many of them the store held.

        Raises :class:`ReadOnlyStoreError` on a read-only store.
        """
        raise ReadOnlyStoreError(f"store {self!r} is read-only: cannot delete {len(keys)} key(s)")

    # Not abstract: a no-op default for the stores that hold nothing to release.
    def close(self) -> None:  # noqa: B027  # pragma: no cover - trivial default
        """Release connections/mappings."""

    # -- import bookkeeping (writable tiers; see triton_rec.storage.tiers.import_table) --------

    def native_table(self) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """``(index, vectors)`` of a node-local table that native code may read without
        Python (the misses of a cache in front of it: :class:`~triton_rec._native.
        LocalMisses`); None (the default) for every other store."""
        return None

    def get_meta(self, name: str) -> Optional[str]:
        """A small string stored beside the table (e.g. the content digest of the sparse
        files it was imported from), or None. Stores without metadata return None."""
        return None

    def set_meta(self, name: str, value: str) -> None:
        """Store ``value`` under ``name`` beside the table (writable tiers)."""
        raise ReadOnlyStoreError(f"store {self!r} keeps no metadata")

    def import_lock(self, timeout: float):
        """A context manager held while importing into this table: one importer at a time,
        whichever process or node it runs on. The default is a no-op (private stores)."""
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tier={self.tier!r}, vec_size={self.vec_size})"


class LocalTableStore(BackingStore):
    """A node-local :class:`EmbeddingTable` (memory-mapped, shared by all instances).

    Thread-safety: every method may be called from any number of threads.
    """

    tier = "local"

    def __init__(self, table: EmbeddingTable):
        self.table = table
        self.vec_size = table.vec_size
        self.default_value = table.default_value
        self._codec = table.codec

    def fetch(
        self, keys: np.ndarray, out: np.ndarray, missing: Optional[np.ndarray] = None
    ) -> np.ndarray:
        """Gather ``keys`` into ``out`` (the default for unknown keys); returns found."""
        t = self.table
        if out.dtype != np.float32 and t.codec.is_rows(out):  # encoded rows, as stored
            rows = np.empty(keys.shape[0], np.int64)
            _native.probe(t.native_index, check_keys(keys), rows)
            found = rows >= 0
            if found.all():
                np.take(t.vectors, rows, axis=0, out=out)
            else:
                out[found] = t.vectors[rows[found]]
                out[~found] = t.codec.default_row(t.default_value)
            return found
        missing = np.empty(keys.shape[0], dtype=np.uint8) if missing is None else missing
        _native.lookup(
            t.native_index,
            t.vectors,
            keys,
            out,
            t.default_value,
            missing=missing,
            precision=t.codec.code,
        )
        return missing == 0

    def num_rows(self) -> int:
        """Rows of the table."""
        return self.table.num_rows

    def native_table(self) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """The table's ``(index, vectors)`` as native code reads them (C-contiguous rows
        of the codec's dtype; the index a direct one where the keys are a range:
        :attr:`EmbeddingTable.native_index`), or None when they are not laid out that way.
        The index array is the table's own: it lives as long as the table."""
        t = self.table
        if not (
            t.index.flags.c_contiguous
            and t.vectors.flags.c_contiguous
            and t.vectors.dtype == self.codec.row_dtype
        ):
            return None
        return t.native_index, t.vectors

    def sample_keys(self, n: int) -> np.ndarray:
        """The first ``n`` keys of the table."""
        return np.asarray(self.table.keys[: max(0, min(n, self.table.num_rows))])

    def __repr__(self) -> str:
        return f"LocalTableStore({self.table.name!r}, path={self.table.path!r})"


class DictStore(BackingStore):
    """A Python dict of key -> vector: writable, obviously correct, slow.

    The reference of the contract suite (every store must answer as this one does),
    and a stand-in for a writable tier in tests.

    Args:
        vec_size: floats per vector.
        default_value: value of every element of an unknown key's vector.
        name: used in messages.

    Thread-safety: every method may be called from any number of threads (one lock).
    """

    tier = "dict"
    read_only = False

    def __init__(self, vec_size: int, default_value: float = 0.0, name: str = "dict"):
        if int(vec_size) < 1:
            raise ValueError(f"vec_size must be >= 1, got {vec_size}")
        self.vec_size = int(vec_size)
        self.default_value = float(default_value)
        self.name = name
        self._rows: Dict[int, np.ndarray] = {}
        self._meta: Dict[str, str] = {}
        self._lock = threading.Lock()

    def get_meta(self, name: str) -> Optional[str]:
        """The metadata string ``name``, or None."""
        with self._lock:
            return self._meta.get(name)

    def set_meta(self, name: str, value: str) -> None:
        """Store ``value`` under ``name``."""
        with self._lock:
            self._meta[name] = str(value)

    def fetch(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Write the rows of ``keys`` into ``out`` (the default for unknown keys); returns found."""
        keys = check_keys(keys)
        found = np.zeros(keys.shape[0], dtype=bool)
        with self._lock:
            for i, k in enumerate(keys.tolist()):
                row = self._rows.get(k)
                if row is None:
                    out[i] = self.default_value
                else:
                    out[i] = row
                    found[i] = True
        return found

    def upsert(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Insert or overwrite rows (last occurrence wins); returns the distinct keys written."""
        keys, vectors = check_rows(keys, vectors, self.vec_size)
        with self._lock:
            for k, v in zip(keys.tolist(), vectors):
                self._rows[k] = v.copy()
        return len(set(keys.tolist()))

    def delete(self, keys: np.ndarray) -> int:
        """Remove the rows of ``keys``; returns how many were held."""
        keys = check_keys(keys)
        with self._lock:
            return sum(self._rows.pop(k, None) is not None for k in set(keys.tolist()))

    def num_rows(self) -> int:
        """Rows held."""
        with self._lock:
            return len(self._rows)

    def sample_keys(self, n: int) -> np.ndarray:
        """Up to ``n`` held keys."""
        with self._lock:
            return np.fromiter(self._rows, dtype=np.int64, count=len(self._rows))[: max(0, n)]

    def __repr__(self) -> str:
        return f"DictStore({self.name!r}, vec_size={self.vec_size})"
