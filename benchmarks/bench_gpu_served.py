#!/usr/bin/env python3
"""Served KIND_GPU against KIND_CPU on one node, in one server and one run (issue 23).

The demo repository (``make demo``) with each measured model five times, all in one
server on the native request path:

- ``<model>_gpu`` / ``<model>_cpu``: instance group KIND_GPU (``--gpu-count`` instances) /
  KIND_CPU (``--cpu-count``), the demo's ps.json entry (a dynamic cache of half of each
  table: requests with misses);
- ``<model>_gpu_static`` / ``<model>_cpu_mapped``: the whole table where the instance
  reads it, every key answered there (the all-hit workload): on the GPU
  ``embedding_cache_type`` ``static`` (the table in device memory), on the CPU
  ``gpucache: false`` (the mapped node-store table). Not ``static`` on the CPU: there it
  is a set-associative cache of the table's size, whose over-full sets keep missing (4.5%
  of the demo DLRM's keys);
- ``<model>_floor``: the native floor backend (``trec_floor``) with the model's inputs and
  outputs: what Triton and a C++ backend cost with no work, the ceiling of any variant.

Models (``--models``): ``dlrm_hps`` and ``hps_demo`` (hps lookups) and ``dlrm`` (the
HugeCTR DLRM), the demo's, by default; ``hps_many``, made here, is an hps model of 26
tables of 20,000 x 16 with one key per table per sample (Criteo's categorical features
each a table, as many deployments have them; the demo models have 2 tables each), the
demo's cache rules otherwise: where a request's per-table work (one launch per table
until the fourth GPU session) shows. ``dlrm_dense`` is the demo DLRM's HugeCTR network as
a ``dense`` model (an ensemble's dense step: DES, the looked-up EMBEDDINGS, ROWINDEX), in
three variants only, ``floor``, ``gpu`` (its CUDA graphs) and ``cpu``: it has no tables.

1. Throughput: ``benchmarks/loadgen.cpp`` (built here with g++; a Python client's CPU per
   request would take the cores being measured) keeps ``--clients`` keep-alive HTTP
   connections busy with requests of each ``--batches`` size (binary tensors, keys Zipf over the
   tables) for ``--seconds``; rounds alternate the variants. Per variant, the median over
   rounds of infer/s and, as the profile of where a request's time goes: the server's CPU
   time per request (``/proc``), Triton's per-request queue and compute times and
   requests per execution (the statistics extension), and the load generator's CPU.
2. Latency: one connection, batch-1 DLRM requests one after the other, p50 and p99.

``--waits block,spin,yield`` runs everything once per way a GPU instance waits for its
stream (``TRITON_REC_GPU_WAIT``), each in a server of its own. ``--perf VARIANTS`` records
the server's stacks with ``perf`` (where installed) while those variants are measured;
``--logs DIR`` keeps the servers' logs and profiles.

    python benchmarks/bench_gpu_served.py [--clients 16] [--seconds 3] [--rounds 2]
        [--batches 64,1024]   # 1,024 samples: lookups of 10k-80k keys, where the GPU shows
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_info  # noqa: E402

from clients.raw_http import encode_request  # noqa: E402
from triton_rec.formats.tables import read_table  # noqa: E402
from triton_rec.triton.runtime import TritonServer  # noqa: E402

DEMO = os.path.join(ROOT, "model_repository")
MODELS = ("dlrm_hps", "hps_demo", "dlrm")  # the default --models
#: the models made here (module docstring): tables, rows per table, vector size, and the
#: demo model whose config.pbtxt and cache rules they take
SYNTHETIC = {"hps_many": {"tables": 26, "rows": 20_000, "dim": 16, "like": "dlrm_hps"}}
#: the ``dense`` models measured here: model -> the demo ps.json entry whose network it runs
DENSE = {"dlrm_dense": "dlrm"}
#: the measured variants of each model (module docstring), in round order
VARIANTS = ("floor", "gpu", "cpu", "gpu_static", "cpu_mapped")


def variants_of(model: str) -> tuple:
    """The variants a model is measured in: a dense model has no tables to hold whole."""
    return VARIANTS[:3] if model in DENSE else VARIANTS


LOADGEN_SOURCE = os.path.join(ROOT, "benchmarks", "loadgen.cpp")


def build_loadgen(out_dir: str) -> str:
    """Compile loadgen.cpp (g++ -O2); the executable's path."""
    exe = os.path.join(out_dir, "loadgen")
    subprocess.run(["g++", "-O2", "-std=c++17", "-pthread", LOADGEN_SOURCE, "-o", exe], check=True)
    return exe


