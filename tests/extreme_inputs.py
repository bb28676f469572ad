"""Extreme inputs for the dense executors (issue 24, "One answer for extreme inputs"):
overflowing, infinite, NaN and denormal floats, one value per sample, and the rule their
answers are held to (docs/backends.md, "Extreme inputs").

The executors compute in IEEE float32 without clamping: an overflow gives inf, inf - inf
and inf * 0 give NaN, a NaN stays NaN through every layer (ReLU and the sigmoid
included) and denormals are kept. So NaN, inf and denormal inputs have one answer, the
same in every executor. A finite input large enough to overflow does not: a product or a
sum that overflows may round to inf in one executor and stay finite in another (a fused
multiply-add rounds once; the order of the additions differs between BLAS kernels).
"""

from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

import numpy as np

#: One per sample: overflowing, infinite, NaN and denormal float32 values.
EXTREMES = np.array([3e38, -3e38, np.inf, -np.inf, np.nan, 1e-45, -1e-40], np.float32)
#: The samples of EXTREMES whose value is finite but overflows in a product or a sum.
OVERFLOWING = np.abs(EXTREMES) == np.float32(3e38)


def extreme_inputs(
    dense: np.ndarray, embs: Sequence[np.ndarray]
) -> Iterator[Tuple[np.ndarray, List[np.ndarray]]]:
    """Copies of a batch of len(EXTREMES) samples in which sample i holds EXTREMES[i]
    (a) in one DES feature and one element of each table's first vector, (b) in all of
    its DES, (c) in all of its embeddings."""
    assert dense.shape[0] == EXTREMES.size, dense.shape
    one = [dense.copy(), *(e.copy() for e in embs)]
    for a in one:
        a.reshape(a.shape[0], -1)[:, 0] = EXTREMES
    yield one[0], one[1:]
    all_dense = dense.copy()
    all_dense[:] = EXTREMES[:, None]
    yield all_dense, list(embs)
    all_embs = [e.copy() for e in embs]
    for e in all_embs:
        e[:] = EXTREMES[:, None, None]
    yield dense, all_embs


def check_extreme_answers(got, want, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """``got`` (one row per EXTREMES value) against the reference ``want``. Samples
    holding inf, NaN or a denormal: NaN exactly where it is NaN, the same infinities,
    finite values within fp32 rounding. Samples holding 3e38: within fp32 rounding where
    both are finite (see the module docstring for why not more)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.shape[0] == EXTREMES.size, (got.shape, want.shape)
    exact = ~OVERFLOWING
    np.testing.assert_array_equal(np.isnan(got[exact]), np.isnan(want[exact]))
    np.testing.assert_allclose(got[exact], want[exact], atol=atol, rtol=rtol)
    both = np.isfinite(got) & np.isfinite(want)
    np.testing.assert_allclose(got[both], want[both], atol=atol, rtol=rtol)
