"""Encoded .npz tables and ``ps-loader quantize`` (issue 15): a table quantized offline is
served as it was written, the error report is the real error, and bad files are named."""

import json
import os

import numpy as np
import pytest

from ps_loader import quantize as q
from ps_loader.__main__ import main as ps_loader_main
from triton_rec.config.ps_json import TableParams, load_ps_config
from triton_rec.errors import ModelFileError
from triton_rec.formats.tables import read_table, read_table_rows, write_table, write_table_rows
from triton_rec.precision import RowCodec
from triton_rec.storage import node_store


def _table(n=500, d=8, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.choice(10**12, size=n, replace=False).astype(np.int64)
    return keys, (rng.standard_normal((n, d)) * 0.3).astype(np.float32)


def _fp16_reference(v):
    return v.astype(np.float16).astype(np.float32)


def _int8_reference(v):
    """FBGEMM's rule, written here independently of RowCodec."""
    lo = v.min(axis=1, keepdims=True)
    rng = v.max(axis=1, keepdims=True) - lo
    qv = np.clip(np.rint((v - lo) * (np.float32(255) / (rng + np.float32(1e-8)))), 0, 255)
    return qv.astype(np.float32) * (rng / np.float32(255)) + lo


def _sparse_source(tmp_path, n, d=8):
    """A HugeCTR sparse directory of ``_table(n, d)``: ``(keys, vectors, path)``."""
    keys, vecs = _table(n=n, d=d)
    src = tmp_path / "t0_sparse_0.model"
    write_table(str(src), keys, vecs)
    return keys, vecs, src


REFERENCE = {"fp16": _fp16_reference, "int8": _int8_reference}


# ------------------------------------------------------------------- encoded .npz


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_an_encoded_npz_reads_back_its_rows_byte_for_byte(tmp_path, precision):
    keys, vecs = _table()
    codec = RowCodec(precision, 8)
    rows = codec.encode(vecs)
    path = str(tmp_path / "t.npz")
    write_table_rows(path, keys, rows, codec)
    k, r, c = read_table_rows(path, 8)
    assert c == codec
    np.testing.assert_array_equal(k, keys)
    assert r.dtype == rows.dtype and r.tobytes() == rows.tobytes()
    # read_table gives the decoded vectors
    want = vecs if precision == "fp32" else REFERENCE[precision](vecs)
    np.testing.assert_allclose(read_table(path, 8)[1], want, rtol=0, atol=1e-6)


def test_encoded_rows_cannot_be_written_as_hugectr_sparse_files(tmp_path):
    keys, vecs = _table()
    with pytest.raises(ValueError, match="fp32 only"):
        write_table_rows(
            str(tmp_path / "t.model"), keys, RowCodec("fp16", 8).encode(vecs), RowCodec("fp16", 8)
        )


@pytest.mark.parametrize(
    "arrays,needle",
    [
        ({"rows": np.zeros((3, 16), np.uint8), "precision": np.array("int4")}, "'precision'"),
        ({"rows": np.zeros((3, 16), np.uint8)}, "no 'precision'"),
        ({"rows": np.zeros((3, 15), np.uint8), "precision": np.array("int8")}, "15 columns"),
        ({"rows": np.zeros((3, 8), np.float32), "precision": np.array("fp16")}, "float16"),
        ({"rows": np.zeros((2, 8), np.float16), "precision": np.array("fp16")}, "3 keys"),
        (
            {
                "rows": np.zeros((3, 8), np.float16),
                "precision": np.array("fp16"),
                "vectors": np.zeros((3, 8), np.float32),
            },
            "exactly one of",
        ),
        ({"rows": np.zeros((3, 8), np.float16), "precision": np.array([b"fp16"])}, "0-d"),
    ],
)
def test_a_malformed_encoded_npz_is_named_with_what_is_wrong(tmp_path, arrays, needle):
    path = str(tmp_path / "bad.npz")
    np.savez(path, keys=np.arange(3, dtype=np.int64), **arrays)
    with pytest.raises(ModelFileError, match=needle) as e:
        read_table_rows(path, 8)
    assert path in str(e.value)
    # the node store refuses it the same way, naming the file
    with pytest.raises(ModelFileError) as e:
        node_store.ensure_layout(path, 8, str(tmp_path / "store"), precision="fp16")
    assert path in str(e.value)


def test_the_store_takes_an_encoded_npz_in_its_precision_as_it_is(tmp_path):
    keys, vecs = _table(n=2000)
    codec = RowCodec("int8", 8)
    rows = codec.encode(vecs)
    rows[:, :8] ^= 1  # not what encoding these vectors again would give: copied, not redone
    path = str(tmp_path / "t.npz")
    write_table_rows(path, keys, rows, codec)
    store = str(tmp_path / "store")
    table = node_store.load_table(TableParams("t", path, 8, 4, 0.0, precision="int8"), store)
    assert table.codec == codec
    # the layout holds the file's rows in the file's order, byte for byte
    np.testing.assert_array_equal(np.asarray(table.keys), keys)
    assert np.asarray(table.vectors).tobytes() == rows.tobytes()
    order = np.argsort(keys)
    out, missing = table.lookup(keys[order])
    assert missing == 0
    np.testing.assert_array_equal(out, codec.decode(rows)[order])


def test_an_encoded_npz_in_another_precision_is_converted_from_its_decoded_values(tmp_path):
    keys, vecs = _table(n=1000)
    src = RowCodec("int8", 8)
    path = str(tmp_path / "t.npz")
    write_table_rows(path, keys, src.encode(vecs), src)
    store = str(tmp_path / "store")
    table = node_store.load_table(TableParams("t", path, 8, 4, 0.0, precision="fp16"), store)
    assert table.codec == RowCodec("fp16", 8)
    out, _ = table.lookup(keys)
    np.testing.assert_array_equal(out, _fp16_reference(_int8_reference(vecs)))


# ------------------------------------------------------------------- quantize


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_quantize_reports_the_real_error_in_any_chunking(monkeypatch, precision):
    _, vecs = _table(n=3001, d=16, seed=3)
    codec = RowCodec(precision, 16)
    err = REFERENCE[precision](vecs).astype(np.float64) - vecs
    want_max, want_rms = np.abs(err).max(), np.sqrt(np.mean(err * err))
    for chunk in (1 << 22, 16 * 7, 16):  # one chunk, uneven chunks, one row per chunk
        monkeypatch.setattr(q, "_CHUNK_VALUES", chunk)
        rows, worst, rms = q.quantize_rows(vecs, RowCodec("fp32", 16), codec)
        assert worst == pytest.approx(want_max, rel=1e-6)
        assert rms == pytest.approx(want_rms, rel=1e-6)
        np.testing.assert_allclose(codec.decode(rows), REFERENCE[precision](vecs), atol=1e-6)


def _ps(tmp_path, tables):
    """A ps.json of model 'm' over HugeCTR sparse directories ``{name: (keys, vecs)}``."""
    files, dims = [], []
    for name, (keys, vecs) in tables.items():
        path = tmp_path / f"{name}_sparse_0.model"
        write_table(str(path), keys, vecs)
        files.append(path.name)
        dims.append(vecs.shape[1])
    entry = {
        "model": "m",
        "sparse_files": files,
        "embedding_table_names": list(tables),
        "embedding_vecsize_per_table": dims,
        "maxnum_catfeature_query_per_table_per_sample": [1] * len(tables),
        "max_batch_size": 8,
    }
    other = dict(entry, model="other")
    ps = tmp_path / "ps.json"
    ps.write_text(json.dumps({"supportlonglong": True, "models": [entry, other]}))
    return ps


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_quantize_a_ps_json_model_and_serve_the_written_copy(tmp_path, capsys, precision):
    tables = {"a": _table(n=700, d=8, seed=1), "b": _table(n=300, d=4, seed=2)}
    ps = _ps(tmp_path, tables)
    out_dir, copy = tmp_path / "q", tmp_path / f"ps.{precision}.json"
    argv = ["quantize", str(ps), "--model", "m", "--precision", precision, "--out", str(out_dir)]
    assert ps_loader_main([*argv, "--write-ps-json", str(copy), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in report] == ["m.a", "m.b"]
    for r, (_keys, vecs) in zip(report, tables.values()):
        err = REFERENCE[precision](vecs).astype(np.float64) - vecs
        assert r["max_abs"] == pytest.approx(np.abs(err).max(), rel=1e-6)
        assert r["rms"] == pytest.approx(np.sqrt(np.mean(err * err)), rel=1e-6)
        assert r["bytes_before"] == 4 * vecs.shape[1]
        assert r["bytes_after"] == RowCodec(precision, vecs.shape[1]).row_bytes
        assert os.path.exists(r["path"])
    cfg = load_ps_config(str(copy))
    m = cfg.model("m")
    assert [t.precision for t in m.tables] == [precision, precision]
    assert cfg.model("other").tables[0].precision == "fp32"  # untouched
    store = str(tmp_path / "store")
    for t, (keys, vecs) in zip(m.tables, tables.values()):
        table = node_store.load_table(t, store)
        out, missing = table.lookup(keys)
        assert missing == 0
        np.testing.assert_allclose(out, REFERENCE[precision](vecs), rtol=0, atol=1e-6)
    # the text report names each table, its sizes and both errors
    assert ps_loader_main([*argv, "--table", "b"]) == 0
    text = capsys.readouterr().out
    assert "m.b: 300 rows x 4, 16 -> " in text and "max abs error" in text and "RMS" in text
    assert "m.a" not in text


def test_quantize_one_sparse_directory(tmp_path, capsys):
    keys, vecs, src = _sparse_source(tmp_path, n=100, d=8)
    argv = ["quantize", str(src), "--vec-size", "8", "--precision", "int8"]
    assert ps_loader_main([*argv, "--out", str(tmp_path / "q")]) == 0
    path = tmp_path / "q" / "t0_sparse_0.model.int8.npz"
    assert str(path) in capsys.readouterr().out
    k, rows, codec = read_table_rows(str(path), 8)
    assert codec.precision == "int8"
    np.testing.assert_array_equal(k, keys)
    np.testing.assert_allclose(codec.decode(rows), _int8_reference(vecs), atol=1e-6)


@pytest.mark.parametrize(
    "extra,needle",
    [
        ([], "either a ps.json"),  # a table without --vec-size
        (["--vec-size", "8", "--write-ps-json", "x.json"], "needs a ps.json"),
    ],
)
def test_quantize_refuses_unclear_arguments(tmp_path, capsys, extra, needle):
    keys, vecs, src = _sparse_source(tmp_path, n=10)
    argv = ["quantize", str(src), "--precision", "fp16", "--out", str(tmp_path / "q"), *extra]
    assert ps_loader_main(argv) == 2
    assert needle in capsys.readouterr().err


def test_quantize_writes_the_ps_json_copy_only_beside_the_original(tmp_path, capsys):
    ps = _ps(tmp_path, {"a": _table(n=10)})
    (tmp_path / "elsewhere").mkdir()
    argv = ["quantize", str(ps), "--precision", "fp16", "--out", str(tmp_path / "q")]
    assert ps_loader_main([*argv, "--write-ps-json", str(tmp_path / "elsewhere" / "p.json")]) == 2
    assert "relative paths" in capsys.readouterr().err


def test_a_broken_source_fails_naming_the_file(tmp_path, capsys):
    src = tmp_path / "t0_sparse_0.model"
    src.mkdir()
    (src / "key").write_bytes(b"\0" * 8)  # no emb_vector file
    argv = ["quantize", str(src), "--vec-size", "8", "--precision", "fp16", "--out", str(tmp_path)]
    assert ps_loader_main(argv) == 1
    assert str(src) in capsys.readouterr().err


def test_convert_builds_each_table_in_its_ps_json_precision(tmp_path, capsys):
    ps = _ps(tmp_path, {"a": _table(n=50, d=8)})
    doc = json.loads(ps.read_text())
    doc["models"][0]["embedding_precision"] = ["int8"]
    ps.write_text(json.dumps(doc))
    store = str(tmp_path / "store")
    assert ps_loader_main(["convert", str(ps), "--store", store, "--model", "m"]) == 0
    assert "m.a: 50 rows x 8 int8 -> " in capsys.readouterr().out
    t = load_ps_config(str(ps)).model("m").tables[0]
    assert node_store.load_table(t, store).codec == RowCodec("int8", 8)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--table", "a", "--write-ps-json", "COPY"], "whole models"),
        (["--table", "nope"], "no table named"),
    ],
)
def test_quantize_refuses_table_selections_it_cannot_honour(tmp_path, capsys, extra, needle):
    ps = _ps(tmp_path, {"a": _table(n=10)})
    extra = [str(tmp_path / "c.json") if x == "COPY" else x for x in extra]
    argv = ["quantize", str(ps), "--precision", "fp16", "--out", str(tmp_path / "q"), *extra]
    assert ps_loader_main(argv) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "q").exists()  # refused before writing anything


