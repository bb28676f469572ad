"""benchmarks/bench_cache.py runs end to end on tiny sizes and prints every table
(so the benchmark cannot rot silently)."""

import json
import os

from tests.benchmark_scripts import load_benchmark


def test_bench_cache_runs_on_tiny_sizes_and_prints_every_table(capsys, tmp_path):
    bc = load_benchmark("bench_cache")
    out_json = tmp_path / "bench_cache.json"
    rc = bc.main(
        [
            "--rows",
            "3000",
            "--dim",
            "8",
            "--batch",
            "256",
            "--cache-rows",
            "512",
            "--reps",
            "2",
            "--e2e-reps",
            "2",
            "--insert-reps",
            "2",
            "--mp-iters",
            "2",
            "--mp-reps",
            "1",
            "--json",
            str(out_json),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    # every section, in order, each followed by a markdown table
    positions = [text.index(title) for title in bc.SECTIONS]
    assert positions == sorted(positions)
    for title in bc.SECTIONS:
        assert "|---" in text[text.index(title) :], title
    assert text.startswith("machine: ")
    for header in (
        "| hit rate | hits | shm lru | shm tinylfu |",
        "| hit rate | sync ms |",
        "| hit rate | misses | query | glue | fetch |",
        "| policy | cache | median ms |",
        "| hit rate | array ms |",
        "| workload | 1 process Mkeys/s |",
    ):
        assert header in text, header
    for rate in ("100%", "90%", "50%", "10%", "0%"):
        assert f"| {rate} |" in text
    for row in (
        "| lru | empty |",
        "| lru | full |",
        "| tinylfu | full, cold keys |",
        "| tinylfu | full, keys queried once |",
        "| shm lru query, 100% hits |",
        "| fused table lookup (no cache) |",
    ):
        assert row in text, row
    data = json.loads(out_json.read_text())
    assert set(data["query"]) == {"1.0", "0.9", "0.5", "0.1", "0.0"}
    assert data["processes"] and data["insert"]
    # It ran at the tiny sizes given (what a time bound on this test stood for: a benchmark
    # that ignored one would run at full size; how long it takes is no business of a test).
    assert data["config"]["rows"] == 3000 and data["config"]["cache_rows"] == 512
    assert "table: 3000 rows x 8 float32" in text
    assert data["query"]["1.0"]["hits"] == 256 and data["query"]["0.0"]["hits"] == 0
    assert all(0 <= r["hits"] <= 256 for r in data["query"].values())
    for case, r in data["insert"].items():
        if case != "numpy scatter reference":  # --insert-reps inserts of --batch keys each
            assert len(r["counts"]) == 2, (case, r)
            assert all(inserted + rejected <= 256 for inserted, _, rejected in r["counts"])
    # cold keys never enter a full TinyLFU cache: the whole batch rejected, each time
    assert data["insert"]["tinylfu full, cold keys"]["counts"] == [[0, 0, 256]] * 2
    # no segment left behind in /dev/shm
    prefix = f"trec_bench-cache-{os.getpid()}-"
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]
    assert leftovers == []


def test_bench_cache_ways_runs_on_tiny_sizes_and_reports_every_way(capsys, tmp_path):
    bw = load_benchmark("bench_cache_ways")
    out_json = tmp_path / "ways.json"
    rc = bw.main(
        [
            "--capacity",
            "8192",
            "--dim",
            "8",
            "--rounds",
            "1",
            "--ways",
            "4,8",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "ways  4:" in text and "ways  8:" in text, text
    report = json.loads(out_json.read_text())
    for w in ("4", "8"):
        q = report["query_us"][w]
        assert q["hot"] > 0 and q["polluted"] > 0, report
