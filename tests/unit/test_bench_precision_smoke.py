"""benchmarks/bench_precision.py runs end to end on tiny sizes and prints every table
(so the benchmark cannot rot silently), and its memory figures are the real sizes."""

import importlib.util
import json
import os

from tests.benchmark_scripts import load_benchmark
from triton_rec.precision import PRECISIONS, RowCodec


def test_bench_precision_runs_on_tiny_sizes_and_prints_every_table(capsys, tmp_path):
    bp = load_benchmark("bench_precision")
    out_json, png = tmp_path / "p.json", tmp_path / "p.png"
    rc = bp.main(["--quick", "--dims", "8,32", "--json", str(out_json), "--png", str(png)])
    text = capsys.readouterr().out
    assert rc == 0 and text.startswith("machine: ")
    positions = [text.index(title) for title in bp.SECTIONS]
    assert positions == sorted(positions)
    for title in bp.SECTIONS:
        assert "|---" in text[text.index(title) :], title
    data = json.loads(out_json.read_text())
    if importlib.util.find_spec("matplotlib") is None:  # the 'bench' extra is optional
        assert "matplotlib is not installed" in text and not png.exists()
    else:
        assert png.stat().st_size > 0
    for section in ("memory", "lookup"):
        assert {(r["dim"], r["precision"]) for r in data[section]} == {
            (d, p) for d in (8, 32) for p in PRECISIONS
        }
    for r in data["memory"]:
        codec = RowCodec(r["precision"], r["dim"])
        assert r["payload"] == codec.row_bytes
        # a layout holds at least the keys and the encoded rows of every row
        assert r["store"] >= codec.row_bytes + 8 and r["cache"] >= codec.row_bytes + 8
    # the 4 processes share one copy: the PSS sum is about one layout file, not four
    assert {r["precision"] for r in data["pss"]} == set(PRECISIONS)
    for r in data["pss"]:
        assert 0.5 * r["file"] <= r["store_pss"] <= 1.5 * r["file"], r
        assert r["cache_pss"] > 0
    assert [f for f in os.listdir("/dev/shm") if f.startswith("bench-precision-")] == []
