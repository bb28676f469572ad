#!/usr/bin/env python3
"""Soak: both backends for a long time at 80% of their measured peak, answers checked.

One tritonserver, supervised as the launcher runs it (a dead instance's model is
reloaded), serves:

- ``soak_hps``: an ``hps`` model, ps.json defaults (cache on) except
  ``hit_rate_threshold: 1.0`` (misses always fetched, so answers are exact), 2 instances;
- ``soak_tiers``: an ``hps`` model with a 3-master Redis Cluster (volatile tier) in front
  of RocksDB (persistent tier), ``on_unavailable: next_tier``, 2 instances;
- ``soak_dlrm``: a ``hugectr`` DLRM (HugeCTR dense file), 2 instances.

Every answer is checked: lookups against the synthetic tables' vectors recomputed from
the keys (exact, unknown keys -> the default value), DLRM predictions against the
trained PyTorch model (|diff| <= 1e-5). First the peak is measured with the same client
(closed loop, ``--workers`` threads, ``--peak-seconds``), then the load runs open-loop
at ``--load`` x that rate for ``--minutes``: the requests are paced by one schedule that
every worker thread takes its next send time from, and the three models take turns.

Midway, after ``--kill-instance-at`` of the run, one instance process of ``soak_hps`` is
SIGKILLed. After ``--kill-redis-at`` one Redis master is SIGKILLed, and after
``--restart-redis-at`` it is restarted (empty: RocksDB answers what it lost). Every
``--sample-seconds`` the script records the RSS and PSS of tritonserver and of every
instance process (``/proc/<pid>/smaps_rollup``), and the requests, failures and wrong
answers of that window.

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--load 0.8] [--workers 4]
        [--out-dir DIR]

Writes ``soak.json`` (every sample, every event, totals) and the server log into
``--out-dir`` (default: a new directory under /tmp, printed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_overhead import DLRM_IO, HPS_IO, _config, bench_dlrm_config  # noqa: E402
from machine import machine_info  # noqa: E402  (benchmarks/ is on sys.path as the script dir)

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model  # noqa: E402
from triton_rec.triton.runtime import TritonServer  # noqa: E402
from triton_rec.util.procfs import smaps_rollup  # noqa: E402

SEED = 71
HPS_TABLE = SyntheticTable(
    "t0", rows=200_000, vec_size=16, max_keys_per_sample=26, default_value=-2.0
)
TIER_TABLE = SyntheticTable(
    "t0", rows=50_000, vec_size=8, max_keys_per_sample=8, default_value=-3.0
)
HPS_SAMPLES = 64
POOL = 48  # distinct requests per model, cycled
UNKNOWN = 4  # keys per hps request that no table holds
DLRM_TOL = 1e-5
MODELS = ("soak_hps", "soak_tiers", "soak_dlrm")

# ----------------------------------------------------------------------------- models


def build(repo: Path, cluster, rocks: Path):
    """Write the three models; returns {model: [(inputs, truth, tolerance)]}."""
    from examples.dlrm import torch_dlrm as td

    rng = np.random.default_rng(SEED)
    # hit_rate_threshold 1.0: misses are always fetched, so every answer must be exact.
    # (With HPS's default 0.9 a batch whose hit rate reaches 0.9 answers its misses with
    # the default value, e.g. after a killed writer's cache set was emptied on repair.)
    hps = dict(write_model(str(repo), "soak_hps", [HPS_TABLE], seed=SEED), hit_rate_threshold=1.0)
    tiers = dict(
        write_model(str(repo), "soak_tiers", [TIER_TABLE], seed=SEED + 1), hit_rate_threshold=1.0
    )
    config = bench_dlrm_config()
    settings = td.TrainSettings(
        seed=SEED, epochs=1, train_rows=16384, eval_rows=2048, batch_size=512
    )
    result, dlrm = td.train_and_export(
        str(repo / "soak_dlrm" / "1"),
        config,
        settings,
        ps_root=str(repo),
        onnx=False,
        name="soak_dlrm",
    )
    # soak_tiers has its own ps.json (tiers are per file); the others keep the node-local store.
    (repo / "ps_tiers.json").write_text(
        json.dumps(
            {
                "supportlonglong": True,
                "volatile_db": {
                    "type": "redis_cluster",
                    "address": cluster.address,
                    "num_partitions": 6,
                    "socket_timeout": 0.5,
                    "connect_timeout": 0.5,
                    "on_unavailable": "next_tier",
                },
                "persistent_db": {"type": "rocks_db", "path": str(rocks)},
                "models": [tiers],
            },
            indent=1,
        )
    )
    (repo / "ps.json").write_text(
        json.dumps({"supportlonglong": True, "models": [hps, dlrm]}, indent=1)
    )
    for name, backend, io in (
        ("soak_hps", "hps", HPS_IO),
        ("soak_tiers", "hps", HPS_IO),
        ("soak_dlrm", "hugectr", DLRM_IO),
    ):
        (repo / name).mkdir(parents=True, exist_ok=True)
        params = {"ps": "../ps_tiers.json"} if name == "soak_tiers" else None
        # the shipped scheduling (2 CPU instances, no queue delay), as bench_overhead's models
        (repo / name / "config.pbtxt").write_text(_config(name, backend, io, params))

    pools = {"soak_hps": [], "soak_tiers": [], "soak_dlrm": []}
    for model, table, seed in (("soak_hps", HPS_TABLE, SEED), ("soak_tiers", TIER_TABLE, SEED + 1)):
        known = table_keys(seed, 0, table.rows)
        p = np.arange(1, len(known) + 1, dtype=np.float64) ** -1.05
        p /= p.sum()
        for _ in range(POOL):
            n = HPS_SAMPLES * table.max_keys_per_sample
            keys = rng.choice(known, size=n, p=p)
            keys[rng.choice(n, UNKNOWN, replace=False)] = rng.integers(2**62, 2**63 - 1, UNKNOWN)
            truth = expected_vectors(seed, 0, keys, table.vec_size)
            truth[keys >= 2**62] = table.default_value
            inputs = [
                ("KEYS", keys[None, :].astype(np.int64), "INT64"),
                ("NUMKEYS", np.array([[n]], np.int32), "INT32"),
            ]
            pools[model].append((inputs, truth.reshape(-1), 0.0))
    data = result.truth.sample(POOL * 16, np.random.default_rng(SEED + 2))
    preds = result.model.predict(data.dense, data.sparse, defaults=[0.0] * len(data.sparse))
    for i in range(POOL):
        a, b = i * 16, i * 16 + 1 + i % 16
        req = data.hugectr_request(a, b)
        inputs = [
            (k, req[k][None, :], dt)
            for k, dt in (("DES", "FP32"), ("CATCOLUMN", "INT64"), ("ROWINDEX", "INT32"))
        ]
        pools["soak_dlrm"].append(
            (inputs, np.asarray(preds[a:b], np.float32).reshape(-1), DLRM_TOL)
        )
    return pools


# ----------------------------------------------------------------------------- load


class Load:
    """Worker threads sending the pooled requests; counts per model, checks every answer."""

    def __init__(self, server: TritonServer, pools, workers: int):
        self.server, self.pools, self.workers = server, pools, workers
        self.lock = threading.Lock()
        self.counts = Counter()  # (model, outcome) -> n; outcome ok | error | wrong
        self.errors = Counter()  # first line of each error message -> n
        self.latencies = []
        self.rate = 0.0  # requests/s; 0 = closed loop
        self.next_send = 0.0
        self.stop_at = 0.0
        self.turn = 0

    def _next(self):
        with self.lock:
            model = MODELS[self.turn % len(MODELS)]
            req = self.pools[model][(self.turn // len(MODELS)) % POOL]
            self.turn += 1
            if self.rate:
                now = time.monotonic()
                self.next_send = max(self.next_send + 1.0 / self.rate, now - 0.5)
                return model, req, self.next_send
            return model, req, 0.0

    def _worker(self):
        import tritonclient.grpc as tc
        from tritonclient.utils import InferenceServerException

        client = tc.InferenceServerClient(self.server.grpc_url)
        out = [tc.InferRequestedOutput("OUTPUT0")]
        try:
            while True:
                model, (inputs, truth, tol), at = self._next()
                wait = at - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if time.monotonic() >= self.stop_at:
                    return
                ins = []
                for name, arr, dt in inputs:
                    i = tc.InferInput(name, list(arr.shape), dt)
                    i.set_data_from_numpy(arr)
                    ins.append(i)
                t0 = time.monotonic()
                try:
                    got = client.infer(model, ins, outputs=out, client_timeout=30).as_numpy(
                        "OUTPUT0"
                    )
                    got = np.asarray(got).reshape(-1)
                    good = got.shape == truth.shape and (
                        np.array_equal(got, truth)
                        if tol == 0
                        else bool(np.max(np.abs(got - truth)) <= tol)
                    )
                    outcome = "ok" if good else "wrong"
                except InferenceServerException as e:
                    outcome = "error"
                    with self.lock:
                        self.errors[f"{model}: {str(e).splitlines()[0][:200]}"] += 1
                dt_ = time.monotonic() - t0
                with self.lock:
                    self.counts[(model, outcome)] += 1
                    if outcome == "ok":
                        self.latencies.append(dt_)
        finally:
            client.close()

    def run(self, seconds: float, rate: float = 0.0):
        """Run for ``seconds`` (closed loop when ``rate`` is 0); returns the threads' run."""
        self.rate, self.next_send = rate, time.monotonic()
        self.stop_at = time.monotonic() + seconds
        threads = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.workers)]
        for t in threads:
            t.start()
        return threads

    def snapshot(self):
        with self.lock:
            return Counter(self.counts), Counter(self.errors), list(self.latencies)


