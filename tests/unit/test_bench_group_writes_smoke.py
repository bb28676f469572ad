"""benchmarks/bench_group_writes.py runs end to end on tiny sizes (it cannot rot
silently), its baseline agreeing with the C++ on what each batch becomes."""

import json

from tests.benchmark_scripts import load_benchmark


def test_bench_group_writes_runs_on_tiny_sizes(capsys, tmp_path):
    bench = load_benchmark("bench_group_writes")
    out = tmp_path / "group_writes.json"
    assert (
        bench.main(["--sizes", "10,300", "--rounds", "1", "--capacity", "4096", "--json", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "300 keys" in text and "numpy baseline" in text
    rows = json.loads(out.read_text())["results"]
    assert [r["keys"] for r in rows] == [10, 300]
    assert all(r["ours_us"] > 0 and r["numpy_us"] > 0 for r in rows)
