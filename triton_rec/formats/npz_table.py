"""numpy ``.npz`` embedding tables: arrays ``keys`` (int64 [N]) and ``vectors`` (float32 [N, D]).

Other dtypes are rejected rather than cast, so a table never changes silently.
"""

from __future__ import annotations

import os
import zipfile
from typing import Tuple

import numpy as np

from triton_rec.config.model_files import open_model_file
from triton_rec.errors import ModelFileError


def read_npz_table(path: str, vec_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Load an ``.npz`` table and check it against ``vec_size``.

    Raises:
        ModelFileError: missing file, not an npz, missing array, wrong dtype or shape.
    """
    if not os.path.lexists(path):
        raise ModelFileError(path, "npz table file does not exist")
    fd, _ = open_model_file(path, "npz table file")  # regular, inside the allowed roots
    try:
        with os.fdopen(fd, "rb") as f, np.load(f, allow_pickle=False) as z:
            for name in ("keys", "vectors"):
                if name not in z.files:
                    raise ModelFileError(path, f"has no array '{name}' (found: {z.files})")
            keys, vectors = z["keys"], z["vectors"]
    except ModelFileError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise ModelFileError(path, f"not a readable .npz file ({e})") from e
    if keys.dtype != np.int64 or keys.ndim != 1:
        raise ModelFileError(path, f"'keys' must be 1-D int64, got {keys.dtype} {keys.shape}")
    if vectors.dtype != np.float32 or vectors.ndim != 2:
        raise ModelFileError(
            path, f"'vectors' must be 2-D float32, got {vectors.dtype} {vectors.shape}"
        )
    if vectors.shape[1] != vec_size:
        raise ModelFileError(
            path,
            f"'vectors' has {vectors.shape[1]} columns but the config says vec_size {vec_size}",
        )
    if vectors.shape[0] != keys.shape[0]:
        raise ModelFileError(
            path, f"'keys' holds {keys.shape[0]} keys but 'vectors' holds {vectors.shape[0]} rows"
        )
    return np.ascontiguousarray(keys), np.ascontiguousarray(vectors)


def write_npz_table(path: str, keys: np.ndarray, vectors: np.ndarray) -> None:
    """Write a table in the ``.npz`` layout read by :func:`read_npz_table`."""
    np.savez(path, keys=np.asarray(keys, np.int64), vectors=np.asarray(vectors, np.float32))
