"""triton_rec.cache.shm_cache / _native.ShmCacheView: the node-wide shared-memory embedding cache.

Checked against an independent brute-force model of a set-associative LRU cache (a
Python OrderedDict per set, set = high bits of splitmix64 re-implemented in numpy), with
vectors derived from their key so that a torn or mixed vector is always detected, and
with real processes: concurrent readers/writers, writers SIGKILLed mid-write, processes
racing to create the same segment, stale segments.

Worker processes run this file as a script (``python test_shm_cache.py <mode> ...``).
Every wait on another process is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import OrderedDict

import numpy as np
import pytest

from triton_rec import _native
from triton_rec.cache.shm_cache import SharedEmbeddingCache, segment_path
from triton_rec.errors import CacheConfigMismatchError, CacheError, ConfigError
from triton_rec.precision import PRECISIONS, RowCodec

SHM = "/dev/shm"
RUN_PREFIX = f"pytest-{uuid.uuid4().hex[:8]}"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
I64 = np.iinfo(np.int64)


def vec_of(keys, d: int) -> np.ndarray:
    """The one true vector of a key: v[j] = key * 1e-3 + j (keys < 2**20 stay exact)."""
    keys = np.asarray(keys, dtype=np.int64)
    return (keys.astype(np.float64)[:, None] * 1e-3 + np.arange(d)).astype(np.float32)


def splitmix64(keys: np.ndarray) -> np.ndarray:
    z = np.asarray(keys, dtype=np.int64).view(np.uint64).copy()
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def ref_set_of(keys, num_sets: int) -> np.ndarray:
    """Documented set function: high log2(num_sets) bits of splitmix64(key)."""
    if num_sets == 1:
        return np.zeros(len(keys), dtype=np.int64)
    bits = num_sets.bit_length() - 1
    return (splitmix64(keys) >> np.uint64(64 - bits)).astype(np.int64)


class RefLRU:
    """Brute-force set-associative LRU cache: one OrderedDict (oldest first) per set."""

    def __init__(self, num_sets: int, ways: int):
        self.num_sets, self.ways = num_sets, ways
        self.sets = [OrderedDict() for _ in range(num_sets)]

    def _set(self, key):
        return self.sets[int(ref_set_of(np.array([key]), self.num_sets)[0])]

    def query(self, keys):
        hits, vecs = [], []
        for k in keys.tolist():
            s = self._set(k)
            if k in s:
                s.move_to_end(k)
                hits.append(True)
                vecs.append(s[k])
            else:
                hits.append(False)
                vecs.append(None)
        return np.array(hits, dtype=bool), vecs

    def insert(self, keys, vectors):
        inserted = evicted = 0
        for k, v in zip(keys.tolist(), vectors):
            s = self._set(k)
            if k in s:
                s[k] = v.copy()
                s.move_to_end(k)
                continue
            if len(s) == self.ways:
                s.popitem(last=False)
                evicted += 1
            s[k] = v.copy()
            inserted += 1
        return inserted, evicted

    def update(self, keys, vectors):
        n = 0
        for k, v in zip(keys.tolist(), vectors):
            s = self._set(k)
            if k in s:
                s[k] = v.copy()  # recency unchanged
                n += 1
        return n

    def erase(self, keys):
        n = 0
        for k in keys.tolist():
            n += self._set(k).pop(k, None) is not None
        return n

    def keys(self):
        return {k for s in self.sets for k in s}


M64 = (1 << 64) - 1


def mix64(z: int) -> int:
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class RefTinyLFU(RefLRU):
    """RefLRU + the documented TinyLFU: 4-row count-min sketch of 4-bit saturating
    counters (width = max(64, pow2 >= 8 x capacity)), every queried key counted, all
    counters halved per 10 x capacity increments, a new key replaces the LRU victim of a
    full set only if its estimate is strictly higher."""

    def __init__(self, num_sets, ways):
        super().__init__(num_sets, ways)
        cap = num_sets * ways
        self.width = 64
        while self.width < 8 * cap:
            self.width *= 2
        self.threshold = 10 * cap
        self.counters = {}
        self.increments = 0
        self.agings = 0

    def _cells(self, key):
        h = mix64((key & M64) ^ 0xD6E8FEB86659FD93)
        return [(r, mix64(h + r * 0x9E3779B97F4A7C15) & (self.width - 1)) for r in range(4)]

    def estimate(self, key):
        return min(self.counters.get(c, 0) for c in self._cells(key))

    def query(self, keys):
        result = super().query(keys)
        for k in keys.tolist():
            for c in self._cells(k):
                self.counters[c] = min(15, self.counters.get(c, 0) + 1)
        self.increments += len(keys)
        while self.increments >= self.threshold:
            self.counters = {c: v >> 1 for c, v in self.counters.items()}
            self.increments -= self.threshold
            self.agings += 1
        return result

    def insert(self, keys, vectors):
        inserted = evicted = rejected = 0
        for k, v in zip(keys.tolist(), vectors):
            s = self._set(k)
            if k in s:
                s[k] = v.copy()
                s.move_to_end(k)
                continue
            if len(s) == self.ways:
                victim = next(iter(s))
                if self.estimate(k) <= self.estimate(victim):
                    rejected += 1
                    continue
                del s[victim]
                evicted += 1
            s[k] = v.copy()
            inserted += 1
        return inserted, evicted, rejected


# ---------------------------------------------------------------------------------------
# fixtures and process helpers


@pytest.fixture(autouse=True, scope="module")
def no_segment_left_behind():
    yield
    left = [f for f in os.listdir(SHM) if RUN_PREFIX in f]
    for f in left:
        os.unlink(os.path.join(SHM, f))
    assert not left, f"segments left in {SHM}: {left}"


@pytest.fixture
def name(request):
    return f"{RUN_PREFIX}-{request.node.name[:60]}"


def open_cache(name, capacity=64, vec_size=8, policy="lru", ways=4, **kw):
    return SharedEmbeddingCache.open(
        name, capacity=capacity, vec_size=vec_size, policy=policy, ways=ways, **kw
    )


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *map(str, args)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 60) -> dict:
    """Wait (bounded) for a worker; return its JSON report; fail on a crash or hang."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"worker {proc.args[2:]} did not finish within {timeout} s\n{err}")
    assert proc.returncode == 0, f"worker {proc.args[2:]} exited {proc.returncode}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def query(cache, keys):
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    out = np.full((len(keys), cache.vec_size), np.nan, dtype=np.float32)
    hit = np.zeros(len(keys), dtype=np.uint8)
    n = cache.query(keys, out, hit)
    assert n == int(hit.sum())
    return hit.astype(bool), out


