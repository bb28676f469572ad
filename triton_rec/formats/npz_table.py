"""numpy ``.npz`` embedding tables, plain or encoded.

- plain: arrays ``keys`` (int64 [N]) and ``vectors`` (float32 [N, D]);
- encoded (issue 15): ``keys``, ``rows`` (a row array of the precision, see
  :class:`triton_rec.precision.RowCodec`: float16 [N, D] or uint8 [N, D + 8]) and
  ``precision`` (a 0-d string array: ``"fp16"``, ``"int8"``), as written by
  ``ps_loader quantize`` and by the TorchRec/FBGEMM importer.

Other dtypes or shapes are rejected rather than cast, so a table never changes silently.
"""

from __future__ import annotations

import os
import zipfile
from typing import Tuple

import numpy as np

from triton_rec.config.model_files import open_model_file
from triton_rec.errors import ModelFileError
from triton_rec.precision import PRECISIONS, RowCodec


def read_npz_rows(path: str, vec_size: int) -> Tuple[np.ndarray, np.ndarray, RowCodec]:
    """Load an ``.npz`` table as ``(keys, rows, codec)``: the rows as the file holds them
    (float32 vectors for a plain table), checked against ``vec_size``.

    Raises:
        ModelFileError: missing file, not an npz, missing or conflicting arrays, unknown
            precision, wrong dtype or shape.
    """
    if not os.path.lexists(path):
        raise ModelFileError(path, "npz table file does not exist")
    fd, _ = open_model_file(path, "npz table file")  # regular, inside the allowed roots
    try:
        with os.fdopen(fd, "rb") as f, np.load(f, allow_pickle=False) as z:
            names = set(z.files)
            if "keys" not in names:
                raise ModelFileError(path, f"has no array 'keys' (found: {z.files})")
            if ("vectors" in names) == ("rows" in names):
                raise ModelFileError(
                    path,
                    "must hold exactly one of 'vectors' (float32) and 'rows' with "
                    f"'precision' (encoded); found: {z.files}",
                )
            keys = z["keys"]
            if "vectors" in names:
                rows, precision = z["vectors"], "fp32"
            else:
                if "precision" not in names:
                    raise ModelFileError(path, "has 'rows' but no 'precision' array")
                tag = z["precision"]
                if tag.ndim != 0 or tag.dtype.kind != "U" or str(tag) not in PRECISIONS:
                    raise ModelFileError(
                        path,
                        f"'precision' must be one of {list(PRECISIONS)} (a 0-d string "
                        f"array), got {tag.dtype} {tag.shape} {tag!r}",
                    )
                rows, precision = z["rows"], str(tag)
    except ModelFileError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise ModelFileError(path, f"not a readable .npz file ({e})") from e
    if keys.dtype != np.int64 or keys.ndim != 1:
        raise ModelFileError(path, f"'keys' must be 1-D int64, got {keys.dtype} {keys.shape}")
    codec = RowCodec(precision, vec_size)
    what = "'vectors'" if precision == "fp32" else f"'rows' ({precision})"
    if rows.ndim != 2 or rows.dtype != codec.row_dtype:
        raise ModelFileError(
            path, f"{what} must be 2-D {codec.row_dtype}, got {rows.dtype} {rows.shape}"
        )
    if rows.shape[1] != codec.row_width:
        raise ModelFileError(
            path,
            f"{what} has {rows.shape[1]} columns but the config says vec_size {vec_size} "
            f"({codec.row_width} columns in {precision})",
        )
    if rows.shape[0] != keys.shape[0]:
        raise ModelFileError(
            path, f"'keys' holds {keys.shape[0]} keys but {what} holds {rows.shape[0]} rows"
        )
    return np.ascontiguousarray(keys), np.ascontiguousarray(rows), codec


def read_npz_table(path: str, vec_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(keys int64 [N], vectors float32 [N, vec_size])`` of an ``.npz`` table (an
    encoded one decoded). Raises ModelFileError as :func:`read_npz_rows`."""
    keys, rows, codec = read_npz_rows(path, vec_size)
    return keys, rows if codec.precision == "fp32" else codec.decode(rows)


def write_npz_rows(path: str, keys: np.ndarray, rows: np.ndarray, codec: RowCodec) -> None:
    """Write a table in ``codec``'s precision (plain for fp32, else encoded)."""
    keys = np.asarray(keys, np.int64)
    codec.check_rows(rows, keys.shape[0], f"{path}: rows")
    if codec.precision == "fp32":
        np.savez(path, keys=keys, vectors=rows)
    else:
        np.savez(path, keys=keys, rows=rows, precision=np.array(codec.precision))


def write_npz_table(path: str, keys: np.ndarray, vectors: np.ndarray) -> None:
    """Write a plain float32 table in the layout read by :func:`read_npz_table`."""
    np.savez(path, keys=np.asarray(keys, np.int64), vectors=np.asarray(vectors, np.float32))
