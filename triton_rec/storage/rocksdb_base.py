"""What both RocksDB tables (:mod:`triton_rec.storage.rocksdb_store`) share: the open
databases of this process (handles shared by every store of a database), options, column
families, argument checks, and the reads (:class:`ColumnFamilyReads`)."""

from __future__ import annotations

import abc
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Dict, List

import numpy as np

from triton_rec.storage.backing_store import (
    BackingStore,
    StoreError,
    StoreUnavailableError,
    check_keys,
    chunks,
    decode_keys,
    decode_values,
    encode_keys,
)

try:  # optional dependency (pip install rocksdict)
    import rocksdict
except ImportError:  # pragma: no cover - exercised only without rocksdict
    rocksdict = None  # type: ignore[assignment]  # optional module: None when absent

log = logging.getLogger("triton_rec.storage.rocksdb_store")  # the RocksDB stores' log

TABLE_RE = re.compile(r"[A-Za-z0-9_.-]{1,250}")


@dataclass
class OpenDB:
    """One open database of this process: its handle, its mode and its users."""

    db: rocksdict.Rdict
    read_only: bool
    users: int


# The open databases of this process, by real path, shared by every store using them: a
# read-write handle serves every store of its database; a read-only one (a snapshot taken
# when it opened) serves the read-only stores whose table it holds.
_DBS: Dict[str, List[OpenDB]] = {}
_DBS_LOCK = threading.Lock()


def db_options(num_threads: int, create: bool) -> rocksdict.Options:
    """Options of a database: raw keys and values; ``num_threads`` background threads."""
    opts = rocksdict.Options(raw_mode=True)
    if create:
        opts.create_if_missing(True)
    if num_threads > 1:
        opts.increase_parallelism(num_threads)
    return opts


def column_family(db: rocksdict.Rdict, name: str, create: bool, options=None):
    """The column family ``name`` of ``db`` (created if ``create``, with ``options``), or
    None if absent."""
    try:
        return db.get_column_family(name)
    except Exception:  # rocksdict: "column name ... does not exist"
        if not create:
            return None
    return db.create_column_family(name, options or rocksdict.Options(raw_mode=True))


def _open(path: str, real: str, read_only: bool, num_threads: int) -> rocksdict.Rdict:
    try:
        if read_only:
            if not os.path.isdir(real):
                raise StoreUnavailableError(f"RocksDB {path}: no database there (opened read-only)")
            return rocksdict.Rdict(
                real,
                db_options(num_threads, create=False),
                access_type=rocksdict.AccessType.read_only(),
            )
        os.makedirs(real, exist_ok=True)
        return rocksdict.Rdict(real, db_options(num_threads, create=True))
    except StoreError:
        raise
    except Exception as e:  # rocksdict raises plain Exception
        hint = (
            " (another process holds it read-write: open it read_only there or here)"
            if "lock" in str(e).lower()
            else ""
        )
        raise StoreUnavailableError(f"RocksDB {path}: cannot open: {e}{hint}") from e


def acquire_db(path: str, table: str, read_only: bool, num_threads: int, where: str):
    """``(real path, handle, column family view)`` for one store; see ``_DBS``."""
    real = os.path.realpath(path)
    with _DBS_LOCK:
        handles = _DBS.setdefault(real, [])
        try:
            for h in sorted(handles, key=lambda h: h.read_only):  # read-write first
                if h.read_only and not read_only:
                    continue
                cf = column_family(h.db, table, create=not read_only)
                if cf is not None:
                    h.users += 1
                    return real, h, cf
            db = _open(path, real, read_only, num_threads)
            cf = column_family(db, table, create=not read_only)
            if cf is None:
                db.close()
                have = [c for c in rocksdict.Rdict.list_cf(real) if c != "default"]
                raise StoreUnavailableError(
                    f"{where}: no such column family in the database "
                    f"(it has: {', '.join(have) or 'none'})"
                )
        except StoreError:
            raise
        except Exception as e:
            raise StoreUnavailableError(f"{where}: cannot open the column family: {e}") from e
        finally:
            if not handles:
                _DBS.pop(real, None)
        h = OpenDB(db, read_only, 1)
        _DBS.setdefault(real, []).append(h)
        return real, h, cf


def release_db(real: str, h: OpenDB) -> None:
    """A store is done with ``h``: the last user closes it."""
    with _DBS_LOCK:
        h.users -= 1
        if h.users == 0:
            handles = _DBS.get(real, [])
            if h in handles:
                handles.remove(h)
            if not handles:
                _DBS.pop(real, None)
            try:
                h.db.close()
            except Exception as e:  # e.g. the directory was removed under it
                log.warning("RocksDB %s: close failed: %s", real, e)


def check_table_args(table_name: str, vec_size: int, max_batch_size: int) -> None:
    """Constructor checks both RocksDB stores make."""
    if rocksdict is None:
        raise StoreUnavailableError(
            "RocksDB store: the rocksdict package is not installed (pip install rocksdict)"
        )
    if not isinstance(table_name, str) or not TABLE_RE.fullmatch(table_name):
        raise ValueError(f"RocksDB table name {table_name!r}: letters, digits, '_', '-', '.' only")
    if int(vec_size) < 1 or int(max_batch_size) < 1:
        raise ValueError(
            f"vec_size and max_batch_size must be >= 1, got {vec_size}, {max_batch_size}"
        )


class ColumnFamilyReads(BackingStore):
    """The reads both RocksDB stores share. Subclasses set ``_cf`` (the table's column
    family), ``_where``, ``max_batch_size`` and ``default_value``, and implement
    :meth:`_get` (run a read, translating errors)."""

    # Set by the subclasses (declared here for the type checker only).
    _cf: Any
    _where: str
    max_batch_size: int

    @abc.abstractmethod
    def _get(self, what: str, fn, *args):
        """Run the read ``fn(*args)``, translating errors into StoreError naming the table.
        ``fn`` must look ``self._cf`` up when called (a lambda, not a bound method of
        it): the node store may replace its handles before running it."""

    def fetch(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` into ``out`` (the default value where absent); found flags."""
        keys = check_keys(keys)
        found = np.zeros(keys.shape[0], dtype=bool)
        raw = encode_keys(keys)
        for s, e in chunks(keys.shape[0], self.max_batch_size):
            values = self._get("multi-get", lambda r: self._cf.get(r), raw[s:e])
            decode_values(
                values, keys[s:e], out[s:e], found[s:e], self.default_value, self._where, self.codec
            )
        return found

    def _count_present(self, raw: List[bytes]) -> int:
        """How many of the encoded keys ``raw`` the table holds (RocksDB deletes do not say)."""
        return sum(
            sum(
                int(v is not None)
                for v in self._get("multi-get", lambda r: self._cf.get(r), raw[s:e])
            )
            for s, e in chunks(len(raw), self.max_batch_size)
        )

    def num_rows(self) -> int:
        """RocksDB's estimate of the keys in the column family (``rocksdb.estimate-num-keys``)."""
        n = self._get(
            "num_rows", lambda p: self._cf.property_int_value(p), "rocksdb.estimate-num-keys"
        )
        return int(n or 0)

    def sample_keys(self, n: int) -> np.ndarray:
        """The first ``n`` keys in RocksDB order (bytewise order of the little-endian keys)."""

        def first_n():
            raw = []
            it = self._cf.iter()
            it.seek_to_first()
            while it.valid() and len(raw) < n:
                raw.append(it.key())
                it.next()
            return raw

        return decode_keys(self._get("iteration", first_n) if n > 0 else [], self._where)
