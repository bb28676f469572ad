#!/usr/bin/env python3
"""The GPU path against floors measured in the same run (issue 23). Needs a CUDA device,
CuPy and NVRTC (``make gpu-check`` runs it after the GPU tests).

1. **Lookup, host keys in, host answer out**, at ``--sizes`` keys (Zipf over a table of
   ``--rows`` x ``--dim`` fp32 rows, every row cached): the device cache
   (``ArrayEmbeddingCache.query_host``: one kernel, pinned staging) and the static device
   table (``_native.DeviceTable``), against the **floor**: a plain lookup kernel written
   for this benchmark (open addressing, linear probing, a warp per key: lane 0 probes,
   the warp copies the row), its keys copied in and answers copied out through pinned
   buffers on one stream, the three steps captured as one CUDA graph and launched once per
   call. Keys and answers live in pinned memory on every side. Rounds alternate the
   implementations; figures are medians; the ratio is floor time / our time (keys/s
   ratio). Beside them, the CPU path on the same node (``_native.lookup`` of the mapped
   table, one thread).
2. **Dense network** (the demo DLRM, ``model_repository/dlrm``) at batch 1 / 64 / 1024:
   the CUDA graphs (:class:`triton_rec.dense.graphs.DenseGraphs`, inputs in, prediction
   out), the same network op by op with CuPy (no graph), the native CPU executor, and the
   floor: the same input and output copies with no network.
3. **Served** (``--served``, needs the Triton server wheel): ``benchmarks/bench_gpu_served.py``.

    python benchmarks/bench_gpu.py [--rows 1000000] [--dim 64] [--rounds 30] [--json F]
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

SIZES = (1664, 26624, 212992)

FLOOR_KERNEL = r"""
__device__ unsigned long long mix(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
extern "C" __global__ void floor_lookup(const long long* slots, unsigned long long cap,
                                        const float* rows, long long dim,
                                        const long long* keys, long long n, float* out) {
  const int lane = threadIdx.x & 31;
  const long long per_block = blockDim.x / 32;
  const long long stride = (long long)gridDim.x * per_block;
  for (long long i = blockIdx.x * per_block + threadIdx.x / 32; i < n; i += stride) {
    long long row = -1;
    if (lane == 0) {
      const long long k = keys[i];
      unsigned long long h = mix((unsigned long long)k) & (cap - 1);
      for (;;) {
        const long long r = slots[2 * h + 1];
        if (r == -1) break;
        if (slots[2 * h] == k) { row = r; break; }
        h = (h + 1) & (cap - 1);
      }
    }
    row = __shfl_sync(0xffffffffu, row, 0);
    float* dst = out + i * dim;
    if (row >= 0) { for (long long j = lane; j < dim; j += 32) dst[j] = rows[row * dim + j]; }
    else { for (long long j = lane; j < dim; j += 32) dst[j] = 0.0f; }
  }
}
"""


def pinned(cupy, shape, dtype):
    """A numpy array in pinned memory of ours (lookups copy straight to and from it)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = _native.PinnedMemory(max(n, 1))
    return np.frombuffer(mem, dtype=dtype, count=int(np.prod(shape))).reshape(shape), mem


def cupy_pinned(cupy, shape, dtype):
    """A numpy array in CuPy's pinned memory (the floor's own buffers)."""
    count = int(np.prod(shape))
    mem = cupy.cuda.alloc_pinned_memory(max(count * np.dtype(dtype).itemsize, 1))
    return np.frombuffer(mem, dtype=dtype, count=count).reshape(shape), mem


def timed(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def lookup_section(cupy, args) -> dict:
    from triton_rec.cache.array_cache import ArrayEmbeddingCache
    from triton_rec.gpu.kernels import load_kernels

    rng = np.random.default_rng(1)
    n, dim = args.rows, args.dim
    keys = rng.permutation(np.arange(n, dtype=np.int64) * 7919 + 13)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    index = _native.build_index(keys)
    # the device cache, every row in it (capacity 2x: no set overflows)
    cache = ArrayEmbeddingCache(2 * n, dim, ways=8, xp="cupy")
    for s in range(0, n, 1 << 18):
        cache.insert(keys[s : s + (1 << 18)], rows[s : s + (1 << 18)])
    table = _native.DeviceTable(load_kernels(0), index, rows, 0, dim, 0.0, "static")
    # the floor: its own copy of the table and index, a plain kernel, a graph per size
    module = cupy.RawModule(code=FLOOR_KERNEL)
    floor_fn = module.get_function("floor_lookup")
    d_slots, d_rows = cupy.asarray(index), cupy.asarray(rows)
    # those copies ran on CuPy's default stream, which the floor's non-blocking stream does
    # not wait for: finish them first
    cupy.cuda.Device().synchronize()
    sms = cupy.cuda.Device(0).attributes["MultiProcessorCount"]
    results = {}
    for m in args.sizes:
        ask = keys[(rng.zipf(1.05, m) - 1) % n]
        floor = (floor_fn, d_slots, d_rows, index.shape[0], sms)
        results[m] = lookup_size(cupy, args, m, ask, dim, cache, table, floor, index, rows)
    return results


def lookup_size(cupy, args, m, ask, dim, cache, table, floor, index, rows) -> dict:
    floor_fn, d_slots, d_rows, capacity, sms = floor
    k_pin, _k = pinned(cupy, (m,), np.int64)
    k_pin[:] = ask
    outs = {name: pinned(cupy, (m, dim), np.float32) for name in ("cache", "table")}
    outs["floor"] = cupy_pinned(cupy, (m, dim), np.float32)
    fk_pin, _fk = cupy_pinned(cupy, (m,), np.int64)
    fk_pin[:] = ask
    status = np.empty(m, np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    d_keys = cupy.empty(m, np.int64)
    d_out = cupy.empty((m, dim), np.float32)
    grid = int(max(1, min(-(-m // 8), sms * 16)))
    f_out = outs["floor"][0]
    with stream:  # H2D keys, the kernel, D2H answers: one graph
        stream.begin_capture()
        cupy.cuda.runtime.memcpyAsync(d_keys.data.ptr, fk_pin.ctypes.data, m * 8, 1, stream.ptr)
        kargs = (d_slots, np.uint64(capacity), d_rows, np.int64(dim), d_keys, np.int64(m), d_out)
        floor_fn((grid,), (256,), kargs)
        nbytes = m * dim * 4
        cupy.cuda.runtime.memcpyAsync(f_out.ctypes.data, d_out.data.ptr, nbytes, 2, stream.ptr)
        graph = stream.end_capture()
    cpu_out = np.empty((m, dim), np.float32)

    def run_floor():
        graph.launch(stream)
        stream.synchronize()

    impls = {
        "floor": run_floor,
        "cache": lambda: cache.query_host(k_pin, outs["cache"][0], status),
        "table": lambda: table.lookup(k_pin, outs["table"][0], status),
        "cpu": lambda: _native.lookup(index, rows, ask, cpu_out, 0.0),
    }
    for fn in impls.values():  # warm, and every answer checked against the CPU path
        fn()
    for name in ("floor", "table"):
        assert np.array_equal(outs[name][0], cpu_out), f"{name} answers wrongly"
    cache.query_host(k_pin, outs["cache"][0], status)
    hit = status == 1  # a set-associative cache drops keys of over-full sets: misses
    hit_rate = float(np.count_nonzero(hit) / m)
    assert np.array_equal(outs["cache"][0][hit], cpu_out[hit]), "the cache answers wrongly"
    assert hit_rate > 0.97, hit_rate
    reps = max(1, int(2e5 // m))
    times: dict = {k: [] for k in impls}
    for r in range(args.rounds):
        order = list(impls)
        order = order[r % len(order) :] + order[: r % len(order)]
        for name in order:
            times[name].append(timed(impls[name], reps))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"lookup {m:>7} keys: floor {med['floor'] * 1e6:8.1f} us | cache "
        f"{med['cache'] * 1e6:8.1f} us ({med['floor'] / med['cache']:.2f}x floor) | "
        f"static table {med['table'] * 1e6:8.1f} us ({med['floor'] / med['table']:.2f}x) | "
        f"CPU path {med['cpu'] * 1e6:8.1f} us | hit rate {hit_rate:.4f}",
        flush=True,
    )
    return {
        "us": {k: round(v * 1e6, 2) for k, v in med.items()},
        "keys_per_s": {k: round(m / v) for k, v in med.items()},
        "ratio_to_floor": {k: round(med["floor"] / med[k], 3) for k in ("cache", "table")},
        "hit_rate": hit_rate,
    }


def dense_section(cupy, args) -> dict:
    from triton_rec.dense.graphs import DenseGraphs
    from triton_rec.dense.hugectr_network import HugeCTRNetwork

    net_json = os.path.join(ROOT, "model_repository", "dlrm", "1", "dlrm.json")
    dense_file = os.path.join(ROOT, "model_repository", "dlrm", "1", "dlrm_dense_0.model")
    if not os.path.exists(dense_file):
        print("dense: no trained demo DLRM (make demo); section skipped", flush=True)
        return {}
    cpu_net = HugeCTRNetwork.load(net_json, dense_file)
    native = _native.DenseNet(cpu_net.native_program(), cpu_net)
    gpu_net = HugeCTRNetwork.load(net_json, dense_file, xp=cupy)
    graphs = DenseGraphs.load(net_json, dense_file, None, max(args.batches), 0)
    print(f"dense: batches up to {graphs.host_max_batch} run on the host (calibrated)", flush=True)
    graphs._host_net = None  # time the graphs at every batch
    rng = np.random.default_rng(2)
    out = {}
    for b in args.batches:
        out[b] = dense_batch(cupy, args, b, rng, cpu_net, native, gpu_net, graphs)
    return out


def dense_batch(cupy, args, b, rng, cpu_net, native, gpu_net, graphs) -> dict:
    dense = rng.standard_normal((b, cpu_net.dense_dim)).astype(np.float32)
    embs = [
        rng.standard_normal((b, t.slot_num, t.vec_size)).astype(np.float32) for t in cpu_net.tables
    ]
    want = cpu_net.predict(dense, embs)
    np.testing.assert_allclose(graphs.predict(dense, embs), want, rtol=1e-4, atol=1e-5)
    d_dense = cupy.empty_like(graphs.dense_in[:b])
    d_embs = [cupy.empty_like(e[:b]) for e in graphs.emb_in]
    res = cupy.empty((b, cpu_net.label_dim), np.float32)

    def floor():
        d_dense.set(dense)
        for d, e in zip(d_embs, embs):
            d.set(e)
        res.get()

    impls = {
        "graph": lambda: graphs.predict(dense, embs),
        "cupy_eager": lambda: cupy.asnumpy(gpu_net.predict(dense, embs)),
        "cpu_native": lambda: native.predict(dense, embs),
        "floor": floor,
    }
    for fn in impls.values():
        fn()
    times: dict = {k: [] for k in impls}
    for r in range(args.rounds):
        order = list(impls)[r % 4 :] + list(impls)[: r % 4]
        for name in order:
            times[name].append(timed(impls[name], 5))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"dense DLRM batch {b:>5}: graph {med['graph'] * 1e6:8.1f} us | CuPy op by op "
        f"{med['cupy_eager'] * 1e6:8.1f} us | CPU native {med['cpu_native'] * 1e6:8.1f} us "
        f"| floor (copies only) {med['floor'] * 1e6:7.1f} us",
        flush=True,
    )
    return {"us": {k: round(v * 1e6, 1) for k, v in med.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES)
    ap.add_argument(
        "--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 1024]
    )
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--sections", default="lookup,dense")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    why = _native.cuda_unavailable()
    if why:
        print(f"bench_gpu: needs a CUDA device ({why})", file=sys.stderr)
        return 2
    import cupy

    from triton_rec.gpu import kernels

    cupy.cuda.Device(0).use()
    report = {
        "machine": machine_info(),
        "device": kernels.device_info(0),
        "kernels": kernels.digest(),
        "command": "python benchmarks/bench_gpu.py " + " ".join(argv or sys.argv[1:]),
    }
    print(json.dumps(report["device"]), flush=True)
    sections = args.sections.split(",")
    if "lookup" in sections:
        report["lookup"] = lookup_section(cupy, args)
    if "dense" in sections:
        report["dense"] = dense_section(cupy, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
