#!/usr/bin/env python3
"""What a set's layout costs a served lookup: the shared cache's query of one request's
keys (64 samples x 26 keys, issue 25's workload) at ``cache_ways`` 4, 8 and 16, the same
capacity and rows, in alternating rounds.

Each key a query answers reads its set's header line (seqlock, robust mutex, valid
flags), the line(s) of its keys, the line(s) of its LRU ticks (written) and its row
(shm_cache.hpp, "REGION LAYOUT"). With 4 ways the 4 keys and 4 ticks share one line, so a
64-byte row costs 3 lines; with 8 ways it costs 4 and with 16 ways 6. Measured twice per
round: ``hot``, requests back to back (what stays in the CPU's caches does), and
``polluted``, 8 MB of other memory written before each request (as Triton's own work
between requests does when served). The hit-rate side of the choice is
``benchmarks/cache_sim.py --ways``.

    python benchmarks/bench_cache_ways.py [--capacity 1000000] [--dim 16] [--rounds 3]
        [--ways 4,8,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_info  # noqa: E402

from triton_rec.cache.shm_cache import SharedEmbeddingCache  # noqa: E402

KEYS_PER_REQUEST, REQUESTS, CALLS = 64 * 26, 16, 600


def query_us(cache, requests, junk, pollute: bool) -> float:
    """Median us of one request's query, cycling through ``requests``."""
    out = np.empty((KEYS_PER_REQUEST, cache.vec_size), np.float32)
    hit = np.empty(KEYS_PER_REQUEST, np.uint8)
    times = []
    for i in range(CALLS):
        if pollute:
            junk[::16] += 1.0  # one write per 64-byte line of 8 MB
        keys = requests[i % len(requests)]
        t0 = time.perf_counter_ns()
        hits = cache.query(keys, out, hit)
        times.append(time.perf_counter_ns() - t0)
        if hits != len(keys):
            raise RuntimeError(f"{hits} of {len(keys)} keys hit: the cache lost resident keys")
    return statistics.median(times) / 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--capacity", type=int, default=1_000_000, help="rows of each cache")
    ap.add_argument("--dim", type=int, default=16, help="float32 values per row")
    ap.add_argument("--ways", default="4,8,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ways = [int(w) for w in args.ways.split(",")]
    rng = np.random.default_rng(0)
    junk = np.ones(2_000_000, np.float32)
    caches = {}
    try:
        for w in ways:
            cache = SharedEmbeddingCache.open(
                f"bench-ways-{w}-{uuid.uuid4().hex[:8]}", args.capacity, args.dim, ways=w
            )
            keys = rng.integers(1, 2**62, args.capacity, dtype=np.int64)
            for a in range(0, len(keys), 65536):
                k = keys[a : a + 65536]
                cache.insert(k, rng.standard_normal((len(k), args.dim)).astype(np.float32))
            resident = cache.keys()  # what the sets kept (a full set evicts)
            requests = [rng.choice(resident, KEYS_PER_REQUEST) for _ in range(REQUESTS)]
            caches[w] = (cache, requests)
        rounds = {w: {"hot": [], "polluted": []} for w in ways}
        for r in range(args.rounds):
            for w in ways if r % 2 == 0 else ways[::-1]:
                cache, requests = caches[w]
                rounds[w]["hot"].append(query_us(cache, requests, junk, False))
                rounds[w]["polluted"].append(query_us(cache, requests, junk, True))
        report = {
            "machine": machine_info(),
            "command": "python benchmarks/bench_cache_ways.py " + " ".join(argv or sys.argv[1:]),
            "settings": vars(args),
            "query_us": {
                w: {k: round(statistics.median(v), 1) for k, v in r.items()}
                for w, r in rounds.items()
            },
        }
        for w in ways:
            q = report["query_us"][w]
            print(
                f"ways {w:2d}: query of {KEYS_PER_REQUEST} keys {q['hot']:6.1f} us hot, "
                f"{q['polluted']:6.1f} us polluted",
                flush=True,
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        for cache, _ in caches.values():
            cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
