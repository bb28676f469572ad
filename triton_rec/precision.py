"""Embedding row precisions: how one table row is encoded in the store, the cache and the tiers.

The one definition of every precision, its row layout and its encode/decode rules
(ps.json ``embedding_precision``, our extension; default ``fp32``). The native gather
(``src/native/row_codec.hpp``) decodes exactly as :meth:`RowCodec.decode` does, and
the tests hold the two to each other.

Row layouts (``D`` = ``vec_size``, little-endian):

``fp32``  ``float32[D]``: 4 D bytes (the format of HugeCTR's sparse files).
``fp16``  ``float16[D]`` (IEEE binary16, round to nearest even): 2 D bytes.
``int8``  ``uint8 q[D]`` then ``float32 scale``, ``float32 bias``: D + 8 bytes.
          Row-wise asymmetric quantization as FBGEMM's "fused 8-bit row-wise" tables
          (caffe2 ``perfkernels/fused_8bit_rowwise_conversion.cc``,
          ``FloatToFused8BitRowwiseQuantized__base``; fbgemm ``src/QuantUtils.cc`` does
          the same): ``bias = min(row)``, ``scale = (max - min) / 255``,
          ``q = round((x - bias) * 255 / (max - min + 1e-8))`` (``lrintf``: half to even), and
          ``x ~= q * scale + bias``. The same byte layout as FBGEMM's, so an FBGEMM
          row is served as it is, without requantizing.

A row array (:meth:`RowCodec.empty`) is ``float32 [N, D]``, ``float16 [N, D]`` or
``uint8 [N, D + 8]``: for ``fp32`` rows and vectors are the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from triton_rec import _native

#: every precision a table may be stored in (ps.json ``embedding_precision``), in code
#: order: defined by the native code (src/native/row_codec.hpp), which decodes them
PRECISIONS: Tuple[str, ...] = tuple(_native.PRECISIONS)
#: the precision of a table whose ps.json entry names none
DEFAULT_PRECISION = "fp32"
#: the int8 row's trailer: float32 scale and float32 bias (row_codec.hpp)
INT8_TRAILER_BYTES: int = _native.INT8_TRAILER_BYTES
# FBGEMM's guard against a constant row (range 0), in the inverse scale only
_INT8_EPS = 1e-8

_ROW_DTYPES: Dict[str, np.dtype] = {
    "fp32": np.dtype("<f4"),
    "fp16": np.dtype("<f2"),
    "int8": np.dtype("u1"),
}


def check_precision(precision: Any, where: str) -> str:
    """``precision`` if it names one of :data:`PRECISIONS`, else ValueError naming ``where``."""
    if precision not in PRECISIONS:
        raise ValueError(f"{where}: precision must be one of {list(PRECISIONS)}, got {precision!r}")
    return str(precision)


@dataclass(frozen=True)
class RowCodec:
    """The encoding of the rows of one table.

    Args:
        precision: one of :data:`PRECISIONS`.
        dim: floats per decoded vector (``vec_size``).
    """

    precision: str
    dim: int

    def __post_init__(self):
        check_precision(self.precision, "RowCodec")
        if int(self.dim) < 1:
            raise ValueError(f"RowCodec: dim must be >= 1, got {self.dim}")

    @property
    def code(self) -> int:
        """The precision's number in the native code and in file headers (its index in
        :data:`PRECISIONS`)."""
        return PRECISIONS.index(self.precision)

    @classmethod
    def from_code(cls, code: int, dim: int) -> RowCodec:
        """The codec whose :attr:`code` is ``code`` (ValueError for an unknown one)."""
        if not 0 <= int(code) < len(PRECISIONS):
            raise ValueError(f"unknown precision code {code} (known: 0..{len(PRECISIONS) - 1})")
        return cls(PRECISIONS[int(code)], int(dim))

    @property
    def row_dtype(self) -> np.dtype:
        """dtype of a row array."""
        return _ROW_DTYPES[self.precision]

    @property
    def row_width(self) -> int:
        """Elements of ``row_dtype`` per row."""
        return self.dim + INT8_TRAILER_BYTES if self.precision == "int8" else self.dim

    @property
    def row_bytes(self) -> int:
        """Bytes per encoded row."""
        return self.row_width * self.row_dtype.itemsize

    def empty(self, n: int, xp: Any = np) -> Any:
        """An uninitialised row array for ``n`` rows (numpy, or CuPy with ``xp=cupy``)."""
        return xp.empty((int(n), self.row_width), dtype=self.row_dtype)

    def check_rows(self, rows: Any, n: int, what: str) -> None:
        """ValueError naming ``what`` unless ``rows`` is a row array of ``n`` rows."""
        shape = (int(n), self.row_width)
        if rows.dtype != self.row_dtype or tuple(rows.shape) != shape:
            raise ValueError(
                f"{what}: {self.precision} rows must be {self.row_dtype} {list(shape)}, "
                f"got {rows.dtype} {list(rows.shape)}"
            )

    def is_rows(self, a: Any) -> bool:
        """Whether ``a`` is a 2-D row array of this codec (for ``fp32``: float32 vectors)."""
        return a.ndim == 2 and a.dtype == self.row_dtype and a.shape[1] == self.row_width

    def as_rows(self, a: Any, what: str) -> Any:
        """``a`` as a C-contiguous row array: a row array of this codec as it is, float32
        ``[N, dim]`` vectors encoded (ValueError naming ``what`` for anything else)."""
        xp = _xp_of(a)
        if self.is_rows(a):
            return xp.ascontiguousarray(a)
        if a.ndim == 2 and a.dtype == np.float32 and a.shape[1] == self.dim:
            return self.encode(a)
        raise ValueError(
            f"{what} must be float32 [N, {self.dim}] vectors or {self.precision} rows "
            f"({self.row_dtype} [N, {self.row_width}]), got {a.dtype} {list(a.shape)}"
        )

    def default_row(self, value: float) -> np.ndarray:
        """The encoded row (``[1, row_width]``) of a vector whose elements are all ``value``:
        what the stores hold for an unknown key's answer. Decodes to exactly ``value`` for
        ``fp32`` and ``int8`` (scale 0, bias ``value``); to ``float16(value)`` for ``fp16``."""
        return self.encode(np.full((1, self.dim), value, np.float32))

    # -- encode / decode (numpy or CuPy: the same operations on either) -------------------

    def encode(self, vectors: Any, out: Optional[Any] = None) -> Any:
        """Encode float32 ``[N, dim]`` vectors into a row array (``out`` if given)."""
        xp = _xp_of(vectors)
        v = xp.asarray(vectors, dtype=xp.float32)
        if v.ndim != 2 or v.shape[1] != self.dim:
            raise ValueError(f"encode: vectors must be [N, {self.dim}], got {list(v.shape)}")
        rows = self.empty(v.shape[0], xp) if out is None else out
        if self.precision == "fp32":
            rows[...] = v
        elif self.precision == "fp16":
            rows[...] = v.astype(xp.float16)
        else:
            lo = v.min(axis=1, keepdims=True) if v.shape[0] else xp.zeros((0, 1), xp.float32)
            hi = v.max(axis=1, keepdims=True) if v.shape[0] else xp.zeros((0, 1), xp.float32)
            rng = hi - lo
            inv = xp.float32(255.0) / (rng + xp.float32(_INT8_EPS))
            q = xp.rint((v - lo) * inv)
            self.pack_int8(xp.clip(q, 0, 255), rng / xp.float32(255.0), lo, out=rows)
        return rows

    def pack_int8(self, q: Any, scale: Any, bias: Any, out: Optional[Any] = None) -> Any:
        """int8 rows from their parts: ``q`` ``[N, dim]`` (values 0..255), ``scale`` and
        ``bias`` ``[N, 1]`` (any float dtype; float16 widens exactly). Into ``out`` if
        given."""
        if self.precision != "int8":
            raise ValueError(f"pack_int8: the codec is {self.precision}, not int8")
        xp = _xp_of(q)
        n = q.shape[0]
        rows = self.empty(n, xp) if out is None else out
        rows[:, : self.dim] = q.astype(xp.uint8)
        sb = xp.concatenate([scale, bias], axis=1).astype(xp.float32)
        rows[:, self.dim :] = sb.view(xp.uint8).reshape(n, INT8_TRAILER_BYTES)
        return rows

    def decode(self, rows: Any, out: Optional[Any] = None) -> Any:
        """Decode a row array into float32 ``[N, dim]`` vectors (``out`` if given)."""
        xp = _xp_of(rows)
        n = rows.shape[0]
        out = xp.empty((n, self.dim), dtype=xp.float32) if out is None else out
        if self.precision == "int8":
            sb = xp.ascontiguousarray(rows[:, self.dim :]).view(xp.float32)  # [N, 2]
            q = rows[:, : self.dim].astype(xp.float32)
            # two roundings (multiply, then add), as the native decoder: no fused multiply-add
            xp.multiply(q, sb[:, 0:1], out=out)
            xp.add(out, sb[:, 1:2], out=out)
        else:
            out[...] = rows
        return out

    def roundtrip_error(self, vectors: np.ndarray) -> Tuple[float, float]:
        """``(max |x - decode(encode(x))|, RMS of the same)`` over every element."""
        v = np.asarray(vectors, np.float32)
        if v.size == 0:
            return 0.0, 0.0
        d = self.decode(self.encode(v)).astype(np.float64) - v
        return float(np.abs(d).max()), float(np.sqrt(np.mean(d * d)))


def transcode(
    rows: np.ndarray,
    src: RowCodec,
    dst: RowCodec,
    chunk_values: int = 1 << 22,
    on_chunk: Optional[Callable[[int, int, np.ndarray, np.ndarray], None]] = None,
) -> np.ndarray:
    """``rows`` of ``src`` re-encoded in ``dst`` (decoded, then encoded), ``chunk_values``
    values at a time so that no full float32 copy of a large table is made.
    ``on_chunk(a, b, vectors, encoded)`` runs after rows ``a..b``: their float32 values
    and their ``dst`` rows (for progress, or to measure the error)."""
    n = int(rows.shape[0])
    out = dst.empty(n)
    step = max(1, chunk_values // max(1, src.dim))
    for a in range(0, n, step):
        b = min(n, a + step)
        vectors = rows[a:b] if src.precision == "fp32" else src.decode(rows[a:b])
        dst.encode(vectors, out=out[a:b])
        if on_chunk is not None:
            on_chunk(a, b, vectors, out[a:b])
    return out


def _xp_of(a: Any):
    """numpy, or the array module (CuPy) of a device array."""
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":  # pragma: no cover - no GPU on the CI machines
        import cupy

        return cupy
    return np