def test_a_source_already_in_the_precision_is_copied_not_requantized(tmp_path, capsys):
    keys, vecs = _table(n=400, d=8, seed=4)
    codec = RowCodec("int8", 8)
    rows = codec.encode(vecs)
    rows[:, :8] ^= 3  # not what encoding the decoded values again would give
    src = tmp_path / "t.npz"
    write_table_rows(str(src), keys, rows, codec)
    argv = ["quantize", str(src), "--vec-size", "8", "--precision", "int8"]
    assert ps_loader_main([*argv, "--out", str(tmp_path / "q"), "--json"]) == 0
    [r] = json.loads(capsys.readouterr().out)
    assert r["copied"] is True and r["max_abs"] == 0.0 and r["rms"] == 0.0
    assert r["path"] == str(tmp_path / "q" / "t.int8.npz")
    k, out, c = read_table_rows(r["path"], 8)
    assert c == codec and out.tobytes() == rows.tobytes()
    np.testing.assert_array_equal(k, keys)
    assert ps_loader_main([*argv, "--out", str(tmp_path / "q")]) == 0
    assert "already in this precision: copied" in capsys.readouterr().out


def test_an_encoded_source_is_measured_against_its_decoded_values(tmp_path, capsys):
    keys, vecs = _table(n=300, d=16, seed=6)
    fp16 = RowCodec("fp16", 16)
    src = tmp_path / "t.npz"
    write_table_rows(str(src), keys, fp16.encode(vecs), fp16)
    argv = ["quantize", str(src), "--vec-size", "16", "--precision", "int8", "--json"]
    assert ps_loader_main([*argv, "--out", str(tmp_path / "q")]) == 0
    [r] = json.loads(capsys.readouterr().out)
    half = _fp16_reference(vecs)  # the source's values
    err = _int8_reference(half).astype(np.float64) - half
    assert r["copied"] is False
    assert r["max_abs"] == pytest.approx(np.abs(err).max(), rel=1e-6)
    assert r["rms"] == pytest.approx(np.sqrt(np.mean(err * err)), rel=1e-6)
    assert (r["bytes_before"], r["bytes_after"]) == (32, 24)
    assert (r["table_bytes_before"], r["table_bytes_after"]) == (300 * 32, 300 * 24)


def test_the_text_report_gives_the_table_bytes_before_and_after(tmp_path, capsys):
    keys, vecs, src = _sparse_source(tmp_path, n=1000, d=8)
    argv = ["quantize", str(src), "--vec-size", "8", "--precision", "fp16"]
    assert ps_loader_main([*argv, "--out", str(tmp_path / "q")]) == 0
    line = capsys.readouterr().out
    assert "1000 rows x 8, 32 -> 16 B/row (0.500x; table 32,000 -> 16,000 B)" in line
