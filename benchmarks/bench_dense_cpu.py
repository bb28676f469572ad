#!/usr/bin/env python3
"""The MLPerf-shaped DLRM's dense network on the CPU, in-process: the native executor
(src/native/dense_net.hpp, gemm.hpp) beside onnxruntime (CPU provider) and PyTorch
running the same weights, one thread each, the same inputs; beside them (in the same rounds,
compared with none of them) the native executor with its rows split over every usable core
(``native_every_core``: what a served instance with the node to itself runs).

    .venv/bin/python benchmarks/bench_dense_cpu.py [--batch-sizes 1,64,1024] [--rounds 7]
    make bench-dense

The network is the one ``ps-loader criteo-dlrm`` writes (ps_loader/criteo.py: dense 13 ->
512-256-128, dot interaction over 27 vectors of 128, 480 -> 1024-1024-512-256-1,
sigmoid; 2.37 M parameters), loaded from its HugeCTR files by ``HugeCTRNetwork.load``.
onnxruntime runs an ONNX graph of the same weights built here (Gemm/Relu, the
interaction as MatMul + Gather), PyTorch the same layers as modules. Rounds alternate
the three (each round times ``--calls`` calls of each), so a busy machine slows all
three alike; the figures are each one's fastest round and the median.

Both OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from this command's environment
(it starts itself again without them): they hold numpy's OpenBLAS, and PyTorch's own
kernels, to older ones on some machines. The native executor uses no BLAS; which kernel
it runs (``_native.gemm_kernels()``) is recorded, as are numpy's BLAS and the load.

Writes benchmarks/data/dense_cpu.json (--out to change).
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
from typing import Callable, Dict, List

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.machine import machine_info  # noqa: E402
from ps_loader import criteo  # noqa: E402

BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def write_network(out_dir: str, seed: int):
    """The generator's network JSON and dense file in ``out_dir``; returns their paths
    and the (W, b) pairs in network order."""
    params = criteo.dense_parameters(seed)
    net = os.path.join(out_dir, "dlrm_criteo.json")
    dense = os.path.join(out_dir, "dlrm_criteo_dense_0.model")
    with open(net, "w", encoding="utf-8") as f:
        json.dump(criteo.network_json(), f)
    np.concatenate([a.ravel() for wb in params for a in wb]).astype("<f4").tofile(dense)
    return net, dense, params


def interaction_pairs(n: int) -> List[int]:
    """Flat indices (i * n + j) of HugeCTR's interaction outputs: i > j, row by row."""
    return [i * n + j for i in range(1, n) for j in range(i)]


