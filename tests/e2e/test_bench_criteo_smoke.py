"""benchmarks/bench_criteo.py end to end on a tiny model (26 tables of 3..400 rows), one
batch size, c=1, short windows: a real tritonserver and perf_analyzer, the JSON's
structure, and every ratio taken against the floor measured in the same run. No figure
is judged: goals live in the benchmark, not here."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

ARGS = ["--scale", "0.00001", "--min-rows", "200", "--concurrency", "1"]
ARGS += ["--window-ms", "100", "--min-requests", "1", "--max-trials", "3"]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_criteo")


def test_the_benchmark_measures_model_and_floor_in_one_run(
    bench, tmp_path, capsys, nothing_left_in_dev_shm
):
    work, data = tmp_path / "work", tmp_path / "data"
    argv = ARGS + ["--batch-sizes", "64", "--work", str(work), "--data-dir", str(data)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    files = list(data.glob("criteo_cpu_*.json"))
    assert [f.name for f in files] == [f"criteo_cpu_{bench.machine_tag()}.json"]
    doc = json.loads(files[0].read_text())

    # what was run, where, on what
    assert doc["argv"] == argv and doc["command"].startswith("python benchmarks/bench_criteo.py")
    assert doc["kind"] == "KIND_CPU" and doc["scale"] == 1e-5 and doc["instances"] == 1
    assert doc["machine"]["nproc"] >= 1 and doc["machine"]["loadavg"] and doc["loadavg_end"]
    assert doc["model"]["reused"] is False and len(doc["model"]["rows"]) == 26
    assert doc["sanity_problems"] == []
    assert set(doc["reference"]["rows"]) == {"256", "1024", "4096", "16384", "65536"}

    # the floor: the model's interface on the native floor backend, same kind and count
    floor = doc["floor"]["config"]
    assert 'backend: "trec_floor"' in floor and "max_batch_size: 65536" in floor
    for line in ('name: "DES"', 'name: "CATCOLUMN"', 'name: "ROWINDEX"', 'name: "OUTPUT0"'):
        assert line in floor
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in floor

    # one row per (model, batch, concurrency), measured; the ratio from these very rows
    rows = {(r["role"], r["batch"], r["concurrency"]): r for r in doc["rows"]}
    assert set(rows) == {("model", 64, 1), ("floor", 64, 1)}
    model, fl = rows[("model", 64, 1)], rows[("floor", 64, 1)]
    assert fl["model"] == "floor_criteo" and model["model"] == "dlrm_criteo"
    for r in (model, fl):
        assert r["status"] in ("ok", "unstable"), r
        assert r["samples_per_s"] == pytest.approx(r["infer_per_s"] * 64)
        assert 0 < r["p50_us"] <= r["p99_us"] and r["requests"] >= 1 and r["loadavg_1m"] >= 0
        assert "--shared-memory system" in r["command"] and "-b 1" in r["command"]
    [ratio] = doc["ratios"]
    assert (ratio["batch"], ratio["concurrency"]) == (64, 1)
    assert ratio["samples_per_s"] == pytest.approx(model["samples_per_s"] / fl["samples_per_s"])
    assert ratio["p99_us"] == pytest.approx(model["p99_us"] / fl["p99_us"])
    assert model["vs_floor"] == ratio["samples_per_s"]

    # the server's memory beside the tables' bytes + dense weights + 60 MiB
    mem, target = doc["memory"], doc["pss_target"]
    assert mem["pss_bytes"] > 0 and sum(mem["pss_by_kind_bytes"].values()) > 0
    assert target["target_bytes"] == (target["tables_bytes"] + target["dense_bytes"] + 60 * 2**20)
    assert target["within"] == (mem["pss_bytes"] <= target["target_bytes"])
    assert doc["memory_after_start"]["pss_bytes"] > 0
    assert doc["memory_after_batch"]["64"]["pss_bytes"] > 0

    # the printed table names both machines and has our row
    assert "| 64 | 1 |" in out and "A100 80GB" in out and doc["machine"]["cpu_model"] in out

    # a second run reuses the model, adding the perf inputs of a new batch size
    argv2 = ARGS + ["--batch-sizes", "32", "--work", str(work), "--data-dir", str(data)]
    assert bench.main(argv2 + ["--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["model"]["reused"] is True
    assert {r["batch"] for r in again["rows"]} == {32}
