"""HugeCTR network JSON + dense file: every layer against an independent PyTorch reference.

The references are written here with torch (CPU) from the rules in
shared/reference/hugectr-layers.md, never with the code under test.
"""

import gc
import json
import os
import weakref

import numpy as np
import pytest
import torch

from tests.extreme_inputs import check_extreme_answers, extreme_inputs
from triton_rec import _native
from triton_rec.dense import Combiner, DenseModel, TableSpec, combine_slots
from triton_rec.dense.hugectr_network import HugeCTRNetwork
from triton_rec.errors import ConfigError, ModelFileError, RequestError

# Copies of the upstream samples (shared/reference/samples/hugectr_v3.0_*).
DATA = os.path.join(os.path.dirname(__file__), "..", "data")
DCN = os.path.join(DATA, "dcn.json")
DEEPFM = os.path.join(DATA, "deepfm.json")
ATOL = 1e-5
B = 7


@pytest.fixture(autouse=True)
def _no_grad():
    # Only inside this module's tests: other modules train with autograd.
    with torch.no_grad():
        yield


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _rng(seed=0):
    return np.random.default_rng(seed)


def _data(dense_dim=6, sparse=((3, 4),), label_dim=1, label_top="label"):
    """A Data layer plus one embedding layer per (slot_num, vec_size[, combiner])."""
    data = {
        "name": "data",
        "type": "Data",
        "label": {"top": label_top, "label_dim": label_dim},
        "dense": {"top": "dense", "dense_dim": dense_dim},
        "sparse": [
            {
                "top": f"data{t}",
                "type": "DistributedSlot",
                "max_feature_num_per_sample": 2 * s[0],
                "slot_num": s[0],
            }
            for t, s in enumerate(sparse)
        ],
    }
    embs = [
        {
            "name": f"emb{t}",
            "type": "DistributedSlotSparseEmbeddingHash",
            "bottom": f"data{t}",
            "top": f"emb{t}",
            "sparse_embedding_hparam": {
                "embedding_vec_size": s[1],
                "combiner": s[2] if len(s) > 2 else "sum",
                "workspace_size_per_gpu_in_mb": 1,
            },
        }
        for t, s in enumerate(sparse)
    ]
    if label_top is None:
        del data["label"]["top"]
    return [data] + embs


def _net(layers, **data_kw):
    return {
        "solver": {"batchsize": 64},
        "optimizer": {"type": "Adam"},
        "layers": _data(**data_kw) + layers,
    }


def _write_floats(path, arrays):
    flat = [np.asarray(a, dtype=np.float32).ravel() for a in arrays]
    (np.concatenate(flat) if flat else np.zeros(0, np.float32)).astype("<f4").tofile(str(path))
    return str(path)


def _load(tmp_path, doc, params, nt=None):
    net = tmp_path / "net.json"
    net.write_text(json.dumps(doc))
    dense = _write_floats(tmp_path / "_dense_0.model", params)
    nt_path = None
    if nt is not None:
        nt_path = tmp_path / "nt.json"
        nt_path.write_text(json.dumps(nt))
    return HugeCTRNetwork.load(str(net), dense, nt_path)


def _inputs(model, seed=1, scale=1.0):
    rng = _rng(seed)
    dense = (rng.standard_normal((B, model.dense_dim)) * scale).astype(np.float32)
    embs = [
        (rng.standard_normal((B, t.slot_num, t.vec_size)) * scale).astype(np.float32)
        for t in model.tables
    ]
    return dense, embs


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _check(model, ref_fn, seed=1, scale=1.0):
    """Predict with the model and compare with ref_fn(dense, embs) (torch tensors)."""
    dense, embs = _inputs(model, seed, scale)
    got = model.predict(dense, embs)
    want = ref_fn(_t(dense), [_t(e) for e in embs]).reshape(B, -1).numpy()
    assert got.dtype == np.float32
    assert got.shape == want.shape == (B, model.label_dim)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-5)
    check_native(model, dense, embs, got)
    return got


def check_native(model, dense, embs, expected):
    """The native executor (issue 14) gives the numpy executor's answer, within fp32
    rounding, on every network it takes; a network it does not take names a layer type
    without a native implementation."""
    if model._net is not None:  # native_net made: predict already runs it
        return
    program = model.native_program()
    if program is None:
        assert any(layer.native is None for layer in model.plan.layers), model
        return
    net = _native.DenseNet(program, model)
    got = net.predict(dense, embs)
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=1e-5)
    # once made, it reads none of the arrays the program points to (native_net lets them
    # go): NaN in every one of them meanwhile changes nothing
    keep = model._native_keep
    saved = [a.copy() for a in keep]
    try:
        for a in keep:
            a.fill(np.nan)
        np.testing.assert_array_equal(net.predict(dense, embs), got)
    finally:
        for a, b in zip(keep, saved):
            a[...] = b
    # Issue 24: on overflowing, infinite, NaN and denormal inputs as well.
    for x_dense, x_embs in extreme_inputs(dense, embs):
        with np.errstate(all="ignore"):  # numpy's overflow warnings: the point of the test
            want = model.predict(x_dense, x_embs)
        check_extreme_answers(net.predict(x_dense, x_embs), want, atol=ATOL)


def _linear(d_in, d_out, seed, bias=True):
    torch.manual_seed(seed)
    return torch.nn.Linear(d_in, d_out, bias=bias)


def _fc_params(lin):
    """HugeCTR layout of an InnerProduct: W [in, out] row-major, then b [out]."""
    return [lin.weight.detach().numpy().T, lin.bias.detach().numpy()]


def _layer(name, type_, bottom, top, **kw):
    d = {"name": name, "type": type_, "bottom": bottom, "top": top}
    d.update(kw)
    return d


def _flat(name, bottom, top):
    """A Reshape of [B, S, V] to [B, S*V] (leading_dim omitted: elements per row)."""
    return _layer(name, "Reshape", bottom, top)


# ---------------------------------------------------------------------------------------
# combine_slots
# ---------------------------------------------------------------------------------------


def _combine_ref(vectors, row_ptr, combiner):
    out = np.zeros((len(row_ptr) - 1, vectors.shape[1]), np.float64)
    for i in range(len(row_ptr) - 1):
        rows = vectors[row_ptr[i] : row_ptr[i + 1]].astype(np.float64)
        if len(rows):
            out[i] = rows.sum(0)
            if combiner == "mean" and len(rows) > 1:
                out[i] /= len(rows)
    return out


