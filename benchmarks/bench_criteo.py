#!/usr/bin/env python3
"""One benchmark users can rerun: the generated MLPerf-shaped DLRM served, beside a floor.

1. Generates the model (``python -m ps_loader criteo-dlrm``, docs/criteo-dlrm.md) at
   ``--scale`` into ``--work`` (default: ``triton-rec-bench-criteo`` under the system's
   temporary directory), or reuses what an earlier run generated there with the same
   scale, precision, seed, ``--min-rows`` and ``--perf-requests`` (a stamp file says so;
   perf input files of batch sizes not generated yet are added);
2. per ``--kind`` (``KIND_CPU``, ``KIND_GPU``, or ``both``: KIND_GPU then KIND_CPU, each
   in a tritonserver of its own, on this node), starts one tritonserver (the project's
   launcher, native request path) with two models: ``dlrm_criteo`` (the generated model,
   backend ``hugectr``, ``--instances`` instances of the kind) and ``floor_criteo``, the
   native floor (backend ``trec_floor``, src/triton_backend/floor_backend.cpp: reads the
   request's metadata, answers zeros of one float per sample) with the same
   config.pbtxt otherwise: inputs DES/CATCOLUMN/ROWINDEX, output OUTPUT0,
   ``max_batch_size`` 65536, dynamic batching, instance kind and count. One request of
   each model is checked first (the model's predictions in (0, 1), the floor's zeros);
3. runs perf_analyzer (the generated input files: power-law keys, ~1% in no table; one
   request = one row of ``batch`` samples, ``-b 1``) against both models for every
   ``--batch-sizes`` x ``--concurrency``: per batch size a warm-up of each model (every
   request of its file, ``--request-count``), then per concurrency the floor and the
   model back to back (which goes first alternates), so each ratio model/floor is taken
   against a floor measured seconds apart in the same server. Windows are time windows
   of ``--window-ms``, lengthened to hold ``--min-requests`` requests at the warm-up's
   latency (a request of 65,536 samples takes seconds on a few cores). On the host, the
   model's c=1 windows of at most ``--inprocess-max`` samples have the network itself
   timed in this process right before and after them (:class:`InProcessNetwork`: the
   same executor, the server's thread rule), for issue 35's served-batch-64 target;
4. measures the server's PSS after start, after each batch size (what its requests left
   resident) and after the sweep (``/proc/<pid>/smaps``, by kind of mapping) beside the
   tables' bytes + the dense weights' bytes + 60 MiB (issue 35's target, stated there for
   4 instances: run with ``--instances 4`` to check it);
5. prints a table per kind with NVIDIA's published Merlin HPS + TensorRT figures
   (:data:`NVIDIA_HPS_TRT`) beside ours at c=1, and writes the raw results to
   ``<data-dir>/criteo_<cpu|gpu>_<machine tag>.json`` (``benchmarks/data`` by default;
   the machine tag is benchmarks/machine.py's ``machine_tag``; ``_<N>instances`` before
   ``.json`` when ``--instances`` is not 1, ``_<math>`` for a KIND_GPU model whose
   ``--dense-math`` is not fp32: config.pbtxt ``dense_math``, docs/precision.md).

Transport, as NVIDIA's offline scenario measured it: gRPC with the tensors in system
shared memory (``--protocol``, ``--shared-memory none`` for plain gRPC/HTTP).

    python benchmarks/bench_criteo.py --scale 0.01 [--kind KIND_CPU|KIND_GPU|both]
        [--batch-sizes 256,1024,4096,16384,65536] [--concurrency 1,2] [--instances 1]
        [--dense-math fp32|tf32|fp16]
        [--window-ms 1000] [--min-requests 3] [--work DIR] [--data-dir benchmarks/data]

Disk: the tables (``ps-loader criteo-dlrm --help``: 1 GB at 0.01, 4.9 GB at 0.05 in
fp32), the node store's copy of them (as much again) and ~170 MB of perf inputs with
every batch size. Runs on one work directory must not overlap (each rewrites its
config.pbtxt files).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_perf_analyzer  # noqa: E402
from machine import gpus, machine_info, machine_tag, nvidia_smi  # noqa: E402

from ps_loader import criteo  # noqa: E402
from triton_rec.config.model_config import DENSE_MATHS  # noqa: E402
from triton_rec.triton import perf_analyzer  # noqa: E402
from triton_rec.triton.runtime import TritonServer  # noqa: E402
from triton_rec.util.procfs import pss_by_mapping, smaps_rollup  # noqa: E402

MODEL = "dlrm_criteo"
FLOOR = "floor_criteo"
KINDS = ("KIND_CPU", "KIND_GPU")
#: issue 35's memory target: PSS <= the tables' bytes + the dense weights + this
PSS_SLACK_BYTES = 60 << 20
PSS_TARGET_INSTANCES = 4

#: NVIDIA's published figures for the same network, the one reference table of this
#: benchmark: NVIDIA DeepLearningExamples,
#: TensorFlow2/Recommendation/DLRM_and_DCNv2/doc/merlin_hps_inference.md, "Offline: DLRM
#: on NVIDIA DGX A100 (1x A100 80GB), Merlin HPS + TensorRT with FP16". Rows: batch ->
#: (samples/s as published, p50 us, p99 us).
NVIDIA_HPS_TRT = {
    "source": "NVIDIA DeepLearningExamples, TensorFlow2/Recommendation/DLRM_and_DCNv2/doc/"
    "merlin_hps_inference.md, 'Offline: DLRM on NVIDIA DGX A100 (1x A100 80GB), Merlin "
    "HPS + TensorRT with FP16'",
    "hardware": "NVIDIA DGX A100, one A100 80GB GPU",
    "setup": "Triton ensemble: Merlin HPS (embeddings; --hps_gpucacheper 0.1) + TensorRT "
    "FP16 dense part (CUDA graphs), 1 instance, max_batch_size 65536, concurrency 1, "
    "perf_analyzer with --shared-memory system, client and server on one host; the "
    "full-size trained model (22B parameters, Criteo 1TB)",
    "rows": {
        256: (401_000, 624, 738),
        1024: (1_250_000, 786, 1130),
        4096: (2_620_000, 1533, 1743),
        16384: (4_000_000, 4001, 5833),
        65536: (4_300_000, 14941, 20144),
    },
}

STAMP = "generated.json"


# ----------------------------------------------------------------------------- the model


def generation_key(args) -> Dict:
    """What makes two generated repositories the same (the batch sizes only add files)."""
    return {
        "scale": args.scale,
        "precision": args.precision,
        "seed": args.seed,
        "min_rows": args.min_rows,
        "perf_requests": args.perf_requests,
    }


def generate(args, batches: List[int]) -> Dict:
    """The generated repository under ``args.work`` (made, or reused when its stamp says it
    was made with the same :func:`generation_key`); returns the stamp, with ``reused``."""
    key = generation_key(args)
    base = Path(args.work).resolve() / (
        f"scale{args.scale:g}_{args.precision}_seed{args.seed}_min{args.min_rows}"
    )
    repo, stamp_path = base / "repo", base / STAMP
    stamp = json.loads(stamp_path.read_text()) if stamp_path.exists() else None
    if stamp is not None and stamp.get("key") == key and (repo / "ps.json").exists():
        have = set(stamp["batch_sizes"])
        if not set(batches) <= have:  # deterministic per batch size: rewriting is harmless
            every = sorted(have | set(batches))
            rows = criteo.table_rows(args.scale, args.min_rows)
            criteo.write_perf_inputs(str(repo), MODEL, rows, args.seed, every, args.perf_requests)
            stamp["batch_sizes"] = every
            stamp_path.write_text(json.dumps(stamp, indent=1))
        print(f"reusing the model generated in {repo}", flush=True)
        return dict(stamp, reused=True, repo=str(repo), store=str(base / "store"))
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    cmd = [sys.executable, "-m", "ps_loader", "criteo-dlrm", "--out", str(repo)]
    cmd += ["--scale", f"{args.scale:g}", "--precision", args.precision, "--seed", str(args.seed)]
    cmd += ["--min-rows", str(args.min_rows), "--perf-requests", str(args.perf_requests)]
    cmd += ["--batch-sizes", ",".join(map(str, batches)), "--name", MODEL]
    t0 = time.monotonic()
    print("generating:", shlex.join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"generation failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    summary = [ln for ln in done.stdout.splitlines() if ln.startswith(f"wrote {MODEL} into")]
    print(*summary, flush=True)
    rows = criteo.table_rows(args.scale, args.min_rows)
    stamp = {
        "key": key,
        "batch_sizes": sorted(batches),
        "command": "python " + shlex.join(cmd[1:]).replace(str(repo), "REPO"),
        "seconds": round(time.monotonic() - t0, 1),
        "rows": rows,
        "tables_bytes": sum(criteo.table_bytes(r, args.precision) for r in rows),
        "dense_bytes": 4 * criteo.DENSE_FILE_FLOATS,
    }
    stamp_path.write_text(json.dumps(stamp, indent=1))
    return dict(stamp, reused=False, repo=str(repo), store=str(base / "store"))


def floor_config(kind: str, instances: int) -> str:
    """The floor's config.pbtxt: the model's own (:func:`ps_loader.criteo.config_pbtxt`),
    renamed, on backend ``trec_floor`` with its hugectr-interface parameters (one float
    per sample: (len(ROWINDEX) - tables) / slots)."""
    text = criteo.config_pbtxt(MODEL, kind, instances)
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("#")) + "\n"
    text = text.replace(f'name: "{MODEL}"', f'name: "{FLOOR}"', 1)
    text = text.replace('backend: "hugectr"', 'backend: "trec_floor"', 1)
    assert f'name: "{FLOOR}"' in text and 'backend: "trec_floor"' in text
    params = {"tables": criteo.NUM_TABLES, "slots": criteo.NUM_TABLES}
    for k, v in params.items():
        text += f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
    return "# The floor of benchmarks/bench_criteo.py: dlrm_criteo's I/O, no work.\n" + text


def configure(
    repo: Path, kind: str, instances: int, precision: str, dense_math: str = "fp32"
) -> None:
    """The model's config.pbtxt for ``kind`` x ``instances`` (its GPU GEMMs in
    ``dense_math``) and its ps.json entry for ``kind`` (``gpucache``: the generator's rule
    for that kind, whatever kind the reused files were generated for), and the floor
    beside it."""
    text = criteo.config_pbtxt(MODEL, kind, instances, dense_math)
    (repo / MODEL / "config.pbtxt").write_text(text)
    criteo.merge_ps_json(str(repo / "ps.json"), criteo.ps_entry(MODEL, precision, kind))
    (repo / FLOOR / "1").mkdir(parents=True, exist_ok=True)
    (repo / FLOOR / "config.pbtxt").write_text(floor_config(kind, instances))


# ----------------------------------------------------------------------------- measuring


def input_file(repo: Path, batch: int) -> Path:
    return repo / criteo.perf_file_name(MODEL, batch)


def sanity_check(server: TritonServer, repo: Path, batch: int) -> List[str]:
    """One request of the ``batch`` file through both models; the problems found."""
    from clients.raw_http import Client

    step = json.loads(input_file(repo, batch).read_text())["data"][0]
    inputs = {k: criteo.decode_perf_tensor(k, v)[None, :] for k, v in step.items()}
    problems, client = [], Client(server.http_url, timeout=600)
    try:
        for model in (MODEL, FLOOR):
            try:
                out = client.infer(model, inputs)["OUTPUT0"].reshape(-1)
            except Exception as e:  # noqa: BLE001  (reported, not fatal)
                problems.append(f"{model}: {e}")
                continue
            if out.size != batch:
                problems.append(f"{model}: {out.size} outputs for {batch} samples")
            elif model == FLOOR and np.any(out != 0):
                problems.append(f"{FLOOR}: answers are not zeros")
            elif model == MODEL and not (
                np.all(np.isfinite(out)) and np.all((out > 0) & (out < 1)) and out.std() > 0
            ):
                problems.append(f"{MODEL}: predictions not spread in (0, 1): {out[:4]}")
    finally:
        client.close()
    return problems


def pa_command(model, batch, conc, url, args, data: Path, csv_path: Path, **mode) -> List[str]:
    """perf_analyzer's command: ``mode`` is ``request_count=N`` (the warm-up) or
    ``window_ms=W, stability=S`` (a measurement)."""
    a = ["-m", model, "-u", url, "-i", args.protocol, "-b", "1", "--input-data", str(data)]
    for k, v in criteo.perf_shapes(batch).items():
        a += ["--shape", f"{k}:{v}"]
    a += ["--concurrency-range", str(conc), "-f", str(csv_path)]
    if args.shared_memory != "none":
        a += ["--shared-memory", args.shared_memory]
        a += ["--output-shared-memory-size", str(4 * batch)]
    if "request_count" in mode:
        a += ["--request-count", str(mode["request_count"])]
    else:
        a += ["--measurement-interval", str(mode["window_ms"])]
        a += [
            "--stability-percentage",
            str(mode["stability"]),
            "--max-trials",
            str(args.max_trials),
        ]
    return perf_analyzer.command(a)


def run_pa(cmd: List[str], csv_path: Path, log_path: Path, timeout: float) -> Dict:
    """One perf_analyzer run: its figures, or ``status`` failed with the reason."""
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=perf_analyzer.environment()
        )
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timeout after {timeout:.0f} s"}
    text = done.stdout + done.stderr
    log_path.write_text(" ".join(cmd) + "\n\n" + text)
    rec: Dict = {"wall_s": round(time.monotonic() - t0, 1)}
    if done.returncode != 0 or not csv_path.exists():
        lines = [ln.strip() for ln in text.splitlines() if "rror" in ln or "stable" in ln]
        reason = (lines[0] if lines else f"perf_analyzer exit {done.returncode}")[:300]
        unstable = "failed to obtain stable measurement" in text.lower()
        return dict(rec, status="failed", reason=reason, unstable=unstable)
    r = bench_perf_analyzer.parse_csv(csv_path)
    r.update(bench_perf_analyzer.parse_stdout(done.stdout))
    m = re.findall(r"Request count: (\d+)", done.stdout)
    rec.update(
        status="ok",
        infer_per_s=r["infer_per_s"],
        avg_us=r.get("avg_us"),
        p50_us=r["p50_us"],
        p90_us=r["p90_us"],
        p99_us=r["p99_us"],
        server_queue_us=r["server_queue_us"],
        server_compute_us=r["server_input_us"] + r["server_infer_us"] + r["server_output_us"],
        requests_per_execution=r.get("requests_per_execution"),
        requests=int(m[-1]) if m else None,
    )
    return rec


def measure(model, batch, conc, server, repo, args, logs: Path, warm_us: float) -> Dict:
    """One (model, batch, concurrency) measurement, retried once without the stability
    check (flagged ``unstable``) when perf_analyzer found the windows unstable."""
    url = server.grpc_url if args.protocol == "grpc" else server.http_url
    window_ms = int(max(args.window_ms, math.ceil(args.min_requests * warm_us / 1000)))
    rec = {"model": model, "role": "floor" if model == FLOOR else "model"}
    rec.update(batch=batch, concurrency=conc, window_ms=window_ms)
    rec["loadavg_1m"] = round(os.getloadavg()[0], 2)
    timeout = 120 + 3 * (args.max_trials + 1) * window_ms / 1000
    for attempt, stability in enumerate((args.stability, 1000)):
        tag = f"{model}_b{batch}_c{conc}" + ("_retry" if attempt else "")
        csv_path = logs / f"{tag}.csv"
        cmd = pa_command(
            model, batch, conc, url, args, input_file(repo, batch), csv_path,
            window_ms=window_ms, stability=stability,
        )  # fmt: skip
        rec["command"] = "perf_analyzer " + shlex.join(cmd[1:]).replace(str(repo), "REPO").replace(
            str(logs), "LOGS"
        )
        res = run_pa(cmd, csv_path, logs / f"{tag}.log", timeout)
        if res["status"] == "ok" or not res.pop("unstable", False) or attempt:
            rec.update(res)
            if res["status"] == "ok":
                rec["samples_per_s"] = res["infer_per_s"] * batch
                rec["status"] = "unstable" if attempt else "ok"
            return rec
    return rec  # unreachable


def warm_up(model, batch, server, repo, args, logs: Path) -> Dict:
    """Every request of the batch's file once through ``model`` (c=1); its latency."""
    url = server.grpc_url if args.protocol == "grpc" else server.http_url
    csv_path = logs / f"{model}_b{batch}_warmup.csv"
    cmd = pa_command(
        model, batch, 1, url, args, input_file(repo, batch), csv_path,
        request_count=args.perf_requests,
    )  # fmt: skip
    res = run_pa(cmd, csv_path, logs / f"{model}_b{batch}_warmup.log", 600)
    res.pop("unstable", None)
    return res