def keys_in_set(cache, set_index, n, start=0):
    cand = np.arange(start, start + 200_000, dtype=np.int64)
    return cand[cache._view._set_of(cand) == set_index][:n]


# ---------------------------------------------------------------------------------------
# single process: behaviour against the reference model


# ways <= 8 keep their valid flags in the set header, more ways after the ticks
@pytest.mark.parametrize("num_sets,ways", [(1, 4), (4, 1), (4, 2), (16, 8), (4, 9), (2, 64)])
def test_lru_hits_misses_evictions_and_vectors_match_a_brute_force_reference(num_sets, ways):
    rng = np.random.default_rng(num_sets * 100 + ways)
    d = 5
    cap = num_sets * ways
    buf = np.zeros(_native.ShmCacheView.required_bytes(num_sets, ways, d, "lru"), np.uint8)
    cache = _native.ShmCacheView.initialize(
        buf, num_sets=num_sets, ways=ways, vec_size=d, policy="lru", checksum=7
    )
    ref = RefLRU(num_sets, ways)
    pool = np.concatenate(
        [[I64.min, -1, 0, I64.max], rng.integers(I64.min, I64.max, size=3 * cap, dtype=np.int64)]
    )
    totals = dict(lookups=0, hits=0, inserts=0, evictions=0)
    for step in range(400):
        # repeats included; half the batches longer than query's prefetch pipeline (24)
        size = rng.integers(1, 2 * ways + 3) if step % 2 else rng.integers(20, 80)
        keys = rng.choice(pool, size=int(size))
        out = np.zeros((len(keys), d), np.float32)
        hit = np.zeros(len(keys), np.uint8)
        n_hits = cache.query(keys, out, hit)
        want_hit, want_vecs = ref.query(keys)
        np.testing.assert_array_equal(hit.astype(bool), want_hit, err_msg=f"step {step}")
        for i in np.flatnonzero(want_hit):
            np.testing.assert_array_equal(out[i], want_vecs[i])
        totals["lookups"] += len(keys)
        totals["hits"] += n_hits
        op = rng.random()
        if op < 0.7:  # insert the misses (as a CachedTable does) plus some random keys
            ins = np.concatenate([keys[~want_hit], rng.choice(pool, size=int(rng.integers(0, 3)))])
            vecs = rng.standard_normal((len(ins), d)).astype(np.float32)
            got = cache.insert(ins, vecs)
            want = ref.insert(ins, vecs)
            assert got == (*want, 0), f"step {step}: insert {got} != reference {want}"
            totals["inserts"] += want[0]
            totals["evictions"] += want[1]
        elif op < 0.85:
            upd = rng.choice(pool, size=4)
            vecs = rng.standard_normal((4, d)).astype(np.float32)
            assert cache.update(upd, vecs) == ref.update(upd, vecs)
        else:
            er = rng.choice(pool, size=2)
            assert cache.erase(er) == ref.erase(er)
    assert set(cache.keys().tolist()) == ref.keys()
    assert cache.size() == len(ref.keys())
    stats = cache.stats()
    for k, v in totals.items():
        assert stats[k] == v, k
    assert stats["misses"] == totals["lookups"] - totals["hits"]