def _combine_float32_in_row_order(vectors, row_ptr, combiner):
    """HugeCTR's kernel order: a float32 accumulator, rows added one after the other."""
    out = np.zeros((len(row_ptr) - 1, vectors.shape[1]), np.float32)
    for i in range(len(row_ptr) - 1):
        a, b = int(row_ptr[i]), int(row_ptr[i + 1])
        for r in range(a, b):
            out[i] = out[i] + vectors[r] if r > a else vectors[r]
        if combiner == "mean" and b - a > 1:
            out[i] = out[i] / np.float32(b - a)
    return out


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_combine_slots_sums_or_averages_each_slot_and_gives_zeros_for_empty_slots(combiner, native):
    rng = _rng(3)
    counts = np.array([1, 0, 3, 2, 0, 0, 1, 4])
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    vecs = rng.standard_normal((ptr[-1], 5)).astype(np.float32)
    got = combine_slots(vecs, ptr, combiner, slot_num=2, native=native)
    assert got.shape == (4, 2, 5) and got.dtype == np.float32
    np.testing.assert_allclose(got.reshape(8, 5), _combine_ref(vecs, ptr, combiner), atol=1e-6)
    assert not got.reshape(8, 5)[[1, 4, 5]].any()


@pytest.mark.parametrize("native", [True, False])
def test_mean_divides_only_when_a_slot_has_more_than_one_key(native):
    vecs = np.array([[2.0, 4.0], [1.0, 1.0], [3.0, 3.0]], np.float32)
    got = combine_slots(vecs, np.array([0, 1, 3]), Combiner.MEAN, native=native)
    np.testing.assert_array_equal(got, [[2.0, 4.0], [2.0, 2.0]])


def test_combine_slots_takes_the_long_slot_path_with_the_same_results():
    # One very long slot among many short ones: the padded gather would be too big, so the
    # array code's running-sum path runs; results must still match the loop reference.
    rng = _rng(4)
    counts = np.array([0, 1] * 50 + [5000] + [2, 0] * 50)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    vecs = rng.standard_normal((ptr[-1], 3)).astype(np.float32)
    for comb in ("sum", "mean"):
        np.testing.assert_allclose(
            combine_slots(vecs, ptr, comb, native=False), _combine_ref(vecs, ptr, comb), atol=2e-5
        )
        # The native loop adds in float32 in row order, as HugeCTR's kernel does.
        native = combine_slots(vecs, ptr, comb)
        np.testing.assert_array_equal(native, _combine_float32_in_row_order(vecs, ptr, comb))
        np.testing.assert_allclose(native, _combine_ref(vecs, ptr, comb), atol=2e-3)


