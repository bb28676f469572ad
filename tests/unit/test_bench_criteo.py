"""benchmarks/bench_criteo.py without a server: the floor's config is the model's but for
the backend, ratios pair each model row with the floor row of the same batch and
concurrency, and the printed table carries NVIDIA's reference figures beside ours
(tests/e2e/test_bench_criteo_smoke.py runs the benchmark itself)."""

from __future__ import annotations

import pytest

from ps_loader import criteo
from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_criteo")


@pytest.mark.parametrize("kind,count", [("KIND_CPU", 1), ("KIND_CPU", 4), ("KIND_GPU", 2)])
def test_the_floor_has_the_models_config_but_its_backend(bench, kind, count):
    model = criteo.config_pbtxt(bench.MODEL, kind, count).splitlines()
    floor = bench.floor_config(kind, count).splitlines()
    assert 'backend: "trec_floor"' in floor and f'name: "{bench.FLOOR}"' in floor
    kept = [ln for ln in model if not ln.startswith(("#", "name:", "backend:"))]
    assert kept and all(ln in floor for ln in kept)  # I/O, max_batch_size, batching, instances
    assert any(f"count: {count} kind: {kind}" in ln for ln in floor)
    assert 'parameters { key: "tables" value: { string_value: "26" } }' in floor


def _row(role, batch, conc, samples, p50=100.0, p99=200.0):
    model = "dlrm_criteo" if role == "model" else "floor_criteo"
    return dict(
        model=model, role=role, batch=batch, concurrency=conc, status="ok", samples_per_s=samples,
        p50_us=p50, p99_us=p99, window_ms=1000, loadavg_1m=1.0,
    )  # fmt: skip


def test_ratios_pair_each_model_row_with_its_own_floor(bench):
    rows = [
        _row("floor", 256, 1, 1000.0),
        _row("model", 256, 1, 250.0, 400.0, 1000.0),
        _row("floor", 256, 2, 2000.0),
        _row("model", 256, 2, 1000.0),
        _row("model", 1024, 1, 50.0),  # its floor failed: no ratio
        dict(_row("floor", 1024, 1, 0.0), status="failed"),
    ]
    del rows[-1]["samples_per_s"]
    out = bench.ratios(rows)
    assert [(r["batch"], r["concurrency"]) for r in out] == [(256, 1), (256, 2)]
    assert out[0]["samples_per_s"] == 0.25 and out[0]["p50_us"] == 4 and out[0]["p99_us"] == 5
    assert out[1]["samples_per_s"] == 0.5 and rows[1]["vs_floor"] == 0.25


def test_the_table_names_both_machines_and_the_reference_at_c1_only(bench):
    rows = [_row("floor", 256, 1, 1000.0), _row("model", 256, 1, 802.0)]
    rows += [_row("floor", 256, 2, 1000.0), _row("model", 256, 2, 900.0)]
    bench.ratios(rows)
    doc = {
        "kind": "KIND_CPU",
        "machine": {"cpu_model": "Some CPU", "nproc": 2, "loadavg": "1.00 2.00 3.00"},
        "gpus": [],
        "scale": 0.01,
        "precision": "fp32",
        "instances": 1,
        "model": {"rows": [1, 2], "tables_bytes": 10**9},
        "settings": {"protocol": "grpc", "shared_memory": "system"},
        "loadavg_end": "1.5 2 3",
        "rows": rows,
    }
    text = bench.table_md(doc)
    assert "Some CPU x 2 CPUs" in text and "A100 80GB" in text and "1.00 2.00 3.00" in text
    # c=1: NVIDIA's batch-256 figures beside ours; c=2: none (NVIDIA measured c=1)
    assert (
        "| 256 | 1 | 802 | 100 | 200 | 1,000 | 100 | 0.802 | 401,000 | 624 | 738 | 0.002 |" in text
    )
    assert "| 256 | 2 | 900 | 100 | 200 | 1,000 | 100 | 0.9 | - | - | - | - |" in text


def test_the_reference_is_nvidias_published_fp16_table(bench):
    ref = bench.NVIDIA_HPS_TRT
    assert sorted(ref["rows"]) == list(criteo.DEFAULT_BATCH_SIZES)
    assert ref["rows"][65536] == (4_300_000, 14941, 20144)
    assert "A100 80GB" in ref["hardware"] and "merlin_hps_inference.md" in ref["source"]


def test_machine_tags_name_cpu_cores_and_gpu():
    from benchmarks.machine import machine_tag

    info = {"cpu_model": "AMD EPYC 9654 96-Core Processor", "nproc": 16}
    assert machine_tag(info, ["NVIDIA H200, 580.159.04, 143771 MiB"]) == "amd-epyc-9654-16c-h200"
    info = {"cpu_model": "Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz", "nproc": 2}
    assert machine_tag(info, []) == "intel-xeon-platinum-8480p-2c"


def test_the_tables_counters_are_read_from_the_metrics_text(bench):
    """What the JSON keeps of each table (``tables``) and the log line that sums it."""
    text = b"""# HELP trec_cache_lookups_total Keys looked up
trec_cache_lookups_total{model="dlrm_criteo",table="C1"} 1000
trec_cache_hits_total{model="dlrm_criteo",table="C1"} 900
trec_cache_misses_total{model="dlrm_criteo",table="C1"} 100
trec_cache_sync_fetched_total{model="dlrm_criteo",table="C1"} 90
trec_cache_default_not_found_total{model="dlrm_criteo",table="C1"} 10
trec_cache_bytes{memory="gpu0",model="dlrm_criteo",table="C1"} 4096
trec_lookup_duration_us_total{model="dlrm_criteo",table="C1",tier="cache"} 1500000
trec_lookup_duration_us_total{model="dlrm_criteo",table="C1",tier="local"} 500000
trec_cache_lookups_total{model="dlrm_criteo",table="C2"} 1000
trec_cache_hits_total{model="dlrm_criteo",table="C2"} 1000
trec_cache_bytes{memory="gpu0",model="dlrm_criteo",table="C2"} 2048
trec_cache_lookups_total{model="floor_criteo",table="C1"} 5
nv_inference_count{model="dlrm_criteo",version="1"} 7
"""
    tables = bench.parse_table_counters(text)
    assert set(tables) == {"C1", "C2"}  # the floor's and Triton's own series left out
    assert tables["C1"] == {
        "lookups": 1000.0,
        "hits": 900.0,
        "misses": 100.0,
        "sync_fetched": 90.0,
        "not_found": 10.0,
        "cache_bytes": 4096.0,
        "memory": "gpu0",
        "cache_us": 1500000.0,
        "local_us": 500000.0,
    }
    line = bench.table_summary(tables)
    assert "2,000 keys looked up, 5.00% missed (90 fetched" in line, line
    assert "1.50 s in the caches, 0.50 s in the host tables" in line, line
    no_cache = {"C1": {"lookups": 10.0, "misses": 10.0, "sync_fetched": 10.0}}
    assert bench.table_summary(no_cache) == "1 tables, 10 keys read from the mapped tables"
