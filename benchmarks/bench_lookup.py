#!/usr/bin/env python3
"""Fused native lookup vs the raw gather limit vs a Python dict, measured side by side.

Table: --rows random unique int64 keys (not 0..N-1) x --dim float32. Each repetition
draws a fresh batch of --batch keys uniformly from the table keys and times, on that
same batch, one after the other:

  (a) fused     _native.lookup(..., num_threads=1)   probe + gather
  (b) fused x2  _native.lookup(..., num_threads=2)
  (c) take      np.take(vectors, rows, axis=0, out=out) with the row ids precomputed
                (the raw gather limit: no hashing at all)
  (c') take     the same with mode="clip": numpy buffers `out` when mode="raise" (the
                default), so this unbuffered variant is the stricter gather limit
  (d) dict      rows = [d[k] for k in keys.tolist()]; np.take(...)

Medians over --reps repetitions are reported as keys/s and GB/s (bytes of output
vectors written per second), plus the ratios (a) / (c) and (a) / (c').

    python benchmarks/bench_lookup.py [--rows 2000000] [--dim 128] [--batch 65536]
                                      [--reps 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from triton_rec import _native

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import machine_info  # noqa: E402


def unique_random_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    info = np.iinfo(np.int64)
    keys = rng.integers(info.min, info.max, size=n, dtype=np.int64, endpoint=True)
    while len(np.unique(keys)) != n:  # practically never (collision odds ~ n^2 / 2^65)
        keys = rng.integers(info.min, info.max, size=n, dtype=np.int64, endpoint=True)
    return keys


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="table rows (default 2M)")
    p.add_argument("--dim", type=int, default=128, help="float32 elements per row (default 128)")
    p.add_argument("--batch", type=int, default=65536, help="keys per lookup (default 65536)")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions (default 15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-dict", action="store_true", help="skip the (slow) Python dict baseline")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)

    machine = machine_info()
    print(
        f"machine: {machine['cpu_model']} (cache {machine['cpu_cache_size']}), "
        f"nproc={machine['nproc']}, numpy {machine['numpy']}, python {machine['python']}"
    )
    print(
        f"table: {args.rows} rows x {args.dim} float32 "
        f"({args.rows * args.dim * 4 / 2**30:.2f} GiB), batch {args.batch} keys, "
        f"{args.reps} reps (median)"
    )

    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    keys = unique_random_keys(rng, args.rows)
    vectors = rng.random((args.rows, args.dim), dtype=np.float32)
    print(f"generated table in {time.perf_counter() - t0:.1f} s")

    t0 = time.perf_counter()
    index = _native.build_index(keys)
    t_build = time.perf_counter() - t0
    print(
        f"build_index: {t_build * 1e3:.0f} ms, index {index.shape} ({index.nbytes / 2**20:.0f} MiB)"
    )

    d = None
    if not args.no_dict:
        t0 = time.perf_counter()
        d = dict(zip(keys.tolist(), range(args.rows)))
        print(f"dict built in {time.perf_counter() - t0:.1f} s")

    out = np.empty((args.batch, args.dim), dtype=np.float32)
    out_ref = np.empty_like(out)

    def fused(batch_keys, _rows, threads):
        missing = _native.lookup(index, vectors, batch_keys, out, 0.0, num_threads=threads)
        assert missing == 0

    def take(_keys, rows):
        np.take(vectors, rows, axis=0, out=out)

    def take_clip(_keys, rows):
        np.take(vectors, rows, axis=0, out=out, mode="clip")

    def dict_take(batch_keys, _rows):
        rows = np.fromiter(
            (d[k] for k in batch_keys.tolist()), dtype=np.int64, count=len(batch_keys)
        )
        np.take(vectors, rows, axis=0, out=out)

    methods = [
        ("(a) fused lookup, 1 thread", lambda k, r: fused(k, r, 1)),
        ("(b) fused lookup, 2 threads", lambda k, r: fused(k, r, 2)),
        ("(c) np.take, precomputed rows (gather limit)", take),
        ("(c') np.take mode='clip', precomputed rows (unbuffered)", take_clip),
    ]
    if d is not None:
        methods.append(("(d) Python dict + np.take", dict_take))

    # Correctness check + warm-up (touches out, faults in code paths).
    pos = rng.integers(0, args.rows, size=args.batch)
    bk = keys[pos]
    np.take(vectors, pos, axis=0, out=out_ref)
    for name, fn in methods:
        out.fill(-1.0)
        fn(bk, pos)
        if not np.array_equal(out, out_ref):
            print(f"ERROR: {name} produced a wrong result", file=sys.stderr)
            return 1

    times = {name: [] for name, _ in methods}
    for rep in range(args.reps):
        pos = rng.integers(0, args.rows, size=args.batch)  # uniform over the table keys
        bk = keys[pos]
        order = methods if rep % 2 == 0 else methods[::-1]  # alternate order against drift
        for name, fn in order:
            times[name].append(timed(lambda fn=fn, bk=bk, pos=pos: fn(bk, pos)))

    out_bytes = args.batch * args.dim * 4
    results = []
    for name, _ in methods:
        med = statistics.median(times[name])
        results.append(
            {
                "method": name,
                "median_s": med,
                "min_s": min(times[name]),
                "keys_per_s": args.batch / med,
                "gb_per_s": out_bytes / med / 1e9,
            }
        )
    limit = next(r for r in results if r["method"].startswith("(c)"))
    for r in results:
        r["vs_gather_limit"] = limit["median_s"] / r["median_s"]

    print()
    print("| method | median ms | min ms | Mkeys/s | GB/s | vs (c) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['method']} | {r['median_s'] * 1e3:.2f} | {r['min_s'] * 1e3:.2f} | "
            f"{r['keys_per_s'] / 1e6:.2f} | {r['gb_per_s']:.2f} | {r['vs_gather_limit']:.2f} |"
        )
    ratio = results[0]["vs_gather_limit"]
    clip = next(r for r in results if r["method"].startswith("(c')"))
    ratio_clip = clip["median_s"] / results[0]["median_s"]
    print(
        f"\nratio (a)/(c) = {ratio:.2f}  "
        f"(fused 1-thread throughput as a fraction of the raw gather limit; target >= 0.60)"
    )
    print(f"ratio (a)/(c') = {ratio_clip:.2f}  (against the unbuffered np.take)")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": machine,
                    "config": {
                        "rows": args.rows,
                        "dim": args.dim,
                        "batch": args.batch,
                        "reps": args.reps,
                        "seed": args.seed,
                        "build_index_s": t_build,
                    },
                    "results": results,
                    "ratio_a_over_c": ratio,
                    "ratio_a_over_c_clip": ratio_clip,
                    "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