@pytest.mark.parametrize("seed", range(5))
def test_the_native_loop_and_the_array_code_agree_on_random_slots(seed):
    rng = _rng(10 + seed)
    counts = rng.integers(0, 6, rng.integers(1, 300))
    ptr = np.concatenate([[0], np.cumsum(counts)])
    vecs = rng.standard_normal((ptr[-1], int(rng.integers(1, 40)))).astype(np.float32)
    for comb in ("sum", "mean"):
        native = combine_slots(vecs, ptr, comb)
        np.testing.assert_array_equal(native, _combine_float32_in_row_order(vecs, ptr, comb))
        np.testing.assert_allclose(native, combine_slots(vecs, ptr, comb, native=False), atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_combine_slots_uses_row_pointers_as_absolute_offsets(native):
    vecs = np.arange(8, dtype=np.float32).reshape(4, 2)
    got = combine_slots(vecs, np.array([1, 2, 2, 4]), "sum", native=native)
    np.testing.assert_array_equal(got, [[2, 3], [0, 0], [10, 12]])


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("ptr", [[0, 2, 1], [0, 1, 5], [-1, 0, 1]])
def test_combine_slots_rejects_row_pointers_that_do_not_fit_the_vectors(ptr, native):
    with pytest.raises(RequestError, match="row pointers"):
        combine_slots(np.zeros((3, 2), np.float32), np.array(ptr), "sum", native=native)


@pytest.mark.parametrize("native", [True, False])
def test_combine_slots_with_no_keys_at_all_gives_zeros(native):
    got = combine_slots(
        np.zeros((0, 4), np.float32), np.zeros(7, np.int64), "mean", slot_num=3, native=native
    )
    assert got.shape == (2, 3, 4) and not got.any()


# ---------------------------------------------------------------------------------------
# each layer against torch
# ---------------------------------------------------------------------------------------


def test_inner_product_is_x_times_w_plus_b_with_w_stored_in_by_out(tmp_path):
    lin = _linear(6, 5, 0)
    doc = _net([_layer("fc", "InnerProduct", "dense", "fc", fc_param={"num_output": 5})])
    m = _load(tmp_path, doc, _fc_params(lin))
    _check(m, lambda d, e: lin(d))


def test_inner_product_on_a_3d_input_applies_to_every_slot(tmp_path):
    lin = _linear(4, 3, 1)
    doc = _net([_layer("fc", "InnerProduct", "emb0", "fc", fc_param={"num_output": 3})])
    m = _load(tmp_path, doc, _fc_params(lin))
    assert m.label_dim == 3 * 3
    _check(m, lambda d, e: lin(e[0]))


@pytest.mark.parametrize(
    "type_, ref",
    [
        ("ReLU", torch.relu),
        ("Sigmoid", torch.sigmoid),
        ("Dropout", torch.nn.Dropout(0.5).eval()),
        ("Softmax", lambda x: torch.softmax(x, dim=-1)),
    ],
)
def test_elementwise_activations_match_torch(tmp_path, type_, ref):
    doc = _net([_layer("act", type_, "dense", "act", rate=0.5)])
    m = _load(tmp_path, doc, [])
    _check(m, lambda d, e: ref(d), scale=5.0)


@pytest.mark.parametrize("first", ["Dropout", "Reshape", "InnerProduct"])
def test_in_place_steps_never_write_into_the_callers_inputs(tmp_path, first):
    # The executor runs a ReLU in place on a temporary of the layer before it; after a
    # Dropout (the input itself) or a Reshape (a view of it) it must not.
    kw = {"fc_param": {"num_output": 3}} if first == "InnerProduct" else {"rate": 0.5}
    if first == "Reshape":
        kw = {"leading_dim": 3}  # [B, 6] -> [2B, 3]
    doc = _net(
        [
            _layer("a", first, "dense", "a", **kw),
            _layer("r", "ReLU", "a", "r"),
            _layer("s", "Sigmoid", "r", "s"),
        ]
    )
    lin = _linear(6, 3, 7)
    m = _load(tmp_path, doc, _fc_params(lin) if first == "InnerProduct" else [])
    dense, embs = _inputs(m, seed=3)
    before = [dense.copy()] + [e.copy() for e in embs]
    got = m.predict(dense, embs)
    for a, b in zip([dense] + embs, before):
        np.testing.assert_array_equal(a, b)
    x = _t(dense)
    ref = torch.sigmoid(torch.relu(lin(x) if first == "InnerProduct" else x))
    np.testing.assert_allclose(got, ref.detach().numpy().reshape(B, -1), atol=ATOL, rtol=1e-5)


def test_sigmoid_does_not_overflow_on_large_inputs(tmp_path):
    m = _load(tmp_path, _net([_layer("s", "Sigmoid", "dense", "s")]), [])
    x = np.array([[-1e4, -100, 0, 100, 1e4, 3]], np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        got = m.predict(x, [np.zeros((1, 3, 4), np.float32)])
    np.testing.assert_allclose(got, torch.sigmoid(_t(x)).numpy(), atol=1e-7)


def test_concat_of_2d_tensors_joins_columns_in_bottom_order_and_ignores_axis(tmp_path):
    doc = _net([_flat("r", "emb0", "r"), _layer("c", "Concat", ["r", "dense"], "c", axis=2)])
    m = _load(tmp_path, doc, [])
    _check(m, lambda d, e: torch.cat([e[0].reshape(B, -1), d], dim=1))


@pytest.mark.parametrize("axis", [1, 2])
def test_concat_of_3d_tensors_joins_along_the_given_axis(tmp_path, axis):
    other = (3, 2) if axis == 1 else (2, 5)
    sparse = ((2, 4), other) if axis == 1 else ((2, 4), (2, 5))
    doc = _net([_layer("c", "Concat", ["emb0", "emb1"], "c", axis=axis)], sparse=sparse)
    if axis == 1:
        doc["layers"][0]["sparse"][1]["slot_num"] = 3
        doc["layers"][2]["sparse_embedding_hparam"]["embedding_vec_size"] = 4
    m = _load(tmp_path, doc, [])
    _check(m, lambda d, e: torch.cat(e, dim=axis))


def test_concat_3d_defaults_to_axis_1(tmp_path):
    doc = _net([_layer("c", "Concat", ["emb0", "emb1"], "c")], sparse=((2, 4), (3, 4)))
    m = _load(tmp_path, doc, [])
    _check(m, lambda d, e: torch.cat(e, dim=1))


def test_reshape_with_leading_dim_reinterprets_rows_row_major(tmp_path):
    # [B, 3, 4] -> [B*6, 2] -> fc per row -> [B, 6*1] (rows of one sample stay together)
    lin = _linear(2, 1, 2)
    doc = _net(
        [
            _layer("r", "Reshape", "emb0", "r", leading_dim=2),
            _layer("fc", "InnerProduct", "r", "fc", fc_param={"num_output": 1}),
            _layer("r2", "Reshape", "fc", "r2", leading_dim=6),
        ]
    )
    m = _load(tmp_path, doc, _fc_params(lin))
    assert m.label_dim == 6
    _check(m, lambda d, e: lin(e[0].reshape(-1, 2)).reshape(B, 6))


def test_reshape_with_time_step_gives_a_3d_tensor(tmp_path):
    doc = _net(
        [
            _layer("r", "Reshape", "dense", "r", leading_dim=2, time_step=3),
            _layer("s", "ReduceSum", "r", "s", axis=2),
        ]
    )
    m = _load(tmp_path, doc, [])
    _check(m, lambda d, e: d.reshape(B, 3, 2).sum(dim=2, keepdim=True))


def test_reshape_with_selected_gathers_those_slots_in_list_order(tmp_path):
    doc = _net([_layer("r", "Reshape", "emb0", "r", selected=[4, 0, 2])], sparse=((5, 3),))
    m = _load(tmp_path, doc, [])
    assert m.label_dim == 9
    _check(m, lambda d, e: e[0][:, [4, 0, 2], :].reshape(B, -1))


def test_interaction_pairs_come_in_row_major_lower_triangle_order_then_a_zero(tmp_path):
    def ref(d, e):
        mlp, emb = d[:, :4], e[0]
        z = torch.cat([mlp[:, None, :], emb], dim=1)
        n = z.shape[1]
        cols = [mlp]
        for i in range(1, n):  # (1,0), (2,0), (2,1), (3,0), ...
            for j in range(i):
                cols.append((z[:, i, :] * z[:, j, :]).sum(dim=1, keepdim=True))
        cols.append(torch.zeros(B, 1))
        return torch.cat(cols, dim=1)

    doc = _net(
        [
            _layer("s", "Slice", "dense", ["mlp", "rest"], ranges=[[0, 4], [4, 6]]),
            _layer("i", "Interaction", ["mlp", "emb0"], "i"),
        ],
        sparse=((5, 4),),
    )
    m = _load(tmp_path, doc, [])
    assert m.label_dim == 4 + 6 * 5 // 2 + 1
    got = _check(m, ref)
    assert not got[:, -1].any()


def test_multicross_v1_is_x0_times_xl_dot_w_plus_xl_plus_b(tmp_path):
    rng = _rng(5)
    d, layers = 6, 3
    ws = [rng.standard_normal(d).astype(np.float32) * 0.3 for _ in range(layers)]
    bs = [rng.standard_normal(d).astype(np.float32) * 0.3 for _ in range(layers)]

    def ref(x0, e):
        xl = x0
        for w, b in zip(ws, bs):
            xl = x0 * (xl @ _t(w))[:, None] + xl + _t(b)
        return xl

    doc = _net([_layer("mc", "MultiCross", "dense", "mc", mc_param={"num_layers": layers})])
    params = [a for pair in zip(ws, bs) for a in pair]  # w0, b0, w1, b1, ...
    _check(_load(tmp_path, doc, params), ref)


def test_multicross_v2_uses_the_low_rank_u_v_projection(tmp_path):
    rng = _rng(6)
    d, p, layers = 6, 2, 2
    us = [rng.standard_normal((d, p)).astype(np.float32) * 0.4 for _ in range(layers)]
    vs = [rng.standard_normal((p, d)).astype(np.float32) * 0.4 for _ in range(layers)]
    bs = [rng.standard_normal(d).astype(np.float32) * 0.4 for _ in range(layers)]

    def ref(x0, e):
        xl = x0
        for u, v, b in zip(us, vs, bs):
            xl = x0 * (xl @ _t(u) @ _t(v) + _t(b)) + xl
        return xl

    doc = _net(
        [
            _layer(
                "mc",
                "MultiCross",
                "dense",
                "mc",
                mc_param={"num_layers": layers, "projection_dim": p},
            )
        ]
    )
    params = [a for trio in zip(us, vs, bs) for a in trio]  # U0, V0, b0, U1, ...
    _check(_load(tmp_path, doc, params), ref)


def test_fm_order2_equals_the_sum_of_pairwise_products(tmp_path):
    def ref(d, e):
        x = e[0]  # [B, S, D]
        s = x.shape[1]
        out = torch.zeros(B, x.shape[2])
        for i in range(s):
            for j in range(i + 1, s):
                out += x[:, i, :] * x[:, j, :]
        return out

    doc = _net(
        [_flat("r", "emb0", "r"), _layer("fm", "FmOrder2", "r", "fm", out_dim=4)], sparse=((5, 4),)
    )
    m = _load(tmp_path, doc, [])
    assert m.label_dim == 4
    _check(m, ref)


def test_slice_ranges_are_half_open_and_may_overlap_and_the_last_top_is_the_output(tmp_path):
    doc = _net([_layer("s", "Slice", "dense", ["a", "b"], ranges=[[0, 4], [2, 6]])])
    m = _load(tmp_path, doc, [])
    assert m.label_dim == 4
    _check(m, lambda d, e: d[:, 2:6])


def test_weight_multiply_scales_each_column_by_its_weight_row(tmp_path):
    w = _rng(7).standard_normal((6, 3)).astype(np.float32)

    def ref(d, e):
        return torch.einsum("bs,se->bse", d, _t(w)).reshape(B, 18)

    doc = _net([_layer("wm", "WeightMultiply", "dense", "wm", weight_dims=[6, 3])])
    _check(_load(tmp_path, doc, [w]), ref)


@pytest.mark.parametrize("axis", [1, 2])
def test_reduce_sum_keeps_the_reduced_axis_as_size_one(tmp_path, axis):
    doc = _net([_layer("rs", "ReduceSum", "emb0", "rs", axis=axis)])
    m = _load(tmp_path, doc, [])
    _check(m, lambda d, e: e[0].sum(dim=axis, keepdim=True))


@pytest.mark.parametrize("type_, op", [("Add", torch.add), ("ElementwiseMultiply", torch.mul)])
def test_add_and_elementwise_multiply_combine_all_bottoms(tmp_path, type_, op):
    doc = _net(
        [
            _layer("s", "Slice", "dense", ["a", "b", "c"], ranges=[[0, 2], [2, 4], [4, 6]]),
            _layer("op", type_, ["a", "b", "c"], "op"),
        ]
    )
    m = _load(tmp_path, doc, [])
    _check(m, lambda d, e: op(op(d[:, 0:2], d[:, 2:4]), d[:, 4:6]))


def test_batch_norm_uses_running_statistics_from_the_non_trainable_file(tmp_path):
    rng = _rng(8)
    bn = torch.nn.BatchNorm1d(6, eps=1e-3).eval()
    bn.weight.copy_(_t(rng.standard_normal(6)))
    bn.bias.copy_(_t(rng.standard_normal(6)))
    bn.running_mean.copy_(_t(rng.standard_normal(6)))
    bn.running_var.copy_(_t(rng.random(6) + 0.5))
    doc = _net([_layer("bn", "BatchNorm", "dense", "bn", bn_param={"factor": 1.0, "eps": 1e-3})])
    nt = {
        "layers": [
            {"type": "BatchNorm", "mean": bn.running_mean.tolist(), "var": bn.running_var.tolist()}
        ]
    }
    m = _load(tmp_path, doc, [bn.weight.numpy(), bn.bias.numpy()], nt=nt)
    _check(m, lambda d, e: bn(d))


def test_mlp_stacks_fused_layers_and_stores_every_bias_even_when_unused(tmp_path):
    lins = [_linear(6, 8, 10), _linear(8, 5, 11), _linear(5, 3, 12)]
    acts = ["Relu", "Relu", "None"]
    biases = [True, False, True]

    def ref(d, e):
        x = d
        for lin, act, use_b in zip(lins, acts, biases):
            x = x @ lin.weight.T + (lin.bias if use_b else 0)
            if act == "Relu":
                x = torch.relu(x)
        return x

    doc = _net(
        [
            _layer(
                "mlp",
                "MLP",
                "dense",
                "mlp",
                mlp_param={"num_outputs": [8, 5, 3], "activations": acts, "biases": biases},
            )
        ]
    )
    params = [a for lin in lins for a in _fc_params(lin)]  # W0, b0 (unused b1 still stored), ...
    m = _load(tmp_path, doc, params)
    assert m.num_params == sum(p.size for p in params)
    _check(m, ref)


def test_mlp_activation_applies_to_every_layer_including_the_last(tmp_path):
    lins = [_linear(6, 4, 13), _linear(4, 3, 14)]
    doc = _net(
        [
            _layer(
                "mlp",
                "MLP",
                "dense",
                "mlp",
                mlp_param={"num_outputs": [4, 3], "activation": "Relu"},
            )
        ]
    )
    m = _load(tmp_path, doc, [a for lin in lins for a in _fc_params(lin)])
    _check(m, lambda d, e: torch.relu(lins[1](torch.relu(lins[0](d)))))


def test_binary_cross_entropy_loss_becomes_a_sigmoid_of_its_first_bottom(tmp_path):
    lin = _linear(6, 1, 15)
    doc = _net(
        [
            _layer("fc", "InnerProduct", "dense", "fc", fc_param={"num_output": 1}),
            _layer("loss", "BinaryCrossEntropyLoss", ["fc", "label"], "loss"),
        ]
    )
    m = _load(tmp_path, doc, _fc_params(lin))
    _check(m, lambda d, e: torch.sigmoid(lin(d)))


def test_cross_entropy_loss_becomes_a_softmax(tmp_path):
    lin = _linear(6, 4, 16)
    doc = _net(
        [
            _layer("fc", "InnerProduct", "dense", "fc", fc_param={"num_output": 4}),
            _layer("loss", "CrossEntropyLoss", ["fc", "label"], "loss"),
        ]
    )
    m = _load(tmp_path, doc, _fc_params(lin))
    _check(m, lambda d, e: torch.softmax(lin(d), dim=1))


def test_two_loss_layers_predict_the_concatenation_of_both_tasks(tmp_path):
    l1, l2 = _linear(3, 1, 17), _linear(3, 2, 18)
    doc = _net(
        [
            _layer("s", "Slice", "dense", ["a", "b"], ranges=[[0, 3], [3, 6]]),
            _layer("fc1", "InnerProduct", "a", "fc1", fc_param={"num_output": 1}),
            _layer("fc2", "InnerProduct", "b", "fc2", fc_param={"num_output": 2}),
            _layer("loss1", "BinaryCrossEntropyLoss", ["fc1", "label1"], "loss1"),
            _layer("loss2", "MultiCrossEntropyLoss", ["fc2", "label2"], "loss2"),
        ],
        label_dim=[1, 2],
        label_top=["label1", "label2"],
    )
    m = _load(tmp_path, doc, _fc_params(l1) + _fc_params(l2))
    assert m.label_dim == 3
    _check(
        m, lambda d, e: torch.cat([torch.sigmoid(l1(d[:, :3])), torch.sigmoid(l2(d[:, 3:]))], dim=1)
    )
    assert m.predict(np.zeros((0, 6), np.float32), [np.zeros((0, 3, 4), np.float32)]).shape == (
        0,
        3,
    )


# ---------------------------------------------------------------------------------------
# dense-file layout on whole networks built in torch
# ---------------------------------------------------------------------------------------


class _TorchDCN(torch.nn.Module):
    """DCN v1 + deep tower + WeightMultiply + BatchNorm, in plain torch."""

    def __init__(self, dense_dim, slots, vec, seed=20):
        super().__init__()
        torch.manual_seed(seed)
        self.d = slots * vec + dense_dim
        self.wm = torch.nn.Parameter(torch.randn(dense_dim, 2) * 0.3)
        self.cross_w = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(self.d) * 0.1) for _ in range(2)]
        )
        self.cross_b = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(self.d) * 0.1) for _ in range(2)]
        )
        self.fc1 = torch.nn.Linear(self.d, 16)
        self.bn = torch.nn.BatchNorm1d(16, eps=1e-5).eval()
        self.bn.weight.copy_(torch.rand(16) + 0.5)
        self.bn.bias.copy_(torch.randn(16) * 0.1)
        self.bn.running_mean.copy_(torch.randn(16) * 0.1)
        self.bn.running_var.copy_(torch.rand(16) + 0.5)
        self.fc2 = torch.nn.Linear(16, 8)
        self.out = torch.nn.Linear(self.d + 8 + 2 * dense_dim, 1)

    def forward(self, dense, emb):
        x0 = torch.cat([emb.reshape(emb.shape[0], -1), dense], dim=1)
        xl = x0
        for w, b in zip(self.cross_w, self.cross_b):
            xl = x0 * (xl @ w)[:, None] + xl + b
        deep = torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x0)))))
        wm = (dense[:, :, None] * self.wm[None]).reshape(dense.shape[0], -1)
        return torch.sigmoid(self.out(torch.cat([xl, deep, wm], dim=1)))

    def hugectr_params(self):
        """Parameters in HugeCTR dense-file order (the JSON order below)."""
        cross = [a.detach().numpy() for pair in zip(self.cross_w, self.cross_b) for a in pair]
        return (
            cross
            + _fc_params(self.fc1)
            + [self.bn.weight.numpy(), self.bn.bias.numpy()]
            + _fc_params(self.fc2)
            + [self.wm.detach().numpy()]
            + _fc_params(self.out)
        )


