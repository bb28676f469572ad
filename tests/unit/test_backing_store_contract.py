"""One contract for every backing store, checked against a brute-force reference.

Every store (DictStore, LocalTableStore, RocksDBStore, RedisClusterStore against a real
3-master Redis Cluster) is filled with the same rows as a :class:`DictStore` and must
answer every fetch exactly as it does: vectors, default fill, found mask. Writable
stores must also follow it through upserts, overwrites and deletes; read-only ones must
refuse them. Store-specific behaviour (Redis partitions over masters and failures,
RocksDB reopening and corrupt values) follows at the end.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from tests.storage_fixtures import (  # noqa: F401  (fixtures)
    redis_cluster,
    rocksdb_dir,
    start_redis_cluster,
    start_tls_redis_cluster,
)
from tests.threads import run_in_threads
from triton_rec.errors import ConfigError, TritonRecError
from triton_rec.storage.backing_store import (
    DictStore,
    LocalTableStore,
    ReadOnlyStoreError,
    StoreDataError,
    StoreUnavailableError,
    tier_table_name,
)
from triton_rec.storage.table import EmbeddingTable

I64_MIN, I64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max
SMALL_BATCH = 7  # max_batch_size of the remote stores: every test batch is chunked
# the stores on a Redis Cluster start one (the redis marker: `make unit` leaves them out)
REDIS = pytest.param("redis", marks=pytest.mark.redis)
TIERED = pytest.param("tiered", marks=pytest.mark.redis)
KINDS = [
    "dict",
    "local",
    "rocksdb",
    "rocksdb-read-only",
    "rocksdb-node",
    REDIS,
    TIERED,
]  # every store reads
WRITABLE = ["dict", "rocksdb", "rocksdb-node", REDIS, TIERED]
READ_ONLY = ["local", "rocksdb-read-only"]


def rows(n: int, vec: int, seed: int = 0):
    """``n`` distinct keys (negatives, 0, INT64 min/max included) and their vectors."""
    rng = np.random.default_rng(seed)
    keys = np.unique(
        np.concatenate(
            [
                rng.integers(I64_MIN, I64_MAX, n, dtype=np.int64, endpoint=True),
                np.array([I64_MIN, I64_MAX, -1, 0, 1], dtype=np.int64),
            ]
        )
    )[:n]
    rng.shuffle(keys)
    return keys, rng.standard_normal((keys.shape[0], vec)).astype(np.float32)


class Stores:
    """Makes stores of one kind filled with given rows (and closes them).

    ``rocksdb-read-only``: written by a read-write store, closed, reopened read-only.
    """

    def __init__(self, kind, request):
        self.kind = kind
        self.opened = []
        if kind.startswith("rocksdb"):
            importlib.import_module("rocksdict")
        if kind == "redis":
            importlib.import_module("redis")
        # set up before (so torn down after) the stores that use it
        backend = (
            "rocksdb_dir"
            if kind.startswith("rocksdb")
            else "redis_cluster"
            if kind == "redis"
            else None
        )
        self.backend = request.getfixturevalue(backend) if backend else None
        if kind == "tiered":
            self.backend = (
                request.getfixturevalue("redis_cluster"),
                request.getfixturevalue("rocksdb_dir"),
            )

    def make(self, keys, vectors, default=0.0, vec=None):
        vec = vectors.shape[1] if vec is None else vec
        name = f"m{uuid.uuid4().hex[:8]}.t"
        if self.kind == "dict":
            s = DictStore(vec, default)
        elif self.kind == "local":
            s = LocalTableStore(EmbeddingTable("t", keys.copy(), vectors.copy(), default))
        elif self.kind.startswith("rocksdb"):
            from triton_rec.storage.rocksdb_store import RocksDBStore

            if self.kind == "rocksdb-node":
                from triton_rec.storage.rocksdb_store import NodeRocksDBTable

                s = NodeRocksDBTable(
                    self.backend / "node", name, vec, default, max_batch_size=SMALL_BATCH
                )
            else:
                s = RocksDBStore(self.backend, name, vec, default, max_batch_size=SMALL_BATCH)
            if self.kind == "rocksdb-read-only":
                s.upsert(keys, vectors)
                s.close()
                s = RocksDBStore(
                    self.backend, name, vec, default, read_only=True, max_batch_size=SMALL_BATCH
                )
        elif self.kind == "tiered":
            # Redis in front of a node RocksDB, copying what it misses (an empty Redis
            # with every row in RocksDB: each answer has to come through the chain).
            from triton_rec.storage.redis_store import RedisClusterStore
            from triton_rec.storage.rocksdb_store import NodeRocksDBTable
            from triton_rec.storage.tiers import Tier, TieredStore

            redis_cluster_, rdir = self.backend
            vol = RedisClusterStore(
                redis_cluster_.address, name, vec, default, max_batch_size=SMALL_BATCH
            )
            per = NodeRocksDBTable(rdir / "node", name, vec, default, max_batch_size=SMALL_BATCH)
            if keys.shape[0]:
                per.upsert(keys, vectors)
            s = TieredStore(
                name, [Tier("volatile", vol), Tier("persistent", per)], cache_missed_embeddings=True
            )
            self.opened.append(s)
            return s
        else:
            from triton_rec.storage.redis_store import RedisClusterStore

            s = RedisClusterStore(
                self.backend.address, name, vec, default, max_batch_size=SMALL_BATCH
            )
        self.opened.append(s)
        if not s.read_only and keys.shape[0]:
            assert s.upsert(keys, vectors) == keys.shape[0]
        return s

    def close(self):
        for s in self.opened:
            s.close()


def _stores(request):
    s = Stores(request.param, request)
    yield s
    s.close()


stores = pytest.fixture(params=KINDS)(_stores)
writable_stores = pytest.fixture(params=WRITABLE)(_stores)
read_only_stores = pytest.fixture(params=READ_ONLY)(_stores)


def reference(keys, vectors, default=0.0):
    ref = DictStore(vectors.shape[1], default)
    ref.upsert(keys, vectors)
    return ref


def assert_same_answers(store, ref, query):
    got = np.full((query.shape[0], store.vec_size), np.nan, dtype=np.float32)
    want = np.full_like(got, np.nan)
    found = store.fetch(query, got)
    want_found = ref.fetch(query, want)
    assert found.dtype == bool and found.shape == query.shape
    np.testing.assert_array_equal(found, want_found)
    np.testing.assert_array_equal(got, want)  # bit-exact, defaults included


# -- reading: every store ---------------------------------------------------------------


@pytest.mark.parametrize("vec", [1, 4, 33])
def test_fetch_of_known_unknown_and_repeated_keys_equals_the_reference(stores, vec):
    keys, vectors = rows(60, vec, seed=vec)
    store = stores.make(keys, vectors, default=-2.5)
    ref = reference(keys, vectors, default=-2.5)
    rng = np.random.default_rng(1)
    unknown = np.array([12345, -12345, 2, -2], dtype=np.int64)
    unknown = unknown[~np.isin(unknown, keys)]
    query = np.concatenate([keys[:20], unknown, keys[:5], keys[rng.integers(0, 60, 30)], unknown])
    rng.shuffle(query)
    assert_same_answers(store, ref, query)


def test_unknown_keys_get_the_default_in_every_element_and_found_false(stores):
    keys, vectors = rows(10, 8)
    store = stores.make(keys, vectors, default=7.25)
    out = np.zeros((3, 8), dtype=np.float32)
    query = np.array([3, 4, 5], dtype=np.int64)
    query = query if not np.isin(query, keys).any() else query + 1000
    found = store.fetch(query, out)
    assert not found.any()
    assert (out == 7.25).all()


def test_extreme_keys_are_ordinary_keys(stores):
    keys = np.array([I64_MIN, I64_MAX, -1, 0, I64_MIN + 1, I64_MAX - 1, -(2**40)], dtype=np.int64)
    vectors = np.arange(keys.shape[0] * 3, dtype=np.float32).reshape(-1, 3)
    store = stores.make(keys, vectors, default=-9.0)
    assert_same_answers(
        store,
        reference(keys, vectors, -9.0),
        np.concatenate([keys[::-1], np.array([1, -2, 2**62], dtype=np.int64)]),
    )


def test_an_empty_batch_returns_an_empty_mask_and_writes_nothing(stores):
    keys, vectors = rows(5, 4)
    store = stores.make(keys, vectors)
    out = np.empty((0, 4), dtype=np.float32)
    found = store.fetch(np.empty(0, dtype=np.int64), out)
    assert found.shape == (0,) and found.dtype == bool


def test_batches_larger_than_max_batch_size_are_answered_whole(stores):
    keys, vectors = rows(200, 5, seed=3)
    store = stores.make(keys, vectors, default=1.5)
    query = np.concatenate([keys, keys[::3], np.arange(1000, 1100, dtype=np.int64)])
    assert query.shape[0] > 10 * SMALL_BATCH
    assert_same_answers(store, reference(keys, vectors, 1.5), query)


def test_num_rows_counts_the_rows(stores):
    keys, vectors = rows(77, 2)
    store = stores.make(keys, vectors)
    assert store.num_rows() == 77  # an estimate may still be exact after plain inserts
    assert stores.make(keys[:0], vectors[:0]).num_rows() == 0


def test_sample_keys_are_distinct_held_keys(stores):
    keys, vectors = rows(50, 2)
    store = stores.make(keys, vectors)
    for n in (0, 1, 13, 50, 80):
        s = store.sample_keys(n)
        assert s.dtype == np.int64 and s.shape == (min(n, 50),)
        assert np.isin(s, keys).all() and np.unique(s).shape == s.shape
    assert set(store.sample_keys(80).tolist()) == set(keys.tolist())


def test_concurrent_fetches_all_get_exact_answers(stores):
    keys, vectors = rows(300, 6)
    store = stores.make(keys, vectors, default=-1.0)
    ref = reference(keys, vectors, -1.0)

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(5):
            q = np.concatenate([keys[rng.integers(0, 300, 40)], rng.integers(-50, 50, 10)])
            assert_same_answers(store, ref, q.astype(np.int64))

    run_in_threads(worker, 4, timeout=30)


# -- writing: writable stores follow the reference; read-only ones refuse ----------------


def test_upsert_overwrite_and_delete_follow_the_reference(writable_stores):
    keys, vectors = rows(40, 4, seed=5)
    store = writable_stores.make(keys, vectors, default=0.5)
    assert not store.read_only
    ref = reference(keys, vectors, 0.5)
    query = np.concatenate([keys, np.arange(-20, 20, dtype=np.int64)])

    new_keys = np.array([keys[0], keys[1], 11, -11, 11], dtype=np.int64)  # 11 twice: last wins
    new_vecs = np.random.default_rng(9).standard_normal((5, 4)).astype(np.float32)
    assert store.upsert(new_keys, new_vecs) == ref.upsert(new_keys, new_vecs) == 4
    assert_same_answers(store, ref, query)
    out = np.empty((1, 4), dtype=np.float32)
    store.fetch(np.array([11], dtype=np.int64), out)
    np.testing.assert_array_equal(out[0], new_vecs[4])

    gone = np.array([keys[2], keys[3], keys[2], 424242], dtype=np.int64)
    assert store.delete(gone) == ref.delete(gone) == 2
    assert_same_answers(store, ref, query)
    assert store.delete(np.array([424242], dtype=np.int64)) == 0
    assert store.delete(np.empty(0, dtype=np.int64)) == 0
    assert store.upsert(np.empty(0, dtype=np.int64), np.empty((0, 4), dtype=np.float32)) == 0
    if store.exact_num_rows:
        assert store.num_rows() == ref.num_rows() == 40 + 2 - 2


def test_large_upserts_are_chunked_and_complete(writable_stores):
    keys, vectors = rows(0, 3)
    store = writable_stores.make(keys, vectors)
    keys, vectors = rows(500, 3, seed=11)
    assert store.upsert(keys, vectors) == 500
    assert_same_answers(store, reference(keys, vectors), keys)
    assert store.delete(keys[:250]) == 250
    ref = reference(keys[250:], vectors[250:])
    assert_same_answers(store, ref, keys)


def test_upsert_checks_shapes_and_dtypes(writable_stores):
    keys, vectors = rows(3, 4)
    store = writable_stores.make(keys, vectors)
    with pytest.raises(ValueError, match="float32"):
        store.upsert(keys, vectors[:, :3])
    with pytest.raises(ValueError, match="float32"):
        store.upsert(keys, vectors.astype(np.float64))
    with pytest.raises(ValueError, match="int64"):
        store.upsert(keys.astype(np.int32), vectors)


def test_read_only_stores_refuse_writes_and_keep_their_rows(read_only_stores):
    keys, vectors = rows(10, 4)
    store = read_only_stores.make(keys, vectors)
    assert store.read_only
    with pytest.raises(ReadOnlyStoreError, match="read-only") as e:
        store.upsert(keys[:2], vectors[:2] + 1)
    assert isinstance(e.value, TritonRecError) and repr(store) in str(e.value)
    with pytest.raises(ReadOnlyStoreError, match="read-only"):
        store.delete(keys[:2])
    assert_same_answers(store, reference(keys, vectors), keys)


# -- names ---------------------------------------------------------------------------------


def test_tier_table_names_join_model_and_table_and_refuse_separators():
    assert tier_table_name("hps_demo", "item") == "hps_et.hps_demo.item"
    for bad in ("a.b", "a{b}", "", "a/b"):
        with pytest.raises(ConfigError):
            tier_table_name(bad, "t")
        with pytest.raises(ConfigError):
            tier_table_name("m", bad)


# -- RocksDB -------------------------------------------------------------------------------


def test_rocksdb_reopened_read_only_sees_the_data_and_other_tables_are_separate(rocksdb_dir):
    importlib.import_module("rocksdict")
    from triton_rec.storage.rocksdb_store import RocksDBStore

    k1, v1 = rows(30, 4, seed=1)
    k2, v2 = rows(20, 2, seed=2)
    a = RocksDBStore(rocksdb_dir, "m.a", 4)
    b = RocksDBStore(rocksdb_dir, "m.b", 2)  # same database, its own column family
    a.upsert(k1, v1)
    b.upsert(k2, v2)
    a.close()
    b.close()
    ra = RocksDBStore(rocksdb_dir, "m.a", 4, read_only=True)
    rb = RocksDBStore(rocksdb_dir, "m.b", 2, read_only=True)
    try:
        assert_same_answers(ra, reference(k1, v1), np.concatenate([k1, k2]))
        assert_same_answers(rb, reference(k2, v2), np.concatenate([k2, k1]))
    finally:
        ra.close()
        rb.close()


def test_rocksdb_value_of_wrong_length_is_reported_with_table_and_key(rocksdb_dir):
    rocksdict = importlib.import_module("rocksdict")
    from triton_rec.storage.rocksdb_store import RocksDBStore

    keys, vectors = rows(20, 4)
    s = RocksDBStore(rocksdb_dir, "m.t", 4)
    s.upsert(keys, vectors)
    s.close()
    db = rocksdict.Rdict(str(rocksdb_dir), rocksdict.Options(raw_mode=True))
    db.get_column_family("m.t").put(int(keys[5]).to_bytes(8, "little", signed=True), b"\x00" * 12)
    db.close()
    s = RocksDBStore(rocksdb_dir, "m.t", 4, read_only=True)
    try:
        out = np.empty((20, 4), dtype=np.float32)
        msg = rf"'m\.t'.*key {int(keys[5])} has 12 bytes, expected 16"
        with pytest.raises(StoreDataError, match=msg):
            s.fetch(keys, out)
        good = np.delete(keys, 5)  # the other rows are still served
        assert_same_answers(s, reference(keys, vectors), good)
    finally:
        s.close()


def test_rocksdb_unopenable_databases_raise_store_unavailable_naming_the_path(rocksdb_dir):
    importlib.import_module("rocksdict")
    from triton_rec.storage.rocksdb_store import RocksDBStore

    with pytest.raises(StoreUnavailableError, match="no database there"):
        RocksDBStore(rocksdb_dir, "m.t", 4, read_only=True)
    w = RocksDBStore(rocksdb_dir, "m.t", 4)
    try:
        with pytest.raises(StoreUnavailableError, match=r"no such column family.*has: m\.t"):
            RocksDBStore(rocksdb_dir, "m.other", 4, read_only=True)
        # another process cannot open it read-write while this one holds it
        code = (
            "import sys; from triton_rec.storage.rocksdb_store import RocksDBStore\n"
            "from triton_rec.storage.backing_store import StoreUnavailableError\n"
            f"try: RocksDBStore({str(rocksdb_dir)!r}, 'm.t', 4)\n"
            "except StoreUnavailableError as e: print(e); sys.exit(3)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.returncode == 3, r.stderr
        assert str(rocksdb_dir) in r.stdout and "lock" in r.stdout.lower()
    finally:
        w.close()


# -- Redis Cluster -------------------------------------------------------------------------


def _owner(cluster, hash_key: bytes) -> int:
    """The master holding ``hash_key`` (the others answer MOVED)."""
    owners = []
    for i in range(len(cluster.ports)):
        try:
            cluster.command(i, "HLEN", hash_key)
            owners.append(i)
        except RuntimeError as e:
            assert "MOVED" in str(e)
    assert len(owners) == 1, owners
    return owners[0]


def test_redis_partitions_spread_a_table_over_all_masters(redis_cluster):
    importlib.import_module("redis")
    from triton_rec.storage.redis_store import RedisClusterStore, partition_of

    store = RedisClusterStore(redis_cluster.address, "spread.t", 4, num_partitions=8)
    try:
        keys, vectors = rows(400, 4)
        store.upsert(keys, vectors)
        assert store.hash_keys == [b"hps_et{spread.t/p%d}v" % i for i in range(8)]  # HPS's
        lengths = {}
        for hk in store.hash_keys:
            owner = _owner(redis_cluster, hk)
            lengths[hk] = (owner, int(redis_cluster.command(owner, "HLEN", hk)))
            # the {...} hash tag names the slot: one slot per partition
            tag = hk[hk.index(b"{") + 1 : hk.index(b"}")]
            assert redis_cluster.command(owner, "CLUSTER", "KEYSLOT", hk) == redis_cluster.command(
                owner, "CLUSTER", "KEYSLOT", tag
            )
        assert {o for o, _ in lengths.values()} == {0, 1, 2}
        assert sum(n for _, n in lengths.values()) == 400 == store.num_rows()
        assert all(int(redis_cluster.command(i, "DBSIZE")) > 0 for i in range(3))
        # every key is in the hash its partition names, stored as 8 LE bytes -> raw float32
        parts = partition_of(keys, 8)
        assert np.bincount(parts, minlength=8).min() > 20
        k = int(keys[0])
        hk = store.hash_keys[parts[0]]
        field = k.to_bytes(8, "little", signed=True)
        assert redis_cluster.command(lengths[hk][0], "HEXISTS", hk, field) == "1"
    finally:
        store.close()


def test_redis_partition_function_is_fixed():
    importlib.import_module("redis")
    # It decides where a key lives: changing it would make stored rows unreachable, and
    # it must be HPS's (rrxmrrxmsx_0, HugeCTR database_backend_detail.hpp) for a Redis
    # HPS filled to be readable. Reference: the mixer written out with Python ints.
    from tests.hps_layout import rrxmrrxmsx_0
    from triton_rec.storage.redis_store import mix64, partition_of

    keys = np.concatenate(
        [
            np.array([0, 1, -1, I64_MIN, I64_MAX, 123456789], dtype=np.int64),
            np.random.default_rng(0).integers(I64_MIN, I64_MAX, 200),
        ]
    )
    want = [rrxmrrxmsx_0(int(k)) for k in keys]
    assert [int(v) for v in mix64(keys)] == want
    for n in (1, 7, 8):
        assert partition_of(keys, n).tolist() == [w % n for w in want]


def test_redis_value_of_wrong_length_is_reported_with_table_and_key(redis_cluster):
    importlib.import_module("redis")
    from triton_rec.storage.redis_store import RedisClusterStore

    store = RedisClusterStore(redis_cluster.address, "corrupt.t", 4)
    try:
        keys, vectors = rows(30, 4)
        store.upsert(keys, vectors)
        k = int(keys[7])
        hk = store.hash_key_of(keys[7:8])[0]
        field = k.to_bytes(8, "little", signed=True)
        redis_cluster.command(_owner(redis_cluster, hk), "HSET", hk, field, b"abc")
        msg = rf"'corrupt\.t'.*key {k} has 3 bytes, expected 16"
        with pytest.raises(StoreDataError, match=msg):
            store.fetch(keys, np.empty((30, 4), dtype=np.float32))
    finally:
        store.close()


def test_redis_bad_or_unreachable_addresses_fail_fast_with_the_address():
    importlib.import_module("redis")
    from tests.storage_fixtures import free_cluster_ports
    from triton_rec.storage.redis_store import RedisClusterStore, parse_address

    assert parse_address("a:1, [::1]:2") == [("a", 1), ("::1", 2)]
    for bad in ("", "host", "host:x", "host:70000"):
        with pytest.raises(ConfigError):
            RedisClusterStore(bad, "m.t", 4)
    port = free_cluster_ports(1)[0]
    t0 = time.monotonic()
    # the refused connection itself is reported, naming the address
    with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{port}.*Connection refused"):
        RedisClusterStore(f"127.0.0.1:{port}", "m.t", 4)
    # at once (a few ms): 30 s only catches a store that waits for the cluster to come up
    # (a connect loop), not a busy machine
    waited = time.monotonic() - t0
    assert waited < 30, f"an unreachable address was reported after {waited:.1f} s"


@pytest.mark.redis
def test_redis_over_tls_with_client_certificate_and_server_name():
    importlib.import_module("redis")
    from triton_rec.storage.redis_store import RedisClusterStore

    with start_tls_redis_cluster() as c:
        tls = dict(
            enable_tls=True,
            tls_ca_certificate=c.tls["ca"],
            tls_client_certificate=c.tls["client_cert"],
            tls_client_key=c.tls["client_key"],
        )
        store = RedisClusterStore(
            c.address, "tls.t", 4, tls_server_name_identification="redis.test", **tls
        )
        try:
            keys, vectors = rows(50, 4)
            store.upsert(keys, vectors)
            assert_same_answers(store, reference(keys, vectors), np.concatenate([keys, [5, 6]]))
        finally:
            store.close()
        # the certificate names redis.test, not 127.0.0.1: without the SNI name it is refused
        with pytest.raises(StoreUnavailableError, match="certificate"):
            RedisClusterStore(c.address, "tls.t", 4, **tls)
        # no client certificate: the server refuses the handshake
        with pytest.raises(StoreUnavailableError):
            RedisClusterStore(
                c.address,
                "tls.t",
                4,
                enable_tls=True,
                tls_ca_certificate=c.tls["ca"],
                tls_server_name_identification="redis.test",
            )


@pytest.mark.redis
def test_redis_stalled_or_killed_master_raises_store_unavailable_quickly():
    """Last on purpose, with a cluster of its own: a stalled master (SIGSTOP) times out,
    recovers when resumed; a killed one is reported at once. Never a hang."""
    importlib.import_module("redis")
    from triton_rec.storage.redis_store import RedisClusterStore

    with start_redis_cluster(3) as c:
        # Four partitions (not the machine's default count) and one key per HMGET: a fetch
        # of the 300 keys is 300 commands, ~75 per partition, so a failure paid per command
        # (the defect checked below) costs minutes, not seconds.
        store = RedisClusterStore(
            c.address,
            "fail.t",
            4,
            num_partitions=4,
            max_batch_size=1,
            socket_timeout=0.5,
            connect_timeout=0.5,
            retries=1,
        )
        try:
            keys, vectors = rows(300, 4)
            store.upsert(keys, vectors)
            out = np.empty((300, 4), dtype=np.float32)
            victim = _owner(c, store.hash_keys[0])

            # resharding: move the slot of partition 0 to another master; the store
            # follows the MOVED replies
            hk = store.hash_keys[0]
            src, dst = victim, (victim + 1) % 3
            slot = c.command(src, "CLUSTER", "KEYSLOT", hk)
            ids = [c.command(i, "CLUSTER", "MYID") for i in range(3)]
            c.command(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
            c.command(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
            c.command(src, "MIGRATE", "127.0.0.1", str(c.ports[dst]), "", "0", "5000", "KEYS", hk)
            for i in (dst, src, 3 - src - dst):
                c.command(i, "CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
            assert _owner(c, hk) == dst
            assert_same_answers(store, reference(keys, vectors), keys)
            victim = dst

            c.procs[victim].send_signal(19)  # SIGSTOP
            try:
                t0 = time.monotonic()
                msg = r"127\.0\.0\.1:\d+.*fail\.t.*Timeout"
                with pytest.raises(StoreUnavailableError, match=msg):
                    store.fetch(keys, out)
                stalled = time.monotonic() - t0
            finally:
                c.procs[victim].send_signal(18)  # SIGCONT
            # About (retries + 1) x socket_timeout + a topology refresh: ~1 s. The defect: a
            # failure paid per command (redis-py re-sending every failed command of the
            # pipeline alone, with its own retries and timeouts; RedisConnection.run_commands
            # turns that off), measured at 148 s with these settings. 15 s, 10x+ the normal
            # time, only fails on that or a hang, never on a busy machine.
            assert stalled < 15, f"the stalled master was reported after {stalled:.1f} s"
            assert store.fetch(keys, out).all()  # recovered

            c.kill(victim)
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailableError, match=f"127.0.0.1:{c.ports[victim]}"):
                store.fetch(keys, out)
            with pytest.raises(StoreUnavailableError):
                store.upsert(keys[:10], vectors[:10])
            # refused connections: reported at once (~20 ms); 15 s only catches a wait (for
            # a failover, a reconnection loop), never a slow machine
            killed = time.monotonic() - t0
            assert killed < 15, f"the killed master was reported after {killed:.1f} s"
        finally:
            store.close()
