#!/usr/bin/env python3
"""Storage tiers, side by side in one run: lookups per tier, the cache in front at
several hit rates, and ingest rates (bulk import, online updates over Redis Streams).

Set-up (all on loopback, started and stopped by this script): one table of --rows
random int64 keys x --dim float32 in

  local    LocalTableStore: the node-local table (native hash index, memory-mapped in
           production; in memory here)
  redis    RedisClusterStore on a 3-master Redis Cluster (tests.storage_fixtures),
           --partitions hashes, pipelined HMGET
  rocksdb  NodeRocksDBTable (secondary handle, as every serving process reads it)

and the raw limit: np.take of the same rows from an in-memory array (row ids
precomputed), called "gather".

1. Ingest (vectors/s): bulk upsert of the whole table into Redis and RocksDB in batches
   of 10k (RocksDB: one read-write open/close per upsert call, as the serving processes
   write), and 1k-key upserts; online updates: --updates vectors published with
   UpdateProducer (8192 per message) and applied to Redis + RocksDB by an UpdateConsumer
   (publish -> read -> decode -> tiers -> ack), timed from the first publish to the last ack.
2. Lookup per tier, batches of 64 / 1024 / 16384 keys drawn from a Zipf(--alpha) law
   over the rows: keys/s and per-batch p50 / p99 latency (--reps batches each).
3. CachedTable (shared-memory LRU cache + hit_rate_threshold 2.0, i.e. misses fetched
   synchronously and inserted) in front of each tier, cache capacity 0.5% .. 30% of the
   rows, warmed with the hottest rows (steady state), 1024-key Zipf batches: keys/s and
   the hit rate measured by the cache's own counters.

    python benchmarks/bench_tiers.py [--rows 500000] [--dim 64] [--reps 40]
        [--updates 200000] [--json benchmarks/out/bench_tiers.json]
        [--plot benchmarks/bench_tiers.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine import machine_info  # noqa: E402
from tests.storage_fixtures import start_redis_cluster  # noqa: E402
from triton_rec.backing_store import LocalTableStore  # noqa: E402
from triton_rec.cached_table import CachedTable  # noqa: E402
from triton_rec.redis_store import RedisClusterStore  # noqa: E402
from triton_rec.rocksdb_store import NodeRocksDBTable  # noqa: E402
from triton_rec.shm_cache import SharedEmbeddingCache  # noqa: E402
from triton_rec.table import EmbeddingTable  # noqa: E402
from triton_rec.updates import UpdateConsumer, UpdateProducer, topic_name  # noqa: E402


def zipf_rows(rng, n_rows, size, alpha):
    """Row ids with P(rank r) ~ 1/r^alpha; ranks are mapped to rows by a fixed shuffle."""
    ranks = np.arange(1, n_rows + 1, dtype=np.float64)
    p = ranks ** -alpha
    p /= p.sum()
    cdf = np.cumsum(p)
    return np.minimum(np.searchsorted(cdf, rng.random(size)), n_rows - 1)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ingest(stores, keys, vectors, args):
    out = {}
    n = keys.shape[0]
    for name, s in stores.items():
        def bulk():
            for a in range(0, n, 10000):
                s.upsert(keys[a:a + 10000], vectors[a:a + 10000])
        t = timed(bulk)
        out[f"{name} bulk 10k/call"] = n / t
        m = min(n, 50000)

        def small():
            for a in range(0, m, 1000):
                s.upsert(keys[a:a + 1000], vectors[a:a + 1000])
        out[f"{name} 1k/call"] = m / timed(small)
    return out


def stream_ingest(address, stores, keys, vectors, count):
    model, table = f"bench{uuid.uuid4().hex[:6]}", "t"
    topic = topic_name(model, table)
    applied = [0]

    def apply(_m, _t, k, v):
        for s in stores:
            s.upsert(k, v)
        applied[0] += k.shape[0]

    consumer = UpdateConsumer(address, "bench", "c0", {topic: vectors.shape[1]}, apply,
                              block_ms=50)
    consumer.poll_once(10)  # create the group before publishing
    idx = np.arange(count) % keys.shape[0]
    t0 = time.perf_counter()
    with UpdateProducer(address, max_batch_size=8192) as p:
        for a in range(0, count, 65536):
            p.publish(model, table, keys[idx[a:a + 65536]], vectors[idx[a:a + 65536]])
    t_pub = time.perf_counter() - t0
    while applied[0] < count:
        consumer.poll_once(50)
    t = time.perf_counter() - t0
    consumer.close()
    return {"publish only": count / t_pub, "publish + consume + apply": count / t}


def lookups(stores, vectors, keys, args, rng):
    res = []
    for batch in (64, 1024, 16384):
        reps = max(5, args.reps if batch <= 1024 else args.reps // 4)
        batches = [zipf_rows(rng, keys.shape[0], batch, args.alpha) for _ in range(reps)]
        out = np.empty((batch, vectors.shape[1]), np.float32)
        methods = {"gather": lambda rows: np.take(vectors, rows, axis=0, out=out, mode="clip")}
        for name, s in stores.items():
            methods[name] = (lambda s: lambda rows: s.fetch(keys[rows], out))(s)
        for name, fn in methods.items():
            times = []
            for rows in batches:
                t0 = time.perf_counter()
                fn(rows)
                times.append(time.perf_counter() - t0)
            times.sort()
            res.append({"batch": batch, "tier": name,
                        "keys_per_s": batch * len(times) / sum(times),
                        "p50_ms": 1e3 * statistics.median(times),
                        "p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))]})
    return res


def with_cache(stores, keys, dim, args, rng):
    res = []
    batch = 1024
    for frac in (0.005, 0.02, 0.08, 0.3):
        cap = max(64, int(frac * keys.shape[0]))
        for name, s in stores.items():
            cache = SharedEmbeddingCache.open(f"bench_tiers_{uuid.uuid4().hex[:8]}", cap, dim,
                                              policy="lru")
            try:
                ct = CachedTable(name, s, cache, hit_rate_threshold=2.0)
                out = np.empty((batch, dim), np.float32)
                # steady state: the hottest rows cached (row i has Zipf rank i + 1), as
                # after a long run; then a few batches through the lookup path
                warm = np.empty((cap, dim), np.float32)
                s.fetch(keys[:cap], warm)
                cache.insert(keys[:cap], warm)
                for _ in range(5):
                    ct.lookup(keys[zipf_rows(rng, keys.shape[0], batch, args.alpha)], out)
                before = ct.stats.snapshot()
                batches = [keys[zipf_rows(rng, keys.shape[0], batch, args.alpha)]
                           for _ in range(args.reps)]
                t = timed(lambda: [ct.lookup(k, out) for k in batches])
                after = ct.stats.snapshot()
                hits = after["hits"] - before["hits"]
                looked = after["lookups"] - before["lookups"]
                res.append({"cache_fraction": frac, "tier": name, "hit_rate": hits / looked,
                            "keys_per_s": looked / t})
            finally:
                cache.close()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=500000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--alpha", type=float, default=1.05)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--updates", type=int, default=200000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-(2**62), 2**62, args.rows + args.rows // 8, dtype=np.int64))
    keys = rng.permutation(keys)[: args.rows]
    vectors = rng.standard_normal((keys.shape[0], args.dim)).astype(np.float32)
    result = {"machine": machine_info(), "args": vars(args)}
    with start_redis_cluster(3) as cluster, tempfile.TemporaryDirectory() as tmp:
        redis_store = RedisClusterStore(cluster.address, "bench.t", args.dim,
                                        num_partitions=args.partitions)
        rocks = NodeRocksDBTable(os.path.join(tmp, "db"), "bench.t", args.dim, num_threads=2)
        try:
            result["ingest"] = ingest({"redis": redis_store, "rocksdb": rocks}, keys, vectors, args)
            stream_redis = RedisClusterStore(cluster.address, "bench.u", args.dim,
                                             num_partitions=args.partitions)
            stream_rocks = NodeRocksDBTable(os.path.join(tmp, "db2"), "bench.u", args.dim,
                                            num_threads=2)
            try:
                result["stream_ingest"] = stream_ingest(
                    cluster.address, [stream_rocks, stream_redis], keys, vectors, args.updates)
            finally:
                stream_redis.close()
                stream_rocks.close()
            stores = {"local": LocalTableStore(EmbeddingTable("t", keys, vectors, 0.0)),
                      "redis": redis_store, "rocksdb": rocks}
            result["lookup"] = lookups(stores, vectors, keys, args, rng)
            result["cache"] = with_cache(stores, keys, args.dim, args, rng)
        finally:
            redis_store.close()
            rocks.close()

    print(f"machine: {result['machine']['cpu_model']}, {result['machine']['nproc']} CPUs, "
          f"load {result['machine']['loadavg']}")
    print("\n| ingest | vectors/s |\n|---|---:|")
    for k, v in {**result["ingest"], **{f"stream: {k}": v for k, v in
                                        result["stream_ingest"].items()}}.items():
        print(f"| {k} | {v:,.0f} |")
    print("\n| batch | tier | keys/s | p50 ms | p99 ms | vs gather |\n|---:|---|---:|---:|---:|---:|")
    gather = {r["batch"]: r["keys_per_s"] for r in result["lookup"] if r["tier"] == "gather"}
    for r in result["lookup"]:
        print(f"| {r['batch']} | {r['tier']} | {r['keys_per_s']:,.0f} | {r['p50_ms']:.3f} | "
              f"{r['p99_ms']:.3f} | {r['keys_per_s'] / gather[r['batch']]:.3f}x |")
    print("\n| cache rows | tier | hit rate | keys/s |\n|---:|---|---:|---:|")
    for r in result["cache"]:
        print(f"| {100 * r['cache_fraction']:.1f}% | {r['tier']} | {r['hit_rate']:.3f} | "
              f"{r['keys_per_s']:,.0f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for tier in ("local", "redis", "rocksdb"):
            pts = sorted((r["hit_rate"], r["keys_per_s"]) for r in result["cache"] if r["tier"] == tier)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tier)
        ax.set_yscale("log")
        ax.set_xlabel("measured cache hit rate (1024-key Zipf batches)")
        ax.set_ylabel("keys/s (cache + tier, one thread)")
        ax.set_title(f"Cache in front of each tier ({args.rows:,} x {args.dim})")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return result


if __name__ == "__main__":
    main()
