"""The generated MLPerf-shaped DLRM (``ps-loader criteo-dlrm --kind KIND_GPU``) served on a
GPU: its small tables held whole on the device (ps.json ``whole_table_max_bytes``), its
large ones in caches of ``gpucacheper`` of their rows, one request looking up both kinds;
answers equal numpy on the files on disk (tests/criteo_reference.py) within 1e-4, and
each table's device memory is what the rule (deployment.device_table_mode) says."""

from __future__ import annotations

import base64
import json
import time
import urllib.request

import numpy as np
import pytest

from clients.raw_http import Client
from ps_loader.criteo import merge_ps_json, write_criteo_dlrm
from tests.criteo_reference import load_dense, load_sparse_dirs, predict
from triton_rec.cache.cuda_ipc import device_cache_bytes
from triton_rec.cache.device_table import device_table_bytes
from triton_rec.config.ps_json import load_ps_config
from triton_rec.precision import RowCodec
from triton_rec.serving.deployment import cache_rows, device_table_mode
from triton_rec.triton.runtime import TritonServer

SCALE, MIN_ROWS, SEED, BATCH = 1e-5, 200, 5, 256  # 26 tables of 3..400 rows
WHOLE_ROWS = 300  # tables of at most this many rows whole, the larger ones cached
TYPES = {"DES": "<f4", "CATCOLUMN": "<i8", "ROWINDEX": "<i4"}


@pytest.fixture(scope="module")
def criteo_gpu(cupy, tmp_path_factory):
    repo = tmp_path_factory.mktemp("criteo-gpu")
    write_criteo_dlrm(
        str(repo),
        SCALE,
        name="criteo",
        kind="KIND_GPU",
        seed=SEED,
        min_rows=MIN_ROWS,
        batch_sizes=(BATCH,),
        b64_from_batch=BATCH,
    )
    entry = next(m for m in json.loads((repo / "ps.json").read_text())["models"])
    limit = device_table_bytes(WHOLE_ROWS, RowCodec("fp32", 128))
    merge_ps_json(str(repo / "ps.json"), dict(entry, whole_table_max_bytes=limit))
    version = repo / "criteo" / "1"
    bottom, top = load_dense(str(version / "criteo_dense_0.model"))
    tables = load_sparse_dirs([str(version / f"criteo{t}_sparse_0.model") for t in range(26)])
    steps = json.loads((repo / f"perf_criteo_{BATCH}.json").read_text())["data"]
    requests = [
        {k: np.frombuffer(base64.b64decode(v["b64"]), TYPES[k]) for k, v in s.items()}
        for s in steps
    ]
    store = tmp_path_factory.mktemp("criteo-store")
    log = tmp_path_factory.mktemp("criteo-log") / "gpu.log"
    with TritonServer(repo, log_path=log, env={"TRITON_REC_STORE": str(store)}) as server:
        yield server, repo, (bottom, top, tables), requests


def test_small_tables_whole_large_ones_cached_answers_as_numpy(criteo_gpu):
    server, repo, (bottom, top, tables), requests = criteo_gpu
    rows = [len(keys) for keys, _ in tables]
    assert min(rows) <= WHOLE_ROWS < max(rows)  # both kinds in one model
    client = Client(server.http_url)
    for req in requests * 2:  # the second pass finds the caches warm
        des, cat = req["DES"].reshape(-1, 13), req["CATCOLUMN"].reshape(-1, 26)
        inputs = {k: v[None, :] for k, v in req.items()}
        got = client.infer("criteo", inputs, ("OUTPUT0",), {"exact": True})["OUTPUT0"]
        want = predict(bottom, top, tables, des, cat)
        np.testing.assert_allclose(got.reshape(-1), want, rtol=0, atol=1e-4)

    params = load_ps_config(str(repo / "ps.json")).model("criteo")
    held: dict = {}
    deadline = time.monotonic() + 10  # the instance publishes its gauges every second
    while sum(v > 0 for v in held.values()) < len(rows) and time.monotonic() < deadline:
        text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        for ln in text.splitlines():
            if ln.startswith("trec_cache_bytes{") and 'model="criteo"' in ln:
                table = ln.split('table="', 1)[1].split('"', 1)[0]
                held[table] = float(ln.rsplit(" ", 1)[1])
        time.sleep(0.5)
    codec = RowCodec("fp32", 128)
    for t, n in enumerate(rows):
        if device_table_mode(params, n, codec) == "static":
            want = device_table_bytes(n, codec)
            assert n <= WHOLE_ROWS
        else:
            assert n > WHOLE_ROWS
            want = device_cache_bytes(
                cache_rows(params, n), 128, params.cache_ways, params.cache_policy
            )
        assert held[f"C{t + 1}"] == want, (t, n)