class InProcessNetwork:
    """The served model's network run in this process by the same native executor
    (:meth:`HugeCTRNetwork.native_net` of :meth:`HugeCTRNetwork.shared`'s network, as the
    server makes it, with the server's thread rule: ``TRITON_REC_DENSE_THREADS``, by
    default every usable core) on inputs of a
    request's shapes: the baseline of issue 35's "served batch 64 p50 <= the network's
    in-process time + 150 us", timed right before and after the served window it is
    compared with."""

    #: each side of a window: calls until this much time or this many calls (at least 3)
    SECONDS, CALLS = 1.0, 400

    def __init__(self, repo: Path):
        from triton_rec.dense.hugectr_network import HugeCTRNetwork

        version = repo / MODEL / "1"
        self.network = HugeCTRNetwork.shared(
            str(version / f"{MODEL}.json"), str(version / f"{MODEL}_dense_0.model")
        )
        self.net = self.network.native_net()
        self.times: Dict[int, List[float]] = {}
        self.inputs: Dict[int, tuple] = {}  # per batch: the same inputs on both sides

    def time(self, batch: int) -> None:
        """One side of a window: calls of ``batch`` samples, their times kept."""
        if batch not in self.inputs:
            rng = np.random.default_rng(batch)
            self.inputs[batch] = (
                rng.standard_normal((batch, self.network.dense_dim)).astype(np.float32),
                [
                    rng.standard_normal((batch, int(t.slot_num), int(t.vec_size))).astype(
                        np.float32
                    )
                    for t in self.network.tables
                ],
            )
        dense, embs = self.inputs[batch]
        self.net.predict(dense, embs)  # warm
        out = self.times.setdefault(batch, [])
        t_end = time.perf_counter() + self.SECONDS
        for i in range(self.CALLS):
            t0 = time.perf_counter()
            self.net.predict(dense, embs)
            out.append((time.perf_counter() - t0) * 1e6)
            if i >= 2 and t0 > t_end:
                break

    def summary(self, batch: int) -> Dict:
        t = np.asarray(self.times.get(batch, []))
        return {
            "calls": int(t.size),
            "threads": int(self.net.threads),
            "p50_us": round(float(np.median(t)), 1),
            "best_us": round(float(t.min()), 1),
        }


