"""The device cache's kernels on a real GPU, held bit for bit to the numpy reference
(ArrayEmbeddingCache with numpy) on the random and adversarial operation sequences the CPU
twin runs in tests/unit/test_gpu_kernels.py, plus a large batch (many blocks: the clock
and the aging advance once per launch) and the public API of the CuPy cache."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_gpu_kernels import CASES
from tests.xcache_harness import (
    MANY_TABLES,
    MODES,
    ONE_LAUNCH,
    check_one_launch,
    keys_in_set,
    operations,
    rows_for,
    run_against_reference,
)
from triton_rec.cache.array_cache import ArrayEmbeddingCache


class KernelCache:
    """The kernels, through _native.DeviceCache, on a CuPy cache's state arrays."""

    def __init__(self, cache: ArrayEmbeddingCache):
        self.cache = cache
        self.gpu = cache._gpu
        assert self.gpu is not None

    def query(self, keys):
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        out = np.empty((keys.shape[0], self.cache.vec_size), np.float32)
        status = np.empty(keys.shape[0], np.uint8)
        self.gpu.query(keys, out, status)
        return out, status

    def write(self, mode, keys, rows=None):
        import triton_rec._native as nat

        counts = self.gpu.write(MODES[mode], np.ascontiguousarray(keys, np.int64), rows)
        return dict(zip(nat.ARRAY_CACHE_WRITE_COUNTS, counts))

    def clear(self):
        self.gpu.clear()

    def repair(self):
        return int(self.gpu.repair())

    def state(self):
        return {n: a.get() for n, a in self.cache.state_arrays().items()}


def _pair(cupy, capacity, vec, ways, policy, precision):
    ref = ArrayEmbeddingCache(capacity, vec, ways=ways, policy=policy, precision=precision)
    dev = ArrayEmbeddingCache(
        capacity, vec, ways=ways, policy=policy, precision=precision, xp="cupy"
    )
    return ref, dev


@pytest.mark.parametrize("capacity,vec,ways,policy,precision,seed", CASES)
def test_the_kernels_agree_with_the_numpy_reference(
    cupy, capacity, vec, ways, policy, precision, seed
):
    ref, dev = _pair(cupy, capacity, vec, ways, policy, precision)
    k = KernelCache(dev)

    def make_odd(sets):
        dev.seq[cupy.asarray(sets)] |= 1
        cupy.cuda.Device().synchronize()  # CuPy's stream: done before the kernels' streams run

    seen = run_against_reference(ref, k, k.state, operations(ref, seed, 120), make_odd)
    assert seen["hits"] > 0 and seen["inserted"] > 0 and seen["evicted"] + seen["overflow"] > 0


@pytest.mark.parametrize("policy", ["lru", "tinylfu"])
def test_a_large_batch_spans_many_blocks_and_still_ticks_once(cupy, policy):
    ref, dev = _pair(cupy, 200_000, 64, 8, policy, "fp32")
    k = KernelCache(dev)
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 400_000, 150_000).astype(np.int64)
    ops = [("insert", (keys, rows_for(ref, keys)))]
    ops += [("query", (rng.integers(0, 400_000, 212_992).astype(np.int64),))] * 12
    ops += [("insert", (keys[::-1].copy(), rows_for(ref, keys[::-1], 7)))]
    seen = run_against_reference(ref, k, k.state, ops, lambda s: None)
    assert seen["hits"] > 100_000
    if policy == "tinylfu":
        assert ref.stats()["sketch_agings"] >= 1


def test_the_cupy_cache_public_api_matches_numpy(cupy):
    ref, dev = _pair(cupy, 64, 8, 4, "lru", "fp16")
    crowd = keys_in_set(ref, 1, 6)
    assert dev.insert(crowd, rows_for(ref, crowd)) == ref.insert(crowd, rows_for(ref, crowd))
    vec_r, hit_r = ref.query(crowd)
    vec_d, hit_d = dev.query(cupy.asarray(crowd))
    assert np.array_equal(vec_r, vec_d.get()) and np.array_equal(hit_r, hit_d.get())
    out = np.empty((6, 8), np.float32)
    status = np.empty(6, np.uint8)
    assert dev.query_host(crowd, out, status) == int(hit_r.sum())
    assert np.array_equal(out[hit_r], vec_r[hit_r])
    assert dev.erase(crowd[:2]) == ref.erase(crowd[:2])
    assert dev.update(crowd, rows_for(ref, crowd, 3)) == ref.update(crowd, rows_for(ref, crowd, 3))
    assert dev.stats()["inserts"] == ref.stats()["inserts"]
    assert dev.size() == ref.size()


@pytest.mark.parametrize("layout", ["one launch", "many tables"])
def test_one_launch_looks_up_caches_and_whole_tables_as_each_alone(cupy, layout):
    # A request's tables in trec_lookup_tables (the twin's cases in
    # tests/unit/test_gpu_kernels.py, on the device): caches of each policy and precision,
    # one without keys, static and uvm tables; then 70 tables, more than one launch serves
    from triton_rec import _native
    from triton_rec.gpu.kernels import load_kernels

    def make_cache(ref):
        dev = ArrayEmbeddingCache(
            ref.capacity, ref.vec_size, ways=ref.ways, policy=ref.policy,
            precision=ref.codec.precision, xp="cupy",
        )  # fmt: skip
        for name, a in dev.state_arrays().items():
            a[...] = cupy.asarray(ref.state_arrays()[name])
        cupy.cuda.Device().synchronize()
        return dev._gpu, lambda: {n: a.get() for n, a in dev.state_arrays().items()}

    def make_table(index, rows, code, dim, default, mode):
        return _native.DeviceTable(load_kernels(0), index, rows, code, dim, default, mode)

    tables = ONE_LAUNCH if layout == "one launch" else MANY_TABLES
    check_one_launch(make_cache, make_table, _native.gpu_lookup_tables, layout=tables)
