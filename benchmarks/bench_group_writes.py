#!/usr/bin/env python3
"""What the host does before a device cache's write: ``group_writes``
(src/native/array_cache_twin.hpp) turns a batch of inserted keys into what the write
kernel takes (each distinct key once, at its last occurrence, grouped by set, batch order
within a set). A GPU instance's misses wait for it on every insert (LocalMisses, through
the cache's InsertBatcher, which also merges the inserts of several instances).

Timed against a naive baseline of the same contract in numpy (``np.unique`` for the last
occurrences, a stable argsort by set), on batches of issue 25's sizes: one request's
misses (300), one batch-64 request (1,664), a batch-1024 request (26,624) and merged
inserts (212,992), keys from a Zipf-like stream with repeats; medians of alternating
rounds. No GPU needed: the GPU path runs this same C++.

    python benchmarks/bench_group_writes.py [--sizes 300,1664,26624,212992] [--rounds 5]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_info  # noqa: E402

from triton_rec import _native  # noqa: E402
from triton_rec.cache.array_cache import ArrayEmbeddingCache  # noqa: E402

SIZES = [300, 1664, 26624, 212992]


def numpy_group_writes(cache: ArrayEmbeddingCache, keys: np.ndarray):
    """The naive baseline: the same contract with numpy's sorts."""
    _, first_of_reversed = np.unique(keys[::-1], return_index=True)
    src = np.sort(keys.size - 1 - first_of_reversed)  # last occurrences, batch order
    sets = cache.set_of(keys[src])
    order = np.argsort(sets, kind="stable")
    src, sets = src[order], sets[order]
    starts = np.flatnonzero(np.r_[True, sets[1:] != sets[:-1]])
    return keys[src], src, sets[starts], np.r_[starts, src.size]


def time_call(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--capacity", type=int, default=1_000_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cache = ArrayEmbeddingCache(args.capacity, 16, ways=8)
    view = cache.native_view()
    rng = np.random.default_rng(7)
    results = []
    for n in args.sizes:
        keys = (rng.zipf(1.05, n) % (4 * args.capacity)).astype(np.int64)
        got, want = _native.group_writes(view, keys), numpy_group_writes(cache, keys)
        # the same keys and sources, set by set (the C++ orders sets as they first appear)
        assert sorted(got[1].tolist()) == sorted(want[1].tolist())
        reps = max(1, 200_000 // n)
        ours, naive = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()  # repeated in C++: the result's arrays made once
            _native.group_writes(view, keys, repeat=reps)
            ours.append((time.perf_counter() - t0) / reps * 1e6)
            naive.append(time_call(lambda k=keys: numpy_group_writes(cache, k), reps))
        row = {
            "keys": n,
            "distinct": int(got[1].size),
            "sets": int(got[2].size),
            "ours_us": statistics.median(ours),
            "numpy_us": statistics.median(naive),
        }
        row["speedup"] = row["numpy_us"] / row["ours_us"]
        results.append(row)
        print(
            f"{n:>8} keys ({row['distinct']} distinct, {row['sets']} sets): "
            f"group_writes {row['ours_us']:9.1f} us | numpy baseline {row['numpy_us']:9.1f} us "
            f"| {row['speedup']:5.1f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine_info(),
                    "command": "python benchmarks/bench_group_writes.py "
                    + " ".join(argv if argv is not None else sys.argv[1:]),
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