def _dcn_json(dense_dim, slots, vec):
    d = slots * vec + dense_dim
    layers = [
        _layer("reshape1", "Reshape", "emb0", "reshape1", leading_dim=slots * vec),
        _layer(
            "slice_dense",
            "Slice",
            "dense",
            ["dense_a", "dense_b"],
            ranges=[[0, dense_dim], [0, dense_dim]],
        ),
        _layer("concat1", "Concat", ["reshape1", "dense_a"], "concat1"),
        _layer("slice1", "Slice", "concat1", ["slice11", "slice12"], ranges=[[0, d], [0, d]]),
        _layer("multicross1", "MultiCross", "slice11", "multicross1", mc_param={"num_layers": 2}),
        _layer("fc1", "InnerProduct", "slice12", "fc1", fc_param={"num_output": 16}),
        _layer("bn1", "BatchNorm", "fc1", "bn1", bn_param={"factor": 0.99, "eps": 1e-5}),
        _layer("relu1", "ReLU", "bn1", "relu1"),
        _layer("dropout1", "Dropout", "relu1", "dropout1", rate=0.5),
        _layer("fc2", "InnerProduct", "dropout1", "fc2", fc_param={"num_output": 8}),
        _layer("relu2", "ReLU", "fc2", "relu2"),
        _layer("wm", "WeightMultiply", "dense_b", "wm", weight_dims=[dense_dim, 2]),
        _layer("concat2", "Concat", ["multicross1", "relu2", "wm"], "concat2"),
        _layer("fc3", "InnerProduct", "concat2", "fc3", fc_param={"num_output": 1}),
        _layer("loss", "BinaryCrossEntropyLoss", ["fc3", "label"], "loss"),
    ]
    return _net(layers, dense_dim=dense_dim, sparse=((slots, vec, 1),))


