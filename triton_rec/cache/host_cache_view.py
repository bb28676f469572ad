"""An :class:`~triton_rec.cache.array_cache.ArrayEmbeddingCache` behind the numpy interface
of the CPU cache (the ``EmbeddingCache`` protocol of :mod:`triton_rec.cache.cached_table`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional

import numpy as np

from triton_rec import _native
from triton_rec.cache.array_cache_state import host_array
from triton_rec.cache.device_plans import DevicePlacement

if TYPE_CHECKING:
    from triton_rec.cache.array_cache import ArrayEmbeddingCache


class HostCacheView:
    """The cache behind the ``EmbeddingCache`` protocol of :mod:`triton_rec.cache.cached_table`
    (the interface of the CPU cache, :class:`triton_rec.cache.shm_cache.SharedEmbeddingCache`):
    numpy in, numpy out; with CuPy, keys and vectors are copied to and from the device."""

    def __init__(self, cache: ArrayEmbeddingCache):
        self.cache = cache
        self.vec_size = cache.vec_size
        self.codec = cache.codec
        self.capacity = cache.capacity
        self.policy = cache.policy

    def query(self, keys: np.ndarray, out: np.ndarray, hit_mask: np.ndarray) -> int:
        """``out[i]`` = vector of ``keys[i]`` where ``hit_mask[i]`` is set (other rows
        unspecified: the device cache writes zeros); returns the hits. On a GPU one kernel
        launch, keys in and answers out through pinned staging
        (:meth:`ArrayEmbeddingCache.query_host`)."""
        if self.cache._gpu is not None:
            status = hit_mask if hit_mask.dtype == np.uint8 else np.empty(len(keys), np.uint8)
            hits = self.cache.query_host(keys, out, status)
            if status is not hit_mask:
                hit_mask[:] = status
            return hits
        vec, hit = self.cache.query(keys)
        hit = host_array(hit)
        idx = np.flatnonzero(hit)
        out[idx] = host_array(vec)[idx]
        hit_mask[:] = hit
        return int(idx.shape[0])

    def device_plan(self) -> Optional[DevicePlacement]:
        """What the native backend's GPU path reads this cache with (its device and
        ``device_cache``: :meth:`ArrayEmbeddingCache.native_plan`), or None for a cache in
        host memory."""
        device = self.cache._device_id
        if self.cache._gpu is None or device is None:
            return None
        return DevicePlacement(device, device_cache=self.cache.native_plan())

    def miss_cache(self) -> Optional[_native.MissCache]:
        """The wrapped cache as the native miss path inserts into it
        (:meth:`ArrayEmbeddingCache.miss_cache`)."""
        return self.cache.miss_cache()

    def insert(self, keys: np.ndarray, vectors: np.ndarray) -> Dict[str, int]:
        """Insert rows into the wrapped cache; returns its insert counters."""
        return self.cache.insert(keys, vectors)

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Overwrite the vectors of keys already cached; returns how many were updated."""
        return self.cache.update(keys, vectors)

    def erase(self, keys: np.ndarray) -> int:
        """Remove ``keys`` from the wrapped cache; returns how many were removed."""
        return self.cache.erase(keys)

    def clear(self) -> None:
        """Empty the wrapped cache."""
        self.cache.clear()

    def keys(self) -> np.ndarray:
        """The cached keys, as a host (numpy) array."""
        return host_array(self.cache.cached_keys())

    def size(self) -> int:
        """Number of keys currently cached."""
        return self.cache.size()

    def stats(self) -> Dict[str, int]:
        """The wrapped cache's counters."""
        return self.cache.stats()

    def hit_rate(self) -> float:
        """The wrapped cache's hit rate."""
        return self.cache.hit_rate()