# ----------------------------------------------------------------------------- memory


def memory(pid: int):
    """(RSS, PSS) in MiB of one process, or None when it is gone."""
    try:
        vals = smaps_rollup(pid)
    except OSError:
        return None
    return vals.get("Rss", 0) / 2**20, vals.get("Pss", 0) / 2**20


def sample_memory(server: TritonServer):
    out = {"server": memory(server.process.pid), "instances": {}}
    for model in MODELS:
        out["instances"][model] = [m for m in (memory(p) for p in server.backend_pids(model)) if m]
    return out


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--load", type=float, default=0.8, help="fraction of the measured peak")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--peak-seconds", type=float, default=30.0)
    p.add_argument("--sample-seconds", type=float, default=30.0)
    p.add_argument("--kill-instance-at", type=float, default=0.4)
    p.add_argument("--kill-redis-at", type=float, default=0.6)
    p.add_argument("--restart-redis-at", type=float, default=0.8)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from tests.storage_fixtures import start_redis_cluster

    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="trec-soak-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="trec-soak-work-"))
    repo, rocks, store = work / "repo", work / "rocks", work / "store"
    result = {
        "command": " ".join(["benchmarks/soak.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "samples": [],
        "events": [],
    }
    with start_redis_cluster(3) as cluster:
        t0 = time.monotonic()
        pools = build(repo, cluster, rocks)
        print(f"models written in {time.monotonic() - t0:.1f} s", flush=True)
        server = TritonServer(
            repo,
            log_path=out_dir / "tritonserver.log",
            supervise=True,
            supervisor_log=lambda line: print(f"supervisor: {line}", flush=True),
            env={"TRITON_REC_STORE": str(store)},
        )
        server.start(timeout=300)
        try:
            load = Load(server, pools, args.workers)
            for t in load.run(args.peak_seconds):
                t.join()
            counts, errors, _ = load.snapshot()
            peak = sum(n for (m, o), n in counts.items() if o == "ok") / args.peak_seconds
            bad = {f"{m} {o}": n for (m, o), n in counts.items() if o != "ok"}
            result["peak"] = {
                "requests_per_s": round(peak, 1),
                "not_ok": bad,
                "errors": dict(errors),
            }
            rate = args.load * peak
            print(
                f"peak {peak:.0f} req/s (closed loop, {args.workers} workers); running at "
                f"{rate:.0f} req/s for {args.minutes} min; not ok during peak: {bad}",
                flush=True,
            )

            load = Load(server, pools, args.workers)
            duration = args.minutes * 60
            start = time.monotonic()
            threads = load.run(duration, rate)
            plan = sorted(
                [
                    (args.kill_instance_at * duration, "kill_instance"),
                    (args.kill_redis_at * duration, "kill_redis"),
                    (args.restart_redis_at * duration, "restart_redis"),
                ]
            )
            next_sample, prev = start, Counter()
            while any(t.is_alive() for t in threads):
                now = time.monotonic()
                while plan and now - start >= plan[0][0]:
                    _, what = plan.pop(0)
                    ev = {"t_s": round(now - start, 1), "event": what}
                    if what == "kill_instance":
                        pids = server.backend_pids("soak_hps")
                        if pids:
                            os.kill(pids[0], signal.SIGKILL)
                            ev["pid"] = pids[0]
                    elif what == "kill_redis":
                        cluster.kill(1)
                        ev["port"] = cluster.ports[1]
                    else:
                        cluster.restart(1)
                    result["events"].append(ev)
                    print(f"[{ev['t_s']:7.1f} s] {what} {ev}", flush=True)
                if now >= next_sample:
                    counts, _, _ = load.snapshot()
                    window = counts - prev
                    prev = counts
                    s = {
                        "t_s": round(now - start, 1),
                        "memory": sample_memory(server),
                        "window": {f"{m} {o}": n for (m, o), n in sorted(window.items())},
                    }
                    result["samples"].append(s)
                    mem = s["memory"]
                    inst = sum(r for v in mem["instances"].values() for r, _ in v)
                    print(
                        f"[{s['t_s']:7.1f} s] server RSS {mem['server'][0]:.0f} MiB, instances RSS "
                        f"{inst:.0f} MiB, window {s['window']}",
                        flush=True,
                    )
                    next_sample += args.sample_seconds
                time.sleep(0.2)
            counts, errors, lat = load.snapshot()
        finally:
            server.stop()
    totals = {f"{m} {o}": n for (m, o), n in sorted(counts.items())}
    result.update(
        totals=totals,
        errors=dict(errors.most_common(20)),
        target_rate=round(rate, 1),
        latency_ms={q: round(1000 * float(np.percentile(lat, q)), 2) for q in (50, 99, 99.9)}
        if lat
        else {},
    )
    first, last = (
        result["samples"][1] if len(result["samples"]) > 1 else None,
        result["samples"][-1],
    )
    if first:

        def tot(s, which):
            m = s["memory"]
            return (m["server"][which] if m["server"] else 0) + sum(
                v[which] for vs in m["instances"].values() for v in vs
            )

        result["growth"] = {
            "rss_mib": round(tot(last, 0) - tot(first, 0), 1),
            "pss_mib": round(tot(last, 1) - tot(first, 1), 1),
            "from_sample_s": first["t_s"],
            "to_sample_s": last["t_s"],
        }
    (out_dir / "soak.json").write_text(json.dumps(result, indent=1))
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "peak",
                    "target_rate",
                    "totals",
                    "errors",
                    "latency_ms",
                    "growth",
                    "events",
                )
                if k in result
            },
            indent=1,
        )
    )
    print(f"raw output in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
