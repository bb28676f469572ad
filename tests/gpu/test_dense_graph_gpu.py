"""The dense networks on the GPU as CUDA graphs (triton_rec.dense.graphs) against the
numpy executor: the sample networks (upstream DCN and DeepFM, the demo DLRM) with random
weights, at batch sizes on, between and past the buckets."""

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


def test_buckets_are_powers_of_two_then_the_largest_batch():
    assert buckets(1) == [1]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]


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
    assert [b for b, _, _ in plan_["buckets"]] == buckets(64)
