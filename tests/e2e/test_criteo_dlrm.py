"""The generated Criteo DLRM (``ps-loader criteo-dlrm``) served by a real tritonserver.

One repository, three models of the same seed and scale (fp32, fp16, int8 tables), on
both request paths (the native backend and Triton's Python backend running the engine)
and both protocols. The reference is numpy on the files on disk
(tests/criteo_reference.py), not the project's network code. Requests are the generated
perf_analyzer inputs themselves (power-law keys, ~1% in no table), sent with
``exact: true`` (every cache miss fetched now: HPS's hit-rate rule would answer the
misses of a warm request with the default, and the caches here hold 20% of tiny tables).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time

import numpy as np
import pytest

from ps_loader.criteo import write_criteo_dlrm
from tests.criteo_reference import load_dense, load_sparse_dirs, predict
from tests.e2e.conftest import client_module, make_client
from triton_rec.triton import perf_analyzer
from triton_rec.triton.runtime import TritonServer
from triton_rec.util.procfs import pss_by_mapping

SEED = 11
SCALE, MIN_ROWS = 1e-5, 200  # 26 tables of 3..400 rows, 4,832 rows in all
BATCH = 256
#: how far fp16 / int8 tables may move a prediction from the fp32 model's (documented in
#: docs/precision.md): about 5x the largest difference measured (2.1e-4 and 4.2e-3 over
#: 3 seeds x 4,096 samples of the perf inputs)
BOUND = {"fp16": 1e-3, "int8": 2e-2}
TYPES = {"DES": ("<f4", "FP32"), "CATCOLUMN": ("<i8", "INT64"), "ROWINDEX": ("<i4", "INT32")}


@pytest.fixture(scope="module")
def criteo_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("criteo-repo")
    common = dict(scale=SCALE, min_rows=MIN_ROWS, seed=SEED)
    write_criteo_dlrm(
        str(repo), name="criteo", batch_sizes=(64, BATCH), b64_from_batch=BATCH, **common
    )
    for p in ("fp16", "int8"):
        write_criteo_dlrm(str(repo), name=f"criteo_{p}", precision=p, batch_sizes=(), **common)
    version = repo / "criteo" / "1"
    bottom, top = load_dense(str(version / "criteo_dense_0.model"))
    tables = load_sparse_dirs([str(version / f"criteo{t}_sparse_0.model") for t in range(26)])
    requests = []
    for step in json.loads((repo / f"perf_criteo_{BATCH}.json").read_text())["data"]:
        assert all("b64" in v for v in step.values())  # decoded here, not by the generator
        requests.append(
            {k: np.frombuffer(base64.b64decode(v["b64"]), TYPES[k][0]) for k, v in step.items()}
        )
    return repo, (bottom, top, tables), requests


@pytest.fixture(scope="module")
def criteo_server(criteo_repo, tmp_path_factory, nothing_left_in_dev_shm, store_dir, request_path):
    repo = criteo_repo[0]
    log = tmp_path_factory.mktemp("criteo-logs") / "tritonserver.log"
    with TritonServer(
        repo, log_path=log, env={"TRITON_REC_STORE": str(store_dir)}, request_path=request_path
    ) as srv:
        yield srv, log


def _infer(server, protocol, model, des, cat):
    """Predictions of ``des [B, 13]`` and ``cat [B, 26]`` (one key per slot)."""
    return _infer_result(server, protocol, model, des, cat).as_numpy("OUTPUT0")


def _infer_result(server, protocol, model, des, cat):
    """The response (tritonclient's InferResult) to ``des [B, 13]`` and ``cat [B, 26]``."""
    b = des.shape[0]
    arrays = {
        "DES": des.reshape(1, -1).astype(np.float32),
        "CATCOLUMN": cat.reshape(1, -1).astype(np.int64),
        "ROWINDEX": np.tile(np.arange(b + 1, dtype=np.int32), 26)[None, :],
    }
    tc = client_module(protocol)
    with make_client(server, protocol) as client:
        inputs = []
        for name, a in arrays.items():
            i = tc.InferInput(name, list(a.shape), TYPES[name][1])
            i.set_data_from_numpy(a)
            inputs.append(i)
        return client.infer(model, inputs, parameters={"exact": True})


def _default_not_found(result, protocol) -> int:
    """The response parameter DefaultNotFound (the native request path sends it)."""
    if protocol == "http":
        return int(result.get_response()["parameters"]["DefaultNotFound"])
    return int(result.get_response().parameters["DefaultNotFound"].int64_param)


def _samples(requests):
    """(des [B, 13], cat [B, 26]) of every perf request, and of a sample all of whose
    keys are in no table."""
    des = np.concatenate([r["DES"].reshape(-1, 13) for r in requests])
    cat = np.concatenate([r["CATCOLUMN"].reshape(-1, 26) for r in requests])
    cat[0] = 2**31 + 12345 + np.arange(26)  # in no table: every vector the default 0
    return des, cat


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_predictions_equal_a_numpy_reference(
    criteo_server, criteo_repo, protocol, request_path
):
    # 255 and 1,024 samples: the native path looks their tables up on every idle core
    # (each_table, host.hpp), so each part's defaults must reach the response's count
    srv, _ = criteo_server
    _, net, requests = criteo_repo
    des, cat = _samples(requests)
    assert 0.003 < (cat >= 2**31).mean() < 0.03  # the perf inputs' unseen keys are in it
    want = predict(*net, des, cat)
    for a, b in ((0, 1), (1, BATCH), (BATCH, des.shape[0])):  # 1, 255 and 1,024 samples
        result = _infer_result(srv, protocol, "criteo", des[a:b], cat[a:b])
        got = result.as_numpy("OUTPUT0")
        assert got.shape == (b - a,)
        np.testing.assert_allclose(got, want[a:b], atol=1e-4, rtol=0)
        if request_path == "native":  # exact: every key no table holds, and only those
            unseen = int((cat[a:b] >= 2**31).sum())
            assert _default_not_found(result, protocol) == unseen, (a, b, unseen)


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_reduced_precision_predictions_stay_within_the_documented_bound(
    criteo_server, criteo_repo, precision
):
    srv, _ = criteo_server
    _, net, requests = criteo_repo
    des, cat = _samples(requests)
    want = predict(*net, des, cat)
    got = _infer(srv, "grpc", f"criteo_{precision}", des, cat)
    err = np.abs(got - want)
    assert err.max() <= BOUND[precision], err.max()
    assert err.max() > 1e-6  # the encoded tables were served, not the fp32 ones


def test_the_native_backend_answers_every_model_itself(criteo_server, request_path):
    # 26 tables of dim 128 in any precision, max_batch_size 65536: all on the native path
    _, log = criteo_server
    text = log.read_text()
    for model in ("criteo", "criteo_fp16", "criteo_int8"):
        assert f"successfully loaded '{model}'" in text
        if request_path == "native":
            assert f"model '{model}' instance {model}_0_0: request path native" in text, model


def test_perf_analyzer_takes_the_generated_inputs(criteo_server, criteo_repo, request_path):
    # on both request paths: no test of the suite is skipped by default
    srv, _ = criteo_server
    repo = criteo_repo[0]
    for batch in (64, BATCH):  # content lists, then b64
        cmd = perf_analyzer.command(
            ["-m", "criteo", "-b", "1", "--input-data", f"perf_criteo_{batch}.json"]
            + ["-u", srv.grpc_url, "-i", "grpc", "--measurement-mode", "count_windows"]
            + ["--measurement-request-count", "3", "--max-trials", "3"]
            + ["--stability-percentage", "1000"]
        )
        r = subprocess.run(
            cmd, cwd=repo, env=perf_analyzer.environment(), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "Successfully read data for 1 stream/streams with 4 step/steps" in r.stdout
        assert "Successful request count" in r.stdout and "error" not in r.stdout.lower()


def _anonymous_pss(pid: int) -> int:
    return pss_by_mapping(pid).get("", 0)  # heap, stacks, anonymous mappings


def _own_repository(criteo_repo, tmp_path):
    """A repository of the fp32 model alone, for a server of the test's own."""
    src, repo = criteo_repo[0], tmp_path / "repo"
    shutil.copytree(src / "criteo", repo / "criteo")
    shutil.copy(src / "ps.json", repo / "ps.json")
    return repo


def test_a_models_instances_share_one_copy_of_its_dense_network(
    criteo_repo, tmp_path, store_dir, nothing_left_in_dev_shm
):
    # The MLPerf network's weights are 9.5 MB whatever the scale: held once per instance
    # (numpy's copy and the native executor's packed one), 4 instances took 55 MB more than
    # one. Shared (HugeCTRNetwork.shared and its one native_net), they take next to nothing.
    repo = _own_repository(criteo_repo, tmp_path)
    config = repo / "criteo" / "config.pbtxt"
    one = config.read_text()
    assert "count: 1 kind: KIND_CPU" in one
    dense_bytes = (repo / "criteo" / "1" / "criteo_dense_0.model").stat().st_size
    assert dense_bytes > 9_000_000
    with TritonServer(
        repo, explicit=True, load_models=["criteo"], log_path=tmp_path / "server.log",
        env={"TRITON_REC_STORE": str(store_dir)},
    ) as srv:  # fmt: skip
        before = _anonymous_pss(srv.process.pid)
        config.write_text(one.replace("count: 1 kind: KIND_CPU", "count: 4 kind: KIND_CPU"))
        with make_client(srv, "http") as client:
            client.load_model("criteo")  # 4 new instances, then the old one goes
            assert client.is_model_ready("criteo")
        log = (tmp_path / "server.log").read_text()
        assert "model 'criteo' instance criteo_0_3: request path native" in log
        grown = _anonymous_pss(srv.process.pid) - before
        des, cat = _samples(criteo_repo[2])
        want = predict(*criteo_repo[1], des[:BATCH], cat[:BATCH])
        np.testing.assert_allclose(_infer(srv, "grpc", "criteo", des[:BATCH], cat[:BATCH]),
                                   want, atol=1e-4, rtol=0)  # fmt: skip
    assert grown < dense_bytes, (grown, dense_bytes)


def _one_thread_server(repo, tmp_path, store_dir) -> TritonServer:
    """A server of ``repo``'s criteo model alone, native path, one dense thread."""
    return TritonServer(
        repo, explicit=True, load_models=["criteo"], log_path=tmp_path / "server.log",
        env={"TRITON_REC_STORE": str(store_dir), "TRITON_REC_DENSE_THREADS": "1"},
        request_path="native",
    )  # fmt: skip


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def test_a_large_request_holds_one_chunk_of_vectors_at_a_time(
    criteo_repo, tmp_path, store_dir, nothing_left_in_dev_shm
):
    # A request's 26 tables' vectors are 13 KB a sample: a batch of 16,384 held 218 MB of
    # them at once (872 MB at 65,536, per instance). The native path looks them up, combines
    # and runs a chunk of samples at a time (combine_and_predict; 288 with one dense thread),
    # so the server's peak memory grows by a few chunks' worth, and the answers across the
    # chunks' boundaries are the reference's.
    repo = _own_repository(criteo_repo, tmp_path)
    des, cat = _samples(criteo_repo[2])
    want = predict(*criteo_repo[1], des, cat)
    copies = 16
    with _one_thread_server(repo, tmp_path, store_dir) as srv:
        pid = srv.process.pid
        np.testing.assert_allclose(_infer(srv, "grpc", "criteo", des, cat), want,
                                   atol=1e-4, rtol=0)  # fmt: skip
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # the peak resident set restarts from the current one
        before = _peak_rss(pid)
        big_des, big_cat = np.tile(des, (copies, 1)), np.tile(cat, (copies, 1))
        got = _infer(srv, "grpc", "criteo", big_des, big_cat)
        grown = _peak_rss(pid) - before
    assert got.shape == (copies * des.shape[0],)
    np.testing.assert_allclose(got, np.tile(want, copies), atol=1e-4, rtol=0)
    all_vectors = big_cat.size * 128 * 4
    assert all_vectors > 200_000_000
    assert grown < all_vectors // 4, (grown, all_vectors)


def test_instances_answering_one_request_at_a_time_share_one_requests_buffers(
    criteo_repo, tmp_path, store_dir, nothing_left_in_dev_shm
):
    # What a request of 2,048 samples holds while it runs (its keys and row pointers, one
    # chunk's vectors, the network's activations: about 7 MB with one dense thread) comes
    # from one pool of the server (ScratchLease), not from each instance's thread: four
    # instances answering one request at a time (Triton hands them round) hold one set,
    # where each kept its own before (grown 4x as much). Once no request has used them for
    # a second (idle_pool.hpp) they are given back: the server, idle, holds them no more
    # (kept for good before). With jemalloc, the server's allocator: under glibc's malloc
    # what is given back depends on where in its arenas the buffers lay (a thread's arena's
    # top stays: idle_pool.hpp's release_freed).
    repo = _own_repository(criteo_repo, tmp_path)
    config = repo / "criteo" / "config.pbtxt"
    one = config.read_text()
    config.write_text(one.replace("count: 1 kind: KIND_CPU", "count: 4 kind: KIND_CPU"))
    des, cat = _samples(criteo_repo[2])
    copies = 2
    big_des, big_cat = np.tile(des, (copies, 1)), np.tile(cat, (copies, 1))
    want = np.tile(predict(*criteo_repo[1], des, cat), copies)
    with _one_thread_server(repo, tmp_path, store_dir) as srv:
        pid = srv.process.pid
        small = _infer(srv, "grpc", "criteo", des[:8], cat[:8])  # every path warmed up once
        np.testing.assert_allclose(small, want[:8], atol=1e-4, rtol=0)
        before = _anonymous_pss(pid)
        np.testing.assert_allclose(_infer(srv, "grpc", "criteo", big_des, big_cat), want,
                                   atol=1e-4, rtol=0)  # fmt: skip
        one_request = _anonymous_pss(pid) - before
        for _ in range(7):
            np.testing.assert_allclose(_infer(srv, "grpc", "criteo", big_des, big_cat), want,
                                       atol=1e-4, rtol=0)  # fmt: skip
        eight_requests = _anonymous_pss(pid) - before
        deadline, idle = time.monotonic() + 20, eight_requests
        while idle >= one_request / 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            idle = _anonymous_pss(pid) - before
        served = (tmp_path / "server.log").read_text()
    assert one_request > 4_000_000, one_request  # the request's buffers were counted
    assert eight_requests < 2 * one_request, (one_request, eight_requests)
    assert idle < one_request / 2, (one_request, eight_requests, idle)
    assert "criteo_0_3: request path native" in served
