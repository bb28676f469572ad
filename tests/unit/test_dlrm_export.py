"""The example DLRM (model_repository/dlrm/train.py, examples/dlrm/torch_dlrm.py): a tiny
training run, and every exported file checked against the PyTorch model.

The HugeCTR files are checked with a small numpy reading of the network JSON written
here from hugectr-layers.md, independent of the exporter and of triton_rec.dense.
"""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from examples.dlrm import torch_dlrm as td  # noqa: E402
from ps_loader.torch_import import find_tables, load_state_dict, write_tables  # noqa: E402
from triton_rec.config.ps_json import parse_ps_config  # noqa: E402
from triton_rec.formats.tables import read_table  # noqa: E402

TRAIN_PY = Path(__file__).resolve().parents[2] / "model_repository" / "dlrm" / "train.py"
SEED = 2026


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``train.py --tiny`` into ``<repo>/dlrm/1``; returns that directory."""
    spec = importlib.util.spec_from_file_location("dlrm_train", TRAIN_PY)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path_factory.mktemp("repo") / "dlrm" / "1"
    assert script.main(["--tiny", "--out", str(out), "--seed", str(SEED)]) == 0
    return out


@pytest.fixture(scope="module")
def model(exported):
    return td.load_trained(str(exported))


@pytest.fixture(scope="module")
def network(exported):
    return json.loads((exported / "dlrm.json").read_text())["layers"]


@pytest.fixture(scope="module")
def held_out():
    """Fresh samples of the hidden model the tiny run learnt from (not its eval set)."""
    return td.HiddenModel(td.TINY_CONFIG, SEED).sample(3000, np.random.default_rng(99))


# ----------------------------------------------------------------- numpy reference


def _pool(keys, offsets, table_keys, vectors, combiner, default=0.0):
    row = {int(k): i for i, k in enumerate(table_keys)}
    out = np.zeros((len(offsets) - 1, vectors.shape[1]), np.float64)
    for s in range(len(offsets) - 1):
        ks = keys[offsets[s] : offsets[s + 1]]
        for k in ks:
            out[s] += vectors[row[int(k)]] if int(k) in row else default
        if combiner == "mean" and len(ks) > 1:
            out[s] /= len(ks)
    return out


def _reference_predict(model_dir, request):
    """Predictions from the HugeCTR files alone, for a DES/CATCOLUMN/ROWINDEX request."""
    layers = json.loads((Path(model_dir) / "dlrm.json").read_text())["layers"]
    params = np.fromfile(Path(model_dir) / "dlrm_dense_0.model", dtype="<f4").astype(np.float64)
    data = layers[0]
    slots = [s["slot_num"] for s in data["sparse"]]
    dense_dim = data["dense"]["dense_dim"]
    n = (len(request["ROWINDEX"]) - len(slots)) // sum(slots)
    tensors = {data["dense"]["top"]: request["DES"].reshape(n, dense_dim).astype(np.float64)}
    # CATCOLUMN is sample-major: regroup by table with each table's row pointers.
    ptrs, a = [], 0
    for s in slots:
        ptrs.append(request["ROWINDEX"][a : a + n * s + 1])
        a += n * s + 1
    per_table = [[] for _ in slots]
    pos = 0
    for i in range(n):
        for t, s in enumerate(slots):
            c = ptrs[t][(i + 1) * s] - ptrs[t][i * s]
            per_table[t].append(request["CATCOLUMN"][pos : pos + c])
            pos += c
    assert pos == len(request["CATCOLUMN"])
    emb_layers = [x for x in layers if x["type"] == "DistributedSlotSparseEmbeddingHash"]
    for t, layer in enumerate(emb_layers):
        keys, vecs = read_table(
            str(Path(model_dir) / f"dlrm{t}_sparse_0.model"),
            layer["sparse_embedding_hparam"]["embedding_vec_size"],
        )
        flat = np.concatenate(per_table[t]) if per_table[t] else np.empty(0, np.int64)
        pooled = _pool(flat, ptrs[t], keys, vecs, layer["sparse_embedding_hparam"]["combiner"])
        tensors[layer["top"]] = pooled.reshape(n, slots[t], -1)
    off = 0
    for layer in layers[1 + len(emb_layers) :]:
        kind, bottom = layer["type"], layer["bottom"]
        if kind == "InnerProduct":
            x = tensors[bottom]
            n_in, n_out = x.shape[-1], layer["fc_param"]["num_output"]
            w = params[off : off + n_in * n_out].reshape(n_in, n_out)
            b = params[off + n_in * n_out : off + n_in * n_out + n_out]
            off += n_in * n_out + n_out
            y = x @ w + b
        elif kind == "ReLU":
            y = np.maximum(tensors[bottom], 0)
        elif kind == "Concat":
            y = np.concatenate([tensors[b] for b in bottom], axis=layer.get("axis", 1))
        elif kind == "Interaction":
            mlp, emb = tensors[bottom[0]], tensors[bottom[1]]
            z = np.concatenate([mlp[:, None, :], emb], axis=1)
            cols = [mlp]
            for i in range(1, z.shape[1]):
                for j in range(i):
                    cols.append(np.einsum("bd,bd->b", z[:, i], z[:, j])[:, None])
            cols.append(np.zeros((n, 1)))
            y = np.concatenate(cols, axis=1)
        elif kind == "BinaryCrossEntropyLoss":
            y = 1.0 / (1.0 + np.exp(-tensors[bottom[0]]))
        else:
            raise AssertionError(f"unexpected layer {kind}")
        tensors[layer["top"]] = y
    assert off == params.size, "the dense file holds more values than the network uses"
    return y[:, 0]


# ----------------------------------------------------------------- tests


def test_the_tiny_run_learns_the_signal_held_out_auc_well_above_chance(exported, model, held_out):
    meta = json.loads((exported / "dlrm_meta.json").read_text())
    assert meta["eval"]["auc"] > 0.6 and meta["eval"]["accuracy"] > 0.6
    assert meta["eval"]["auc"] < meta["eval"]["oracle_auc"]
    prob = model.predict(held_out.dense, held_out.sparse)
    assert td.auc(held_out.labels, prob) > 0.6


def test_auc_is_rank_based_with_ties_averaged():
    assert td.auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == 0.75
    assert td.auc([0, 1], [0.5, 0.5]) == 0.5
    # positive-negative pairs: (3 > 1) counts 1, (3 = 3) counts 1/2, for both positives
    assert td.auc([1, 0, 1, 0], [3, 1, 3, 3]) == pytest.approx((1 + 0.5 + 1 + 0.5) / 4)
    assert np.isnan(td.auc([1, 1], [0.2, 0.3]))


def test_the_network_json_uses_hugectr_dlrm_layers_in_order(network):
    assert [layer["type"] for layer in network] == [
        "Data",
        "DistributedSlotSparseEmbeddingHash",
        "DistributedSlotSparseEmbeddingHash",
        "InnerProduct",
        "ReLU",
        "InnerProduct",
        "ReLU",
        "Concat",
        "Interaction",
        "InnerProduct",
        "ReLU",
        "InnerProduct",
        "ReLU",
        "InnerProduct",
        "BinaryCrossEntropyLoss",
    ]
    data = network[0]
    assert data["dense"] == {"top": "dense", "dense_dim": 8}
    assert data["label"]["label_dim"] == 1
    assert data["sparse"] == [
        {"top": "data0", "type": "DistributedSlot", "max_feature_num_per_sample": 4, "slot_num": 4},
        {"top": "data1", "type": "DistributedSlot", "max_feature_num_per_sample": 6, "slot_num": 2},
    ]
    assert [e["sparse_embedding_hparam"]["combiner"] for e in network[1:3]] == ["sum", "mean"]
    assert {e["sparse_embedding_hparam"]["embedding_vec_size"] for e in network[1:3]} == {16}
    concat, inter = network[7], network[8]
    assert concat["bottom"] == ["sparse_embedding0", "sparse_embedding1"] and concat["axis"] == 1
    assert inter["bottom"] == [network[6]["top"], concat["top"]]
    assert network[-1]["bottom"] == [network[-2]["top"], "label"]
    assert network[-2]["fc_param"]["num_output"] == 1
    tops = [layer["top"] for layer in network[1:]]
    assert len(set(tops)) == len(tops)


def test_the_dense_file_holds_exactly_the_parameters_of_the_network(exported, network, model):
    width = {"dense": network[0]["dense"]["dense_dim"]}
    count = 0
    for layer in network[1:]:
        bottom = layer.get("bottom")
        if layer["type"] == "InnerProduct":
            n_in, n_out = width[bottom], layer["fc_param"]["num_output"]
            count += n_in * n_out + n_out
            width[layer["top"]] = n_out
        elif layer["type"] == "ReLU":
            width[layer["top"]] = width[bottom]
        elif layer["type"] == "Interaction":
            n = 1 + sum(s["slot_num"] for s in network[0]["sparse"])
            width[layer["top"]] = width[bottom[0]] + n * (n - 1) // 2 + 1
    assert width["interaction1"] == 16 + 21 + 1
    size = os.path.getsize(exported / "dlrm_dense_0.model")
    assert size == 4 * count
    assert count == sum(p.numel() for p in model.dense_arch.parameters())
    assert count == json.loads((exported / "dlrm_meta.json").read_text())["dense_param_count"]
    # W is stored [in, out] (the transpose of torch's Linear.weight), then b
    first = np.fromfile(exported / "dlrm_dense_0.model", dtype="<f4", count=8 * 16 + 16)
    np.testing.assert_array_equal(
        first[:128].reshape(8, 16), model.dense_arch.bottom[0].weight.detach().numpy().T
    )
    np.testing.assert_array_equal(first[128:], model.dense_arch.bottom[0].bias.detach().numpy())


def test_sparse_dirs_hold_the_trained_rows_under_the_data_keys(exported, model, held_out):
    truth = td.HiddenModel(td.TINY_CONFIG, SEED)
    fresh = td.build_model(td.TINY_CONFIG)
    for t, spec in enumerate(td.TINY_CONFIG.tables):
        keys, vecs = read_table(str(exported / f"dlrm{t}_sparse_0.model"), 16)
        # keys: the ids the data uses, in row order; non-contiguous 64-bit values
        np.testing.assert_array_equal(keys, truth.keys[t])
        assert len(keys) == spec.rows and keys.max() > 2**40
        assert not np.array_equal(np.sort(keys), np.arange(keys.min(), keys.min() + len(keys)))
        weight = model.embedding_bags[spec.name].weight.detach().numpy()
        np.testing.assert_array_equal(vecs, weight)
        assert not np.allclose(weight, fresh.embedding_bags[spec.name].weight.detach().numpy())
        # every key of the data is found, at the row PyTorch uses for it
        data_keys = held_out.sparse[t][0]
        rows = model.rows_of(t, data_keys)
        assert (rows >= 0).all()
        np.testing.assert_array_equal(keys[rows], data_keys)


def test_the_hugectr_files_reproduce_pytorch_predictions(exported, model, held_out):
    request = held_out.hugectr_request(0, 200)
    assert request["DES"].shape == (200 * 8,)
    assert request["ROWINDEX"].shape == (200 * 4 + 1 + 200 * 2 + 1,)
    expected = model.predict(
        held_out.dense[:200],
        [(k[o[0] : o[200 * s]], o[: 200 * s + 1]) for (k, o), s in zip(held_out.sparse, (4, 2))],
    )
    got = _reference_predict(exported, request)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert expected.std() > 0.1  # the predictions say something


def test_unknown_keys_and_empty_slots_follow_hugectr_semantics(exported, model):
    # 2 samples; table 0: one key per slot, one unknown; table 1 (mean): 0, 3, 1, 2 keys.
    t0, t1 = model.table_keys(0), model.table_keys(1)
    unknown = 12345  # not a key: the generated ones are > 2**40 with overwhelming odds
    assert unknown not in set(t0.tolist()) | set(t1.tolist())
    k0 = np.array([t0[1], t0[150], unknown, t0[399], t0[2], t0[3], t0[250], t0[300]])
    o0 = np.arange(9)
    k1 = np.array([t1[5], t1[6], unknown, t1[180], t1[7], t1[8]])
    o1 = np.array([0, 0, 3, 4, 6])
    dense = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    expected = model.predict(dense, [(k0, o0), (k1, o1)])
    # HugeCTR request: CATCOLUMN sample-major
    cat = np.concatenate([k0[:4], k1[0:3], k0[4:], k1[3:]])
    request = {
        "DES": dense.reshape(-1),
        "CATCOLUMN": cat,
        "ROWINDEX": np.concatenate([o0, o1]).astype(np.int32),
    }
    np.testing.assert_allclose(_reference_predict(exported, request), expected, atol=1e-5)
    # pooled vectors directly: empty slot = zeros, mean over all keys of a slot,
    # an unknown key counts as a vector of the default value
    rows = torch.from_numpy(model.rows_of(1, k1))
    pooled = model.pooled(1, rows, torch.from_numpy(o1), default=2.0).detach().numpy()
    w = model.embedding_bags["table1"].weight.detach().numpy()
    np.testing.assert_array_equal(pooled[0, 0], np.zeros(16))
    np.testing.assert_allclose(pooled[0, 1], (w[5] + w[6] + 2.0) / 3, rtol=1e-6)
    np.testing.assert_allclose(pooled[1, 0], w[180], rtol=1e-6)
    np.testing.assert_allclose(pooled[1, 1], (w[7] + w[8]) / 2, rtol=1e-6)


def test_the_onnx_model_reproduces_the_pytorch_dense_part(exported, model):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(
        str(exported / "dlrm_dense.onnx"), providers=["CPUExecutionProvider"]
    )
    assert [i.name for i in sess.get_inputs()] == ["dense", "emb_0", "emb_1"]
    assert [o.name for o in sess.get_outputs()] == ["prob"]
    assert [i.shape[1:] for i in sess.get_inputs()] == [[8], [4, 16], [2, 16]]
    rng = np.random.default_rng(5)
    for batch in (1, 37):  # dynamic batch axis
        feeds = {
            "dense": rng.standard_normal((batch, 8)).astype(np.float32),
            "emb_0": (0.3 * rng.standard_normal((batch, 4, 16))).astype(np.float32),
            "emb_1": (0.3 * rng.standard_normal((batch, 2, 16))).astype(np.float32),
        }
        [prob] = sess.run(["prob"], feeds)
        with torch.no_grad():
            inputs = (torch.from_numpy(feeds[k]) for k in ("dense", "emb_0", "emb_1"))
            expected = model.dense_arch(*inputs)
        assert prob.shape == (batch, 1) and prob.dtype == np.float32
        np.testing.assert_allclose(prob, expected.numpy(), rtol=0, atol=1e-5)


def test_the_onnx_dense_model_runs_a_large_batch_in_parts_of_run_samples(exported):
    # Issue 24: onnxruntime keeps its arena at the largest run's size, and the requests of
    # one execute call run together: runs of at most RUN_SAMPLES samples bound it.
    pytest.importorskip("onnxruntime")
    from triton_rec.dense import onnx_model

    dense_model = onnx_model.OnnxDenseModel.load(
        str(exported / "dlrm_dense.onnx"), str(exported / "dlrm.json"), threads=1
    )
    n = 2 * onnx_model.RUN_SAMPLES + 7
    rng = np.random.default_rng(11)
    dense = rng.standard_normal((n, 8)).astype(np.float32)
    embs = [(0.3 * rng.standard_normal((n, s, 16))).astype(np.float32) for s in (4, 2)]
    whole = dense_model.session.run(None, {"dense": dense, "emb_0": embs[0], "emb_1": embs[1]})
    sizes = []
    run = dense_model.session.run

    class Counting:
        def run(self, names, feeds):
            sizes.append(len(feeds["dense"]))
            return run(names, feeds)

        def __getattr__(self, name):
            return getattr(dense_model.session, name)

    dense_model.session = Counting()
    got = dense_model.predict(dense, embs)
    assert sizes == [onnx_model.RUN_SAMPLES, onnx_model.RUN_SAMPLES, 7]
    assert got.shape == (n, 1)
    np.testing.assert_allclose(got, whole[0], rtol=1e-6, atol=1e-7)
    assert dense_model.predict(dense[:3], [e[:3] for e in embs]).shape == (3, 1)
    assert sizes[-1] == 3


def test_interaction_orders_pairs_like_hugectr_and_ends_with_a_zero_pad():
    rng = np.random.default_rng(0)
    mlp = rng.standard_normal((3, 4)).astype(np.float32)
    emb = rng.standard_normal((3, 5, 4)).astype(np.float32)
    out = td.interaction(torch.from_numpy(mlp), torch.from_numpy(emb)).numpy()
    z = np.concatenate([mlp[:, None], emb], axis=1)
    n = 6
    assert out.shape == (3, 4 + n * (n - 1) // 2 + 1)
    for b in range(3):
        expected = list(mlp[b])
        for i in range(1, n):  # (1,0), (2,0), (2,1), (3,0), ...
            for j in range(i):
                expected.append(float(z[b, i] @ z[b, j]))
        expected.append(0.0)
        np.testing.assert_allclose(out[b], expected, rtol=1e-5, atol=1e-6)
    assert (out[:, -1] == 0).all()
    assert td.pair_index_list(4) == [4, 8, 9, 12, 13, 14]


def test_the_ps_entry_is_accepted_by_the_ps_json_parser(exported):
    entry = json.loads((exported / "dlrm_ps_entry.json").read_text())
    repo = exported.parent.parent
    cfg = parse_ps_config({"supportlonglong": True, "models": [entry]}, base_dir=str(repo))
    m = cfg.model("dlrm")
    assert [t.vec_size for t in m.tables] == [16, 16]
    assert [t.max_keys_per_sample for t in m.tables] == [4, 6]
    for t in m.tables:
        assert os.path.isdir(t.sparse_file)
    assert os.path.isfile(m.dense_file) and os.path.isfile(m.network_file)
    assert entry["slot_num"] == 6 and entry["label_dim"] == 1
    assert not m.unknown_keys


def test_the_state_dict_loads_with_weights_only_and_imports_to_the_same_sparse_files(
    exported, tmp_path
):
    state = torch.load(exported / "dlrm_torch.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    path = str(exported / "dlrm_torch.pt")
    tables = find_tables(load_state_dict(path), source=path)
    assert [t.name for t in tables] == ["table0", "table1"]
    keys = {t.name: state[f"sparse_keys.{t.name}"].numpy() for t in tables}
    for w in write_tables(tables, str(tmp_path), keys=keys, prefix="dlrm"):
        original = exported / Path(w.path).name
        for f in ("key", "emb_vector"):
            assert (Path(w.path) / f).read_bytes() == (original / f).read_bytes()


def test_training_is_deterministic_for_a_seed():
    settings = td.TrainSettings(seed=7, epochs=1, train_rows=1024, eval_rows=512, batch_size=128)
    a = td.train(td.TINY_CONFIG, settings)
    b = td.train(td.TINY_CONFIG, settings)
    assert a.metrics["auc"] == b.metrics["auc"]
    for (k, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(va, vb), k
