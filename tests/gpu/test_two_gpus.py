"""Several GPUs per node: a KIND_GPU instance group over ``gpus: [0, 1]`` serves from one
cache per (model, device), each request on its instance's device (``DeviceID``), every
answer the KIND_CPU server's bit for bit; a GPU that ps.json's ``deployed_device_list``
lacks fails the load with HPS's message. The first test needs two GPUs (on a node with one
it is skipped, saying so); CI runs the same paths against the fake driver's two devices
(tests/native/gpu_host_paths.cpp, test_two_devices)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from clients.raw_http import Client
from triton_rec.triton.runtime import TritonServer

from .test_served_gpu import _demo_keys, make_repository

HPS_OUT = ("OUTPUT0", "DeviceID")


def _gpu_count(cupy) -> int:
    return int(cupy.cuda.runtime.getDeviceCount())


def _on_gpus(path: Path, kind: str, gpus: str, deployed: list) -> Path:
    """The demo repository with hps_demo alone, its instance group ``kind`` (one instance
    per GPU of ``gpus``), ps.json's ``deployed_device_list`` ``deployed``."""
    repo = make_repository(path, kind)
    cfg = repo / "hps_demo" / "config.pbtxt"
    text = re.sub(r"instance_group \[.*?\]\s*\n", "", cfg.read_text(), flags=re.S)
    group = f"kind: {kind}" + (f" gpus: [ {gpus} ]" if kind == "KIND_GPU" else "")
    cfg.write_text(text + f"instance_group [ {{ count: 1 {group} }} ]\n")
    ps = json.loads((repo / "ps.json").read_text())
    for m in ps["models"]:
        m["deployed_device_list"] = deployed
    (repo / "ps.json").write_text(json.dumps(ps, indent=1))
    return repo


def test_an_instance_group_over_two_gpus_serves_from_each(cupy, tmp_path):
    n = _gpu_count(cupy)
    if n < 2:
        pytest.skip(f"needs two GPUs; this node has {n}")
    gpu_repo = _on_gpus(tmp_path / "gpu", "KIND_GPU", "0, 1", [0, 1])
    cpu_repo = _on_gpus(tmp_path / "cpu", "KIND_CPU", "", [0])
    env = {"TRITON_REC_STORE": str(tmp_path / "store")}

    def server(repo, log):
        return TritonServer(
            repo, log_path=tmp_path / log, env=env, explicit=True, load_models=["hps_demo"]
        )

    with server(gpu_repo, "gpu.log") as gpu, server(cpu_repo, "cpu.log") as cpu:
        log = (tmp_path / "gpu.log").read_text()
        for d in (0, 1):
            assert f"KIND_GPU instance on GPU {d}: embedding cache on the GPU: yes" in log, d
        pools, rng = _demo_keys(), np.random.default_rng(5)
        requests = []
        for batch in [1, 7, 64, 200] * 8:
            keys = [rng.choice(p, batch * k) for p, k in zip(pools, (4, 1))]
            requests.append(
                {
                    "KEYS": np.concatenate(keys).astype(np.int64)[None, :],
                    "NUMKEYS": np.array([len(k) for k in keys], np.int32)[None, :],
                }
            )

        def ask(url, inputs):
            c = Client(url)
            try:
                return c.infer("hps_demo", inputs, HPS_OUT, {"exact": True})
            finally:
                c.close()

        with ThreadPoolExecutor(8) as pool:  # concurrent: both instances busy
            got = list(pool.map(lambda r: ask(gpu.http_url, r), requests * 2))
        want = [ask(cpu.http_url, r) for r in requests * 2]
        for g, w in zip(got, want):
            assert np.array_equal(g["OUTPUT0"].view(np.uint32), w["OUTPUT0"].view(np.uint32))
        assert {int(g["DeviceID"].reshape(-1)[0]) for g in got} == {0, 1}


def test_a_gpu_not_in_deployed_device_list_fails_the_load_naming_it(cupy, tmp_path):
    repo = _on_gpus(tmp_path / "repo", "KIND_GPU", "0", [7])
    env = {"TRITON_REC_STORE": str(tmp_path / "store")}
    with TritonServer(repo, log_path=tmp_path / "s.log", env=env, explicit=True) as srv:
        req = urllib.request.Request(
            f"http://{srv.http_url}/v2/repository/models/hps_demo/load", data=b"", method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=120).close()
        body = e.value.read().decode()
        assert (
            "Please confirm that device 0 is added to 'deployed_device_list' in the ps "
            "configuration file (it lists [7])"
        ) in body, body
        assert srv.is_ready()
