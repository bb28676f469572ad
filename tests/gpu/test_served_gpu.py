"""Served on the GPU: the demo repository with every instance group KIND_GPU (native request
path) answers as the same repository on KIND_CPU in a second server: hps lookups bit for
bit (device cache; static and uvm tables held whole), the HugeCTR DLRM, its dense model
and its ensemble within float32 rounding. The load log says what runs on the GPU. The
Python request path is refused where the 2.51 stub cannot read numpy >= 2 arrays."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from clients.raw_http import Client
from triton_rec.formats.tables import read_table
from triton_rec.triton.runtime import TritonServer

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "model_repository"
HPS_OUT = ("OUTPUT0", "DefaultNotFound", "DefaultAsync")


def make_repository(path: Path, kind: str) -> Path:
    """The demo repository in ``path``, every instance group of ``kind`` (count 2), plus
    ``hps_demo_static`` and ``hps_demo_uvm`` (hps_demo's tables, those cache types), and
    ``dlrm_ensemble_hugectr``: the ensemble with the HugeCTR network as its dense step
    (``dlrm_dense_hugectr``, ps.json entry ``dlrm``), which the native path runs."""
    shutil.copytree(DEMO, path)
    for src, name, old, new in (
        ("dlrm_dense", "dlrm_dense_hugectr", 'string_value: "dlrm_hps"', 'string_value: "dlrm"'),
        (
            "dlrm_ensemble",
            "dlrm_ensemble_hugectr",
            'model_name: "dlrm_dense"',
            'model_name: "dlrm_dense_hugectr"',
        ),
    ):
        (path / name / "1").mkdir(parents=True)
        cfg = (path / src / "config.pbtxt").read_text()
        assert old in cfg, (src, old)
        cfg = cfg.replace(f'name: "{src}"', f'name: "{name}"', 1).replace(old, new)
        (path / name / "config.pbtxt").write_text(cfg)
    for cfg in path.glob("*/config.pbtxt"):
        text = re.sub(r"kind:\s*KIND_\w+", f"kind: {kind}", cfg.read_text())
        cfg.write_text(text)
    ps = json.loads((path / "ps.json").read_text())
    demo = next(m for m in ps["models"] if m["model"] == "hps_demo")
    for mode in ("static", "uvm"):
        name = f"hps_demo_{mode}"
        ps["models"].append(dict(demo, model=name, embedding_cache_type=mode))
        (path / name).mkdir()
        cfg = (path / "hps_demo" / "config.pbtxt").read_text()
        (path / name / "config.pbtxt").write_text(cfg.replace('"hps_demo"', f'"{name}"'))
        (path / name / "1").mkdir()
    for cfg in path.glob("*/config.pbtxt"):  # the optional default-answer outputs
        if 'backend: "hps"' in cfg.read_text() and "DefaultAsync" not in cfg.read_text():
            cfg.write_text(
                cfg.read_text().replace(
                    '{ name: "DeviceID" data_type: TYPE_INT32 dims: [ 1 ] }',
                    '{ name: "DeviceID" data_type: TYPE_INT32 dims: [ 1 ] },'
                    '{ name: "DefaultNotFound" data_type: TYPE_INT32 dims: [ 1 ] },'
                    '{ name: "DefaultAsync" data_type: TYPE_INT32 dims: [ 1 ] }',
                )
            )
    (path / "ps.json").write_text(json.dumps(ps, indent=1))
    return path


@pytest.fixture(scope="module")
def servers(cupy, tmp_path_factory):
    if not (DEMO / "hps_demo" / "1" / "hps_demo0_sparse_0.model").exists():
        pytest.fail("the demo repository is not built (make demo / python -m ps_loader demo)")
    tmp = tmp_path_factory.mktemp("served")
    gpu_repo = make_repository(tmp / "gpu", "KIND_GPU")
    cpu_repo = make_repository(tmp / "cpu", "KIND_CPU")
    env = {"TRITON_REC_STORE": str(tmp / "store")}
    with TritonServer(gpu_repo, log_path=tmp / "gpu.log", env=env) as gpu:
        with TritonServer(cpu_repo, log_path=tmp / "cpu.log", env=env) as cpu:
            yield gpu, cpu, tmp


def _demo_keys():
    ps = json.loads((DEMO / "ps.json").read_text())
    demo = next(m for m in ps["models"] if m["model"] == "hps_demo")
    return [
        read_table(str(DEMO / f), v)[0]
        for f, v in zip(demo["sparse_files"], demo["embedding_vecsize_per_table"])
    ]


def test_the_load_log_names_the_gpu_path(servers):
    _, _, tmp = servers
    log = (tmp / "gpu.log").read_text()
    for model in (
        "hps_demo",
        "dlrm",
        "dlrm_hps",
        "hps_demo_static",
        "hps_demo_uvm",
        "dlrm_dense_hugectr",
    ):
        assert re.search(rf"model '{model}' instance \S+: request path native", log), model
    assert "embedding cache on the GPU: yes" in log
    assert "dense executor on the GPU: yes" in log


@pytest.mark.parametrize("model", ["hps_demo", "hps_demo_static", "hps_demo_uvm", "dlrm_hps"])
def test_hps_lookups_on_the_gpu_are_the_cpu_answers_bit_for_bit(servers, model):
    gpu, cpu, _ = servers
    rng = np.random.default_rng(3)
    if model == "dlrm_hps":
        ps = json.loads((DEMO / "ps.json").read_text())
        m = next(x for x in ps["models"] if x["model"] == "dlrm_hps")
        pools = [
            read_table(str(DEMO / f), v)[0]
            for f, v in zip(m["sparse_files"], m["embedding_vecsize_per_table"])
        ]
        per_sample = m["maxnum_catfeature_query_per_table_per_sample"]
    else:
        pools, per_sample = _demo_keys(), [4, 1]
    outs = HPS_OUT if model != "dlrm_hps" else ("OUTPUT0",)  # dlrm_hps declares OUTPUT0 only
    g, c = Client(gpu.http_url), Client(cpu.http_url)
    for i, batch in enumerate([1, 7, 64, 64, 64, 200]):
        keys = [rng.choice(p, batch * n) for p, n in zip(pools, per_sample)]
        keys[0][:3] = [-5, -6, 2**62 + 11]  # keys no table holds: the default value
        inputs = {
            "KEYS": np.concatenate(keys).astype(np.int64),
            "NUMKEYS": np.array([len(k) for k in keys], np.int32),
        }
        if model != "dlrm_hps":  # max_batch_size > 0: a batch dimension
            inputs = {k: v[None, :] for k, v in inputs.items()}
        exact = {"exact": True} if i % 2 == 0 else None  # every miss fetched: comparable
        got = g.infer(model, inputs, outs, exact if model != "dlrm_hps" else {"exact": True})
        want = c.infer(model, inputs, outs, {"exact": True})
        if "DefaultAsync" in got and int(got["DefaultAsync"].sum()):
            continue  # misses answered with the default by HPS's hit-rate rule
        assert np.array_equal(got["OUTPUT0"].view(np.uint32), want["OUTPUT0"].view(np.uint32))
        if "DefaultNotFound" in got:
            assert int(got["DefaultNotFound"].sum()) == 3


def _dlrm_data(n):
    from examples.dlrm.torch_dlrm import HiddenModel, load_trained

    model = load_trained(str(DEMO / "dlrm" / "1"))
    meta = json.loads((DEMO / "dlrm" / "1" / "dlrm_meta.json").read_text())
    return HiddenModel(model.config, meta["seed"]).sample(n, np.random.default_rng(42))


def test_the_dlrm_on_the_gpu_answers_as_on_the_cpu(servers):
    gpu, cpu, _ = servers
    data = _dlrm_data(400)
    g, c = Client(gpu.http_url), Client(cpu.http_url)
    a = 0
    for n in (1, 7, 64, 1, 128, 199):
        req = data.hugectr_request(a, a + n)
        inputs = {k: v[None, :] for k, v in req.items()}
        got = g.infer("dlrm", inputs, ("OUTPUT0",), {"exact": True})["OUTPUT0"]
        want = c.infer("dlrm", inputs, ("OUTPUT0",), {"exact": True})["OUTPUT0"]
        # upstream HugeCTR's [num_samples] (hot_paths.cpp), from either server
        assert got.shape == want.shape == (n,), (got.shape, want.shape)
        np.testing.assert_allclose(got.reshape(-1), want.reshape(-1), rtol=1e-5, atol=2e-6)
        a += n


def test_the_ensemble_on_the_gpu_answers_as_on_the_cpu(servers):
    gpu, cpu, _ = servers
    data = _dlrm_data(100)
    g, c = Client(gpu.http_url), Client(cpu.http_url)
    for a, b in ((0, 1), (1, 33), (33, 100)):
        inputs = data.ensemble_request(a, b)
        got = g.infer("dlrm_ensemble", inputs, ("PREDICTION",))["PREDICTION"]
        want = c.infer("dlrm_ensemble", inputs, ("PREDICTION",))["PREDICTION"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("model", ["dlrm_ensemble_hugectr", "dlrm_dense_hugectr"])
def test_the_hugectr_dense_step_on_the_gpu_answers_as_on_the_cpu(servers, model):
    """The ``dense`` backend's native GPU path: EMBEDDINGS and ROWINDEX to the device, the
    slots combined by the combine kernel, the network's graph of the request's bucket.
    Batches of 300 and 1,024 samples run as graphs (the load's calibration keeps only
    batches the host runs at least twice as fast on the host: up to 16 on an H200), the
    small ones on the host; each answer is the KIND_CPU server's within float32 rounding."""
    gpu, cpu, _ = servers
    data = _dlrm_data(1400)
    g, c = Client(gpu.http_url), Client(cpu.http_url)
    a = 0
    for n in (1, 7, 64, 300, 1024):
        inputs = data.ensemble_request(a, a + n)
        if model == "dlrm_dense_hugectr":  # the looked-up vectors, from the CPU server
            emb = c.infer("dlrm_hps", {k: inputs[k] for k in ("KEYS", "NUMKEYS")}, ("OUTPUT0",))
            inputs = {
                "DES": inputs["DES"],
                "EMBEDDINGS": emb["OUTPUT0"].reshape(-1),
                "ROWINDEX": inputs["ROWINDEX"],
            }
            out = "OUTPUT0"
        else:
            out = "PREDICTION"
        got = g.infer(model, inputs, (out,))[out]
        want = c.infer(model, inputs, (out,))[out]
        assert got.size == want.size == n
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
        a += n


def test_no_well_formed_request_on_the_gpu_enters_python_misses_included(servers):
    """The requests above missed the demo caches (half of each table on the device): their
    misses were answered in C++ (LocalMisses with the device cache's write kernel), not by
    a call into Python. Checked on the server's trec_python_calls_total, after a cold
    request of every key of a table and a warm one (default answers). Until the device
    caches had a MissCache, each request with a miss made one (what="misses")."""
    import urllib.request

    gpu, _, _ = servers
    g = Client(gpu.http_url)
    keys = _demo_keys()
    for exact in ({"exact": True}, None):
        for start in range(0, len(keys[1]), 200):  # 200 samples of [4, 1] keys a request
            part = keys[1][start : start + 200]
            first = np.resize(keys[0][start:], 4 * len(part))
            inputs = {
                "KEYS": np.concatenate([first, part])[None, :].astype(np.int64),
                "NUMKEYS": np.array([[len(first), len(part)]], np.int32),
            }
            g.infer("hps_demo", inputs, ("OUTPUT0",), exact)

    def fetched(text):
        return sum(
            float(ln.rsplit(" ", 1)[1])
            for ln in text.splitlines()
            if ln.startswith("trec_cache_sync_fetched_total") and 'model="hps_demo"' in ln
        )

    deadline = time.monotonic() + 20  # the instances publish their counters every few s
    while True:
        text = urllib.request.urlopen(gpu.metrics_url, timeout=5).read().decode()
        if fetched(text) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if fetched(text) == 0:  # what the server said about hps_demo, to tell why
        _, _, tmp = servers
        said = [ln for ln in text.splitlines() if 'model="hps_demo"' in ln and "trec_" in ln]
        warned = [
            ln
            for ln in (tmp / "gpu.log").read_text().splitlines()
            if "hps_demo" in ln and ln[:1] in "WE"
        ]
        pytest.fail(
            "no miss was fetched: the test did not miss the caches, or hps_demo's metrics "
            "were not published\n" + "\n".join(said + warned[-20:])
        )
    calls = [
        ln
        for ln in text.splitlines()
        if ln.startswith("trec_python_calls_total{")
        and float(ln.rsplit(" ", 1)[1]) > 0
        # the ensemble's dense step is the ONNX network: hosted, as on the CPU (onnxruntime's
        # C API cannot be had here, docs/upstream-notes.md); 3 requests above
        and 'model="dlrm_dense",what="request"' not in ln
    ]
    assert calls == [], calls


def test_malformed_requests_on_the_gpu_get_the_engines_error_and_the_server_stays_up(servers):
    from clients.raw_http import InferError

    gpu, _, _ = servers
    g = Client(gpu.http_url)
    with pytest.raises(InferError, match="NUMKEYS"):
        g.infer(
            "hps_demo", {"KEYS": np.zeros((1, 3), np.int64), "NUMKEYS": np.array([[1]], np.int32)}
        )
    keys = _demo_keys()
    ok = g.infer(
        "hps_demo",
        {
            "KEYS": np.array([[keys[0][0], keys[1][0]]], np.int64),
            "NUMKEYS": np.array([[1, 1]], np.int32),
        },
        ("OUTPUT0",),
        {"exact": True},
    )
    assert ok["OUTPUT0"].size == 80


def test_the_python_request_path_says_why_it_cannot_run_under_numpy_2(servers):
    from triton_rec.errors import RequestPathUnavailable

    _, _, tmp = servers
    server = TritonServer(tmp / "gpu", log_path=tmp / "py.log", request_path="python")
    if int(np.__version__.split(".")[0]) >= 2:
        with pytest.raises(RequestPathUnavailable, match="numpy"):
            server.launch()
        return
    with server:  # numpy < 2: the Python path serves the GPU models too
        keys = _demo_keys()
        out = Client(server.http_url).infer(
            "hps_demo",
            {"KEYS": np.array([[keys[0][0], keys[1][0]]], np.int64),
             "NUMKEYS": np.array([[1, 1]], np.int32)},
        )  # fmt: skip
        assert out["OUTPUT0"].size == 80
