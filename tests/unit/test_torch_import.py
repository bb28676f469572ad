"""Embedding tables from PyTorch state dicts (ps_loader.torch_import)."""

import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from ps_loader.torch_import import (  # noqa: E402
    find_tables,
    import_tables,
    json_fields,
    load_state_dict,
    main,
    write_tables,
)
from triton_rec.errors import ModelFileError  # noqa: E402
from triton_rec.formats.tables import read_table, read_table_rows  # noqa: E402


class _TouchOnLoad:
    """Unpickling this object would create a file: proof that nothing was executed."""

    def __init__(self, marker):
        self.marker = pathlib.Path(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


class _TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.user_emb = nn.Embedding(30, 8)
        self.item_embedding = nn.EmbeddingBag(50, 8, mode="sum")
        self.fc = nn.Linear(16, 4)
        self.proj_emb = nn.Linear(8, 8)  # has a bias: not an embedding table


def _save(tmp_path, obj, name="state.pt"):
    path = tmp_path / name
    torch.save(obj, path)
    return str(path)


def _assert_table(path, weight, keys=None):
    k, v = read_table(path, weight.shape[1])
    expected_keys = np.arange(weight.shape[0]) if keys is None else keys
    np.testing.assert_array_equal(k, expected_keys)
    np.testing.assert_array_equal(v, weight.detach().float().numpy())


def test_an_embedding_bag_state_dict_round_trips_to_a_hugectr_directory(tmp_path):
    bag = nn.EmbeddingBag(50, 8)
    path = _save(tmp_path, bag.state_dict(), "items.pt")
    [t] = import_tables(path, str(tmp_path / "out"))
    assert (t.name, t.key, t.rows, t.vec_size) == ("items", "weight", 50, 8)
    assert t.path == str(tmp_path / "out" / "0_sparse_0.model")
    _assert_table(t.path, bag.weight)


def test_an_embedding_saved_as_a_bare_tensor_is_one_table(tmp_path):
    w = torch.randn(7, 3)
    [t] = import_tables(_save(tmp_path, w, "bare.pt"), str(tmp_path / "out"), fmt="npz")
    assert t.path.endswith("0.npz")
    _assert_table(t.path, w)


def test_embeddings_inside_a_model_are_found_by_module_name_and_linears_are_not(tmp_path):
    model = _TwoTower()
    path = _save(tmp_path, model.state_dict())
    tables = find_tables(load_state_dict(path), source=path)
    assert [(t.name, t.key) for t in tables] == [
        ("user_emb", "user_emb.weight"),
        ("item_embedding", "item_embedding.weight"),
    ]
    written = write_tables(tables, str(tmp_path / "out"), prefix="tt")
    names = [pathlib.Path(w.path).name for w in written]
    assert names == ["tt0_sparse_0.model", "tt1_sparse_0.model"]
    _assert_table(written[0].path, model.user_emb.weight)
    _assert_table(written[1].path, model.item_embedding.weight)


@pytest.mark.parametrize("prefix", ["", "model.sparse_arch.embedding_bag_collection."])
@pytest.mark.parametrize("collection", ["embedding_bags", "embeddings"])
def test_torchrec_style_collections_are_found_with_or_without_a_module_prefix(
    tmp_path, prefix, collection
):
    w0, w1 = torch.randn(40, 16), torch.randn(12, 4)
    state = {
        f"{prefix}{collection}.t_cat_0.weight": w0,
        f"{prefix}{collection}.t_cat_1.weight": w1,
        "model.over_arch.0.weight": torch.randn(4, 4),  # dense layers are left alone
        "model.over_arch.0.bias": torch.randn(4),
    }
    written = import_tables(_save(tmp_path, state), str(tmp_path / "out"))
    assert [(w.name, w.rows, w.vec_size) for w in written] == [
        ("t_cat_0", 40, 16),
        ("t_cat_1", 12, 4),
    ]
    _assert_table(written[0].path, w0)
    _assert_table(written[1].path, w1)


def test_a_checkpoint_nesting_the_state_dict_is_flattened(tmp_path):
    w = torch.randn(9, 4)
    ckpt = {"epoch": 3, "state_dict": {"embedding_bags.users.weight": w}, "note": "x"}
    [t] = import_tables(_save(tmp_path, ckpt), str(tmp_path / "out"))
    assert (t.name, t.key) == ("users", "state_dict.embedding_bags.users.weight")
    _assert_table(t.path, w)


def test_tables_can_be_picked_by_name_key_or_module_prefix_in_the_given_order(tmp_path):
    model = _TwoTower()
    path = _save(tmp_path, model.state_dict())
    state = load_state_dict(path)
    picked = find_tables(state, ["item_embedding", "fc.weight", "user_emb"], source=path)
    assert [(t.name, t.key) for t in picked] == [
        ("item_embedding", "item_embedding.weight"),
        ("fc", "fc.weight"),
        ("user_emb", "user_emb.weight"),
    ]
    np.testing.assert_array_equal(picked[1].weight, model.fc.weight.detach().numpy())


def test_caller_provided_keys_replace_row_ids(tmp_path):
    w = torch.randn(20, 4)
    keys = (np.arange(20, dtype=np.int64) * 7_919_000_003) ^ 0x5A5A
    [t] = import_tables(
        _save(tmp_path, {"embedding_bags.t.weight": w}), str(tmp_path / "out"), keys={"t": keys}
    )
    _assert_table(t.path, w, keys)


@pytest.mark.parametrize(
    "keys, needle",
    [
        (np.arange(19), "20 keys needed"),
        (np.zeros(20, np.int64), "not unique"),
        (np.linspace(0, 1, 20), "must be integers"),
    ],
)
def test_bad_caller_keys_are_rejected(tmp_path, keys, needle):
    tables = find_tables({"embedding_bags.t.weight": torch.randn(20, 4)})
    with pytest.raises(ValueError, match=needle):
        write_tables(tables, str(tmp_path / "out"), keys={"t": keys})
    with pytest.raises(ValueError, match="unknown tables"):
        write_tables(tables, str(tmp_path / "out"), keys={"other": np.arange(20)})


def test_half_weights_stay_fp16_and_bfloat16_ones_become_float32(tmp_path):
    w = torch.randn(10, 8)
    state = {"embedding_bags.a.weight": w.half(), "embedding_bags.b.weight": w.bfloat16()}
    written = import_tables(_save(tmp_path, state), str(tmp_path / "out"))
    assert [t.precision for t in written] == ["fp16", "fp32"]
    assert written[0].path.endswith(".npz")  # HugeCTR sparse files hold float32 only
    keys, rows, codec = read_table_rows(written[0].path, 8)
    assert codec.precision == "fp16" and rows.tobytes() == w.half().numpy().tobytes()
    _assert_table(written[1].path, w.bfloat16())
    fields = json.loads(json_fields(written))
    assert fields["embedding_precision"] == ["fp16", "fp32"]


# --------------------------------------------------------- 8-bit row-wise quantized tables


def _fbgemm_fused8(w: np.ndarray) -> np.ndarray:
    """FBGEMM's FloatToFused8BitRowwiseQuantized, from its rule: per row q (uint8), then
    float32 scale = range / 255 and bias = min (written here, not with RowCodec)."""
    lo = w.min(axis=1, keepdims=True)
    rng = w.max(axis=1, keepdims=True) - lo
    q = np.clip(np.rint((w - lo) * (np.float32(255) / (rng + np.float32(1e-8)))), 0, 255)
    sb = np.concatenate([rng / np.float32(255), lo], axis=1).astype("<f4")
    return np.concatenate([q.astype(np.uint8), sb.view(np.uint8)], axis=1)


def _dequant(q, scale, bias):
    return q.astype(np.float32) * scale.astype(np.float32) + bias.astype(np.float32)


def test_a_torchrec_quantized_collection_with_split_scale_and_bias_imports_as_int8(tmp_path):
    rng = np.random.default_rng(5)
    q = rng.integers(0, 256, size=(40, 16), dtype=np.uint8)
    scale = (rng.random((40, 1)) * 0.01).astype(np.float16)
    bias = (rng.standard_normal((40, 1)) * 0.1).astype(np.float16)
    prefix = "sparse.ebc.embedding_bags.t_cat_0"
    state = {
        f"{prefix}.weight": torch.from_numpy(q),
        f"{prefix}.weight_qscale": torch.from_numpy(scale),
        f"{prefix}.weight_qbias": torch.from_numpy(bias),
    }
    [t] = import_tables(_save(tmp_path, state), str(tmp_path / "out"))
    assert (t.name, t.precision, t.rows, t.vec_size) == ("t_cat_0", "int8", 40, 16)
    keys, rows, codec = read_table_rows(t.path, 16)
    assert codec.precision == "int8"
    np.testing.assert_array_equal(rows[:, :16], q)  # the quantized values, untouched
    np.testing.assert_allclose(codec.decode(rows), _dequant(q, scale, bias), rtol=0, atol=1e-6)
    # served: the node store takes the rows as they are
    from triton_rec.config.ps_json import TableParams
    from triton_rec.storage import node_store

    table = node_store.load_table(
        TableParams("t", t.path, 16, 4, 0.0, precision="int8"), str(tmp_path / "store")
    )
    out, missing = table.lookup(keys[::-1].copy())
    assert missing == 0
    np.testing.assert_allclose(out, _dequant(q, scale, bias)[::-1], rtol=0, atol=1e-6)


def test_fbgemm_fused8_rows_import_byte_for_byte(tmp_path):
    w = np.random.default_rng(2).standard_normal((30, 12)).astype(np.float32)
    fused = _fbgemm_fused8(w)
    state = {"embedding_bags.items.weight": torch.from_numpy(fused)}
    path = _save(tmp_path, state)
    with pytest.raises(ModelFileError, match="--quantized NAME=fused8") as e:
        import_tables(path, str(tmp_path / "out"))
    assert path in str(e.value)
    [t] = import_tables(path, str(tmp_path / "out"), quantized={"items": "fused8"})
    assert (t.precision, t.vec_size) == ("int8", 12)
    _, rows, codec = read_table_rows(t.path, 12)
    assert rows.tobytes() == fused.tobytes()
    sb = fused[:, 12:].copy().view("<f4")
    np.testing.assert_allclose(
        codec.decode(rows), _dequant(fused[:, :12], sb[:, :1], sb[:, 1:]), rtol=0, atol=1e-6
    )


def test_tbe_rows_with_scale_and_bias_in_front_and_padding_import(tmp_path):
    rng = np.random.default_rng(9)
    q = rng.integers(0, 256, size=(8, 10), dtype=np.uint8)
    sb = rng.random((8, 2)).astype(np.float16)
    padded = np.zeros((8, 16), np.uint8)  # row_alignment 16: 4 + 10 bytes, 2 of padding
    padded[:, :4] = sb.view(np.uint8)
    padded[:, 4:14] = q
    half = rng.standard_normal((8, 6)).astype(np.float16)
    fp16_padded = np.zeros((8, 16), np.uint8)
    fp16_padded[:, :12] = half.view(np.uint8)
    state = {
        "embedding_bags.a.weight": torch.from_numpy(padded),
        "embedding_bags.b.weight": torch.from_numpy(fp16_padded),
    }
    argv = [_save(tmp_path, state), "--out", str(tmp_path / "out")]
    assert main([*argv, "--quantized", "a=tbe-int8:10", "--quantized", "b=tbe-fp16:6"]) == 0
    a, b = str(tmp_path / "out" / "0.npz"), str(tmp_path / "out" / "1.npz")
    _, rows, codec = read_table_rows(a, 10)
    np.testing.assert_allclose(codec.decode(rows), _dequant(q, sb[:, :1], sb[:, 1:]), atol=1e-6)
    _, rows, codec = read_table_rows(b, 6)
    assert codec.precision == "fp16" and rows.tobytes() == half.tobytes()


@pytest.mark.parametrize(
    "quantized,needle",
    [
        ({"t": "int4"}, "unknown --quantized layout"),
        ({"t": "tbe-int8:30"}, "hold no 30 int8 values"),
        ({"nope": "fused8"}, "unknown tables"),
    ],
)
def test_unusable_quantized_layouts_are_named(quantized, needle):
    state = {"embedding_bags.t.weight": torch.zeros(4, 16, dtype=torch.uint8)}
    with pytest.raises(ModelFileError, match=needle):
        find_tables(state, quantized=quantized)


def test_int4_or_integer_weights_are_refused_naming_the_tensor():
    state = {"embedding_bags.t.weight": torch.zeros(4, 16, dtype=torch.int32)}
    with pytest.raises(ModelFileError, match="embedding_bags.t.weight' is torch.int32"):
        find_tables(state)


class UInt4Tensor(torch.Tensor):
    """Named as TorchRec's int4 weight subclass (torchrec/tensor_types.py)."""


def test_torchrec_int4_weights_are_refused_as_int4_naming_the_class(tmp_path):
    w = torch.zeros(4, 8, dtype=torch.uint8).as_subclass(UInt4Tensor)
    path = _save(tmp_path, {"embedding_bags.t.weight": w}, "int4.pt")
    with pytest.raises(ModelFileError, match=r"int4/int2 .*UInt4Tensor") as e:
        import_tables(path, str(tmp_path / "out"))
    assert str(e.value).startswith(path + ": refused")
    assert not (tmp_path / "out").exists()


def _split_state(collection, n=64, d=12, seed=11, scale_dtype=np.float16, shape=(-1, 1)):
    """A TorchRec quantized collection's state dict in split mode (from the rule of
    fbgemm's mode 2, written here): q uint8 [n, d], weight_qscale / weight_qbias."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, size=(n, d), dtype=np.uint8)
    scale = (rng.random(n) * 0.02).astype(scale_dtype).reshape(shape)
    bias = (rng.standard_normal(n) * 0.1).astype(scale_dtype).reshape(shape)
    prefix = f"model.sparse.ec.{collection}.t"
    state = {
        f"{prefix}.weight": torch.from_numpy(q),
        f"{prefix}.weight_qscale": torch.from_numpy(scale),
        f"{prefix}.weight_qbias": torch.from_numpy(bias),
    }
    # our int8 rows, from the layout's definition: q, float32 scale, float32 bias
    trailer = np.stack([scale.reshape(n), bias.reshape(n)], axis=1).astype("<f4")
    expected = np.concatenate([q, trailer.view(np.uint8)], axis=1)
    return state, q, expected


@pytest.mark.parametrize(
    "collection,scale_dtype,shape",
    [
        ("embeddings", np.float16, (-1, 1)),  # EmbeddingCollection, as fbgemm writes it
        ("embedding_bags", np.float32, (-1,)),  # float32 [N] columns are taken too
    ],
)
def test_split_scale_bias_rows_are_bit_exact_and_serve_their_values(
    tmp_path, capsys, collection, scale_dtype, shape
):
    from triton_rec.config.ps_json import TableParams
    from triton_rec.precision import RowCodec
    from triton_rec.storage import node_store

    state, q, expected = _split_state(collection, scale_dtype=scale_dtype, shape=shape)
    path = _save(tmp_path, state)
    assert main([path, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "0: t: 64 rows x 12 int8" in out
    fields = json.loads(out.split("ps.json: ", 1)[1])
    assert fields["embedding_precision"] == ["int8"]
    assert fields["embedding_vecsize_per_table"] == [12]
    [npz] = fields["sparse_files"]
    keys, rows, codec = read_table_rows(npz, 12)
    assert codec == RowCodec("int8", 12)
    assert rows.tobytes() == expected.tobytes()  # q, scale and bias exactly as saved
    # the node store maps the rows as they are; lookups decode q * scale + bias
    store = str(tmp_path / "store")
    res = node_store.ensure_layout(npz, 12, store, precision="int8")
    assert res.n_rows == 64
    table = node_store.load_table(TableParams("t", npz, 12, 4, 0.0, precision="int8"), store)
    assert np.asarray(table.vectors).tobytes() == expected.tobytes()
    sb = expected[:, 12:].copy().view("<f4")
    want = q.astype(np.float32) * sb[:, :1] + sb[:, 1:]
    pick = np.array([63, 0, 17, 5], np.int64)
    got, missing = table.lookup(keys[pick])
    assert missing == 0
    np.testing.assert_array_equal(got, want[pick])


def test_fp16_weights_serve_exactly_their_half_values(tmp_path):
    from triton_rec.config.ps_json import TableParams
    from triton_rec.storage import node_store

    w = (torch.randn(33, 6) * 0.5).half()
    [t] = import_tables(_save(tmp_path, {"embeddings.h.weight": w}), str(tmp_path / "out"))
    assert (t.precision, t.vec_size, t.rows) == ("fp16", 6, 33)
    table = node_store.load_table(
        TableParams("h", t.path, 6, 4, 0.0, precision="fp16"), str(tmp_path / "store")
    )
    assert np.asarray(table.vectors).tobytes() == w.numpy().tobytes()  # not converted
    got, missing = table.lookup(np.arange(33, dtype=np.int64)[::-1].copy())
    assert missing == 0
    np.testing.assert_array_equal(got, w.float().numpy()[::-1])


@pytest.mark.parametrize(
    "bad,needle",
    [
        ("weight_qscale", r"weight_qscale' is torch.float16 \[64, 2\]"),
        ("weight_qbias", r"weight_qbias' is torch.uint8"),
    ],
)
def test_split_scale_or_bias_of_the_wrong_shape_or_dtype_is_named(bad, needle):
    state, _, _ = _split_state("embedding_bags")
    key = f"model.sparse.ec.embedding_bags.t.{bad}"
    if bad == "weight_qscale":
        state[key] = torch.zeros(64, 2, dtype=torch.float16)
    else:
        state[key] = torch.zeros(64, 1, dtype=torch.uint8)
    with pytest.raises(ModelFileError, match=needle):
        find_tables(state)


def test_a_file_that_needs_unpickling_is_refused_naming_the_file_and_nothing_runs(tmp_path):
    marker = tmp_path / "executed"
    state = {"emb.weight": torch.randn(3, 2), "obj": _TouchOnLoad(marker)}
    path = _save(tmp_path, state, "evil.pt")
    with pytest.raises(ModelFileError) as e:
        import_tables(path, str(tmp_path / "out"))
    assert str(e.value).startswith(path + ": refused")
    assert "weights_only=True" in str(e.value) and "(global " in str(e.value)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_a_whole_pickled_model_is_refused(tmp_path):
    path = _save(tmp_path, nn.Embedding(4, 2), "model.pt")
    with pytest.raises(ModelFileError, match=r"refused.*global torch\.nn.*state_dict\(\)"):
        load_state_dict(path)


@pytest.mark.parametrize("content", [b"not a torch file at all", b""])
def test_garbage_and_missing_files_fail_naming_the_file(tmp_path, content):
    path = tmp_path / "junk.pt"
    path.write_bytes(content)
    with pytest.raises(ModelFileError, match=f"^{path}: not a readable PyTorch file"):
        load_state_dict(str(path))
    with pytest.raises(ModelFileError, match="does not exist"):
        load_state_dict(str(tmp_path / "nope.pt"))


def test_an_unknown_layout_fails_listing_the_tensors_found(tmp_path):
    path = _save(
        tmp_path,
        {"lin.weight": torch.zeros(2, 3), "lin.bias": torch.zeros(2), "step": 5},
        "dense_only.pt",
    )
    with pytest.raises(ModelFileError) as e:
        import_tables(path, str(tmp_path / "out"))
    msg = str(e.value)
    assert msg.startswith(path + ": no embedding table found")
    assert "lin.weight [2, 3], lin.bias [2]" in msg and "--table" in msg


def test_a_table_name_that_matches_nothing_lists_tables_and_tensors(tmp_path):
    path = _save(tmp_path, _TwoTower().state_dict())
    with pytest.raises(
        ModelFileError,
        match=r"no table or tensor named 'items'.*"
        r"Tables found: \['item_embedding', 'user_emb'\].*fc\.bias \[4\]",
    ):
        find_tables(load_state_dict(path), ["items"], source=path)
    with pytest.raises(ModelFileError, match="'fc.bias' is torch.float32 \\[4\\], not a 2-D"):
        find_tables(load_state_dict(path), ["fc.bias"], source=path)


def test_the_command_line_lists_and_writes_tables(tmp_path, capsys):
    w = torch.randn(6, 4)
    path = _save(tmp_path, {"model.embedding_bags.users.weight": w})
    np.save(tmp_path / "keys.npy", np.arange(100, 106, dtype=np.int64))
    assert main([path, "--list"]) == 0
    out = capsys.readouterr().out
    assert (
        "1 table(s)" in out
        and "0: users: 6 rows x 4 fp32 (model.embedding_bags.users.weight)" in out
    )
    assert not (tmp_path / "out").exists()
    assert (
        main(
            [
                path,
                "--out",
                str(tmp_path / "out"),
                "--table",
                "users",
                "--prefix",
                "m",
                "--keys",
                f"users={tmp_path / 'keys.npy'}",
            ]
        )
        == 0
    )
    assert '"embedding_table_names": ["users"]' in capsys.readouterr().out
    _assert_table(str(tmp_path / "out" / "m0_sparse_0.model"), w, np.arange(100, 106))
    assert main([str(tmp_path / "absent.pt"), "--out", str(tmp_path / "o2")]) == 1
    assert "absent.pt: PyTorch state dict file does not exist" in capsys.readouterr().err


class _Config:
    """A plain Python object saved next to the tensors (e.g. a training config)."""

    def __init__(self):
        self.lr = 0.1


def test_a_checkpoint_with_a_non_tensor_object_is_refused_in_our_words_only(tmp_path):
    path = _save(tmp_path, {"emb.weight": torch.randn(3, 2), "config": _Config()}, "ckpt.pt")
    with pytest.raises(ModelFileError) as e:
        load_state_dict(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: refused: loading it needs arbitrary Python objects unpickled")
    assert f"{__name__}._Config" in msg
    # never torch's advice to load the file unsafely, nor its text in the traceback
    assert "weights_only=False" not in msg and "weights_only` to `False" not in msg
    assert "Weights only load failed" not in msg
    assert e.value.__cause__ is None and e.value.__suppress_context__


@pytest.mark.parametrize(
    "wording", ["whatever a future torch says", "Unsupported global: GLOBAL x.y"]
)
def test_the_refusal_is_matched_by_exception_type_not_wording(tmp_path, monkeypatch, wording):
    import pickle

    path = _save(tmp_path, {"emb.weight": torch.randn(3, 2), "config": _Config()}, "ckpt.pt")

    def load(*args, **kwargs):
        raise pickle.UnpicklingError(wording + " ... re-run with weights_only=False")

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(ModelFileError) as e:
        load_state_dict(path)
    assert str(e.value).startswith(f"{path}: refused") and f"{__name__}._Config" in str(e.value)
    assert "weights_only=False" not in str(e.value) and wording not in str(e.value)
