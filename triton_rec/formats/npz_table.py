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
from typing import Any, Callable, NamedTuple, Sequence, Tuple

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
            member, precision = _members(path, z.files, lambda: z["precision"])
            keys, rows = z["keys"], z[member]
    except ModelFileError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise ModelFileError(path, f"not a readable .npz file ({e})") from e
    codec = _check_arrays(path, vec_size, precision, keys, rows)
    return np.ascontiguousarray(keys), np.ascontiguousarray(rows), codec


def npz_shape(path: str, vec_size: int) -> Tuple[int, RowCodec]:
    """``(rows, codec)`` of an ``.npz`` table from the headers of its arrays alone (the
    data is never read): the checks of :func:`read_npz_rows`, which loads exactly this.

    Raises:
        ModelFileError: as :func:`read_npz_rows`.
    """
    if not os.path.lexists(path):
        raise ModelFileError(path, "npz table file does not exist")
    fd, _ = open_model_file(path, "npz table file")
    try:
        with os.fdopen(fd, "rb") as f, zipfile.ZipFile(f) as z:
            names = [n[: -len(".npy")] for n in z.namelist() if n.endswith(".npy")]

            def header(name: str) -> _Header:
                with z.open(name + ".npy") as m:
                    version = np.lib.format.read_magic(m)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _fortran, dtype = read(m)
                return _Header(tuple(shape), np.dtype(dtype))

            def precision_tag() -> np.ndarray:
                with z.open("precision.npy") as m:
                    return np.lib.format.read_array(m, allow_pickle=False)

            member, precision = _members(path, names, precision_tag)
            keys, rows = header("keys"), header(member)
    except ModelFileError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise ModelFileError(path, f"not a readable .npz file ({e})") from e
    return int(rows.shape[0]), _check_arrays(path, vec_size, precision, keys, rows)


class _Header(NamedTuple):
    """An ``.npy`` array as its header describes it."""

    shape: Tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        """Dimensions."""
        return len(self.shape)


def _members(path: str, names: Sequence[str], tag: Callable[[], Any]) -> Tuple[str, str]:
    """``(array holding the rows, precision)`` of an npz whose arrays are ``names``;
    ``tag()`` reads its ``precision`` array."""
    found = sorted(names)
    if "keys" not in names:
        raise ModelFileError(path, f"has no array 'keys' (found: {found})")
    if ("vectors" in names) == ("rows" in names):
        raise ModelFileError(
            path,
            "must hold exactly one of 'vectors' (float32) and 'rows' with "
            f"'precision' (encoded); found: {found}",
        )
    if "vectors" in names:
        return "vectors", "fp32"
    if "precision" not in names:
        raise ModelFileError(path, "has 'rows' but no 'precision' array")
    value = tag()
    if value.ndim != 0 or value.dtype.kind != "U" or str(value) not in PRECISIONS:
        raise ModelFileError(
            path,
            f"'precision' must be one of {list(PRECISIONS)} (a 0-d string "
            f"array), got {value.dtype} {value.shape} {value!r}",
        )
    return "rows", str(value)


def _check_arrays(path: str, vec_size: int, precision: str, keys: Any, rows: Any) -> RowCodec:
    """The codec of a table whose keys and rows arrays (or their headers) are these;
    ModelFileError for a wrong dtype or shape."""
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
    return codec


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


class NpzRowsWriter:
    """Write an ``.npz`` table in ``codec``'s precision chunk by chunk (a table larger than
    memory), in the layout :func:`write_npz_rows` writes and :func:`read_npz_rows` reads.

    The row array's size is fixed up front (``n_rows``): the rows go straight into their
    zip member (stored, zip64) as they are appended; the keys wait in a temporary file
    beside the table and are copied into their member when the table is closed. The zip
    is written under a temporary name and renamed when closed. ``append(keys, rows)`` as
    often as needed, then ``close()``; or use it as a context manager (an exception inside
    removes what was written).

    Args:
        path: the ``.npz`` file.
        n_rows: rows the table will hold.
        codec: the rows' precision (fp32: a plain table with ``vectors``).
    """

    _COPY_BYTES = 1 << 24

    def __init__(self, path: str, n_rows: int, codec: RowCodec):
        self.path, self.n_rows, self.codec = path, int(n_rows), codec
        self.rows = 0
        self._tmp = path + ".partial"
        self._keys_tmp = path + ".keys.partial"
        self._zip = zipfile.ZipFile(self._tmp, "w", zipfile.ZIP_STORED, allowZip64=True)
        member = "vectors" if codec.precision == "fp32" else "rows"
        self._member = self._zip.open(f"{member}.npy", "w", force_zip64=True)
        _npy_header(self._member, codec.row_dtype, (self.n_rows, codec.row_width))
        self._keys = open(self._keys_tmp, "w+b")

    def append(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Append int64 ``keys [n]`` and their rows (a row array of the codec, or float32
        vectors, encoded here)."""
        keys = np.ascontiguousarray(keys, dtype="<i8")
        rows = self.codec.as_rows(rows, f"{self.path}: rows")
        self.codec.check_rows(rows, keys.shape[0], f"{self.path}: rows")
        if self.rows + keys.shape[0] > self.n_rows:
            raise ValueError(f"{self.path}: more than the {self.n_rows} rows declared")
        self._member.write(np.ascontiguousarray(rows).tobytes())
        self._keys.write(keys.tobytes())
        self.rows += int(keys.shape[0])

    def close(self) -> None:
        """Write the keys and the precision, finish the zip and give it its name
        (ValueError when fewer rows than declared were appended)."""
        if self.rows != self.n_rows:
            self.abort()
            raise ValueError(f"{self.path}: {self.rows} rows written, {self.n_rows} declared")
        self._member.close()
        with self._zip.open("keys.npy", "w", force_zip64=True) as m:
            _npy_header(m, np.dtype("<i8"), (self.n_rows,))
            self._keys.seek(0)
            while True:
                block = self._keys.read(self._COPY_BYTES)
                if not block:
                    break
                m.write(block)
        if self.codec.precision != "fp32":
            with self._zip.open("precision.npy", "w") as m:
                np.lib.format.write_array(m, np.array(self.codec.precision))
        self._zip.close()
        self._keys.close()
        os.unlink(self._keys_tmp)
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Close and remove the partial files."""
        for f in (self._member, self._zip, self._keys):
            try:
                f.close()
            except (OSError, ValueError):  # a member left open makes the zip refuse
                pass
        for p in (self._tmp, self._keys_tmp):
            if os.path.exists(p):
                os.unlink(p)

    def __enter__(self) -> NpzRowsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _npy_header(f, dtype: np.dtype, shape: Tuple[int, ...]) -> None:
    """The ``.npy`` header of a C-ordered array (numpy's format, version 1.0)."""
    header = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
        "fortran_order": False,
        "shape": tuple(int(s) for s in shape),
    }
    np.lib.format.write_array_header_1_0(f, header)
