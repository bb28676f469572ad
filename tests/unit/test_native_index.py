"""triton_rec._native: build_index / probe, checked against a plain dict and an
independent numpy re-implementation of the persisted layout (splitmix64 + linear probing)."""

from __future__ import annotations

import numpy as np
import pytest

from triton_rec import _native

I64 = np.iinfo(np.int64)
EXTREMES = np.array([I64.min, I64.min + 1, -2, -1, 0, 1, I64.max - 1, I64.max], dtype=np.int64)


def random_unique_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    """n distinct int64 keys over the whole range (about half negative), shuffled; the
    EXTREMES (INT64_MIN, -1, INT64_MAX, ...) are always among them when n >= 8."""
    rand = rng.integers(I64.min, I64.max, size=2 * n + 16, dtype=np.int64, endpoint=True)
    rand = rng.permutation(np.setdiff1d(rand, EXTREMES))
    return rng.permutation(np.concatenate([EXTREMES, rand])[:n])


def dict_rows(table_keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    d = {int(k): i for i, k in enumerate(table_keys)}
    return np.array([d.get(int(q), -1) for q in queries], dtype=np.int64)


def splitmix64(keys: np.ndarray) -> np.ndarray:
    z = keys.astype(np.int64).view(np.uint64).copy()
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def probe(index, keys):
    out = np.full(len(keys), -7, dtype=np.int64)
    n_missing = _native.probe(index, keys, out)
    return out, n_missing


def test_probe_finds_every_key_of_a_random_table_with_negative_and_extreme_keys():
    rng = np.random.default_rng(1)
    keys = random_unique_keys(rng, 5000)
    assert set(EXTREMES.tolist()) <= set(keys.tolist())
    index = _native.build_index(keys)
    rows, n_missing = probe(index, keys)
    assert n_missing == 0
    np.testing.assert_array_equal(rows, np.arange(len(keys)))


def test_probe_reports_absent_keys_as_minus_one_and_counts_them():
    rng = np.random.default_rng(2)
    keys = random_unique_keys(rng, 1000)
    index = _native.build_index(keys[:600])
    queries = rng.permutation(np.concatenate([keys, keys[:50]]))
    rows, n_missing = probe(index, queries)
    expected = dict_rows(keys[:600], queries)
    np.testing.assert_array_equal(rows, expected)
    assert n_missing == int((expected == -1).sum()) == 400


def test_minus_one_and_int64_min_are_ordinary_keys_not_empty_markers():
    keys = np.array([-1, I64.min, 0, I64.max], dtype=np.int64)
    index = _native.build_index(keys)
    rows, n_missing = probe(index, np.array([I64.max, -1, 5, I64.min, 0], dtype=np.int64))
    assert rows.tolist() == [3, 0, -1, 1, 2]
    assert n_missing == 1


def test_index_is_int64_with_power_of_two_capacity_of_at_least_twice_the_keys_and_16():
    for n in [0, 1, 7, 8, 9, 100, 1024, 1025]:
        keys = np.arange(n, dtype=np.int64) * 3 - 50
        index = _native.build_index(keys)
        expected_cap = 16
        while expected_cap < 2 * n:
            expected_cap *= 2
        assert index.dtype == np.int64 and index.flags.c_contiguous
        assert index.shape == (expected_cap, 2)
        assert _native.index_capacity(n) == expected_cap
        # rows are exactly 0..n-1 once each, everything else is empty (-1)
        used = index[:, 1][index[:, 1] != -1]
        np.testing.assert_array_equal(np.sort(used), np.arange(n))


def test_index_layout_is_splitmix64_home_slot_with_linear_probing():
    """Re-implements the documented persisted layout independently of the C++ code."""
    rng = np.random.default_rng(3)
    keys = random_unique_keys(rng, 3000)
    index = _native.build_index(keys)
    cap = index.shape[0]
    home = (splitmix64(keys) & np.uint64(cap - 1)).astype(np.int64)
    for row, (key, h) in enumerate(zip(keys.tolist(), home.tolist())):
        s = h
        while True:
            k, r = int(index[s, 0]), int(index[s, 1])
            assert r != -1, f"key {key} not reachable from its home slot {h}"
            if k == key and r == row:
                break
            s = (s + 1) % cap


def test_duplicate_key_is_rejected_with_the_key_and_both_rows_in_the_message():
    keys = np.array([10, 42, 7, -3, 42, 9], dtype=np.int64)
    with pytest.raises(ValueError, match=r"duplicate key 42 at rows 1 and 4") as info:
        _native.build_index(keys)
    assert isinstance(info.value, _native.DuplicateKeyError)
    assert (info.value.key, info.value.first_row, info.value.second_row) == (42, 1, 4)


def test_duplicate_of_an_extreme_key_is_rejected():
    keys = np.array([I64.min, 5, -1, I64.min], dtype=np.int64)
    with pytest.raises(ValueError, match=rf"duplicate key {I64.min} at rows 0 and 3"):
        _native.build_index(keys)
    with pytest.raises(ValueError, match=r"duplicate key -1 at rows 0 and 2"):
        _native.build_index(np.array([-1, 3, -1], dtype=np.int64))


def test_empty_table_gives_an_all_empty_index_where_every_probe_misses():
    index = _native.build_index(np.empty(0, dtype=np.int64))
    assert index.shape == (16, 2)
    assert (index[:, 1] == -1).all()
    rows, n_missing = probe(index, np.array([0, -1, I64.min], dtype=np.int64))
    assert rows.tolist() == [-1, -1, -1] and n_missing == 3
    rows, n_missing = probe(index, np.empty(0, dtype=np.int64))
    assert rows.shape == (0,) and n_missing == 0


def test_large_random_table_of_200k_keys_matches_a_dict():
    rng = np.random.default_rng(4)
    keys = random_unique_keys(rng, 250_000)
    table, absent = keys[:200_000], keys[200_000:]
    index = _native.build_index(table)
    queries = rng.permutation(np.concatenate([table[rng.integers(0, len(table), 100_000)], absent]))
    rows, n_missing = probe(index, queries)
    np.testing.assert_array_equal(rows, dict_rows(table, queries))
    assert n_missing == len(absent)


def test_read_only_memmap_keys_and_index_work(tmp_path):
    rng = np.random.default_rng(5)
    keys = random_unique_keys(rng, 2000)
    np.save(tmp_path / "keys.npy", keys)
    mkeys = np.load(tmp_path / "keys.npy", mmap_mode="r")
    assert not mkeys.flags.writeable
    index = _native.build_index(mkeys)
    np.save(tmp_path / "index.npy", index)
    mindex = np.load(tmp_path / "index.npy", mmap_mode="r")
    assert not mindex.flags.writeable
    rows, n_missing = probe(mindex, mkeys)
    np.testing.assert_array_equal(rows, np.arange(len(keys)))
    assert n_missing == 0


def test_index_without_any_empty_slot_does_not_hang():
    # A corrupt (full) index: every slot occupied by a key that is never queried.
    index = np.zeros((16, 2), dtype=np.int64)
    index[:, 0] = np.arange(100, 116)
    rows, n_missing = probe(index, np.array([5, 100], dtype=np.int64))
    assert n_missing == 1 and rows[0] == -1


def test_index_row_below_minus_one_is_reported_as_corrupt():
    index = _native.build_index(np.array([11, 22], dtype=np.int64))
    index[index[:, 1] == 1, 1] = -5
    with pytest.raises(ValueError, match=r"corrupt index: slot \d+ maps key 22 to row -5"):
        probe(index, np.array([22], dtype=np.int64))


# ---- argument validation -------------------------------------------------------------------


def test_keys_of_wrong_dtype_are_rejected_naming_the_argument():
    with pytest.raises(TypeError, match=r"keys must be int64 C-contiguous, got int32"):
        _native.build_index(np.arange(5, dtype=np.int32))
    with pytest.raises(TypeError, match=r"keys must be int64 C-contiguous, got uint64"):
        _native.build_index(np.arange(5, dtype=np.uint64))
    with pytest.raises(TypeError, match=r"keys must be int64 C-contiguous, got >i8"):
        _native.build_index(np.arange(5, dtype=">i8"))


def test_keys_that_are_not_an_ndarray_are_rejected_without_conversion():
    with pytest.raises(TypeError, match=r"keys must be a numpy.ndarray of int64, got list"):
        _native.build_index([1, 2, 3])


def test_non_contiguous_or_2d_keys_are_rejected():
    with pytest.raises(ValueError, match=r"keys must be int64 C-contiguous, got a non-contiguous"):
        _native.build_index(np.arange(10, dtype=np.int64)[::2])
    with pytest.raises(ValueError, match=r"keys must be 1-D, got shape \(2, 3\)"):
        _native.build_index(np.zeros((2, 3), dtype=np.int64))


def test_probe_rejects_bad_index_and_out_rows():
    index = _native.build_index(np.arange(10, dtype=np.int64))
    keys = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match=r"out_rows has shape \(3,\), expected \(4,\)"):
        _native.probe(index, keys, np.empty(3, dtype=np.int64))
    with pytest.raises(TypeError, match=r"out_rows must be int64 C-contiguous, got int32"):
        _native.probe(index, keys, np.empty(4, dtype=np.int32))
    ro = np.empty(4, dtype=np.int64)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"out_rows must be writable"):
        _native.probe(index, keys, ro)
    with pytest.raises(ValueError, match=r"index has shape \(24, 2\), expected \(capacity, 2\)"):
        _native.probe(np.full((24, 2), -1, dtype=np.int64), keys, np.empty(4, dtype=np.int64))
    with pytest.raises(ValueError, match=r"index has shape \(32, 3\)"):
        _native.probe(np.full((32, 3), -1, dtype=np.int64), keys, np.empty(4, dtype=np.int64))
    with pytest.raises(TypeError, match=r"index must be int64 C-contiguous, got float64"):
        _native.probe(index.astype(np.float64), keys, np.empty(4, dtype=np.int64))
    with pytest.raises(ValueError, match=r"out_rows must not overlap keys"):
        _native.probe(index, keys, keys)


