"""End to end, the server's life cycle through the launcher (`python -m triton_rec.runtime
serve`, what `make serve` runs), issue 24: a repository with one broken model starts and
serves the others, and reports the broken one; the broken model loads once fixed, without
a restart; `--strict-startup` keeps Triton's fail-fast."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.e2e.conftest import hps_config
from triton_rec.triton.runtime import TritonServer, free_port

SEED = 61
TABLES = [SyntheticTable("t", rows=2000, vec_size=8, max_keys_per_sample=4)]


def _repo(tmp_path):
    """hps_good and hps_broken (its table directory removed) in one repository."""
    repo = tmp_path / "repo"
    entries = []
    for name in ("hps_good", "hps_broken"):
        entries.append(
            dict(write_model(str(repo), name, TABLES, seed=SEED), hit_rate_threshold=1.0)
        )
        (repo / name / "config.pbtxt").write_text(hps_config(name, 1))
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": entries}))
    shutil.rmtree(repo / entries[1]["sparse_files"][0])
    return repo, entries[1]["sparse_files"][0]


def _launch(tmp_path, store_dir, *extra):
    ports = [free_port() for _ in range(3)]
    repo, missing = _repo(tmp_path)
    log = open(tmp_path / "launcher.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "triton_rec.runtime", "serve", "--model-repository", str(repo)]
        + [f"--http-port={ports[0]}", f"--grpc-port={ports[1]}", f"--metrics-port={ports[2]}"]
        + list(extra),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TRITON_REC_STORE": str(store_dir)},
        start_new_session=True,
    )
    srv = TritonServer(repo, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2])
    return proc, srv, log, repo, missing


def _output(tmp_path) -> str:
    return (tmp_path / "launcher.log").read_text(errors="replace")


def _infer_exact(srv, model) -> bool:
    from clients.raw_http import Client

    keys = table_keys(SEED, 0, TABLES[0].rows)[:6]
    c = Client(srv.http_url)
    try:
        out = c.infer(
            model, {"KEYS": keys[None, :], "NUMKEYS": np.array([[6]], np.int32)}, ["OUTPUT0"]
        )["OUTPUT0"]
    finally:
        c.close()
    return np.array_equal(out.reshape(-1), expected_vectors(SEED, 0, keys, 8).reshape(-1))


def _model_ready(srv, model) -> bool:
    try:
        with urllib.request.urlopen(f"http://{srv.http_url}/v2/models/{model}/ready", timeout=5):
            return True
    except OSError:
        return False


def _stop(proc, log):
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    log.close()


def test_one_broken_model_does_not_keep_the_others_from_serving(tmp_path, store_dir):
    proc, srv, log, repo, missing = _launch(tmp_path, store_dir)
    try:
        deadline = time.monotonic() + 120
        while "triton-rec: serving" not in _output(tmp_path):
            assert proc.poll() is None, _output(tmp_path)[-3000:]
            assert time.monotonic() < deadline, _output(tmp_path)[-3000:]
            time.sleep(0.2)
        time.sleep(0.5)  # the report's FAILED lines follow the first
        out = _output(tmp_path)
        # the node serves: ready, the good model exact, the broken one named with its file
        assert srv.is_ready()
        assert _infer_exact(srv, "hps_good")
        assert not _model_ready(srv, "hps_broken")
        failed = [line for line in out.splitlines() if "FAILED hps_broken" in line]
        assert failed and os.path.basename(missing) in failed[0], out[-3000:]
        assert [m["name"] for m in srv.failed_models()] == ["hps_broken"]
        # fixed on disk, loaded through the repository API: no restart
        write_model(str(repo), "hps_broken", TABLES, seed=SEED)
        req = urllib.request.Request(
            f"http://{srv.http_url}/v2/repository/models/hps_broken/load", data=b"", method="POST"
        )
        urllib.request.urlopen(req, timeout=120).close()
        assert _model_ready(srv, "hps_broken") and _infer_exact(srv, "hps_broken")
        assert srv.failed_models() == []
    finally:
        _stop(proc, log)


def test_strict_startup_keeps_fail_fast(tmp_path, store_dir):
    proc, srv, log, _, missing = _launch(tmp_path, store_dir, "--strict-startup")
    try:
        assert proc.wait(120) != 0
        out = _output(tmp_path)
        assert "failed to load" in out and os.path.basename(missing) in out, out[-3000:]
    finally:
        _stop(proc, log)


@pytest.mark.parametrize("strict", [False, True])
def test_the_server_command_follows_the_startup_mode(tmp_path, strict):
    cmd = TritonServer(tmp_path, strict_startup=strict).command()
    assert ("--exit-on-error=false" in cmd) is not strict
