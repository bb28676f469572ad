"""The capturable join of CUDA graphs (triton_rec.gpu.blas.concatenate_by_slices), run
with numpy: the same answers as numpy.concatenate, and numpy's refusals."""

import numpy as np
import pytest

from triton_rec.gpu.blas import concatenate_by_slices


@pytest.mark.parametrize("axis", [0, 1, -1, 2, -3])
def test_it_joins_as_numpy_does(axis):
    rng = np.random.default_rng(7)
    parts = []
    for i in range(26):  # the MLPerf-shaped DLRM's 26 embeddings, of uneven widths
        shape = [3, 4, 5]
        shape[axis % 3] = 1 + i % 4
        parts.append(rng.standard_normal(shape).astype(np.float32))
    got = concatenate_by_slices(np, parts, axis)
    want = np.concatenate(parts, axis=axis)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_the_result_type_is_numpys():
    parts = [np.ones((2, 1), np.float16), np.full((2, 2), 3, np.int32), np.zeros((2, 1))]
    got = concatenate_by_slices(np, parts, 1)
    assert got.dtype == np.concatenate(parts, axis=1).dtype == np.float64
    np.testing.assert_array_equal(got, np.concatenate(parts, axis=1))


def test_views_and_empty_parts():
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    parts = [base[:, ::3], base[:, 1:1], base[::-1, 2:4]]
    np.testing.assert_array_equal(
        concatenate_by_slices(np, parts, 1), np.concatenate(parts, axis=1)
    )


@pytest.mark.parametrize(
    "parts, axis, words",
    [
        ([], 0, "at least one"),
        ([np.ones((2, 3)), np.ones((3, 3))], 1, "must match"),
        ([np.ones((2, 3)), np.ones(3)], 0, "must match"),
        ([np.ones((2, 3))], 2, "out of bounds"),
    ],
)
def test_what_numpy_refuses_it_refuses(parts, axis, words):
    with pytest.raises(ValueError, match=words):
        concatenate_by_slices(np, parts, axis)
