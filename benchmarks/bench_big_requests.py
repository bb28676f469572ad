#!/usr/bin/env python3
"""What oversized requests cost the server before they are refused (issue 24).

Triton 2.51 has no request-size limit of its own (no ``--http-max-input-size``, gRPC
messages up to 2 GB: docs/upstream-notes.md, "Stopping tritonserver 2.51"): a request is
received whole before a backend sees it, and this project's backends refuse what exceeds
a model's largest valid request from its shape (docs/operations.md, "Request limits").
This measures the memory in between: ``--concurrent`` clients each send one request whose
``KEYS`` hold ``--mb`` MB to the demo ``hps_demo`` (gRPC, then HTTP with binary tensors),
all at once; tritonserver's resident memory (RSS) is sampled every 20 ms. Reported: RSS
before, the peak, and RSS ``--settle`` seconds after the last answer; every request must
be refused naming the input, and a good request answered afterwards.

    python benchmarks/bench_big_requests.py [--mb 400] [--concurrent 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from machine import machine_info, process_memory_kb  # noqa: E402

from triton_rec.triton.runtime import TritonServer  # noqa: E402


class Sampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, process_memory_kb(self.pid))
            time.sleep(0.02)


def send(protocol: str, url: str, keys: np.ndarray, out: list) -> None:
    """One oversized request (every key in the first table); appends its error message
    (or "answered")."""
    from clients.hps_client import lookup

    try:
        lookup(url, "hps_demo", [keys, keys[:0]], protocol=protocol, timeout=300)
        out.append("answered")
    except Exception as e:  # noqa: BLE001 - the refusal is the expected outcome
        out.append(str(e)[:300])


def round_of(srv: TritonServer, protocol: str, mb: int, concurrent: int, settle: float) -> dict:
    pid = srv.process.pid
    url = srv.grpc_url if protocol == "grpc" else srv.http_url
    keys = np.ones(mb * 1024 * 1024 // 8, np.int64)
    before = process_memory_kb(pid)
    sampler = Sampler(pid)
    sampler.start()
    outcomes: list = []
    threads = [
        threading.Thread(target=send, args=(protocol, url, keys, outcomes))
        for _ in range(concurrent)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - t0
    time.sleep(settle)
    sampler.done.set()
    sampler.join()
    after = process_memory_kb(pid)
    return {
        "protocol": protocol,
        "rss_before_mb": round(before / 1024),
        "rss_peak_mb": round(sampler.peak / 1024),
        "peak_over_before_per_request_mb": round((sampler.peak - before) / 1024 / concurrent),
        "rss_after_settle_mb": round(after / 1024),
        "seconds": round(took, 1),
        "outcomes": outcomes,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--settle", type=float, default=15.0)
    ap.add_argument("--protocols", default="grpc,http", help="rounds, in order")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="trec-big-")
    report = {
        "machine": machine_info(),
        "command": "python benchmarks/bench_big_requests.py " + " ".join(argv or sys.argv[1:]),
        "settings": vars(args),
        "rounds": [],
    }
    ok = True
    with TritonServer(
        os.path.join(ROOT, "model_repository"),
        explicit=True,
        load_models=["hps_demo"],
        log_path=os.path.join(tmp, "server.log"),
        env={"TRITON_REC_STORE": os.path.join(tmp, "store")},
    ) as srv:
        for protocol in args.protocols.split(","):
            r = round_of(srv, protocol, args.mb, args.concurrent, args.settle)
            report["rounds"].append(r)
            refused = all("KEYS" in o for o in r["outcomes"])
            ok &= refused and srv.process.poll() is None and srv.is_ready()
            print(
                f"{protocol}: {args.concurrent} x {args.mb} MB at once: RSS {r['rss_before_mb']} MB"
                f" -> peak {r['rss_peak_mb']} MB ({r['peak_over_before_per_request_mb']} MB per "
                f"request) -> {r['rss_after_settle_mb']} MB {args.settle:.0f} s later; "
                f"refused by name: {refused}; {r['seconds']} s",
                flush=True,
            )
        from clients.raw_http import Client  # a good request is answered afterwards

        c = Client(srv.http_url)
        good = c.infer(
            "hps_demo",
            {
                "KEYS": np.arange(5, dtype=np.int64)[None, :],
                "NUMKEYS": np.array([[4, 1]], np.int32),
            },
        )["OUTPUT0"]
        c.close()
        report["good_request_floats"] = int(good.size)
        ok &= good.size == 4 * 64 + 16
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
