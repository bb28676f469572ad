"""HPS's storage layouts written out from its source (HugeCTR v23.09, see
docs/upstream-notes.md), independently of triton_rec's stores: tests fill Redis and
RocksDB the way HPS did and check that the backends serve what is there.

- Redis: table ``T`` = ``hps_et.<model>.<table>`` in ``num_partitions`` hashes
  ``hps_et{T/p<i>}v``, key ``k`` in partition ``rrxmrrxmsx_0(k) % num_partitions``,
  field = the 8 raw key bytes, value = the raw float32 vector.
- RocksDB: one database, column family ``T``, key = the 8 raw key bytes, value = the raw
  float32 vector.
"""

from __future__ import annotations

import struct

import numpy as np

M64 = (1 << 64) - 1


def rotr(x: int, n: int) -> int:
    return ((x >> n) | (x << (64 - n))) & M64


def rrxmrrxmsx_0(x: int) -> int:
    """Pelle Evensen's mixer with Python ints (``x`` taken modulo 2**64)."""
    x &= M64
    x ^= rotr(x, 25) ^ rotr(x, 50)
    x = (x * 0xA24BAED4963EE407) & M64
    x ^= rotr(x, 24) ^ rotr(x, 49)
    x = (x * 0x9FB21C651E98DF25) & M64
    return x ^ (x >> 28)


def write_hps_redis(cluster, table: str, keys, vectors, num_partitions: int) -> None:
    """HSET every row the way HPS's RedisClusterBackend stores it (redis-py's own cluster
    client, not triton_rec's store)."""
    from redis.cluster import RedisCluster

    rc = RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        pipe = rc.pipeline(transaction=False)
        for k, v in zip(np.asarray(keys).tolist(), np.asarray(vectors, np.float32)):
            hkey = f"hps_et{{{table}/p{rrxmrrxmsx_0(k) % num_partitions}}}v".encode()
            pipe.hset(hkey, struct.pack("<q", k), v.astype("<f4").tobytes())
        pipe.execute()
    finally:
        rc.close()


def write_hps_rocksdb(path, table: str, keys, vectors) -> None:
    """Put every row into column family ``table`` of the database at ``path``."""
    import rocksdict

    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    db = rocksdict.Rdict(str(path), opts)
    try:
        try:
            cf = db.get_column_family(table)
        except Exception:
            cf = db.create_column_family(table, rocksdict.Options(raw_mode=True))
        for k, v in zip(np.asarray(keys).tolist(), np.asarray(vectors, np.float32)):
            cf[struct.pack("<q", k)] = v.astype("<f4").tobytes()
        del cf
    finally:
        db.close()