def test_a_whole_torch_network_written_in_hugectr_layout_predicts_the_same(tmp_path):
    ref = _TorchDCN(dense_dim=5, slots=4, vec=3)
    params = ref.hugectr_params()
    nt = {
        "layers": [
            {
                "type": "BatchNorm",
                "mean": ref.bn.running_mean.tolist(),
                "var": ref.bn.running_var.tolist(),
            }
        ]
    }
    m = _load(tmp_path, _dcn_json(5, 4, 3), params, nt=nt)
    assert m.num_params == sum(np.asarray(p).size for p in params)
    assert [(t.slot_num, t.vec_size, t.combiner) for t in m.tables] == [(4, 3, Combiner.MEAN)]
    got = _check(m, lambda d, e: ref(d, e[0]))
    assert np.all((got > 0) & (got < 1))


class _TorchDLRM(torch.nn.Module):
    def __init__(self, dense_dim, slots, vec, seed=30):
        super().__init__()
        torch.manual_seed(seed)
        self.bottom = [torch.nn.Linear(dense_dim, 8), torch.nn.Linear(8, vec)]
        n = slots + 1
        self.top_in = vec + n * (n - 1) // 2 + 1
        self.top = [torch.nn.Linear(self.top_in, 6), torch.nn.Linear(6, 1)]

    def forward(self, dense, emb):
        x = torch.relu(self.bottom[1](torch.relu(self.bottom[0](dense))))
        z = torch.cat([x[:, None, :], emb], dim=1)
        pairs = [
            (z[:, i] * z[:, j]).sum(1, keepdim=True) for i in range(z.shape[1]) for j in range(i)
        ]
        inter = torch.cat([x] + pairs + [torch.zeros(x.shape[0], 1)], dim=1)
        return torch.sigmoid(self.top[1](torch.relu(self.top[0](inter))))

    def hugectr_params(self):
        return [a for lin in self.bottom + self.top for a in _fc_params(lin)]


