"""The volatile tier: one table in a Redis Cluster (HPS ``volatile_db`` of type ``redis_cluster``).

Layout (HPS's, HugeCTR v23.09 ``redis_backend.cpp``; docs/upstream-notes.md):

- a table ``T`` (deployments: ``hps_et.<model>.<table>``,
  :func:`triton_rec.storage.backing_store.tier_table_name`) is split in ``num_partitions``
  Redis hashes with the keys ``hps_et{T/p<i>}v``, ``i = 0 .. num_partitions-1``. The
  ``{...}`` hash tag puts each partition in one hash slot on one master, and the
  partitions of a table spread over the masters;
- a key goes to partition ``rrxmrrxmsx_0(key) % num_partitions`` (:func:`partition_of`);
- hash field: the int64 key as 8 little-endian bytes; value: the vector as
  ``vec_size`` little-endian float32, nothing else.

So a Redis that HPS filled (with the same ``num_partitions``) is read as it is. Our own
bookkeeping lives beside it: sorted sets ``hps_et{T/p<i>}z`` for the overflow policies
(HPS keeps hashes ``...t`` of its own, which we leave alone) and the hash
``hps_et{T/meta}`` (import marker).

Bulk reads are pipelined HMGETs (one per partition and chunk of ``max_batch_size``
keys), bulk writes pipelined HSETs; redis-py sends the commands of all masters before
reading the replies. A value of the wrong length is reported
(:class:`StoreDataError` naming the table and the key), never returned in part.

Failures never hang: connect and socket timeouts (2 s by default), a bounded number
of cluster retries with a short backoff, a bounded wait for a free connection; they
raise :class:`StoreUnavailableError` naming the cluster's address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from typing import Any, List, Optional, Sequence

import numpy as np

from triton_rec.config.ps_json import (
    MAX_TIER_COUNT,
    OVERFLOW_POLICIES,
    OverflowPolicy,
    VolatileDBParams,
    default_num_partitions,
    field_defaults,
)
from triton_rec.precision import DEFAULT_PRECISION, RowCodec
from triton_rec.storage.backing_store import (
    BackingStore,
    StoreDataError,
    StoreError,
    StoreUnavailableError,
    check_keys,
    check_rows,
    chunks,
    decode_keys,
    decode_values,
    encode_keys,
    last_occurrence,
)
from triton_rec.storage.redis_connection import RedisConnection, parse_address

try:  # optional dependency (pip install redis)
    import redis
except ImportError as _e:  # pragma: no cover - exercised only without redis-py
    redis = None  # type: ignore[assignment]  # optional module: None when absent
    _IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

__all__ = [
    "PARTITIONS_META",
    "PARTITION_SAMPLE",
    "RedisClusterStore",
    "RedisConnection",
    "mix64",
    "parse_address",
    "partition_of",
]

log = logging.getLogger(__name__)

_TABLE_RE = re.compile(r"[A-Za-z0-9_.-]{1,250}")
_C1 = np.uint64(0xA24BAED4963EE407)
_C2 = np.uint64(0x9FB21C651E98DF25)


def _rotr(x: np.ndarray, n: int) -> np.ndarray:
    return (x >> np.uint64(n)) | (x << np.uint64(64 - n))


def mix64(keys: np.ndarray) -> np.ndarray:
    """Pelle Evensen's rrxmrrxmsx_0 mixer of every int64 key (as uint64), the function
    HPS partitions Redis tables with (HugeCTR ``database_backend_detail.hpp``)."""
    x = keys.astype(np.int64, copy=False).view(np.uint64)
    with np.errstate(over="ignore"):
        x = x ^ _rotr(x, 25) ^ _rotr(x, 50)
        x = x * _C1
        x = x ^ _rotr(x, 24) ^ _rotr(x, 49)
        x = x * _C2
        return x ^ (x >> np.uint64(28))


#: field of the table's metadata hash that records its partition count
PARTITIONS_META = "num_partitions"
#: keys sampled per partition hash to detect the partition count of a table HPS wrote
PARTITION_SAMPLE = 64
#: the volatile_db defaults (one source: the ps.json dataclass)
_DEFAULTS = field_defaults(VolatileDBParams)


def partition_of(keys: np.ndarray, num_partitions: int) -> np.ndarray:
    """The partition (``0 .. num_partitions-1``) of every key: ``mix64(key) % num_partitions``,
    as HPS computes it.

    A fixed function of the key alone (never Python's ``hash``), so every process, every
    later version and HPS agree on where a key lives.
    """
    return (mix64(keys) % np.uint64(num_partitions)).astype(np.intp)


class RedisClusterStore(BackingStore):
    """One table in a Redis Cluster, as ``num_partitions`` hashes (see the module docstring).

    Args:
        address: ``"host:port,host:port"``: some masters of the cluster (the others are
            discovered).
        table_name: ``<model>.<table>`` by convention
            (:func:`~triton_rec.storage.backing_store.tier_table_name`).
        vec_size: floats per vector.
        default_value: value of every element of an unknown key's vector.
        precision: how the hash values hold the rows (:mod:`triton_rec.precision`;
            ``embedding_precision`` of ps.json): every value is one encoded row.
        num_partitions: hashes per table; it decides where a key lives, so it must be the
            writer's. None: the count of the table the cluster holds (recorded by this
            project, else found from where its keys are, :meth:`_detect_partitions`; an
            ambiguous layout is refused), and for a new table HPS's default
            (:func:`~triton_rec.config.ps_json.default_num_partitions`). A count that
            contradicts the one recorded for the table is refused.
        max_batch_size: most keys per HMGET/HSET/HDEL command.
        connection: how to connect (credentials, TLS, connections per master, timeouts,
            retries): the keyword arguments of :class:`RedisConnection`, which defines
            them and their defaults once for the tier and the update streams.

    Raises:
        StoreUnavailableError: the cluster cannot be reached (names ``address``).
        ConfigError: a malformed ``address``.

    Thread-safety: every method may be called from any number of threads.
    """

    tier = "redis"
    read_only = False

    def __init__(
        self,
        address: str,
        table_name: str,
        vec_size: int,
        default_value: float = 0.0,
        *,
        num_partitions: Optional[int] = _DEFAULTS["num_partitions"],
        max_batch_size: int = _DEFAULTS["max_batch_size"],
        overflow_margin: Optional[int] = _DEFAULTS["overflow_margin"],
        overflow_policy: str = _DEFAULTS["overflow_policy"],
        overflow_resolution_target: float = _DEFAULTS["overflow_resolution_target"],
        refresh_time_after_fetch: bool = False,
        precision: str = DEFAULT_PRECISION,
        **connection: Any,
    ):
        self._codec = RowCodec(precision, int(vec_size))
        if redis is None:
            raise StoreUnavailableError(
                f"Redis store: the redis package cannot be imported ({_IMPORT_ERROR}; "
                "pip install redis)"
            )
        if not isinstance(table_name, str) or not _TABLE_RE.fullmatch(table_name):
            raise ValueError(
                f"Redis table name {table_name!r}: letters, digits, '_', '-', '.' only"
            )
        for what, v in (
            ("vec_size", vec_size),
            ("num_partitions", 1 if num_partitions is None else num_partitions),
            ("max_batch_size", max_batch_size),
        ):
            if int(v) < 1:
                raise ValueError(f"{what} must be >= 1, got {v}")
        self.address = address
        self.table_name = table_name
        self.vec_size = int(vec_size)
        self.default_value = float(default_value)
        self.max_batch_size = int(max_batch_size)
        self.meta_key = f"hps_et{{{table_name}/meta}}".encode()
        self._where = f"Redis Cluster {address} table {table_name!r}"
        self._conn = RedisConnection(address, where=self._where, **connection)
        self._client = self._conn.client
        try:
            self.num_partitions = self._resolve_partitions(num_partitions)
        except BaseException:
            self._conn.close()
            raise
        # HPS's value hashes: hps_et{<table>/p<i>}v, the {...} hash tag puts a partition
        # (and its bookkeeping below) in one slot
        self.hash_keys = [
            f"hps_et{{{table_name}/p{i}}}v".encode() for i in range(self.num_partitions)
        ]
        # Overflow bookkeeping: one sorted set per partition, in the partition's slot (same
        # hash tag), scoring every key by write time (evict_oldest; access time too with
        # refresh_time_after_fetch) or by reads (evict_least_used). Only kept with a margin.
        if overflow_policy not in OVERFLOW_POLICIES:
            raise ValueError(
                f"overflow_policy {overflow_policy!r}: "
                f"{', '.join(OVERFLOW_POLICIES[:-1])} or {OVERFLOW_POLICIES[-1]}"
            )
        if overflow_margin is not None and int(overflow_margin) < 1:
            raise ValueError(f"overflow_margin must be >= 1, got {overflow_margin}")
        if not 0.0 < float(overflow_resolution_target) < 1.0:
            raise ValueError(
                f"overflow_resolution_target must be within ]0, 1[, "
                f"got {overflow_resolution_target}"
            )
        self.overflow_margin = None if overflow_margin is None else int(overflow_margin)
        self.overflow_policy = overflow_policy
        self.overflow_target: Optional[int] = None
        if self.overflow_margin is not None:
            self.overflow_target = max(
                0, int(self.overflow_margin * float(overflow_resolution_target))
            )
        self.refresh_time_after_fetch = bool(refresh_time_after_fetch)
        self._scored = (
            self.overflow_margin is not None and overflow_policy != OverflowPolicy.EVICT_RANDOM
        )
        # "z", not HPS's "t": HPS keeps plain hashes of times / counts there
        self.score_keys = [h[:-1] + b"z" for h in self.hash_keys]
        self.evicted = 0  # rows removed by overflow handling (this process)

    # -- partitions -------------------------------------------------------------------

    def _resolve_partitions(self, given: Optional[int]) -> int:
        """The table's partition count (see ``num_partitions`` in the class docstring); the
        count is recorded in the table's metadata the first time."""
        recorded = self.get_meta(PARTITIONS_META)
        if recorded is not None and given is not None and int(recorded) != int(given):
            raise StoreDataError(
                f"{self._where}: volatile_db.num_partitions is {given} but the table was "
                f"written with {recorded} partitions: every key would be looked for in the "
                f"wrong hash; remove num_partitions or set it to {recorded}"
            )
        if recorded is not None:
            return int(recorded)
        n = int(given) if given is not None else self._detect_partitions()
        self.run_commands("HSETNX", lambda pipe: pipe.hsetnx(self.meta_key, PARTITIONS_META, n))
        return n

    def _detect_partitions(self) -> int:
        """The partition count of a table HPS wrote (its count is min(16, hardware
        threads) of the machine that wrote it): the hashes present give a lower bound, and
        the count is the one under which every sampled key sits in its own partition.
        A new table gets :func:`default_num_partitions`; a layout that fits no count, or
        several, is refused (StoreDataError) rather than answered with default values."""
        names = [f"hps_et{{{self.table_name}/p{i}}}v".encode() for i in range(MAX_TIER_COUNT)]
        exists = self.run_commands("EXISTS", lambda pipe: [pipe.exists(h) for h in names])
        present = [i for i, e in enumerate(exists) if e]
        if not present:
            return default_num_partitions()
        samples = self.run_commands(
            "HRANDFIELD",
            lambda pipe: [pipe.hrandfield(names[i], PARTITION_SAMPLE) for i in present],
        )
        parts = np.concatenate(
            [np.full(len(raw), p, dtype=np.uint64) for p, raw in zip(present, samples)]
        )
        hashed = mix64(decode_keys([k for raw in samples for k in raw], self._where))
        fits = [
            n
            for n in range(max(present) + 1, MAX_TIER_COUNT + 1)
            if np.array_equal(hashed % np.uint64(n), parts)
        ]
        if len(fits) == 1:
            return fits[0]
        fix = "set volatile_db.num_partitions in ps.json to the count the writer used"
        if not fits:
            raise StoreDataError(
                f"{self._where}: the table's hashes p{min(present)}..p{max(present)} hold keys "
                f"that no partition count (up to {MAX_TIER_COUNT}) places where they are: it "
                f"was not written with HPS's layout; {fix}"
            )
        shown = ", ".join(map(str, fits[:8])) + (", ..." if len(fits) > 8 else "")
        raise StoreDataError(
            f"{self._where}: the table's keys fit {len(fits)} partition counts ({shown}): "
            f"too few keys to tell which one HPS used; {fix}"
        )

    # -- plumbing -------------------------------------------------------------------

    def run_commands(self, what: str, commands) -> list:
        """Pipeline ``commands(pipe)`` (a redis-py cluster pipeline) and return the
        replies (:meth:`RedisConnection.run_commands`; errors name this table)."""
        return self._conn.run_commands(what, commands)

    def _by_partition(self, keys: np.ndarray):
        """``(partition, indices into keys)`` for every partition holding some of ``keys``,
        the indices cut in chunks of at most ``max_batch_size``."""
        parts = partition_of(keys, self.num_partitions)
        order = np.argsort(parts, kind="stable")
        bounds = np.searchsorted(parts[order], np.arange(self.num_partitions + 1))
        for p in range(self.num_partitions):
            idx = order[bounds[p] : bounds[p + 1]]
            for s, e in chunks(idx.shape[0], self.max_batch_size):
                yield p, idx[s:e]

    # -- BackingStore ---------------------------------------------------------------

    def fetch(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Write the vectors of found ``keys`` into ``out``; returns the found mask."""
        keys = check_keys(keys)
        m = keys.shape[0]
        found = np.zeros(m, dtype=bool)
        if m == 0:
            return found
        raw = encode_keys(keys)
        groups = list(self._by_partition(keys))

        def commands(pipe):
            for p, idx in groups:
                pipe.hmget(self.hash_keys[p], [raw[i] for i in idx.tolist()])

        values: List[Optional[bytes]] = [None] * m
        for (_, idx), reply in zip(groups, self.run_commands("HMGET", commands)):
            for i, v in zip(idx.tolist(), reply):
                values[i] = v
        decode_values(values, keys, out, found, self.default_value, self._where, self.codec)
        if self._scored and (
            self.refresh_time_after_fetch or self.overflow_policy == OverflowPolicy.EVICT_LEAST_USED
        ):
            self._touch(keys, found, raw)
        return found

    def upsert(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Insert or overwrite rows (last duplicate wins); returns the number of keys written."""
        keys, vectors = check_rows(keys, vectors, self.vec_size, self.codec)
        idx = last_occurrence(keys)
        keys, vectors = keys[idx], np.ascontiguousarray(vectors[idx])
        if keys.shape[0] == 0:
            return 0
        raw_k = encode_keys(keys)
        raw_v = vectors.view(f"V{self.codec.row_bytes}").ravel().tolist()
        touched = set()
        now = time.time()

        def commands(pipe) -> None:
            for p, sub in self._by_partition(keys):
                touched.add(p)
                items: List[bytes] = []
                for i in sub.tolist():
                    items.append(raw_k[i])
                    items.append(raw_v[i])
                pipe.hset(self.hash_keys[p], items=items)
                if self._scored:
                    if self.overflow_policy == OverflowPolicy.EVICT_OLDEST:
                        pipe.zadd(self.score_keys[p], {raw_k[i]: now for i in sub.tolist()})
                    else:  # evict_least_used: new rows start unused, rewrites keep their count
                        pipe.zadd(self.score_keys[p], {raw_k[i]: 0 for i in sub.tolist()}, nx=True)

        self.run_commands("HSET", commands)
        if self.overflow_margin is not None:
            self._resolve_overflow(sorted(touched))
        return int(keys.shape[0])

    # -- overflow handling ----------------------------------------------------------

    def _resolve_overflow(self, parts: List[int]) -> None:
        """Prune every partition of ``parts`` holding more than ``overflow_margin`` rows
        down to ``overflow_margin * overflow_resolution_target`` rows (HPS semantics)."""

        margin, target = self.overflow_margin, self.overflow_target
        assert margin is not None and target is not None  # only called with a margin

        def lens(pipe):
            for p in parts:
                pipe.hlen(self.hash_keys[p])

        for p, n in zip(parts, self.run_commands("HLEN", lens)):
            if int(n) > margin:
                self._prune(p, int(n) - target)

    def _prune(self, p: int, n: int) -> None:
        h, z = self.hash_keys[p], self.score_keys[p]
        victims: List[bytes] = []
        if self._scored:  # lowest scores first: oldest writes / fewest reads
            popped = self.run_commands("ZPOPMIN", lambda pipe: pipe.zpopmin(z, n))[0]
            victims = [m for m, _ in popped]
        if len(victims) < n:  # evict_random, or rows the sorted set does not know
            more = (
                self.run_commands("HRANDFIELD", lambda pipe: pipe.hrandfield(h, n - len(victims)))[
                    0
                ]
                or []
            )
            victims += [v for v in more if v not in set(victims)]
        if not victims:
            return

        def drop(pipe):
            pipe.hdel(h, *victims)
            if self._scored:
                pipe.zrem(z, *victims)

        removed = self.run_commands("HDEL", drop)[0]
        self.evicted += int(removed)

    def _touch(self, keys: np.ndarray, found: np.ndarray, raw: List[bytes]) -> None:
        """Record reads for the overflow policy (evict_least_used, or evict_oldest with
        refresh_time_after_fetch). Best effort: a failure here never fails the lookup."""
        hit = np.flatnonzero(found)
        if hit.shape[0] == 0:
            return
        now = time.time()

        def commands(pipe):
            for p, sub in self._by_partition(keys[hit]):
                members = [raw[i] for i in hit[sub].tolist()]
                if self.overflow_policy == OverflowPolicy.EVICT_OLDEST:
                    pipe.zadd(self.score_keys[p], {m: now for m in members}, xx=True)
                else:
                    for m in members:
                        pipe.zincrby(self.score_keys[p], 1, m)

        try:
            self.run_commands("ZADD", commands)
        except StoreError as e:
            log.warning("%s", e)

    def delete(self, keys: np.ndarray) -> int:
        """Remove ``keys`` from the table; returns how many were removed."""
        keys = np.unique(check_keys(keys))
        if keys.shape[0] == 0:
            return 0
        raw = encode_keys(keys)

        def commands(pipe):
            for p, sub in self._by_partition(keys):
                pipe.hdel(self.hash_keys[p], *[raw[i] for i in sub.tolist()])
                if self._scored:
                    pipe.zrem(self.score_keys[p], *[raw[i] for i in sub.tolist()])

        replies = self.run_commands("HDEL", commands)
        return int(sum(replies[::2] if self._scored else replies))

    def num_rows(self) -> int:
        """Exact: the sum of HLEN over the table's partitions."""

        def commands(pipe):
            for h in self.hash_keys:
                pipe.hlen(h)

        return int(sum(self.run_commands("HLEN", commands)))

    def sample_keys(self, n: int) -> np.ndarray:
        """Up to ``n`` distinct keys, taken by HSCAN partition after partition."""
        raw: dict = {}  # HSCAN may return a field twice: keep each once, in order
        for h in self.hash_keys:
            cursor = 0
            while len(raw) < n:
                step = min(max(n - len(raw), 10), 1000)
                cursor, page = self.run_commands(
                    "HSCAN", lambda pipe, c=cursor, h=h, step=step: pipe.hscan(h, c, count=step)
                )[0]
                for field in page:
                    if len(raw) >= n:
                        break
                    raw[field] = None
                if cursor == 0:
                    break
            if len(raw) >= n:
                break
        return decode_keys(list(raw), self._where)

    # -- import bookkeeping ------------------------------------------------------------

    def get_meta(self, name: str) -> Optional[str]:
        """The table's metadata value ``name``, or None if unset."""
        v = self.run_commands("HGET", lambda pipe: pipe.hget(self.meta_key, name))[0]
        return None if v is None else v.decode()

    def set_meta(self, name: str, value: str) -> None:
        """Set the table's metadata value ``name``."""
        self.run_commands("HSET", lambda pipe: pipe.hset(self.meta_key, name, str(value)))

    @contextlib.contextmanager
    def import_lock(self, timeout: float, ttl: float = 15.0):
        """One importer of this table across every node: ``SET <lock> <token> NX PX``,
        kept alive by a thread while held (a crashed holder frees it after ``ttl``).

        Raises:
            StoreUnavailableError: not acquired within ``timeout`` seconds.
        """
        key = self.meta_key + b"lock"
        token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}".encode()
        ttl_ms = int(ttl * 1000)
        deadline = time.monotonic() + timeout
        while not self.run_commands("SET", lambda pipe: pipe.set(key, token, nx=True, px=ttl_ms))[
            0
        ]:
            if time.monotonic() > deadline:
                holder = self.run_commands("GET", lambda pipe: pipe.get(key))[0]
                raise StoreUnavailableError(
                    f"{self._where}: another loader ({holder!r}) holds the import lock; "
                    f"gave up after {timeout:.0f} s"
                )
            time.sleep(0.1)
        stop = threading.Event()

        def keep_alive():
            while not stop.wait(ttl / 3):
                try:
                    self.run_commands("PEXPIRE", lambda pipe: pipe.pexpire(key, ttl_ms))
                except StoreError as e:  # the import itself will fail and say why
                    log.warning("%s", e)

        t = threading.Thread(target=keep_alive, name="trec-import-lock", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
            try:
                if self.run_commands("GET", lambda pipe: pipe.get(key))[0] == token:
                    self.run_commands("DEL", lambda pipe: pipe.delete(key))
            except StoreError as e:  # expires by itself
                log.warning("%s", e)

    def close(self) -> None:
        """Close the Redis connection."""
        self._conn.close()

    def hash_key_of(self, keys: np.ndarray) -> Sequence[bytes]:
        """The Redis hash holding each of ``keys`` (for operators and tests)."""
        parts = partition_of(check_keys(keys), self.num_partitions)
        return [self.hash_keys[p] for p in parts.tolist()]

    def __repr__(self) -> str:
        return (
            f"RedisClusterStore({self.address!r}, {self.table_name!r}, "
            f"vec_size={self.vec_size}, num_partitions={self.num_partitions})"
        )