@pytest.mark.parametrize("num_sets,ways", [(1, 4), (4, 2), (16, 4), (4, 12)])
def test_tinylfu_admissions_and_aging_match_a_brute_force_reference(num_sets, ways):
    rng = np.random.default_rng(num_sets * 10 + ways)
    d = 3
    cap = num_sets * ways
    buf = np.zeros(_native.ShmCacheView.required_bytes(num_sets, ways, d, "tinylfu"), np.uint8)
    cache = _native.ShmCacheView.initialize(buf, num_sets, ways, d, "tinylfu", 0)
    ref = RefTinyLFU(num_sets, ways)
    pool = np.concatenate(
        [[I64.min, -1, 0, I64.max], rng.integers(I64.min, I64.max, size=4 * cap, dtype=np.int64)]
    )
    weights = rng.pareto(1.0, size=len(pool)) + 0.05  # skewed popularity
    weights /= weights.sum()
    rejected = 0
    for step in range(400):
        keys = rng.choice(pool, size=int(rng.integers(1, 2 * ways + 3)), p=weights)
        out = np.zeros((len(keys), d), np.float32)
        hit = np.zeros(len(keys), np.uint8)
        cache.query(keys, out, hit)
        want_hit, want_vecs = ref.query(keys)
        np.testing.assert_array_equal(hit.astype(bool), want_hit, err_msg=f"step {step}")
        for i in np.flatnonzero(want_hit):
            np.testing.assert_array_equal(out[i], want_vecs[i])
        ins = keys[~want_hit]
        vecs = rng.standard_normal((len(ins), d)).astype(np.float32)
        want = ref.insert(ins, vecs)
        assert cache.insert(ins, vecs) == want, f"step {step}"
        rejected += want[2]
    assert set(cache.keys().tolist()) == ref.keys()
    np.testing.assert_array_equal(cache._estimate(pool), [ref.estimate(int(k)) for k in pool])
    stats = cache.stats()
    assert rejected > 0 and ref.agings > 0
    assert (stats["rejected_admissions"], stats["sketch_agings"]) == (rejected, ref.agings)


def test_set_of_a_key_is_the_high_bits_of_splitmix64():
    buf = np.zeros(_native.ShmCacheView.required_bytes(64, 2, 1), np.uint8)
    cache = _native.ShmCacheView.initialize(buf, 64, 2, 1)
    keys = np.concatenate([[I64.min, -1, 0, 1, I64.max], np.arange(1000) * 7919]).astype(np.int64)
    np.testing.assert_array_equal(cache._set_of(keys), ref_set_of(keys, 64))