# -- a direct index: keys that are a range --------------------------------------------


@pytest.mark.parametrize(
    "base",
    [0, 7, -1000, I64.max - 99, I64.min],  # the range may wrap past INT64_MAX
)
def test_a_direct_index_answers_exactly_as_the_hash_index_of_the_same_keys(base):
    from triton_rec.storage.table import EmbeddingTable, key_range_base

    n = 200
    keys = (np.arange(n, dtype=np.uint64) + np.uint64(base % 2**64)).view(np.int64)
    assert key_range_base(keys) == base
    vectors = np.random.default_rng(1).standard_normal((n, 4)).astype(np.float32)
    table = EmbeddingTable("t", keys, vectors, default_value=0.25)
    assert table.key_base == base and table.native_index.shape == (1, 2)
    rng = np.random.default_rng(2)
    queries = np.concatenate(
        [keys, keys - 1, keys + 1, EXTREMES, random_unique_keys(rng, 300)]
    ).astype(np.int64)
    direct, hashed = probe(table.native_index, queries), probe(table.index, queries)
    np.testing.assert_array_equal(direct[0], hashed[0])
    np.testing.assert_array_equal(direct[0], dict_rows(keys, queries))
    assert direct[1] == hashed[1]
    outs = []
    for index in (table.native_index, table.index):
        out = np.empty((len(queries), 4), np.float32)
        missing = np.empty(len(queries), np.uint8)
        n_missing = _native.lookup(index, vectors, queries, out, 0.25, missing=missing)
        outs.append((out, missing, n_missing))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2]


