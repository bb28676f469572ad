"""The dense networks on the GPU as CUDA graphs (triton_rec.dense.graphs) against the
numpy executor: the sample networks (upstream DCN and DeepFM, the demo DLRM) with random
weights, at batch sizes on, between and past the buckets (which sizes the buckets are:
tests/unit/test_dense_graphs.py, no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from triton_rec.dense.graphs import DenseGraphs, buckets
from triton_rec.dense.hugectr_network import HugeCTRNetwork

ROOT = Path(__file__).resolve().parents[2]
NETWORKS = [
    ROOT / "tests" / "data" / "dcn.json",
    ROOT / "tests" / "data" / "deepfm.json",
    ROOT / "model_repository" / "dlrm" / "1" / "dlrm.json",
]


@pytest.mark.parametrize("path", NETWORKS, ids=lambda p: p.stem)
def test_graphs_answer_as_the_numpy_executor(cupy, path, tmp_path):
    plan = HugeCTRNetwork.parse(str(path))
    rng = np.random.default_rng(11)
    dense_file = tmp_path / "dense.model"
    (rng.standard_normal(plan.num_params) * 0.1).astype("<f4").tofile(dense_file)
    ref = HugeCTRNetwork.load(str(path), str(dense_file))
    graphs = DenseGraphs.load(str(path), str(dense_file), None, 64, 0)
    for batch in (1, 7, 64, 150):
        dense = rng.standard_normal((batch, ref.dense_dim)).astype(np.float32)
        embs = [
            rng.standard_normal((batch, t.slot_num, t.vec_size)).astype(np.float32)
            for t in ref.tables
        ]
        want = ref.predict(dense, embs)
        got = graphs.predict(dense, embs)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"batch {batch}")
    plan_ = graphs.native_plan()
    assert [b for b, _, _ in plan_.buckets] == buckets(64)


def test_networks_loaded_on_parallel_threads_all_capture(cupy, tmp_path):
    """Triton loads models and instances on parallel threads: 8 networks captured together,
    beside a thread doing other CUDA work and one creating and freeing device caches (as
    the other models of a repository do while they load), all load and answer. On an
    H200, 16 DLRM instances loading together failed with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    before the capture lock, and a DLRM beside device caches being created with
    ``cublasSgemm failed: cuBLAS status 13`` before SETUP_LOCK and the capture retry."""
    import threading

    from triton_rec.cache.gpu_share import open_shared_cache

    path = ROOT / "model_repository" / "dlrm" / "1" / "dlrm.json"
    plan = HugeCTRNetwork.parse(str(path))
    rng = np.random.default_rng(3)
    dense_file = tmp_path / "dense.model"
    (rng.standard_normal(plan.num_params) * 0.1).astype("<f4").tofile(dense_file)
    ref = HugeCTRNetwork.load(str(path), str(dense_file))
    loaded, errors, stop = [], [], threading.Event()

    def load():
        try:
            loaded.append(DenseGraphs.load(str(path), str(dense_file), None, 256, 0))
        except Exception as e:  # noqa: BLE001 - the test reports every failure
            errors.append(e)

    def other_cuda_work():
        with cupy.cuda.Device(0):
            while not stop.is_set():
                a = cupy.random.standard_normal((64, 64), dtype=cupy.float32)
                (a @ a).sum().get()

    def device_caches():
        i = 0
        while not stop.is_set():
            shared = open_shared_cache(f"noise{i}", 1 << 14, 64, device=0, directory=str(tmp_path))
            shared.close(linger=0)
            i += 1

    noise = [threading.Thread(target=f) for f in (other_cuda_work, device_caches)]
    for t in noise:
        t.start()
    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for t in noise:
        t.join()
    assert not errors, errors
    dense = rng.standard_normal((100, ref.dense_dim)).astype(np.float32)
    embs = [
        rng.standard_normal((100, t.slot_num, t.vec_size)).astype(np.float32) for t in ref.tables
    ]
    want = ref.predict(dense, embs)
    for g in loaded:
        np.testing.assert_allclose(g.predict(dense, embs), want, rtol=1e-4, atol=1e-5)