def test_query_returns_exactly_the_vector_of_each_key_under_heavy_eviction(name):
    with open_cache(name, capacity=32, vec_size=16, ways=4) as cache:
        rng = np.random.default_rng(3)
        seen_hits = 0
        for _ in range(300):
            keys = rng.integers(0, 500, size=40)
            hit, out = query(cache, keys)
            np.testing.assert_array_equal(out[hit], vec_of(keys[hit], 16))
            seen_hits += int(hit.sum())
            cache.insert(keys[~hit], vec_of(keys[~hit], 16))
        assert seen_hits > 0 and cache.stats()["evictions"] > 0


def test_repeated_key_in_one_insert_batch_keeps_the_last_vector():
    buf = np.zeros(_native.ShmCacheView.required_bytes(1, 4, 2), np.uint8)
    cache = _native.ShmCacheView.initialize(buf, 1, 4, 2)
    keys = np.array([5, 6, 5], np.int64)
    vecs = np.array([[1, 1], [2, 2], [3, 3]], np.float32)
    assert cache.insert(keys, vecs) == (2, 0, 0)
    assert cache.stats()["updates"] == 1
    out = np.zeros((1, 2), np.float32)
    hit = np.zeros(1, bool)
    assert cache.query(np.array([5], np.int64), out, hit) == 1
    assert out.tolist() == [[3, 3]]


def test_clear_empties_the_cache_and_keys_is_a_snapshot_of_cached_keys(name):
    with open_cache(name, capacity=64, vec_size=3) as cache:
        keys = np.arange(40, dtype=np.int64)
        cache.insert(keys, vec_of(keys, 3))
        ref = RefLRU(cache.num_sets, cache.ways)
        ref.insert(keys, vec_of(keys, 3))
        assert sorted(cache.keys().tolist()) == sorted(ref.keys())
        cache.clear()
        assert cache.size() == 0 and cache.keys().shape == (0,)
        assert not query(cache, keys)[0].any()


# ---------------------------------------------------------------------------------------
# TinyLFU


def test_tinylfu_rejects_a_one_hit_wonder_but_admits_a_hot_key_evicting_the_lru_way(name):
    with open_cache(name, capacity=4, ways=4, vec_size=4, policy="tinylfu") as cache:
        assert cache.num_sets == 1
        residents = np.array([1, 2, 3, 4], np.int64)
        assert cache.insert(residents, vec_of(residents, 4)) == (4, 0, 0)  # free ways: admitted
        for _ in range(5):
            assert query(cache, residents)[0].all()  # key 1 is now the least recently used
        wonder = np.array([100], np.int64)
        assert not query(cache, wonder)[0].any()  # seen once
        assert cache.insert(wonder, vec_of(wonder, 4)) == (0, 0, 1)
        assert sorted(cache.keys().tolist()) == [1, 2, 3, 4]
        assert cache.stats()["rejected_admissions"] == 1
        tie = np.array([300], np.int64)
        for _ in range(5):  # as frequent as the victim: the resident stays
            query(cache, tie)
        assert cache.insert(tie, vec_of(tie, 4)) == (0, 0, 1)
        hot = np.array([200], np.int64)
        for _ in range(8):
            query(cache, hot)
        assert cache.insert(hot, vec_of(hot, 4)) == (1, 1, 0)
        assert sorted(cache.keys().tolist()) == [2, 3, 4, 200]
        hit, out = query(cache, hot)
        assert hit.all() and np.array_equal(out, vec_of(hot, 4))


def test_lru_policy_admits_the_same_one_hit_wonder(name):
    with open_cache(name, capacity=4, ways=4, vec_size=4, policy="lru") as cache:
        residents = np.array([1, 2, 3, 4], np.int64)
        cache.insert(residents, vec_of(residents, 4))
        for _ in range(5):
            query(cache, residents)
        assert cache.insert(np.array([100], np.int64), vec_of([100], 4)) == (1, 1, 0)
        assert sorted(cache.keys().tolist()) == [2, 3, 4, 100]


def test_tinylfu_counters_saturate_at_15_and_halve_after_10x_capacity_increments(name):
    with open_cache(name, capacity=4, ways=4, vec_size=1, policy="tinylfu") as cache:
        key = np.array([7], np.int64)
        for _ in range(20):  # 20 increments
            query(cache, key)
        assert cache._view._estimate(key).tolist() == [15]
        assert cache.stats()["sketch_agings"] == 0
        query(cache, np.arange(1000, 1019, dtype=np.int64))  # 39 increments: not yet
        assert cache.stats()["sketch_agings"] == 0
        query(cache, np.array([1019], np.int64))  # 40 = 10 x capacity: halve
        assert cache.stats()["sketch_agings"] == 1
        assert cache._view._estimate(key).tolist() == [7]