def test_a_dlrm_with_mlp_layers_and_interaction_predicts_like_torch(tmp_path):
    ref = _TorchDLRM(dense_dim=6, slots=5, vec=4)
    layers = [
        _layer(
            "mlp1", "MLP", "dense", "mlp1", mlp_param={"num_outputs": [8, 4], "activation": "Relu"}
        ),
        _layer("interaction1", "Interaction", ["mlp1", "emb0"], "interaction1"),
        _layer(
            "mlp2",
            "MLP",
            "interaction1",
            "mlp2",
            mlp_param={"num_outputs": [6, 1], "activations": ["Relu", "None"]},
        ),
        _layer("loss", "BinaryCrossEntropyLoss", ["mlp2", "label"], "loss"),
    ]
    doc = {"layers": _data(dense_dim=6, sparse=((5, 4, "sum"),)) + layers}
    m = _load(tmp_path, doc, ref.hugectr_params())
    _check(m, lambda d, e: ref(d, e[0]), scale=0.5)


# ---------------------------------------------------------------------------------------
# the upstream samples, dense-file size
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, params, combiner", [(DCN, 166601, Combiner.MEAN), (DEEPFM, 477744, Combiner.SUM)]
)
def test_upstream_samples_load_unchanged_with_a_dense_file_of_exactly_the_right_size(
    tmp_path, path, params, combiner
):
    plan = HugeCTRNetwork.parse(path)
    assert plan.num_params == params and plan.dense_file_bytes == 4 * params
    dense = _write_floats(tmp_path / "d.model", [_rng(9).standard_normal(params) * 0.05])
    m = HugeCTRNetwork.load(path, dense)
    assert isinstance(m, DenseModel)
    assert (m.dense_dim, m.label_dim, m.total_slots) == (13, 1, 26)
    (t,) = m.tables
    assert (t.name, t.slot_num, t.combiner, t.input_name, t.max_feature_num_per_sample) == (
        "sparse_embedding1",
        26,
        combiner,
        "data1",
        30,
    )
    dense_in, embs = _inputs(m)
    out = m.predict(dense_in, embs)
    assert out.shape == (B, 1) and out.dtype == np.float32 and np.all(np.isfinite(out))
    assert np.all((out >= 0) & (out <= 1))  # both end in a Sigmoid


def test_the_deepfm_sample_computes_fm_plus_linear_plus_deep_terms(tmp_path):
    # Independent torch rendering of deepfm.json with its dense file's layout.
    rng = _rng(10)
    wm1, wm2 = rng.standard_normal((13, 10)) * 0.1, rng.standard_normal((13, 1)) * 0.1
    lins = [
        _linear(390, 400, 40),
        _linear(400, 400, 41),
        _linear(400, 400, 42),
        _linear(400, 1, 43),
    ]
    params = [wm1, wm2] + [a for lin in lins for a in _fc_params(lin)]
    dense = _write_floats(tmp_path / "d.model", params)
    m = HugeCTRNetwork.load(DEEPFM, dense)

    def ref(d, e):
        emb = e[0]  # [B, 26, 11]: 10 FM factors + 1 linear weight per slot
        fm_in = torch.cat(
            [emb[:, :, :10].reshape(B, 260), (d[:, :, None] * _t(wm1)).reshape(B, 130)], 1
        )
        deep = fm_in
        for lin in lins[:3]:
            deep = torch.relu(lin(deep))
        deep = lins[3](deep)
        v = fm_in.reshape(B, 39, 10)
        fm = 0.5 * (v.sum(1) ** 2 - (v * v).sum(1)).sum(1, keepdim=True)
        linear = torch.cat([emb[:, :, 10], d * _t(wm2)[:, 0]], 1).sum(1, keepdim=True)
        return torch.sigmoid(deep + fm + linear)

    _check(m, ref, scale=0.3)


@pytest.mark.parametrize("delta, words", [(-1, "too short"), (1, "too long")])
def test_a_dense_file_one_float_off_fails_naming_the_file_and_the_bytes(tmp_path, delta, words):
    n = HugeCTRNetwork.parse(DCN).num_params + delta
    dense = _write_floats(tmp_path / "_dense_10000.model", [np.zeros(n)])
    with pytest.raises(ModelFileError) as err:
        HugeCTRNetwork.load(DCN, dense)
    msg = str(err.value)
    assert err.value.path == dense and dense in msg and words in msg
    assert "666404 bytes" in msg and f"{4 * n} bytes" in msg
    assert "layer 'fc4' (InnerProduct)" in msg
    if delta < 0:
        assert (
            "fc4' (InnerProduct): W [200, 1] + b [1] = 201 floats, bytes [665600, 666404)"
            "   <-- the file ends here" in msg
        )


def test_a_short_file_marks_the_first_layer_it_cannot_fill(tmp_path):
    dense = _write_floats(tmp_path / "d.model", [np.zeros(90000)])
    with pytest.raises(ModelFileError) as err:
        HugeCTRNetwork.load(DCN, dense)
    (marked,) = [line for line in str(err.value).splitlines() if "<--" in line]
    assert "layer 'fc2'" in marked


def test_a_missing_dense_file_names_the_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found") as err:
        HugeCTRNetwork.load(DCN, str(tmp_path / "nope.model"))
    assert err.value.path.endswith("nope.model")


# ---------------------------------------------------------------------------------------
# structure errors
# ---------------------------------------------------------------------------------------


def _plan_error(doc, match, exc=ConfigError):
    with pytest.raises(exc, match=match) as err:
        HugeCTRNetwork.parse(doc)
    return str(err.value)


def test_an_unsupported_layer_fails_naming_its_type_and_name():
    msg = _plan_error(
        _net([_layer("gru1", "GRU", "dense", "g", gru_param={})]), "unsupported type 'GRU'"
    )
    assert "layer 'gru1'" in msg


