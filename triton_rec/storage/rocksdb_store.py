"""The persistent tier: one table in a RocksDB database (HPS ``persistent_db``), via rocksdict.

Layout (the HPS layout; one database may hold the tables of many models):

- one RocksDB database per ``path`` (ps.json ``persistent_db.path``);
- one **column family per table**; deployments name it ``hps_et.<model>.<table>`` as
  HPS does (:func:`triton_rec.storage.backing_store.tier_table_name`), e.g.
  ``hps_et.hps_demo.item``;
- key: the int64 key as 8 little-endian bytes; value: the vector as ``vec_size``
  little-endian float32 (``4 * vec_size`` bytes), nothing else.

A stored value of another length is reported (:class:`StoreDataError` naming the table
and the key), never returned in part.

Opening: RocksDB allows one read-write opener per database (a second process gets
:class:`StoreUnavailableError` naming the lock); any number of read-only openers, each
seeing the database as it was when it opened it. In one process, the stores of a
database share one read-write handle; read-only stores share a read-only handle that
holds their table (or the read-write one, which is current). :class:`RocksDBStore` is
that single-process store (and the ``read_only`` tier); :class:`NodeRocksDBTable` is
the table the processes of a node read and write together (secondary handles, a
node-wide writer lock).
"""

from __future__ import annotations

import logging

import numpy as np

from triton_rec.precision import DEFAULT_PRECISION, RowCodec
from triton_rec.storage.backing_store import (
    StoreError,
    StoreUnavailableError,
    check_keys,
    check_rows,
    chunks,
    encode_keys,
    last_occurrence,
)
from triton_rec.storage.rocksdb_base import (  # rocksdict: None when not installed
    ColumnFamilyReads,
    acquire_db,
    check_table_args,
    release_db,
    rocksdict,
)
from triton_rec.storage.rocksdb_node import (  # re-exported
    L0_COMPACTION_TRIGGER,
    META_COLUMN_FAMILY,
    NodeRocksDBTable,
)

__all__ = ["L0_COMPACTION_TRIGGER", "META_COLUMN_FAMILY", "NodeRocksDBTable", "RocksDBStore"]

log = logging.getLogger(__name__)


class RocksDBStore(ColumnFamilyReads):
    """One table (a column family) of a RocksDB database.

    Args:
        path: the database directory (created, with the column family, unless read_only).
        table_name: the column family, ``hps_et.<model>.<table>`` by convention
            (:func:`~triton_rec.storage.backing_store.tier_table_name`).
        vec_size: floats per vector.
        precision: how the values hold the rows (:mod:`triton_rec.precision`;
            ``embedding_precision`` of ps.json): every value is one encoded row.
        default_value: value of every element of an unknown key's vector.
        read_only: open the database read-only (the table must exist); upsert/delete raise
            :class:`~triton_rec.storage.backing_store.ReadOnlyStoreError`.
        max_batch_size: most keys per multi-get or write batch.
        num_threads: RocksDB background threads (``persistent_db.num_threads``).

    Raises:
        StoreUnavailableError: the database cannot be opened (missing, locked by another
            process) or, read-only, has no such column family (the message lists those it has).

    ``num_rows`` is RocksDB's estimate (``rocksdb.estimate-num-keys``): exact after plain
    inserts, approximate once keys are overwritten or deleted.

    Thread-safety: every method may be called from any number of threads.
    """

    tier = "rocksdb"
    exact_num_rows = False

    def __init__(
        self,
        path,
        table_name: str,
        vec_size: int,
        default_value: float = 0.0,
        read_only: bool = False,
        max_batch_size: int = 10000,
        num_threads: int = 16,
        precision: str = DEFAULT_PRECISION,
    ):
        check_table_args(table_name, vec_size, max_batch_size)
        self.path = str(path)
        self.table_name = table_name
        self.vec_size = int(vec_size)
        self._codec = RowCodec(precision, self.vec_size)
        self.default_value = float(default_value)
        self.read_only = bool(read_only)
        self.max_batch_size = int(max_batch_size)
        self._where = f"RocksDB {self.path} table {table_name!r}"
        self._real, self._h, self._cf = acquire_db(
            self.path, table_name, self.read_only, int(num_threads), self._where
        )
        try:
            self._handle = (
                None if self.read_only else self._h.db.get_column_family_handle(table_name)
            )
        except Exception as e:
            self._cf.close()
            self._cf = None
            release_db(self._real, self._h)
            raise StoreUnavailableError(f"{self._where}: cannot open the column family: {e}") from e
        self._closed = False

    def _get(self, what: str, fn, *args):
        if self._closed:
            raise StoreError(f"{self._where}: store is closed")
        try:
            return fn(*args)
        except StoreError:
            raise
        except Exception as e:
            raise StoreError(f"{self._where}: {what} failed: {e}") from e

    def _write(self, fill) -> None:
        wb = rocksdict.WriteBatch(raw_mode=True)
        wb.set_default_column_family(self._handle)
        fill(wb)
        self._get("write", self._h.db.write, wb)

    def upsert(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Insert or overwrite rows (last occurrence wins, in batches); returns rows written."""
        if self.read_only:
            return super().upsert(keys, vectors)
        keys, vectors = check_rows(keys, vectors, self.vec_size, self.codec)
        idx = last_occurrence(keys)
        keys, vectors = keys[idx], np.ascontiguousarray(vectors[idx])
        raw_k = encode_keys(keys)
        raw_v = vectors.view(f"V{self.codec.row_bytes}").ravel().tolist()
        for s, e in chunks(keys.shape[0], self.max_batch_size):

            def fill(wb, s=s, e=e):
                for k, v in zip(raw_k[s:e], raw_v[s:e]):
                    wb.put(k, v)

            self._write(fill)
        return int(keys.shape[0])

    def delete(self, keys: np.ndarray) -> int:
        """Remove ``keys``; one multi-get first counts those present (RocksDB does not say)."""
        if self.read_only:
            return super().delete(keys)
        keys = np.unique(check_keys(keys))
        raw = encode_keys(keys)
        present = self._count_present(raw)
        for s, e in chunks(keys.shape[0], self.max_batch_size):

            def fill(wb, s=s, e=e):
                for k in raw[s:e]:
                    wb.delete(k)

            self._write(fill)
        return present

    def close(self) -> None:
        """Release this store's column family; the last store of a database closes it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._cf.close()
        finally:
            # the column-family objects keep the database open (and locked) until dropped
            self._cf = self._handle = None
            release_db(self._real, self._h)

    def __repr__(self) -> str:
        mode = ", read_only" if self.read_only else ""
        return f"RocksDBStore({self.path!r}, {self.table_name!r}, vec_size={self.vec_size}{mode})"
