"""HugeCTR-backend requests: ``DES`` / ``CATCOLUMN`` / ``ROWINDEX`` validated and regrouped.

Layout (HugeCTR Triton backend, see ``docs/upstream-notes.md`` and hps-compat):

- ``DES``: float32, ``num_samples x dense_dim``, sample-major;
- ``CATCOLUMN``: every key, sample-major: sample 0's keys of table 0, of table 1, ...,
  then sample 1's ...; UINT32 or INT64;
- ``ROWINDEX``: int32 CSR row pointers, one block per table, concatenated: table t
  contributes ``num_samples * slots_t + 1`` values starting at 0; slot j of sample i of
  table t holds keys ``rp_t[i*slots_t + j] .. rp_t[i*slots_t + j + 1]`` (0..n keys:
  multi-hot), counted within table t's keys.
- ``num_samples = (len(ROWINDEX) - num_tables) / sum_t slots_t``.

:func:`parse_hugectr_request` checks all of it and returns, per table, its keys in
table order and its own row pointers, ready for lookup and slot combination.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Sequence, Tuple, Union

import numpy as np

from triton_rec import _native
from triton_rec.cache.cached_table import new_default_counts
from triton_rec.errors import RequestError


@dataclass(frozen=True)
class HugeCTRRequest:
    """A validated request.

    Args:
        num_samples: samples in the request.
        dense: float32 ``[num_samples, dense_dim]``.
        keys: per table, int64 keys in table order (sample by sample, slot by slot).
        row_ptrs: per table, int64 ``[num_samples * slots_t + 1]`` pointers into ``keys[t]``.
        exact: fetch every cache miss now (the request parameter ``exact``).
        defaults: int64 ``[len(DEFAULT_CAUSES)]``: the request's keys answered with the
            default value, by cause, filled in by the lookup.
    """

    num_samples: int
    dense: np.ndarray
    keys: Tuple[np.ndarray, ...]
    row_ptrs: Tuple[np.ndarray, ...]
    exact: bool = False
    defaults: np.ndarray = field(default_factory=new_default_counts, compare=False)


def parse_hugectr_request(
    model: str,
    des: np.ndarray,
    catcolumn: np.ndarray,
    rowindex: np.ndarray,
    slots: Union[Sequence[int], np.ndarray],
    dense_dim: int,
    max_batch_size: int,
) -> HugeCTRRequest:
    """Validate the three tensors and regroup CATCOLUMN by table.

    The regrouping and the ROWINDEX checks run in one native pass
    (``_native.regroup_hugectr``); when it rejects the request, the checks below in
    Python (:func:`_row_pointers`) name what is wrong.

    Args:
        model: model name, for messages.
        des, catcolumn, rowindex: the tensors as received (any shape; read flat).
        slots: slots per table (from the network's Data layer).
        dense_dim: dense features per sample.
        max_batch_size: most samples a request may hold.

    Raises:
        RequestError: naming the tensor and what is wrong with it.
    """
    p = f"model '{model}'"
    if catcolumn.dtype not in (np.uint32, np.int64):
        raise RequestError(f"{p}: CATCOLUMN must be UINT32 or INT64, got {catcolumn.dtype}")
    cat = np.ascontiguousarray(catcolumn.reshape(-1))
    slot_arr = np.asarray(slots, np.int64)  # no copy for the int64 array sessions keep
    slot_list = slot_arr.tolist()
    n, dense, rows = _samples_and_dense(p, des, rowindex, slot_list, dense_dim, max_batch_size)
    keys = np.empty(cat.shape[0], np.int64)
    starts = np.empty(len(slot_list) + 1, np.int64)
    ptrs = np.empty(rows.shape[0], np.int64)
    if not _native.regroup_hugectr(cat, rows, slot_arr, n, keys, starts, ptrs):
        _row_pointers(p, rows.astype(np.int64), slot_list, n, cat.shape[0])  # raises, naming it
        raise AssertionError(
            f"{p}: the native ROWINDEX check rejected a request the reference accepts"
        )
    bounds, table_keys, table_ptrs, block = starts.tolist(), [], [], 0
    for t, s in enumerate(slot_list):
        table_keys.append(keys[bounds[t] : bounds[t + 1]])
        table_ptrs.append(ptrs[block : block + n * s + 1])
        block += n * s + 1
    return HugeCTRRequest(n, dense, tuple(table_keys), tuple(table_ptrs))


def _samples_and_dense(p, des, rowindex, slots, dense_dim, max_batch_size):
    """Validate the dtypes, the sizes and DES; (num_samples, dense [n, dense_dim], flat
    C-contiguous int32 ROWINDEX)."""
    if des.dtype != np.float32:
        raise RequestError(f"{p}: DES must be FP32, got {des.dtype}")
    if rowindex.dtype != np.int32:
        raise RequestError(f"{p}: ROWINDEX must be INT32, got {rowindex.dtype}")
    des, rows = des.reshape(-1), np.ascontiguousarray(rowindex.reshape(-1))
    n_tables, total_slots = len(slots), int(sum(slots))
    extra = rows.shape[0] - n_tables
    if rows.shape[0] == 0 or extra <= 0:
        raise RequestError(f"{p}: empty request (ROWINDEX has {rows.shape[0]} values)")
    if extra % total_slots:
        raise RequestError(
            f"{p}: ROWINDEX has {rows.shape[0]} values; expected num_samples * {total_slots} slots "
            f"+ {n_tables} (one block of num_samples*slots+1 row pointers per table)"
        )
    n = extra // total_slots
    if n > max_batch_size:
        raise RequestError(
            f"{p}: request holds {n} samples, more than max_batch_size {max_batch_size}"
        )
    if des.shape[0] % dense_dim:
        raise RequestError(
            f"{p}: DES has {des.shape[0]} values, not a multiple of dense_dim {dense_dim}"
        )
    if des.shape[0] != n * dense_dim:
        raise RequestError(
            f"{p}: DES holds {des.shape[0] // dense_dim} samples but ROWINDEX holds {n}"
        )
    if not np.isfinite(des).all():
        i = int(np.flatnonzero(~np.isfinite(des))[0])
        raise RequestError(
            f"{p}: DES holds a non-finite value ({des[i]}) at sample {i // dense_dim}, "
            f"feature {i % dense_dim}"
        )
    return n, des.reshape(n, dense_dim), rows


def _row_pointers(p, rows, slots, n, num_keys=None):
    """The ROWINDEX checks (the reference the native regrouping follows): per table,
    its block of row pointers starts at 0 and never decreases, and (with ``num_keys``)
    the blocks point to exactly that many keys. Returns per-table row pointers and
    keys-per-sample counts."""
    ptrs, counts, start = [], [], 0
    for t, s in enumerate(slots):
        rp = rows[start : start + n * s + 1]
        start += n * s + 1
        if rp[0] != 0:
            raise RequestError(
                f"{p}: ROWINDEX block of table {t} must start at 0, got {int(rp[0])}"
            )
        steps = np.diff(rp)
        if (steps < 0).any():
            j = int(np.flatnonzero(steps < 0)[0])
            raise RequestError(
                f"{p}: ROWINDEX block of table {t} decreases at position {j + 1} "
                f"({int(rp[j])} -> {int(rp[j + 1])}); row pointers must be non-decreasing"
            )
        ptrs.append(rp)
        counts.append(rp[s::s] - rp[:-1:s])  # keys of each sample in this table
    if num_keys is not None:
        total = int(sum(int(rp[-1]) for rp in ptrs))
        if total != num_keys:
            raise RequestError(
                f"{p}: ROWINDEX points to {total} keys but CATCOLUMN has {num_keys}"
                + (" (ROWINDEX points past the end of CATCOLUMN)" if total > num_keys else "")
            )
    return ptrs, counts


def parse_embedding_request(
    model: str,
    des: np.ndarray,
    embeddings: np.ndarray,
    rowindex: np.ndarray,
    slots: Sequence[int],
    vec_sizes: Sequence[int],
    dense_dim: int,
    max_batch_size: int,
) -> Tuple[int, np.ndarray, List[np.ndarray], List[np.ndarray]]:
    """Requests of a dense model fed by an ``hps`` model (ensemble path).

    ``EMBEDDINGS`` is the ``hps`` answer: the vectors of every key, table-major; the
    ROWINDEX layout is the ``hugectr`` one, counted within each table's keys.

    Returns ``(num_samples, dense, per-table vectors [keys_t, vec_t], per-table row pointers)``.
    NaN or inf in ``EMBEDDINGS`` is refused as in ``DES`` (RequestError naming the table,
    the key and the element).
    """
    p = f"model '{model}'"
    if embeddings.dtype != np.float32:
        raise RequestError(f"{p}: EMBEDDINGS must be FP32, got {embeddings.dtype}")
    n, dense, rows = _samples_and_dense(p, des, rowindex, slots, dense_dim, max_batch_size)
    ptrs, _ = _row_pointers(p, rows.astype(np.int64), slots, n)
    flat = embeddings.reshape(-1)
    sizes = [int(rp[-1]) * int(v) for rp, v in zip(ptrs, vec_sizes)]
    if sum(sizes) != flat.shape[0]:
        raise RequestError(
            f"{p}: ROWINDEX points to {[int(rp[-1]) for rp in ptrs]} keys per table, i.e. "
            f"{sum(sizes)} floats of embeddings, but EMBEDDINGS has {flat.shape[0]}"
        )
    vectors, pos = [], 0
    for size, v in zip(sizes, vec_sizes):
        vectors.append(flat[pos : pos + size].reshape(-1, int(v)))
        pos += size
    if not np.isfinite(flat).all():  # DES's rule (_samples_and_dense), for the same reason
        for t, vec in enumerate(vectors):
            bad = np.flatnonzero(~np.isfinite(vec))
            if bad.size:
                key, element = divmod(int(bad[0]), vec.shape[1])
                seg = int(np.searchsorted(ptrs[t], key, side="right")) - 1  # sample * slots + slot
                raise RequestError(
                    f"{p}: EMBEDDINGS holds a non-finite value ({vec[key, element]}) at sample "
                    f"{seg // slots[t]}, table {t}, slot {seg % slots[t]} (the table's key "
                    f"{key}), element {element}"
                )
    return n, dense, vectors, ptrs
