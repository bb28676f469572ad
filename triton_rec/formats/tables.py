"""Format dispatch: one entry point to read or write a table whatever its format."""

from __future__ import annotations

from typing import Tuple

import numpy as np

from triton_rec.formats.hugectr_sparse import read_sparse_dir, write_sparse_dir
from triton_rec.formats.npz_table import read_npz_table, write_npz_table


def read_table(path: str, vec_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Read a table: ``.npz`` files by suffix, anything else as a HugeCTR sparse directory.

    Returns ``(keys int64 [N], vectors float32 [N, vec_size])``; raises
    :class:`triton_rec.errors.ModelFileError` naming the file on any problem.
    """
    if str(path).endswith(".npz"):
        return read_npz_table(path, vec_size)
    return read_sparse_dir(path, vec_size)


def read_table_rows(path: str, vec_size: int):
    """``(keys, rows, codec)``: the table's rows as the source holds them (float32 for
    HugeCTR sparse files and plain ``.npz`` tables)."""
    from triton_rec.precision import RowCodec

    keys, vectors = read_table(path, vec_size)
    return keys, vectors, RowCodec("fp32", vec_size)


def write_table(path: str, keys: np.ndarray, vectors: np.ndarray) -> None:
    """Write a table in the format implied by ``path`` (see :func:`read_table`)."""
    if str(path).endswith(".npz"):
        write_npz_table(path, keys, vectors)
    else:
        write_sparse_dir(path, keys, vectors)
