"""An embedding table in memory: keys, vectors and the native hash index over the keys."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.errors import DuplicateKeyError


class EmbeddingTable:
    """Read-only table answering batched key lookups with the fused native kernel.

    Args:
        name: table name, used in messages.
        keys: int64 ``[N]`` unique keys (may be a read-only memmap).
        vectors: float32 ``[N, D]`` rows; row i belongs to ``keys[i]`` (may be a memmap).
        default_value: value of every element returned for an unknown key.
        path: where the table came from, for error messages.

    Raises:
        DuplicateKeyError: a key appears twice (the message names the file, key and rows).

    Thread-safety: :meth:`lookup` may be called from several threads at once; the
    table is never modified after construction.
    """

    def __init__(
        self,
        name: str,
        keys: np.ndarray,
        vectors: np.ndarray,
        default_value: float = 0.0,
        path: Optional[str] = None,
    ):
        self.name = name
        self.path = path or f"<table {name}>"
        self.keys = keys
        self.vectors = vectors
        self.default_value = float(default_value)
        try:
            self.index = _native.build_index(keys)
        except ValueError as e:
            if "duplicate" in str(e):
                raise DuplicateKeyError(self.path, str(e)) from e
            raise

    @property
    def num_rows(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def vec_size(self) -> int:
        return int(self.vectors.shape[1])

    def lookup(self, keys: np.ndarray, out: Optional[np.ndarray] = None) -> Tuple[np.ndarray, int]:
        """Gather the vectors of ``keys`` (int64 ``[M]``) into ``out`` (float32 ``[M, D]``).

        Unknown keys get ``default_value`` in every element. Returns ``(out, misses)``.
        """
        if out is None:
            out = np.empty((keys.shape[0], self.vec_size), dtype=np.float32)
        misses = _native.lookup(self.index, self.vectors, keys, out, self.default_value)
        return out, int(misses)

    def __repr__(self) -> str:
        return f"EmbeddingTable({self.name!r}, rows={self.num_rows}, vec_size={self.vec_size})"