# ---------------------------------------------------------------------------------------
# native argument checks and region validation


def make_view(num_sets=4, ways=2, d=3, policy="lru"):
    buf = np.zeros(_native.ShmCacheView.required_bytes(num_sets, ways, d, policy), np.uint8)
    return buf, _native.ShmCacheView.initialize(buf, num_sets, ways, d, policy, 1)


def test_bad_arguments_are_rejected_with_messages_naming_the_argument():
    buf, v = make_view()
    k = np.arange(3, dtype=np.int64)
    out = np.zeros((3, 3), np.float32)
    hit = np.zeros(3, np.uint8)
    with pytest.raises(TypeError, match="keys must be int64"):
        v.query(k.astype(np.int32), out, hit)
    with pytest.raises(ValueError, match=r"out has shape \(3, 4\), expected \(3, 3\)"):
        v.query(k, np.zeros((3, 4), np.float32), hit)
    with pytest.raises(TypeError, match="hit_mask must be uint8 or bool"):
        v.query(k, out, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="out must be writable"):
        ro = out.copy()
        ro.flags.writeable = False
        v.query(k, ro, hit)
    with pytest.raises(TypeError, match="vectors must be float32"):
        v.insert(k, out.astype(np.float64))
    with pytest.raises(ValueError, match="vectors must be float32 C-contiguous"):
        v.insert(k, np.zeros((3, 6), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="keys must be 1-D"):
        v.erase(k.reshape(3, 1))
    with pytest.raises(ValueError, match="must not overlap the cache region"):
        v.insert(k[:1], buf[4096 : 4096 + 12].view(np.float32).reshape(1, 3))
    with pytest.raises(ValueError, match="num_sets must be a power of two"):
        _native.ShmCacheView.required_bytes(3, 2, 3, "lru")
    with pytest.raises(ValueError, match="policy must be 'lru' or 'tinylfu'"):
        _native.ShmCacheView.required_bytes(4, 2, 3, "fifo")
    with pytest.raises(ValueError, match="ways must be in"):
        _native.ShmCacheView.required_bytes(4, 65, 3, "lru")
    assert "policy=lru capacity=8 (4 sets x 2 ways) vec_size=3" in repr(v)


def test_attach_validates_the_region():
    buf, v = make_view(8, 2, 4, "tinylfu")
    w = _native.ShmCacheView.attach(buf)
    assert (w.capacity, w.vec_size, w.policy, w.checksum) == (16, 4, "tinylfu", 1)
    with pytest.raises(_native.ShmCacheError, match="bad magic"):
        _native.ShmCacheView.attach(np.zeros(len(buf), np.uint8))
    with pytest.raises(_native.ShmCacheError, match="truncated"):
        _native.ShmCacheView.attach(buf[: len(buf) - 64])
    with pytest.raises(ValueError, match="has 100 bytes, needs"):
        _native.ShmCacheView.initialize(np.zeros(100, np.uint8), 4, 2, 3)
    with pytest.raises(TypeError, match="writable"):
        _native.ShmCacheView.attach(bytes(len(buf)))
    half = buf.copy()
    off = _native.SHM_CACHE_INITIALIZED_OFFSET
    half[off : off + 4] = 0  # the 'initialized' flag cleared: a creator died formatting
    with pytest.raises(_native.ShmCacheError, match="not initialized"):
        _native.ShmCacheView.attach(half)
    v.release()
    with pytest.raises(ValueError, match="released"):
        v.size()


def test_capacity_is_rounded_up_to_a_power_of_two_number_of_sets(name):
    with open_cache(name, capacity=1000, ways=8) as c:
        assert (c.num_sets, c.capacity) == (128, 1024)
    with open_cache(name, capacity=3, ways=8) as c:
        assert (c.num_sets, c.capacity) == (1, 8)


def test_names_are_sanitized_without_making_distinct_names_collide():
    a, b = segment_path("m/t 1"), segment_path("m:t 1")
    assert a != b
    for p in (a, b):
        assert os.path.dirname(p) == SHM
        base = os.path.basename(p)
        assert base.startswith("trec_m_t_1-") and all(c.isalnum() or c in "_-." for c in base)
    assert segment_path("hps_demo.cpu.item") == "/dev/shm/trec_hps_demo.cpu.item"


# ---------------------------------------------------------------------------------------
# segment life cycle


def test_two_opens_share_one_segment_and_the_last_close_removes_the_file(name):
    a = open_cache(name)
    b = open_cache(name)
    path = a.path
    assert os.path.exists(path) and a.attached_pids() == [os.getpid()] * 2
    k = np.arange(10, dtype=np.int64)
    a.insert(k, vec_of(k, 8))
    assert query(b, k)[0].all()
    a.close()
    assert os.path.exists(path)
    with pytest.raises(CacheError, match="closed"):
        a.size()
    b.close()
    b.close()  # idempotent
    assert not os.path.exists(path)


def test_config_mismatch_with_a_live_attacher_raises_an_error_naming_the_file(name):
    holder = spawn("hold_open", name, 64, 8)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(CacheConfigMismatchError) as exc:
            open_cache(name, capacity=64, vec_size=16)
        assert isinstance(exc.value, ConfigError)
        assert segment_path(name) in str(exc.value) and "vec_size 16" in str(exc.value)
        assert f"PIDs [{holder.pid}]" in str(exc.value)
        with open_cache(name, capacity=64, vec_size=8) as same:  # same config attaches
            assert sorted(same.attached_pids()) == sorted([holder.pid, os.getpid()])
    finally:
        finish(holder, timeout=30)  # closes its stdin: it detaches and exits
    assert not os.path.exists(segment_path(name))


@pytest.mark.parametrize("same_config", [True, False])
def test_a_stale_segment_whose_processes_all_died_is_reclaimed(name, same_config):
    report = finish(spawn("die_attached", name, 64, 8), timeout=30)
    assert report["size"] > 0
    assert os.path.exists(segment_path(name))  # left behind by the dead process
    with open_cache(name, capacity=64, vec_size=8 if same_config else 4) as cache:
        assert cache.size() == 0  # a fresh segment, never the dead one's contents
        assert cache.stats()["inserts"] == 0
        assert cache.attached_pids() == [os.getpid()]
        assert cache.vec_size == (8 if same_config else 4)
    assert not os.path.exists(segment_path(name))


def test_processes_racing_to_create_one_name_all_end_up_on_one_segment(name):
    n = 6
    start_at = time.time() + 1.5
    procs = [spawn("race", name, i, n, start_at) for i in range(n)]
    reports = [finish(p, timeout=60) for p in procs]
    assert len({r["inode"] for r in reports}) == 1
    assert all(sorted(r["keys"]) == list(range(n)) for r in reports)
    assert not os.path.exists(segment_path(name))
    assert not [f for f in os.listdir(SHM) if f.startswith(".trec_tmp")]


# ---------------------------------------------------------------------------------------
# concurrency and crashes


@pytest.mark.slow  # runs for `seconds` by design
def test_concurrent_processes_never_see_a_torn_or_wrong_vector(name):
    seconds, n_procs, d = 10, 4, 256
    with open_cache(name, capacity=256, vec_size=d, ways=8) as cache:
        procs = [spawn("stress", name, seconds, seed, d) for seed in range(n_procs)]
        reports = [finish(p, timeout=seconds + 60) for p in procs]
        stats = cache.stats()
    for r in reports:
        assert r["bad"] == 0, f"worker saw wrong vectors: {r}"
        assert r["checked_hits"] > 1000 and r["batches"] > 100
    assert stats["evictions"] > 10_000
    assert stats["hits"] == sum(r["hits"] for r in reports)


def test_a_writer_killed_while_holding_a_set_lock_is_recovered_and_nobody_hangs(name):
    with open_cache(name, capacity=64, vec_size=16, ways=4) as cache:  # 16 sets
        target = 5
        in_set = keys_in_set(cache, target, 4)
        elsewhere = np.arange(1000, 1040, dtype=np.int64)
        elsewhere = elsewhere[cache._view._set_of(elsewhere) != target][:20]
        cache.insert(in_set, vec_of(in_set, 16))
        cache.insert(elsewhere, vec_of(elsewhere, 16))
        assert query(cache, in_set)[0].all()

        holder = spawn("hold_set", name, target, 120)
        try:
            wait_for(
                lambda: cache._view._debug_set_seq(target) % 2 == 1,
                30,
                "the child to lock the set and start a write",
            )
            # a reader of the held set must wait (it can never return the torn vectors)
            reader = spawn("query", name, ",".join(map(str, in_set)))
            time.sleep(0.5)
            assert reader.poll() is None, finish(reader)
        finally:
            os.kill(holder.pid, signal.SIGKILL)
            holder.communicate(timeout=30)
        assert holder.returncode == -signal.SIGKILL

        r = finish(reader, timeout=30)  # got the lock (EOWNERDEAD), repaired the set
        assert r["hits"] == 0 and r["bad"] == 0
        assert cache.stats()["recovered_sets"] == 1
        assert cache._view._debug_set_seq(target) % 2 == 0
        # a new process attaches and uses the repaired set and the others
        both = ",".join(map(str, np.concatenate([in_set, elsewhere])))
        r = finish(spawn("check", name, both, 64, 16, 4, "lru"), timeout=30)
        assert r["bad"] == 0 and r["hits_before"] == len(elsewhere) and r["hits_after"] == r["n"]
        hit, out = query(cache, in_set)
        assert hit.all() and np.array_equal(out, vec_of(in_set, 16))
        assert holder.pid not in cache.attached_pids()
    assert not os.path.exists(segment_path(name))


def test_writers_sigkilled_at_random_moments_leave_a_usable_consistent_cache(name):
    rng = np.random.default_rng(11)
    with open_cache(name, capacity=256, vec_size=256, ways=8, policy="tinylfu") as cache:
        # ~100 of the writer's keys, at most 4 per set, so that all can be resident at once
        cand = np.arange(0, 3000, 7, dtype=np.int64)
        sets = cache._view._set_of(cand)
        keep = np.array([np.sum(sets[:i] == sets[i]) < 4 for i in range(len(cand))])
        keys = ",".join(map(str, cand[keep][:100]))
        for _ in range(4):
            before = cache.stats()["inserts"] + cache.stats()["updates"]
            writer = spawn("write_loop", name)
            try:
                wait_for(
                    lambda before=before: (
                        cache.stats()["inserts"] + cache.stats()["updates"] > before + 2000
                    ),
                    30,
                    "the writer to start writing",
                )
                time.sleep(float(rng.uniform(0.0, 0.2)))
            finally:
                writer.kill()
                writer.communicate(timeout=30)
            r = finish(spawn("check", name, keys, 256, 256, 8, "tinylfu"), timeout=30)
            assert r["bad"] == 0 and r["hits_after"] == r["n"]
        assert cache.attached_pids() == [os.getpid()]
    assert not os.path.exists(segment_path(name))


# ---------------------------------------------------------------------------------------
# worker processes


def _parse_keys(text):
    return np.array([int(x) for x in text.split(",") if x], dtype=np.int64)


def _worker(mode, args):
    if mode == "stress":
        # Every key has two true vectors, +vec_of(key) and -vec_of(key) (updates flip
        # between them while others read): a hit must equal one of them exactly, so a
        # mix of two keys, or of two versions of one key, is caught.
        name, seconds, seed, d = args[0], float(args[1]), int(args[2]), int(args[3])
        cache = open_cache(name, capacity=256, vec_size=d, ways=8)
        rng = np.random.default_rng(seed)
        truth = vec_of(np.arange(5000), d)
        bad = batches = checked = hits = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            keys = rng.integers(0, 5000, size=int(rng.integers(1, 512)))
            keys[: len(keys) // 2] %= 300  # a hot subset, so that hits happen
            hit, out = query(cache, keys)
            want = truth[keys]
            ok = (out == want).all(axis=1) | (out == -want).all(axis=1)
            bad += int((hit & ~ok).sum())
            checked += int(hit.sum())
            hits += int(hit.sum())
            miss = keys[~hit]
            cache.insert(miss, truth[miss])
            flip = keys[hit][:64]
            sign = np.where(rng.random(len(flip)) < 0.5, 1, -1).astype(np.float32)
            cache.update(flip, truth[flip] * sign[:, None])
            if batches % 13 == 0:
                cache.erase(keys[:3])
            batches += 1
        cache.close()
        return dict(bad=bad, batches=batches, checked_hits=checked, hits=hits)
    if mode == "hold_open":  # attach, say so, stay attached until stdin closes
        cache = open_cache(args[0], capacity=int(args[1]), vec_size=int(args[2]))
        print("ready", flush=True)
        sys.stdin.read()
        cache.close()
        return {}
    if mode == "die_attached":  # attach, insert, die without closing
        cache = open_cache(args[0], capacity=int(args[1]), vec_size=int(args[2]))
        k = np.arange(20, dtype=np.int64)
        cache.insert(k, vec_of(k, cache.vec_size))
        print(json.dumps(dict(size=cache.size())), flush=True)
        os._exit(0)
    if mode == "race":
        name, index, n, start_at = args[0], int(args[1]), int(args[2]), float(args[3])
        time.sleep(max(0.0, start_at - time.time()))
        cache = open_cache(name, capacity=64, vec_size=4)
        inode = os.fstat(cache._fd).st_ino
        cache.insert(np.array([index], np.int64), vec_of([index], 4))
        deadline = time.monotonic() + 30
        while len(cache.keys()) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        keys = sorted(cache.keys().tolist())
        cache.close()
        return dict(inode=inode, keys=keys)
    if mode == "hold_set":  # lock a set mid-write and sleep: to be SIGKILLed
        cache = open_cache(args[0], capacity=64, vec_size=16, ways=4)
        cache._view._debug_hold_set(int(args[1]), float(args[2]))
        return {}
    if mode == "query":
        cache = open_cache(args[0], capacity=64, vec_size=16, ways=4)
        keys = _parse_keys(args[1])
        hit, out = query(cache, keys)
        bad = int((hit & ~(out == vec_of(keys, 16)).all(axis=1)).sum())
        cache.close()
        return dict(hits=int(hit.sum()), bad=bad)
    if mode == "write_loop":  # insert / update / query as fast as possible until killed
        cache = open_cache(args[0], capacity=256, vec_size=256, ways=8, policy="tinylfu")
        rng = np.random.default_rng(os.getpid())
        while True:
            keys = rng.integers(0, 3000, size=256)
            hit, _ = query(cache, keys)
            cache.insert(keys, vec_of(keys, 256))
            cache.update(keys, vec_of(keys, 256))
    if mode == "check":  # a new process: attach, verify, make the keys resident, verify
        capacity, d, ways, policy = int(args[2]), int(args[3]), int(args[4]), args[5]
        cache = open_cache(args[0], capacity=capacity, vec_size=d, ways=ways, policy=policy)
        keys = _parse_keys(args[1])
        hit, out = query(cache, keys)
        bad = int((hit & ~(out == vec_of(keys, d)).all(axis=1)).sum())
        hits_before = int(hit.sum())
        cache.clear()  # (under TinyLFU only inserting into a free way is always admitted)
        cache.insert(keys, vec_of(keys, d))
        hit, out = query(cache, keys)
        bad += int((hit & ~(out == vec_of(keys, d)).all(axis=1)).sum())
        cache.close()
        return dict(n=len(keys), bad=bad, hits_before=hits_before, hits_after=int(hit.sum()))
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1], sys.argv[2:])), flush=True)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_set_costs_its_rows_plus_24_bytes_a_way_at_up_to_8_ways(precision):
    """Set layout (shm_cache.hpp): 64-byte header holding the seqlock, the mutex and, up to
    8 ways, the valid flags; then keys and ticks (16 bytes a way), rounded to 64; rows."""
    for ways, d in ((8, 128), (8, 16), (4, 7), (16, 128), (64, 3)):
        row = RowCodec(precision, d).row_bytes
        flags = 0 if ways <= 8 else -(-ways // 8) * 8
        head = -(-(64 + 16 * ways + flags) // 64) * 64
        stride = -(-(head + ways * row) // 64) * 64
        per_set = _native.ShmCacheView.required_bytes(
            512, ways, d, "lru", RowCodec(precision, d).code
        ) - _native.ShmCacheView.required_bytes(256, ways, d, "lru", RowCodec(precision, d).code)
        assert per_set == 256 * stride, (ways, d)