def write_bodies(path: str, bodies) -> str:
    """Requests (body, header length) in loadgen's file format."""
    with open(path, "wb") as f:
        for body, hl in bodies:
            f.write(struct.pack("<II", hl, len(body)))
            f.write(body)
    return path


def run_loadgen(exe: str, url: str, model: str, bodies_file: str, clients: int, seconds: float):
    """One loadgen run: its JSON report (raises when a request failed)."""
    host, port = url.rsplit(":", 1)
    out = subprocess.run(
        [exe, host, port, model, bodies_file, str(clients), str(seconds)],
        check=True,
        capture_output=True,
        text=True,
    )
    r = json.loads(out.stdout)
    if r["failed"]:
        raise RuntimeError(f"{model}: {r['failed']} requests failed: {r['first_error']}")
    return r


def _floor_parameters(model: str, entry: dict) -> dict:
    """trec_floor's parameters for a model with ``entry``'s interface (its ps.json entry)."""
    if model in ("dlrm", *DENSE):
        from examples.dlrm.torch_dlrm import load_trained

        cfg = load_trained(os.path.join(DEMO, "dlrm", "1")).config
        middle = {"middle": "EMBEDDINGS"} if model in DENSE else {}
        return {"tables": len(cfg.tables), "slots": cfg.total_slots, **middle}
    return {"vec_sizes": ",".join(str(v) for v in entry["embedding_vecsize_per_table"])}


def make_synthetic(model: str, base: str) -> dict:
    """Writes a SYNTHETIC model's tables (HugeCTR sparse folders, random rows) under
    ``base``/<model>/1 and returns its ps.json entry (paths relative to ``base``)."""
    from triton_rec.formats.hugectr_sparse import write_sparse_dir

    spec = SYNTHETIC[model]
    with open(os.path.join(DEMO, "ps.json")) as f:
        like = next(m for m in json.load(f)["models"] if m["model"] == spec["like"])
    rng = np.random.default_rng(3)
    files = []
    for t in range(spec["tables"]):
        rel = f"{model}/1/{model}{t}_sparse_0.model"
        keys = rng.choice(10**9, spec["rows"], replace=False).astype(np.int64)
        vectors = rng.standard_normal((spec["rows"], spec["dim"])).astype(np.float32)
        write_sparse_dir(os.path.join(base, rel), keys, vectors)
        files.append(rel)
    return {
        "model": model,
        "sparse_files": files,
        "embedding_table_names": [f"table{t}" for t in range(spec["tables"])],
        "embedding_vecsize_per_table": [spec["dim"]] * spec["tables"],
        "maxnum_catfeature_query_per_table_per_sample": [1] * spec["tables"],
        "default_value_for_each_table": [0.0] * spec["tables"],
        **{k: like[k] for k in ("deployed_device_list", "max_batch_size", "gpucache",
                                "gpucacheper", "hit_rate_threshold")},
    }  # fmt: skip


def model_sources(models, base: str) -> dict:
    """model -> (folder its ps.json paths are relative to, its ps.json entry, its
    config.pbtxt text): the demo's, or a SYNTHETIC model's made under ``base``."""
    with open(os.path.join(DEMO, "ps.json")) as f:
        entries = {m["model"]: m for m in json.load(f)["models"]}
    sources = {}
    for model in models:
        like = SYNTHETIC[model]["like"] if model in SYNTHETIC else model
        with open(os.path.join(DEMO, like, "config.pbtxt")) as f:
            cfg = f.read().replace(f'name: "{like}"', f'name: "{model}"', 1)
        if model in SYNTHETIC:
            sources[model] = (base, make_synthetic(model, base), cfg)
        else:
            sources[model] = (DEMO, entries[DENSE.get(model, model)], cfg)
    return sources


