"""Fixtures that start a real tritonserver (PyPI wheel) on free loopback ports."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, write_model
from triton_rec.triton.runtime import REQUEST_PATHS, TritonServer

SEED = 5
HERE = Path(__file__).parent
DEMO_REPO = HERE.parents[1] / "model_repository"
WDL_TABLES = [
    SyntheticTable(
        "embedding_table1", rows=3000, vec_size=1, max_keys_per_sample=2, default_value=0.0
    ),
    SyntheticTable(
        "embedding_table2", rows=20000, vec_size=16, max_keys_per_sample=26, default_value=0.0
    ),
]
TWO_TABLES = [
    SyntheticTable("item", rows=5000, vec_size=32, max_keys_per_sample=3, default_value=-1.5),
    SyntheticTable("user", rows=1000, vec_size=8, max_keys_per_sample=1, default_value=2.0),
]
# hps_mapped: one table and no cache (its rows from the mapped node-store table): the
# native path looks up a large request's keys of it in ranges, on every idle core.
MAPPED_TABLE = [
    SyntheticTable("big", rows=50_000, vec_size=16, max_keys_per_sample=26, default_value=-3.0)
]
HPS_IO = """
input [
  { name: "KEYS" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },
  { name: "NUMKEYS" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true }
]
"""


def hps_config(
    name: str,
    count: int,
    outputs: str = '{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }',
    extra: str = "",
) -> str:
    return (
        f'name: "{name}"\nbackend: "hps"\nmax_batch_size: 1024\n{HPS_IO}'
        f"output [ {outputs} ]\n"
        "dynamic_batching { max_queue_delay_microseconds: 500 }\n"
        f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n{extra}"
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory) -> Path:
    """A repository with the WDL sample layout, a second two-table model, and broken models."""
    repo = tmp_path_factory.mktemp("models")
    wdl = write_model(str(repo), "hps_wdl", WDL_TABLES, seed=SEED)
    two = write_model(str(repo), "hps_two", TWO_TABLES, seed=SEED + 1)
    two["max_batch_size"] = 64
    # The WDL model uses the upstream sample's config.pbtxt with only the instance
    # kind changed (no GPU here) and ragged batching allowed.
    upstream = (HERE.parent / "data" / "hps_wdl_upstream_config.pbtxt").read_text()
    cpu = upstream.replace("kind : KIND_GPU\n    gpus:[0]", "kind : KIND_CPU")
    assert cpu != upstream
    cpu = cpu.replace(
        'dims: [ -1 ]\n  },\n  {\n    name: "NUMKEYS"',
        'dims: [ -1 ]\n    allow_ragged_batch: true\n  },\n  {\n    name: "NUMKEYS"',
    )
    _write(repo / "hps_wdl" / "config.pbtxt", cpu)
    # hps_two: instance count 2, ps.json found through the `ps` parameter, info outputs.
    outs = (
        '{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },'
        '{ name: "NumSample" data_type: TYPE_INT32 dims: [ 1 ] },'
        '{ name: "DeviceID" data_type: TYPE_INT32 dims: [ 1 ] },'
        '{ name: "DefaultNotFound" data_type: TYPE_INT32 dims: [ 1 ] },'
        '{ name: "DefaultAsync" data_type: TYPE_INT32 dims: [ 1 ] }'
    )
    _write(
        repo / "hps_two" / "config.pbtxt",
        hps_config(
            "hps_two", 2, outs, 'parameters { key: "ps" value: { string_value: "conf/two.json" } }'
        ),
    )
    _write(
        repo / "hps_two" / "conf" / "two.json",
        json.dumps(
            {
                "supportlonglong": True,
                "models": [
                    {
                        **two,
                        "sparse_files": [os.path.join("..", "..", f) for f in two["sparse_files"]],
                    }
                ],
            }
        ),
    )

    mapped = dict(write_model(str(repo), "hps_mapped", MAPPED_TABLE, seed=SEED + 2), gpucache=False)
    _write(
        repo / "hps_mapped" / "config.pbtxt",
        hps_config(
            "hps_mapped",
            1,
            '{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] },'
            '{ name: "DefaultNotFound" data_type: TYPE_INT32 dims: [ 1 ] }',
        ),
    )

    # Broken models, loaded on demand by the tests.
    missing = dict(
        wdl, model="bad_missing", sparse_files=[wdl["sparse_files"][0], "nowhere/t1_sparse_0.model"]
    )
    trunc = write_model(str(repo), "bad_truncated", WDL_TABLES, seed=SEED)
    vec_file = repo / trunc["sparse_files"][1] / "emb_vector"
    vec_file.write_bytes(vec_file.read_bytes()[:-6])
    # hps_flat: the same WDL files, max_batch_size 0 (the layout used inside ensembles),
    # so KEYS/NUMKEYS are sent 1-D ([280] and [2]).
    flat = dict(wdl, model="hps_flat")
    _write(
        repo / "hps_flat" / "config.pbtxt",
        hps_config("hps_flat", 1)
        .replace("max_batch_size: 1024", "max_batch_size: 0")
        .replace("dynamic_batching { max_queue_delay_microseconds: 500 }\n", "")
        .replace(" allow_ragged_batch: true", ""),
    )
    (repo / "hps_flat" / "1").mkdir(parents=True, exist_ok=True)
    for name in ("bad_missing", "bad_truncated"):
        _write(repo / name / "config.pbtxt", hps_config(name, 1))
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
    _write(
        repo / "ps.json",
        json.dumps(
            {"supportlonglong": True, "models": [wdl, flat, mapped, missing, trunc]}, indent=1
        ),
    )
    return repo


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory) -> Path:
    """The node-local table store the test servers use (never the user's default)."""
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="session", params=REQUEST_PATHS)
def request_path(request):
    """The main suites run on both request paths: the native backend (the default) and
    Triton's Python backend. Servers a test starts itself use the default."""
    return request.param


