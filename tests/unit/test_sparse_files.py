"""Reading and validating HugeCTR sparse directories and .npz tables."""

import os

import numpy as np
import pytest

from ps_loader.synthetic import expected_vectors, table_keys
from triton_rec.errors import ModelFileError
from triton_rec.formats.tables import read_table, write_table


def _table(n=100, d=8, seed=3):
    rng = np.random.default_rng(seed)
    keys = rng.permutation(np.arange(-n, n * 3, 4, dtype=np.int64))[:n]
    return keys, rng.standard_normal((n, d)).astype(np.float32)


def test_a_hugectr_directory_reads_back_byte_for_byte(tmp_path):
    keys, vecs = _table()
    path = str(tmp_path / "t0_sparse_0.model")
    write_table(path, keys, vecs)
    # The on-disk layout is raw little-endian int64 / float32 with no header.
    assert (tmp_path / "t0_sparse_0.model" / "key").read_bytes() == keys.astype("<i8").tobytes()
    assert (tmp_path / "t0_sparse_0.model" / "emb_vector").read_bytes() == vecs.astype(
        "<f4"
    ).tobytes()
    k, v = read_table(path, 8)
    np.testing.assert_array_equal(k, keys)
    np.testing.assert_array_equal(v, vecs)
    assert not v.flags.writeable  # mapped read-only, never copied


def test_extra_hugectr_files_are_ignored(tmp_path):
    keys, vecs = _table()
    path = tmp_path / "t.model"
    write_table(str(path), keys, vecs)
    (path / "slot_id").write_bytes(np.zeros(len(keys), np.uint64).tobytes())
    (path / "meta").write_bytes(b"whatever")
    assert read_table(str(path), 8)[0].shape == (100,)


def test_an_empty_table_is_valid(tmp_path):
    write_table(str(tmp_path / "e.model"), np.empty(0, np.int64), np.empty((0, 4), np.float32))
    k, v = read_table(str(tmp_path / "e.model"), 4)
    assert k.shape == (0,) and v.shape == (0, 4)


@pytest.mark.parametrize(
    "damage, needle, names",
    [
        (lambda p: (p / "key").unlink(), "missing file", "key"),
        (lambda p: (p / "emb_vector").unlink(), "missing file", "emb_vector"),
        (
            lambda p: (p / "key").write_bytes((p / "key").read_bytes()[:-3]),
            "not a multiple of 8",
            "key",
        ),
        (
            lambda p: (p / "emb_vector").write_bytes((p / "emb_vector").read_bytes()[:-4]),
            "not a multiple of 4*vec_size = 32",
            "emb_vector",
        ),
        (
            lambda p: (p / "key").write_bytes((p / "key").read_bytes()[:-8]),
            "holds 99 keys but 'emb_vector' holds 100 vectors",
            "t.model",
        ),
    ],
)
def test_broken_directories_fail_naming_the_file(tmp_path, damage, needle, names):
    keys, vecs = _table()
    path = tmp_path / "t.model"
    write_table(str(path), keys, vecs)
    damage(path)
    with pytest.raises(ModelFileError) as e:
        read_table(str(path), 8)
    assert needle in str(e.value)
    assert str(path) in str(e.value) and names in str(e.value)


def test_a_wrong_vec_size_is_caught_by_the_row_count(tmp_path):
    keys, vecs = _table(n=100, d=8)
    write_table(str(tmp_path / "t.model"), keys, vecs)
    with pytest.raises(
        ModelFileError, match="holds 100 keys but 'emb_vector' holds 50 vectors of size 16"
    ):
        read_table(str(tmp_path / "t.model"), 16)


def test_a_missing_directory_is_named(tmp_path):
    with pytest.raises(ModelFileError, match=r"nope.model: sparse model directory does not exist"):
        read_table(str(tmp_path / "nope.model"), 4)


def test_npz_tables_round_trip_and_are_checked(tmp_path):
    keys, vecs = _table(d=4)
    p = str(tmp_path / "t.npz")
    write_table(p, keys, vecs)
    k, v = read_table(p, 4)
    np.testing.assert_array_equal(k, keys)
    np.testing.assert_array_equal(v, vecs)
    with pytest.raises(ModelFileError, match="4 columns but the config says vec_size 5"):
        read_table(p, 5)
    np.savez(str(tmp_path / "f64.npz"), keys=keys, vectors=vecs.astype(np.float64))
    with pytest.raises(ModelFileError, match="'vectors' must be 2-D float32, got float64"):
        read_table(str(tmp_path / "f64.npz"), 4)
    np.savez(str(tmp_path / "nokeys.npz"), vectors=vecs)
    with pytest.raises(ModelFileError, match="has no array 'keys'"):
        read_table(str(tmp_path / "nokeys.npz"), 4)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ModelFileError, match="junk.npz: not a readable .npz"):
        read_table(str(tmp_path / "junk.npz"), 4)


def test_synthetic_tables_have_unique_keys_and_reproducible_vectors():
    keys = table_keys(7, 1, 5000)
    assert np.unique(keys).shape == (5000,)
    assert (keys < 0).any() and (keys > 0).any()
    a = expected_vectors(7, 1, keys[:10], 16)
    b = expected_vectors(7, 1, keys[:10], 16)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.float32 and a.min() >= -1 and a.max() < 1
    assert not np.array_equal(expected_vectors(7, 2, keys[:10], 16), a)  # tables differ


@pytest.mark.parametrize("fmt", ["fp32-dir", "fp32", "fp16", "int8"])
def test_a_table_written_chunk_by_chunk_reads_back_as_one_written_at_once(tmp_path, fmt):
    from triton_rec.formats.hugectr_sparse import SparseDirWriter
    from triton_rec.formats.npz_table import NpzRowsWriter
    from triton_rec.formats.tables import read_table_rows, write_table_rows
    from triton_rec.precision import RowCodec

    keys, vecs = _table(n=100)
    codec = RowCodec(fmt.split("-")[0], 8)
    ext = ".model" if fmt.endswith("dir") else ".npz"
    a, b = str(tmp_path / f"a{ext}"), str(tmp_path / f"b{ext}")
    if ext == ".model":
        writer = SparseDirWriter(a, 8, rows=100)
    else:
        writer = NpzRowsWriter(a, 100, codec)
    with writer as w:
        for i in range(0, 100, 33):  # chunks of 33, 33, 33, 1
            w.append(keys[i : i + 33], vecs[i : i + 33])
    write_table_rows(b, keys, codec.encode(vecs), codec)
    (ka, ra, ca), (kb, rb, cb) = read_table_rows(a, 8), read_table_rows(b, 8)
    assert ca == cb == codec
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(ra, rb)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (a, b))


@pytest.mark.parametrize("ext", [".model", ".npz"])
def test_a_short_or_failed_chunked_write_leaves_no_table_behind(tmp_path, ext):
    from triton_rec.formats.hugectr_sparse import SparseDirWriter
    from triton_rec.formats.npz_table import NpzRowsWriter
    from triton_rec.precision import RowCodec

    keys, vecs = _table(n=10)

    def writer(path):
        if ext == ".model":
            return SparseDirWriter(path, 8, rows=11)
        return NpzRowsWriter(path, 11, RowCodec("int8", 8))

    w = writer(str(tmp_path / f"short{ext}"))
    w.append(keys, vecs)
    with pytest.raises(ValueError, match="10 rows written, 11"):
        w.close()
    with pytest.raises(RuntimeError), writer(str(tmp_path / f"failed{ext}")) as w:
        w.append(keys, vecs)
        raise RuntimeError("generator failed")
    assert os.listdir(tmp_path) == []
