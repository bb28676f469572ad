"""The wheel on its own: built from this checkout, installed into a virtual environment of
its own, and run from outside the checkout, it lays out Triton's backend directory from its
package data, serves a model and answers through its namespaced clients.

The test environment sees the dependencies of the checkout's environment (numpy, the
Triton wheel, tritonclient) through a ``.pth`` line, but not its editable install of this
project: ``.pth`` files of a folder added that way are not run. The server's backend stubs
run the same environment (the launcher puts its interpreter first on ``PATH``); the test
checks in ``/proc/<pid>/maps`` that every stub runs the wheel's C++ module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.e2e.conftest import hps_config
from triton_rec.triton.runtime import free_ports
from triton_rec.util.procfs import children

ROOT = Path(__file__).resolve().parents[2]
SEED = 11
TABLES = [
    SyntheticTable("item", rows=2000, vec_size=16, max_keys_per_sample=4, default_value=-1.0),
    SyntheticTable("user", rows=500, vec_size=4, max_keys_per_sample=1, default_value=0.5),
]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A virtual environment with the wheel installed and the checkout's dependencies."""
    wheels = tmp_path_factory.mktemp("wheel")
    # The build reuses the editable install's objects in its CMake build folder
    # (build/{wheel_tag}) when it compiles with the same flags: without build isolation, with
    # the build tools `make install` put in this environment. Without them, it builds in
    # isolation (pyproject.toml's build-system requires, fetched), from scratch.
    isolation = (
        [] if importlib.util.find_spec("scikit_build_core") is None else ["--no-build-isolation"]
    )
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(wheels)]
        + [str(ROOT)]
    )
    (wheel,) = wheels.glob("triton_rec-*.whl")
    env_dir = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)])
    site = _site_packages(env_dir)
    (site / "checkout-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), wheel])
    return env_dir


def _site_packages(env_dir: Path) -> Path:
    (site,) = (env_dir / "lib").glob("python3*/site-packages")
    return site


def test_the_wheel_ships_the_engine_tools_clients_and_backends_and_nothing_else(venv):
    site = _site_packages(venv)
    top = {p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth"))}
    assert top - {"bin", "__pycache__"} == {"triton_rec", "ps_loader"}
    pkg = site / "triton_rec"
    for name in ("hps", "hugectr", "dense"):
        shipped = pkg / "triton" / "backend" / name / "model.py"
        assert shipped.read_bytes() == (ROOT / "backend" / name / "model.py").read_bytes()
    assert (pkg / "clients" / "hps_client.py").is_file()
    assert list(pkg.glob("_native*.so"))
    assert (pkg / "triton" / "native_backends" / "libtriton_trec.so").is_file()
    # the benchmarks' floor is built in a checkout, never shipped
    assert not list(site.rglob("libtriton_trec_floor.so"))
    assert not any((pkg / sub).is_symlink() for sub in ("clients", "triton/backend"))


def test_the_installed_launcher_serves_a_model_from_outside_the_checkout(venv, tmp_path):
    repo = tmp_path / "models"
    entry = write_model(str(repo), "hps_small", TABLES, seed=SEED)
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": [entry]}))
    (repo / "hps_small" / "config.pbtxt").write_text(hps_config("hps_small", 2))
    installed = _site_packages(venv)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TRITON_REC_STORE"] = str(tmp_path / "store")
    backends = tmp_path / "backends"
    cwd = str(tmp_path)  # not the checkout: nothing resolves through the current folder

    # The environment imports the wheel's engine, not the checkout's.
    code = "import triton_rec.triton.runtime as r; print(r.BACKEND_SOURCES)"
    where = _run([python, "-c", code], env=env, cwd=cwd)
    assert Path(where.stdout.strip()) == installed / "triton_rec" / "triton" / "backend"

    http, grpc, metrics = free_ports(3)
    cmd = [
        python,
        "-m",
        "triton_rec.runtime",
        "serve",
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        f"--metrics-port={metrics}",
    ]
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, http, "hps_small", tmp_path / "server.log")
        assert (backends / "hps" / "model.py").read_bytes() == (
            installed / "triton_rec" / "triton" / "backend" / "hps" / "model.py"
        ).read_bytes()
        # The native path: both instances live in the server process, whose embedded
        # interpreter runs the wheel's engine (no stub processes).
        mapping = [p for p in _descendants(proc.pid) if _maps_native(p)]
        assert len(mapping) == 1, "only the server maps the C++ module"
        assert os.path.basename(os.readlink(f"/proc/{mapping[0]}/exe")) == "tritonserver"
        assert all(str(installed) in lib for lib in _maps_native(mapping[0]))
        assert (backends / "hps" / "libtriton_hps.so").is_file()

        # The namespaced client of the wheel asks; the answer is the table's rows.
        item = table_keys(SEED, 0, TABLES[0].rows)[[3, 1999, 7]]
        user = table_keys(SEED, 1, TABLES[1].rows)[[42]]
        r = _run(
            [
                python,
                "-m",
                "triton_rec.clients.hps_client",
                "--url",
                f"127.0.0.1:{http}",
                "--model",
                "hps_small",
                "--json",
                # --table=K: keys may be negative, which argparse would take for options
                "--table=" + ",".join(str(int(k)) for k in item),
                f"--table={int(user[0])}",
            ],
            env=env,
            cwd=cwd,
        )
        got = np.asarray(json.loads(r.stdout)["output"], dtype=np.float32)
        want = np.concatenate(
            [
                expected_vectors(SEED, 0, item, 16).ravel(),
                expected_vectors(SEED, 1, user, 4).ravel(),
            ]
        )
        np.testing.assert_array_equal(got, want)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    assert proc.returncode == 0, (tmp_path / "server.log").read_text()[-3000:]


def _wait_ready(proc: subprocess.Popen, port: int, model: str, log: Path) -> None:
    deadline = time.monotonic() + 180
    url = f"http://127.0.0.1:{port}/v2/models/{model}/ready"
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{model} not ready within 180 s:\n{log.read_text()[-4000:]}")


def _descendants(pid: int):
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def _maps_native(pid: int):
    """Paths of the ``_native`` extension mapped by ``pid`` (empty if none or gone)."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
            return {line.split()[-1] for line in f if "/_native." in line}
    except OSError:
        return set()