def categorize(path: str, repo: str, store: str) -> str:
    if not path:
        return "anonymous"
    if path.startswith(store + os.sep):
        return "node_store"
    if path.startswith(repo + os.sep):
        return "repository"
    if path.startswith("/dev/shm/"):
        return "dev_shm"
    if ".so" in os.path.basename(path):
        return "libraries"
    return "other_files"


def memory(pid: int, repo: str, store: str) -> Dict:
    """The server process's memory (bytes): PSS, RSS, peak RSS and PSS by mapping kind."""
    rollup = smaps_rollup(pid)
    kinds: Dict[str, int] = {}
    for path, pss in pss_by_mapping(pid).items():
        k = categorize(path, repo, store)
        kinds[k] = kinds.get(k, 0) + pss
    with open(f"/proc/{pid}/status") as f:
        hwm = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:")), None)
    return {
        "pss_bytes": rollup.get("Pss"),
        "rss_bytes": rollup.get("Rss"),
        "vm_hwm_bytes": hwm,
        "pss_by_kind_bytes": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
    }


def gpu_memory_mib(pid: int) -> Optional[float]:
    """Device memory the process holds (nvidia-smi), None where it cannot tell."""
    lines = nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    used = [float(b) for a, b in (ln.split(",") for ln in lines or () if "," in ln)
            if int(a) == pid]  # fmt: skip
    return sum(used) if used else None