@pytest.mark.parametrize(
    "keys",
    [[5, 6, 8], [5, 4, 3], [1, 1], [3, 4, 5, 6, 7, 0]],
)
def test_keys_that_are_not_a_range_keep_their_hash_index(keys):
    from triton_rec.storage.table import EmbeddingTable, key_range_base

    keys = np.array(keys, np.int64)
    assert key_range_base(keys) is None
    assert key_range_base(keys[:0]) is None
    if len(set(keys.tolist())) == len(keys):
        t = EmbeddingTable("t", keys, np.zeros((len(keys), 2), np.float32))
        assert t.key_base is None and t.native_index is t.index


def test_a_range_is_recognized_across_the_scans_chunks():
    from triton_rec.storage.table import key_range_base

    keys = np.arange(10, 10 + 5000, dtype=np.int64)
    assert key_range_base(keys, chunk=64) == 10
    keys[4097] += 1
    assert key_range_base(keys, chunk=64) is None


def test_a_direct_index_of_more_rows_than_the_vectors_is_refused_as_corrupt():
    vectors = np.zeros((10, 4), np.float32)
    out = np.empty((1, 4), np.float32)
    with pytest.raises(Exception, match="corrupt index"):
        _native.lookup(np.array([[100, 20]], np.int64), vectors, np.array([115]), out, 0.0)
    assert _native.lookup(np.array([[100, 20]], np.int64), vectors, np.array([121]), out, 0.0)


@pytest.mark.parametrize("index", [np.array([[0, -1]]), np.zeros((2, 2)), np.zeros((8, 2))])
def test_a_malformed_direct_or_short_index_is_refused_naming_it(index):
    with pytest.raises(ValueError, match="index"):
        probe(np.ascontiguousarray(index, dtype=np.int64), np.array([1], np.int64))
