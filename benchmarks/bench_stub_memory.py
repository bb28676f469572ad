#!/usr/bin/env python3
"""Page faults and CPU per request, per process, for large DLRM requests (1,024 samples).

Two servers one after the other, each serving ``floor_dlrm`` and ``dlrm`` of
``bench_overhead.py`` (2 instances each): one as shipped (the instances set glibc's
malloc thresholds, ``triton_rec.triton.process_setup.tune_allocator``), one with a harmless
``GLIBC_TUNABLES=glibc.malloc.check=0``, which makes the instances leave malloc alone
(a user's malloc tunables always win). For each model, perf_analyzer (gRPC, concurrency
1, ``--seconds`` per round, ``--rounds`` rounds alternating the models) loads it while
the CPU time and minor page faults of tritonserver and of each instance process are read
from /proc; printed per inference the server counted.

    .venv/bin/python benchmarks/bench_stub_memory.py [--rounds 2] [--seconds 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_overhead as bo  # noqa: E402
from machine import machine_info  # noqa: E402

from triton_rec.triton import perf_analyzer  # noqa: E402
from triton_rec.triton.runtime import TritonServer  # noqa: E402
from triton_rec.util.procfs import proc_stat  # noqa: E402


def cpu_and_faults(pid: int):
    st = proc_stat(pid)
    return st.cpu_seconds, st.minflt


def measure(server: TritonServer, model: str, data: Path, seconds: float) -> dict:
    pids = {"server": server.process.pid}
    pids.update({f"instance {i}": p for i, p in enumerate(server.backend_pids(model))})
    before = {k: cpu_and_faults(p) for k, p in pids.items()}
    n0 = bo.inference_count(server, model)
    subprocess.run(
        perf_analyzer.command(
            [
                "-m",
                model,
                "-u",
                server.grpc_url,
                "-i",
                "grpc",
                "--input-data",
                str(data),
                "--concurrency-range",
                "1",
                "--measurement-interval",
                str(int(seconds * 1000)),
                "-s",
                "1000",
                "--max-trials",
                "1",
            ]
        ),
        env=perf_analyzer.environment(),
        capture_output=True,
    )
    n = bo.inference_count(server, model) - n0
    after = {k: cpu_and_faults(p) for k, p in pids.items()}
    instances = [k for k in pids if k != "server"]
    return {
        "inferences": n,
        "server_cpu_us": (after["server"][0] - before["server"][0]) * 1e6 / n,
        "instances_cpu_us": sum(after[k][0] - before[k][0] for k in instances) * 1e6 / n,
        "server_faults": (after["server"][1] - before["server"][1]) / n,
        "instances_faults": sum(after[k][1] - before[k][1] for k in instances) / n,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args(argv)
    print(f"machine: {machine_info()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_stub_memory_") as tmp:
        repo = Path(tmp) / "repo"
        meta = bo.build_repository(repo, ["dlrm"])
        data = bo.write_inputs(meta, ["dlrm"], [1024], 8, Path(tmp))[("dlrm", 1024)]
        for setting, env in (
            ("instances tune malloc (shipped)", {}),
            (
                "malloc untouched (GLIBC_TUNABLES=glibc.malloc.check=0)",
                {"GLIBC_TUNABLES": "glibc.malloc.check=0"},
            ),
        ):
            server = TritonServer(
                repo,
                explicit=True,
                load_models=["floor_dlrm", "dlrm"],
                log_path=Path(tmp) / "server.log",
                env={"TRITON_REC_STORE": str(Path(tmp) / "store"), **env},
            )
            server.start(timeout=300)
            try:
                for rnd in range(args.rounds):
                    for model in ("floor_dlrm", "dlrm"):
                        r = measure(server, model, data, args.seconds)
                        rows.append((setting, model, rnd, r))
                        print(
                            setting, model, rnd, {k: round(v, 1) for k, v in r.items()}, flush=True
                        )
            finally:
                server.stop()
    print(
        "\n| setting | model | round | inferences | instances: CPU us / faults per inference "
        "| tritonserver: CPU us / faults per inference |\n|---|---|---:|---:|---:|---:|"
    )
    for setting, model, rnd, r in rows:
        print(
            f"| {setting} | `{model}` | {rnd} | {r['inferences']} | {r['instances_cpu_us']:,.0f} / "
            f"{r['instances_faults']:,.1f} | "
            f"{r['server_cpu_us']:,.0f} / {r['server_faults']:,.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
