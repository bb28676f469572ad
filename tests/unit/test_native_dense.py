"""The native dense executor (src/native/dense_net.hpp) against the numpy executor on
the sample networks (upstream DCN and DeepFM, the demo DLRM)
with random weights, at batch 1 and 64. The layer-by-layer comparisons run in
test_hugectr_network.py (check_native, on every network there)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from triton_rec import _native
from triton_rec.dense.hugectr_network import NATIVE_OPS, SUPPORTED_LAYER_TYPES, HugeCTRNetwork

ROOT = Path(__file__).resolve().parents[2]
NETWORKS = [
    ROOT / "tests" / "data" / "dcn.json",
    ROOT / "tests" / "data" / "deepfm.json",
    ROOT / "model_repository" / "dlrm" / "1" / "dlrm.json",
]


def _random_model(path: Path, tmp_path: Path, seed: int) -> HugeCTRNetwork:
    plan = HugeCTRNetwork.parse(str(path))
    rng = np.random.default_rng(seed)
    dense = tmp_path / f"{path.stem}_dense_0.model"
    (rng.standard_normal(plan.num_params) * 0.1).astype("<f4").tofile(dense)
    return HugeCTRNetwork.load(str(path), str(dense))


@pytest.mark.parametrize("path", NETWORKS, ids=lambda p: p.stem)
@pytest.mark.parametrize("batch", [1, 64])
def test_native_and_numpy_executors_agree_on_the_sample_networks(path, batch, tmp_path):
    if not path.exists():
        pytest.fail(f"{path} is missing (make demo writes the demo DLRM)")
    model = _random_model(path, tmp_path, seed=batch)
    program = model.native_program()
    assert program is not None, [layer.type for layer in model.plan.layers]
    rng = np.random.default_rng(7)
    dense = rng.standard_normal((batch, model.dense_dim)).astype(np.float32)
    embs = [
        rng.standard_normal((batch, t.slot_num, t.vec_size)).astype(np.float32)
        for t in model.tables
    ]
    want = model.predict(dense, embs)
    got = _native.DenseNet(program, model).predict(dense, embs)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def _interaction_reference(mlp: np.ndarray, emb: np.ndarray) -> np.ndarray:
    """HugeCTR's interaction (triton_rec.dense.hugectr.layers._build_interaction) in
    float64: m, the strict lower triangle of Z Z^T in row-major order, a zero."""
    z = np.concatenate([mlp[:, None, :], emb], axis=1).astype(np.float64)
    ii, jj = np.tril_indices(z.shape[1], -1)
    gram = z @ z.transpose(0, 2, 1)
    return np.concatenate([mlp, gram[:, ii, jj], np.zeros((len(mlp), 1))], axis=1)


@pytest.mark.parametrize("kernel", _native.interaction_kernels())
@pytest.mark.parametrize(
    "rows, slots, dim",
    # DLRM's shapes (the demo's 27 x 32, MLPerf's 27 x 128) at a few batch sizes; vectors
    # that are not a whole number of SIMD lanes (a scalar tail per sum), a single pair
    [(1, 26, 32), (3, 26, 32), (13, 26, 32), (64 + 14, 26, 32), (2, 26, 128), (5, 26, 128)]
    + [(21, 5, 7), (6, 1, 16), (40, 26, 16), (3, 7, 13), (2, 4, 3)],
)
def test_every_interaction_kernel_computes_hugectrs_interaction(kernel, rows, slots, dim):
    rng = np.random.default_rng(rows * 100 + slots)
    mlp = rng.standard_normal((rows, dim)).astype(np.float32)
    emb = rng.standard_normal((rows, slots, dim)).astype(np.float32)
    got = _native.interaction(mlp, emb, kernel)
    np.testing.assert_allclose(got, _interaction_reference(mlp, emb), rtol=1e-5, atol=1e-4)


def test_the_interaction_refuses_inputs_of_the_wrong_shape_and_unknown_kernels():
    mlp, emb = np.zeros((2, 8), np.float32), np.zeros((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="must be float32"):
        _native.interaction(mlp, emb[:1])
    with pytest.raises(ValueError, match="no interaction kernel"):
        _native.interaction(mlp, emb, "avx1024")


def test_malformed_programs_and_inputs_are_refused():
    with pytest.raises(ValueError, match="not a dense program"):
        _native.DenseNet(np.zeros(4, np.int64), None)
    with pytest.raises(ValueError, match="truncated"):
        _native.DenseNet(np.array([0x74726563646E7331, 5], np.int64), None)


def test_every_native_op_is_a_supported_layer_and_the_codes_are_the_enums_order():
    assert set(NATIVE_OPS) <= SUPPORTED_LAYER_TYPES
    # dense_net.hpp numbers its ops 0..16 in this order; both losses share the sigmoid code
    assert sorted(set(NATIVE_OPS.values())) == list(range(17))


def _network_inputs(model, batch, seed=7):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((batch, model.dense_dim)).astype(np.float32)
    embs = [
        rng.standard_normal((batch, t.slot_num, t.vec_size)).astype(np.float32)
        for t in model.tables
    ]
    return dense, embs


@pytest.mark.parametrize("gemm", _native.gemm_kernels())
@pytest.mark.parametrize("path", NETWORKS, ids=lambda p: p.stem)
def test_every_gemm_kernel_runs_the_sample_networks_as_numpy_does(gemm, path, tmp_path):
    # gemm.hpp's kernels, each that this CPU has (the widest is the default), at batch
    # sizes that make every kind of tile: 1 to 13 rows (the rest tiles of each width, a
    # whole tile and a rest), 150 (a block of 144 rows and a rest), on networks whose
    # widths are and are not whole panels (DCN's cross network projects, DeepFM's FM)
    model = _random_model(path, tmp_path, seed=5)
    net = _native.DenseNet(model.native_program(), model, gemm=gemm)
    assert net.gemm == gemm
    for batch in [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 150]:
        dense, embs = _network_inputs(model, batch, seed=batch)
        np.testing.assert_allclose(
            net.predict(dense, embs), model.predict(dense, embs), atol=1e-5, rtol=1e-5
        )


def test_a_product_longer_than_a_slice_of_the_weights_sums_every_row(tmp_path):
    # gemm.hpp takes W in slices of 1,024 rows: K = 2,600 makes three slices (sums stored
    # and taken up again, the bias only in the first, the ReLU only in the last)
    layers = [
        {
            "name": "data",
            "type": "Data",
            "label": {"top": "label", "label_dim": 1},
            "dense": {"top": "dense", "dense_dim": 2600},
            "sparse": [
                {
                    "top": "d0",
                    "type": "DistributedSlot",
                    "slot_num": 1,
                    "max_feature_num_per_sample": 1,
                }
            ],
        },
        {
            "name": "e0",
            "type": "DistributedSlotSparseEmbeddingHash",
            "bottom": "d0",
            "top": "e0",
            "sparse_embedding_hparam": {"embedding_vec_size": 4, "combiner": "sum"},
        },
        {
            "name": "fc1",
            "type": "InnerProduct",
            "bottom": "dense",
            "top": "fc1",
            "fc_param": {"num_output": 37},
        },
        {"name": "relu1", "type": "ReLU", "bottom": "fc1", "top": "relu1"},
        {
            "name": "fc2",
            "type": "InnerProduct",
            "bottom": "relu1",
            "top": "fc2",
            "fc_param": {"num_output": 1},
        },
    ]
    net_json = tmp_path / "long.json"
    net_json.write_text(json.dumps({"layers": layers}))
    model = _random_model(net_json, tmp_path, seed=2)
    for gemm in _native.gemm_kernels():
        net = _native.DenseNet(model.native_program(), model, gemm=gemm, threads=1)
        for batch in (1, 7, 40):
            dense, embs = _network_inputs(model, batch, seed=batch)
            np.testing.assert_allclose(
                net.predict(dense, embs), model.predict(dense, embs), atol=1e-4, rtol=1e-5
            )


def test_a_samples_answer_does_not_depend_on_its_batch(tmp_path):
    # every sum runs over k in order from the bias, whatever the tile (gemm.hpp): the
    # same sample alone, among others and at another place gets the same bits
    model = _random_model(NETWORKS[2], tmp_path, seed=9)
    for gemm in _native.gemm_kernels():
        net = _native.DenseNet(model.native_program(), model, gemm=gemm)
        dense, embs = _network_inputs(model, 300, seed=4)
        whole = net.predict(dense, embs)
        for a, b in [(0, 1), (5, 6), (17, 30), (200, 300), (150, 299)]:
            part = net.predict(dense[a:b], [e[a:b] for e in embs])
            np.testing.assert_array_equal(part, whole[a:b], err_msg=f"{gemm} rows {a}:{b}")


def test_the_mlperf_dlrm_runs_without_its_relu_and_concat_steps(tmp_path):
    # ps-loader criteo-dlrm's network: every InnerProduct's ReLU is applied as its sums are
    # stored, and the interaction reads the 26 tables' outputs where they lie (no Concat);
    # the answers are numpy's
    from ps_loader import criteo

    net_json = tmp_path / "net.json"
    net_json.write_text(json.dumps(criteo.network_json()))
    dense = tmp_path / "dense.model"
    params = criteo.dense_parameters(seed=3)
    np.concatenate([a.ravel() for wb in params for a in wb]).astype("<f4").tofile(dense)
    model = HugeCTRNetwork.load(str(net_json), str(dense))
    net = _native.DenseNet(model.native_program(), model)
    ops = {name: code for name, code in NATIVE_OPS.items()}
    assert ops["ReLU"] not in net.steps and ops["Concat"] not in net.steps, net.steps
    assert net.steps.count(ops["InnerProduct"]) == 8 and ops["Interaction"] in net.steps
    # a thread's buffers hold the activations alive together: at most the top MLP's two
    # 1,024-wide ones (all of them side by side: 4,194 floats a sample)
    assert net.workspace_floats == 1024 + 1024
    for batch in (1, 7, 64, 600):  # 600: passes of 288 rows through the same buffers
        dense_in, embs = _network_inputs(model, batch, seed=batch)
        embs = [0.25 * e for e in embs]
        np.testing.assert_allclose(
            net.predict(dense_in, embs), model.predict(dense_in, embs), atol=1e-5, rtol=1e-5
        )


def test_rows_split_across_threads_give_the_same_bits_as_one_thread(tmp_path):
    # row_parts.hpp: a large batch splits its rows across idle cores; each part runs the
    # same kernels on its rows, so the answer is bit for bit one thread's, whatever the
    # split (batches of 1 to 300 rows, 2 to 4 parts)
    model = _random_model(NETWORKS[2], tmp_path, seed=11)
    one = _native.DenseNet(model.native_program(), model, threads=1)
    assert one.threads == 1
    for threads in (2, 3, 4):
        many = _native.DenseNet(model.native_program(), model, threads=threads)
        assert many.threads == threads
        for batch in (1, 2, 5, 64, 300):
            dense, embs = _network_inputs(model, batch, seed=batch)
            np.testing.assert_array_equal(many.predict(dense, embs), one.predict(dense, embs))


def test_the_thread_limit_comes_from_the_environment_and_a_bad_one_is_refused(tmp_path):
    code = (
        "from pathlib import Path; import tempfile; from triton_rec import _native;"
        "from tests.unit.test_native_dense import NETWORKS, _random_model;"
        "m = _random_model(NETWORKS[2], Path(tempfile.mkdtemp()), seed=1);"
        "print(_native.DenseNet(m.native_program(), m).threads)"
    )
    import subprocess
    import sys

    def run(value):
        env = {**os.environ, "TRITON_REC_DENSE_THREADS": value}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
        )

    assert run("3").stdout.strip() == "3"
    assert run("1").stdout.strip() == "1"
    assert int(run("auto").stdout.strip()) == len(os.sched_getaffinity(0))
    bad = run("lots")
    assert bad.returncode != 0 and "TRITON_REC_DENSE_THREADS" in bad.stderr, bad.stderr


def test_an_unknown_gemm_kernel_is_refused():
    assert "base" in _native.gemm_kernels()
    with pytest.raises(ValueError, match="no gemm kernel 'avx1024'"):
        _native.DenseNet(np.zeros(1, np.int64), None, gemm="avx1024")


def test_the_dense_step_plan_describes_the_network_for_the_native_backend(tmp_path):
    """DenseSession.native_plan: kind dense, no tables, per table its slots, combiner and
    width, the input limits and the program; None for a network without a program."""
    from triton_rec.dense import Combiner
    from triton_rec.serving.ranking import DenseSession

    model = _random_model(NETWORKS[1], tmp_path, seed=3)  # DeepFM: one table, 26 slots
    session = DenseSession("deepfm_dense", model, 64)
    plan = session.native_plan()
    assert plan.kind == "dense" and plan.tables == [] and plan.gpu is None
    assert plan.slots == [t.slot_num for t in model.tables]
    assert plan.vec_sizes == [t.vec_size for t in model.tables]
    assert plan.mean == [t.combiner == Combiner.MEAN for t in model.tables]
    assert (plan.dense_dim, plan.label_dim, plan.max_batch_size) == (
        model.dense_dim,
        model.label_dim,
        64,
    )
    limits = session.input_limits()
    assert plan.limits is not None
    assert (plan.limits.des, plan.limits.cat, plan.limits.rows) == tuple(
        limits[k][0] for k in ("DES", "EMBEDDINGS", "ROWINDEX")
    )
    assert plan.dense_net is model.native_net() is not None

    class NoProgram:
        tables = model.tables
        dense_dim, label_dim = model.dense_dim, model.label_dim

    assert DenseSession("x", NoProgram(), 64).native_plan() is None
