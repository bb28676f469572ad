#!/usr/bin/env python3
"""Storage tiers side by side in one run: ingest rates, lookups per tier against the raw
gather limit, and the shared cache in front of each tier at several hit rates.

Command used for benchmarks/history/2026-11-22-storage-tiers.md (repository root, package
installed in .venv):

    .venv/bin/python benchmarks/bench_tiers.py

(defaults: --rows 1000000 --dim 64 --alpha 1.05 --partitions 8 --seed 0
--hit-rates 0.5,0.8,0.95,0.99 --cache-batch 1024; writes benchmarks/out/bench_tiers.json,
benchmarks/out/bench_tiers.md and benchmarks/bench_tiers.png). About 50-75 s on 2 shared
vCPUs; at the 0.99 point the three caches hold about 0.7 GB of /dev/shm.

Set-up: one table of --rows random unique int64 keys x --dim float32 (seeded), held by

  local         LocalTableStore over the node-local layout (triton_rec.storage.node_store: the
                HugeCTR sparse files written to a temp dir, converted once, mapped
                read-only, native hash index), as a serving process maps it
  redis         RedisClusterStore on a real 3-master Redis Cluster on loopback, started
                and stopped here (tests.storage_fixtures.start_redis_cluster),
                --partitions hashes, pipelined HMGET/HSET
  rocksdb       RocksDBStore (one read-write handle) in a temp dir
  rocksdb-node  NodeRocksDBTable (what a deployment with a writable persistent_db opens:
                reads through a secondary handle; writes open the database
                read-write under a node-wide flock and keep it while writes keep
                coming, 0.5 s idle / 2 s at most)

and two references that are not tiers:

  gather        np.take(vectors, rows, axis=0, out=out, mode="clip") of the same rows
                from an in-memory array, row ids precomputed: the memory limit
  codec         encode_keys + decode_values of the same keys/values (bytes prepared
                beforehand): the per-key Python work every byte-level tier (Redis,
                RocksDB) does around its I/O, with no I/O at all

1. Ingest. Bulk load of the whole table in upserts of 65,536 rows (the batch of
   triton_rec.storage.tiers.import_table): rows/s and MB/s (MB = rows x dim x 4 bytes); then
   the same plus the compaction import_table runs after it (RocksDBStore has no compact
   method: its column family's compact_range is called). Then upserts of --upsert-rows
   random existing keys (overwrites) in calls of 1,000 and 10,000 keys: vectors/s.
   Online updates: --updates vectors published with UpdateProducer (8,192 per message)
   and applied to a fresh redis + rocksdb-node table by an UpdateConsumer (read, decode,
   upsert, ack), timed from the first publish to the last ack.
2. Lookups, batches of 64 / 1024 / 16384 keys, rows drawn from Zipf(--alpha) over the
   table (rank r with probability ~ r^-alpha; row i has rank i + 1 and the keys are
   random, so hot rows are spread over the key space). Every method gets its own batches
   (same law) and runs them back to back in 5 blocks, the methods in rotating order from
   block to block (run_blocks): keys/s = keys / summed batch time, p50 / p99 of the
   per-batch time.
3. CachedTable (SharedEmbeddingCache, LRU, hit_rate_threshold=2.0: every miss is fetched
   from the tier synchronously, answered and inserted) in front of local, redis and
   rocksdb. For each target hit rate: the cache size at which LRU reaches it on single
   Zipf draws (Che's approximation), then one correction step from a short run on the
   local tier alone (batched misses make LRU miss more), rounded up by the power-of-two
   set count (ways 8..16 chosen to round least). Each tier gets its own cache, filled
   with that many hottest rows (untimed; about the state after a long run), then serves
   --cache-warmup and --cache-reps batches of --cache-batch Zipf keys, the same sequence
   for every tier (so the same hits), in blocks as in 2. The hit rate reported is the one
   CachedTable.stats counted over the timed batches, not the target. store % = share of
   the time spent in the tier (TableStats.store_ns); us per miss = that time / misses.
   Every segment is closed (unlinked) afterwards.

Options for a quick look: --rows 100000 --reps-scale 0.3 --updates 20000.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import uuid

import numpy as np

ROOT = os.path.dirname(os.path.abspath(__file__))
while not os.path.isdir(os.path.join(ROOT, "triton_rec")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_info  # noqa: E402

from tests.storage_fixtures import start_redis_cluster  # noqa: E402
from triton_rec.cache.cached_table import CachedTable  # noqa: E402
from triton_rec.cache.shm_cache import SharedEmbeddingCache, layout_for, segment_path  # noqa: E402
from triton_rec.formats.tables import write_table  # noqa: E402
from triton_rec.storage import node_store  # noqa: E402
from triton_rec.storage.backing_store import LocalTableStore, decode_values, encode_keys  # noqa: E402
from triton_rec.storage.redis_store import RedisClusterStore  # noqa: E402
from triton_rec.storage.rocksdb_store import NodeRocksDBTable, RocksDBStore  # noqa: E402
from triton_rec.updates import UpdateConsumer, UpdateProducer, topic_name  # noqa: E402

LOOKUP_BATCHES = (64, 1024, 16384)
LOOKUP_REPS = {64: 300, 1024: 120, 16384: 24}  # x --reps-scale
IMPORT_BATCH = 65536
UPSERT_BATCHES = (1000, 10000)
ROUNDS = 5  # blocks per measurement (see run_blocks)
CACHE_TIERS = ("local", "redis", "rocksdb")
SECTIONS = ("## Ingest", "## Lookups per tier", "## Cache in front of the tier")


class Zipf:
    """Row ids with P(row i) ~ (i + 1)^-alpha (row i has rank i + 1)."""

    def __init__(self, n: int, alpha: float):
        p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
        self.cdf = np.cumsum(p / p.sum())
        self.n = n

    def rows(self, rng, size: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(size)), self.n - 1)

    def lru_rows_for_hit_rate(self, h: float) -> int:
        """Cache rows at which an LRU cache reaches hit rate ``h`` on independent draws
        (Che's approximation: a key stays cached if it was drawn within the last T draws,
        C = sum_i 1 - exp(-p_i T), hit rate = sum_i p_i (1 - exp(-p_i T)))."""
        p = np.diff(self.cdf, prepend=0.0)
        lo, hi = 1.0, 1e15
        for _ in range(80):
            t = math.sqrt(lo * hi)
            if float(np.dot(p, -np.expm1(-p * t))) < h:
                lo = t
            else:
                hi = t
        return int(min(self.n, math.ceil(float(np.sum(-np.expm1(-p * hi))))))


def pct(times, q):
    return float(np.percentile(np.asarray(times), q)) * 1e3


def make_table(keys, vectors, tmp):
    """The node-local table as a serving process gets it: sparse files -> layout -> map."""
    src = os.path.join(tmp, "src", "bench_sparse_0.model")
    os.makedirs(os.path.dirname(src), exist_ok=True)
    write_table(src, keys, vectors)
    t0 = time.perf_counter()
    res = node_store.ensure_layout(src, vectors.shape[1], os.path.join(tmp, "store"))
    convert = time.perf_counter() - t0
    shutil.rmtree(os.path.dirname(src))  # the layout is all the table needs from now on
    table = node_store.open_table(res.path, "bench")
    table.prefault()  # as a deployment does (InstanceSpec.prefault)
    return table, convert


# -- 1. ingest -------------------------------------------------------------------------


def ingest(stores, keys, vectors, args, rng):
    n, row_mb = keys.shape[0], vectors.shape[1] * 4 / 1e6
    res = []
    for name, s in stores.items():
        t0 = time.perf_counter()
        for a in range(0, n, IMPORT_BATCH):
            s.upsert(keys[a : a + IMPORT_BATCH], vectors[a : a + IMPORT_BATCH])
        t = time.perf_counter() - t0
        res.append(
            {
                "tier": name,
                "what": f"bulk load, {IMPORT_BATCH:,} rows/call",
                "rows": n,
                "seconds": t,
                "rows_per_s": n / t,
                "mb_per_s": n * row_mb / t,
            }
        )
        compact = getattr(s, "compact", None)
        if compact is None and isinstance(s, RocksDBStore):
            compact = lambda s=s: s._cf.compact_range(None, None)  # noqa: E731 (no public API)
        if compact is not None:
            tc = time.perf_counter()
            compact()
            tc = time.perf_counter() - tc
            res.append(
                {
                    "tier": name,
                    "what": "bulk load + compaction (import_table)",
                    "rows": n,
                    "seconds": t + tc,
                    "rows_per_s": n / (t + tc),
                    "mb_per_s": n * row_mb / (t + tc),
                }
            )
    m = min(n, args.upsert_rows)
    for batch in UPSERT_BATCHES:
        rows = rng.choice(n, size=max(min(batch, m), (m // batch) * batch), replace=False)
        for name, s in stores.items():
            t0 = time.perf_counter()
            for a in range(0, rows.shape[0], batch):
                r = rows[a : a + batch]
                s.upsert(keys[r], vectors[r])
            t = time.perf_counter() - t0
            res.append(
                {
                    "tier": name,
                    "what": f"upsert, {batch:,} keys/call",
                    "rows": rows.shape[0],
                    "seconds": t,
                    "rows_per_s": rows.shape[0] / t,
                    "mb_per_s": rows.shape[0] * row_mb / t,
                }
            )
    return res


def stream_ingest(address, stores, keys, vectors, count):
    """UpdateProducer -> Redis Stream -> UpdateConsumer -> upsert into ``stores``."""
    model, table = f"bench{uuid.uuid4().hex[:6]}", "t"
    topic = topic_name(model, table)
    applied = [0]

    def apply(_m, _t, k, v):
        for s in stores:
            s.upsert(k, v)
        applied[0] += k.shape[0]

    consumer = UpdateConsumer(address, "bench", "c0", {topic: vectors.shape[1]}, apply, block_ms=50)
    try:
        consumer.poll_once(10)  # creates the group before anything is published
        idx = np.arange(count) % keys.shape[0]
        t0 = time.perf_counter()
        with UpdateProducer(address, max_batch_size=8192) as p:
            for a in range(0, count, 65536):
                p.publish(model, table, keys[idx[a : a + 65536]], vectors[idx[a : a + 65536]])
        t_pub = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        while applied[0] < count and time.monotonic() < deadline:
            consumer.poll_once(50)
        t = time.perf_counter() - t0
    finally:
        consumer.close()
    row_mb = vectors.shape[1] * 4 / 1e6
    return [
        {
            "tier": "stream",
            "what": "publish only (UpdateProducer)",
            "rows": count,
            "seconds": t_pub,
            "rows_per_s": count / t_pub,
            "mb_per_s": count * row_mb / t_pub,
        },
        {
            "tier": "stream -> "
            + " + ".join(s.tier if s.tier != "rocksdb" else "rocksdb-node" for s in stores),
            "what": "publish + consume + apply + ack",
            "rows": applied[0],
            "seconds": t,
            "rows_per_s": applied[0] / t,
            "mb_per_s": applied[0] * row_mb / t,
        },
    ]


# -- 2. lookups --------------------------------------------------------------------------


def run_blocks(methods, batches, rounds):
    """Time ``methods[m](batches[m][i])`` for every i. The batches are split in ``rounds``
    blocks; each round runs every method over its next block, methods in rotating order:
    each method runs back to back (its own steady state, as a serving loop would) and
    slow drifts of the shared machine fall on every method alike."""
    names = list(methods)
    times = {m: [] for m in names}
    n = len(batches[names[0]])
    bounds = [round(n * r / rounds) for r in range(rounds + 1)]
    for r in range(rounds):
        for m in names[r % len(names) :] + names[: r % len(names)]:
            fn = methods[m]
            for b in batches[m][bounds[r] : bounds[r + 1]]:
                t0 = time.perf_counter()
                fn(b)
                times[m].append(time.perf_counter() - t0)
    return times


def lookups(stores, keys, vectors, zipf, args, rng):
    dim = vectors.shape[1]
    res = []
    for batch in LOOKUP_BATCHES:
        reps = max(3, int(LOOKUP_REPS[batch] * args.reps_scale))
        out = np.empty((batch, dim), np.float32)
        found = np.empty(batch, bool)

        def codec(b, out=out, found=found):
            raw = encode_keys(b[1])
            decode_values(b[2], b[1], out, found, 0.0, "bench")
            return raw

        methods = {
            "gather": lambda b, out=out: np.take(vectors, b[0], axis=0, out=out, mode="clip"),
            "codec": codec,
        }
        for name, s in stores.items():
            methods[name] = lambda b, s=s, out=out: s.fetch(b[1], out)
        batches = {}
        for m in methods:  # every method gets batches of its own (same law, other rows)
            rows = [zipf.rows(rng, batch) for _ in range(reps)]
            batches[m] = [
                (r, keys[r], [v.tobytes() for v in vectors[r]] if m == "codec" else None)
                for r in rows
            ]
        times = run_blocks(methods, batches, min(ROUNDS, reps))
        for m in methods:
            ts = times[m]
            res.append(
                {
                    "batch": batch,
                    "tier": m,
                    "reps": reps,
                    "keys_per_s": batch * len(ts) / sum(ts),
                    "us_per_key": 1e6 * sum(ts) / (batch * len(ts)),
                    "p50_ms": pct(ts, 50),
                    "p99_ms": pct(ts, 99),
                }
            )
    return res


# -- 3. cache in front -------------------------------------------------------------------


def cache_layout(rows: int):
    """(ways, requested capacity) with the least power-of-two rounding for ``rows``."""
    best = None
    for ways in range(8, 17):
        actual = layout_for(rows, ways) * ways
        if best is None or actual < best[1]:
            best = (ways, actual)
    return best


def cache_point(stores, rows_wanted, keys, vectors, zipf, args, rng, prefix, warmup, reps):
    """One cache size: a fresh cache per tier, filled with the ``rows_wanted`` hottest rows
    (hottest inserted last = most recent), then ``warmup`` + ``reps`` batches through
    CachedTable, the tiers in rotating order on the same batches."""
    dim, batch = vectors.shape[1], args.cache_batch
    ways, cap = cache_layout(max(64, rows_wanted))
    caches, tables, res = {}, {}, []
    try:
        for name in stores:
            caches[name] = SharedEmbeddingCache.open(
                f"{prefix}{uuid.uuid4().hex[:8]}", cap, dim, policy="lru", ways=ways
            )
            tables[name] = CachedTable(name, stores[name], caches[name], hit_rate_threshold=2.0)
            for e in range(rows_wanted, 0, -IMPORT_BATCH):
                s = max(0, e - IMPORT_BATCH)
                caches[name].insert(
                    np.ascontiguousarray(keys[s:e][::-1]), np.ascontiguousarray(vectors[s:e][::-1])
                )
        out = np.empty((batch, dim), np.float32)
        names = list(stores)
        # every tier's cache sees the same key sequence, so the same hits
        seq = [keys[zipf.rows(rng, batch)] for _ in range(warmup + reps)]
        methods = {m: (lambda t: lambda k: t.lookup(k, out))(tables[m]) for m in names}
        run_blocks(methods, {m: seq[:warmup] for m in names}, 1)
        before = {m: tables[m].stats.snapshot() for m in names}
        times = run_blocks(methods, {m: seq[warmup:] for m in names}, min(ROUNDS, reps))
        for m in names:
            a, b = tables[m].stats.snapshot(), before[m]
            d = {k: a[k] - b[k] for k in ("lookups", "hits", "misses", "store_ns", "cache_ns")}
            ts = times[m]
            res.append(
                {
                    "tier": m,
                    "cache_rows": caches[m].capacity,
                    "ways": ways,
                    "filled_rows": rows_wanted,
                    "hit_rate": d["hits"] / d["lookups"],
                    "keys_per_s": d["lookups"] / sum(ts),
                    "p50_ms": pct(ts, 50),
                    "p99_ms": pct(ts, 99),
                    "store_share": d["store_ns"] / 1e9 / sum(ts),
                    "cache_share": d["cache_ns"] / 1e9 / sum(ts),
                    "us_per_miss": (d["store_ns"] / 1e3 / d["misses"] if d["misses"] else None),
                }
            )
    finally:
        for c in caches.values():
            c.close()
    return res


def with_cache(stores, keys, vectors, zipf, args, rng, prefix):
    """Per target hit rate: size from Che's approximation, one calibration step on the
    local tier alone (batching makes LRU miss more than on single draws), then the run."""
    res = []
    n = keys.shape[0]
    for target in args.hit_rates:
        rows0 = max(1, zipf.lru_rows_for_hit_rate(target))
        h0 = cache_point(
            {"local": stores["local"]},
            rows0,
            keys,
            vectors,
            zipf,
            args,
            rng,
            prefix,
            args.cache_warmup,
            max(10, args.cache_reps // 4),
        )[0]["hit_rate"]
        aim = min(0.9999, max(0.01, target + (target - h0)))
        rows = max(1, min(n, zipf.lru_rows_for_hit_rate(aim)))
        for r in cache_point(
            stores, rows, keys, vectors, zipf, args, rng, prefix, args.cache_warmup, args.cache_reps
        ):
            res.append(
                {"target": target, "calibration_rows": rows0, "calibration_hit_rate": h0, **r}
            )
    return res


# -- output ------------------------------------------------------------------------------


def markdown(result) -> str:
    m, a = result["machine"], result["args"]
    lines = [
        f"machine: {m['cpu_model']}, nproc {m['nproc']}, {m.get('ram_gib', '?')} GiB RAM, "
        f"Linux {m['kernel']}, Python {m['python']}, numpy {m['numpy']}, "
        f"loadavg {m['loadavg']} (start) / {result['loadavg_end']} (end); "
        f"wall time {result['wall_s']:.0f} s",
        f"table: {a['rows']:,} rows x {a['dim']} float32 "
        f"({a['rows'] * a['dim'] * 4 / 2**20:.0f} MiB), "
        f"Zipf alpha {a['alpha']}, Redis {a['partitions']} partitions on 3 masters; "
        f"node-local layout conversion {result['layout_convert_s']:.1f} s",
        "",
    ]
    lines += [
        SECTIONS[0],
        "",
        "| tier | what | rows | s | rows/s | MB/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["ingest"]:
        lines.append(
            f"| {r['tier']} | {r['what']} | {r['rows']:,} | {r['seconds']:.2f} | "
            f"{r['rows_per_s']:,.0f} | {r['mb_per_s']:.1f} |"
        )
    lines += [
        "",
        SECTIONS[1],
        "",
        "| batch | tier | keys/s | us/key | p50 ms | p99 ms | vs gather |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    gather = {r["batch"]: r["keys_per_s"] for r in result["lookup"] if r["tier"] == "gather"}
    for r in result["lookup"]:
        lines.append(
            f"| {r['batch']:,} | {r['tier']} | {r['keys_per_s']:,.0f} | "
            f"{r['us_per_key']:.3f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
            f"{r['keys_per_s'] / gather[r['batch']]:.4f} |"
        )
    lines += [
        "",
        SECTIONS[2],
        "",
        f"CachedTable, LRU, hit_rate_threshold 2.0, batches of {a['cache_batch']:,} keys, "
        f"{a['cache_reps']} timed after {a['cache_warmup']} warm-up; "
        "no cache = the same tier's row at this batch size above.",
        "",
        "| target | filled rows | cache rows (ways) | tier | measured hit rate | keys/s | "
        "p50 ms | p99 ms | store % | us per miss | vs no cache |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    nocache = {
        r["tier"]: r["keys_per_s"] for r in result["lookup"] if r["batch"] == a["cache_batch"]
    }
    for r in result["cache"]:
        base = nocache.get(r["tier"])
        vs = f"{r['keys_per_s'] / base:.2f}x" if base else "-"
        upm = "-" if r["us_per_miss"] is None else f"{r['us_per_miss']:.2f}"
        lines.append(
            f"| {r['target']} | {r['filled_rows']:,} | "
            f"{r['cache_rows']:,} ({r['ways']}) | "
            f"{r['tier']} | {r['hit_rate']:.4f} | {r['keys_per_s']:,.0f} | "
            f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {100 * r['store_share']:.0f} | "
            f"{upm} | {vs} |"
        )
    return "\n".join(lines) + "\n"


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = result["args"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"local": "C0", "redis": "C1", "rocksdb": "C2"}
    nocache = {
        r["tier"]: r["keys_per_s"] for r in result["lookup"] if r["batch"] == a["cache_batch"]
    }
    for tier in CACHE_TIERS:
        pts = sorted((r["hit_rate"], r["keys_per_s"]) for r in result["cache"] if r["tier"] == tier)
        if not pts:
            continue
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            color=colors[tier],
            label=f"{tier} + cache",
        )
        if tier in nocache:
            ax.axhline(nocache[tier], color=colors[tier], ls=":", lw=1, label=f"{tier}, no cache")
    if "gather" in nocache:
        ax.axhline(nocache["gather"], color="k", ls="--", lw=1, label="np.take gather (limit)")
    ax.set_yscale("log")
    ax.set_xlabel("measured cache hit rate (CachedTable.stats)")
    ax.set_ylabel(f"keys/s ({a['cache_batch']}-key batches, one thread)")
    ax.set_title(
        f"Cache in front of each tier: {a['rows']:,} x {a['dim']} float32, Zipf {a['alpha']}",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def leftover_segments(prefix):
    d = os.path.dirname(segment_path(prefix + "x"))
    base = os.path.basename(segment_path(prefix + "x"))[:-1]
    return [os.path.join(d, f) for f in os.listdir(d) if f.startswith(base)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="table rows (default 1M)")
    ap.add_argument("--dim", type=int, default=64, help="float32 per row (default 64)")
    ap.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent (default 1.05)")
    ap.add_argument("--partitions", type=int, default=8, help="Redis hashes per table (default 8)")
    ap.add_argument(
        "--reps-scale",
        type=float,
        default=1.0,
        help=f"x lookup batches per size {LOOKUP_REPS} (default 1)",
    )
    ap.add_argument(
        "--upsert-rows",
        type=int,
        default=100_000,
        help="keys overwritten per upsert batch size (default 100k)",
    )
    ap.add_argument(
        "--updates",
        type=int,
        default=100_000,
        help="vectors sent through Redis Streams (default 100k; 0: skip)",
    )
    ap.add_argument(
        "--hit-rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.5, 0.8, 0.95, 0.99],
        help="target hit rates (default 0.5,0.8,0.95,0.99)",
    )
    ap.add_argument("--cache-batch", type=int, default=1024, help="keys per cached lookup")
    ap.add_argument("--cache-warmup", type=int, default=30, help="untimed batches per hit rate")
    ap.add_argument("--cache-reps", type=int, default=150, help="timed batches per hit rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json",
        default=os.path.join(ROOT, "benchmarks", "out", "bench_tiers.json"),
        help="results as JSON ('' for none)",
    )
    ap.add_argument(
        "--md",
        default=os.path.join(ROOT, "benchmarks", "out", "bench_tiers.md"),
        help="the printed tables as a markdown file ('' for none)",
    )
    ap.add_argument(
        "--plot",
        default=os.path.join(ROOT, "benchmarks", "bench_tiers.png"),
        help="PNG of keys/s vs hit rate (needs matplotlib; '' for none)",
    )
    args = ap.parse_args(argv)
    if args.cache_batch not in LOOKUP_BATCHES:
        ap.error(f"--cache-batch must be one of {LOOKUP_BATCHES}")

    t_start = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    keys = np.unique(rng.integers(-(2**62), 2**62, args.rows + args.rows // 8 + 16, dtype=np.int64))
    keys = rng.permutation(keys)[: args.rows]
    vectors = rng.standard_normal((keys.shape[0], args.dim)).astype(np.float32)
    zipf = Zipf(keys.shape[0], args.alpha)
    result = {"machine": machine_info("/tmp"), "args": vars(args)}
    prefix = f"bench-tiers-{os.getpid()}-"
    opened = []
    tmp = tempfile.mkdtemp(prefix="trec-bench-tiers-")
    try:
        with start_redis_cluster(3) as cluster:
            table, result["layout_convert_s"] = make_table(keys, vectors, tmp)
            local = LocalTableStore(table)
            redis_store = RedisClusterStore(
                cluster.address, "bench.t", args.dim, num_partitions=args.partitions
            )
            opened.append(redis_store)
            rocks = RocksDBStore(os.path.join(tmp, "rocks"), "bench.t", args.dim, num_threads=2)
            opened.append(rocks)
            node = NodeRocksDBTable(
                os.path.join(tmp, "rocks-node"), "bench.t", args.dim, num_threads=2
            )
            opened.append(node)
            writable = {"redis": redis_store, "rocksdb": rocks, "rocksdb-node": node}
            result["ingest"] = ingest(writable, keys, vectors, args, rng)
            if args.updates > 0:
                s_redis = RedisClusterStore(
                    cluster.address, "bench.u", args.dim, num_partitions=args.partitions
                )
                s_node = NodeRocksDBTable(
                    os.path.join(tmp, "rocks-stream"), "bench.u", args.dim, num_threads=2
                )
                try:
                    result["ingest"] += stream_ingest(
                        cluster.address, [s_redis, s_node], keys, vectors, args.updates
                    )
                finally:
                    s_redis.close()
                    s_node.close()
            tiers = {"local": local, **writable}
            result["lookup"] = lookups(tiers, keys, vectors, zipf, args, rng)
            result["cache"] = with_cache(
                {t: tiers[t] for t in CACHE_TIERS}, keys, vectors, zipf, args, rng, prefix
            )
    finally:
        for s in opened:
            s.close()
        shutil.rmtree(tmp, ignore_errors=True)
        for p in leftover_segments(prefix):  # only if a close failed
            os.unlink(p)
    result["loadavg_end"] = machine_info()["loadavg"]
    result["wall_s"] = time.perf_counter() - t_start
    text = markdown(result)
    print(text, end="")
    for path in (args.json, args.md, args.plot):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError as e:  # matplotlib comes with the `bench` extra only
            print(f"\nno plot: {e} (pip install -e '.[bench]')")
            args.plot = ""
    print(f"\nwrote {', '.join(p for p in (args.json, args.md, args.plot) if p)}")
    return result


if __name__ == "__main__":
    main()
