#!/usr/bin/env python3
"""Reloads without memory growth (issue 24): unload/load cycles of models through the
repository API while other models serve, and tritonserver's anonymous memory (RssAnon).

The demo repository (``make demo``): ``--cycle`` models (default ``hps_demo,dlrm``) are
unloaded and loaded again ``--cycles`` times while one client sends requests to
``--serve`` (default ``hps_wdl``) and checks each answer against the first one. RssAnon
of the server is sampled every ``--every`` cycles; the figure is its growth from the end
of the warm-up (``--warmup`` cycles) to the last cycle, and the least-squares slope per
cycle over the samples. The same cycles of a model served by the native floor backend
(``trec_floor``: Triton alone, no work) give the floor: what Triton's own model life
cycle keeps.

    python benchmarks/bench_reload.py [--cycles 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import datetime, timezone

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_info, process_memory_kb  # noqa: E402

from clients.raw_http import Client  # noqa: E402
from triton_rec.triton.runtime import TritonServer  # noqa: E402

DEMO = os.path.join(ROOT, "model_repository")
FLOOR_CONFIG = """name: "floor_cycle"
backend: "trec_floor"
max_batch_size: 1024
input [
  { name: "KEYS" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },
  { name: "NUMKEYS" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
parameters { key: "vec_sizes" value: { string_value: "8" } }
"""


def _post(url: str) -> None:
    req = urllib.request.Request(url, data=b"", method="POST")
    urllib.request.urlopen(req, timeout=300).close()


class ServeLoad(threading.Thread):
    """Requests to one model, back to back, each answer compared with the first."""

    def __init__(self, srv: TritonServer, model: str):
        super().__init__(daemon=True)
        self.srv, self.model = srv, model
        self.done, self.answered, self.errors = threading.Event(), 0, []

    def run(self) -> None:
        keys = np.arange(1, 29, dtype=np.int64)[None, :]
        inputs = {"KEYS": keys, "NUMKEYS": np.array([[2, 26]], np.int32)}
        c = Client(self.srv.http_url)
        first = None
        while not self.done.is_set():
            try:
                out = c.infer(self.model, inputs)["OUTPUT0"]
            except Exception as e:  # noqa: BLE001 - every failure is reported
                self.errors.append(repr(e)[:300])
                continue
            first = out if first is None else first
            if not np.array_equal(out, first):
                self.errors.append("a different answer")
            self.answered += 1
        c.close()


def wait_unloaded(srv: TritonServer, model: str, timeout: float = 60.0) -> None:
    """Until the repository index no longer has ``model`` loaded or unloading. Triton's
    unload request is answered as soon as the unload starts (tritonserver.h:
    TRITONSERVER_ServerUnloadModel "does not wait for the requested model to be fully
    unload"; src/http_server.cc replies right after calling it), and a load of the same
    model while its instances still finalize is the overlap Triton's own tracker has
    crashes for (triton-inference-server/server issues 4924, 6223): a cycle is an unload
    that finished, then a load."""
    deadline = time.monotonic() + timeout
    while True:
        states = {e.get("state") for e in srv.model_index() if e.get("name") == model}
        if not states & {"READY", "UNLOADING", "LOADING"}:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model} still {sorted(states)} {timeout:.0f} s after its unload")
        time.sleep(0.002)


#: how long a cycle leaves a model loaded before it unloads it. Triton 2.51 crashes
#: (SIGSEGV in TritonBackendThread::StopBackendThread, seen here about once in 20,000
#: immediate cycles, core dump in benchmarks/history/2026-11-28-reload-cycles.md) when an
#: instance is destroyed while its backend thread still pushes the instance back onto its
#: list after the warm-up payload that ended the load: core src/backend_model_instance.cc,
#: BackendThread's ``model_instances_.push_back`` after ``payload->Execute`` against
#: StopBackendThread's unlocked ``model_instances_.back()``. Any model, any backend; the
#: wait leaves the thread the time to finish.
SETTLE_S = 0.01


def cycle(srv: TritonServer, models, cycles: int, every: int) -> dict:
    """``cycles`` unload/load cycles of ``models``; RssAnon samples {cycle: kB}. Each
    load is left :data:`SETTLE_S` before the next unload."""
    samples = {}
    for i in range(cycles + 1):
        if i % every == 0:
            samples[i] = process_memory_kb(srv.process.pid, "RssAnon")
        if i == cycles:
            break
        for m in models:
            base = f"http://{srv.http_url}/v2/repository/models/{m}"
            _post(base + "/unload")
            wait_unloaded(srv, m)
            _post(base + "/load")
        time.sleep(SETTLE_S)
    return samples


def summarize(samples: dict, warmup: int) -> dict:
    xs = np.array([c for c in samples if c >= warmup], dtype=float)
    ys = np.array([samples[int(c)] for c in xs], dtype=float)
    slope = float(np.polyfit(xs, ys, 1)[0]) if len(xs) > 1 else 0.0
    return {
        "growth_kb": int(ys[-1] - ys[0]),
        "slope_kb_per_cycle": round(slope, 3),
        "samples_kb": {int(c): int(v) for c, v in samples.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument(
        "--floor-cycles",
        type=int,
        default=None,
        help="the floor model's cycles (default: --cycles)",
    )
    ap.add_argument("--cycle", default="hps_demo,dlrm", help="models to unload and load")
    ap.add_argument("--serve", default="hps_wdl", help="model served meanwhile")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    models = args.cycle.split(",")
    tmp = tempfile.mkdtemp(prefix="trec-reload-")
    repo = os.path.join(tmp, "repo")
    shutil.copytree(DEMO, repo, symlinks=True)
    os.makedirs(os.path.join(repo, "floor_cycle", "1"))
    with open(os.path.join(repo, "floor_cycle", "config.pbtxt"), "w") as f:
        f.write(FLOOR_CONFIG)
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": "python benchmarks/bench_reload.py " + " ".join(argv or sys.argv[1:]),
        "settings": vars(args),
    }
    env = {"TRITON_REC_STORE": os.path.join(tmp, "store")}
    env.update(json.loads(os.environ.get("BENCH_RELOAD_ENV", "{}")))  # e.g. malloc settings
    srv = TritonServer(
        repo,
        explicit=True,
        load_models=models + [args.serve, "floor_cycle"],
        log_path=os.path.join(tmp, "server.log"),
        env=env,
    )
    with srv:
        load = ServeLoad(srv, args.serve)
        load.start()
        try:
            t0 = time.monotonic()
            floor_cycles = args.cycles if args.floor_cycles is None else args.floor_cycles
            floor = cycle(srv, ["floor_cycle"], floor_cycles, args.every)
            t1 = time.monotonic()
            ours = cycle(srv, models, args.cycles, args.every)
            t2 = time.monotonic()
        finally:  # also when a cycle fails: else the load runs on against a stopped server
            load.done.set()
            load.join(30)
    floor_warmup = min(args.warmup, max(floor) // 2)
    report["floor"] = dict(summarize(floor, floor_warmup), seconds=round(t1 - t0, 1))
    report["models"] = dict(summarize(ours, args.warmup), seconds=round(t2 - t1, 1))
    report["served"] = {"model": args.serve, "answered": load.answered, "errors": load.errors[:20]}
    for k in ("floor", "models"):
        r = report[k]
        print(
            f"{k:7s} {args.cycles} cycles: RssAnon {r['growth_kb']:+d} kB after the warm-up "
            f"({r['slope_kb_per_cycle']:+.2f} kB/cycle), {r['seconds']} s",
            flush=True,
        )
    print(f"served {args.serve}: {load.answered} answers, {len(load.errors)} errors", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if load.errors else 0


if __name__ == "__main__":
    sys.exit(main())
