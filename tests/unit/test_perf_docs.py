"""docs/performance.md and the README's headline figures are what benchmarks/perf_docs.py
generates now from benchmarks/data/ and benchmarks/targets.json: a data file, a spec or a
target changed without ``make perf-docs`` fails here. Plain stdlib, no servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def perf_docs():
    return load_benchmark("perf_docs")


def test_the_performance_page_is_what_the_script_generates_now(perf_docs):
    page = (REPO / "docs" / "performance.md").read_text(encoding="utf-8")
    assert page == perf_docs.render_page(), "docs/performance.md is out of date: make perf-docs"


def test_the_readme_headline_figures_are_what_the_script_generates_now(perf_docs):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert perf_docs.HEADLINE_BEGIN in readme and perf_docs.HEADLINE_END in readme
    assert readme == perf_docs.readme_with_headlines(readme), (
        "the README's headline figures are out of date: make perf-docs"
    )


def test_every_unmet_target_says_why_and_every_target_names_a_section(perf_docs):
    targets = json.loads((REPO / "benchmarks" / "targets.json").read_text())["targets"]
    sections = {b.key for b in perf_docs.BENCHMARKS}
    for t in targets:
        assert t["section"] in sections, t["target"]
        assert t["op"] in perf_docs.OPS, t["target"]
    # render_targets raises on an unmet target without a reason
    assert perf_docs.render_targets(targets)


def test_targets_and_headlines_read_the_data_their_sections_show(perf_docs):
    # A data file is named by a target (targets.json), by its section's tables and by the
    # README's headlines (perf_docs.py): one of them moved to a newer run alone left the
    # others showing the older one (the hps headlines read 2026-11-26's run for a day).
    targets = json.loads((REPO / "benchmarks" / "targets.json").read_text())["targets"]
    shown = {
        b.key: {f for t in b.tables for f in perf_docs.data_files(t.data)}
        for b in perf_docs.BENCHMARKS
    }
    for t in targets:
        assert t["data"] in shown[t["section"]], (t["target"], t["data"])
    for h in perf_docs.HEADLINES:
        assert h.data in shown[h.anchor], (h.text, h.data)


def test_paths_select_one_element_and_refuse_ambiguity(perf_docs):
    doc = {"summary": [{"model": "a", "c": 1, "v": 2.0}, {"model": "a", "c": 8, "v": 3.0}]}
    assert perf_docs.get(doc, "summary[model=a,c=8]/v") == 3.0
    with pytest.raises(KeyError):
        perf_docs.get(doc, "summary[model=a]/v")
    assert perf_docs.rows_of({"by": {"1": {"x": 1}, "8": {"x": 2}}}, "by/*") == [
        ("1", {"x": 1}),
        ("8", {"x": 2}),
    ]


def test_a_new_benchmark_is_a_spec_entry(perf_docs, tmp_path, monkeypatch):
    """A JSON file with a date, a command and a machine, and a Benchmark naming its rows
    and columns, give a section whose ratio column is computed against the baseline row."""
    data = tmp_path / "data"
    data.mkdir()
    machine = {"cpu_model": "AMD EPYC", "nproc": 2, "ram_gib": 23.5, "kernel": "6.18.44-x"}
    machine.update(python="3.11.7", numpy="1.26.4")
    (data / "new_cpu_amd-epyc-2c.json").write_text(
        json.dumps(
            {
                "date": "2026-11-27T10:00:00+00:00",
                "command": "python benchmarks/bench_new.py --json /tmp/x/new.json",
                "machine": machine,
                "results": [
                    {"engine": "ours", "batch": 64, "us": 50.0},
                    {"engine": "onnxruntime", "batch": 64, "us": 100.0},
                ],
            }
        )
    )
    monkeypatch.setattr(perf_docs, "DATA", str(data))
    spec = perf_docs.Benchmark(
        "bench_new",
        "A new benchmark",
        "bench_new.py",
        "what it measures",
        [
            perf_docs.Table(
                "us per call",
                "new_cpu_*.json",
                "results",
                [
                    perf_docs.Col("engine", "engine"),
                    perf_docs.Col("us", "us", "{:.1f}"),
                    perf_docs.ratio(
                        "speed x onnxruntime", "^results[engine=onnxruntime,batch={batch}]/us", "us"
                    ),
                ],
            )
        ],
    )
    monkeypatch.setattr(perf_docs, "BENCHMARKS", [spec])
    monkeypatch.setattr(perf_docs, "TARGETS", str(tmp_path / "targets.json"))
    (tmp_path / "targets.json").write_text('{"targets": []}')
    page = perf_docs.render_page()
    assert '<a id="bench_new"></a>' in page
    assert "- Measured on 2026-11-27; machine: AMD EPYC, 2 CPUs; 23.5 GiB; Linux 6.18.44" in page
    assert "`python benchmarks/bench_new.py --json <out-dir>/new.json`" in page
    assert "| ours | 50.0 | 2.00x |" in page
    assert "| onnxruntime | 100.0 | 1.00x |" in page


def test_the_machine_names_the_gpu_the_file_records(perf_docs):
    machine = {"cpu_model": "Intel(R) Xeon(R) Processor", "nproc": 16, "ram_gib": 125.9}
    doc = {"machine": machine, "gpus": ["NVIDIA H200, 580.159.04, 143771 MiB"]}
    assert perf_docs.machine_short(doc, None) == "NVIDIA H200 node"
    assert perf_docs.machine_of(doc, None, None).startswith("one NVIDIA H200; Intel Xeon, 16 CPUs")
    assert perf_docs.machine_short({"machine": machine}, None) == "Intel Xeon, 16 CPUs"


def test_the_readme_is_a_product_page_of_at_most_12_kb():
    # issue 36: what it is, the commands, what is supported, today's figures; the history
    # lives under benchmarks/history/
    readme = (REPO / "README.md").read_bytes()
    assert len(readme) <= 12 * 1024, len(readme)
    for diary in ("session", "call 13", "run13_", "next loan"):
        assert diary not in readme.decode("utf-8").lower(), diary
