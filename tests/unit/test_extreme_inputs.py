"""Issue 24, "One answer for extreme inputs": the dense executors of the demo DLRM
(model_repository/dlrm/1, written by `make demo`) on overflowing, infinite, NaN and
denormal DES and embedding values: the numpy executor (the reference), the native one
(src/native/dense_net.hpp), onnxruntime on the exported ONNX file and the PyTorch model
it was trained as. The per-layer networks of test_hugectr_network.py go through the
same inputs (check_native); the rule is in tests/extreme_inputs.py and docs/backends.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.extreme_inputs import EXTREMES, check_extreme_answers, extreme_inputs
from triton_rec import _native
from triton_rec.dense.hugectr_network import HugeCTRNetwork
from triton_rec.dense.onnx_model import OnnxDenseModel

MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "dlrm" / "1"
B = EXTREMES.size


@pytest.fixture(scope="module")
def executors():
    """name -> predict(dense, embs) of each executor of the demo DLRM."""
    files = [MODEL_DIR / n for n in ("dlrm.json", "dlrm_dense_0.model", "dlrm_dense.onnx")]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        pytest.fail(f"{missing} missing (make demo trains the demo DLRM)")
    numpy_net = HugeCTRNetwork.load(str(files[0]), str(files[1]))
    native = _native.DenseNet(numpy_net.native_program(), numpy_net)
    pytest.importorskip("onnxruntime")
    onnx = OnnxDenseModel.load(str(files[2]), str(files[0]))

    def numpy_predict(dense, embs):
        with np.errstate(all="ignore"):  # overflow warnings: the point of these tests
            return numpy_net.predict(dense, embs)

    out = {"numpy": numpy_predict, "native": native.predict, "onnx": onnx.predict}
    if (MODEL_DIR / "dlrm_torch.pt").exists():
        torch = pytest.importorskip("torch")
        from examples.dlrm.torch_dlrm import load_trained

        model = load_trained(str(MODEL_DIR))

        def torch_predict(dense, embs):
            with torch.no_grad():
                ts = [torch.from_numpy(np.ascontiguousarray(a)) for a in (dense, *embs)]
                return model.dense_arch(*ts).numpy().reshape(len(dense), -1)

        out["torch"] = torch_predict
    return numpy_net, out


def _batch(model, seed=3):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((B, model.dense_dim)).astype(np.float32)
    embs = [
        (0.3 * rng.standard_normal((B, t.slot_num, t.vec_size))).astype(np.float32)
        for t in model.tables
    ]
    return dense, embs


def _answers_with(executors, value, where):
    """The batch with `value` in all of DES or of one table's embeddings, and each
    executor's answer to it."""
    model, predict = executors
    dense, embs = _batch(model)
    if where == "DES":
        dense[:] = value
    else:
        embs[int(where[-1])][:] = value
    answers = {name: fn(dense, embs) for name, fn in predict.items()}
    for got in answers.values():
        assert got.shape == (B, 1)
    return dense, embs, answers


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["DES", "emb_0", "emb_1"])
def test_an_infinite_or_nan_input_gives_nan_in_every_executor(executors, value, where):
    # The measurement: DES = 3e38 gave 0.49968836 for every sample from the
    # native executor (its ReLU turned the NaN of inf - inf into 0), NaN from numpy.
    # inf and NaN have one answer everywhere, whatever the kernels' order of sums.
    dense, embs, answers = _answers_with(executors, value, where)
    for name, got in answers.items():
        assert np.isnan(got).all(), (name, got.ravel())


@pytest.mark.parametrize("value", [3e38, -3e38])
@pytest.mark.parametrize("where", ["DES", "emb_0", "emb_1"])
def test_a_finite_overflowing_input_gives_nan_or_a_probability(executors, value, where):
    # 3e38 overflows part-way through sums whose order (and fused multiply-adds) differ
    # between kernels: numpy's sgemm ends at NaN or at 0 or 1 depending on the CPU's
    # OpenBLAS kernel (seen: 1.0 for 4 of 7 samples on one AMD EPYC), PyTorch and
    # onnxruntime likewise (docs/backends.md, "Extreme inputs"). What holds everywhere:
    # each answer is NaN or a probability, never an error; and the native executor,
    # whose sums run in one order for every tile (gemm.hpp), gives a sample the same
    # answer alone as in its batch, call after call.
    dense, embs, answers = _answers_with(executors, value, where)
    for name, got in answers.items():
        finite = got[~np.isnan(got)]
        assert ((finite >= 0) & (finite <= 1)).all(), (name, got.ravel())
    native = executors[1]["native"]
    whole = native(dense, embs)
    np.testing.assert_array_equal(native(dense, embs), whole)
    for i in range(B):
        alone = native(dense[i : i + 1], [e[i : i + 1] for e in embs])
        np.testing.assert_array_equal(alone, whole[i : i + 1], err_msg=f"sample {i}")


def test_one_extreme_value_per_sample_touches_only_its_sample(executors):
    model, predict = executors
    dense, embs = _batch(model)
    clean = predict["numpy"](dense, embs)
    for x_dense, x_embs in extreme_inputs(dense, embs):
        want = predict["numpy"](x_dense, x_embs)
        for name, fn in predict.items():
            if name != "numpy":
                check_extreme_answers(fn(x_dense, x_embs), want)
        assert np.isnan(want[2:5]).all(), want.ravel()  # inf, -inf, NaN reach the prediction
    # and the other samples of a batch keep their answers
    for i in range(B):
        x_dense = dense.copy()
        x_dense[i] = EXTREMES[i]
        with_one = predict["native"](x_dense, embs)
        rest = np.arange(B) != i
        np.testing.assert_array_equal(with_one[rest], predict["native"](dense, embs)[rest])
        np.testing.assert_allclose(with_one[rest], clean[rest], rtol=1e-5, atol=1e-6)


def test_denormal_inputs_are_kept_not_flushed(executors):
    # A float32 denormal (1e-40) as the only non-zero input: numpy, the native executor
    # and onnxruntime all compute with it (none flushes denormals to zero).
    model, predict = executors
    dense, embs = _batch(model)
    zero = [np.zeros_like(e) for e in embs]
    base = predict["numpy"](np.zeros_like(dense), zero)
    for name in ("numpy", "native", "onnx"):
        tiny = predict[name](np.full_like(dense, 1e-40), zero)
        np.testing.assert_allclose(tiny, base, rtol=1e-5, atol=1e-6, err_msg=name)
    # the arithmetic itself keeps them: 1e-40 * 2 is 2e-40, not 0
    assert np.float32(1e-40) * np.float32(2) > 0
