"""The trained demo DLRM served three ways must answer what PyTorch computes.

- `dlrm`: fused (backend hugectr), HugeCTR dense file + network JSON;
- `dlrm_onnx`: fused, dense part as ONNX (onnxruntime);
- `dlrm_ensemble`: hps lookup model -> dense model, a Triton ensemble.

The reference is the PyTorch model rebuilt from its state dict (`examples.dlrm.torch_dlrm`),
fed the same samples; held-out samples come from the generator the model was trained on.
"""

from __future__ import annotations

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