def test_a_tensor_read_twice_fails_as_upstream_requires():
    doc = _net([_layer("a", "ReLU", "dense", "a"), _layer("b", "Sigmoid", "dense", "b")])
    _plan_error(
        doc, "tensor 'dense' is read by both layer 'a' \\(ReLU\\) and layer 'b' \\(Sigmoid\\)"
    )


def test_an_undefined_bottom_fails_naming_the_layer_and_tensor():
    _plan_error(
        _net([_layer("a", "ReLU", "nothing", "a")]), "layer 'a' \\(ReLU\\) reads tensor 'nothing'"
    )


def test_a_top_name_used_twice_fails():
    doc = _net(
        [
            _layer("s", "Slice", "dense", ["x", "y"], ranges=[[0, 3], [3, 6]]),
            _layer("a", "ReLU", "x", "y"),
        ]
    )
    _plan_error(doc, "tensor 'y' is produced twice")


def test_unconsumed_tensors_and_an_unused_label_are_fine():
    doc = _net(
        [
            _layer("s", "Slice", "dense", ["x", "y"], ranges=[[0, 3], [3, 6]]),
            _layer("a", "ReLU", "x", "a"),
        ]
    )
    assert HugeCTRNetwork.parse(doc).output == ("a",)


def test_a_missing_key_names_the_layer_and_the_key():
    _plan_error(
        _net([_layer("fc9", "InnerProduct", "dense", "fc", fc_param={})]),
        "layer 'fc9'.*'fc_param.num_output'",
    )


def test_a_shape_mismatch_names_the_layer_and_shapes():
    lin = {"num_output": 2}
    doc = _net(
        [
            _layer("fc", "InnerProduct", "dense", "fc", fc_param=lin),
            _layer("add", "Add", ["fc", "emb0"], "o"),
        ]
    )
    _plan_error(doc, "layer 'add' \\(Add\\).*\\[B, 2\\], \\[B, 3, 4\\]")


def test_a_reshape_whose_rows_would_mix_samples_is_rejected():
    _plan_error(
        _net([_layer("r", "Reshape", "dense", "r", leading_dim=4)]), "rows would mix samples"
    )


def test_reduce_sum_over_the_batch_axis_is_rejected():
    _plan_error(_net([_layer("r", "ReduceSum", "dense", "r", axis=0)]), "sums over the batch")


def test_slice_ranges_must_be_in_order_and_within_the_width():
    _plan_error(
        _net([_layer("s", "Slice", "dense", ["a", "b"], ranges=[[2, 4], [0, 3]])]),
        "must not decrease",
    )
    _plan_error(_net([_layer("s", "Slice", "dense", ["a"], ranges=[[0, 7]])]), "end <= 6")


def test_the_pre_v21_top_level_data_format_is_rejected_clearly():
    _plan_error({"data": {"label_dim": 1, "slot_num": 1}, "layers2": []}, "pre-v2.1")


def test_the_first_layer_must_be_data():
    _plan_error({"layers": [_layer("a", "ReLU", "x", "y")]}, "first layer must be the Data layer")


def test_embedding_layers_must_follow_the_order_of_the_sparse_inputs():
    doc = _net([_layer("c", "Concat", ["emb0", "emb1"], "c")], sparse=((2, 4), (3, 4)))
    doc["layers"][1], doc["layers"][2] = doc["layers"][2], doc["layers"][1]
    _plan_error(doc, "order of the Data layer's sparse inputs")


def test_a_sparse_input_without_an_embedding_layer_fails():
    doc = _net([_layer("a", "ReLU", "dense", "a")], sparse=((2, 4), (3, 4)))
    del doc["layers"][2]
    _plan_error(doc, "'data1'.* no embedding layer")


def test_a_bad_combiner_names_the_layer():
    doc = _net([_layer("a", "ReLU", "dense", "a")], sparse=((2, 4, "max"),))
    _plan_error(doc, "layer 'emb0'.*combiner")


@pytest.mark.parametrize(
    "value, want",
    [(0, Combiner.SUM), (1, Combiner.MEAN), ("sum", Combiner.SUM), ("mean", Combiner.MEAN)],
)
def test_combiner_is_read_in_both_the_old_numeric_and_the_string_form(value, want):
    doc = _net([_layer("a", "ReLU", "dense", "a")], sparse=((2, 4, value),))
    assert HugeCTRNetwork.parse(doc).tables[0].combiner is want


def test_tables_expose_slots_vector_size_and_max_nnz_for_the_request_layout():
    doc = _net([_layer("c", "Concat", ["r0", "r1"], "c")], sparse=((2, 4), (3, 8, "mean")))
    doc["layers"][3:3] = [_flat("f0", "emb0", "r0"), _flat("f1", "emb1", "r1")]
    doc["layers"][0]["sparse"][1]["nnz_per_slot"] = [1, 5, 2]
    del doc["layers"][0]["sparse"][1]["max_feature_num_per_sample"]
    plan = HugeCTRNetwork.parse(doc)
    t0, t1 = plan.tables
    assert (t0.slot_num, t0.vec_size, t0.combiner, t0.max_nnz) == (2, 4, Combiner.SUM, None)
    assert (t1.name, t1.input_name, t1.output_name) == ("emb1", "data1", "emb1")
    assert (t1.slot_num, t1.vec_size, t1.combiner, t1.max_nnz, t1.max_feature_num_per_sample) == (
        3,
        8,
        Combiner.MEAN,
        5,
        8,
    )
    assert plan.label_dim == 2 * 4 + 3 * 8


def test_batch_norm_without_running_statistics_fails_naming_the_layer(tmp_path):
    doc = _net([_layer("bn7", "BatchNorm", "dense", "bn", bn_param={"factor": 1.0, "eps": 1e-5})])
    with pytest.raises(ConfigError, match="'bn7'.*non_trainable_params_file"):
        _load(tmp_path, doc, [np.ones(6), np.zeros(6)])


def test_a_non_trainable_file_with_the_wrong_length_names_the_file(tmp_path):
    doc = _net([_layer("bn", "BatchNorm", "dense", "bn", bn_param={"factor": 1.0, "eps": 1e-5})])
    nt = {"layers": [{"type": "BatchNorm", "mean": [0.0] * 5, "var": [1.0] * 6}]}
    with pytest.raises(ModelFileError, match="nt.json.*mean must hold 6 values"):
        _load(tmp_path, doc, [np.ones(6), np.zeros(6)], nt=nt)


