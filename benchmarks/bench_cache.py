#!/usr/bin/env python3
"""Embedding-cache costs, measured side by side in one run: the shared-memory CPU cache
(SharedEmbeddingCache) at several hit rates next to the raw gather limit and the fused
table lookup, CachedTable end to end, cache inserts, the numpy run of the array-API
(GPU) cache, and two processes querying one shared cache.

Table: --rows random unique int64 keys x --dim float32, hash index built as the
node-local table builds it. Caches of --cache-rows slots (8 ways) are filled with a
"hot" set of --fill x slots rows; the rows every cache really kept (set overflow evicts
or rejects a few) are the *resident* rows, the rows never inserted are the *cold* rows.
A batch at hit rate h is round(h x --batch) resident rows + the rest cold rows,
shuffled, so every cache answers exactly the same hits (checked).

1. Query, per hit rate (one fresh batch per repetition, every method on that batch,
   order alternating between repetitions):
     shm lru / shm tinylfu   SharedEmbeddingCache.query(keys, out, hit_mask)
     array cache (numpy)     ArrayEmbeddingCache(...).host_view().query(...), the GPU
                             algorithm run with numpy (not the CPU path)
     take, all rows          np.take(vectors, rows, axis=0, out=out, mode="clip") with the
                             row ids precomputed: the raw gather limit for the whole batch
     take, hit rows          the same for the hit rows only (the bytes the cache copies)
     fused table lookup      _native.lookup(index, vectors, keys, out, 0.0) (1 thread):
                             the node-local table without a cache
2. CachedTable.lookup (lru cache + LocalTableStore), per hit rate:
     sync   hit_rate_threshold 1.5: misses fetched from the store, answered, inserted.
            The cached state (resident rows only) is re-created before every timed
            lookup (clear + insert, untimed): each one is a warm cache meeting new misses.
     async  hit_rate_threshold 0 + BackgroundInserter: serving path only (misses answered
            with the default value, handed to the inserter); the inserter is drained and
            the state re-created after the timed call, untimed.
     store  CachedTable without a cache (gpucache: false): LocalTableStore.fetch.
3. Insert (lru, tinylfu) of --batch new keys into an empty cache (cleared before every
   repetition) and into a full cache (steady state: every set full, keys not cached);
   tinylfu into a full cache twice: cold keys (TinyLFU rejects them) and keys queried
   once beforehand (admitted, evicting). Reference: numpy scatter of the same bytes
   into random rows of a [slots, dim] array.
4. The array cache: column "array cache (numpy)" of part 1.
5. Processes: persistent worker processes (forked after setup, each attached to the
   shared cache by name, each with its own batches) run --mp-iters back-to-back lookups;
   1 process alone vs 2 at once, aggregate keys/s = keys of all workers / wall time from
   the first start to the last end.

Medians over repetitions; GB/s = bytes of the output buffer (batch x dim x 4) per second.

    python benchmarks/bench_cache.py [--rows 1000000] [--dim 128] [--batch 65536]
                                     [--cache-rows 262144] [--reps 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
import traceback
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lookup import timed, unique_random_keys  # noqa: E402
from machine import machine_info  # noqa: E402

from triton_rec import _native  # noqa: E402
from triton_rec.cache.array_cache import ArrayEmbeddingCache  # noqa: E402
from triton_rec.cache.cached_table import BackgroundInserter, CachedTable  # noqa: E402
from triton_rec.cache.shm_cache import SharedEmbeddingCache  # noqa: E402
from triton_rec.storage.backing_store import LocalTableStore  # noqa: E402
from triton_rec.storage.table import EmbeddingTable  # noqa: E402

WAYS = 8
SECTIONS = (
    "## 1. Cache query vs gather limit",
    "## 2. CachedTable.lookup end to end",
    "## 3. Insert throughput",
    "## 4. Array-API cache (numpy) vs native cache",
    "## 5. Processes sharing one cache",
)


# ------------------------------------------------------------------------------- helpers


def med(xs):
    return statistics.median(xs)


def ms(t):
    return f"{t * 1e3:.2f}"


def mk(n, t):
    return f"{n / t / 1e6:.2f}"


def gbs(nbytes, t):
    return f"{nbytes / t / 1e9:.2f}"


def ratio(num, den):
    return f"{num / den:.2f}"


def make_batch(rng, resident, cold, batch, hit_rate):
    """Row ids: round(hit_rate x batch) resident rows + the rest cold rows (distinct when
    there are enough), shuffled. Returns (rows, number of hits)."""
    nh = int(round(hit_rate * batch))
    hot = rng.choice(resident, nh, replace=nh > len(resident))
    miss = rng.choice(cold, batch - nh, replace=batch - nh > len(cold))
    rows = np.concatenate([hot, miss])
    rng.shuffle(rows)
    return rows, nh


class Bench:
    def __init__(self, args):
        self.args = args
        self.tag = f"bench-cache-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.caches = []
        self.results = {}

    def open_cache(self, suffix, policy):
        c = SharedEmbeddingCache.open(
            f"{self.tag}-{suffix}", self.args.cache_rows, self.args.dim, policy=policy, ways=WAYS
        )
        self.caches.append(c)
        return c

    def close(self):
        for c in self.caches:
            c.close()


# --------------------------------------------------------------------------- setup


def setup(b: Bench):
    a = b.args
    rng = np.random.default_rng(a.seed)
    t0 = time.perf_counter()
    b.keys = unique_random_keys(rng, a.rows)
    b.vectors = rng.random((a.rows, a.dim), dtype=np.float32)
    b.table = EmbeddingTable("bench", b.keys, b.vectors, default_value=0.0)
    b.store = LocalTableStore(b.table)
    print(f"generated table + index in {time.perf_counter() - t0:.1f} s")

    b.lru = b.open_cache("lru", "lru")
    b.tlfu = b.open_cache("tinylfu", "tinylfu")
    b.arr = ArrayEmbeddingCache(a.cache_rows, a.dim, ways=WAYS, policy="lru")
    b.arr_view = b.arr.host_view()
    slots = b.lru.capacity
    n_hot = max(1, int(a.fill * slots))
    hot = np.sort(rng.choice(a.rows, n_hot, replace=False))
    hk, hv = b.keys[hot], np.ascontiguousarray(b.vectors[hot])
    t0 = time.perf_counter()
    for c in (b.lru, b.tlfu):
        c.insert(hk, hv)
    b.arr.insert(hk, hv)
    kept = np.isin(hk, b.lru.keys()) & np.isin(hk, b.tlfu.keys()) & np.isin(hk, b.arr_view.keys())
    b.resident = hot[kept]
    b.cold = np.setdiff1d(np.arange(a.rows), hot)
    b.res_keys = b.keys[b.resident]
    b.res_vecs = np.ascontiguousarray(b.vectors[b.resident])
    print(
        f"caches: {slots} slots ({b.lru.num_sets} sets x {WAYS} ways), "
        f"shm segment {b.lru.nbytes / 2**20:.0f} MiB (lru), {b.tlfu.nbytes / 2**20:.0f} MiB "
        f"(tinylfu); filled with {n_hot} hot rows in {time.perf_counter() - t0:.1f} s, "
        f"{len(b.resident)} resident in all three caches, {len(b.cold)} cold rows"
    )


# ----------------------------------------------------------------- 1 + 4: query vs limits


def bench_query(b: Bench):
    a = b.args
    B, D = a.batch, a.dim
    rng = np.random.default_rng(a.seed + 1)
    out = np.empty((B, D), np.float32)
    hm = np.empty(B, np.uint8)
    hits_seen = {}
    hit_rows = [None]  # row ids of the current batch's hits (for "take, hit rows")

    def shm(cache, name):
        def f(bk, rows, nh):
            h = cache.query(bk, out, hm)
            hits_seen.setdefault(name, set()).add(h - nh)

        return f

    def arr(bk, rows, nh):
        h = b.arr_view.query(bk, out, hm)
        hits_seen.setdefault("array", set()).add(h - nh)

    def take_all(bk, rows, nh):
        np.take(b.vectors, rows, axis=0, out=out, mode="clip")

    def take_hit(bk, rows, nh):
        np.take(b.vectors, hit_rows[0], axis=0, out=out[:nh], mode="clip")

    def fused(bk, rows, nh):
        _native.lookup(b.table.index, b.vectors, bk, out, 0.0, num_threads=1)

    methods = [
        ("shm lru", shm(b.lru, "lru")),
        ("shm tinylfu", shm(b.tlfu, "tinylfu")),
        ("array cache (numpy)", arr),
        ("take, all rows", take_all),
        ("take, hit rows", take_hit),
        ("fused table lookup", fused),
    ]

    # correctness + warm-up: hits and hit vectors of every cache
    rows, nh = make_batch(rng, b.resident, b.cold, B, 0.5)
    bk = b.keys[rows]
    is_hot = np.isin(rows, b.resident)
    hit_rows[0] = rows[is_hot]
    for name, cache in (("lru", b.lru), ("tinylfu", b.tlfu), ("array", b.arr_view)):
        out.fill(-1)
        h = cache.query(bk, out, hm)
        if (
            h != nh
            or not np.array_equal(hm.astype(bool), is_hot)
            or not np.array_equal(out[is_hot], b.vectors[rows[is_hot]])
        ):
            raise RuntimeError(f"{name} cache answered {h} hits, expected {nh}, or wrong vectors")
    for _, f in methods:
        f(bk, rows, nh)

    res = {}
    for hr in a.hit_rates:
        times = {n: [] for n, _ in methods}
        for rep in range(a.reps):
            rows, nh = make_batch(rng, b.resident, b.cold, B, hr)
            hit_rows[0] = rows[np.isin(rows, b.resident)]
            bk = b.keys[rows]
            order = methods if rep % 2 == 0 else methods[::-1]
            for n, f in order:
                times[n].append(timed(lambda f=f, bk=bk, rows=rows, nh=nh: f(bk, rows, nh)))
        res[hr] = {"hits": nh, **{n: med(t) for n, t in times.items()}}
    bad = {k: v for k, v in hits_seen.items() if v != {0}}
    if bad:
        raise RuntimeError(f"caches answered unexpected hit counts (delta vs expected): {bad}")
    b.results["query"] = res

    print(f"\n{SECTIONS[0]}\n")
    print(
        f"Median ms per batch of {B} keys ({a.reps} repetitions, same batch for every "
        "method in a repetition).\n"
    )
    print(
        "| hit rate | hits | shm lru | shm tinylfu | take, all rows | take, hit rows "
        "| fused table lookup |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for hr, r in res.items():
        print(
            f"| {hr:.0%} | {r['hits']} | {ms(r['shm lru'])} | {ms(r['shm tinylfu'])} | "
            f"{ms(r['take, all rows'])} | {ms(r['take, hit rows'])} | "
            f"{ms(r['fused table lookup'])} |"
        )
    print(
        "\nThroughput and ratios (a ratio x = reference time / cache time: 1.00 = as fast "
        "as the reference, 0.50 = half its throughput).\n"
    )
    print(
        "| hit rate | lru Mkeys/s | lru GB/s | lru vs take all rows | lru vs take hit rows "
        "| lru vs fused table | tinylfu vs lru |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for hr, r in res.items():
        t = r["shm lru"]
        print(
            f"| {hr:.0%} | {mk(B, t)} | {gbs(B * D * 4, t)} | "
            f"{ratio(r['take, all rows'], t)} | {ratio(r['take, hit rows'], t)} | "
            f"{ratio(r['fused table lookup'], t)} | {ratio(t, r['shm tinylfu'])} |"
        )


def print_array(b: Bench):
    a = b.args
    B = a.batch
    print(f"\n{SECTIONS[3]}\n")
    print(
        "ArrayEmbeddingCache (the GPU algorithm, here with numpy) through host_view().query, "
        "timed in the loop of part 1 on the same batches.\n"
    )
    print(
        "| hit rate | array ms | array Mkeys/s | shm lru ms | array / shm lru (time) "
        "| array vs take all rows |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for hr, r in b.results["query"].items():
        t = r["array cache (numpy)"]
        print(
            f"| {hr:.0%} | {ms(t)} | {mk(B, t)} | {ms(r['shm lru'])} | "
            f"{ratio(t, r['shm lru'])} | {ratio(r['take, all rows'], t)} |"
        )


# ------------------------------------------------------------------- 2: CachedTable


def restore(b: Bench, cache):
    cache.clear()
    cache.insert(b.res_keys, b.res_vecs)


def bench_cached_table(b: Bench):
    a = b.args
    B, D = a.batch, a.dim
    rng = np.random.default_rng(a.seed + 2)
    out = np.empty((B, D), np.float32)
    cache = b.lru
    inserter = BackgroundInserter(max_pending=64)
    sync_t = CachedTable("bench", b.store, cache, hit_rate_threshold=1.5)
    async_t = CachedTable("bench", b.store, cache, hit_rate_threshold=0.0, inserter=inserter)
    store_t = CachedTable("bench", b.store, None)

    restore(b, cache)
    if cache.size() != len(b.resident):
        raise RuntimeError(f"restore left {cache.size()} keys, expected {len(b.resident)}")

    breakdown = {}

    def run_sync(bk, rows, nh):
        restore(b, cache)
        s0 = sync_t.stats.snapshot()
        t = timed(lambda: sync_t.lookup(bk, out))
        s1 = sync_t.stats.snapshot()
        if s1["hits"] - s0["hits"] != nh:
            raise RuntimeError("sync lookup: unexpected hits")
        c, s = (s1["cache_ns"] - s0["cache_ns"]) * 1e-9, (s1["store_ns"] - s0["store_ns"]) * 1e-9
        breakdown.setdefault(nh, []).append((c, s, t - c - s))
        return t

    def run_async(bk, rows, nh):
        restore(b, cache)
        t = timed(lambda: async_t.lookup(bk, out))
        if not inserter.drain(60):
            raise RuntimeError("background inserter did not drain")
        return t

    def run_store(bk, rows, nh):
        return timed(lambda: store_t.lookup(bk, out))

    reused = np.empty((B, D), np.float32)

    def run_steps(bk, rows, nh):
        """The steps of the synchronous path (cached_table.py), each timed on its own."""
        restore(b, cache)
        pc = time.perf_counter
        t0 = pc()
        hit = np.zeros(B, dtype=np.uint8)
        cache.query(bk, out, hit)
        t1 = pc()
        miss_idx = np.flatnonzero(hit == 0)
        miss_keys = bk[miss_idx]
        fetched = np.empty((len(miss_idx), D), dtype=np.float32)
        t2 = pc()
        b.store.fetch(miss_keys, fetched)
        t3 = pc()
        out[miss_idx] = fetched
        t4 = pc()
        cache.insert(miss_keys, fetched)
        t5 = pc()
        b.store.fetch(miss_keys, reused[: len(miss_idx)])  # same fetch, warm buffer
        t6 = pc()
        steps.setdefault(nh, []).append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5))
        return t5 - t0

    steps = {}
    methods = [("sync", run_sync), ("async", run_async), ("store", run_store), ("steps", run_steps)]
    res = {}
    try:
        for hr in a.hit_rates:
            times = {n: [] for n, _ in methods}
            for rep in range(a.e2e_reps):
                rows, nh = make_batch(rng, b.resident, b.cold, B, hr)
                bk = b.keys[rows]
                for n, f in methods if rep % 2 == 0 else methods[::-1]:
                    times[n].append(f(bk, rows, nh))
            br, st = breakdown[nh], steps[nh]
            res[hr] = {
                "hits": nh,
                **{n: med(t) for n, t in times.items()},
                "sync_cache": med([x[0] for x in br]),
                "sync_store": med([x[1] for x in br]),
                "sync_other": med([x[2] for x in br]),
                **{
                    f"step_{name}": med([x[i] for x in st])
                    for i, name in enumerate(
                        ("query", "glue", "fetch", "scatter", "insert", "fetch_warm")
                    )
                },
            }
    finally:
        inserter.close()
    restore(b, cache)
    # the synchronous answers are exact: check one batch against the table
    rows, nh = make_batch(rng, b.resident, b.cold, B, 0.5)
    sync_t.lookup(b.keys[rows], out)
    if not np.array_equal(out, b.vectors[rows]):
        raise RuntimeError("synchronous CachedTable.lookup returned wrong vectors")
    restore(b, cache)
    b.results["cached_table"] = res

    print(f"\n{SECTIONS[1]}\n")
    print(
        f"Median ms per batch of {B} keys ({a.e2e_reps} repetitions). sync = "
        "hit_rate_threshold 1.5 (misses fetched, answered exactly, inserted), cached state "
        "re-created before each timed lookup; async = threshold 0 + BackgroundInserter, "
        "serving path only; store = no cache (LocalTableStore.fetch = fused table lookup). "
        "sync breakdown from CachedTable.stats: cache = query + insert, store = from the "
        "query's end to the insert (miss index, fetch into a new buffer, scatter into "
        "out), other = the rest.\n"
    )
    print(
        "| hit rate | sync ms | (cache / store / other) | async ms | store ms "
        "| sync Mkeys/s | async Mkeys/s | sync vs store | async vs store |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for hr, r in res.items():
        print(
            f"| {hr:.0%} | {ms(r['sync'])} | {ms(r['sync_cache'])} / {ms(r['sync_store'])} / "
            f"{ms(r['sync_other'])} | {ms(r['async'])} | {ms(r['store'])} | "
            f"{mk(B, r['sync'])} | {mk(B, r['async'])} | {ratio(r['store'], r['sync'])} | "
            f"{ratio(r['store'], r['async'])} |"
        )
    print(
        "\nWhere the synchronous path's time goes: its steps replayed one by one on the same "
        "batches and cache state (median ms). glue = hit mask, miss index, miss keys, "
        "new buffer; fetch = LocalTableStore.fetch of the misses into that new buffer; "
        "fetch, warm buffer = the same fetch again into a buffer already written "
        "(not part of the path: shows the cost of first-touching the new buffer).\n"
    )
    print(
        "| hit rate | misses | query | glue | fetch | scatter into out | insert "
        "| sum | fetch, warm buffer |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for hr, r in res.items():
        parts = [r[f"step_{n}"] for n in ("query", "glue", "fetch", "scatter", "insert")]
        print(
            f"| {hr:.0%} | {B - r['hits']} | "
            + " | ".join(ms(x) for x in parts)
            + f" | {ms(sum(parts))} | {ms(r['step_fetch_warm'])} |"
        )


# -------------------------------------------------------------------------- 3: insert


def bench_insert(b: Bench):
    a = b.args
    B, D = a.batch, a.dim
    rng = np.random.default_rng(a.seed + 3)
    caches = {p: b.open_cache(f"ins-{p}", p) for p in ("lru", "tinylfu")}
    slots = caches["lru"].capacity
    scratch = np.zeros((slots, D), np.float32)
    hm = np.empty(B, np.uint8)
    qout = np.empty((B, D), np.float32)

    def new_rows(cache):
        cached = np.isin(b.keys, cache.keys())
        return rng.choice(np.flatnonzero(~cached), B, replace=False)

    def fill(cache):
        perm = rng.permutation(a.rows)
        for i in range(0, min(a.rows, 4 * slots), B):
            r = perm[i : i + B]
            cache.insert(b.keys[r], np.ascontiguousarray(b.vectors[r]))
        if cache.size() != cache.capacity:
            raise RuntimeError(f"could not fill the cache ({cache.size()} of {cache.capacity})")

    cases = [
        ("lru", "empty"),
        ("lru", "full"),
        ("tinylfu", "empty"),
        ("tinylfu", "full, cold keys"),
        ("tinylfu", "full, keys queried once"),
        ("numpy scatter", "reference"),
    ]
    times = {c: [] for c in cases}
    counts = {c: [] for c in cases}
    # Empty cases first (clear before each), then the full ones (steady state).
    for _ in range(a.insert_reps):
        for pol in ("lru", "tinylfu"):
            c = caches[pol]
            c.clear()
            r = rng.choice(a.rows, B, replace=False)
            k, v = b.keys[r], np.ascontiguousarray(b.vectors[r])
            res = []
            times[(pol, "empty")].append(
                timed(lambda res=res, c=c, k=k, v=v: res.append(c.insert(k, v)))
            )
            counts[(pol, "empty")].append(res[0])
        slots_idx = rng.choice(slots, min(B, slots), replace=False)
        v = np.ascontiguousarray(b.vectors[rng.choice(a.rows, len(slots_idx))])

        def scatter(slots_idx=slots_idx, v=v):
            scratch[slots_idx] = v

        times[cases[-1]].append(timed(scatter))
    for c in caches.values():
        c.clear()
        fill(c)
    for _ in range(a.insert_reps):
        for case in cases[:-1]:
            pol, state = case
            if state == "empty":
                continue
            c = caches[pol]
            if state == "full, keys queried once":
                # A fresh cache (zero sketch) filled with never-queried keys, so that keys
                # queried once beforehand beat every victim: all admitted, all evicting.
                c = SharedEmbeddingCache.open(
                    f"{b.tag}-ins-fresh", a.cache_rows, D, policy=pol, ways=WAYS
                )
            try:
                if c is not caches[pol]:
                    fill(c)
                r = new_rows(c)
                k, v = b.keys[r], np.ascontiguousarray(b.vectors[r])
                if state == "full, keys queried once":
                    c.query(k, qout, hm)
                res = []
                times[case].append(timed(lambda res=res, c=c, k=k, v=v: res.append(c.insert(k, v))))
                counts[case].append(res[0])
            finally:
                if c is not caches[pol]:
                    c.close()
    b.results["insert"] = {
        f"{p} {s}": {"median_s": med(times[(p, s)]), "counts": [tuple(x) for x in counts[(p, s)]]}
        for p, s in cases
    }

    print(f"\n{SECTIONS[2]}\n")
    print(
        f"Median ms to insert {B} keys ({a.insert_reps} repetitions) into a cache of "
        f"{slots} slots. empty = cleared before each insert; full = every set full, keys "
        "not cached (steady state); tinylfu full, keys queried once = a fresh full cache "
        "of never-queried keys, the new keys queried once before the insert (so admitted). "
        "Counts: medians per batch. Reference: numpy fancy assignment of the same bytes "
        "into random rows.\n"
    )
    print(
        "| policy | cache | median ms | Mkeys/s | GB/s | inserted | evicted | rejected "
        "| vs numpy scatter |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    ref = med(times[cases[-1]])
    for case in cases:
        t = med(times[case])
        if counts[case]:
            ins, ev, rej = (int(med([x[i] for x in counts[case]])) for i in range(3))
        else:
            ins = ev = rej = "-"
        print(
            f"| {case[0]} | {case[1]} | {ms(t)} | {mk(B, t)} | {gbs(B * D * 4, t)} | {ins} | "
            f"{ev} | {rej} | {ratio(ref, t)} |"
        )


# ---------------------------------------------------------------- 5: processes


def _mp_worker(conn, wid, spec):
    try:
        a = spec["args"]
        caches = {
            p: SharedEmbeddingCache.open(spec["names"][p], a.cache_rows, a.dim, policy=p, ways=WAYS)
            for p in ("lru", "tinylfu")
        }
        rng = np.random.default_rng(a.seed + 100 + wid)
        B, D = a.batch, a.dim
        out = np.empty((B, D), np.float32)
        hm = np.empty(B, np.uint8)
        index, vectors, keys = spec["index"], spec["vectors"], spec["keys"]
        batches = {}
        for case, (_, hr) in spec["cases"].items():
            batches[case] = [
                keys[make_batch(rng, spec["resident"], spec["cold"], B, hr)[0]] for _ in range(4)
            ]

        def fn(case):
            kind = spec["cases"][case][0]
            if kind == "fused":
                return lambda k: _native.lookup(index, vectors, k, out, 0.0, num_threads=1)
            c = caches[kind]
            return lambda k: c.query(k, out, hm)

        fns = {case: fn(case) for case in spec["cases"]}
        for case in spec["cases"]:  # warm-up
            fns[case](batches[case][0])
        conn.send(("ready", wid))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            case, iters, t_start = msg
            f, bs = fns[case], batches[case]
            while time.perf_counter() < t_start:
                pass
            per = []
            c0 = time.process_time()
            t0 = time.perf_counter()
            for i in range(iters):
                ti = time.perf_counter()
                f(bs[i % len(bs)])
                per.append(time.perf_counter() - ti)
            t1 = time.perf_counter()
            conn.send((t0, t1, per, time.process_time() - c0))
        for c in caches.values():
            c.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def bench_processes(b: Bench):
    a = b.args
    B = a.batch
    cases = {
        "shm lru query, 100% hits": ("lru", 1.0),
        "shm lru query, 50% hits": ("lru", 0.5),
        "shm tinylfu query, 100% hits": ("tinylfu", 1.0),
        "fused table lookup (no cache)": ("fused", 1.0),
    }
    spec = {
        "args": a,
        "names": {"lru": f"{b.tag}-lru", "tinylfu": f"{b.tag}-tinylfu"},
        "index": b.table.index,
        "vectors": b.vectors,
        "keys": b.keys,
        "resident": b.resident,
        "cold": b.cold,
        "cases": cases,
    }
    ctx = multiprocessing.get_context("fork")  # workers share the table pages (copy-on-write)
    workers = []
    try:
        for wid in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_mp_worker, args=(child, wid, spec), daemon=True)
            p.start()
            child.close()
            workers.append((p, parent))
        for _, conn in workers:
            msg = conn.recv()
            if msg[0] != "ready":
                raise RuntimeError(f"worker failed:\n{msg[1]}")

        def run(case, n):
            t_start = time.perf_counter() + 0.02
            for _, conn in workers[:n]:
                conn.send((case, a.mp_iters, t_start))
            got = [conn.recv() for _, conn in workers[:n]]
            for g in got:
                if g[0] == "error":
                    raise RuntimeError(f"worker failed:\n{g[1]}")
            wall = max(g[1] for g in got) - min(g[0] for g in got)
            cpu = sum(g[3] for g in got)
            nkeys = n * a.mp_iters * B
            return {
                "kps": nkeys / wall,
                "lat": med([x for g in got for x in g[2]]),
                "cpu_share": cpu / (n * wall),
                "kpcpu": nkeys / cpu,
            }

        got = {(case, n): [] for case in cases for n in (1, 2)}
        for rep in range(a.mp_reps):  # every case in every repetition, against drift
            for case in cases:
                for n in (1, 2) if rep % 2 == 0 else (2, 1):
                    got[case, n].append(run(case, n))
        res = {
            case: {
                f"{k}_{n}": med([g[k] for g in got[case, n]])
                for k in ("kps", "lat", "cpu_share", "kpcpu")
                for n in (1, 2)
            }
            for case in cases
        }
    finally:
        for _, conn in workers:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p, _ in workers:
            p.join(10)
            if p.is_alive():
                p.terminate()
    b.results["processes"] = res

    print(f"\n{SECTIONS[4]}\n")
    print(
        f"Each worker process runs {a.mp_iters} back-to-back lookups of {B} keys (its own "
        f"batches); medians over {a.mp_reps} repetitions, 1 and 2 processes alternating. "
        "Aggregate = keys of all workers / wall time from the first start to the last end. "
        "CPU share = the workers' CPU time / (processes x wall time): below 1.00 other "
        "processes of the machine took the cores. Mkeys per CPU-s = keys / the workers' "
        "CPU time: the throughput a worker gets while it runs (memory contention shows "
        "here, scheduling does not).\n"
    )
    print(
        "| workload | 1 process Mkeys/s | 2 processes aggregate Mkeys/s | scaling "
        "| ms per lookup, 1 / 2 procs | CPU share, 1 / 2 procs "
        "| Mkeys per CPU-s, 1 / 2 procs |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case, r in res.items():
        print(
            f"| {case} | {r['kps_1'] / 1e6:.2f} | {r['kps_2'] / 1e6:.2f} | "
            f"{r['kps_2'] / r['kps_1']:.2f} | {ms(r['lat_1'])} / {ms(r['lat_2'])} | "
            f"{r['cpu_share_1']:.2f} / {r['cpu_share_2']:.2f} | "
            f"{r['kpcpu_1'] / 1e6:.2f} / {r['kpcpu_2'] / 1e6:.2f} |"
        )


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows (default 1M)")
    p.add_argument("--dim", type=int, default=128, help="float32 elements per row (default 128)")
    p.add_argument("--batch", type=int, default=65536, help="keys per lookup (default 65536)")
    p.add_argument(
        "--cache-rows",
        type=int,
        default=262_144,
        help="requested cache capacity in rows (default 262144 = 1/4 of the table)",
    )
    p.add_argument(
        "--fill",
        type=float,
        default=0.5,
        help="fraction of the cache slots filled with hot rows (default 0.5)",
    )
    p.add_argument(
        "--hit-rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[1.0, 0.9, 0.5, 0.1, 0.0],
        help="comma-separated (default 1,.9,.5,.1,0)",
    )
    p.add_argument("--reps", type=int, default=21, help="repetitions, part 1/4 (default 21)")
    p.add_argument("--e2e-reps", type=int, default=15, help="repetitions, part 2 (default 15)")
    p.add_argument("--insert-reps", type=int, default=15, help="repetitions, part 3 (default 15)")
    p.add_argument(
        "--mp-iters",
        type=int,
        default=20,
        help="lookups per worker per measurement, part 5 (default 20)",
    )
    p.add_argument("--mp-reps", type=int, default=11, help="repetitions, part 5 (default 11)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)

    machine = machine_info()
    print(
        f"machine: {machine['cpu_model']} (cache {machine['cpu_cache_size']}), "
        f"nproc={machine['nproc']}, {machine.get('mem_gib', '?')} GiB RAM, "
        f"load average {machine['loadavg']}, numpy {machine['numpy']}, "
        f"python {machine['python']}, {machine['platform']}"
    )
    print(
        f"table: {args.rows} rows x {args.dim} float32 "
        f"({args.rows * args.dim * 4 / 2**30:.2f} GiB), batch {args.batch} keys"
    )

    t_all = time.perf_counter()
    b = Bench(args)
    try:
        setup(b)
        bench_query(b)  # parts 1 and 4 (timed in one loop)
        bench_cached_table(b)  # leaves the lru cache with the resident rows, as before
        bench_insert(b)
        print_array(b)
        bench_processes(b)  # forks: after part 2 has joined its background thread
    finally:
        b.close()
    elapsed = time.perf_counter() - t_all
    load_after = machine_info()["loadavg"]
    print(f"\ntotal {elapsed:.0f} s; load average at the end {load_after}")

    if args.json:

        def keyed(d):
            return {str(k): v for k, v in d.items()}

        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine,
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                    "query": keyed(b.results["query"]),
                    "cached_table": keyed(b.results["cached_table"]),
                    "insert": b.results["insert"],
                    "processes": b.results["processes"],
                    "elapsed_s": elapsed,
                    "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
