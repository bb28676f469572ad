"""benchmarks/bench_tiers.py runs end to end on tiny sizes (a real 3-master Redis Cluster,
RocksDB, the node-local layout, shared-memory caches) and reports sane figures, so the
benchmark cannot rot silently."""

import json
import os

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.mark.slow  # the benchmark script end to end (RocksDB, several sizes)
def test_bench_tiers_runs_on_tiny_sizes_with_sane_figures(capsys, tmp_path):
    bt = load_benchmark("bench_tiers")
    paths = {k: tmp_path / f"bench_tiers.{k}" for k in ("json", "md", "png")}
    try:  # the plot needs matplotlib, which only the `bench` extra installs
        import matplotlib  # noqa: F401

        plot = True
    except ImportError:
        plot = False
    result = bt.main(
        [
            "--rows",
            "4000",
            "--dim",
            "8",
            "--reps-scale",
            "0.05",
            "--upsert-rows",
            "2000",
            "--updates",
            "3000",
            "--cache-warmup",
            "3",
            "--cache-reps",
            "8",
            "--json",
            str(paths["json"]),
            "--md",
            str(paths["md"]),
            "--plot",
            str(paths["png"]) if plot else "",
        ]
    )
    text = capsys.readouterr().out

    # every section, in order, each with a markdown table; the same text in the .md file
    assert text.startswith("machine: ")
    positions = [text.index(title) for title in bt.SECTIONS]
    assert positions == sorted(positions)
    for title in bt.SECTIONS:
        assert "|---" in text[text.index(title) :], title
    assert paths["md"].read_text() in text
    assert paths["png"].stat().st_size > 1000 if plot else not paths["png"].exists()
    data = json.loads(paths["json"].read_text())
    assert data["args"]["rows"] == 4000 and data["machine"]["nproc"] >= 1

    # ingest: bulk load, 1k / 10k upserts per writable tier, the stream path
    ingest = {(r["tier"], r["what"]) for r in result["ingest"]}
    for tier in ("redis", "rocksdb", "rocksdb-node"):
        for what in (
            "bulk load, 65,536 rows/call",
            "upsert, 1,000 keys/call",
            "upsert, 10,000 keys/call",
        ):
            assert (tier, what) in ingest, (tier, what)
    assert any(t.startswith("stream ->") for t, _ in ingest)
    for r in result["ingest"]:
        assert r["rows"] > 0 and r["rows_per_s"] > 0 and r["mb_per_s"] > 0, r
    # It ran at the tiny sizes given (what a time bound on this test stood for: a benchmark
    # that ignored one would run at full size; how long it takes is no business of a test):
    # --rows bulk loaded, at most --upsert-rows upserted, the --updates all applied.
    for r in result["ingest"]:
        if r["what"].startswith("bulk load"):
            assert r["rows"] == 4000, r
        elif r["what"].startswith("upsert"):
            assert r["rows"] <= 2000, r
        else:
            assert r["tier"].startswith("stream") and r["rows"] == 3000, r

    # lookups: every tier and reference at every batch size
    got = {(r["batch"], r["tier"]) for r in result["lookup"]}
    assert got == {
        (b, t)
        for b in (64, 1024, 16384)
        for t in ("gather", "codec", "local", "redis", "rocksdb", "rocksdb-node")
    }
    for r in result["lookup"]:
        assert r["keys_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"], r
        assert r["reps"] == max(3, int(bt.LOOKUP_REPS[r["batch"]] * 0.05)), r  # --reps-scale

    # cache in front: 4 target hit rates x 3 tiers, measured hit rates in [0, 1] and
    # equal across tiers (same key sequence, deterministic caches)
    assert len(result["cache"]) == 12
    assert {r["tier"] for r in result["cache"]} == {"local", "redis", "rocksdb"}
    for r in result["cache"]:
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["keys_per_s"] > 0, r
        assert r["cache_rows"] >= r["filled_rows"] > 0 and 0.0 <= r["store_share"] <= 1.0
    for target in (0.5, 0.8, 0.95, 0.99):
        assert len({r["hit_rate"] for r in result["cache"] if r["target"] == target}) == 1
    for row in ("| 1,024 | gather |", "| 16,384 | redis |", "| 64 | rocksdb-node |"):
        assert row in text, row

    # no shared-memory segment left behind
    base = os.path.basename(bt.segment_path(f"bench-tiers-{os.getpid()}-x"))[:-1]
    assert [f for f in os.listdir("/dev/shm") if f.startswith(base)] == []
