"""What an embedding cache sits in front of: the backing-store interface.

An embedding cache answers what it holds and asks a :class:`BackingStore` for the
rest. The node-local table (:class:`LocalTableStore`) is the first implementation;
the storage tiers of later milestones (Redis Cluster, RocksDB) implement the same
four methods and plug in under the cache unchanged.
"""

from __future__ import annotations

import abc
from typing import Optional

import numpy as np

from triton_rec import _native
from triton_rec.table import EmbeddingTable


class BackingStore(abc.ABC):
    """A source of truth for one embedding table.

    Implementations state their thread-safety; all of them must allow concurrent
    :meth:`fetch` calls.
    """

    #: floats per vector
    vec_size: int
    #: value of every element of a vector whose key the store does not hold
    default_value: float
    #: short name used in metrics labels ("local", "redis", "rocksdb", ...)
    tier: str

    @abc.abstractmethod
    def fetch(self, keys: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Write the vectors of ``keys`` (int64 ``[M]``) into ``out`` (float32 ``[M, D]``).

        Keys the store does not hold get ``default_value`` in every element.
        Returns a bool ``[M]`` mask of the keys that were found.
        """

    @abc.abstractmethod
    def num_rows(self) -> int:
        """Rows the store holds (may be an estimate for remote stores)."""

    @abc.abstractmethod
    def sample_keys(self, n: int) -> np.ndarray:
        """Up to ``n`` keys the store holds, for cache warm-up (``init_ec``)."""

    def close(self) -> None:  # pragma: no cover - trivial default
        """Release connections/mappings."""


class LocalTableStore(BackingStore):
    """A node-local :class:`EmbeddingTable` (memory-mapped, shared by all instances).

    Thread-safety: every method may be called from any number of threads.
    """

    tier = "local"

    def __init__(self, table: EmbeddingTable):
        self.table = table
        self.vec_size = table.vec_size
        self.default_value = table.default_value

    def fetch(self, keys: np.ndarray, out: np.ndarray, missing: Optional[np.ndarray] = None) -> np.ndarray:
        missing = np.empty(keys.shape[0], dtype=np.uint8) if missing is None else missing
        t = self.table
        _native.lookup(t.index, t.vectors, keys, out, t.default_value, missing=missing)
        return missing == 0

    def num_rows(self) -> int:
        return self.table.num_rows

    def sample_keys(self, n: int) -> np.ndarray:
        return np.asarray(self.table.keys[: max(0, min(n, self.table.num_rows))])
