"""The RocksDB table the processes of a node read and write together
(:class:`NodeRocksDBTable`; :mod:`triton_rec.storage.rocksdb_store` says the layout):
secondary handles that catch up, one read-write handle per process under a node-wide
writer lock (:class:`_NodeWriter`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from typing import Any, Dict, Optional, Set, Tuple

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
    check_table_args,
    column_family,
    db_options,
    log,
    rocksdict,
)
from triton_rec.util.procfs import flock_exclusive

META_COLUMN_FAMILY = "__trec_meta__"
#: writes compact the table when it has this many level-0 files: every write batch
#: opens and closes the database, which leaves one small L0 file, and background
#: compactions never get the time to merge them (measured: 29 L0 files made a 1024-key
#: multi-get 6.5x slower than after compaction)
L0_COMPACTION_TRIGGER = 8


def _node_options(num_threads: int = 1, create: bool = False) -> rocksdict.Options:
    """Options of the node databases: bloom filters (a get for a missing key skips most
    files), few info-log files."""
    opts = db_options(num_threads, create)
    table = rocksdict.BlockBasedOptions()
    table.set_bloom_filter(10, False)
    opts.set_block_based_table_factory(table)
    opts.set_keep_log_file_num(2)
    return opts


class _NodeWriter:
    """The read-write side of one node database in this process, shared by every
    :class:`NodeRocksDBTable` of that database here (one ``flock`` fd and one read-write
    handle per process and database: the tables of a model update one after another
    without waiting for each other's hold to expire).

    :meth:`primary` opens the database read-write under the node-wide writer lock
    ``<path>.writer.lock`` and keeps both for ``hold_seconds`` after the last write (a
    steady stream of updates does not pay an open per batch, and RocksDB's background
    flushes and compactions get to run), never longer than ``max_hold_seconds`` in one
    go, so the other processes of the node get their turn to write.
    """

    _open: Dict[str, _NodeWriter] = {}
    _open_lock = threading.Lock()

    def __init__(self, path: str, num_threads: int, hold_seconds: float, max_hold_seconds: float):
        self.path = path
        self.num_threads = num_threads
        self.hold_seconds = hold_seconds
        self.max_hold_seconds = max_hold_seconds
        self.lock_path = path + ".writer.lock"
        self.users = 0
        self._lock = threading.RLock()  # serialises this process's writes
        # while writing: (lock fd, read-write handle, time acquired, column families)
        self._held: Optional[Tuple[int, Any, float, Set[str]]] = None
        self._generation = 0

    @classmethod
    def acquire(
        cls, path: str, num_threads: int, hold_seconds: float, max_hold_seconds: float
    ) -> _NodeWriter:
        """The writer of database ``path`` (settings of its first user win)."""
        with cls._open_lock:
            w = cls._open.get(path)
            if w is None:
                w = cls._open[path] = cls(path, num_threads, hold_seconds, max_hold_seconds)
            w.users += 1
            return w

    def release(self) -> None:
        """One user less; the last one closes the handle and drops the lock."""
        with self._open_lock:
            self.users -= 1
            if self.users > 0:
                return
            if self._open.get(self.path) is self:
                del self._open[self.path]
        with self._lock:
            self._generation += 1
            self._release_primary()

    @contextlib.contextmanager
    def primary(self, where: str, column_families, lock_timeout: float):
        """The database opened read-write under the writer lock, with the column
        families ``column_families`` created if missing; yields the handle."""
        with self._lock:
            if self._held is None:
                self._held = self._open_primary(where, lock_timeout)
            self._generation += 1  # any pending idle release is now stale
            try:
                fd, db, t0, have = self._held
                for name in column_families:
                    if name not in have:
                        column_family(db, name, create=True, options=_node_options())
                        have.add(name)
                yield db
            except StoreError:
                self._release_primary()
                raise
            except Exception as e:
                self._release_primary()
                hint = (
                    " (a process outside this backend holds it read-write)"
                    if "lock" in str(e).lower()
                    else ""
                )
                raise StoreUnavailableError(f"{where}: write failed: {e}{hint}") from e
            if self._held is not None:
                if time.monotonic() - self._held[2] >= self.max_hold_seconds:
                    self._release_primary()
                else:
                    gen = self._generation
                    t = threading.Timer(self.hold_seconds, self._release_if_idle, (gen,))
                    t.daemon = True
                    t.start()

    def _open_primary(self, where: str, lock_timeout: float):
        """``(lock fd, read-write handle, time acquired, column family names)``: flock,
        then open/create with every column family the database has (RocksDB's rule for
        a read-write open)."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd = _lock_fd(self.lock_path, lock_timeout, where)
        try:
            cf_opts = {}
            if os.path.exists(os.path.join(self.path, "CURRENT")):  # a database, not just a dir
                cf_opts = {
                    c: _node_options() for c in rocksdict.Rdict.list_cf(self.path) if c != "default"
                }
            db = rocksdict.Rdict(
                self.path,
                _node_options(self.num_threads, create=True),
                column_families=cf_opts or None,
            )
        except Exception as e:
            os.close(fd)
            hint = (
                " (a process outside this backend holds it read-write)"
                if "lock" in str(e).lower()
                else ""
            )
            raise StoreUnavailableError(f"{where}: cannot open read-write: {e}{hint}") from e
        return fd, db, time.monotonic(), set(cf_opts)

    def _release_if_idle(self, generation: int) -> None:
        with self._lock:
            if generation == self._generation:
                self._release_primary()

    def _release_primary(self) -> None:
        """Close the read-write handle and release the writer lock (``_lock`` held)."""
        held, self._held = self._held, None
        if held is None:
            return
        fd, db = held[0], held[1]
        try:
            db.close()
        except Exception as e:  # pragma: no cover - best effort
            log.warning("RocksDB %s: close failed: %s", self.path, e)
        finally:
            del db, held
            os.close(fd)  # releases the flock


class NodeRocksDBTable(ColumnFamilyReads):
    """One table of a RocksDB database that several processes of a node serve at once.

    RocksDB allows one read-write opener per database, and every Triton model instance
    is its own process. So each instance reads through its own **secondary** handle
    (``AccessType.secondary``), which follows the database's writes when it catches up
    (at most every ``catch_up_interval`` seconds, inside :meth:`fetch`, and right after
    its own writes) and is opened again when a table was added to the database since
    (a secondary cannot follow a new column family). Writes (:meth:`upsert`,
    :meth:`delete`, :meth:`set_meta`) go through the process's :class:`_NodeWriter` of
    the database: an exclusive ``flock`` on ``<path>.writer.lock`` and a read-write
    handle (20-60 ms to open on this VM), kept while writes keep coming
    (``hold_seconds`` idle, ``max_hold_seconds`` at most), then closed, so any process
    may write while the others keep serving.

    Metadata (:meth:`get_meta`) lives in the column family ``__trec_meta__`` under the
    key ``<table>/<name>``.

    Args:
        path: the database directory (created with the column family on first use).
        table_name, vec_size, default_value, max_batch_size, num_threads: as for
            :class:`RocksDBStore`.
        lock_timeout: seconds a write waits for the writer lock before
            :class:`StoreUnavailableError`.
        catch_up_interval: seconds between catch-ups with the writers.
        hold_seconds, max_hold_seconds: how long the writer lock and handle are kept
            after a write / at most in one go (the first table of the database in this
            process sets them for all).

    Thread-safety: every method may be called from any number of threads.
    """

    tier = "rocksdb"
    read_only = False
    exact_num_rows = False
    # The secondary handle and its column families; None while closed or being reopened.
    _db: Any
    _meta: Any

    def __init__(
        self,
        path,
        table_name: str,
        vec_size: int,
        default_value: float = 0.0,
        max_batch_size: int = 10000,
        num_threads: int = 4,
        lock_timeout: float = 600.0,
        catch_up_interval: float = 0.5,
        hold_seconds: float = 0.5,
        max_hold_seconds: float = 2.0,
        precision: str = DEFAULT_PRECISION,
    ):
        check_table_args(table_name, vec_size, max_batch_size)
        self.path = os.path.abspath(str(path))
        self.table_name = table_name
        self.vec_size = int(vec_size)
        self._codec = RowCodec(precision, self.vec_size)
        self.default_value = float(default_value)
        self.max_batch_size = int(max_batch_size)
        self.num_threads = int(num_threads)
        self.lock_timeout = float(lock_timeout)
        self.catch_up_interval = float(catch_up_interval)
        self._where = f"RocksDB {self.path} table {table_name!r}"
        self._io = threading.Lock()  # serialises catch-up with reads of this process
        self._closed = False
        self._writer = _NodeWriter.acquire(
            self.path, self.num_threads, float(hold_seconds), float(max_hold_seconds)
        )
        # Create the database and the column families once (under the writer lock), then
        # follow it as a secondary (which sees the column families that exist when it
        # opens: ours does by then).
        try:
            with self._primary():
                pass
        except BaseException:
            self._writer.release()
            raise
        _remove_dead_secondaries(self.path + ".secondary")
        self._secondary_dir = os.path.join(
            self.path + ".secondary", f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._db = self._cf = self._meta = None
        self.reopened = 0  # secondary handles opened again (column families added)
        try:
            os.makedirs(self._secondary_dir, exist_ok=True)
            self._open_secondary()
        except Exception as e:
            shutil.rmtree(self._secondary_dir, ignore_errors=True)
            self._writer.release()
            raise StoreUnavailableError(f"{self._where}: cannot open as a secondary: {e}") from e
        self._last_catch_up = time.monotonic()

    def _open_secondary(self) -> None:
        """Open this process's secondary handle with every column family there is now
        (``_io`` held, or in the constructor)."""
        cfs = {c: _node_options() for c in rocksdict.Rdict.list_cf(self.path) if c != "default"}
        db = rocksdict.Rdict(
            self.path,
            _node_options(),
            column_families=cfs,
            access_type=rocksdict.AccessType.secondary(self._secondary_dir),
        )
        try:
            cf = db.get_column_family(self.table_name)
            meta = db.get_column_family(META_COLUMN_FAMILY)
        except Exception:
            db.close()
            raise
        self._db, self._cf, self._meta = db, cf, meta

    # -- plumbing ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _primary(self):
        """The database opened read-write (see :class:`_NodeWriter`); yields it."""
        if self._closed:
            raise StoreError(f"{self._where}: store is closed")
        with self._writer.primary(
            self._where, (self.table_name, META_COLUMN_FAMILY), self.lock_timeout
        ) as db:
            yield db

    def catch_up(self) -> None:
        """Make this process's view current with every write made so far."""
        with self._io:
            self._catch_up_locked()

    def _catch_up_locked(self) -> None:
        if self._db is None:  # a reopen failed before: try again
            try:
                self._open_secondary()
            except Exception as e:
                raise StoreUnavailableError(
                    f"{self._where}: cannot open as a secondary: {e}"
                ) from e
        try:
            self._db.try_catch_up_with_primary()
        except Exception as e:
            if "unknown column family" not in str(e):
                raise StoreUnavailableError(f"{self._where}: catch-up failed: {e}") from e
            # Another table was added to the database after this handle opened; a
            # secondary cannot follow that (RocksDB reports the MANIFEST as corrupt), so
            # open it again with the column families there are now (rare: once per table
            # added to the node's database).
            db = self._db
            self._db = self._cf = self._meta = None  # column families first, then the db
            try:
                db.close()
            except Exception as close_error:  # pragma: no cover - best effort
                log.warning("%s: close failed: %s", self._where, close_error)
            del db
            try:
                self._open_secondary()
            except Exception as e2:
                raise StoreUnavailableError(
                    f"{self._where}: cannot open as a secondary again: {e2}"
                ) from e2
            self.reopened += 1
            log.info(
                "%s: secondary handle reopened (a table was added to the database)", self._where
            )
        self._last_catch_up = time.monotonic()

    def _get(self, what: str, fn, *args):
        if self._closed:
            raise StoreError(f"{self._where}: store is closed")
        with self._io:
            if time.monotonic() - self._last_catch_up > self.catch_up_interval:
                self._catch_up_locked()
            try:
                return fn(*args)
            except Exception as e:
                raise StoreError(f"{self._where}: {what} failed: {e}") from e

    def _write_batches(self, fill_batches) -> None:
        with self._primary() as db:
            handle = db.get_column_family_handle(self.table_name)
            for fill in fill_batches:
                wb = rocksdict.WriteBatch(raw_mode=True)
                wb.set_default_column_family(handle)
                fill(wb)
                db.write(wb)
            del handle
            cf = db.get_column_family(self.table_name)
            if (cf.property_int_value("rocksdb.num-files-at-level0") or 0) >= L0_COMPACTION_TRIGGER:
                cf.compact_range(None, None)
            del cf
        self.catch_up()

    def compact(self) -> None:
        """Compact the table into as few files as possible (after a bulk import)."""
        with self._primary() as db:
            cf = db.get_column_family(self.table_name)
            cf.compact_range(None, None)
            del cf
        self.catch_up()

    # -- BackingStore ---------------------------------------------------------------

    def upsert(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Insert or overwrite rows (last occurrence wins, in batches); returns rows written."""
        keys, vectors = check_rows(keys, vectors, self.vec_size, self.codec)
        idx = last_occurrence(keys)
        keys, vectors = keys[idx], np.ascontiguousarray(vectors[idx])
        raw_k = encode_keys(keys)
        raw_v = vectors.view(f"V{self.codec.row_bytes}").ravel().tolist()

        def batch(s, e):
            def fill(wb):
                for k, v in zip(raw_k[s:e], raw_v[s:e]):
                    wb.put(k, v)

            return fill

        self._write_batches(batch(s, e) for s, e in chunks(keys.shape[0], self.max_batch_size))
        return int(keys.shape[0])

    def delete(self, keys: np.ndarray) -> int:
        """Remove the rows of ``keys``; returns how many were held."""
        keys = np.unique(check_keys(keys))
        raw = encode_keys(keys)
        self.catch_up()
        present = self._count_present(raw)

        def batch(s, e):
            def fill(wb):
                for k in raw[s:e]:
                    wb.delete(k)

            return fill

        self._write_batches(batch(s, e) for s, e in chunks(keys.shape[0], self.max_batch_size))
        return present

    def get_meta(self, name: str) -> Optional[str]:
        """The metadata string ``name``, or None."""
        self.catch_up()
        v = self._get(
            "meta read", lambda k: self._meta.get(k), f"{self.table_name}/{name}".encode()
        )
        return None if v is None else bytes(v).decode()

    def set_meta(self, name: str, value: str) -> None:
        """Store ``value`` under ``name``."""
        with self._primary() as db:
            meta = db.get_column_family(META_COLUMN_FAMILY)
            meta[f"{self.table_name}/{name}".encode()] = str(value).encode()
            del meta
        self.catch_up()

    def import_lock(self, timeout: float):
        """One importer per table and node: an ``flock`` of ``<path>.<table>.import.lock``."""
        return _flock(f"{self.path}.{self.table_name}.import.lock", timeout, self._where)

    def close(self) -> None:
        """Release the writer lock, close the database, remove the secondary directory."""
        if self._closed:
            return
        self._closed = True
        self._writer.release()
        with self._io:
            self._cf = self._meta = None
            try:
                self._db.close()
            except Exception as e:  # pragma: no cover - best effort
                log.warning("%s: close failed: %s", self._where, e)
            self._db = None
        shutil.rmtree(self._secondary_dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"NodeRocksDBTable({self.path!r}, {self.table_name!r}, vec_size={self.vec_size})"


def _remove_dead_secondaries(parent: str) -> None:
    """Remove the secondary-handle directories (``<pid>-<id>``) of processes that no
    longer exist (a SIGKILLed instance cannot remove its own)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def _lock_fd(path: str, timeout: float, where: str) -> int:
    """An fd of ``path`` (created) holding an exclusive ``flock``, waited for at most
    ``timeout`` s; closing the fd releases it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flock_exclusive(
            fd,
            time.monotonic() + timeout,
            lambda: StoreUnavailableError(
                f"{where}: {path} is held by another process; gave up after {timeout:.0f} s"
            ),
            min_delay=0.005,
            max_delay=0.005,
        )
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _flock(path: str, timeout: float, where: str):
    """An exclusive ``flock`` of ``path`` (created), waited for at most ``timeout`` s."""
    fd = _lock_fd(path, timeout, where)
    try:
        yield
    finally:
        os.close(fd)
