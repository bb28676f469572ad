"""The shipped demo repository (what `make serve` serves), the CLI client and perf_analyzer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ps_loader.synthetic import DEMO_MODELS, DEMO_SEED, expected_vectors, table_keys
from tests.e2e.conftest import DEMO_REPO

VENV_BIN = Path(sys.executable).parent


def _expected(model, keys_per_table):
    parts = []
    for t, (spec, keys) in enumerate(zip(DEMO_MODELS[model], keys_per_table)):
        known = set(table_keys(DEMO_SEED, t, spec.rows).tolist())
        v = expected_vectors(DEMO_SEED, t, np.asarray(keys, np.int64), spec.vec_size)
        v[[int(k) not in known for k in keys]] = spec.default_value
        parts.append(v.reshape(-1))
    return np.concatenate(parts)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_cli_client_gets_correct_vectors_from_the_demo_model(demo_server, protocol):
    url = demo_server.http_url if protocol == "http" else demo_server.grpc_url
    cmd = [
        str(VENV_BIN / "triton-rec-client"),
        "--url",
        url,
        "--protocol",
        protocol,
        "--model",
        "hps_demo",
        "--ps-json",
        str(DEMO_REPO / "ps.json"),
        "--samples",
        "3",
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["counts"] == [12, 3]
    np.testing.assert_array_equal(
        np.array(result["output"], np.float32), _expected("hps_demo", result["keys"])
    )


def test_the_cli_client_sends_keys_given_by_hand_and_unknown_keys_get_defaults(demo_server):
    known = table_keys(DEMO_SEED, 0, DEMO_MODELS["hps_demo"][0].rows)[:2].tolist()
    cmd = [
        str(VENV_BIN / "triton-rec-client"),
        "--url",
        demo_server.http_url,
        "--model",
        "hps_demo",
        "--table",
        ",".join(str(k) for k in known + [123]),
        "--table",
        "",
        "--json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = np.array(json.loads(done.stdout)["output"], np.float32)
    np.testing.assert_array_equal(out, _expected("hps_demo", [known + [123], []]))


def test_the_cli_client_reports_server_errors(demo_server):
    cmd = [
        str(VENV_BIN / "triton-rec-client"),
        "--url",
        demo_server.http_url,
        "--model",
        "hps_demo",
        "--table",
        "1,2",
    ]  # one table only: the model has two
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "NUMKEYS has 1 counts but the model has 2 tables" in done.stderr


def _perf_analyzer_env():
    import nvidia.cuda_runtime

    lib = os.path.join(list(nvidia.cuda_runtime.__path__)[0], "lib")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    return env


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_drives_the_demo_model_with_generated_inputs(demo_server, protocol, tmp_path):
    data = tmp_path / "input.json"
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "triton_rec.clients.perf_inputs",
            "--ps-json",
            str(DEMO_REPO / "ps.json"),
            "--model",
            "hps_demo",
            "--samples",
            "4",
            "--requests",
            "8",
            "--unknown-fraction",
            "0.01",
            "--out",
            str(data),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gen.returncode == 0, gen.stderr
    content = json.loads(data.read_text())["data"]
    assert len(content) == 8 and len(content[0]["KEYS"]["content"]) == 4 * 4 + 4 * 1
    url = demo_server.http_url if protocol == "http" else demo_server.grpc_url
    cmd = [
        str(VENV_BIN / "perf_analyzer"),
        "-m",
        "hps_demo",
        "-u",
        url,
        "-i",
        protocol,
        "--input-data",
        str(data),
        "--concurrency-range",
        "2",
        "--measurement-mode",
        "count_windows",
        "--measurement-request-count",
        "100",
        "--max-trials",
        "3",
        "--stability-percentage",
        "1000",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env=_perf_analyzer_env()
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Throughput" in done.stdout
    assert "error" not in done.stdout.lower(), done.stdout
