"""benchmarks/bench_overhead.py: its reporting (ratios within a round, medians over rounds,
scheduling variants) on synthetic records, and its repository builder on the hps group,
so the benchmark cannot rot silently. The measuring itself needs a server and
perf_analyzer: run ``bench_overhead.py --quick`` for that."""

import importlib.util
import json
import os
import sys

import pytest

_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.fixture(scope="module")
def bo():
    sys.path.insert(0, os.path.abspath(_DIR))
    spec = importlib.util.spec_from_file_location(
        "bench_overhead", os.path.join(_DIR, "bench_overhead.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(model, rnd, infer, group="hps"):
    return {
        "model": model,
        "group": group,
        "batch": 64,
        "concurrency": 1,
        "protocol": "grpc",
        "status": "ok",
        "round": rnd,
        "infer_per_s": infer,
        "p50_us": 1e6 / infer,
        "p99_us": 2e6 / infer,
        "server_compute_us": 100.0,
        "cpu_us_per_infer": 500.0,
        "requests_per_exec": 1.0,
    }


def test_ratios_are_taken_within_a_round_then_the_median(bo):
    results = []
    for rnd, (floor, naive, hps) in enumerate(
        [(1000, 400, 900), (500, 200, 500), (2000, 800, 1400)]
    ):
        results += [
            _rec("floor_hps", rnd, floor),
            _rec("floor_native_hps", rnd, 2 * floor),
            _rec("naive_hps", rnd, naive),
            _rec("hps", rnd, hps),
        ]
    rows = {r["model"]: r for r in bo.summarize(results)}
    assert rows["hps"]["vs_floor"] == pytest.approx(0.9)  # median of 0.9, 1.0, 0.7
    assert rows["hps"]["vs_floor_range"] == pytest.approx((0.7, 1.0))
    assert rows["hps"]["vs_native_floor"] == pytest.approx(0.45)  # the C++ floor: half
    assert rows["hps"]["vs_naive"] == pytest.approx(2.25)  # median of 2.25, 2.5, 1.75
    assert rows["floor_hps"]["vs_floor"] == 1.0
    md = bo.tables_md(list(rows.values()))
    assert "| 64 | grpc | 1 | `hps` | 900 | 0.90 (0.70-1.00) | 0.45 (0.35-0.50) | 2.25 |" in md


def test_variants_copy_the_models_with_other_scheduling(bo, tmp_path, monkeypatch):
    monkeypatch.setattr(bo, "HPS_ROWS", 1000)
    repo = tmp_path / "repo"
    bo.build_repository(repo, ["hps"])
    groups = bo.add_variants(
        repo, ["hps"], [("d7", "dynamic_batching { max_queue_delay_microseconds: 7 }")]
    )
    assert groups == ["hps__d7"]
    assert bo.FLOOR["hps__d7"] == "floor_hps__d7" and bo.NAIVE["hps__d7"] == "naive_hps__d7"
    text = (repo / "hps__d7" / "config.pbtxt").read_text()
    assert 'name: "hps__d7"' in text and "max_queue_delay_microseconds: 7" in text
    assert "instance_group" not in text  # the variant's lines replaced the shipped ones
    assert (repo / "naive_hps__d7" / "1" / "model.py").exists()
    models = {m["model"] for m in json.loads((repo / "ps.json").read_text())["models"]}
    assert {"hps", "hps_nocache", "hps__d7", "hps_nocache__d7"} <= models


def test_the_scheduling_is_the_shipped_examples(bo):
    text = open(os.path.join(_DIR, "..", "model_repository", "dlrm", "config.pbtxt")).read()
    for line in bo.SCHEDULING.splitlines():
        assert line in text


def test_the_miss_stream_groups_name_their_workload(bo, tmp_path, monkeypatch):
    """hps_misses feeds hps_5pct (cache 5%) a stream of distinct requests; the all-hit hps
    group replays a few requests through the same model; both beside the C++ floor."""
    monkeypatch.setattr(bo, "HPS_ROWS", 5000)
    repo = tmp_path / "repo"
    meta = bo.build_repository(repo, ["hps", "hps_misses"])
    entries = {m["model"]: m for m in json.loads((repo / "ps.json").read_text())["models"]}
    assert entries["hps_5pct"]["gpucacheper"] == bo.MISS_CACHE < 0.5
    assert "gpucacheper" not in entries["hps"]  # the ps.json default
    assert "hps_5pct" in bo.GROUP_MODELS["hps"] and "hps_5pct" in bo.GROUP_MODELS["hps_misses"]
    assert bo.NATIVE_FLOOR["hps_misses"] == bo.FLOOR["hps_misses"] == "floor_native_hps"
    files = bo.write_inputs(meta, ["hps", "hps_misses"], [1], 4, tmp_path, miss_requests=30)
    replay = json.loads(files[("hps", 64)].read_text())["data"]
    stream = json.loads(files[("hps_misses", 64)].read_text())["data"]
    assert (len(replay), len(stream)) == (4, 30)