def build_repository(
    path: str, gpu_count: int, cpu_count: int, gpu_kind: str = "KIND_GPU", sources=None
) -> str:
    """Each measured model (``sources``: model_sources; default the demo's MODELS) in its
    variants (module docstring), with its files in its own version folder (ps.json paths
    rewritten: every folder of a repository is a model)."""
    os.makedirs(path)
    with open(os.path.join(DEMO, "ps.json")) as f:
        ps = json.load(f)
    sources = sources or model_sources(MODELS, path)
    ps["models"] = []
    for model, (base, model_entry, demo_cfg) in sources.items():
        for variant in variants_of(model):
            name = f"{model}_{variant}"
            version = os.path.join(path, name, "1")
            os.makedirs(version)
            cfg = demo_cfg.replace(f'name: "{model}"', f'name: "{name}"', 1)
            # a dense model's network: its ps.json entry (each variant has its own)
            cfg = re.sub(r'(key: "ps_model" value: \{ string_value: )"\w+"', rf'\1"{name}"', cfg)
            kind, count = (gpu_kind, gpu_count) if "gpu" in variant else ("KIND_CPU", cpu_count)
            group = f"instance_group [ {{ count: {count} kind: {kind} }} ]"
            cfg = re.sub(r"instance_group \[.*?\]", group, cfg, flags=re.S)
            if variant == "floor":
                cfg = re.sub(r'backend: "\w+"', 'backend: "trec_floor"', cfg)
                cfg = re.sub(r"parameters \{.*", "", cfg, flags=re.S)
                for k, v in _floor_parameters(model, model_entry).items():
                    cfg += f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                with open(os.path.join(path, name, "config.pbtxt"), "w") as f:
                    f.write(cfg)
                continue
            entry = dict(model_entry, model=name)
            if variant == "gpu_static":
                entry["embedding_cache_type"] = "static"
            elif variant == "cpu_mapped":
                entry["gpucache"] = False

            def local(rel: str, version=version, name=name, base=base) -> str:
                src = os.path.join(base, rel)
                dst = os.path.join(version, os.path.basename(rel))
                if not os.path.exists(dst):
                    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
                return f"{name}/1/{os.path.basename(rel)}"

            entry["sparse_files"] = [local(p) for p in entry["sparse_files"]]
            for key in ("dense_file", "network_file", "non_trainable_params_file"):
                if entry.get(key):
                    entry[key] = local(entry[key])
            ps["models"].append(entry)
            source_dir = os.path.join(base, DENSE.get(model, model), "1")
            for f in os.listdir(source_dir):  # e.g. the network JSON
                if f.endswith(".json"):
                    shutil.copy(os.path.join(source_dir, f), os.path.join(version, f))
            with open(os.path.join(path, name, "config.pbtxt"), "w") as f:
                f.write(cfg)
    with open(os.path.join(path, "ps.json"), "w") as f:
        json.dump(ps, f, indent=1)
    return path


def hps_bodies(source, batch: int, n: int, rng) -> list:
    """n requests of ``batch`` samples for an hps model (``source``: model_sources')."""
    base, m, cfg = source
    pools = [
        read_table(os.path.join(base, p), v)[0]
        for p, v in zip(m["sparse_files"], m["embedding_vecsize_per_table"])
    ]
    batched = "max_batch_size: 0" not in cfg
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


def _dlrm_samples(batch: int, n: int):
    from examples.dlrm.torch_dlrm import HiddenModel, load_trained

    model = load_trained(os.path.join(DEMO, "dlrm", "1"))
    with open(os.path.join(DEMO, "dlrm", "1", "dlrm_meta.json")) as f:
        seed = json.load(f)["seed"]
    return HiddenModel(model.config, seed).sample(batch * n, np.random.default_rng(5))


def dlrm_bodies(batch: int, n: int) -> list:
    data = _dlrm_samples(batch, n)
    bodies = []
    for i in range(n):
        req = data.hugectr_request(i * batch, (i + 1) * batch)
        bodies.append(encode_request({k: v[None, :] for k, v in req.items()}, ("OUTPUT0",)))
    return bodies


