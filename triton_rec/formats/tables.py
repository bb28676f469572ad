"""Format dispatch: one entry point to read or write a table whatever its format."""

from __future__ import annotations

from typing import Tuple

import numpy as np

from triton_rec.formats.hugectr_sparse import read_sparse_dir, sparse_dir_rows, write_sparse_dir
from triton_rec.formats.npz_table import (
    npz_shape,
    read_npz_rows,
    read_npz_table,
    write_npz_rows,
    write_npz_table,
)
from triton_rec.precision import RowCodec


def is_npz(path: str) -> bool:
    """Whether ``path`` names an ``.npz`` table (else a HugeCTR sparse directory): the
    one rule, by suffix."""
    return str(path).endswith(".npz")


def read_table(path: str, vec_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Read a table: ``.npz`` files by suffix, anything else as a HugeCTR sparse directory.

    Returns ``(keys int64 [N], vectors float32 [N, vec_size])`` (an encoded ``.npz``
    decoded); raises :class:`triton_rec.errors.ModelFileError` naming the file on any
    problem.
    """
    if is_npz(path):
        return read_npz_table(path, vec_size)
    return read_sparse_dir(path, vec_size)


def read_table_rows(path: str, vec_size: int) -> Tuple[np.ndarray, np.ndarray, RowCodec]:
    """``(keys, rows, codec)``: the table's rows as the source holds them: float32 for
    HugeCTR sparse files and plain ``.npz`` tables, encoded for an encoded ``.npz``."""
    if is_npz(path):
        return read_npz_rows(path, vec_size)
    keys, vectors = read_sparse_dir(path, vec_size)
    return keys, vectors, RowCodec("fp32", vec_size)


def table_shape(path: str, vec_size: int) -> Tuple[int, RowCodec]:
    """``(rows, codec)`` of a table, from its files' sizes and headers alone (never its
    data): what :func:`read_table_rows` would return the keys and rows of. Raises
    :class:`triton_rec.errors.ModelFileError` as it does."""
    if is_npz(path):
        return npz_shape(path, vec_size)
    return sparse_dir_rows(path, vec_size), RowCodec("fp32", vec_size)


def write_table(path: str, keys: np.ndarray, vectors: np.ndarray) -> None:
    """Write a float32 table in the format implied by ``path`` (see :func:`read_table`)."""
    if is_npz(path):
        write_npz_table(path, keys, vectors)
    else:
        write_sparse_dir(path, keys, vectors)


def write_table_rows(path: str, keys: np.ndarray, rows: np.ndarray, codec: RowCodec) -> None:
    """Write a table in ``codec``'s precision: an ``.npz`` for any precision, a HugeCTR
    sparse directory for fp32 only (the format has no other)."""
    if is_npz(path):
        write_npz_rows(path, keys, rows, codec)
    elif codec.precision == "fp32":
        write_sparse_dir(path, keys, rows)
    else:
        raise ValueError(
            f"{path}: HugeCTR sparse files hold fp32 only; write {codec.precision} rows "
            "to an .npz path"
        )
