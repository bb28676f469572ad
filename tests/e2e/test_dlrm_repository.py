"""The trained demo DLRM served three ways must answer what PyTorch computes.

- `dlrm`: fused (backend hugectr), HugeCTR dense file + network JSON;
- `dlrm_onnx`: fused, dense part as ONNX (onnxruntime);
- `dlrm_ensemble`: hps lookup model -> dense model, a Triton ensemble.

The reference is the PyTorch model rebuilt from its state dict (`examples.dlrm.torch_dlrm`),
fed the same samples; held-out samples come from the generator the model was trained on.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from examples.dlrm.torch_dlrm import HiddenModel, auc, load_trained
from tests.e2e.conftest import DEMO_REPO, infer_raw

N = 600  # held-out samples, sent in requests of various sizes


@pytest.fixture(scope="module")
def reference(demo_server):
    model = load_trained(str(DEMO_REPO / "dlrm" / "1"))
    meta = json.loads((DEMO_REPO / "dlrm" / "1" / "dlrm_meta.json").read_text())
    data = HiddenModel(model.config, meta["seed"]).sample(N, np.random.default_rng(987654))
    # Some keys the tables never saw: served and reference both use the default (0) vector.
    data.sparse[0][0][:5] = np.arange(1, 6) * -7
    torch_pred = model.predict(data.dense, data.sparse, defaults=[0.0] * len(data.sparse))
    return model, data, torch_pred


def _fused(server, protocol, model, data, a, b):
    req = data.hugectr_request(a, b)
    inputs = [
        ("DES", req["DES"][None, :], "FP32"),
        ("CATCOLUMN", req["CATCOLUMN"][None, :], "INT64"),
        ("ROWINDEX", req["ROWINDEX"][None, :], "INT32"),
    ]
    return infer_raw(server, protocol, model, inputs).as_numpy("OUTPUT0")


def _ensemble(server, protocol, data, a, b):
    req = data.ensemble_request(a, b)
    types = {"DES": "FP32", "KEYS": "INT64", "NUMKEYS": "INT32", "ROWINDEX": "INT32"}
    inputs = [(name, req[name], t) for name, t in types.items()]
    return infer_raw(server, protocol, "dlrm_ensemble", inputs, outputs=("PREDICTION",)).as_numpy(
        "PREDICTION"
    )


CHUNKS = [(0, 1), (1, 65), (65, 600)]


@pytest.mark.parametrize("model", ["dlrm", "dlrm_onnx", "ensemble"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_predictions_equal_pytorch(demo_server, reference, model, protocol):
    _, data, torch_pred = reference
    for a, b in CHUNKS:
        if model == "ensemble":
            out = _ensemble(demo_server, protocol, data, a, b)
        else:
            out = _fused(demo_server, protocol, model, data, a, b)
        assert out.shape == (b - a,)
        np.testing.assert_allclose(out, torch_pred[a:b], atol=1e-5, rtol=0)


def test_the_served_model_is_better_than_chance_on_held_out_data(demo_server, reference):
    _, data, _ = reference
    served = np.concatenate([_fused(demo_server, "grpc", "dlrm", data, a, b) for a, b in CHUNKS])
    score = auc(data.labels, served)
    assert score > 0.75, score


@pytest.mark.parametrize("tensor", ["DES", "EMBEDDINGS"])
def test_the_dense_model_refuses_nan_in_embeddings_as_in_des(demo_server, reference, tensor):
    # Issue 24: the dense backend refused NaN/inf in DES but computed with them in
    # EMBEDDINGS; now both, on both request paths, with an error naming the tensor.
    from tritonclient.utils import InferenceServerException

    _, data, torch_pred = reference
    req = data.ensemble_request(0, 3)
    vec = 16  # both demo tables
    embs = np.zeros(int(req["NUMKEYS"].sum()) * vec, np.float32)
    des = req["DES"].copy()
    if tensor == "DES":
        des[9] = np.nan
        needle = "DES holds a non-finite value (nan) at sample 1, feature 1"
    else:
        embs[int(req["NUMKEYS"][0]) * vec + 3] = np.inf  # table 1's first key
        needle = "EMBEDDINGS holds a non-finite value (inf) at sample 0, table 1"
    inputs = [
        ("DES", des, "FP32"),
        ("EMBEDDINGS", embs, "FP32"),
        ("ROWINDEX", req["ROWINDEX"], "INT32"),
    ]
    with pytest.raises(InferenceServerException) as e:
        infer_raw(demo_server, "grpc", "dlrm_dense", inputs)
    assert "dlrm_dense" in str(e.value) and needle in str(e.value), str(e.value)
    # the model still answers, and the ensemble around it too
    embs[:] = 0
    inputs[0], inputs[1] = ("DES", req["DES"], "FP32"), ("EMBEDDINGS", embs, "FP32")
    assert infer_raw(demo_server, "http", "dlrm_dense", inputs).as_numpy("OUTPUT0").shape == (3,)
    np.testing.assert_allclose(
        _ensemble(demo_server, "http", data, 0, 3), torch_pred[:3], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("model", ["dlrm", "ensemble"])
def test_an_overflowing_des_gives_nan_as_the_numpy_reference_does(demo_server, reference, model):
    # Issue 24: DES = 3e38 is finite and accepted; the native dense executor answered
    # 0.49968836 for every sample (its ReLU ate the NaN of inf - inf) where numpy gives NaN.
    _, data, _ = reference
    big = dataclasses.replace(data, dense=np.full_like(data.dense, 3e38))
    if model == "ensemble":
        out = _ensemble(demo_server, "grpc", big, 0, 4)
    else:
        out = _fused(demo_server, "grpc", "dlrm", big, 0, 4)
    assert out.shape == (4,) and np.isnan(out).all(), out
