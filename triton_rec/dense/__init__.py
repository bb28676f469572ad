"""Dense executors: the part of a ranking model that runs after the embedding lookup.

A :class:`DenseModel` turns a batch of dense features and the *combined* embedding
vectors of each table into predictions. The caller (``triton_rec.serving.ranking``) does the
lookups and combines every slot's vectors with :func:`combine_slots`; the model only
runs the network.

Implementations:

- :class:`triton_rec.dense.hugectr_network.HugeCTRNetwork`: a HugeCTR network JSON and
  dense file, executed with numpy (or CuPy: same code, ``xp`` argument).

The array code here and in the executors is written once over the array API that numpy
and CuPy share (``xp``). A KIND_GPU instance runs a HugeCTR network on its GPU when it can
import CuPy (:func:`triton_rec.serving.deployment.dense_placement`), captured as CUDA
graphs (:class:`triton_rec.dense.graphs.DenseGraphs`, which tests/gpu holds to the numpy
executor on an H200); CI runs numpy.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from triton_rec.errors import ConfigError, RequestError

__all__ = [
    "Combiner",
    "DenseModel",
    "HugeCTRNetwork",
    "TableSpec",
    "array_module",
    "combine_slots",
    "to_host",
]


class Combiner(str, enum.Enum):
    """How the vectors of one multi-hot slot become one vector (HugeCTR semantics).

    ``sum``: their sum. ``mean``: their sum divided by their count, *only when the count
    is above 1*. An empty slot gives zeros with either combiner
    (HugeCTR ``src/inference/embedding_feature_combiner.cu``, kernel
    ``embedding_feature_combine_kernel``, v23.08.00 lines 27-56).
    """

    SUM = "sum"
    MEAN = "mean"

    @classmethod
    def parse(cls, value, where: str = "combiner") -> Combiner:
        """``"sum"``/``"mean"`` (v3.1+ JSON) or ``0``/``1`` (v3.0 JSON: 0 = sum, 1 = mean).

        Args:
            value: the JSON value.
            where: named in the error message.

        Raises:
            ConfigError: any other value.
        """
        if isinstance(value, Combiner):
            return value
        if isinstance(value, bool):  # bool is an int subclass: never a valid combiner
            raise ConfigError(f"{where}: combiner must be 'sum' or 'mean' (or 0/1), got {value!r}")
        if isinstance(value, int):
            # HugeCTR v3.0 src/parsers/inference_parser.cpp:231-238: 0 -> Sum, 1 -> Mean.
            if value in (0, 1):
                return cls.SUM if value == 0 else cls.MEAN
        elif isinstance(value, str) and value.lower() in ("sum", "mean"):
            return cls(value.lower())
        raise ConfigError(f"{where}: combiner must be 'sum' or 'mean' (or 0/1), got {value!r}")


@dataclass(frozen=True)
class TableSpec:
    """One embedding input of a dense model, as the caller must feed it.

    Table ``t`` of a model is the ``t``-th entry of :attr:`DenseModel.tables`; for a
    HugeCTR network that is the ``t``-th ``Data.sparse`` input, the ``t``-th embedding
    layer and the ``t``-th ``sparse_files`` entry of ps.json. ``predict`` takes its
    combined vectors as ``float32 [B, slot_num, vec_size]``.

    Args:
        name: the table's name (the embedding layer's ``name`` for HugeCTR).
        slot_num: slots per sample (ROWINDEX holds ``B * slot_num + 1`` pointers).
        vec_size: floats per vector.
        combiner: how a multi-hot slot's vectors are combined.
        max_nnz: most keys in one slot, when the model says (``nnz_per_slot``).
        max_feature_num_per_sample: most keys of this table in one sample, when given.
        input_name: the sparse input tensor's name (``Data.sparse[t].top``).
        output_name: the tensor the embedding layer produces (its ``top``).
    """

    name: str
    slot_num: int
    vec_size: int
    combiner: Combiner = Combiner.SUM
    max_nnz: Optional[int] = None
    max_feature_num_per_sample: Optional[int] = None
    input_name: str = ""
    output_name: str = ""

    def __post_init__(self):
        if int(self.slot_num) < 1 or int(self.vec_size) < 1:
            raise ConfigError(
                f"table '{self.name}': slot_num and vec_size must be >= 1, "
                f"got {self.slot_num} and {self.vec_size}"
            )
        object.__setattr__(self, "combiner", Combiner.parse(self.combiner, f"table '{self.name}'"))


class DenseModel(abc.ABC):
    """The dense part of a ranking model.

    Thread-safety: ``predict`` does not modify the model; concurrent calls are safe as
    far as the array library is (numpy: yes).
    """

    @property
    @abc.abstractmethod
    def dense_dim(self) -> int:
        """Dense features per sample (``DES`` holds ``B * dense_dim`` floats)."""

    @property
    @abc.abstractmethod
    def label_dim(self) -> int:
        """Predictions per sample: the width of :meth:`predict`'s result."""

    @property
    @abc.abstractmethod
    def tables(self) -> Tuple[TableSpec, ...]:
        """The embedding inputs, in the order ``predict`` takes them."""

    @property
    def total_slots(self) -> int:
        """Slots per sample over all tables (HugeCTR's ``slots`` / ``slot_num``)."""
        return sum(int(t.slot_num) for t in self.tables)

    @abc.abstractmethod
    def predict(self, dense, embeddings: Sequence) -> np.ndarray:
        """Predictions for a batch.

        Args:
            dense: float32 ``[B, dense_dim]``.
            embeddings: per table, float32 ``[B, slot_num_t, vec_size_t]``, already
                combined per slot (see :func:`combine_slots`).

        Returns:
            float32 ``[B, label_dim]`` (an array of the model's array module).

        Raises:
            RequestError: an input of the wrong shape.
        """

    def _check_inputs(self, dense, embeddings, xp):
        """Shared validation of ``predict``'s inputs.

        Returns (B, dense, embeddings) as xp float32.
        """
        dense = xp.asarray(dense, dtype=xp.float32)
        if dense.ndim == 1 and self.dense_dim == 0:
            dense = dense.reshape(-1, 0)
        if dense.ndim != 2 or dense.shape[1] != self.dense_dim:
            raise RequestError(
                f"dense input must be [B, {self.dense_dim}], got {list(dense.shape)}"
            )
        batch = dense.shape[0]
        specs = self.tables
        if len(embeddings) != len(specs):
            raise RequestError(f"expected {len(specs)} embedding inputs, got {len(embeddings)}")
        out = []
        for spec, emb in zip(specs, embeddings):
            emb = xp.asarray(emb, dtype=xp.float32)
            want = (batch, int(spec.slot_num), int(spec.vec_size))
            if tuple(emb.shape) != want:
                raise RequestError(
                    f"embedding input of table '{spec.name}' must be {list(want)}, "
                    f"got {list(emb.shape)}"
                )
            out.append(emb)
        return batch, dense, out


