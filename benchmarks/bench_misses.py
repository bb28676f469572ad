#!/usr/bin/env python3
"""Served lookups with cache misses against the same table served all-hit (issue 25).

One server, one table (``--rows`` x 16 fp32; 64 samples (``--samples``) x 26 keys per request, the
issue's workload), four models with its inputs and outputs, measured in alternating
rounds at each concurrency with ``benchmarks/loadgen.cpp`` (HTTP keep-alive, binary
tensors; what the server spends per request read from /proc):

- ``floor``: the native floor backend (``trec_floor``): Triton and a C++ backend, no work;
- ``allhit``: ``hps`` with ps.json defaults except ``gpucacheper`` ``--cache``, fed 16
  requests replayed: after the warm-up every key is in the cache (what the
  earlier served figures in benchmarks/history/ measured);
- ``misses``: the same model entry, fed ``--requests`` distinct requests whose keys are
  Zipf(1.05) over the table: a cache smaller than the working set, HPS's hit-rate rules
  (``hit_rate_threshold`` 0.9: a request at or above it gets default answers for its
  misses and queues them for insertion; below it, its misses are fetched and inserted);
- ``nocache``: ``gpucache: false`` (the mapped node-store table), fed the Zipf stream.

Reported per concurrency: infer/s of each, ``misses / allhit`` (issue 25's target:
>= 0.85x), ``allhit / floor`` (>= 0.8x), the server CPU per request, and the cache's hit
rate over the ``misses`` rounds (Triton metrics); then the lookups of the same requests
in-process (:func:`in_process_lookup_us`) beside the server CPU each model spends over the
floor per request: what of the served gap is the lookup itself.

    python benchmarks/bench_misses.py [--concurrency 1,2,8] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_gpu_served import build_loadgen, measure, run_loadgen, write_bodies  # noqa: E402
from machine import machine_info  # noqa: E402

from clients.raw_http import encode_request  # noqa: E402
from ps_loader.synthetic import SyntheticTable, table_keys, write_model  # noqa: E402
from triton_rec.triton.runtime import TritonServer  # noqa: E402

VEC, KEYS_PER_SAMPLE, SAMPLES, ZIPF, SEED = 16, 26, 64, 1.05, 25
MODELS = ("floor", "allhit", "misses", "nocache")
HPS_IO = """input [
  { name: "KEYS" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },
  { name: "NUMKEYS" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 0 }
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def build_repository(repo: Path, rows: int, cache: float) -> None:
    entry = write_model(str(repo), "misses", [SyntheticTable("t0", rows, VEC, KEYS_PER_SAMPLE)])
    entry.update(gpucacheper=cache)
    entries = [entry, dict(entry, model="allhit"), dict(entry, model="nocache", gpucache=False)]
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": entries}))
    for name in MODELS:
        backend = "trec_floor" if name == "floor" else "hps"
        cfg = f'name: "{name}"\nbackend: "{backend}"\nmax_batch_size: 1024\n{HPS_IO}'
        if name == "floor":
            cfg += f'parameters {{ key: "vec_sizes" value: {{ string_value: "{VEC}" }} }}\n'
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(cfg)


def key_stream(pool: np.ndarray, n: int, rng, samples: int = SAMPLES) -> list:
    """n requests' keys: samples x KEYS_PER_SAMPLE Zipf(ZIPF) draws over the table each."""
    ranks = np.arange(1, len(pool) + 1, dtype=np.float64)
    p = ranks**-ZIPF
    p /= p.sum()
    return [
        pool[rng.choice(len(pool), samples * KEYS_PER_SAMPLE, p=p)].astype(np.int64)
        for _ in range(n)
    ]


def bodies(requests: list) -> list:
    """The HTTP bodies of the requests' keys (KEYS [1, K], NUMKEYS [1, 1])."""
    return [
        encode_request(
            {"KEYS": keys[None, :], "NUMKEYS": np.array([[keys.shape[0]]], np.int32)},
            ("OUTPUT0",),
        )
        for keys in requests
    ]


def in_process_lookup_us(repo: Path, capacity_of: float, replay: list, stream: list) -> dict:
    """The lookups of the same requests in this process, without Triton (median us per
    request): ``allhit``, the shared cache's native query of a replayed request once every
    key is cached (what the native path runs); ``misses``, CachedTable.lookup of the stream
    (the query and the native miss path, HPS's rules, the background inserter running)
    after its first quarter warmed the cache; ``misses_query``, the cache's query alone of
    the same stream (what an all-hit lookup of the stream's working set would cost: the
    replayed requests' 16 x 1,664 keys stay in the CPU's caches, the stream's do not).
    What the served gap is compared with."""
    import time
    import uuid

    from triton_rec.cache.cached_table import BackgroundInserter, CachedTable
    from triton_rec.cache.shm_cache import SharedEmbeddingCache
    from triton_rec.formats.tables import read_table
    from triton_rec.storage.backing_store import LocalTableStore
    from triton_rec.storage.table import EmbeddingTable

    entry = json.loads((repo / "ps.json").read_text())["models"][0]
    keys, vectors = read_table(str(repo / entry["sparse_files"][0]), VEC)
    table = EmbeddingTable("t0", keys, vectors, 0.0)
    out = {}
    for name, requests in (("allhit", replay), ("misses", stream)):
        cache = SharedEmbeddingCache.open(
            f"bench-misses-{uuid.uuid4().hex[:8]}", int(len(keys) * capacity_of), VEC
        )
        inserter = BackgroundInserter()
        ct = CachedTable("t0", LocalTableStore(table), cache, 0.9, inserter)
        try:
            warm = requests if name == "allhit" else requests[: len(requests) // 4]
            for _ in range(2):
                for k in warm:
                    ct.lookup(k, np.empty((k.shape[0], VEC), np.float32))
                inserter.drain()
            times = []
            measured = requests * 20 if name == "allhit" else requests[len(requests) // 4 :]
            hit = np.empty(len(requests[0]), np.uint8)
            buf = np.empty((len(requests[0]), VEC), np.float32)
            for k in measured:
                t0 = time.perf_counter_ns()
                if name == "allhit":
                    cache.query(k, buf, hit)
                else:
                    ct.lookup(k, buf)
                times.append(time.perf_counter_ns() - t0)
            out[name] = round(statistics.median(times) / 1000, 1)
            if name == "misses":  # the query alone, over the stream's larger working set
                times = []
                for k in measured:
                    t0 = time.perf_counter_ns()
                    cache.query(k, buf, hit)
                    times.append(time.perf_counter_ns() - t0)
                out["misses_query"] = round(statistics.median(times) / 1000, 1)
        finally:
            inserter.close()
            cache.close()
    return out


def cache_counts(srv: TritonServer, model: str) -> dict:
    """The model's cache lookups and hits so far (Triton's metrics endpoint)."""
    text = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
    out = {}
    for what in ("lookups", "hits"):
        m = re.search(rf'trec_cache_{what}_total{{model="{model}",table="t0"}} (\S+)', text)
        out[what] = float(m.group(1)) if m else 0.0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--cache", type=float, default=0.05, help="gpucacheper of the cached models")
    ap.add_argument("--requests", type=int, default=2000, help="distinct requests of the stream")
    ap.add_argument(
        "--samples",
        type=int,
        default=SAMPLES,
        help=f"samples a request ({KEYS_PER_SAMPLE} keys each)",
    )
    ap.add_argument("--concurrency", default="1,2,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="trec-misses-"))
    exe = build_loadgen(str(tmp))
    build_repository(tmp / "repo", args.rows, args.cache)
    rng = np.random.default_rng(SEED)
    pool = table_keys(0, 0, args.rows)
    stream_keys = key_stream(pool, args.requests, rng, args.samples)
    replay_keys = key_stream(pool, 16, rng, args.samples)
    stream = write_bodies(str(tmp / "stream.bin"), bodies(stream_keys))
    replay = write_bodies(str(tmp / "replay.bin"), bodies(replay_keys))
    feed = {"floor": replay, "allhit": replay, "misses": stream, "nocache": stream}
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "command": "python benchmarks/bench_misses.py " + " ".join(argv or sys.argv[1:]),
        "settings": vars(args),
        "by_concurrency": {},
    }
    env = {"TRITON_REC_STORE": str(tmp / "store")}
    with TritonServer(tmp / "repo", log_path=tmp / "server.log", env=env) as srv:
        for m in MODELS:  # warm: the replayed keys into allhit's cache, the stream's head
            run_loadgen(exe, srv.http_url, m, feed[m], 2, 3.0)
        before = cache_counts(srv, "misses")
        for c in (int(x) for x in args.concurrency.split(",")):
            rounds = {m: [] for m in MODELS}
            for r in range(args.rounds):
                for m in MODELS if r % 2 == 0 else MODELS[::-1]:
                    rounds[m].append(measure(exe, srv, m, feed[m], c, args.seconds))
            rate = {m: statistics.median(x["infer_per_s"] for x in rs) for m, rs in rounds.items()}
            cpu = {m: statistics.median(x["server_cpu_us"] for x in rs) for m, rs in rounds.items()}
            report["by_concurrency"][c] = {
                "infer_per_s": {m: round(v, 1) for m, v in rate.items()},
                "server_cpu_us": {m: round(v, 1) for m, v in cpu.items()},
                "misses_over_allhit": round(rate["misses"] / rate["allhit"], 3),
                "allhit_over_floor": round(rate["allhit"] / rate["floor"], 3),
                "nocache_over_floor": round(rate["nocache"] / rate["floor"], 3),
            }
            print(
                f"c={c}: "
                + " | ".join(f"{m} {rate[m]:7.0f}/s ({cpu[m]:5.0f} us CPU)" for m in MODELS)
                + f" | misses/allhit {rate['misses'] / rate['allhit']:.2f}x"
                f" | allhit/floor {rate['allhit'] / rate['floor']:.2f}x",
                flush=True,
            )
        after = cache_counts(srv, "misses")
    inproc = in_process_lookup_us(tmp / "repo", args.cache, replay_keys, stream_keys)
    report["in_process_lookup_us"] = inproc
    print(
        f"in-process lookup of the same requests (us/request): allhit {inproc['allhit']}, "
        f"misses {inproc['misses']} (its query alone {inproc['misses_query']}); "
        "served CPU over the floor (us/request): "
        + ", ".join(
            f"c={c} allhit {v['server_cpu_us']['allhit'] - v['server_cpu_us']['floor']:.0f} "
            f"misses {v['server_cpu_us']['misses'] - v['server_cpu_us']['floor']:.0f}"
            for c, v in report["by_concurrency"].items()
        ),
        flush=True,
    )
    lookups = after["lookups"] - before["lookups"]
    report["misses_hit_rate"] = round((after["hits"] - before["hits"]) / max(lookups, 1), 4)
    print(f"hit rate of `misses` over the rounds: {report['misses_hit_rate']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
