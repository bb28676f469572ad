"""The device cache's per-set locks in the write kernel itself (``trec_cache_write``): the
scenarios tests/unit/test_set_locks.py runs on the kernel's CPU twin, on a device cache."""

from __future__ import annotations

from tests.unit.test_set_locks import (
    VEC,
    after_a_dead_writer,
    beside_a_live_writer,
    lock_file,  # noqa: F401 - the fixture
)
from triton_rec.cache.array_cache import ArrayEmbeddingCache


def test_a_kernel_write_goes_beside_a_live_writer_and_waits_only_for_its_set(cupy, lock_file):  # noqa: F811
    beside_a_live_writer(lambda lock: ArrayEmbeddingCache(512, VEC, lock=lock, xp=cupy), lock_file)


def test_a_set_a_dead_writer_left_is_healed_by_the_next_kernel_write(cupy, lock_file):  # noqa: F811
    after_a_dead_writer(lambda lock: ArrayEmbeddingCache(512, VEC, lock=lock, xp=cupy), lock_file)
