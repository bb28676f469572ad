"""The device cache's per-set locks in the write kernel itself (``trec_cache_write``): the
scenarios tests/unit/test_set_locks.py runs on the kernel's CPU twin, on a device cache."""

from __future__ import annotations

from tests.unit.test_set_locks import VEC, after_a_dead_writer, beside_a_live_writer
from triton_rec.cache.array_cache import ArrayEmbeddingCache


def _device_cache(cupy):
    return lambda lock: ArrayEmbeddingCache(64 * 8, VEC, ways=8, lock=lock, xp=cupy)


def test_a_kernel_write_goes_beside_a_live_writer_and_waits_only_for_its_set(cupy, tmp_path):
    import os

    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        beside_a_live_writer(_device_cache(cupy), fd)
    finally:
        os.close(fd)


def test_a_set_a_dead_writer_left_is_healed_by_the_next_kernel_write(cupy, tmp_path):
    import os

    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        after_a_dead_writer(_device_cache(cupy), fd)
    finally:
        os.close(fd)
