"""Reading and validating HugeCTR sparse directories and .npz tables."""

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
