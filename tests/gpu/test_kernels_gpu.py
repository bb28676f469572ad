"""The device cache's kernels on a real GPU, held bit for bit to the numpy reference
(ArrayEmbeddingCache with numpy) on the random and adversarial operation sequences the CPU
twin runs in tests/unit/test_gpu_kernels.py, plus a large batch (many blocks: the clock
and the aging advance once per launch) and the public API of the CuPy cache."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_gpu_kernels import CASES
from tests.xcache_harness import (
    MODES,
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


def test_one_launch_looks_up_caches_and_whole_tables_as_each_alone(cupy):
    # A request's tables in one trec_lookup_tables launch: two caches (each policy and
    # precision), a table without keys, a static and a uvm table; each answers what it
    # answers alone (the numpy reference for the caches, whose state, ticks and sketch
    # included, must end the same), the empty one is left alone.
    from triton_rec import _native
    from triton_rec.gpu.kernels import load_kernels
    from triton_rec.precision import RowCodec

    rng = np.random.default_rng(11)
    pairs = [_pair(cupy, 4096, 16, 8, "lru", "fp32"), _pair(cupy, 2048, 8, 4, "tinylfu", "fp16")]
    asked = []
    for ref, dev in pairs:
        held = rng.integers(0, 50_000, 3_000).astype(np.int64)
        ref.insert(held, rows_for(ref, held))
        dev.insert(held, rows_for(ref, held))
        asked.append(np.concatenate([rng.choice(held, 700), rng.integers(60_000, 90_000, 300)]))
    whole = []
    for mode in ("static", "uvm"):
        keys = rng.choice(np.arange(10**6), 5_000, replace=False).astype(np.int64)
        codec = RowCodec("fp16", 5)
        rows = codec.encode(rng.standard_normal((keys.size, 5)).astype(np.float32))
        index = _native.build_index(keys)
        table = _native.DeviceTable(load_kernels(0), index, rows, codec.code, 5, -1.5, mode)
        ask = np.concatenate([rng.choice(keys, 900), np.arange(2 * 10**6, 2 * 10**6 + 100)])
        want = np.empty((ask.size, 5), np.float32)
        _native.lookup(index, rows, ask, want, -1.5, precision=codec.code)
        whole.append((table, ask, want))
    empty_ref, empty_dev = _pair(cupy, 1024, 4, 4, "lru", "fp32")
    tables = [pairs[0][1]._gpu, empty_dev._gpu, pairs[1][1]._gpu, whole[0][0], whole[1][0]]
    keys = [asked[0], np.empty(0, np.int64), asked[1], whole[0][1], whole[1][1]]
    dims = [16, 4, 8, 5, 5]
    outs = [np.full((k.size, d), np.nan, np.float32) for k, d in zip(keys, dims)]
    statuses = [np.full(k.size, 9, np.uint8) for k in keys]
    _native.gpu_lookup_tables(tables, keys, outs, statuses)
    for (ref, dev), i, ask in zip(pairs, (0, 2), asked):
        vec, hit = ref.query(ask)
        assert np.array_equal(statuses[i], hit.astype(np.uint8))
        assert np.array_equal(outs[i].view(np.uint32), vec.view(np.uint32))
        state = {n: a.get() for n, a in dev.state_arrays().items()}
        for name, a in ref.state_arrays().items():
            assert np.array_equal(state[name], a), name
    for (_table, ask, want), i in zip(whole, (3, 4)):
        assert np.array_equal(outs[i].view(np.uint32), want.view(np.uint32))
        assert np.array_equal(statuses[i], (np.arange(ask.size) < 900).astype(np.uint8))
    empty_state = {n: a.get() for n, a in empty_dev.state_arrays().items()}
    for name, a in empty_ref.state_arrays().items():
        assert np.array_equal(empty_state[name], a), name