def test_a_network_file_that_is_not_json_is_a_model_file_error(tmp_path):
    bad = tmp_path / "net.json"
    bad.write_text("{ not json")
    with pytest.raises(ModelFileError, match="not valid JSON") as err:
        HugeCTRNetwork.parse(str(bad))
    assert err.value.path == str(bad)


def test_predict_rejects_inputs_of_the_wrong_shape(tmp_path):
    m = _load(tmp_path, _net([_layer("a", "ReLU", "dense", "a")]), [])
    with pytest.raises(RequestError, match="dense input must be \\[B, 6\\]"):
        m.predict(np.zeros((2, 5), np.float32), [np.zeros((2, 3, 4), np.float32)])
    with pytest.raises(RequestError, match="table 'emb0' must be \\[2, 3, 4\\]"):
        m.predict(np.zeros((2, 6), np.float32), [np.zeros((2, 3, 5), np.float32)])
    with pytest.raises(RequestError, match="expected 1 embedding inputs"):
        m.predict(np.zeros((2, 6), np.float32), [])


def test_an_empty_batch_gives_an_empty_prediction(tmp_path):
    m = _load(tmp_path, _net([_layer("a", "ReLU", "dense", "a")]), [])
    assert m.predict(np.zeros((0, 6), np.float32), [np.zeros((0, 3, 4), np.float32)]).shape == (
        0,
        6,
    )


def test_table_spec_rejects_nonsense_sizes():
    with pytest.raises(ConfigError):
        TableSpec(name="t", slot_num=0, vec_size=4)


def test_a_ranking_session_answers_num_samples_rows_of_label_dim(tmp_path):
    # upstream's output is [num_samples] (hugectr_backend src/hugectr.cc L2352-2373); with
    # label_dim > 1 each sample's label_dim predictions form a row
    from ps_loader.synthetic import SyntheticTable, table_keys, write_model
    from triton_rec.config.ps_json import parse_ps_config
    from triton_rec.serving.ranking import RankingSession
    from triton_rec.serving.session import TableSet

    lin = _linear(6, 2, 0)
    doc = _net(
        [_layer("fc", "InnerProduct", "dense", "fc", fc_param={"num_output": 2})],
        label_dim=2,
        sparse=((3, 4),),
    )
    model = _load(tmp_path, doc, _fc_params(lin))
    entry = write_model(str(tmp_path / "repo"), "r", [SyntheticTable("t", 100, 4, 6, 0.0)], 1)
    doc = {"supportlonglong": True, "models": [{**entry, "gpucache": False}]}
    params = parse_ps_config(doc, str(tmp_path / "repo")).models[0]
    session = RankingSession(params, TableSet.open(params), model)
    try:
        rng = _rng(3)
        requests, dense = [], []
        for n in (2, 3):
            d = rng.standard_normal((n, 6)).astype(np.float32)
            keys = rng.choice(table_keys(1, 0, 100), n * 3)
            rows = np.arange(n * 3 + 1, dtype=np.int32)
            requests.append(session.parse_request(d.reshape(-1), keys, rows))
            dense.append(d)
        answers = session.predict_many(requests)
        for d, got in zip(dense, answers):
            assert got.shape == (d.shape[0], 2)
            want = lin(_t(d)).detach().numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=ATOL)
    finally:
        session.close()


# ---------------------------------------------------------------------------------------
# one network per process for the instances of a model
# ---------------------------------------------------------------------------------------


def test_shared_loads_the_same_files_once_and_anew_when_a_file_changes(tmp_path):
    lin = _linear(6, 5, 0)
    doc = _net([_layer("fc", "InnerProduct", "dense", "fc", fc_param={"num_output": 5})])
    net = tmp_path / "net.json"
    net.write_text(json.dumps(doc))
    dense = _write_floats(tmp_path / "_dense_0.model", _fc_params(lin))
    a = HugeCTRNetwork.shared(str(net), dense)
    assert HugeCTRNetwork.shared(os.path.join(str(tmp_path), ".", "net.json"), dense) is a
    net_a = a.native_net()
    assert net_a is not None and a.native_net() is net_a  # one executor to share
    _check(a, lambda d, e: lin(d))
    # the dense file replaced (a retrained model): its new weights, not the held ones
    other = _linear(6, 5, 3)
    os.unlink(dense)
    _write_floats(dense, _fc_params(other))
    b = HugeCTRNetwork.shared(str(net), dense)
    assert b is not a
    _check(b, lambda d, e: other(d))
    # held weakly: a network goes with its last holder (an unloaded model's weights)
    gone = weakref.ref(b)
    del a, b, net_a
    gc.collect()
    assert gone() is None
    c = HugeCTRNetwork.shared(str(net), dense)
    _check(c, lambda d, e: other(d))


def test_native_net_runs_predict_and_lets_the_numpy_weights_go(tmp_path):
    lin = _linear(6, 5, 1)
    doc = _net([_layer("fc", "InnerProduct", "dense", "fc", fc_param={"num_output": 5})])
    net = tmp_path / "net.json"
    net.write_text(json.dumps(doc))
    model = HugeCTRNetwork.load(
        str(net), _write_floats(tmp_path / "_dense_0.model", _fc_params(lin))
    )
    dense, embs = _inputs(model, 0, 1.0)
    before = model.predict(dense, embs)
    root = model._arrays[0][0]
    while root.base is not None:  # the array read from the dense file
        root = root.base
    weights = weakref.ref(root)
    del root
    executor = model.native_net()
    gc.collect()
    assert weights() is None  # numpy's copy is gone: the executor holds its own
    after = model.predict(dense, embs)
    np.testing.assert_array_equal(after, executor.predict(dense, embs))  # predict runs it
    np.testing.assert_allclose(after, before, atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(after, lin(_t(dense)).numpy(), atol=ATOL, rtol=1e-5)
    assert model.native_net() is executor
    with pytest.raises(RuntimeError, match="native_net"):
        model.native_program()  # its addresses would be of freed arrays


def test_a_missing_dense_file_still_fails_naming_it_when_shared(tmp_path):
    doc = _net([_layer("fc", "InnerProduct", "dense", "fc", fc_param={"num_output": 5})])
    net = tmp_path / "net.json"
    net.write_text(json.dumps(doc))
    with pytest.raises(ModelFileError, match="nowhere_dense_0.model"):
        HugeCTRNetwork.shared(str(net), str(tmp_path / "nowhere_dense_0.model"))
