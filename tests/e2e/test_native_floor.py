"""The native floor backend ``trec_floor`` (src/triton_backend/floor_backend.cpp, issue 14):
a C++ Triton backend built by CMake, placed by the launcher and loaded by the wheel's
tritonserver. It answers the ``hps`` interface with zeros of the answer's size and
refuses malformed requests by name; the server stays ready."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.e2e.conftest import HPS_IO, client_module, make_client
from triton_rec.triton.runtime import TritonServer

CONFIG = (
    'name: "{name}"\nbackend: "trec_floor"\nmax_batch_size: 1024\n'
    + HPS_IO
    + 'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
    'parameters { key: "vec_sizes" value: { string_value: "{sizes}" } }\n'
)


# the hugectr interface: 2 tables, 26 slots in all
RANKING = """name: "floor_ranking"
backend: "trec_floor"
max_batch_size: 1024
input [
  { name: "DES" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true },
  { name: "CATCOLUMN" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },
  { name: "ROWINDEX" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
parameters { key: "tables" value: { string_value: "2" } }
parameters { key: "slots" value: { string_value: "26" } }
"""
# the dense interface (an ensemble's dense step): EMBEDDINGS in CATCOLUMN's place
DENSE = (
    RANKING.replace("floor_ranking", "floor_dense").replace(
        '{ name: "CATCOLUMN" data_type: TYPE_INT64', '{ name: "EMBEDDINGS" data_type: TYPE_FP32'
    )
    + 'parameters { key: "middle" value: { string_value: "EMBEDDINGS" } }\n'
)


@pytest.fixture(scope="module")
def floor_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("floor_repo")
    for name, sizes in (("floor", "16,8"), ("floor_bad", "16,x")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            CONFIG.replace("{name}", name).replace("{sizes}", sizes)
        )
    for name, cfg in (("floor_ranking", RANKING), ("floor_dense", DENSE)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(cfg)
    log = tmp_path_factory.mktemp("floor_logs") / "tritonserver.log"
    srv = TritonServer(
        repo, explicit=True, load_models=["floor", "floor_ranking", "floor_dense"], log_path=log
    )
    srv.start()
    yield srv
    srv.stop()


def _infer(server, protocol, keys, numkeys):
    tc = client_module(protocol)
    with make_client(server, protocol) as client:
        k = tc.InferInput("KEYS", list(keys.shape), "INT64")
        k.set_data_from_numpy(keys)
        n = tc.InferInput("NUMKEYS", list(numkeys.shape), "INT32")
        n.set_data_from_numpy(numkeys)
        return client.infer("floor", [k, n]).as_numpy("OUTPUT0")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_native_floor_answers_zeros_of_the_answers_size(floor_server, protocol):
    keys = np.arange(50, dtype=np.int64)[None, :]
    out = _infer(floor_server, protocol, keys, np.array([[30, 20]], np.int32))
    assert out.dtype == np.float32 and out.size == 30 * 16 + 20 * 8 and not out.any()


@pytest.mark.parametrize(
    "numkeys, needle",
    [
        (np.array([[30, 21]], np.int32), "NUMKEYS sums to 51 but KEYS has 50 keys"),
        (np.array([[50]], np.int32), "NUMKEYS has 1 counts but the model has 2 tables"),
        (np.array([[60, -10]], np.int32), "NUMKEYS[1] is negative"),
    ],
)
def test_malformed_requests_get_an_error_naming_the_problem(floor_server, numkeys, needle):
    keys = np.arange(50, dtype=np.int64)[None, :]
    with pytest.raises(Exception, match=re.escape(needle)):
        _infer(floor_server, "grpc", keys, numkeys)
    with make_client(floor_server, "http") as client:
        assert client.is_server_ready() and client.is_model_ready("floor")
    out = _infer(floor_server, "http", keys, np.array([[25, 25]], np.int32))
    assert out.size == 25 * 16 + 25 * 8


def test_a_bad_vec_sizes_parameter_fails_the_load_with_its_name(floor_server):
    with make_client(floor_server, "http") as client:
        with pytest.raises(Exception, match="vec_sizes must be a list"):
            client.load_model("floor_bad")
        assert client.is_server_ready()


@pytest.mark.parametrize(
    "model, middle",
    [
        ("floor_ranking", ("CATCOLUMN", np.int64, "INT64")),
        ("floor_dense", ("EMBEDDINGS", np.float32, "FP32")),
    ],
)
def test_the_native_floor_answers_one_zero_per_sample_on_the_whole_model_interfaces(
    floor_server, model, middle
):
    tc = client_module("grpc")
    n = 3
    arrays = {
        "DES": (np.zeros((1, n * 13), np.float32), "FP32"),
        middle[0]: (np.arange(n * 26, dtype=middle[1])[None, :], middle[2]),
        "ROWINDEX": (np.zeros((1, n * 26 + 2), np.int32), "INT32"),
    }
    with make_client(floor_server, "grpc") as client:
        inputs = []
        for name, (a, dtype) in arrays.items():
            i = tc.InferInput(name, list(a.shape), dtype)
            i.set_data_from_numpy(a)
            inputs.append(i)
        out = client.infer(model, inputs).as_numpy("OUTPUT0")
        assert out.shape == (n,) and not out.any()
        arrays["ROWINDEX"] = (np.zeros((1, n * 26 + 3), np.int32), "INT32")
        inputs[2] = tc.InferInput("ROWINDEX", [1, n * 26 + 3], "INT32")
        inputs[2].set_data_from_numpy(arrays["ROWINDEX"][0])
        with pytest.raises(
            Exception, match=re.escape("ROWINDEX has 81 values, not 2 + samples x 26")
        ):
            client.infer(model, inputs)
        assert client.is_server_ready()


def test_loadgen_counts_answers_and_failures(floor_server, tmp_path):
    """benchmarks/loadgen.cpp (the served GPU benchmark's load generator) against a real
    server: every answer counted, an error answer counted as failed with its message."""
    from clients.raw_http import encode_request
    from tests.benchmark_scripts import load_benchmark

    bench = load_benchmark("bench_gpu_served")
    exe = bench.build_loadgen(str(tmp_path))
    keys = np.arange(6, dtype=np.int64)[None, :]
    good = encode_request({"KEYS": keys, "NUMKEYS": np.array([[4, 2]], np.int32)}, ["OUTPUT0"])
    bad = encode_request({"KEYS": keys, "NUMKEYS": np.array([[4, 9]], np.int32)}, ["OUTPUT0"])
    good_file = bench.write_bodies(str(tmp_path / "good.bin"), [good] * 3)
    r = bench.run_loadgen(exe, floor_server.http_url, "floor", good_file, 2, 0.5)
    assert r["answered"] > 10 and r["failed"] == 0 and r["p50_us"] > 0
    bad_file = bench.write_bodies(str(tmp_path / "bad.bin"), [good, bad])
    with pytest.raises(RuntimeError, match="requests failed: .*NUMKEYS"):
        bench.run_loadgen(exe, floor_server.http_url, "floor", bad_file, 1, 0.3)
