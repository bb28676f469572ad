"""``triton-rec-server plan`` against a real server (docs/operations.md, "Sizing a node").

The plan of a repository, made from its config.pbtxt files and ps.json alone, is held to
what a tritonserver that loads the repository then holds: the node store's layout files
(host memory) and the cache segments in the shared-memory directory, each within 10%;
and the server's load log states the plan's own figures for every model it loads, and its
metrics (``trec_table_bytes``, ``trec_cache_bytes``) the same bytes while it serves. On the
demo repository (`make demo`) and on a generated Criteo DLRM in int8 (``.npz`` tables,
another row layout).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tests.e2e.conftest import DEMO_REPO
from triton_rec.cache.shm_cache import SHM_DIR_VARIABLE, shm_dir
from triton_rec.storage.node_store import STORE_ENV
from triton_rec.triton.runtime import TritonServer, main

#: how far the plan may be from what the server holds
TOLERANCE = 0.10
SIZING_LINE = re.compile(
    r"model '(?P<model>[^']+)': sizing: .*\(host_bytes=(?P<host>\d+)\).*\(shm_bytes=(?P<shm>\d+)\)"
)


def demo_repository(tmp_path_factory) -> Path:
    if not (DEMO_REPO / "hps_demo" / "1" / "hps_demo0_sparse_0.model" / "key").exists():
        subprocess.run([sys.executable, "-m", "ps_loader", "demo", str(DEMO_REPO)], check=True)
    if not (DEMO_REPO / "dlrm" / "1" / "dlrm_dense_0.model").exists():
        subprocess.run([sys.executable, str(DEMO_REPO / "dlrm" / "train.py")], check=True)
    return DEMO_REPO


def criteo_int8_repository(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("criteo-int8")
    cmd = [sys.executable, "-m", "ps_loader", "criteo-dlrm", "--out", str(out)]
    cmd += ["--scale", "0.0002", "--min-rows", "100", "--precision", "int8", "--batch-sizes", ""]
    subprocess.run(cmd, check=True, capture_output=True)
    # a KIND_CPU model is generated to read its mapped tables alone: put the shared CPU
    # cache (gpucacheper 0.2) in front of them, so the plan's /dev/shm figure is held too
    ps = out / "ps.json"
    doc = json.loads(ps.read_text())
    for model in doc["models"]:
        model["gpucache"] = True
    ps.write_text(json.dumps(doc, indent=2))
    return out


def plan_json(repo: Path) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["plan", "--model-repository", str(repo), "--json", "--node-gpus", "none"])
    doc = json.loads(out.getvalue())
    assert code == 0, doc["misfits"]
    return doc


def exported_bytes(server: TritonServer, plan: dict) -> dict:
    """Per model, the sum of its ``trec_table_bytes`` and ``trec_cache_bytes`` series,
    once every model with tables exports them (the instances publish their metrics
    every second: polled for up to a minute)."""
    tabled = {n for n, m in plan["models"].items() if m["host_bytes"]}
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
            text = r.read().decode()
        found: dict = {}
        for name, key in (("trec_table_bytes", "host_bytes"), ("trec_cache_bytes", "shm_bytes")):
            for m in re.finditer(name + r'\{[^}]*model="([^"]+)"[^}]*\} (\S+)', text):
                model = found.setdefault(m.group(1), {"host_bytes": 0, "shm_bytes": 0})
                model[key] += int(float(m.group(2)))
        complete = all(found.get(n, {}).get("host_bytes") for n in tabled)
        if complete or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def files_bytes(folder: Path, pattern: str = "*") -> int:
    return sum(f.stat().st_size for f in folder.rglob(pattern) if f.is_file())


@pytest.mark.parametrize("make_repo", [demo_repository, criteo_int8_repository])
def test_the_plan_is_what_the_loaded_server_holds(make_repo, tmp_path_factory, tmp_path):
    repo = make_repo(tmp_path_factory)
    plan = plan_json(repo)
    store = tmp_path / "store"
    # the server's shared-memory files in a folder of their own (on the same tmpfs)
    shm = Path(tempfile.mkdtemp(prefix="plan-test-", dir=shm_dir()))
    env = {STORE_ENV: str(store), SHM_DIR_VARIABLE: str(shm)}
    server = TritonServer(repo, log_path=tmp_path / "server.log", env=env).start()
    try:
        assert server.failed_models() == []
        exported = exported_bytes(server, plan)
        held = {
            "host_bytes": files_bytes(store / "layouts", "*.tbl"),
            "shm_bytes": files_bytes(shm),
        }
        log = (tmp_path / "server.log").read_text(errors="replace")
    finally:
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
    for key, actual in held.items():
        planned = plan["totals"][key]
        assert planned > 0
        assert abs(actual - planned) <= TOLERANCE * planned, (key, planned, actual)
    # the load log: one line per model the backends load, the plan's figures exactly
    logged = {
        m["model"]: {"host_bytes": int(m["host"]), "shm_bytes": int(m["shm"])}
        for m in map(SIZING_LINE.search, log.splitlines())
        if m
    }
    sized = {n for n, m in plan["models"].items() if m["backend"] in ("hps", "hugectr", "dense")}
    assert set(logged) == sized
    for name, figures in logged.items():
        model = plan["models"][name]
        assert figures == {"host_bytes": model["host_bytes"], "shm_bytes": model["shm_bytes"]}
    lines = [line for line in log.splitlines() if SIZING_LINE.search(line)]
    assert len(lines) == len(sized)  # once per model, whatever its instance count
    # and while they serve, the metrics say what each model's tables and caches hold
    for name, model in plan["models"].items():
        if model["host_bytes"]:
            want = {"host_bytes": model["host_bytes"], "shm_bytes": model["shm_bytes"]}
            assert exported.get(name) == want, name