def dense_bodies(source, batch: int, n: int) -> list:
    """n requests of ``batch`` samples for a dense model: the demo DLRM's samples, each
    key's vector read from its table (``source``: model_sources'; what the ensemble's hps
    step answers)."""
    base, m, _ = source
    data = _dlrm_samples(batch, n)
    tables = []
    for p, v in zip(m["sparse_files"], m["embedding_vecsize_per_table"]):
        keys, vectors = read_table(os.path.join(base, p), v)
        order = np.argsort(keys)
        tables.append((keys[order], vectors[order]))
    bodies = []
    for i in range(n):
        req = data.ensemble_request(i * batch, (i + 1) * batch)
        counts = np.concatenate([[0], np.cumsum(req["NUMKEYS"])])
        emb = []
        for t, (keys, vectors) in enumerate(tables):
            part = req["KEYS"][counts[t] : counts[t + 1]]
            at = np.searchsorted(keys, part)
            if not np.array_equal(keys[np.minimum(at, keys.size - 1)], part):
                raise ValueError(f"{m['model']}: a sample's key is not in table {t}")
            emb.append(vectors[at].reshape(-1))
        inputs = {
            "DES": req["DES"],
            "EMBEDDINGS": np.concatenate(emb).astype(np.float32),
            "ROWINDEX": req["ROWINDEX"],
        }
        bodies.append(encode_request(inputs, ("OUTPUT0",)))
    return bodies


