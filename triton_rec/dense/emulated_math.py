"""The host twin of a GPU instance's reduced-precision dense layers (the config.pbtxt
parameter ``dense_math``; on the GPU :class:`~triton_rec.gpu.blas.CapturableCupy`): numpy
whose ``matmul`` rounds its operands as the GPU's GEMMs do, so that the accuracy of ``tf32``
and ``fp16`` against ``fp32`` is measured without a GPU (``benchmarks/bench_dense_math.py``)
and held in CI (``tests/unit/test_dense_math.py``); the GPU suite checks the device's own
answers against the same bounds (``tests/gpu/test_dense_math_gpu.py``).

What each math does to a GEMM (as CapturableCupy runs it):

- ``tf32``: both operands of every GEMM (the layers' and the interaction's) reach the tensor
  cores as TF32: 10 explicit mantissa bits instead of 23. Emulated by truncation, the
  coarser of the two conversions the hardware and cuBLAS use (round-to-nearest loses half as
  much), so the emulated error bounds the device's;
- ``fp16``: a layer's GEMM (activations times weights) on fp16 copies of both (round to
  nearest; beyond 65,504 an activation becomes infinite, and so the prediction NaN, as with
  TensorRT's FP16); the interaction's products of activations stay float32.

Accumulation is float32 in every math, on the GPU and here (the host's order of the sums
differs from cuBLAS's: float32 rounding, far below the bounds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from triton_rec.config.model_config import DENSE_MATHS

#: The bit mask that keeps TF32's bits of a float32: sign, 8 exponent bits, 10 mantissa bits.
TF32_MASK = np.uint32(0xFFFFE000)


def to_tf32(x: np.ndarray) -> np.ndarray:
    """``x`` (float32) with its mantissa truncated to TF32's 10 bits."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    return (a.view(np.uint32) & TF32_MASK).view(np.float32)


def to_fp16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to fp16 (to nearest; overflow to infinity) and back to float32."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


class EmulatedMath:
    """numpy, with ``matmul`` rounding its operands as ``math`` does on the GPU: the array
    module of a :class:`~triton_rec.dense.hugectr_network.HugeCTRNetwork` built to measure
    that math's answers on the host (``HugeCTRNetwork.load(..., xp=EmulatedMath(math))``)."""

    __name__ = "numpy"

    def __init__(self, math: str):
        if math not in DENSE_MATHS:
            raise ValueError(f"math must be one of {DENSE_MATHS}, got {math!r}")
        self.math = math

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a @ b`` with the operands as the GPU's GEMM of this math sees them."""
        interaction = a.ndim == 3 and b.ndim == 3  # activations times activations
        if self.math == "tf32":
            a, b = to_tf32(a), to_tf32(b)
        elif self.math == "fp16" and not interaction:
            a, b = to_fp16(a), to_fp16(b)
        return np.matmul(a, b)
