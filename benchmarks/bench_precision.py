#!/usr/bin/env python3
"""Embedding precision (issue 15): memory and lookup speed of fp32 / fp16 / int8 tables,
side by side in one run.

Three sections, every figure also as a ratio to fp32 measured in the same run:

1. **Memory per row** at each ``--dims``: bytes per row of the node store layout file
   (keys + encoded rows + hash index, written by ``ensure_layout`` from one fp32 HugeCTR
   sparse directory of ``--mem-rows`` rows) and of the shared CPU cache segment
   (``ShmCacheView.required_bytes``: tags, set headers and encoded rows, 8 ways), with
   the row payload alone beside them.
2. **PSS of 4 instances** at the largest dim: 4 processes each map the same store layout
   (every page touched) and attach the same shared cache (filled by the first); the sum
   of their PSS over the layout file and over the cache segment, read from
   ``/proc/<pid>/smaps``: what the node pays for the table once, however many instances.
3. **Fused lookup** at each ``--dims``: one table of ``--table-mb`` MB in fp32 (larger
   than the CPU caches), converted into a node store layout in each precision and
   mapped as an instance maps it (every page resident); every round draws ``--batch`` keys
   uniformly from the table and runs ``_native.lookup`` (probe + gather + decode into
   float32, one thread) for each precision on the same keys (each layout has its own
   hash index, so none finds the batch's index slots warm), starting
   with a different precision each round. Medians over ``--rounds`` of ns per key; the
   speed-ups are medians of the per-round ratios. Beside it, the raw gather
   ceiling of each precision: ``np.take`` of the encoded rows with precomputed row ids
   (no probe, no decode, no float32 output; on a second batch of keys, so no row is warm
   from the lookups): the most that fewer bytes can buy.

    .venv/bin/python benchmarks/bench_precision.py [--dims 16,64,128] [--table-mb 2048]
        [--batch 4096] [--rounds 300] [--json out.json] [--png out.png]
    .venv/bin/python benchmarks/bench_precision.py --quick     # tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_info  # noqa: E402

from triton_rec import _native  # noqa: E402
from triton_rec.precision import PRECISIONS, RowCodec  # noqa: E402

SECTIONS = ("## Memory per row", "## PSS of 4 instances", "## Fused lookup")
CACHE_WAYS, CACHE_SETS = 8, 1 << 14
INSTANCES = 4
SHM = "/dev/shm"


def unique_random_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    info = np.iinfo(np.int64)
    while True:  # practically one draw (collision odds ~ n^2 / 2^65)
        keys = rng.integers(info.min, info.max, size=n, dtype=np.int64, endpoint=True)
        if len(np.unique(keys)) == n:
            return keys


def random_vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    out = np.empty((n, dim), np.float32)
    step = max(1, (1 << 24) // dim)
    for s in range(0, n, step):  # in chunks: no float64 copy of the whole table
        out[s : s + step] = rng.standard_normal((min(step, n - s), dim), dtype=np.float32)
    return out


def _table_params(source: str, dim: int, precision: str) -> types.SimpleNamespace:
    """What ``load_table`` reads of a ps.json table (``TableParams``)."""
    return types.SimpleNamespace(
        name="t0", sparse_file=source, vec_size=dim, precision=precision, default_value=0.0
    )


# ----------------------------------------------------------------------------- memory


def memory_per_row(dims, rows: int, store: str, rng) -> list:
    from triton_rec.formats.tables import write_table
    from triton_rec.storage.node_store import ensure_layout

    out = []
    for dim in dims:
        source = os.path.join(store, f"src_{dim}")
        write_table(source, unique_random_keys(rng, rows), random_vectors(rng, rows, dim))
        for p in PRECISIONS:
            codec = RowCodec(p, dim)
            res = ensure_layout(source, dim, store, precision=p)
            cache = _native.ShmCacheView.required_bytes(
                CACHE_SETS, CACHE_WAYS, dim, "lru", codec.code
            )
            out.append(
                {
                    "dim": dim,
                    "precision": p,
                    "payload": codec.row_bytes,
                    "store": os.path.getsize(res.path) / rows,
                    "cache": cache / (CACHE_SETS * CACHE_WAYS),
                    "layout": res.path,
                    "source": source,
                }
            )
    return out


WORKER = """
import os, sys, types
import numpy as np
from triton_rec.cache.shm_cache import SharedEmbeddingCache
from triton_rec.storage.node_store import load_table
source, dim, precision, name, capacity, fill = sys.argv[1:7]
t = types.SimpleNamespace(name="t0", sparse_file=source, vec_size=int(dim),
                          precision=precision, default_value=0.0)