def _cpu_of(stat_path: str) -> float:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/PID/stat)."""
    return _cpu_of(f"/proc/{pid}/stat")


def thread_cpu_seconds(pid: int) -> dict:
    """CPU seconds of a process's threads, summed by thread name (/proc/PID/task/*/comm):
    which of the server's threads (HTTP front end, model instances, CUDA, ...) spend it."""
    out: dict = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = re.sub(r"\d+$", "#", f.read().strip())
            out[name] = out.get(name, 0.0) + _cpu_of(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # the thread ended
            pass
    return out


def model_stats(url: str, model: str) -> dict:
    """Triton's cumulative statistics of a model: request count, execution count and the
    nanoseconds of each phase (statistics extension)."""
    host, port = url.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("GET", f"/v2/models/{model}/stats")
    s = json.loads(c.getresponse().read())["model_stats"][0]
    c.close()
    i = s["inference_stats"]
    out = {"requests": i["success"]["count"], "executions": s["execution_count"]}
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        out[phase + "_ns"] = i[phase]["ns"]
    return out


def perf_record(pid: int, seconds: float, out: str):
    """``perf record`` of the server's stacks for ``seconds`` into ``out`` (started in the
    background; None where perf is not installed)."""
    if shutil.which("perf") is None:
        return None
    cmd = ["perf", "record", "-F", "499", "-g", "-p", str(pid), "-o", out, "--", "sleep"]
    return subprocess.Popen(
        cmd + [str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def perf_report(proc, data: str) -> None:
    """Wait for perf_record's process; its flat reports (self time >= 0.5% by thread name and
    library, then by library and symbol) beside the data."""
    proc.wait()
    flat = ["perf", "report", "-i", data, "--stdio", "--no-children", "-g", "none"]
    with open(data + ".txt", "w") as f:
        for sort in ("comm,dso", "dso,sym"):
            f.flush()
            subprocess.run(
                flat + ["--sort", sort, "--percent-limit", "0.5"],
                stdout=f,
                stderr=subprocess.STDOUT,
            )


def measure(exe, srv, model, bodies_file, clients, seconds, perf_out=None) -> dict:
    """One round of one variant: infer/s and where each request's time went (with
    ``perf_out``, a perf profile of the server during the round, where perf exists)."""
    url, pid = srv.http_url, srv.process.pid
    before, cpu0 = model_stats(url, model), server_cpu_seconds(pid)
    threads0 = thread_cpu_seconds(pid)
    prof = perf_record(pid, seconds * 0.8, perf_out) if perf_out else None
    r = run_loadgen(exe, url, model, bodies_file, clients, seconds)
    if prof is not None:
        perf_report(prof, perf_out)
    cpu1, after = server_cpu_seconds(pid), model_stats(url, model)
    threads1 = thread_cpu_seconds(pid)
    n = max(after["requests"] - before["requests"], 1)
    by_thread = {
        name: (t - threads0.get(name, 0.0)) / r["answered"] * 1e6 for name, t in threads1.items()
    }
    out = {
        "infer_per_s": r["answered"] / r["seconds"],
        "server_cpu_us": (cpu1 - cpu0) / r["answered"] * 1e6,
        "client_cpu_us": r["cpu_s"] / r["answered"] * 1e6,
        "requests_per_execution": n / max(after["executions"] - before["executions"], 1),
        "p50_us": r["p50_us"],
        "p99_us": r["p99_us"],
    }
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        out[phase + "_us"] = (after[phase + "_ns"] - before[phase + "_ns"]) / n / 1e3
    # server CPU per request by thread name, the threads that spent >= 1 us of it
    out.update({f"cpu_us[{k}]": v for k, v in sorted(by_thread.items()) if v >= 1.0})
    return out


def serve_and_measure(args, repo, tmp, exe, bodies_files, single_files, wait) -> dict:
    """Every model's variants in one server whose GPU instances wait the way ``wait``."""
    # each server its own store and shared-memory folder: nothing one leaves behind (its
    # stop under load is issue 24's subject) reaches the next
    env = {
        "TRITON_REC_STORE": os.path.join(tmp, f"store-{wait}"),
        "TRITON_REC_SHM_DIR": tempfile.mkdtemp(prefix=f"shm-{wait}-", dir=tmp),
        "TRITON_REC_GPU_WAIT": wait,
    }
    report = {"throughput": {}, "latency_batch1": {}}
    log = os.path.join(args.logs or tmp, f"server-{wait}.log")
    with TritonServer(repo, log_path=log, env=env) as srv:
        url = srv.http_url
        for (model, _), feed in bodies_files.items():  # warm caches and connections
            for v in variants_of(model):
                run_loadgen(exe, url, f"{model}_{v}", feed, 4, 1.0)
        for (model, batch), feed in bodies_files.items():
            variants = variants_of(model)
            rounds = {v: [] for v in variants}
            for r in range(args.rounds):
                for v in variants if r % 2 == 0 else variants[::-1]:
                    name = f"{model}_{v}"
                    perf = (
                        os.path.join(args.logs or tmp, f"perf-{wait}-{name}.data")
                        if r == 0 and name in args.perf
                        else None
                    )
                    rounds[v].append(
                        measure(exe, srv, name, feed, args.clients, args.seconds, perf)
                    )
            med = {
                v: {
                    k: round(statistics.median(x.get(k, 0.0) for x in rs), 1)
                    for k in sorted(set().union(*rs))
                }
                for v, rs in rounds.items()
            }
            rate = {v: m["infer_per_s"] for v, m in med.items()}
            whole = "gpu_static" in rate  # a model with tables: held whole too
            report["throughput"][f"{model}@{batch}"] = {
                "variants": med,
                "gpu_over_cpu": round(rate["gpu"] / rate["cpu"], 3),
                **(
                    {
                        "gpu_static_over_cpu_mapped": round(
                            rate["gpu_static"] / rate["cpu_mapped"], 3
                        )
                    }
                    if whole
                    else {}
                ),
                "over_floor": {v: round(rate[v] / rate["floor"], 3) for v in variants[1:]},
            }
            print(f"[wait={wait}] {model} batch {batch}, {args.clients} connections:")
            for v, m in med.items():
                print(
                    f"  {model}_{v:11s} {m['infer_per_s']:9.0f} infer/s "
                    f"({m['infer_per_s'] / rate['floor']:.2f}x floor) | server CPU "
                    f"{m['server_cpu_us']:6.1f} us/req | compute_infer {m['compute_infer_us']:7.1f}"
                    f" us | queue {m['queue_us']:7.1f} us | {m['requests_per_execution']:.2f} "
                    f"req/exec | p50 {m['p50_us']} us",
                    flush=True,
                )
                threads = {k[7:-1]: x for k, x in m.items() if k.startswith("cpu_us[")}
                print(
                    "      server CPU us/req by thread: "
                    + ", ".join(
                        f"{k} {x:.1f}" for k, x in sorted(threads.items(), key=lambda i: -i[1])
                    ),
                    flush=True,
                )
            held = (
                f" (whole table: {rate['gpu_static'] / rate['cpu_mapped']:.2f}x)" if whole else ""
            )
            print(f"  GPU/CPU {rate['gpu'] / rate['cpu']:.2f}x{held}", flush=True)
        if "dlrm" not in args.models:
            return report
        lat = {}
        for v in VARIANTS:
            model = f"dlrm_{v}"
            run_loadgen(exe, url, model, single_files, 1, 0.5)
            r = run_loadgen(exe, url, model, single_files, 1, args.seconds)
            lat[v] = {"p50_us": r["p50_us"], "p99_us": r["p99_us"]}
        lat["gpu_over_cpu_p50"] = round(lat["gpu"]["p50_us"] / max(lat["cpu"]["p50_us"], 1), 3)
        report["latency_batch1"]["dlrm"] = lat
        print(f"[wait={wait}] dlrm batch 1, one connection: {json.dumps(lat)}", flush=True)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--batches", default="64", help="samples per request, comma-separated (e.g. 64,1024)"
    )
    ap.add_argument("--gpu-count", type=int, default=4)
    ap.add_argument("--cpu-count", type=int, default=8)
    ap.add_argument("--waits", default="yield", help="comma-separated: yield, block, spin")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default=None, help="keep the servers' logs in this folder")
    ap.add_argument(
        "--perf",
        default="",
        help="comma-separated variants (e.g. dlrm_gpu_static) to profile with perf in round 1",
    )
    # KIND_CPU here checks the benchmark itself on a machine without a GPU
    ap.add_argument("--gpu-kind", default="KIND_GPU", choices=("KIND_GPU", "KIND_CPU"))
    ap.add_argument(
        "--models",
        default=",".join(MODELS),
        help=f"comma-separated, of {', '.join(MODELS + tuple(SYNTHETIC) + tuple(DENSE))} "
        "(module docstring)",
    )
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.perf = [p for p in args.perf.split(",") if p]
    rng = np.random.default_rng(1)
    tmp = tempfile.mkdtemp(prefix="trec-served-")
    exe = build_loadgen(tmp)
    sources = model_sources(args.models, os.path.join(tmp, "sources"))
    repo = build_repository(
        os.path.join(tmp, "repo"), args.gpu_count, args.cpu_count, args.gpu_kind, sources
    )
    files = {}
    for batch in (int(b) for b in args.batches.split(",")):
        n = 64 if batch <= 256 else 16  # distinct requests per model and batch size
        for model in args.models:
            if model == "dlrm":
                made = dlrm_bodies(batch, n)
            elif model in DENSE:
                made = dense_bodies(sources[model], batch, n)
            else:
                made = hps_bodies(sources[model], batch, n, rng)
            files[(model, batch)] = write_bodies(os.path.join(tmp, f"{model}-{batch}.bin"), made)
    single = (
        write_bodies(os.path.join(tmp, "dlrm1.bin"), dlrm_bodies(1, 200))
        if "dlrm" in args.models
        else None
    )
    report = {
        "machine": machine_info(),
        "command": "python benchmarks/bench_gpu_served.py " + " ".join(argv or sys.argv[1:]),
        "settings": vars(args),
        "by_wait": {},
    }
    failed = False
    for wait in args.waits.split(","):
        try:
            report["by_wait"][wait] = serve_and_measure(args, repo, tmp, exe, files, single, wait)
        except RuntimeError as e:  # a server that did not start: its errors, then the next
            failed = True
            with open(os.path.join(args.logs or tmp, f"server-{wait}.log"), errors="replace") as f:
                errors = [line.rstrip() for line in f if line.startswith("E")]
            report["by_wait"][wait] = {"error": str(e)[-1500:], "server_errors": errors}
            print(f"[wait={wait}] FAILED: the server's errors:", *errors, sep="\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
