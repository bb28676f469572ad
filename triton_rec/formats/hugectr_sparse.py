"""HugeCTR sparse model directories (one per embedding table).

Layout (HugeCTR / HPS, see docs/upstream-notes.md):

- ``key``: N little-endian int64 values, no header, any order;
- ``emb_vector``: N x vec_size little-endian float32 values, row i belongs to key i;
  vec_size is not stored, it comes from ps.json (``embedding_vecsize_per_table``);
- ``slot_id`` (N x uint64, localized embeddings) and ``meta`` may exist and are ignored.

Reading memory-maps the files read-only (no copy); validation only looks at sizes.
Writing: :func:`write_sparse_dir` (arrays in memory) or :class:`SparseDirWriter` (chunk by
chunk, for tables larger than memory).
Key uniqueness is checked when the hash index is built.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np

from triton_rec.config.model_files import open_model_file
from triton_rec.errors import ModelFileError

KEY_FILE = "key"
VECTOR_FILE = "emb_vector"
_KEY_DTYPE = np.dtype("<i8")
_VEC_DTYPE = np.dtype("<f4")


def _map(f, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(f, dtype=dtype, mode="r", shape=(count,))


def _sparse_files(path: str, vec_size: int) -> Tuple[str, str]:
    """The key and vector files of a sparse directory, checked to exist (ModelFileError)."""
    if vec_size < 1:
        raise ModelFileError(path, f"vector size must be >= 1, got {vec_size}")
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise ModelFileError(path, f"sparse model directory {what}")
    key_path = os.path.join(path, KEY_FILE)
    vec_path = os.path.join(path, VECTOR_FILE)
    for p in (key_path, vec_path):
        if not os.path.lexists(p):
            raise ModelFileError(p, "missing file of the sparse model")
    return key_path, vec_path


def read_sparse_dir(path: str, vec_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Map a HugeCTR sparse directory read-only.

    Args:
        path: the ``*.model`` directory.
        vec_size: floats per vector (from ps.json).

    Returns:
        ``(keys, vectors)``: int64 ``[N]`` and float32 ``[N, vec_size]`` read-only arrays.

    Raises:
        ModelFileError: naming the directory or file that is missing or whose size is wrong.
    """
    key_path, vec_path = _sparse_files(path, vec_size)
    # Opened once, regular files inside the allowed roots; sizes and maps from these.
    key_fd, key_st = open_model_file(key_path, "sparse key file")
    with os.fdopen(key_fd, "rb") as key_f:
        vec_fd, vec_st = open_model_file(vec_path, "sparse vector file")
        with os.fdopen(vec_fd, "rb") as vec_f:
            return _map_sparse(
                path, vec_size, key_path, key_f, key_st.st_size, vec_path, vec_f, vec_st.st_size
            )


def sparse_dir_rows(path: str, vec_size: int) -> int:
    """The rows of a HugeCTR sparse directory, from its files' sizes alone (their data is
    never read; a file created sparse counts at its apparent size): the checks of
    :func:`read_sparse_dir`, which maps exactly this many rows.

    Raises:
        ModelFileError: as :func:`read_sparse_dir`.
    """
    key_path, vec_path = _sparse_files(path, vec_size)
    sizes = []
    for p, what in ((key_path, "sparse key file"), (vec_path, "sparse vector file")):
        fd, st = open_model_file(p, what)
        os.close(fd)
        sizes.append(st.st_size)
    return _sparse_rows(path, vec_size, key_path, sizes[0], vec_path, sizes[1])


def _sparse_rows(
    path: str, vec_size: int, key_path: str, key_bytes: int, vec_path: str, vec_bytes: int
) -> int:
    """The rows that files of these sizes hold (ModelFileError when they disagree)."""
    if key_bytes % _KEY_DTYPE.itemsize:
        raise ModelFileError(
            key_path, f"size {key_bytes} bytes is not a multiple of 8 (int64 keys): truncated?"
        )
    row_bytes = _VEC_DTYPE.itemsize * vec_size
    if vec_bytes % row_bytes:
        raise ModelFileError(
            vec_path,
            f"size {vec_bytes} bytes is not a multiple of 4*vec_size = {row_bytes} "
            f"(vec_size {vec_size} from the config): truncated or wrong vec_size?",
        )
    n_keys = key_bytes // _KEY_DTYPE.itemsize
    n_rows = vec_bytes // row_bytes
    if n_keys != n_rows:
        raise ModelFileError(
            path,
            f"'{KEY_FILE}' holds {n_keys} keys but '{VECTOR_FILE}' holds {n_rows} vectors "
            f"of size {vec_size}",
        )
    return n_rows


