#!/usr/bin/env python3
"""perf_analyzer sweep of the demo DLRM served fused, as an ensemble, and an identity floor.

One run, loopback only, every server stopped at the end. It

1. makes sure the demo DLRM is trained (``model_repository/dlrm/1/dlrm_dense_0.model``;
   else runs ``model_repository/dlrm/train.py``);
2. builds a temporary model repository with copies of the trained files and configs:
   ``dlrm`` (fused, backend ``hugectr``, dense part = HugeCTR dense file run by numpy),
   ``dlrm_onnx`` (the same fused model with its dense part in onnxruntime: the dense
   implementation the ensemble uses, so fused vs ensemble can be compared like for like),
   ``dlrm_ensemble`` with its two steps ``dlrm_hps`` -> ``dlrm_dense`` (ONNX), and
   ``identity``: a Python-backend model with dlrm's interface (DES/CATCOLUMN/ROWINDEX
   in, OUTPUT0 = the first num_samples values of DES out; max_batch_size 1024, ragged
   inputs, dynamic batching, 2 instances, like dlrm).
   That is the floor: Triton + Python-backend stub round trip, no model work. The
   server gets a private node-local store (``TRITON_REC_STORE``) in the temp dir;
3. writes perf_analyzer ``--input-data`` JSON files from held-out samples of the
   generator the model was trained on (``HiddenModel(config, seed).sample``, another
   RNG seed than training), several distinct requests per file: for dlrm/identity one
   row per tensor (shape ``[n]`` without the batch dim, perf_analyzer adds batch 1), for
   the ensemble 1-D tensors DES, KEYS (table-major), NUMKEYS, ROWINDEX;
4. checks once, with tritonclient, that dlrm and dlrm_ensemble answer the same and that
   identity echoes DES (so the benchmark measures working models);
5. runs perf_analyzer for every model x samples/request x concurrency x protocol in
   ``count_windows`` mode (the window's request count scaled to the batch), reads its
   ``-f`` CSV and prints markdown tables. A run that fails is recorded as failed with the
   reason; a run that did not stabilise within ``--max-trials`` is re-run once with the
   stability check off (``-s 1000``) and flagged ``unstable``.

    .venv/bin/python benchmarks/bench_perf_analyzer.py [--quick] [--out-dir DIR]
        [--models dlrm,dlrm_onnx,dlrm_ensemble,identity] [--samples 1,64,1024]
        [--concurrency 1,2,4,8] [--conc-1024 1,2,4,8] [--protocols http,grpc]
        [--requests-per-file 16] [--max-trials 6] [--stability 50] [--window-scale 2] [--keep]
        [--locust "-u 8 -r 4 -t 60s"] [--skip-perf]

``--quick``: dlrm only, 64 samples/request, concurrency 2, both protocols.
``--locust "ARGS"``: afterwards, run ``benchmarks/locustfile.py`` headless against the same
server (``--host`` and ``--csv`` are filled in; ARGS e.g. ``-u 8 -r 4 -t 60s``) and print its
statistics; ``--skip-perf`` skips the perf_analyzer sweep.
Raw outputs (CSVs, perf_analyzer stdout, server log, results.json, tables.md) go to
``--out-dir`` (default: a new directory under /tmp, printed at the end).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from triton_rec.triton import perf_analyzer  # noqa: E402
from triton_rec.triton.runtime import TritonServer  # noqa: E402

DEMO = ROOT / "model_repository"
VENV_BIN = Path(sys.executable).parent
HELD_OUT_SEED = 31337  # RNG seed of the held-out samples (training used another stream)

# Published reference (NVIDIA HugeCTR backend, full Criteo DLRM, one V100, batch 1, concurrency 1).
V100_REF = {"avg_us": 675.0, "infer_per_s": 1464.6, "p99_us": 907.0}

IDENTITY_CONFIG = """\
# Floor for the dlrm benchmark: dlrm's interface, no model work (Python backend).
name: "identity"
backend: "python"
max_batch_size: 1024
input [
  { name: "DES" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true },
  { name: "CATCOLUMN" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },
  { name: "ROWINDEX" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
instance_group [ { count: 2 kind: KIND_CPU } ]
parameters { key: "tables" value: { string_value: "%(tables)d" } }
parameters { key: "total_slots" value: { string_value: "%(slots)d" } }
"""

IDENTITY_MODEL = '''\
"""Identity floor: OUTPUT0 = the first num_samples values of DES (one float per sample,
like dlrm's output), num_samples = (len(ROWINDEX) - tables) / total_slots."""
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.tables = int(params["tables"]["string_value"])
        self.slots = int(params["total_slots"]["string_value"])

    def execute(self, requests):
        responses = []
        for request in requests:
            des = pb_utils.get_input_tensor_by_name(request, "DES").as_numpy().reshape(-1)
            pb_utils.get_input_tensor_by_name(request, "CATCOLUMN").as_numpy()
            rowindex = pb_utils.get_input_tensor_by_name(request, "ROWINDEX").as_numpy().reshape(-1)
            n = (rowindex.size - self.tables) // self.slots
            out = des[:n].copy()
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT0", out)]))
        return responses
'''


# ----------------------------------------------------------------------------- setup


def ensure_trained() -> None:
    d = DEMO / "dlrm" / "1"
    needed = [
        "dlrm_dense_0.model",
        "dlrm.json",
        "dlrm_dense.onnx",
        "dlrm_meta.json",
        "dlrm_torch.pt",
        "dlrm0_sparse_0.model",
        "dlrm1_sparse_0.model",
    ]
    if all((d / f).exists() for f in needed):
        return
    print("demo DLRM not trained yet: running model_repository/dlrm/train.py", flush=True)
    subprocess.run([sys.executable, str(DEMO / "dlrm" / "train.py")], check=True, cwd=ROOT)


def build_repository(repo: Path) -> dict:
    """Copy the dlrm files/configs into ``repo``, add identity; return the dlrm meta."""
    src = DEMO / "dlrm" / "1"
    meta = json.loads((src / "dlrm_meta.json").read_text())
    (repo / "dlrm" / "1").mkdir(parents=True)
    shutil.copy2(DEMO / "dlrm" / "config.pbtxt", repo / "dlrm" / "config.pbtxt")
    for f in src.iterdir():  # a private copy: a concurrent retrain cannot change what we serve
        if f.is_dir():
            shutil.copytree(f, repo / "dlrm" / "1" / f.name)
        elif f.suffix in (".model", ".json", ".onnx", ".pt"):
            shutil.copy2(f, repo / "dlrm" / "1" / f.name)
    for name in ("dlrm_onnx", "dlrm_hps", "dlrm_dense", "dlrm_ensemble"):
        (repo / name / "1").mkdir(parents=True)
        shutil.copy2(DEMO / name / "config.pbtxt", repo / name / "config.pbtxt")
    ps = json.loads((DEMO / "ps.json").read_text())
    ps["models"] = [m for m in ps["models"] if m["model"] in ("dlrm", "dlrm_onnx", "dlrm_hps")]
    assert len(ps["models"]) == 3, "ps.json lacks the dlrm / dlrm_onnx / dlrm_hps entries"
    (repo / "ps.json").write_text(json.dumps(ps, indent=1))
    (repo / "identity" / "1").mkdir(parents=True)
    (repo / "identity" / "config.pbtxt").write_text(
        IDENTITY_CONFIG % {"tables": len(meta["tables"]), "slots": meta["total_slots"]}
    )
    (repo / "identity" / "1" / "model.py").write_text(IDENTITY_MODEL)
    return meta


def held_out(meta: dict, n: int):
    from examples.dlrm.torch_dlrm import DLRMConfig, HiddenModel

    config = DLRMConfig.from_meta(meta)
    return HiddenModel(config, meta["seed"]).sample(n, np.random.default_rng(HELD_OUT_SEED))


def ensemble_request(data, a: int, b: int) -> dict:
    """The same samples as ``data.hugectr_request(a, b)`` in the ensemble's layout."""
    return data.ensemble_request(a, b)


def _entry(arr: np.ndarray) -> dict:
    return {"content": arr.reshape(-1).tolist(), "shape": [int(arr.size)]}


def write_inputs(meta: dict, samples: list, requests_per_file: dict, out: Path) -> dict:
    """perf_analyzer input files per (kind, n); kind 'fused' (dlrm, identity) or 'ensemble'."""
    files = {}
    for n in samples:
        r = requests_per_file[n]
        data = held_out(meta, n * r)
        fused, ens = [], []
        for i in range(r):
            req = data.hugectr_request(i * n, (i + 1) * n)
            fused.append({k: _entry(v) for k, v in req.items()})
            ens.append(
                {k: _entry(v) for k, v in ensemble_request(data, i * n, (i + 1) * n).items()}
            )
        for kind, rows in (("fused", fused), ("ensemble", ens)):
            p = out / f"input_{kind}_{n}.json"
            p.write_text(json.dumps({"data": rows}))
            files[(kind, n)] = p
    return files


def sanity_check(server: TritonServer, files: dict, models: list, samples: list) -> list:
    """One request of each input file through each model; returns problems (empty = fine)."""
    import tritonclient.http as http

    problems = []
    client = http.InferenceServerClient(server.http_url)
    types = {
        "DES": "FP32",
        "CATCOLUMN": "INT64",
        "ROWINDEX": "INT32",
        "KEYS": "INT64",
        "NUMKEYS": "INT32",
    }
    try:
        for n in samples:
            results = {}
            for model in models:
                kind = "ensemble" if model == "dlrm_ensemble" else "fused"
                row = json.loads(files[(kind, n)].read_text())["data"][0]
                inputs = []
                for name, e in row.items():
                    arr = np.array(
                        e["content"],
                        dtype={"FP32": np.float32, "INT64": np.int64, "INT32": np.int32}[
                            types[name]
                        ],
                    )
                    if kind == "fused":
                        arr = arr[None, :]
                    i = http.InferInput(name, list(arr.shape), types[name])
                    i.set_data_from_numpy(arr)
                    inputs.append(i)
                out_name = "PREDICTION" if kind == "ensemble" else "OUTPUT0"
                try:
                    out = client.infer(model, inputs).as_numpy(out_name).reshape(-1)
                except Exception as e:  # noqa: BLE001  (reported, not fatal)
                    problems.append(f"{model} n={n}: {e}")
                    continue
                if out.size != n:
                    problems.append(f"{model} n={n}: {out.size} outputs")
                results[model] = (out, np.array(row["DES"]["content"], np.float32))
            for other in ("dlrm_onnx", "dlrm_ensemble"):
                if (
                    "dlrm" in results
                    and other in results
                    and results[other][0].size == n
                    and not np.allclose(results["dlrm"][0], results[other][0], atol=1e-5)
                ):
                    problems.append(f"n={n}: dlrm and {other} disagree")
            if "identity" in results and not np.array_equal(
                results["identity"][0], results["identity"][1][:n]
            ):
                problems.append(f"n={n}: identity does not echo DES[:n]")
    finally:
        client.close()
    return problems


# ----------------------------------------------------------------------------- perf_analyzer


def window_requests(n: int, conc: int, scale: float = 1.0) -> int:
    """Requests per count window: ~enough for a p99 at small batches, short at 1024."""
    base = {1: 300, 64: 150}.get(n, 40 if n >= 1024 else 100)
    return int(max(base, 10 * conc) * scale)


def pa_command(model, url, protocol, data, conc, count, csv_path, max_trials, stability):
    return perf_analyzer.command(
        [
            "-m",
            model,
            "-u",
            url,
            "-i",
            protocol,
            "--input-data",
            str(data),
            "--concurrency-range",
            str(conc),
            "--measurement-mode",
            "count_windows",
            "--measurement-request-count",
            str(count),
            "--max-trials",
            str(max_trials),
            "--stability-percentage",
            str(stability),
            "-f",
            str(csv_path),
        ]
    )


def parse_csv(path: Path) -> dict:
    """The first row of a perf_analyzer ``-f`` CSV: throughput, latencies, time split (us)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError("empty CSV")
    r = rows[0]
    g = lambda k: float(r[k]) if r.get(k) not in (None, "") else float("nan")  # noqa: E731
    return {
        "infer_per_s": g("Inferences/Second"),
        "avg_us": g("Avg latency"),
        "p50_us": g("p50 latency"),
        "p90_us": g("p90 latency"),
        "p99_us": g("p99 latency"),
        "client_send_us": g("Client Send"),
        "network_server_us": g("Network+Server Send/Recv"),
        "server_queue_us": g("Server Queue"),
        "server_input_us": g("Server Compute Input"),
        "server_infer_us": g("Server Compute Infer"),
        "server_output_us": g("Server Compute Output"),
        "client_recv_us": g("Client Recv"),
    }


def parse_stdout(text: str) -> dict:
    """What the CSV lacks: the client's average latency (and its standard deviation), and
    the server's inference/execution counts (requests per execution = dynamic batching)."""
    out = {}
    m = re.search(r"Avg latency: (\d+) usec \(standard deviation (\d+) usec\)", text)
    if m:
        out["avg_us"], out["std_us"] = float(m.group(1)), float(m.group(2))
    inf = re.search(r"Inference count: (\d+)", text)
    exe = re.search(r"Execution count: (\d+)", text)
    if inf and exe and int(exe.group(1)) > 0:
        out["requests_per_execution"] = int(inf.group(1)) / int(exe.group(1))
    if "Composing models:" in text:  # ensembles: each step's server-side split
        comp = {}
        part = text.split("Composing models:", 1)[1]
        for m in re.finditer(
            r"^\s*(\S+), version: \S+\n(.*?)Avg request latency: (\d+) usec \((.*?)\)",
            part,
            re.S | re.M,
        ):
            d = {"total_us": float(m.group(3))}
            for k, v in re.findall(
                r"(queue|compute input|compute infer|compute output) (\d+) usec", m.group(4)
            ):
                d[k.replace(" ", "_") + "_us"] = float(v)
            comp[m.group(1)] = d
        out["composing"] = comp
    return out


def run_one(model, n, conc, protocol, server, files, out_dir, args, env) -> dict:
    kind = "ensemble" if model == "dlrm_ensemble" else "fused"
    url = server.http_url if protocol == "http" else server.grpc_url
    tag = f"{model}_n{n}_c{conc}_{protocol}"
    count = window_requests(n, conc, args.window_scale)
    rec = {
        "model": model,
        "samples": n,
        "concurrency": conc,
        "protocol": protocol,
        "window_requests": count,
        "status": "ok",
    }
    t0 = time.monotonic()
    for attempt, (trials, stab) in enumerate(((args.max_trials, args.stability), (3, 1000))):
        csv_path = out_dir / f"{tag}{'_retry' if attempt else ''}.csv"
        cmd = pa_command(
            model, url, protocol, files[(kind, n)], conc, count, csv_path, trials, stab
        )
        rec["command"] = " ".join(cmd)
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout, env=env
            )
        except subprocess.TimeoutExpired:
            rec.update(status="failed", reason=f"timeout after {args.timeout} s")
            break
        (out_dir / f"{tag}{'_retry' if attempt else ''}.log").write_text(done.stdout + done.stderr)
        text = done.stdout + done.stderr
        if done.returncode == 0 and csv_path.exists():
            try:
                rec.update(parse_csv(csv_path))
            except (ValueError, KeyError) as e:
                rec.update(status="failed", reason=f"unreadable CSV: {e}")
                break
            rec.update(parse_stdout(done.stdout))
            if attempt:
                rec["status"] = "unstable"
            rec["samples_per_s"] = rec["infer_per_s"] * n
            break
        unstable = "stable" in text.lower() and "fail" in text.lower()
        reason = next(
            (ln.strip() for ln in text.splitlines() if "rror" in ln or "ailed" in ln),
            f"exit {done.returncode}",
        )
        rec.update(status="failed", reason=reason[:200])
        if not unstable or attempt:
            break
    rec["wall_s"] = round(time.monotonic() - t0, 2)
    return rec


# ----------------------------------------------------------------------------- locust


def run_locust(server: TritonServer, repo: Path, out_dir: Path, extra: str) -> str:
    """Run benchmarks/locustfile.py headless against ``server``; markdown of its stats."""
    cmd = [
        str(VENV_BIN / "locust"),
        "-f",
        str(ROOT / "benchmarks" / "locustfile.py"),
        "--headless",
        "--host",
        f"http://{server.http_url}",
        "--csv",
        str(out_dir / "locust"),
        "--only-summary",
        *shlex.split(extra),
    ]
    env = dict(
        os.environ,
        TRITON_REC_PS_JSON=str(repo / "ps.json"),
        TRITON_REC_DLRM_DIR=str(repo / "dlrm" / "1"),
        LOCUST_SAMPLES_JSON=str(out_dir / "locust_samples.json"),
    )
    print("locust:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    (out_dir / "locust.log").write_text(done.stdout + done.stderr)
    lines = [
        "",
        "### locust (benchmarks/locustfile.py)",
        "",
        f"`locust {' '.join(shlex.quote(a) for a in cmd[1:])}` (exit {done.returncode}, "
        f"{time.monotonic() - t0:.0f} s)",
        "",
    ]
    stats = out_dir / "locust_stats.csv"
    if not stats.exists():
        return "\n".join(lines + ["locust wrote no statistics: see locust.log", ""])
    lines += [
        "| name | requests | failures | req/s | avg ms | p50 ms | p95 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    with open(stats, newline="") as f:
        for r in csv.DictReader(f):
            lines.append(
                f"| {r['Name']} | {r['Request Count']} | {r['Failure Count']} "
                f"| {float(r['Requests/s']):.1f} | {float(r['Average Response Time']):.1f} "
                f"| {r['50%']} | {r['95%']} | {r['99%']} | {float(r['Max Response Time']):.0f} |"
            )
    sj = out_dir / "locust_samples.json"
    if sj.exists():
        d = json.loads(sj.read_text())
        lines += [
            "",
            "samples/s (successful requests): "
            + ", ".join(f"{m} {v:,.0f}" for m, v in sorted(d["samples_per_s"].items()))
            + f", total {sum(d['samples_per_s'].values()):,.0f}",
        ]
    failures = out_dir / "locust_failures.csv"
    if failures.exists():
        with open(failures, newline="") as f:
            rows = list(csv.DictReader(f))
        lines += [
            "",
            f"failures: {len(rows)} distinct"
            + "".join(
                f"\n- {r.get('Name')}: {r.get('Error')} (x{r.get('Occurrences')})" for r in rows
            ),
        ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- report


def machine_info() -> dict:
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    try:
        pa = subprocess.run(
            perf_analyzer.command(["--version"]),
            capture_output=True,
            text=True,
            env=perf_analyzer.environment(),
            timeout=30,
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        pa = "?"
    import importlib.metadata as md

    return {
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "nvidia-pytriton": md.version("nvidia-pytriton"),
        "tritonclient": md.version("tritonclient"),
        "perf_analyzer": pa or "?",
        "tritonserver": "2.51 (nvidia-pytriton wheel)",
        "loadavg_start": os.getloadavg(),
    }


def fmt(x, digits=0):
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def tables_md(results: list) -> str:
    lines = []
    models = list(dict.fromkeys(r["model"] for r in results))
    for model in models:
        lines += [
            f"### {model}",
            "",
            "| samples/req | conc | proto | infer/s | samples/s | avg us | p50 us | p99 us "
            "| server queue us | server compute us | req/exec | status |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in results:
            if r["model"] != model:
                continue
            ok = r["status"] != "failed"
            compute = (
                (
                    r.get("server_input_us", 0)
                    + r.get("server_infer_us", 0)
                    + r.get("server_output_us", 0)
                )
                if ok
                else None
            )
            status = r["status"] if r["status"] != "failed" else f"failed: {r.get('reason', '')}"
            lines.append(
                f"| {r['samples']} | {r['concurrency']} | {r['protocol']} "
                f"| {fmt(r.get('infer_per_s'), 1)} | {fmt(r.get('samples_per_s'))} "
                f"| {fmt(r.get('avg_us'))} | {fmt(r.get('p50_us'))} "
                f"| {fmt(r.get('p99_us'))} | {fmt(r.get('server_queue_us'))} | {fmt(compute)} "
                f"| {fmt(r.get('requests_per_execution'), 2)} | {status} |"
            )
        lines.append("")
        steps = [r for r in results if r["model"] == model and r.get("composing")]
        if steps:
            names = sorted(steps[0]["composing"])
            lines += [
                f"{model} per step (server side, us: queue / compute infer / whole step):",
                "",
                "| samples/req | conc | proto | " + " | ".join(names) + " |",
                "|---:|---:|---|" + "---:|" * len(names),
            ]
            for r in steps:
                cells = []
                for nm in names:
                    c = r["composing"].get(nm, {})
                    cells.append(
                        f"{fmt(c.get('queue_us'))} / {fmt(c.get('compute_infer_us'))} "
                        f"/ {fmt(c.get('total_us'))}"
                    )
                lines.append(
                    f"| {r['samples']} | {r['concurrency']} | {r['protocol']} | "
                    + " | ".join(cells)
                    + " |"
                )
            lines.append("")
    return "\n".join(lines)


def reference_md(results: list) -> str:
    rows = [
        r
        for r in results
        if r["model"] == "dlrm"
        and r["samples"] == 1
        and r["concurrency"] == 1
        and r["status"] != "failed"
    ]
    lines = [
        "### dlrm at batch 1, concurrency 1 vs the published HugeCTR/V100 figure",
        "",
        "| setup | avg us | p99 us | infer/s |",
        "|---|---:|---:|---:|",
        "| NVIDIA HugeCTR backend, full Criteo DLRM, 1x V100 (published) "
        f"| {V100_REF['avg_us']:.0f} | {V100_REF['p99_us']:.0f} | {V100_REF['infer_per_s']:.1f} |",
    ]
    for r in rows:
        lines.append(
            f"| triton-rec `dlrm` (small demo DLRM, 2 CPU cores), {r['protocol']} "
            f"| {fmt(r['avg_us'])} | {fmt(r['p99_us'])} | {fmt(r['infer_per_s'], 1)} |"
        )
    for r in rows:
        lines.append("")
        lines.append(
            f"{r['protocol']}: our average latency is "
            f"{r['avg_us'] / V100_REF['avg_us']:.2f}x the V100 figure, throughput "
            f"{r['infer_per_s'] / V100_REF['infer_per_s']:.2f}x. The models differ "
            "(theirs: full Criteo DLRM on a GPU; ours: a small demo DLRM on 2 CPU cores), so this "
            "compares serving overhead at batch 1, not model speed."
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="dlrm, 64 samples/request, concurrency 2, http+grpc"
    )
    p.add_argument("--models", default="dlrm,dlrm_onnx,dlrm_ensemble,identity")
    p.add_argument("--samples", default="1,64,1024")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument(
        "--conc-1024",
        default=None,
        help="concurrency levels for >= 1024 samples (default: --concurrency)",
    )
    p.add_argument("--protocols", default="http,grpc")
    p.add_argument("--requests-per-file", type=int, default=16)
    p.add_argument("--max-trials", type=int, default=6)
    p.add_argument(
        "--window-scale",
        type=float,
        default=2.0,
        help="multiplies the requests per count window (300/150/40 at 1/64/1024 samples)",
    )
    p.add_argument("--stability", type=int, default=50, help="perf_analyzer --stability-percentage")
    p.add_argument("--timeout", type=int, default=180, help="seconds per perf_analyzer run")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the temporary model repository")
    p.add_argument(
        "--locust",
        default=None,
        metavar="ARGS",
        help='also run the locustfile against the server, e.g. --locust "-u 8 -r 4 -t 60s"',
    )
    p.add_argument(
        "--skip-perf", action="store_true", help="no perf_analyzer sweep (with --locust)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.samples, args.concurrency, args.conc_1024 = "dlrm", "64", "2", None
    models = args.models.split(",")
    samples = [int(x) for x in args.samples.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    concs_big = [int(x) for x in args.conc_1024.split(",")] if args.conc_1024 else concs
    protocols = args.protocols.split(",")

    t_start = time.monotonic()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="bench_perf_", dir="/tmp")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_perf_repo_", dir="/tmp"))
    info = machine_info()
    print(f"machine: {info}", flush=True)
    ensure_trained()
    repo = work / "repo"
    meta = build_repository(repo)
    per_file = {
        n: (max(4, args.requests_per_file // 2) if n >= 1024 else args.requests_per_file)
        for n in samples
    }
    files = write_inputs(meta, samples, per_file, out_dir)
    served = set(models) | ({"dlrm", "dlrm_ensemble"} if args.locust is not None else set())
    load = sorted(served | ({"dlrm_hps", "dlrm_dense"} if "dlrm_ensemble" in served else set()))
    server = TritonServer(
        repo,
        explicit=True,
        load_models=load,
        log_path=out_dir / "server.log",
        env={"TRITON_REC_STORE": str(work / "store")},
    )
    results, problems, locust_md = [], [], ""
    env = perf_analyzer.environment()
    try:
        t0 = time.monotonic()
        server.start(timeout=300)
        print(
            f"server ready in {time.monotonic() - t0:.1f} s "
            f"({server.http_url}, grpc {server.grpc_url})",
            flush=True,
        )
        problems = sanity_check(server, files, models, samples)
        print("sanity check:", "ok" if not problems else problems, flush=True)
        for model in [] if args.skip_perf else models:
            for n in samples:
                for conc in concs_big if n >= 1024 else concs:
                    for protocol in protocols:
                        rec = run_one(model, n, conc, protocol, server, files, out_dir, args, env)
                        results.append(rec)
                        tail = " " + rec.get("reason", "") if rec["status"] == "failed" else ""
                        print(
                            f"{model:14s} n={n:<5d} c={conc} {protocol:4s} {rec['status']:8s} "
                            f"{fmt(rec.get('infer_per_s'), 1):>9s} infer/s "
                            f"{fmt(rec.get('avg_us')):>8s} us avg "
                            f"{fmt(rec.get('p99_us')):>8s} us p99  ({rec['wall_s']} s){tail}",
                            flush=True,
                        )
        if args.locust is not None:
            locust_md = run_locust(server, repo, out_dir, args.locust)
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()
    total = time.monotonic() - t_start
    md = tables_md(results)
    if any(r["model"] == "dlrm" and r["samples"] == 1 and r["concurrency"] == 1 for r in results):
        md += "\n" + reference_md(results)
    md += locust_md
    print("\n" + md)
    print(f"total wall time {total:.0f} s; raw output in {out_dir}")
    (out_dir / "tables.md").write_text(md)
    (out_dir / "results.json").write_text(
        json.dumps(
            {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "argv": sys.argv[1:],
                "machine": info,
                "sanity_problems": problems,
                "wall_s": round(total, 1),
                "requests_per_file": per_file,
                "results": results,
            },
            indent=1,
        )
    )
    return 0 if not problems and all(r["status"] != "failed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