def run_kind(kind: str, gen: Dict, batches, concs, args) -> Dict:
    """One server of ``kind``: the sweep, the ratios and the memory; the JSON document."""
    repo, store = Path(gen["repo"]), gen["store"]
    logs = Path(args.work).resolve() / "logs" / kind.lower()
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    configure(repo, kind, args.instances, args.precision, dense_math_of(args, kind))
    server = TritonServer(
        repo,
        explicit=True,
        load_models=[MODEL, FLOOR],
        log_path=logs / "server.log",
        env={"TRITON_REC_STORE": store},
        request_path="native",
    )
    blas = {k: server.environment().get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    # the network in-process beside the served c=1 windows of the host (--inprocess-max)
    inproc = InProcessNetwork(repo) if kind == "KIND_CPU" and args.inprocess_max else None
    rows: List[Dict] = []
    warm: Dict = {}
    doc: Dict = {"kind": kind, "server_blas_env": blas}
    t0 = time.monotonic()
    try:
        server.start(timeout=1800)
        doc["server_start_s"] = round(time.monotonic() - t0, 1)
        print(f"{kind}: server ready in {doc['server_start_s']} s", flush=True)
        pid = server.process.pid
        doc["memory_after_start"] = memory(pid, str(repo), store)
        doc["sanity_problems"] = sanity_check(server, repo, min(batches))
        print(f"{kind}: sanity check", doc["sanity_problems"] or "ok", flush=True)
        for i, batch in enumerate(batches):
            for model in (MODEL, FLOOR):
                w = warm_up(model, batch, server, repo, args, logs)
                warm[f"{model}/{batch}"] = w
                if w["status"] != "ok":
                    print(f"  warm-up {model} b={batch} failed: {w.get('reason')}", flush=True)
            for j, conc in enumerate(concs):
                order = (FLOOR, MODEL) if (i + j) % 2 == 0 else (MODEL, FLOOR)
                for model in order:
                    lat = warm.get(f"{model}/{batch}", {}).get("avg_us") or 0.0
                    beside = (
                        inproc is not None and model == MODEL and conc == 1
                        and batch <= args.inprocess_max
                    )  # fmt: skip
                    if beside:
                        inproc.time(batch)
                    rec = measure(model, batch, conc, server, repo, args, logs, lat)
                    if beside:
                        inproc.time(batch)
                        rec["inprocess_network"] = inproc.summary(batch)
                        if rec.get("p50_us"):
                            rec["served_p50_minus_inprocess_us"] = round(
                                rec["p50_us"] - rec["inprocess_network"]["p50_us"], 1
                            )
                    rows.append(rec)
                    print(row_line(kind, rec), flush=True)
            m = memory(pid, str(repo), store)  # what this batch size left resident
            doc.setdefault("memory_after_batch", {})[str(batch)] = {
                "pss_bytes": m["pss_bytes"],
                "anonymous_pss_bytes": m["pss_by_kind_bytes"].get("anonymous", 0),
                "vm_hwm_bytes": m["vm_hwm_bytes"],
            }
        doc["memory"] = memory(pid, str(repo), store)
        doc["tables"] = table_counters(server)
        print(f"{kind}: {table_summary(doc['tables'])}", flush=True)
        if kind == "KIND_GPU":
            doc["memory"]["gpu_memory_mib"] = gpu_memory_mib(pid)
    finally:
        server.stop()
    doc["warmup"] = warm
    doc["rows"] = rows
    doc["ratios"] = ratios(rows)
    return doc


#: the server's per-table counters kept in the JSON (triton_rec/triton/metrics.py), and how
#: each is named there
TABLE_COUNTERS = {
    "lookups": "trec_cache_lookups_total",
    "hits": "trec_cache_hits_total",
    "misses": "trec_cache_misses_total",
    "sync_fetched": "trec_cache_sync_fetched_total",
    "default_answered": "trec_cache_default_answered_total",
    "not_found": "trec_cache_default_not_found_total",
    "cache_bytes": "trec_cache_bytes",
    "duration_us": "trec_lookup_duration_us_total",
}


def table_counters(server: TritonServer) -> Dict[str, Dict[str, float]]:
    """The model's tables as the server counted them over the whole run (warm-ups and the
    sweep): keys looked up, hits, misses and what answered them, and each table's cache
    bytes (``memory`` label: where it lives). Read from the metrics endpoint after the
    instances' next publication."""
    import urllib.request

    time.sleep(2.5)  # the instances publish every second (metrics_interval)
    return parse_table_counters(urllib.request.urlopen(server.metrics_url, timeout=10).read())


def parse_table_counters(metrics: bytes) -> Dict[str, Dict[str, float]]:
    """:func:`table_counters` from the text of the metrics endpoint."""
    text = metrics.decode()
    names = {v: k for k, v in TABLE_COUNTERS.items()}
    out: Dict[str, Dict[str, float]] = {}
    for line in text.splitlines():
        m = re.match(r"(\w+)\{([^}]*)\} (\S+)$", line)
        if not m or m.group(1) not in names:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("model") != MODEL or "table" not in labels:
            continue
        entry = out.setdefault(labels["table"], {})
        key = names[m.group(1)]
        if key == "duration_us":  # by tier: the cache's time, the host table's (local)
            key = f"{labels.get('tier', '?')}_us"
        entry[key] = float(m.group(3))
        if "memory" in labels:
            entry["memory"] = labels["memory"]
    return out


def table_summary(tables: Dict[str, Dict[str, float]]) -> str:
    """One line: keys looked up, the share that missed, how the misses were answered."""
    total = {
        k: sum(t.get(k, 0.0) for t in tables.values())
        for k in list(TABLE_COUNTERS) + ["cache_us", "local_us"]
    }
    if not total["lookups"]:
        return f"{len(tables)} tables, no lookup counted"
    if not any("cache_bytes" in t for t in tables.values()):
        return f"{len(tables)} tables, {total['lookups']:,.0f} keys read from the mapped tables"
    return (
        f"{len(tables)} tables, {total['lookups']:,.0f} keys looked up, "
        f"{total['misses'] / total['lookups']:.2%} missed ({total['sync_fetched']:,.0f} fetched "
        f"from the host table, {total['default_answered']:,.0f} answered with the default, "
        f"{total['not_found']:,.0f} in no table); {total['cache_us'] / 1e6:.2f} s in the "
        f"caches, {total['local_us'] / 1e6:.2f} s in the host tables"
    )


def ratios(rows: List[Dict]) -> List[Dict]:
    """model / floor per (batch, concurrency), from the same run: samples/s, p50, p99."""
    ok = {(r["role"], r["batch"], r["concurrency"]): r for r in rows if "samples_per_s" in r}
    out = []
    for (role, batch, conc), m in ok.items():
        f = ok.get(("floor", batch, conc))
        if role != "model" or f is None:
            continue
        rec = {"batch": batch, "concurrency": conc, "floor_model": f["model"]}
        for k in ("samples_per_s", "p50_us", "p99_us"):
            rec[k] = m[k] / f[k] if f.get(k) else None
        m["vs_floor"] = rec["samples_per_s"]
        out.append(rec)
    return sorted(out, key=lambda r: (r["batch"], r["concurrency"]))


# ----------------------------------------------------------------------------- reporting


def fmt(v, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def fmt_ratio(v) -> str:
    """A ratio to 3 significant digits (0.0196, 0.000147, 1.02)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3g}" if v >= 1e-4 else f"{v:.2e}"


def row_line(kind: str, r: Dict) -> str:
    tail = f" {r.get('reason', '')}" if r["status"] == "failed" else ""
    return (
        f"  {kind} {r['model']:12s} b={r['batch']:<6d} c={r['concurrency']} {r['status']:8s} "
        f"{fmt(r.get('samples_per_s')):>11s} samples/s p50 {fmt(r.get('p50_us')):>9s} us "
        f"p99 {fmt(r.get('p99_us')):>9s} us ({r.get('requests')} requests measured, "
        f"{r['window_ms']} ms windows, load {r['loadavg_1m']}){tail}"
    )


def table_md(doc: Dict) -> str:
    """The kind's table: ours, the floor, the ratio, NVIDIA's figures at c=1."""
    m = doc["machine"]
    ours = f"{m['cpu_model']} x {m['nproc']} CPUs" + (
        f", {doc['gpus'][0]}" if doc["kind"] == "KIND_GPU" and doc["gpus"] else ""
    )
    ref = NVIDIA_HPS_TRT
    lines = [
        f"### {doc['kind']}, scale {doc['scale']:g} ({sum(doc['model']['rows']):,} rows, "
        f"{doc['model']['tables_bytes'] / 1e6:,.0f} MB of {doc['precision']} tables), "
        f"{doc['instances']} instance(s), {doc['settings']['protocol']}, shared memory "
        f"{doc['settings']['shared_memory']}",
        "",
        f"Ours: {ours}; load average {m['loadavg']} at the start, {doc['loadavg_end']} at the end.",
        f"NVIDIA: {ref['hardware']}; {ref['setup']}.",
        "",
        "| batch | c | samples/s | p50 us | p99 us | floor samples/s | floor p50 us | "
        "model/floor | NVIDIA samples/s | NVIDIA p50 us | NVIDIA p99 us | ours/NVIDIA |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r["role"], r["batch"], r["concurrency"]): r for r in doc["rows"]}
    for (role, batch, conc), r in sorted(by.items(), key=lambda kv: kv[0][1:]):
        if role != "model":
            continue
        f = by.get(("floor", batch, conc), {})
        nv = ref["rows"].get(batch) if conc == 1 else None
        vs_nv = r["samples_per_s"] / nv[0] if nv and r.get("samples_per_s") else None
        flag = "" if r["status"] == "ok" else f" ({r['status']})"
        lines.append(
            f"| {batch:,} | {conc} | {fmt(r.get('samples_per_s'))}{flag} | {fmt(r.get('p50_us'))} "
            f"| {fmt(r.get('p99_us'))} | {fmt(f.get('samples_per_s'))} | {fmt(f.get('p50_us'))} "
            f"| {fmt_ratio(r.get('vs_floor'))} | {fmt(nv[0]) if nv else '-'} "
            f"| {fmt(nv[1]) if nv else '-'} | {fmt(nv[2]) if nv else '-'} | {fmt_ratio(vs_nv)} |"
        )
    mem = doc.get("memory") or {}
    if mem.get("pss_bytes"):
        kinds = ", ".join(f"{k} {v / 2**20:,.0f}" for k, v in mem["pss_by_kind_bytes"].items())
        t = doc["pss_target"]
        start = (doc.get("memory_after_start") or {}).get("pss_bytes") or 0
        lines += [
            "",
            f"Server PSS, {doc['instances']} instance(s): {start / 2**20:,.0f} MiB after start, "
            f"{mem['pss_bytes'] / 2**20:,.0f} MiB after the sweep ({kinds}; peak RSS "
            f"{mem['vm_hwm_bytes'] / 2**20:,.0f} MiB, a page counted once per mapping of it). "
            f"Tables {t['tables_bytes'] / 2**20:,.0f} "
            f"MiB + dense weights {t['dense_bytes'] / 2**20:,.1f} MiB + 60 MiB = "
            f"{t['target_bytes'] / 2**20:,.0f} MiB: "
            + ("within" if t["within"] else "over")
            + f" (the target is stated for {PSS_TARGET_INSTANCES} instances).",
        ]
    return "\n".join(lines) + "\n"


def dense_math_of(args, kind: str) -> str:
    """The GEMMs' arithmetic of ``kind``'s model: ``--dense-math`` on a GPU, fp32 on the host
    (config.pbtxt ``dense_math`` is for KIND_GPU instances)."""
    return args.dense_math if kind == "KIND_GPU" else "fp32"


def data_path(args, kind: str, tag: str) -> Path:
    if args.json and args.kind != "both":
        return Path(args.json)
    more = f"_{args.instances}instances" if args.instances != 1 else ""
    if dense_math_of(args, kind) != "fp32":
        more += f"_{args.dense_math}"
    return Path(args.data_dir) / f"criteo_{kind.split('_')[1].lower()}_{tag}{more}.json"


def preflight() -> Optional[str]:
    """Why the floor or perf_analyzer cannot run here, or None."""
    from triton_rec.triton.runtime import benchmark_backend_library

    if benchmark_backend_library("trec_floor") is None:
        return (
            "the native floor backend (trec_floor) is built only in a checkout: "
            "pip install -e . (or make install) there"
        )
    try:
        done = subprocess.run(
            perf_analyzer.command(["--version"]),
            capture_output=True,
            text=True,
            timeout=60,
            env=perf_analyzer.environment(),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if done.returncode != 0:
        return (done.stdout + done.stderr).strip()[-500:]
    return None


def source_info() -> Dict:
    """What code served: the checkout's commit and its uncommitted source files, whether
    ``triton_rec`` was imported from this checkout, and a digest of its native module."""
    import hashlib

    import triton_rec

    def git(*a: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "src", "triton_rec", "backend", "ps_loader")
    pkg = Path(triton_rec.__file__).resolve()
    native = next(iter(sorted(pkg.parent.glob("_native*.so"))), None)
    if native is None:  # an editable install: the package beside the built module
        import triton_rec._native as mod

        native = Path(mod.__file__)
    return {
        "git_commit": (git("rev-parse", "HEAD") or "").strip() or None,
        "git_modified_sources": [ln[3:] for ln in (status or "").splitlines()],
        "triton_rec_from_this_checkout": ROOT in pkg.parents,
        "native_module_sha256": hashlib.sha256(native.read_bytes()).hexdigest()[:16],
    }


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scale", type=float, required=True, help="the tables' scale, in (0, 1]")
    p.add_argument("--kind", default="KIND_CPU", choices=[*KINDS, "both"])
    p.add_argument("--batch-sizes", type=_ints, default=list(criteo.DEFAULT_BATCH_SIZES))
    p.add_argument("--concurrency", type=_ints, default=[1, 2])
    p.add_argument("--instances", type=int, default=1, help="instances of each model")
    p.add_argument(
        "--dense-math",
        default="fp32",
        choices=DENSE_MATHS,
        help="the KIND_GPU model's GEMMs (config.pbtxt dense_math; KIND_CPU: fp32)",
    )
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "int8"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-rows", type=int, default=criteo.DEFAULT_MIN_ROWS)
    p.add_argument("--perf-requests", type=int, default=4, help="distinct requests per file")
    p.add_argument("--protocol", default="grpc", choices=["grpc", "http"])
    p.add_argument("--shared-memory", default="system", choices=["system", "none"])
    p.add_argument("--window-ms", type=int, default=1000, help="perf_analyzer's time window")
    p.add_argument(
        "--min-requests",
        type=int,
        default=3,
        help="a window is made long enough for this many requests at the warm-up's latency",
    )
    p.add_argument("--stability", type=int, default=50, help="perf_analyzer -s (percent)")
    p.add_argument("--max-trials", type=int, default=4, help="perf_analyzer -r")
    p.add_argument(
        "--work",
        default=os.path.join(tempfile.gettempdir(), "triton-rec-bench-criteo"),
        help="where the model is generated (and reused), the logs written",
    )
    p.add_argument(
        "--inprocess-max", type=int, default=4096,
        help="KIND_CPU: time the network in this process right before and after each served "
        "c=1 window of at most this many samples (0: never)",
    )  # fmt: skip
    p.add_argument("--data-dir", default=str(ROOT / "benchmarks" / "data"))
    p.add_argument("--json", default=None, help="the JSON file (one --kind only)")
    p.add_argument("--note", default=None, help="a remark recorded in the JSON")
    args = p.parse_args(argv)
    problem = criteo.argument_problem(args.scale, args.min_rows, args.batch_sizes, "KIND_CPU")
    if problem or not args.batch_sizes or not args.concurrency or args.instances < 1:
        p.error(problem or "--batch-sizes, --concurrency and --instances must not be empty / 0")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    why = preflight()
    if why:
        print(f"cannot measure here: {why}", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    info, gpu_list = machine_info(), gpus()
    tag = machine_tag(info, gpu_list)
    print(f"machine: {tag} {info} {gpu_list}", flush=True)
    batches, concs = sorted(set(args.batch_sizes)), sorted(set(args.concurrency))
    gen = generate(args, batches)
    source = source_info()
    kinds = ["KIND_GPU", "KIND_CPU"] if args.kind == "both" else [args.kind]
    status, out = 0, []
    for kind in kinds:
        t0 = time.monotonic()
        doc = {
            "benchmark": "bench_criteo",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": "python benchmarks/bench_criteo.py " + shlex.join(argv),
            "argv": argv,
            "machine": info,
            "machine_tag": tag,
            "gpus": gpu_list,
            "note": args.note,
            "source": source,
            "blas_env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")},
            "scale": args.scale,
            "precision": args.precision,
            "instances": args.instances,
            "model": {
                k: gen[k]
                for k in ("rows", "tables_bytes", "dense_bytes", "command", "seconds", "reused")
            },
            "settings": {
                "batch_sizes": batches,
                "concurrency": concs,
                "protocol": args.protocol,
                "shared_memory": args.shared_memory,
                "window_ms": args.window_ms,
                "min_requests": args.min_requests,
                "stability_percentage": args.stability,
                "max_trials": args.max_trials,
                "perf_requests": args.perf_requests,
                "seed": args.seed,
                "min_rows": args.min_rows,
                "request_path": "native",
                "dense_math": dense_math_of(args, kind),
            },
            "floor": {"model": FLOOR, "config": floor_config(kind, args.instances)},
            "reference": {**NVIDIA_HPS_TRT, "rows": {str(k): v for k, v in
                                                    NVIDIA_HPS_TRT["rows"].items()}},
        }  # fmt: skip
        doc.update(run_kind(kind, gen, batches, concs, args))
        target = gen["tables_bytes"] + gen["dense_bytes"] + PSS_SLACK_BYTES
        pss = (doc.get("memory") or {}).get("pss_bytes")
        doc["pss_target"] = {
            "tables_bytes": gen["tables_bytes"],
            "dense_bytes": gen["dense_bytes"],
            "slack_bytes": PSS_SLACK_BYTES,
            "target_bytes": target,
            "target_instances": PSS_TARGET_INSTANCES,
            "instances": args.instances,
            "within": pss is not None and pss <= target,
        }
        doc["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        doc["wall_s"] = round(time.monotonic() - t0, 1)
        path = data_path(args, kind, tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        out.append((doc, path))
        bad = doc["sanity_problems"] or any(r["status"] == "failed" for r in doc["rows"])
        status = status or (1 if bad else 0)
    print()
    for doc, path in out:
        print(table_md(doc))
        print(f"raw results: {path}\n")
    print(
        f"total {time.monotonic() - t_start:.0f} s; model and logs in {Path(args.work).resolve()}"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
