#!/usr/bin/env python3
"""Table load times: node-local layout (triton_rec.storage.node_store) vs the per-instance way.

Writes a HugeCTR sparse table (--rows x --dim float32, default 8.2M x 128 = 4.2 GB of
vectors; keys are shuffled unique random int64) under --dir, then measures, in one run:

  convert      first ensure_layout(): read + hash + write keys/vectors, build + write
               the index, publish (GB/s = layout data bytes / s)
  rehash       the source is touched (new mtime, same content): ensure_layout() hashes
               it, finds the layout by content digest, converts nothing
  reference    a plain copy of emb_vector (copy_file_range) on the same disk: what
               writing that many bytes costs, for scale
  fast path    load_table() again, --reps times (the source is only stat'ed): median / max
  open         open_table(): map + header checks + index spot check
  prefault     EmbeddingTable.prefault() on the mapped layout (GB/s = layout bytes / s)
  old way      read_table() + EmbeddingTable(...) (maps the files, builds a private index,
               as every instance process does without the store), then its prefault()

Lookups of random keys (known and unknown) are checked equal between the two tables,
and the lookup speed of both is measured (65,536 random known keys, median of 15).
With --cold, the source files (before converting and before the old way) and the layout
(before open + prefault) are evicted from the page cache first (fsync +
posix_fadvise(DONTNEED) on those files only), so those steps read from disk.

Everything under --dir is deleted at the end unless --keep.

    python benchmarks/bench_table_load.py [--rows 8200000] [--dim 128] [--dir /tmp/...]
                                          [--cold] [--reps 20] [--keep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from triton_rec.config.ps_json import TableParams
from triton_rec.formats.hugectr_sparse import KEY_FILE, VECTOR_FILE
from triton_rec.formats.tables import read_table
from triton_rec.storage import node_store
from triton_rec.storage.table import EmbeddingTable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import evict_files, machine_info  # noqa: E402

CHUNK_ROWS_BYTES = 64 << 20


def write_source(path: str, rows: int, dim: int, seed: int) -> float:
    """A HugeCTR sparse directory of random data; returns seconds."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    os.makedirs(path, exist_ok=True)
    keys = np.unique(rng.integers(-(2**62), 2**62, size=rows + rows // 32 + 64, dtype=np.int64))
    keys = keys[:rows]
    if keys.shape[0] != rows:
        raise RuntimeError("could not draw enough unique keys")
    rng.shuffle(keys)
    keys.tofile(os.path.join(path, KEY_FILE))
    step = max(1, CHUNK_ROWS_BYTES // (4 * dim))
    with open(os.path.join(path, VECTOR_FILE), "wb") as f:
        for start in range(0, rows, step):
            n = min(step, rows - start)
            f.write(rng.random((n, dim), dtype=np.float32).data)
    return time.perf_counter() - t0


def fsync(*paths: str) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def copy_file(src: str, dst: str) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        left = os.fstat(fi.fileno()).st_size
        while left:
            left -= os.copy_file_range(fi.fileno(), fo.fileno(), left)


def pmd_mapped(path: str) -> int:
    """Bytes of this process's mappings of ``path`` mapped with 2 MiB pages (Linux smaps)."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    inside = line.rstrip("\n").endswith(path)
                elif inside and head == "FilePmdMapped:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


def fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2f} ms"


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all threads)."""
    t = os.times()
    return t.user + t.system


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=8_200_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dir", help="work directory (default: a new directory under /tmp)")
    ap.add_argument("--store", help="store directory (default: <dir>/store)")
    ap.add_argument("--cold", action="store_true", help="evict files from the page cache first")
    ap.add_argument("--reps", type=int, default=20, help="fast-path loads timed")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    work = args.dir or tempfile.mkdtemp(prefix="triton-rec-bench-", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    store = args.store or os.path.join(work, "store")
    src = os.path.join(work, "table0_sparse_0.model")
    info = machine_info(work)
    rows, dim = args.rows, args.dim
    res: dict = {"rows": rows, "dim": dim, "cold": args.cold, "machine": info}
    res["loadavg_start"] = os.getloadavg()[0]
    try:
        print(f"writing {rows} x {dim} float32 to {src} ...", file=sys.stderr, flush=True)
        res["write_source_s"] = write_source(src, rows, dim, args.seed)
        # Start every write-heavy step with no dirty pages of ours pending.
        src_files = (os.path.join(src, KEY_FILE), os.path.join(src, VECTOR_FILE))
        res["fsync_source_s"] = timed(lambda: fsync(*src_files))[1]
        src_bytes = 8 * rows + 4 * rows * dim
        res["source_bytes"] = src_bytes
        if args.cold:
            evict_files(*src_files)

        # 1. first conversion
        progress = node_store.ProgressLogger("convert", sys.stderr)
        c0 = cpu_seconds()
        conv, s = timed(lambda: node_store.ensure_layout(src, dim, store, progress))
        res["convert_cpu_s"] = cpu_seconds() - c0
        assert conv.action == "converted", conv
        res["convert_s"], res["layout_data_bytes"] = s, conv.data_bytes
        res["layout_path"] = conv.path
        res["fsync_layout_s"] = timed(lambda: fsync(conv.path))[1]

        # Reference: the same disk writing a plain copy of emb_vector (kernel copy, no
        # hashing, no index), timed up to the last byte handed to the page cache, like
        # the conversion (no fsync in either).
        if args.cold:
            evict_files(os.path.join(src, VECTOR_FILE))
        ref = os.path.join(store, "reference-copy")
        c0 = cpu_seconds()
        _, s = timed(lambda: copy_file(os.path.join(src, VECTOR_FILE), ref))
        res["reference_copy_s"], res["reference_copy_cpu_s"] = s, cpu_seconds() - c0
        res["fsync_reference_s"] = timed(lambda: fsync(ref))[1]
        os.unlink(ref)

        # 2. fast path: load_table again (source only stat'ed)
        tp = TableParams("t", src, dim, 1, 0.0)
        times = []
        for _ in range(args.reps):
            t, s = timed(lambda: node_store.load_table(tp, store))
            times.append(s)
            del t
        res["fast_path_median_s"], res["fast_path_max_s"] = statistics.median(times), max(times)

        # 3. open + prefault
        if args.cold:
            evict_files(conv.path)
        mapped, s = timed(lambda: node_store.open_table(conv.path, "t"))
        res["open_s"] = s
        touched, s = timed(mapped.prefault)
        res["prefault_s"], res["prefault_bytes"] = s, touched
        res["layout_pmd_mapped_bytes"] = pmd_mapped(conv.path)

        # 4. the per-instance way: map the source, build a private index
        if args.cold:
            evict_files(*src_files)

        def old_way():
            keys, vectors = read_table(src, dim)
            return EmbeddingTable("t", keys, vectors, 0.0, src)

        private, s = timed(old_way)
        res["old_way_s"], res["private_index_bytes"] = s, private.index.nbytes
        _, s = timed(private.prefault)
        res["old_way_prefault_s"] = s
        res["source_pmd_mapped_bytes"] = pmd_mapped(os.path.join(src, VECTOR_FILE))

        rng = np.random.default_rng(1)
        q = np.concatenate([rng.choice(private.keys, 100_000), rng.integers(0, 2**40, 1000)])
        a, ma = mapped.lookup(q)
        b, mb = private.lookup(q)
        assert ma == mb and np.array_equal(a, b), "lookups differ"
        # Serving speed over each (both prefaulted): the layout must not be slower.
        batch = rng.choice(private.keys, 1 << 16)
        out = np.empty((batch.size, dim), np.float32)
        for name, table in (("layout", mapped), ("old_way", private)):
            runs = []
            for _ in range(15):
                t0 = time.perf_counter()
                table.lookup(batch, out)
                runs.append(time.perf_counter() - t0)
            res[f"lookup_{name}_keys_per_s"] = batch.size / statistics.median(runs)
        del private, mapped, a, b

        # 5. touched source, same content: found by digest, nothing converted
        kst = os.stat(os.path.join(src, KEY_FILE))
        os.utime(os.path.join(src, KEY_FILE), ns=(kst.st_atime_ns, kst.st_mtime_ns + 10**9))
        if args.cold:
            evict_files(*src_files)
        c0 = cpu_seconds()
        re, s = timed(lambda: node_store.ensure_layout(src, dim, store))
        res["rehash_cpu_s"] = cpu_seconds() - c0
        assert re.action == "aliased" and re.path == conv.path, re
        res["rehash_s"] = s
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if args.store:
                shutil.rmtree(args.store, ignore_errors=True)

    res["loadavg_end"] = os.getloadavg()[0]
    gb = 1e9
    lay = res["layout_data_bytes"]
    vec_gb = 4 * rows * dim / gb
    conv_sync = res["convert_s"] + res["fsync_layout_s"]
    ref_sync = res["reference_copy_s"] + res["fsync_reference_s"]
    lines = [
        f"Table: {rows:,} rows x {dim} float32 = {src_bytes / gb:.2f} GB source; layout "
        f"{lay / gb:.2f} GB (keys + vectors + index of {res['private_index_bytes'] / 1e6:.0f} MB)"
        + ("; page cache evicted before each step (cold)" if args.cold else "; warm page cache"),
        "",
        "| step | time | throughput | CPU (user + sys) |",
        "|---|---:|---:|---:|",
        f"| first conversion (read + hash + write + index) | {fmt_s(res['convert_s'])} | "
        f"{lay / gb / res['convert_s']:.2f} GB/s | {res['convert_cpu_s']:.1f} s |",
        f"| ... then `fsync` of the layout (not done by default) | "
        f"+{fmt_s(res['fsync_layout_s'])} | "
        f"{lay / gb / conv_sync:.2f} GB/s overall | |",
        f"| reference: plain copy of `emb_vector` (`copy_file_range`) | "
        f"{fmt_s(res['reference_copy_s'])} | {vec_gb / res['reference_copy_s']:.2f} GB/s | "
        f"{res['reference_copy_cpu_s']:.1f} s |",
        f"| ... then `fsync` of the copy | +{fmt_s(res['fsync_reference_s'])} | "
        f"{vec_gb / ref_sync:.2f} GB/s overall | |",
        f"| second `load_table` (fast path), median of {args.reps} | "
        f"{fmt_s(res['fast_path_median_s'])} | max {fmt_s(res['fast_path_max_s'])} | |",
        f"| `open_table` (map + checks) | {fmt_s(res['open_s'])} | | |",
        f"| `prefault()` of the layout | {fmt_s(res['prefault_s'])} | "
        f"{res['prefault_bytes'] / gb / res['prefault_s']:.2f} GB/s | |",
        f"| old way: `read_table` + `build_index` (per instance) | {fmt_s(res['old_way_s'])} | "
        f"{rows / res['old_way_s'] / 1e6:.1f} M keys/s | |",
        f"| old way, then `prefault()` (source files + private index) | "
        f"{fmt_s(res['old_way_prefault_s'])} | | |",
        f"| lookups of 65,536 random keys, layout / old way (median of 15) | | "
        f"{res['lookup_layout_keys_per_s'] / 1e6:.1f} / "
        f"{res['lookup_old_way_keys_per_s'] / 1e6:.1f} M keys/s | |",
        f"| touched source, same content: found by digest | {fmt_s(res['rehash_s'])} | "
        f"{src_bytes / gb / res['rehash_s']:.2f} GB/s | {res['rehash_cpu_s']:.1f} s |",
        "",
        f"Machine: {info['cpu_model']}, {info['nproc']} CPUs, {info['ram_gb']} GB RAM, "
        f"{info['disk_free_gb']} GB free on {info['filesystem']} ({work}), Linux "
        f"{info['kernel']}, Python {info['python']}, numpy {info['numpy']}; 1-min load "
        f"average {res['loadavg_start']:.1f} at start, {res['loadavg_end']:.1f} at end. "
        f"Writing the source took {res['write_source_s']:.1f} s "
        f"(+{res['fsync_source_s']:.1f} s fsync). Mapped with 2 MiB pages after prefault: "
        f"layout {res['layout_pmd_mapped_bytes'] / gb:.2f} GB, source `emb_vector` "
        f"{res['source_pmd_mapped_bytes'] / gb:.2f} GB.",
    ]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
