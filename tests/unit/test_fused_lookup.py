"""triton_rec._native.lookup (fused probe + gather), checked against a dict + numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from triton_rec import _native

I64 = np.iinfo(np.int64)
EXTREMES = np.array([I64.min, -1, 0, I64.max], dtype=np.int64)


def random_unique_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    rand = rng.integers(I64.min, I64.max, size=2 * n + 16, dtype=np.int64, endpoint=True)
    rand = rng.permutation(np.setdiff1d(rand, EXTREMES))
    return rng.permutation(np.concatenate([EXTREMES, rand])[:n])


def reference(table_keys, vectors, queries, default):
    """Independent answer: dict key -> row, then numpy fancy indexing."""
    d = {int(k): i for i, k in enumerate(table_keys)}
    rows = np.array([d.get(int(q), -1) for q in queries], dtype=np.int64)
    out = np.full((len(queries), vectors.shape[1]), default, dtype=np.float32)
    out[rows >= 0] = vectors[rows[rows >= 0]]
    return out, rows < 0


def make_table(seed, n, dim):
    rng = np.random.default_rng(seed)
    keys = random_unique_keys(rng, n)
    vectors = rng.standard_normal((n, dim), dtype=np.float32)
    return rng, keys, vectors


def mixed_queries(rng, keys, absent, m):
    """m queries: mostly table keys (with repeats), some absent keys."""
    hits = keys[rng.integers(0, len(keys), m - m // 5)] if len(keys) else np.empty(0, np.int64)
    misses = absent[rng.integers(0, len(absent), m - len(hits))]
    return rng.permutation(np.concatenate([hits, misses]).astype(np.int64))


def run_lookup(index, vectors, queries, default, **kw):
    out = np.full((len(queries), vectors.shape[1]), np.nan, dtype=np.float32)
    n_missing = _native.lookup(index, vectors, queries, out, default, **kw)
    return out, n_missing


@pytest.mark.parametrize("dim", [1, 3, 16, 17, 128, 129])
def test_known_keys_get_their_rows_and_unknown_keys_get_the_default(dim):
    rng, keys, vectors = make_table(dim, 3000, dim)
    table, absent = keys[:2500], keys[2500:]
    index = _native.build_index(table)
    queries = mixed_queries(rng, table, absent, 5000)
    out, n_missing = run_lookup(index, vectors[:2500], queries, -2.5)
    expected, expected_missing = reference(table, vectors[:2500], queries, -2.5)
    np.testing.assert_array_equal(out, expected)
    assert n_missing == int(expected_missing.sum()) > 0


def test_negative_and_extreme_keys_are_looked_up_like_any_other():
    keys = np.array([I64.max, -1, I64.min, 0, -123456789], dtype=np.int64)
    vectors = np.arange(10, dtype=np.float32).reshape(5, 2)
    index = _native.build_index(keys)
    queries = np.array([I64.min, 1, -1, I64.max, I64.min + 1, -123456789], dtype=np.int64)
    out, n_missing = run_lookup(index, vectors, queries, 7.0)
    assert out.tolist() == [[4, 5], [7, 7], [2, 3], [0, 1], [7, 7], [8, 9]]
    assert n_missing == 2


@pytest.mark.parametrize("mask_dtype", [np.uint8, np.bool_])
def test_missing_mask_marks_exactly_the_unknown_keys(mask_dtype):
    rng, keys, vectors = make_table(11, 1000, 8)
    index = _native.build_index(keys[:700])
    queries = mixed_queries(rng, keys[:700], keys[700:], 3000)
    missing = np.ones(len(queries), dtype=mask_dtype)  # stale values must be overwritten
    missing[::2] = 0
    out, n_missing = run_lookup(index, vectors[:700], queries, 0.0, missing=missing)
    expected, expected_missing = reference(keys[:700], vectors[:700], queries, 0.0)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(missing.astype(bool), expected_missing)
    assert set(np.unique(missing.view(np.uint8)).tolist()) == {0, 1}
    assert n_missing == int(expected_missing.sum())


def test_one_and_two_threads_give_identical_output():
    rng, keys, vectors = make_table(12, 20_000, 32)
    index = _native.build_index(keys[:15_000])
    queries = mixed_queries(rng, keys[:15_000], keys[15_000:], 50_001)
    results = []
    for num_threads in [1, 2, 3, 64]:
        missing = np.zeros(len(queries), dtype=np.uint8)
        out, n = run_lookup(
            index, vectors[:15_000], queries, 1.5, missing=missing, num_threads=num_threads
        )
        results.append((out, missing, n))
    expected, expected_missing = reference(keys[:15_000], vectors[:15_000], queries, 1.5)
    for out, missing, n in results:
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(missing.astype(bool), expected_missing)
        assert n == int(expected_missing.sum())
    np.testing.assert_array_equal(results[0][0].view(np.uint32), results[1][0].view(np.uint32))


def test_read_only_memmap_index_vectors_and_keys_work(tmp_path):
    rng, keys, vectors = make_table(13, 4000, 12)
    index = _native.build_index(keys)
    queries = mixed_queries(rng, keys, np.array([5, 6, 7], dtype=np.int64) * 99991, 9000)
    for name, arr in [("index", index), ("vectors", vectors), ("queries", queries)]:
        np.save(tmp_path / f"{name}.npy", arr)
    m = {n: np.load(tmp_path / f"{n}.npy", mmap_mode="r") for n in ["index", "vectors", "queries"]}
    assert not any(a.flags.writeable for a in m.values())
    for num_threads in [1, 2]:
        out, n_missing = run_lookup(
            m["index"], m["vectors"], m["queries"], 3.0, num_threads=num_threads
        )
        expected, expected_missing = reference(keys, vectors, queries, 3.0)
        np.testing.assert_array_equal(out, expected)
        assert n_missing == int(expected_missing.sum())


def test_empty_table_returns_the_default_for_every_key():
    index = _native.build_index(np.empty(0, dtype=np.int64))
    vectors = np.empty((0, 4), dtype=np.float32)
    queries = np.array([0, -1, I64.min, 99], dtype=np.int64)
    missing = np.zeros(4, dtype=np.bool_)
    out, n_missing = run_lookup(index, vectors, queries, -1.0, missing=missing)
    assert (out == -1.0).all() and missing.all() and n_missing == 4


def test_empty_batch_returns_zero_missing():
    _, keys, vectors = make_table(14, 10, 4)
    index = _native.build_index(keys)
    out, n_missing = run_lookup(index, vectors, np.empty(0, dtype=np.int64), 0.0, num_threads=2)
    assert out.shape == (0, 4) and n_missing == 0


def test_large_random_lookup_of_200k_keys_matches_the_reference():
    rng, keys, vectors = make_table(15, 220_000, 16)
    table, absent = keys[:200_000], keys[200_000:]
    index = _native.build_index(table)
    queries = mixed_queries(rng, table, absent, 200_000)
    missing = np.empty(len(queries), dtype=np.uint8)
    out, n_missing = run_lookup(
        index, vectors[:200_000], queries, 0.25, missing=missing, num_threads=2
    )
    expected, expected_missing = reference(table, vectors[:200_000], queries, 0.25)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(missing.astype(bool), expected_missing)
    assert n_missing == int(expected_missing.sum())


# ---- corrupt index ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_threads", [1, 2])
def test_index_row_beyond_the_vectors_raises_instead_of_reading_out_of_bounds(num_threads):
    keys = np.arange(10_000, dtype=np.int64) * 7
    index = _native.build_index(keys)
    vectors = np.zeros((9_000, 4), dtype=np.float32)  # index built for a bigger table
    queries = keys[::-1].copy()  # the bad rows are in the first chunk of the batch
    out = np.empty((len(queries), 4), dtype=np.float32)
    with pytest.raises(
        ValueError,
        match=r"corrupt index: slot \d+ maps key \d+ to row \d+, "
        r"but vectors has 9000 rows",
    ) as info:
        _native.lookup(index, vectors, queries, out, 0.0, num_threads=num_threads)
    assert isinstance(info.value, _native.CorruptIndexError)


def test_error_in_a_worker_thread_is_raised_in_the_caller():
    keys = np.arange(10_000, dtype=np.int64)
    index = _native.build_index(keys)
    vectors = np.zeros((9_990, 2), dtype=np.float32)
    queries = keys.copy()  # only the last 10 keys (second thread's chunk) are bad
    out = np.empty((len(queries), 2), dtype=np.float32)
    with pytest.raises(ValueError, match=r"maps key 99\d\d to row 99\d\d, but vectors has 9990"):
        _native.lookup(index, vectors, queries, out, 0.0, num_threads=2)


# ---- argument validation ---------------------------------------------------------------------


@pytest.fixture
def small():
    keys = np.arange(20, dtype=np.int64)
    vectors = np.ones((20, 16), dtype=np.float32)
    return _native.build_index(keys), vectors, keys[:10].copy(), np.empty((10, 16), np.float32)


def test_vectors_of_wrong_dtype_are_rejected_without_casting(small):
    index, vectors, keys, out = small
    with pytest.raises(TypeError, match=r"^vectors must be float32 C-contiguous, got float64$"):
        _native.lookup(index, vectors.astype(np.float64), keys, out, 0.0)
    with pytest.raises(TypeError, match=r"keys must be int64 C-contiguous, got uint64"):
        _native.lookup(index, vectors, keys.astype(np.uint64), out, 0.0)
    with pytest.raises(TypeError, match=r"out must be float32 C-contiguous, got float16"):
        _native.lookup(index, vectors, keys, np.zeros((10, 16), np.float16), 0.0)
    with pytest.raises(TypeError, match=r"missing must be uint8 or bool C-contiguous, got int32"):
        _native.lookup(index, vectors, keys, out, 0.0, missing=np.zeros(10, np.int32))
    with pytest.raises(TypeError, match=r"vectors must be a numpy.ndarray of float32, got list"):
        _native.lookup(index, vectors.tolist(), keys, out, 0.0)


def test_non_contiguous_arguments_are_rejected(small):
    index, vectors, keys, out = small
    wide = np.ones((20, 32), dtype=np.float32)
    with pytest.raises(ValueError, match=r"vectors must be float32 C-contiguous, got a non-contig"):
        _native.lookup(index, wide[:, ::2], keys, out, 0.0)
    with pytest.raises(ValueError, match=r"keys must be int64 C-contiguous, got a non-contiguous"):
        _native.lookup(index, vectors, np.arange(20, dtype=np.int64)[::2], out, 0.0)
    with pytest.raises(ValueError, match=r"out must be float32 C-contiguous, got a non-contig"):
        _native.lookup(index, vectors, keys, np.empty((16, 10), np.float32).T, 0.0)
    with pytest.raises(ValueError, match=r"index must be int64 C-contiguous, got a non-contig"):
        _native.lookup(np.asfortranarray(index), vectors, keys, out, 0.0)


def test_wrong_shapes_are_rejected_naming_argument_and_dimensions(small):
    index, vectors, keys, out = small
    with pytest.raises(ValueError, match=r"^out has shape \(10, 8\), expected \(10, 16\)$"):
        _native.lookup(index, vectors, keys, np.empty((10, 8), np.float32), 0.0)
    with pytest.raises(ValueError, match=r"out has shape \(9, 16\), expected \(10, 16\)"):
        _native.lookup(index, vectors, keys, np.empty((9, 16), np.float32), 0.0)
    with pytest.raises(ValueError, match=r"missing has shape \(11,\), expected \(10,\)"):
        _native.lookup(index, vectors, keys, out, 0.0, missing=np.zeros(11, np.uint8))
    with pytest.raises(ValueError, match=r"vectors must be 2-D, got shape \(320,\)"):
        _native.lookup(index, vectors.ravel(), keys, out, 0.0)
    with pytest.raises(ValueError, match=r"out must be 2-D, got shape \(10, 16, 1\)"):
        _native.lookup(index, vectors, keys, out[..., None], 0.0)
    with pytest.raises(ValueError, match=r"index has shape \(20, 2\), expected \(capacity, 2\)"):
        _native.lookup(index[:20], vectors, keys, out, 0.0)


def test_read_only_outputs_overlaps_and_bad_thread_counts_are_rejected(small):
    index, vectors, keys, out = small
    ro = out.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"out must be writable"):
        _native.lookup(index, vectors, keys, ro, 0.0)
    ro_mask = np.zeros(10, np.uint8)
    ro_mask.flags.writeable = False
    with pytest.raises(ValueError, match=r"missing must be writable"):
        _native.lookup(index, vectors, keys, out, 0.0, missing=ro_mask)
    with pytest.raises(ValueError, match=r"out must not overlap vectors"):
        _native.lookup(index, vectors, keys, vectors[:10], 0.0)
    with pytest.raises(ValueError, match=r"num_threads must be >= 1, got 0"):
        _native.lookup(index, vectors, keys, out, 0.0, num_threads=0)


def test_keyword_arguments_are_accepted(small):
    index, vectors, keys, out = small
    missing = np.zeros(10, np.uint8)
    n = _native.lookup(
        index=index,
        vectors=vectors,
        keys=keys,
        out=out,
        default_value=0.0,
        missing=missing,
        num_threads=2,
    )
    assert n == 0 and (out == 1.0).all() and not missing.any()
