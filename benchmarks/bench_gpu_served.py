#!/usr/bin/env python3
"""Served KIND_GPU against KIND_CPU on one node, in one server and one run (issue 23).

The demo repository (``make demo``) with each measured model twice: ``<model>_gpu``
(instance group KIND_GPU, ``--gpu-count`` instances) and ``<model>_cpu`` (KIND_CPU,
``--cpu-count``), both on the native request path. Models: ``dlrm_hps`` and ``hps_demo``
(hps lookups) and ``dlrm`` (the HugeCTR DLRM).

1. Throughput: ``--clients`` processes, one keep-alive HTTP connection each (binary
   tensors, ``clients/raw_http.py``), send batch-``--batch`` requests of one variant for
   ``--seconds``; rounds alternate the variants (gpu, cpu, cpu, gpu, ...). Keys are Zipf
   over the tables (the caches warm first); infer/s = answered requests / time, median
   over rounds; the ratio is GPU / CPU.
2. Latency: one connection, batch-1 DLRM requests one after the other, p50 and p99 of
   each variant.

    python benchmarks/bench_gpu_served.py [--clients 16] [--seconds 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_info  # noqa: E402

from clients.raw_http import Client, encode_request  # noqa: E402
from triton_rec.formats.tables import read_table  # noqa: E402
from triton_rec.triton.runtime import TritonServer  # noqa: E402

DEMO = os.path.join(ROOT, "model_repository")
MODELS = ("dlrm_hps", "hps_demo", "dlrm")


def build_repository(path: str, gpu_count: int, cpu_count: int, gpu_kind: str = "KIND_GPU") -> str:
    """Each measured model twice, with its files in its own version folder (ps.json paths
    rewritten: every folder of a repository is a model)."""
    os.makedirs(path)
    with open(os.path.join(DEMO, "ps.json")) as f:
        ps = json.load(f)
    entries = {m["model"]: m for m in ps["models"]}
    ps["models"] = []
    for model in MODELS:
        for kind, count in (("gpu", gpu_count), ("cpu", cpu_count)):
            name = f"{model}_{kind}"
            version = os.path.join(path, name, "1")
            os.makedirs(version)
            entry = dict(entries[model], model=name)

            def local(rel: str, version=version, name=name) -> str:
                src = os.path.join(DEMO, rel)
                dst = os.path.join(version, os.path.basename(rel))
                if not os.path.exists(dst):
                    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
                return f"{name}/1/{os.path.basename(rel)}"

            entry["sparse_files"] = [local(p) for p in entry["sparse_files"]]
            for key in ("dense_file", "network_file", "non_trainable_params_file"):
                if entry.get(key):
                    entry[key] = local(entry[key])
            ps["models"].append(entry)
            with open(os.path.join(DEMO, model, "config.pbtxt")) as f:
                cfg = f.read().replace(f'name: "{model}"', f'name: "{name}"')
            kind_name = gpu_kind if kind == "gpu" else "KIND_CPU"
            group = f"instance_group [ {{ count: {count} kind: {kind_name} }} ]"
            cfg = re.sub(r"instance_group \[.*?\]", group, cfg, flags=re.S)
            for f in os.listdir(os.path.join(DEMO, model, "1")):  # e.g. the network JSON
                if f.endswith(".json"):
                    shutil.copy(os.path.join(DEMO, model, "1", f), os.path.join(version, f))
            with open(os.path.join(path, name, "config.pbtxt"), "w") as f:
                f.write(cfg)
    with open(os.path.join(path, "ps.json"), "w") as f:
        json.dump(ps, f, indent=1)
    return path


def hps_bodies(model: str, batch: int, n: int, rng) -> list:
    with open(os.path.join(DEMO, "ps.json")) as f:
        m = next(x for x in json.load(f)["models"] if x["model"] == model)
    pools = [
        read_table(os.path.join(DEMO, p), v)[0]
        for p, v in zip(m["sparse_files"], m["embedding_vecsize_per_table"])
    ]
    with open(os.path.join(DEMO, model, "config.pbtxt")) as f:
        batched = "max_batch_size: 0" not in f.read()
    bodies = []
    for _ in range(n):
        keys = [
            p[(rng.zipf(1.1, batch * k) - 1) % p.shape[0]]
            for p, k in zip(pools, m["maxnum_catfeature_query_per_table_per_sample"])
        ]
        inputs = {
            "KEYS": np.concatenate(keys).astype(np.int64),
            "NUMKEYS": np.array([len(k) for k in keys], np.int32),
        }
        if batched:  # a model with a batch dimension takes [1, n]
            inputs = {k: v[None, :] for k, v in inputs.items()}
        bodies.append(encode_request(inputs, ("OUTPUT0",)))
    return bodies


def dlrm_bodies(batch: int, n: int) -> list:
    from examples.dlrm.torch_dlrm import HiddenModel, load_trained

    model = load_trained(os.path.join(DEMO, "dlrm", "1"))
    with open(os.path.join(DEMO, "dlrm", "1", "dlrm_meta.json")) as f:
        seed = json.load(f)["seed"]
    data = HiddenModel(model.config, seed).sample(batch * n, np.random.default_rng(5))
    bodies = []
    for i in range(n):
        req = data.hugectr_request(i * batch, (i + 1) * batch)
        bodies.append(encode_request({k: v[None, :] for k, v in req.items()}, ("OUTPUT0",)))
    return bodies


def _client(url, model, bodies, seconds, start, q):
    c = Client(url)
    while time.time() < start:
        time.sleep(0.001)
    done, errors, i = 0, 0, 0
    end = start + seconds
    while time.time() < end:
        body, hl = bodies[i % len(bodies)]
        status, _, _ = c.post(model, body, hl)
        done += status == 200
        errors += status != 200
        i += 1
    q.put((done, errors))


def throughput(url, model, bodies, clients, seconds) -> float:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    start = time.time() + 0.5
    procs = [
        ctx.Process(target=_client, args=(url, model, bodies, seconds, start, q))
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    errors = sum(e for _, e in results)
    if errors:
        raise RuntimeError(f"{model}: {errors} requests failed")
    return sum(d for d, _ in results) / seconds


def latency(url, model, bodies, n) -> dict:
    c = Client(url)
    times = []
    for i in range(n):
        body, hl = bodies[i % len(bodies)]
        t0 = time.perf_counter()
        status, _, _ = c.post(model, body, hl)
        times.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"{model}: HTTP {status}")
    times.sort()
    return {
        "p50_us": round(times[len(times) // 2] * 1e6, 1),
        "p99_us": round(times[int(n * 0.99)] * 1e6, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gpu-count", type=int, default=4)
    ap.add_argument("--cpu-count", type=int, default=8)
    ap.add_argument("--json", default=None)
    # KIND_CPU here checks the benchmark itself on a machine without a GPU
    ap.add_argument("--gpu-kind", default="KIND_GPU", choices=("KIND_GPU", "KIND_CPU"))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(1)
    tmp = tempfile.mkdtemp(prefix="trec-served-")
    repo = build_repository(
        os.path.join(tmp, "repo"), args.gpu_count, args.cpu_count, args.gpu_kind
    )
    bodies = {
        "dlrm_hps": hps_bodies("dlrm_hps", args.batch, 64, rng),
        "hps_demo": hps_bodies("hps_demo", args.batch, 64, rng),
        "dlrm": dlrm_bodies(args.batch, 64),
    }
    single = dlrm_bodies(1, 200)
    report = {
        "machine": machine_info(),
        "command": "python benchmarks/bench_gpu_served.py " + " ".join(argv or sys.argv[1:]),
        "settings": vars(args),
        "throughput": {},
        "latency_batch1": {},
    }
    env = {"TRITON_REC_STORE": os.path.join(tmp, "store")}
    with TritonServer(repo, log_path=os.path.join(tmp, "server.log"), env=env) as srv:
        url = srv.http_url
        for model, b in bodies.items():  # warm the caches and the connections
            for kind in ("gpu", "cpu"):
                throughput(url, f"{model}_{kind}", b, 4, 1.0)
        for model, b in bodies.items():
            rates = {"gpu": [], "cpu": []}
            for r in range(args.rounds):
                order = ("gpu", "cpu") if r % 2 == 0 else ("cpu", "gpu")
                for kind in order:
                    rates[kind].append(
                        throughput(url, f"{model}_{kind}", b, args.clients, args.seconds)
                    )
            med = {k: statistics.median(v) for k, v in rates.items()}
            report["throughput"][model] = {
                "infer_per_s": {k: round(v, 1) for k, v in med.items()},
                "gpu_over_cpu": round(med["gpu"] / med["cpu"], 3),
            }
            print(
                f"served {model} batch {args.batch}, {args.clients} connections: KIND_GPU "
                f"{med['gpu']:8.0f} infer/s | KIND_CPU {med['cpu']:8.0f} infer/s | "
                f"GPU/CPU {med['gpu'] / med['cpu']:.2f}x",
                flush=True,
            )
        for kind in ("gpu", "cpu"):
            latency(url, f"dlrm_{kind}", single, 50)
        lat = {k: latency(url, f"dlrm_{k}", single, 400) for k in ("gpu", "cpu")}
        lat["gpu_over_cpu_p50"] = round(lat["gpu"]["p50_us"] / lat["cpu"]["p50_us"], 3)
        report["latency_batch1"]["dlrm"] = lat
        print(f"served dlrm batch 1, one connection: {json.dumps(lat)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
