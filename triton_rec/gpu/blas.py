"""Matrix products that a CUDA graph can capture.

CuPy refuses to call cuBLAS while its current stream is being captured (CuPy 14:
``NotImplementedError: calling cuBLAS API during stream capture is currently unsupported``,
seen on the H200 node); cuBLAS itself supports capture. :class:`CapturableCupy` is CuPy with
``matmul`` done through a cuBLAS handle of our own (``_native.Cublas``, the library CuPy
loaded, on CuPy's current stream) and everything else CuPy's: the array module a
:class:`~triton_rec.dense.hugectr_network.HugeCTRNetwork` is built with when it runs as CUDA
graphs (:mod:`triton_rec.dense.graphs`).
"""

from __future__ import annotations

import ctypes.util
import glob
import os
from typing import Any, List

from triton_rec import _native
from triton_rec.gpu.nvrtc import _site_dirs

_WHEEL_GLOBS = ("nvidia/cu13/lib/libcublas.so.*", "nvidia/cublas/lib/libcublas.so.*")


def library_path() -> str:
    """The cuBLAS library to use: the one already loaded in this process (CuPy's), else
    one of the NVIDIA wheels, else the dynamic loader's ``libcublas.so``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libcublas.so"):
                    return path
    except OSError:
        pass
    found: List[str] = []
    for d in _site_dirs():
        for pattern in _WHEEL_GLOBS:
            found += sorted(glob.glob(os.path.join(d, pattern)))
    if found:
        return found[0]
    return ctypes.util.find_library("cublas") or "libcublas.so"


def concatenate_by_slices(xp: Any, arrays, axis: int = 0):
    """``xp.concatenate(arrays, axis)`` as one copy into a slice of the result per array:
    kernels that take no table from the host, so a CUDA graph can capture them. ``xp`` is
    CuPy, or numpy for its host twin."""
    arrays = list(arrays)
    if not arrays:
        raise ValueError("need at least one array to concatenate")
    nd = arrays[0].ndim
    if not -nd <= axis < nd:
        raise ValueError(f"axis {axis} is out of bounds for arrays of {nd} dimensions")
    ax = axis % nd
    shape = list(arrays[0].shape)
    for a in arrays[1:]:
        if a.ndim != nd or any(a.shape[d] != shape[d] for d in range(nd) if d != ax):
            raise ValueError(
                f"all the input array dimensions except for axis {axis} must match: "
                f"{tuple(arrays[0].shape)} and {tuple(a.shape)}"
            )
    shape[ax] = sum(int(a.shape[ax]) for a in arrays)
    out = xp.empty(tuple(shape), dtype=xp.result_type(*arrays))
    index = [slice(None)] * nd
    offset = 0
    for a in arrays:
        width = int(a.shape[ax])
        index[ax] = slice(offset, offset + width)
        out[tuple(index)] = a
        offset += width
    return out


class CapturableCupy:
    """CuPy, with ``matmul`` through ``_native.Cublas`` on CuPy's current stream.

    Args:
        cupy: the CuPy module.
        device: the CUDA device the handle works on.
        math: the model's ``dense_math`` (:data:`~triton_rec.config.model_config.DENSE_MATHS`):
            ``fp32``; ``tf32`` (the handle's float32 GEMMs on tensor cores, their inputs
            rounded to TF32); ``fp16`` (a layer's GEMM, activations times weights, on fp16
            copies of both made in the graph, accumulated in float32; the interaction's
            products of activations stay float32). :mod:`triton_rec.dense.emulated_math`
            is its host twin, which measures the accuracy bound.
    """

    __name__ = "cupy"

    def __init__(self, cupy: Any, device: int, math: str = "fp32"):
        self._cupy = cupy
        cupy.cuda.Device(device).use()
        (cupy.ones((2, 2), cupy.float32) @ cupy.ones((2, 2), cupy.float32)).sum()  # loads cuBLAS
        self._blas = _native.Cublas(library_path(), int(device), math)

    @property
    def math(self) -> str:
        """The handle's ``dense_math``."""
        return self._blas.math

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cupy, name)

    def concatenate(self, arrays, axis: int = 0):
        """``numpy.concatenate``, capturable: CuPy's own joins more than a few arrays in one
        kernel whose table of pointers it copies from the host, which a capturing stream
        refuses (``the current stream is capturing, so H2D transfers are disallowed``, seen
        on an H200 with the 26 embeddings of the MLPerf-shaped DLRM)."""
        return concatenate_by_slices(self._cupy, arrays, axis)

    def matmul(self, a, b):
        """``a @ b`` for float32 ``a [..., m, k]`` and ``b [k, n]`` or ``[k]``, or batched
        ``a [B, m, k] @ b [B, k, n]``: the product as ``numpy.matmul`` defines it."""
        cp = self._cupy
        f32 = cp.float32
        stream = cp.cuda.get_current_stream().ptr
        if b.ndim == 1:
            return self.matmul(a, b[:, None])[..., 0]
        k, n = int(b.shape[-2]), int(b.shape[-1])
        if b.ndim == 2:
            a2 = cp.ascontiguousarray(a, dtype=f32).reshape(-1, k)
            b2 = cp.ascontiguousarray(b, dtype=f32)
            c = cp.empty((a2.shape[0], n), dtype=f32)
            if c.size and k and self.math == "fp16":  # both converted each run: no stale copy
                a16, b16 = a2.astype(cp.float16), b2.astype(cp.float16)
                self._blas.gemm_half(
                    stream, a2.shape[0], n, k, a16.data.ptr, b16.data.ptr, c.data.ptr
                )
            elif c.size and k:
                self._blas.sgemm(stream, a2.shape[0], n, k, a2.data.ptr, b2.data.ptr, c.data.ptr)
            elif c.size:
                c.fill(0)
            return c.reshape(*a.shape[:-1], n)
        if a.ndim == 3 and b.ndim == 3 and a.shape[0] == b.shape[0]:
            a3 = cp.ascontiguousarray(a, dtype=f32)
            b3 = cp.ascontiguousarray(b, dtype=f32)
            batch, m = int(a3.shape[0]), int(a3.shape[1])
            c = cp.empty((batch, m, n), dtype=f32)
            if c.size and k:
                self._blas.sgemm_batched(
                    stream, batch, m, n, k, a3.data.ptr, b3.data.ptr, c.data.ptr
                )
            elif c.size:
                c.fill(0)
            return c
        raise ValueError(f"matmul of {a.shape} and {b.shape} is not supported here")