@pytest.fixture(scope="session")
def server(model_repo, tmp_path_factory, nothing_left_in_dev_shm, store_dir, request_path):
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    srv = TritonServer(
        model_repo,
        explicit=True,
        load_models=["hps_wdl", "hps_two", "hps_flat", "hps_mapped"],
        log_path=log,
        env={"TRITON_REC_STORE": str(store_dir)},
        request_path=request_path,
    )
    srv.start()
    yield srv
    srv.stop()


def shm_entries():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="session")
def nothing_left_in_dev_shm():
    """The server and our backends leave nothing behind in /dev/shm (checked after the
    servers that depend on this fixture have stopped)."""
    before = shm_entries()
    yield
    leftover = {e for e in shm_entries() - before if "triton" in e.lower() or "trec" in e.lower()}
    assert not leftover, f"left in /dev/shm: {sorted(leftover)}"


def client_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as tc
    else:
        import tritonclient.grpc as tc
    return tc


@contextlib.contextmanager
def make_client(server, protocol):
    """A client that is closed afterwards (open connections delay the server's shutdown
    past its exit timeout, and then Triton kills the backend stubs uncleanly)."""
    tc = client_module(protocol)
    client = tc.InferenceServerClient(server.http_url if protocol == "http" else server.grpc_url)
    try:
        yield client
    finally:
        client.close()


def infer_raw(server, protocol, model, inputs, outputs=("OUTPUT0",)):
    """inputs: list of (name, np.ndarray, triton dtype). Returns the result object."""
    tc = client_module(protocol)
    with make_client(server, protocol) as client:
        ins = []
        for name, arr, dtype in inputs:
            i = tc.InferInput(name, list(arr.shape), dtype)
            i.set_data_from_numpy(arr)
            ins.append(i)
        outs = [tc.InferRequestedOutput(o) for o in outputs]
        return client.infer(model, ins, outputs=outs)


@pytest.fixture(params=["http", "grpc"])
def protocol(request):
    return request.param


__all__ = ["np"]


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory, nothing_left_in_dev_shm, store_dir, request_path):
    """The shipped model repository, as `make serve` serves it (generated by `make demo`)."""
    import subprocess
    import sys

    if not (DEMO_REPO / "hps_demo" / "1" / "hps_demo0_sparse_0.model" / "key").exists():
        subprocess.run([sys.executable, "-m", "ps_loader", "demo", str(DEMO_REPO)], check=True)
    if not (DEMO_REPO / "dlrm" / "1" / "dlrm_dense_0.model").exists():
        subprocess.run([sys.executable, str(DEMO_REPO / "dlrm" / "train.py")], check=True)
    log = tmp_path_factory.mktemp("demo-logs") / "tritonserver.log"
    with TritonServer(
        DEMO_REPO, log_path=log, env={"TRITON_REC_STORE": str(store_dir)}, request_path=request_path
    ) as srv:
        yield srv