def to_host(array) -> np.ndarray:
    """``array`` as a host (numpy) array: a CuPy (device) array is copied back with its
    ``.get()`` (CuPy refuses ``np.asarray`` on purpose), a numpy array is returned as it is."""
    if isinstance(array, np.ndarray):
        return array
    get = getattr(array, "get", None)
    return np.asarray(get() if callable(get) else array)


def array_module(array):
    """numpy, or CuPy when ``array`` is a CuPy array (without importing CuPy otherwise)."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy  # optional dependency, only reached with a CuPy array

        return cupy
    return np


def combine_slots(
    vectors,
    row_ptr,
    combiner="sum",
    xp=None,
    *,
    slot_num: Optional[int] = None,
    native: bool = True,
):
    """Combine the looked-up vectors of every slot into one vector per slot (HugeCTR rules).

    Segment ``i`` (one slot of one sample) is ``vectors[row_ptr[i]:row_ptr[i + 1]]``; its
    result is the sum of those rows, divided by their count for ``mean`` only when the
    count is above 1; an empty segment gives zeros (HugeCTR v23.08.00
    ``src/inference/embedding_feature_combiner.cu:27-56``: ``row_ptrs`` are used as
    absolute row offsets, ``mean`` divides only if ``feature_num > 1``).

    Vectorized, safe for empty segments (``np.add.reduceat`` is not: it returns the row
    at an empty segment's start). Slots with at most a few keys (the usual case) are
    gathered into a padded ``[segments, max_count, D]`` block and summed in float32;
    when that block would be much larger than the input (a few very long slots), the
    sums are differences of a float64 running sum instead.

    Args:
        vectors: float32 ``[nnz_total, D]``.
        row_ptr: integer ``[segments + 1]``, non-decreasing, within ``[0, nnz_total]``.
        combiner: ``"sum"`` / ``"mean"`` (or a :class:`Combiner`, or 0/1).
        xp: numpy or cupy; by default the module of ``vectors``.
        slot_num: if given, the result is ``[segments / slot_num, slot_num, D]``.
        native: with numpy, run the C++ loop (``_native.combine_segments``: the same
            sums in float32, row order) and use the array code below only to explain
            an invalid ``row_ptr``; False forces the array code (the one CuPy runs).

    Returns:
        float32 ``[segments, D]``, or ``[B, slot_num, D]`` with ``slot_num``.

    Raises:
        RequestError: ``row_ptr`` is not a valid CSR pointer array for ``vectors``.
    """
    if xp is None:
        xp = array_module(vectors)
    comb = Combiner.parse(combiner)
    if native and xp is np:
        out = _combine_native(vectors, row_ptr, comb, slot_num)
        if out is not None:
            return out
    vectors = xp.asarray(vectors, dtype=xp.float32)
    if vectors.ndim != 2:
        raise RequestError(f"vectors must be [nnz, D], got {list(vectors.shape)}")
    nnz, dim = vectors.shape
    ptr = xp.asarray(row_ptr).astype(xp.int64)
    if ptr.ndim != 1 or ptr.shape[0] < 1:
        raise RequestError(
            f"row pointers must be 1-D with at least one entry, got {list(ptr.shape)}"
        )
    n_seg = ptr.shape[0] - 1
    if slot_num is not None and (slot_num < 1 or n_seg % slot_num):
        raise RequestError(f"{n_seg} slots is not a multiple of slot_num {slot_num}")
    out_shape = (n_seg // slot_num, slot_num, dim) if slot_num is not None else (n_seg, dim)
    if n_seg == 0:
        return xp.zeros(out_shape, dtype=xp.float32)
    counts = ptr[1:] - ptr[:-1]
    # One host round-trip for all checks and the path choice.
    lo, hi, min_count, max_count = (
        int(v) for v in xp.stack([ptr.min(), ptr.max(), counts.min(), counts.max()]).tolist()
    )
    if min_count < 0 or lo < 0 or hi > nnz:
        raise RequestError(
            f"row pointers must be non-decreasing within [0, {nnz}] "
            f"(got min {lo}, max {hi}, smallest step {min_count})"
        )
    if max_count == 0:
        return xp.zeros(out_shape, dtype=xp.float32)
    if max_count * n_seg <= 4 * nnz + 2 * n_seg:
        # Padded gather: [n_seg, max_count] row indices, masked beyond each count.
        steps = xp.arange(max_count, dtype=xp.int64)
        idx = ptr[:-1, None] + steps[None, :]
        mask = steps[None, :] < counts[:, None]
        idx = xp.where(mask, idx, 0)
        block = vectors[idx] * mask[:, :, None].astype(xp.float32)
        sums = block.sum(axis=1, dtype=xp.float32)
    else:
        running = xp.concatenate(
            [xp.zeros((1, dim), dtype=xp.float64), xp.cumsum(vectors.astype(xp.float64), axis=0)]
        )
        sums = (running[ptr[1:]] - running[ptr[:-1]]).astype(xp.float32)
    if comb is Combiner.MEAN:
        div = xp.maximum(counts, 1).astype(xp.float32)
        sums = sums / div[:, None]
    return sums.reshape(out_shape)


def _combine_native(vectors, row_ptr, comb: Combiner, slot_num: Optional[int]):
    """:func:`combine_slots` by the C++ loop, or None when the array code must run (to
    raise the error that explains a malformed input)."""
    from triton_rec import _native

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    ptr = np.ascontiguousarray(row_ptr, dtype=np.int64) if np.ndim(row_ptr) == 1 else None
    if vectors.ndim != 2 or ptr is None or ptr.shape[0] < 1:
        return None
    n_seg, dim = ptr.shape[0] - 1, vectors.shape[1]
    if slot_num is not None and (slot_num < 1 or n_seg % slot_num):
        return None
    out = np.empty((n_seg, dim), dtype=np.float32)
    if not _native.combine_segments(vectors, ptr, comb is Combiner.MEAN, out):
        return None
    return out.reshape(n_seg // slot_num, slot_num, dim) if slot_num is not None else out


# Imported last: hugectr_network imports the names above from this package.
from triton_rec.dense.hugectr_network import HugeCTRNetwork  # noqa: E402  (circular: see above)