table = load_table(t, os.environ["TRITON_REC_STORE"], prefault=True)
cache = SharedEmbeddingCache.open(name, int(capacity), int(dim), precision=precision,
                                  directory=os.environ["BENCH_SHM_DIR"])
n = min(cache.capacity, table.num_rows)
if fill == "1":
    for s in range(0, n, 65536):
        e = min(n, s + 65536)
        cache.insert(np.ascontiguousarray(table.keys[s:e]), np.asarray(table.vectors[s:e]))
out = np.empty((n, int(dim)), np.float32)
hit = np.empty(n, np.bool_)
cache.query(np.ascontiguousarray(table.keys[:n]), out, hit)  # touch every page
print(table.layout_path, cache.path, flush=True)
sys.stdin.readline()
cache.close()
"""


def pss_of_instances(entries: list, dim: int, store: str, shm_dir: str) -> list:
    """Sum of PSS over the layout file and the cache segment of INSTANCES processes."""
    from triton_rec.util.procfs import pss_by_mapping

    env = dict(os.environ, TRITON_REC_STORE=store, BENCH_SHM_DIR=shm_dir)
    out = []
    for e in [e for e in entries if e["dim"] == dim]:
        p = e["precision"]
        name = f"bench-precision-{os.getpid()}-{p}-{dim}"
        capacity = CACHE_SETS * CACHE_WAYS
        procs = []
        try:
            for i in range(INSTANCES):  # one after the other: the first creates and fills
                proc = subprocess.Popen(
                    [sys.executable, "-c", WORKER, e["source"], str(dim), p, name,
                     str(capacity), "1" if i == 0 else "0"],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                procs.append(proc)
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"worker {i} ({p}) failed")
            layout = os.path.realpath(e["layout"])
            store_pss = cache_pss = 0
            for proc in procs:
                for path, pss in pss_by_mapping(proc.pid).items():
                    if path and os.path.realpath(path) == layout:
                        store_pss += pss
                    elif path.startswith(shm_dir) and f"trec_{name}" in path:
                        cache_pss += pss
            out.append(
                {
                    "dim": dim,
                    "precision": p,
                    "store_pss": store_pss,
                    "cache_pss": cache_pss,
                    "file": os.path.getsize(e["layout"]),
                }
            )
        finally:
            for proc in procs:
                proc.stdin.close()
                proc.wait(timeout=60)
    return out


# ----------------------------------------------------------------------------- speed


def lookup_speed(dims, table_mb: float, batch: int, rounds: int, store: str, rng) -> list:
    from triton_rec.formats.tables import write_table
    from triton_rec.storage.node_store import load_table

    out = []
    for dim in dims:
        rows = max(batch, int(table_mb * 1e6 / (4 * dim)))
        keys = unique_random_keys(rng, rows)
        source = os.path.join(store, f"lookup_{dim}")
        write_table(source, keys, random_vectors(rng, rows, dim))
        # what the server maps: one node store layout per precision (its own hash index,
        # so no precision finds the batch's index slots warm from another one's lookup),
        # every page resident, as an instance loads it (prefault)
        loaded = {
            p: load_table(_table_params(source, dim, p), store, prefault=True) for p in PRECISIONS
        }
        tables = {p: np.asarray(t.vectors) for p, t in loaded.items()}
        indexes = {p: t.index for p, t in loaded.items()}
        index = indexes["fp32"]
        outs = {p: np.empty((batch, dim), np.float32) for p in PRECISIONS}
        raw = {p: np.empty((batch, tables[p].shape[1]), tables[p].dtype) for p in PRECISIONS}
        ids = np.empty(batch, np.int64)
        fused = {p: [] for p in PRECISIONS}
        gather = {p: [] for p in PRECISIONS}
        for r in range(rounds):
            sample = keys[rng.integers(0, rows, size=batch)]
            order = PRECISIONS[r % 3 :] + PRECISIONS[: r % 3]
            for p in order:
                code = RowCodec(p, dim).code
                t0 = time.perf_counter_ns()
                _native.lookup(indexes[p], tables[p], sample, outs[p], 0.0, precision=code)
                fused[p].append(time.perf_counter_ns() - t0)
            # the gather ceiling on other keys: rows the lookups above left in the CPU
            # caches would flatter it
            _native.probe(index, keys[rng.integers(0, rows, size=batch)], ids)
            for p in order:
                t0 = time.perf_counter_ns()
                np.take(tables[p], ids, axis=0, out=raw[p], mode="clip")
                gather[p].append(time.perf_counter_ns() - t0)
        # the decoded answers agree with the reference decoding (the benchmark measures
        # what is served, not a shortcut)
        _native.probe(index, sample, ids)
        for p in PRECISIONS:
            codec = RowCodec(p, dim)
            want = codec.decode(tables[p][ids])
            if not np.array_equal(outs[p], want):
                raise AssertionError(f"dim {dim} {p}: fused lookup != reference decode")
        table_bytes = {p: tables[p].nbytes for p in PRECISIONS}
        for p in PRECISIONS:
            # speed-ups as the median of the per-round ratios (paired: same round, same
            # keys), which drift in the machine's speed between rounds does not move
            out.append(
                {
                    "dim": dim,
                    "precision": p,
                    "rows": rows,
                    "table_mb": table_bytes[p] / 1e6,
                    "fused_ns_per_key": statistics.median(fused[p]) / batch,
                    "gather_ns_per_key": statistics.median(gather[p]) / batch,
                    "fused_x_fp32": statistics.median(
                        a / b for a, b in zip(fused["fp32"], fused[p])
                    ),
                    "gather_x_fp32": statistics.median(
                        a / b for a, b in zip(gather["fp32"], gather[p])
                    ),
                }
            )
        del tables, index, indexes, keys, loaded
        for name in os.listdir(os.path.join(store, "layouts")):  # keep the disk use bounded
            os.unlink(os.path.join(store, "layouts", name))
    return out


# ----------------------------------------------------------------------------- report


def _ratio(rows: list, field: str, key, p: str) -> float:
    base = next(r for r in rows if key(r) and r["precision"] == "fp32")[field]
    mine = next(r for r in rows if key(r) and r["precision"] == p)[field]
    return mine / base


def tables_md(mem: list, pss: list, speed: list, batch: int) -> str:
    lines = [
        SECTIONS[0],
        "",
        "| dim | precision | payload B | store B/row | x fp32 | cache B/row | x fp32 | "
        "payload x fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in mem:
        k = lambda x, d=r["dim"]: x["dim"] == d  # noqa: E731
        lines.append(
            f"| {r['dim']} | {r['precision']} | {r['payload']} | {r['store']:.1f} | "
            f"{_ratio(mem, 'store', k, r['precision']):.3f} | {r['cache']:.1f} | "
            f"{_ratio(mem, 'cache', k, r['precision']):.3f} | "
            f"{_ratio(mem, 'payload', k, r['precision']):.3f} |"
        )
    lines += ["", SECTIONS[1], ""]
    if pss:
        lines += [
            f"| dim | precision | layout file MB | store PSS MB ({INSTANCES} proc) | "
            f"cache PSS MB | total MB | x fp32 |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in pss:
            tot = (r["store_pss"] + r["cache_pss"]) / 1e6
            base = next(x for x in pss if x["precision"] == "fp32")
            btot = (base["store_pss"] + base["cache_pss"]) / 1e6
            lines.append(
                f"| {r['dim']} | {r['precision']} | {r['file'] / 1e6:.1f} | "
                f"{r['store_pss'] / 1e6:.1f} | {r['cache_pss'] / 1e6:.1f} | {tot:.1f} | "
                f"{tot / btot:.3f} |"
            )
    else:
        lines.append("(skipped)")
    lines += [
        "",
        SECTIONS[2],
        "",
        f"| dim | precision | rows | table MB | fused ns/key | Mkeys/s | x fp32 | "
        f"gather ns/key | gather x fp32 |  (batch {batch}, 1 thread)",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in speed:
        p = r["precision"]
        lines.append(
            f"| {r['dim']} | {p} | {r['rows']:,} | {r['table_mb']:.0f} | "
            f"{r['fused_ns_per_key']:.1f} | {1e3 / r['fused_ns_per_key']:.2f} | "
            f"{r['fused_x_fp32']:.2f} | {r['gather_ns_per_key']:.1f} | "
            f"{r['gather_x_fp32']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(mem: list, speed: list, path: str) -> bool:
    """The store-memory and lookup-speed ratios as bars; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the 'bench' extra): no plot", flush=True)
        return False

    dims = sorted({r["dim"] for r in speed} | {r["dim"] for r in mem})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.25
    for i, p in enumerate(PRECISIONS):
        xs = np.arange(len(dims)) + (i - 1) * w
        st = [_ratio(mem, "store", lambda x, d=d: x["dim"] == d, p) if mem else 0 for d in dims]
        sp = [next(r["fused_x_fp32"] for r in speed if r["dim"] == d and r["precision"] == p)
              for d in dims]  # fmt: skip
        axes[0].bar(xs, st, w, label=p)
        axes[1].bar(xs, sp, w, label=p)
    axes[0].axhline(0.5, color="grey", ls=":", lw=1)
    axes[0].axhline(0.3, color="grey", ls="--", lw=1)
    axes[0].set_title("node store bytes per row, x fp32 (lines: 0.5 / 0.3 targets)")
    axes[1].axhline(1.6, color="grey", ls=":", lw=1)
    axes[1].axhline(2.0, color="grey", ls="--", lw=1)
    axes[1].set_title("fused lookup keys/s, x fp32 (lines: 1.6 / 2.0 targets)")
    for ax in axes:
        ax.set_xticks(range(len(dims)), [f"dim {d}" for d in dims])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    p.add_argument("--dims", default="16,64,128")
    p.add_argument("--table-mb", type=float, default=2048, help="fp32 table size per dim")
    p.add_argument("--mem-rows", type=int, default=262144, help="rows of the memory tables")
    p.add_argument("--batch", type=int, default=4096, help="keys per lookup")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--no-pss", action="store_true", help="skip the 4-process PSS section")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.table_mb, args.mem_rows, args.batch, args.rounds = 4, 4096, 256, 6
    dims = [int(d) for d in args.dims.split(",")]
    rng = np.random.default_rng(args.seed)
    print(f"machine: {json.dumps(machine_info())}", flush=True)
    tmp = tempfile.TemporaryDirectory
    with tmp(prefix="bench-precision-") as store, tmp(prefix="bench-precision-", dir=SHM) as shm:
        t0 = time.monotonic()
        mem = memory_per_row(dims, args.mem_rows, store, rng)
        pss = [] if args.no_pss else pss_of_instances(mem, max(dims), store, shm)
        print(f"memory measured in {time.monotonic() - t0:.1f} s", flush=True)
        t0 = time.monotonic()
        speed = lookup_speed(dims, args.table_mb, args.batch, args.rounds, store, rng)
        print(f"lookups measured in {time.monotonic() - t0:.1f} s", flush=True)
    text = tables_md(mem, pss, speed, args.batch)
    print(text)
    if args.json:
        for r in mem:
            r.pop("layout"), r.pop("source")
        data = {"machine": machine_info(), "args": vars(args), "memory": mem, "pss": pss}
        data["lookup"] = speed
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    if args.png:
        plot(mem, speed, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
