"""benchmarks/bench_tiers.py runs end to end on tiny sizes (real Redis Cluster and
RocksDB) and reports sane figures (so the benchmark cannot rot silently)."""

import importlib.util
import json
import os
import sys

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_tiers.py")


def test_bench_tiers_runs_on_tiny_sizes(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_tiers", os.path.abspath(_PATH))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_tiers", mod)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    result = mod.main(["--rows", "4000", "--dim", "8", "--reps", "5", "--updates", "3000",
                       "--json", str(out), "--plot", str(tmp_path / "p.png")])
    text = capsys.readouterr().out
    assert "| ingest |" in text and "vs gather" in text and "hit rate" in text
    assert json.loads(out.read_text())["args"]["rows"] == 4000
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert all(v > 0 for v in result["ingest"].values())
    assert all(v > 0 for v in result["stream_ingest"].values())
    tiers = {(r["batch"], r["tier"]) for r in result["lookup"]}
    assert tiers == {(b, t) for b in (64, 1024, 16384) for t in ("gather", "local", "redis", "rocksdb")}
    assert all(0.0 <= r["hit_rate"] <= 1.0 and r["keys_per_s"] > 0 for r in result["cache"])
    assert len(result["cache"]) == 12