def _map_sparse(path, vec_size, key_path, key_f, key_bytes, vec_path, vec_f, vec_bytes):
    n_rows = _sparse_rows(path, vec_size, key_path, key_bytes, vec_path, vec_bytes)
    keys = _map(key_f, _KEY_DTYPE, n_rows)
    vectors = _map(vec_f, _VEC_DTYPE, n_rows * vec_size).reshape(n_rows, vec_size)
    return keys, vectors


def write_sparse_dir(path: str, keys: np.ndarray, vectors: np.ndarray) -> None:
    """Write ``keys`` / ``emb_vector`` in HugeCTR's layout (creates the directory)."""
    keys = np.ascontiguousarray(keys, dtype=_KEY_DTYPE)
    vectors = np.ascontiguousarray(vectors, dtype=_VEC_DTYPE)
    if vectors.ndim != 2 or vectors.shape[0] != keys.shape[0]:
        raise ValueError(f"vectors shape {vectors.shape} does not match {keys.shape[0]} keys")
    os.makedirs(path, exist_ok=True)
    keys.tofile(os.path.join(path, KEY_FILE))
    vectors.tofile(os.path.join(path, VECTOR_FILE))


class SparseDirWriter:
    """Write a HugeCTR sparse directory chunk by chunk (a table larger than memory).

    ``append(keys, vectors)`` as often as needed, then ``close()``; or use it as a
    context manager (an exception inside removes what was written). The two files are
    written under temporary names and renamed when closed, so a directory never holds a
    half-written table under the names :func:`read_sparse_dir` reads.

    Args:
        path: the ``*.model`` directory (created).
        vec_size: floats per vector.
        rows: if given, ``close()`` checks that exactly this many rows were appended.
    """

    def __init__(self, path: str, vec_size: int, rows: Optional[int] = None):
        if vec_size < 1:
            raise ValueError(f"vec_size must be >= 1, got {vec_size}")
        self.path, self.vec_size, self.expected_rows = path, int(vec_size), rows
        self.rows = 0
        self._created = not os.path.isdir(path)
        os.makedirs(path, exist_ok=True)
        self._names = [os.path.join(path, n) for n in (KEY_FILE, VECTOR_FILE)]
        self._files = [open(n + ".partial", "wb") for n in self._names]

    def append(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Append rows: int64 ``keys [n]`` and float32 ``vectors [n, vec_size]``."""
        keys = np.ascontiguousarray(keys, dtype=_KEY_DTYPE)
        vectors = np.ascontiguousarray(vectors, dtype=_VEC_DTYPE)
        if keys.ndim != 1 or vectors.shape != (keys.shape[0], self.vec_size):
            raise ValueError(
                f"{self.path}: vectors {list(vectors.shape)} do not match {keys.shape[0]} keys "
                f"of vec_size {self.vec_size}"
            )
        self._files[0].write(keys.tobytes())
        self._files[1].write(vectors.tobytes())
        self.rows += int(keys.shape[0])

    def close(self) -> None:
        """Finish the files and give them their names (ValueError on a short table)."""
        for f in self._files:
            f.close()
        if self.expected_rows is not None and self.rows != self.expected_rows:
            self.abort()
            raise ValueError(
                f"{self.path}: {self.rows} rows written, {self.expected_rows} expected"
            )
        for n in self._names:
            os.replace(n + ".partial", n)

    def abort(self) -> None:
        """Close and remove the partial files (and the directory, if created and empty)."""
        for f, n in zip(self._files, self._names):
            f.close()
            if os.path.exists(n + ".partial"):
                os.unlink(n + ".partial")
        if self._created and not os.listdir(self.path):
            os.rmdir(self.path)

    def __enter__(self) -> SparseDirWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