def onnx_session(params, path: str):
    """onnxruntime, one thread, on an ONNX graph of the network (inputs dense, emb_<t>)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits = [], []
    n = criteo.NUM_TABLES + 1
    inputs = [helper.make_tensor_value_info("dense", TensorProto.FLOAT, ["B", criteo.DENSE_DIM])]
    inputs += [
        helper.make_tensor_value_info(f"emb_{t}", TensorProto.FLOAT, ["B", 1, criteo.EMBEDDING_DIM])
        for t in range(criteo.NUM_TABLES)
    ]

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def mlp(x, layers, tag, last_relu):
        for i, (w, b) in enumerate(layers):
            y = f"{tag}{i}"
            nodes.append(helper.make_node("Gemm", [x, const(f"{y}w", w), const(f"{y}b", b)], [y]))
            x = y
            if last_relu or i < len(layers) - 1:
                nodes.append(helper.make_node("Relu", [x], [f"{y}r"]))
                x = f"{y}r"
        return x

    nb = len(criteo.BOTTOM_MLP)
    bottom = mlp("dense", params[:nb], "bottom", True)
    nodes.append(helper.make_node("Unsqueeze", [bottom, const("axis1", np.array([1]))], ["b3"]))
    embs = [f"emb_{t}" for t in range(criteo.NUM_TABLES)]
    nodes.append(helper.make_node("Concat", ["b3", *embs], ["z"], axis=1))
    nodes.append(helper.make_node("Transpose", ["z"], ["zt"], perm=[0, 2, 1]))
    nodes.append(helper.make_node("MatMul", ["z", "zt"], ["gram"]))
    nodes.append(helper.make_node("Reshape", ["gram", const("flat", np.array([0, n * n]))], ["g"]))
    pairs = const("pairs", np.array(interaction_pairs(n), np.int64))
    nodes.append(helper.make_node("Gather", ["g", pairs], ["dots"], axis=1))
    # the padding zero: a column of the batch's size
    nodes.append(helper.make_node("ReduceSum", ["dense", const("ax1", np.array([1]))], ["s"]))
    nodes.append(helper.make_node("Mul", ["s", const("zero", np.float32(0))], ["pad"]))
    nodes.append(helper.make_node("Concat", [bottom, "dots", "pad"], ["inter"], axis=1))
    logit = mlp("inter", params[nb:], "top", False)
    nodes.append(helper.make_node("Sigmoid", [logit], ["prob"]))
    out = [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["B", 1])]
    graph = helper.make_graph(nodes, "dlrm_criteo", inputs, out, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return lambda dense, embs: sess.run(
        None, {"dense": dense, **{f"emb_{t}": e for t, e in enumerate(embs)}}
    )[0]


def torch_model(params):
    """PyTorch (eager, inference mode, one thread) running the same weights."""
    import torch

    torch.set_num_threads(1)
    nb = len(criteo.BOTTOM_MLP)

    def seq(layers, last_relu):
        mods = []
        for i, (w, b) in enumerate(layers):
            lin = torch.nn.Linear(w.shape[0], w.shape[1])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
                lin.bias.copy_(torch.from_numpy(b))
            mods.append(lin)
            if last_relu or i < len(layers) - 1:
                mods.append(torch.nn.ReLU())
        return torch.nn.Sequential(*mods).eval()

    bottom, top = seq(params[:nb], True), seq(params[nb:], False)
    n = criteo.NUM_TABLES + 1
    ii, jj = np.tril_indices(n, -1)
    ii, jj = torch.from_numpy(ii), torch.from_numpy(jj)

    def predict(dense, embs):
        with torch.inference_mode():
            x = bottom(torch.from_numpy(dense))
            z = torch.cat([x[:, None, :], *(torch.from_numpy(e) for e in embs)], dim=1)
            gram = torch.bmm(z, z.transpose(1, 2))
            inter = torch.cat([x, gram[:, ii, jj], torch.zeros(len(dense), 1)], dim=1)
            return torch.sigmoid(top(inter)).numpy()

    return predict


def inputs(batch: int, seed: int):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((batch, criteo.DENSE_DIM)).astype(np.float32)
    embs = [
        (criteo.VECTOR_SCALE * rng.uniform(-1, 1, (batch, 1, criteo.EMBEDDING_DIM))).astype(
            np.float32
        )
        for _ in range(criteo.NUM_TABLES)
    ]
    return dense, embs


def time_calls(fn: Callable[[], object], calls: int):
    """(wall, this thread's CPU time) per call, in us: each executor computes on the
    calling thread (one thread), so CPU time leaves out what other processes took."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6, (time.thread_time() - c0) / calls * 1e6


def measure(executors: Dict[str, Callable], batch: int, rounds: int, calls: int) -> Dict:
    dense, embs = inputs(batch, seed=batch)
    answers = {name: np.asarray(fn(dense, embs)) for name, fn in executors.items()}  # warm
    ref = answers["native"]
    times: Dict[str, List[float]] = {name: [] for name in executors}
    cpu: Dict[str, List[float]] = {name: [] for name in executors}
    for _ in range(rounds):
        for name, fn in executors.items():
            wall, used = time_calls(lambda fn=fn: fn(dense, embs), calls)
            times[name].append(wall)
            cpu[name].append(used)
    row = {"batch": batch, "calls_per_round": calls, "rounds": rounds}
    for name, ts in times.items():
        row[name] = {
            "best_us": round(min(ts), 1),
            "median_us": round(statistics.median(ts), 1),
            "best_cpu_us": round(min(cpu[name]), 1),
            "max_abs_diff_vs_native": float(np.abs(answers[name] - ref).max()),
        }
    for peer in executors:
        if not peer.startswith("native"):
            # > 1: the native executor is faster than the peer (wall time, CPU time)
            row[f"native_speed_vs_{peer}"] = round(
                row[peer]["best_us"] / row["native"]["best_us"], 3
            )
            row[f"native_cpu_speed_vs_{peer}"] = round(
                row[peer]["best_cpu_us"] / row["native"]["best_cpu_us"], 3
            )
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,64,1024")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=0, help="calls per round (0: by batch size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--out", help="JSON path (default benchmarks/data/dense_cpu.json)")
    p.add_argument(
        "--keep-blas-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE"
    )
    args = p.parse_args(argv)
    if not args.keep_blas_env and any(k in os.environ for k in BLAS_ENV):
        env = {k: v for k, v in os.environ.items() if k not in BLAS_ENV}
        return subprocess.call([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env)

    from threadpoolctl import threadpool_info, threadpool_limits

    from triton_rec import _native
    from triton_rec.dense.hugectr_network import HugeCTRNetwork

    with tempfile.TemporaryDirectory() as tmp, threadpool_limits(1):
        net_json, dense_file, params = write_network(tmp, args.seed)
        network = HugeCTRNetwork.load(net_json, dense_file)
        native = _native.DenseNet(network.native_program(), network, threads=1)
        executors = {"native": native.predict, "onnxruntime": onnx_session(params, f"{tmp}/m.onnx")}
        if not args.no_torch:
            executors["pytorch"] = torch_model(params)
        # beside them, not compared with them: the native executor as a served instance with
        # the node to itself runs it, its rows split over every usable core (row_parts.hpp)
        every_core = _native.DenseNet(network.native_program(), network)
        if every_core.threads > 1:
            executors["native_every_core"] = every_core.predict
        rows = []
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            calls = args.calls or max(2, 2000 // (batch + 20))
            row = measure(executors, batch, args.rounds, calls)
            rows.append(row)
            peers = "  ".join(
                f"{k}: {row[k]['best_us']:,.0f} us ({row.get('native_speed_vs_' + k, 1):.2f}x, "
                f"CPU {row[k]['best_cpu_us']:,.0f} us "
                f"{row.get('native_cpu_speed_vs_' + k, 1):.2f}x)"
                for k in executors
            )
            print(f"batch {batch:>5}: {peers}", flush=True)
        result = {
            "benchmark": "dense_cpu",
            "command": "benchmarks/bench_dense_cpu.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine_info(),
            "load_average": list(os.getloadavg()),
            "threads": 1,
            "native_every_core_threads": every_core.threads,
            "network": repr(network),
            "native_gemm_kernel": native.gemm,
            "native_gemm_kernels_on_this_cpu": _native.gemm_kernels(),
            "blas": [
                {k: i.get(k) for k in ("internal_api", "architecture", "version", "num_threads")}
                for i in threadpool_info()
            ],
            "blas_env_removed": not args.keep_blas_env,
            "rows": rows,
        }
    out = args.out or os.path.join(ROOT, "benchmarks", "data", "dense_cpu.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {os.path.relpath(out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
