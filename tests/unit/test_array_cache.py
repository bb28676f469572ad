"""triton_rec.cache.array_cache (the device embedding cache, run here with xp=numpy) and the
publish/attach flow of triton_rec.cache.gpu_share, checked against a brute-force set-associative
LRU written with Python lists, vectors derived from their keys, and real spawned processes
sharing the arrays through /dev/shm. CuPy is absent on this machine (and blocked where a
test needs it absent on any machine)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict

import numpy as np
import pytest

from triton_rec.cache import gpu_share
from triton_rec.cache.array_cache import (
    ArrayEmbeddingCache,
    CupyUnavailableError,
    resolve_xp,
)
from triton_rec.util.procfs import start_time

D = 8


def true_vec(keys, d=D, version=0):
    """The vector of each key: a function of the key (and a version), never stored."""
    keys = np.asarray(keys, dtype=np.int64)
    base = (keys % 100_003).astype(np.float32) + np.float32(version) * 1000.0
    return base[:, None] + np.arange(d, dtype=np.float32)[None, :] * 0.25


def splitmix64(keys):
    z = np.asarray(keys, dtype=np.int64).view(np.uint64).copy()
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class RefLRU:
    """Brute-force set-associative LRU with the documented batch semantics, in plain Python:
    a query batch is one clock tick (its hits all get it); an insert batch is one tick, last
    occurrence of a key wins, cached keys are updated and pinned, new keys take free ways
    (lowest index first) then the least recently used unpinned ways (ties: lowest index),
    in batch order per set; the rest overflow."""

    def __init__(self, num_sets, ways):
        self.ways = ways
        self.sets = [[None] * ways for _ in range(num_sets)]  # slot: [key, tick] or None
        self.clock = 0

    def _find(self, s, k):
        for i, slot in enumerate(self.sets[s]):
            if slot is not None and slot[0] == k:
                return i
        return -1

    def query(self, keys, sets):
        self.clock += 1
        hits = []
        for k, s in zip(keys, sets):
            i = self._find(s, k)
            if i >= 0:
                self.sets[s][i][1] = self.clock
            hits.append(i >= 0)
        return np.array(hits, dtype=bool)

    def insert(self, keys, sets):
        self.clock += 1
        last = {}
        for k, s in zip(keys, sets):
            last.pop(k, None)
            last[k] = s  # dict order = order of last occurrences
        pinned, new_by_set = set(), defaultdict(list)
        res = dict(inserted=0, updated=0, evicted=0, overflow=0)
        for k, s in last.items():
            i = self._find(s, k)
            if i >= 0:
                self.sets[s][i][1] = self.clock
                pinned.add((s, i))
                res["updated"] += 1
            else:
                new_by_set[s].append(k)
        for s, ks in new_by_set.items():
            slots = self.sets[s]
            free = [i for i, sl in enumerate(slots) if sl is None]
            used = sorted(
                (sl[1], i) for i, sl in enumerate(slots) if sl is not None and (s, i) not in pinned
            )
            cands = free + [i for _, i in used]
            for j, k in enumerate(ks):
                if j >= len(cands):
                    res["overflow"] += 1
                    continue
                res["evicted"] += slots[cands[j]] is not None
                slots[cands[j]] = [k, self.clock]
                res["inserted"] += 1
        return res

    def keys(self):
        return {sl[0] for slots in self.sets for sl in slots if sl is not None}


def keys_in_one_set(cache, n, set_index=0, start=0):
    """n distinct keys that all map to the same set."""
    cand = np.arange(start, start + 200_000, dtype=np.int64)
    ks = cand[cache.set_of(cand) == set_index][:n]
    assert len(ks) == n
    return ks


@pytest.fixture
def shm_name():
    name = f"trec-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    d = gpu_share.shm_dir()
    for f in os.listdir(d):  # never leave anything behind, even when a test fails
        if name in f:
            os.unlink(os.path.join(d, f))


# ---------------------------------------------------------------- geometry and hashing
def test_the_set_count_is_the_capacity_over_the_ways_rounded_up_to_one_set():
    # gpucacheper sizes the cache: the slots exceed the request by less than one set (the
    # old rounding to a power of two of sets nearly doubled 65 x 8-way: 128 slots)
    for capacity, ways, sets in [(100, 4, 25), (64, 8, 8), (65, 8, 9), (1, 8, 1), (7, 1, 7)]:
        c = ArrayEmbeddingCache(capacity, 4, ways=ways)
        assert (c.num_sets, c.ways, c.slots, c.capacity) == (sets, ways, sets * ways, sets * ways)
        assert capacity <= c.slots < capacity + ways
        layout = ArrayEmbeddingCache.state_layout(capacity, 4, ways)
        shapes = {n: a.shape for n, a in c.state_arrays().items()}
        assert shapes == {n: s for n, (s, _) in layout.items()}


def fastrange_ref(keys, n):
    """(splitmix64(key) * n) >> 64 with Python's unbounded ints."""
    return np.array([(int(h) * n) >> 64 for h in splitmix64(keys)], dtype=np.int64)


@pytest.mark.parametrize("capacity,ways", [(1000, 8), (100, 4), (65, 8), (64, 8), (1, 8)])
def test_set_of_is_the_multiply_shift_of_splitmix64_by_the_set_count(capacity, ways):
    c = ArrayEmbeddingCache(capacity, 4, ways=ways)
    i64 = np.iinfo(np.int64)
    rand = np.random.default_rng(0).integers(i64.min, i64.max, 1000, dtype=np.int64)
    keys = np.concatenate([np.array([i64.min, -1, 0, 1, i64.max]), rand])
    np.testing.assert_array_equal(c.set_of(keys), fastrange_ref(keys, c.num_sets))
    assert ((c.set_of(keys) >= 0) & (c.set_of(keys) < c.num_sets)).all()


def test_the_fastrange_is_exact_up_to_the_largest_set_count():
    from triton_rec.cache.array_cache import MAX_SETS, fastrange

    h = splitmix64(np.arange(-500, 500))
    for n in (1, 3, 1000, 2**31 + 11, MAX_SETS):
        want = np.array([(int(x) * n) >> 64 for x in h], dtype=np.uint64)
        np.testing.assert_array_equal(fastrange(h, n), want)
    top = np.array([np.iinfo(np.uint64).max], dtype=np.uint64)
    assert int(fastrange(top, MAX_SETS)[0]) == MAX_SETS - 1


def test_a_set_count_that_is_not_a_power_of_two_uses_every_set_evenly():
    c = ArrayEmbeddingCache(25 * 4, 4, ways=4)  # 25 sets
    counts = np.bincount(c.set_of(np.arange(100_000)), minlength=25)
    assert counts.shape == (25,) and counts.min() > 0.9 * 4000 and counts.max() < 1.1 * 4000


def test_an_lru_cache_allocates_no_frequency_sketch():
    lru = ArrayEmbeddingCache(1000, 4, ways=8, policy="lru")
    tiny = ArrayEmbeddingCache(1000, 4, ways=8, policy="tinylfu")
    assert "sketch" not in lru.state_arrays() and lru.sketch is None
    assert "sketch" not in ArrayEmbeddingCache.state_layout(1000, 4, 8, "lru")
    assert tiny.state_arrays()["sketch"].shape == (4, 8192)
    sketch_bytes = tiny.state_arrays()["sketch"].nbytes
    nbytes = {c.policy: sum(a.nbytes for a in c.state_arrays().values()) for c in (lru, tiny)}
    assert nbytes["tinylfu"] - nbytes["lru"] == sketch_bytes
    with pytest.raises(Exception, match="sketch"):
        lru.estimate(np.arange(3))
    keys = np.arange(40)  # the lru cache works without one
    lru.insert(keys, true_vec(keys, 4))
    assert lru.query(keys)[1].all()
    lru.clear()
    assert lru.size() == 0
    again = ArrayEmbeddingCache.from_arrays(tiny.state_arrays())
    assert again.sketch_width == 8192


# ---------------------------------------------------------------- LRU against the reference
@pytest.mark.parametrize("capacity,ways", [(64, 4), (50, 8), (16, 1), (96, 16)])
def test_hits_and_misses_equal_a_brute_force_set_associative_lru_on_random_traces(capacity, ways):
    rng = np.random.default_rng(capacity * 31 + ways)
    c = ArrayEmbeddingCache(capacity, D, ways=ways)
    ref = RefLRU(c.num_sets, c.ways)
    universe = rng.integers(-(10**12), 10**12, 400)
    weights = 1.0 / np.arange(1, 401) ** 0.9
    weights /= weights.sum()
    for _ in range(300):
        keys = rng.choice(universe, size=int(rng.integers(1, 48)), p=weights)
        sets = c.set_of(keys).tolist()
        out, hit = c.query(keys)
        want = ref.query(keys.tolist(), sets)
        np.testing.assert_array_equal(hit, want)
        np.testing.assert_array_equal(out[hit], true_vec(keys[hit]))
        assert not out[~hit].any()
        miss = keys[~hit]
        res = c.insert(miss, true_vec(miss))
        want_res = ref.insert(miss.tolist(), c.set_of(miss).tolist())
        assert res == dict(want_res, rejected=0)
    assert set(c.cached_keys().tolist()) == ref.keys()
    assert c.size() == len(ref.keys())
    st = c.stats()
    assert st["hits"] + st["misses"] == st["lookups"] and st["torn"] == 0
    assert 0.0 < c.hit_rate() < 1.0


def test_returned_vectors_always_equal_the_true_vectors_including_extreme_keys():
    rng = np.random.default_rng(7)
    i64 = np.iinfo(np.int64)
    extremes = [i64.min, i64.min + 1, -1, 0, 1, i64.max]
    universe = np.concatenate([extremes, rng.integers(i64.min, i64.max, 500)])
    c = ArrayEmbeddingCache(128, D, ways=8, policy="tinylfu")
    for _ in range(200):
        keys = rng.choice(universe, size=int(rng.integers(1, 64)))
        out, hit = c.query(keys)
        np.testing.assert_array_equal(out[hit], true_vec(keys[hit]))
        c.insert(keys[~hit], true_vec(keys[~hit]))
    assert c.stats()["hits"] > 0


def test_duplicate_keys_in_one_insert_batch_keep_the_last_vector():
    c = ArrayEmbeddingCache(64, D)
    keys = np.array([5, 9, 5, 5, 9], dtype=np.int64)
    vecs = true_vec(keys, version=0) + np.arange(5, dtype=np.float32)[:, None]
    res = c.insert(keys, vecs)
    assert res["inserted"] == 2 and c.size() == 2
    out, hit = c.query(np.array([5, 9]))
    assert hit.all()
    np.testing.assert_array_equal(out, vecs[[3, 4]])


# ---------------------------------------------------------------- update / erase / clear
def test_update_overwrites_only_cached_keys_and_does_not_count_as_an_access():
    c = ArrayEmbeddingCache(4, D, ways=4)
    ks = keys_in_one_set(c, 5)
    c.insert(ks[:4], true_vec(ks[:4]))
    c.query(ks[1:4])  # ks[0] is now the least recently used
    upd = np.array([ks[0], ks[1], ks[4], 10**15])
    assert c.update(upd, true_vec(upd, version=3)) == 2  # ks[4] and 10**15 are not cached
    assert set(c.cached_keys().tolist()) == set(ks[:4].tolist())
    c.insert(ks[4:], true_vec(ks[4:]))  # evicts ks[0]: the update did not refresh it
    assert set(c.cached_keys().tolist()) == set(ks[1:].tolist())
    out, hit = c.query(ks[1:3])
    assert hit.all()
    np.testing.assert_array_equal(out[0], true_vec(ks[1:2], version=3)[0])
    np.testing.assert_array_equal(out[1], true_vec(ks[2:3])[0])


def test_erase_removes_keys_and_frees_their_ways_for_new_keys():
    c = ArrayEmbeddingCache(4, D, ways=4)
    ks = keys_in_one_set(c, 6)
    c.insert(ks[:4], true_vec(ks[:4]))
    assert c.erase(np.array([ks[1], ks[2], ks[5]])) == 2
    assert c.size() == 2
    _, hit = c.query(ks[:4])
    assert hit.tolist() == [True, False, False, True]
    res = c.insert(ks[4:], true_vec(ks[4:]))
    assert (res["inserted"], res["evicted"]) == (2, 0)  # took the freed ways
    assert set(c.cached_keys().tolist()) == {ks[0], ks[3], ks[4], ks[5]}


def test_clear_empties_the_cache_and_resets_the_sketch():
    c = ArrayEmbeddingCache(64, D, policy="tinylfu")
    keys = np.arange(40)
    c.query(keys)
    c.insert(keys, true_vec(keys))
    assert c.size() > 0 and c.estimate(keys).min() >= 1
    c.clear()
    assert c.size() == 0 and c.cached_keys().size == 0
    assert not c.query(keys)[1].any()
    assert (c.seq % 2 == 0).all()


# ---------------------------------------------------------------- TinyLFU admission
def test_tinylfu_rejects_one_hit_wonders_against_hot_victims():
    c = ArrayEmbeddingCache(4, D, ways=4, policy="tinylfu")
    hot = keys_in_one_set(c, 4)
    for _ in range(5):
        c.query(hot)
    c.insert(hot, true_vec(hot))  # free ways: always admitted
    wonders = keys_in_one_set(c, 3, start=300_000)
    _, hit = c.query(wonders)
    assert not hit.any()
    res = c.insert(wonders, true_vec(wonders))
    assert (res["inserted"], res["rejected"], res["evicted"]) == (0, 3, 0)
    assert set(c.cached_keys().tolist()) == set(hot.tolist())
    assert c.stats()["rejected"] == 3


def test_tinylfu_admits_a_key_hotter_than_its_victim_and_evicts_the_lru_way():
    c = ArrayEmbeddingCache(4, D, ways=4, policy="tinylfu")
    ks = keys_in_one_set(c, 5)
    for _ in range(3):
        c.query(ks[:4])
    c.insert(ks[:4], true_vec(ks[:4]))
    c.query(ks[1:4])  # ks[0] least recently used, estimate 3
    for _ in range(6):
        c.query(ks[4:])
    assert c.estimate(ks[4:])[0] > c.estimate(ks[:1])[0]
    res = c.insert(ks[4:], true_vec(ks[4:]))
    assert (res["inserted"], res["evicted"], res["rejected"]) == (1, 1, 0)
    assert set(c.cached_keys().tolist()) == set(ks[1:].tolist())


def test_tinylfu_rejects_a_new_key_only_as_frequent_as_its_victim():
    c = ArrayEmbeddingCache(4, D, ways=4, policy="tinylfu")
    ks = keys_in_one_set(c, 5)
    c.query(ks)
    c.insert(ks[:4], true_vec(ks[:4]))
    assert c.estimate(ks[4:])[0] == c.estimate(ks[:1])[0] == 1
    assert c.insert(ks[4:], true_vec(ks[4:]))["rejected"] == 1
    c.query(ks[4:])
    assert c.insert(ks[4:], true_vec(ks[4:]))["inserted"] == 1


def test_lru_admits_what_tinylfu_rejects():
    c = ArrayEmbeddingCache(4, D, ways=4, policy="lru")
    hot = keys_in_one_set(c, 4)
    for _ in range(5):
        c.query(hot)
    c.insert(hot, true_vec(hot))
    wonder = keys_in_one_set(c, 1, start=300_000)
    assert c.insert(wonder, true_vec(wonder))["inserted"] == 1


def test_the_sketch_is_halved_after_ten_times_capacity_counted_keys():
    c = ArrayEmbeddingCache(16, D, ways=4, policy="tinylfu")
    key = np.array([42])
    for _ in range(100):
        c.query(key)
    assert c.estimate(key)[0] == 100
    other = np.arange(1000, 1059)  # 100 + 59 = 159 counted keys: one short of 10 x 16
    c.query(other)
    assert c.estimate(key)[0] >= 100
    c.query(np.array([7]))  # the 160th: counters halve
    assert 50 <= c.estimate(key)[0] <= 52  # 100 (+ a collision or two with the others) halved
    assert int(c.meta[1]) == 0 and c.stats()["sketch_agings"] == 1


def test_sketch_counters_saturate_instead_of_wrapping():
    c = ArrayEmbeddingCache(100_000, 1, ways=8, policy="tinylfu")
    key = np.full(300, 3)
    c.query(key)
    assert c.estimate(key[:1])[0] == 255


# ---------------------------------------------------------------- over-full sets
def test_an_over_full_set_in_one_batch_keeps_the_first_new_keys_in_batch_order():
    c = ArrayEmbeddingCache(8, D, ways=4)
    assert c.num_sets == 2
    ks = keys_in_one_set(c, 7, set_index=1)
    batch = ks[[3, 0, 6, 1, 5, 2]]
    res = c.insert(batch, true_vec(batch))
    assert (res["inserted"], res["overflow"], res["evicted"]) == (4, 2, 0)
    assert set(c.cached_keys().tolist()) == set(batch[:4].tolist())
    assert c.stats()["overflow"] == 2
    _, hit = c.query(batch)
    assert hit.tolist() == [True, True, True, True, False, False]


def test_keys_updated_by_a_batch_are_never_evicted_by_the_same_batch():
    c = ArrayEmbeddingCache(4, D, ways=4)
    ks = keys_in_one_set(c, 8)
    c.insert(ks[:4], true_vec(ks[:4]))
    batch = np.concatenate([ks[4:8], ks[:1]])  # ks[0] is the LRU way, updated here
    res = c.insert(batch, true_vec(batch, version=2))
    assert (res["updated"], res["inserted"], res["overflow"], res["evicted"]) == (1, 3, 1, 3)
    assert set(c.cached_keys().tolist()) == {ks[0], ks[4], ks[5], ks[6]}
    out, _ = c.query(ks[:1])
    np.testing.assert_array_equal(out, true_vec(ks[:1], version=2))


# ---------------------------------------------------------------- seqlock validation
def test_keys_of_a_set_being_written_come_back_as_misses_never_as_data():
    c = ArrayEmbeddingCache(64, D, ways=4)
    keys = np.arange(100, 164)
    c.insert(keys, true_vec(keys))
    cached = c.cached_keys()
    s = int(c.set_of(cached[:1])[0])
    c.seq[s] += 1  # a writer is in the middle of set s
    c.vectors[s, 0, : D // 2] = -1.0  # ... half-way through a vector
    out, hit = c.query(cached)
    in_s = c.set_of(cached) == s
    assert in_s.any() and not hit[in_s].any() and hit[~in_s].all()
    assert not out[in_s].any()
    np.testing.assert_array_equal(out[~in_s], true_vec(cached[~in_s]))
    assert c.stats()["torn"] == int(in_s.sum())


def test_a_write_completed_between_the_two_seq_reads_is_retried_and_returns_the_new_vector():
    c = ArrayEmbeddingCache(16, D, ways=4)
    keys = np.array([1, 2, 3])
    c.insert(keys, true_vec(keys))
    calls = []

    def writer_finishes_during_read(cache, sets):
        if not calls:  # the first read overlaps a whole write of every set involved
            for s in np.unique(sets):
                cache.seq[s] += 1
                w = np.flatnonzero(cache.valid[s])
                cache.vectors[s, w] = true_vec(cache.slot_keys[s, w], version=5)
                cache.seq[s] += 1
        calls.append(1)

    c._between_reads = writer_finishes_during_read
    out, hit = c.query(keys)
    assert len(calls) == 2 and hit.all()
    np.testing.assert_array_equal(out, true_vec(keys, version=5))
    assert c.stats()["torn"] == 0


def test_a_writer_active_during_both_attempts_yields_misses_after_one_retry():
    c = ArrayEmbeddingCache(16, D, ways=4)
    keys = np.array([1, 2, 3])
    c.insert(keys, true_vec(keys))
    calls = []

    def busy_writer(cache, sets):
        for s in np.unique(sets):
            cache.seq[s] += 2  # another whole write happened each time
            cache.vectors[s] = -7.0
        calls.append(1)

    c._between_reads = busy_writer
    out, hit = c.query(keys)
    assert len(calls) == 2 and not hit.any() and not out.any()
    assert c.stats()["torn"] == 3


def test_a_set_left_odd_by_a_dead_writer_is_dropped_by_the_next_write_to_it():
    c = ArrayEmbeddingCache(8, D, ways=4)
    ks = keys_in_one_set(c, 3)
    c.insert(ks[:2], true_vec(ks[:2]))
    s = int(c.set_of(ks[:1])[0])
    c.seq[s] |= 1  # the writer died here, maybe mid-vector
    c.vectors[s, 0] = 99.0
    assert not c.query(ks[:2])[1].any()
    c.insert(ks[2:], true_vec(ks[2:]))
    assert c.seq[s] % 2 == 0
    assert set(c.cached_keys().tolist()) == {ks[2]}  # the maybe-torn ways are gone
    c.seq[s] |= 1
    assert c.repair() == 1 and c.size() == 0 and c.seq[s] % 2 == 0
    assert c.stats()["recovered_sets"] == 2


# ---------------------------------------------------------------- attach / share
def test_from_arrays_attaches_with_the_creators_geometry_policy_and_contents():
    a = ArrayEmbeddingCache(98, D, ways=4, policy="tinylfu")
    a.insert(np.arange(10), true_vec(np.arange(10)))
    b = ArrayEmbeddingCache.from_arrays(a.state_arrays())
    assert (b.requested_capacity, b.capacity, b.vec_size, b.ways) == (98, 100, D, 4)
    assert (b.policy, b.xp) == ("tinylfu", np)
    out, hit = b.query(np.arange(10))
    assert hit.all()
    np.testing.assert_array_equal(out, true_vec(np.arange(10)))
    with pytest.raises(Exception, match="magic"):
        ArrayEmbeddingCache.from_arrays({n: np.zeros_like(x) for n, x in a.state_arrays().items()})
    bad = dict(a.state_arrays(), vectors=np.zeros((1, 1, 1), np.float32))
    with pytest.raises(Exception, match="vectors"):
        ArrayEmbeddingCache.from_arrays(bad)


def test_share_and_attach_numpy_arrays_round_trip_and_refuse_a_second_publisher(shm_name):
    src = {"a": np.arange(10, dtype=np.int64), "b": np.ones((3, 5), np.float32)}
    owner = gpu_share.share_numpy_arrays(shm_name, src)
    try:
        with pytest.raises(FileExistsError):
            gpu_share.share_numpy_arrays(shm_name, src)
        other = gpu_share.attach_numpy_arrays(shm_name)
        np.testing.assert_array_equal(other.arrays["a"], src["a"])
        other.arrays["b"][1, 2] = 7.0
        assert owner.arrays["b"][1, 2] == 7.0
        assert not other.owner and other.pid == os.getpid()
        other.close()
        assert os.path.exists(owner.path)
    finally:
        owner.close()
    assert not os.path.exists(owner.path)
    with pytest.raises(FileNotFoundError):
        gpu_share.attach_numpy_arrays(shm_name)
    leftovers = [f for f in os.listdir(gpu_share.shm_dir()) if shm_name in f]
    assert leftovers == []


def _child_sees_and_inserts(name, parent_keys, child_keys, results):
    """Spawned process: attach by name, check the parent's inserts, insert its own."""
    import numpy as np

    from triton_rec.cache import gpu_share as gs

    shared = gs.open_shared_cache(name, 256, D, ways=8, policy="lru")
    out, hit = shared.cache.query(parent_keys)
    seen_ok = bool(hit.all()) and bool(np.array_equal(out, true_vec(parent_keys)))
    res = shared.cache.insert(child_keys, true_vec(child_keys))
    results.put((shared.owner, seen_ok, res["inserted"]))
    shared.close()


def test_two_processes_attach_to_the_same_shared_arrays_by_name_and_see_each_others_inserts(
    shm_name,
):
    parent_keys, child_keys = np.arange(0, 40), np.arange(1000, 1040)
    shared = gpu_share.open_shared_cache(shm_name, 256, D, ways=8, policy="lru")
    try:
        assert shared.owner and "cupy" not in sys.modules
        assert shared.cache.insert(parent_keys, true_vec(parent_keys))["inserted"] == 40
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        p = ctx.Process(
            target=_child_sees_and_inserts, args=(shm_name, parent_keys, child_keys, results)
        )
        p.start()
        child_owner, child_saw_parent, child_inserted = results.get(timeout=60)
        p.join(timeout=60)
        assert p.exitcode == 0
        assert (child_owner, child_saw_parent, child_inserted) == (False, True, 40)
        out, hit = shared.cache.query(child_keys)
        assert hit.all()
        np.testing.assert_array_equal(out, true_vec(child_keys))
        assert shared.cache.size() == 80
        assert shared.stats()["inserts"] == 80  # writer counters are node-wide
        assert shared.stats()["lookups"] == 40  # reader counters are this process's
        assert os.path.exists(gpu_share.shared_path(shm_name))  # the child left it
    finally:
        shared.close()
    assert [f for f in os.listdir(gpu_share.shm_dir()) if shm_name in f] == []


# ---------------------------------------------------------------- owner lifetime
def _child_attached_until_told(name, keys, attached, go, results):
    """Spawned process: attach, report, wait for ``go``, read ``keys``, detach."""
    from triton_rec.cache import gpu_share as gs

    shared = gs.open_shared_cache(name, 256, D, ways=8, policy="lru")
    attached.put(os.getpid())
    go.wait(60)
    out, hit = shared.cache.query(keys)
    results.put(bool(hit.all()) and bool(np.array_equal(out, true_vec(keys))))
    shared.close()


def _spawn_attached(name, keys):
    ctx = multiprocessing.get_context("spawn")
    attached, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_child_attached_until_told, args=(name, keys, attached, go, results))
    p.start()
    return p, attached.get(timeout=60), go, results


def test_the_owner_retains_the_memory_while_another_process_is_attached(shm_name):
    keys = np.arange(30)
    owner = gpu_share.open_shared_cache(shm_name, 256, D, ways=8, policy="lru")
    p = None
    try:
        owner.cache.insert(keys, true_vec(keys))
        p, child_pid, go, results = _spawn_attached(shm_name, keys)
        assert sorted(pid for pid, _ in owner.attached()) == sorted([os.getpid(), child_pid])
        # close while the child is attached: unpublished at once, memory retained
        assert owner.close(linger=0) is False
        assert gpu_share.retained_caches() == [shm_name]
        assert [f for f in os.listdir(gpu_share.shm_dir()) if shm_name in f] == []
        assert gpu_share.release_retained() == 0  # still attached
        go.set()
        assert results.get(timeout=60) is True  # the child still reads the owner's data
        p.join(timeout=60)
        assert p.exitcode == 0
        assert gpu_share.release_retained() == 1 and gpu_share.retained_caches() == []
    finally:
        owner.close(linger=0)
        if p is not None and p.is_alive():
            p.kill()
        gpu_share.release_retained()


def _published(name):
    return [f for f in os.listdir(gpu_share.shm_dir()) if name in f]


def test_the_owner_waits_for_attached_processes_before_freeing(shm_name):
    # Catches an owner that does not wait for an attached process (close() would return
    # False, the memory retained) or frees the memory under it (the child's read fails).
    keys = np.arange(10)
    owner = gpu_share.open_shared_cache(shm_name, 256, D, ways=8, policy="lru")
    owner.cache.insert(keys, true_vec(keys))
    p, _, go, results = _spawn_attached(shm_name, keys)
    closed = []
    closer = threading.Thread(target=lambda: closed.append(owner.close(linger=120)))
    try:
        closer.start()
        # close() unpublishes the cache once it has seen who is attached: from then on it
        # waits, and only then is the child told to read and detach (so the wait is sure)
        deadline = time.monotonic() + 60
        while _published(shm_name):
            assert time.monotonic() < deadline, "close() never unpublished the cache"
            time.sleep(0.01)
        go.set()
        closer.join(timeout=120)
        assert closed == [True], closed  # freed by close() itself, after the child left
        assert gpu_share.retained_caches() == []
        assert results.get(timeout=60) is True  # the child read the owner's rows meanwhile
        p.join(timeout=60)
        assert p.exitcode == 0
    finally:
        go.set()
        closer.join(timeout=120)
        if p.is_alive():
            p.kill()
        gpu_share.release_retained()


def test_the_owner_does_not_wait_for_handles_of_its_own_process(shm_name):
    # Instances of one model in one server: the owner's close must not wait the linger for
    # the others (they close on the same unload); the memory stays until the last closes.
    keys = np.arange(12)
    owner = gpu_share.open_shared_cache(shm_name, 256, D, ways=8, policy="lru")
    owner.cache.insert(keys, true_vec(keys))
    second = gpu_share.open_shared_cache(shm_name, 256, D, ways=8, policy="lru")
    try:
        assert not second.owner
        # The defect: waiting out the whole linger for a handle of its own process (it
        # closes later, on the same unload). Normally milliseconds; half the linger is
        # only reached by that wait, never by a busy machine.
        linger = 120
        t0 = time.monotonic()
        assert owner.close(linger=linger) is False  # retained for the second handle
        waited = time.monotonic() - t0
        assert waited < linger / 2, f"close() waited {waited:.1f} s for its own process"
        assert gpu_share.retained_caches() == [shm_name]
        out, hit = second.cache.query(keys)
        assert hit.all() and np.array_equal(out, true_vec(keys))
        assert second.close(linger=0) is True
        assert gpu_share.retained_caches() == []
    finally:
        second.close(linger=0)
        owner.close(linger=0)
        gpu_share.release_retained()


def test_attachments_of_processes_that_are_gone_do_not_hold_the_memory(shm_name):
    owner = gpu_share.open_shared_cache(shm_name, 256, D)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me, started = os.getpid(), start_time(os.getpid())
    with owner.lock:
        owner.lock.register((gone.pid, 1))  # exited
        owner.lock.register((me, started + 1))  # our pid, another start time: a reused pid
        owner.lock.register((me, 0))  # no start time: cannot be verified
    assert owner.attached() == [(me, started)]
    assert owner.close(linger=0) is True and gpu_share.retained_caches() == []


def _rewrite_owner_start_time(path, starttime):
    with open(path, "r+b") as f:
        head = f.read(4096)
        n = int.from_bytes(head[8:16], "little")
        manifest = json.loads(head[16 : 16 + n])
        manifest["starttime"] = starttime
        blob = json.dumps(manifest).encode()
        f.seek(0)
        f.write(head[:8] + len(blob).to_bytes(8, "little") + blob)


def test_state_published_by_a_recycled_pid_is_stale_and_replaced(shm_name):
    # The owner check is pid + start time (as for the CPU segments): a process now running
    # under the owner's pid with another start time is not the owner.
    first = gpu_share.open_shared_cache(shm_name, 256, D)
    first.cache.insert(np.arange(5), true_vec(np.arange(5)))
    path = gpu_share.shared_path(shm_name)
    _rewrite_owner_start_time(path, start_time(os.getpid()) + 1)
    second = gpu_share.open_shared_cache(shm_name, 256, D)
    try:
        assert second.owner and second.cache.size() == 0  # a fresh cache, not the stale one
        assert gpu_share.attach_numpy_arrays(shm_name).owner_alive()
    finally:
        second.close(linger=0)
        first.close(linger=0)


def test_handles_without_the_owners_start_time_are_stale(shm_name):
    hpath = gpu_share.shared_path(shm_name, ".cudaipc.json")
    me, started = os.getpid(), start_time(os.getpid())
    try:
        for starttime, stale in ((started, False), (started + 1, True), (None, True)):
            doc = {"format": gpu_share.HANDLES_FORMAT, "pid": me, "arrays": {}}
            if starttime is not None:
                doc["starttime"] = starttime
            with open(hpath, "w") as f:
                json.dump(doc, f)
            os.chmod(hpath, 0o600)
            if stale:
                with pytest.raises(gpu_share.StaleHandlesError):
                    gpu_share.read_handles(hpath)
            else:
                assert gpu_share.read_handles(hpath) == {}
    finally:
        os.unlink(hpath)


def test_attaching_with_another_geometry_is_refused_and_removes_nothing(shm_name):
    with gpu_share.open_shared_cache(shm_name, 256, D) as owner:
        with pytest.raises(Exception, match="another geometry"):
            gpu_share.open_shared_cache(shm_name, 256, D + 1)
        with pytest.raises(Exception, match="another geometry"):
            gpu_share.open_shared_cache(shm_name, 256, D, policy="tinylfu")
        assert os.path.exists(gpu_share.shared_path(shm_name))
        assert owner.cache.insert(np.arange(3), true_vec(np.arange(3)))["inserted"] == 3


RW = 256  # floats per vector in the torn-read test: [key, version, version, ...]


def _hammering_writer(name, keys, ready, stop, results):
    """Spawned process: rewrite every vector as fast as it can until told to stop."""
    import numpy as np

    from triton_rec.cache import gpu_share as gs

    shared = gs.open_shared_cache(name, 256, RW, ways=8)
    ready.set()
    version = 0
    while not stop.is_set():
        version += 1
        rows = np.full((len(keys), RW), float(version), np.float32)
        rows[:, 0] = keys
        shared.cache.update(keys, rows)
    results.put(version)
    shared.close()


def test_a_writer_process_rewriting_vectors_never_makes_a_reader_see_a_torn_vector(shm_name):
    keys = np.arange(1, 65, dtype=np.int64)
    shared = gpu_share.open_shared_cache(shm_name, 256, RW, ways=8)
    try:
        rows = np.zeros((len(keys), RW), np.float32)
        rows[:, 0] = keys
        assert shared.cache.insert(keys, rows)["inserted"] == len(keys)
        ctx = multiprocessing.get_context("spawn")
        ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
        p = ctx.Process(target=_hammering_writer, args=(shm_name, keys, ready, stop, results))
        p.start()
        assert ready.wait(60)
        # read until the rows of 20 versions were seen (reads and rewrites overlapped that
        # long), not for a fixed time a busy machine may spend elsewhere
        checked, seen, deadline = 0, set(), time.monotonic() + 120
        while len(seen) < 20:
            assert time.monotonic() < deadline, f"the reader saw versions {sorted(seen)}"
            out, hit = shared.cache.query(keys)
            got = out[hit]
            np.testing.assert_array_equal(got[:, 0], keys[hit])  # never another key's row
            assert (got[:, 1:] == got[:, 1:2]).all(), "torn vector"  # never two versions
            checked += int(hit.sum())
            seen.update(got[:, 1].tolist())
        stop.set()
        versions = results.get(timeout=60)
        p.join(timeout=60)
        assert p.exitcode == 0
        assert checked > 0 and versions >= max(seen)
    finally:
        shared.close()


# ---------------------------------------------------------------- CuPy stays optional
class _NoCupy:
    """A meta-path finder that makes ``import cupy`` fail and records the attempt."""

    def __init__(self):
        self.attempts = 0

    def find_spec(self, name, path=None, target=None):
        if name == "cupy" or name.startswith("cupy."):
            self.attempts += 1
            raise ImportError("No module named 'cupy' (blocked by the test)")
        return None


NO_CUPY_SCRIPT = """
import sys
import numpy as np

class NoCupy:
    attempts = 0
    def find_spec(self, name, path=None, target=None):
        if name == "cupy" or name.startswith("cupy."):
            NoCupy.attempts += 1
            raise ImportError("No module named 'cupy' (blocked)")
        return None

sys.meta_path.insert(0, NoCupy())
from triton_rec.cache.array_cache import ArrayEmbeddingCache
from triton_rec.cache import gpu_share
c = ArrayEmbeddingCache(32, 4, policy="tinylfu", xp="numpy")
k = np.arange(10)
c.query(k)
c.insert(k, np.ones((10, 4), np.float32))
assert c.query(k)[1].all()
view = c.host_view()
out, hit = np.zeros((3, 4), np.float32), np.zeros(3, np.uint8)
assert view.query(np.array([1, 2, 99]), out, hit) == 2
assert hit.tolist() == [1, 1, 0] and set(view.keys().tolist()) == set(range(10))
assert NoCupy.attempts == 0 and "cupy" not in sys.modules
print("ok")
"""


def test_the_modules_import_and_run_without_cupy_and_never_try_to_import_it():
    r = subprocess.run(
        [sys.executable, "-c", NO_CUPY_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_requesting_a_cupy_cache_without_cupy_raises_a_clear_error():
    blocker = _NoCupy()
    sys.meta_path.insert(0, blocker)
    saved = sys.modules.pop("cupy", None)
    try:
        with pytest.raises(CupyUnavailableError, match="CuPy"):
            ArrayEmbeddingCache(32, 4, xp="cupy")
        with pytest.raises(ImportError, match="needs CuPy"):
            resolve_xp("cupy")
        with pytest.raises(CupyUnavailableError):
            gpu_share.export_arrays({})
        with pytest.raises(CupyUnavailableError):
            gpu_share.open_shared_cache("trec-never-created", 32, 4, device=0, directory=None)
            assert blocker.attempts >= 4
    finally:
        sys.meta_path.remove(blocker)
        if saved is not None:
            sys.modules["cupy"] = saved
    assert [f for f in os.listdir(gpu_share.shm_dir()) if "trec-never-created" in f] == []
    assert gpu_share.shared_path("x", ".lock").endswith("/trec_xp_x.lock")


def test_an_unknown_array_module_or_policy_is_a_config_error():
    with pytest.raises(Exception, match="numpy' or 'cupy"):
        ArrayEmbeddingCache(32, 4, xp="torch")
    with pytest.raises(Exception, match="policy"):
        ArrayEmbeddingCache(32, 4, policy="lfu")


def test_a_cached_table_serves_correct_vectors_through_the_shared_cache(shm_name):
    from triton_rec.cache.cached_table import CachedTable
    from triton_rec.storage.backing_store import LocalTableStore
    from triton_rec.storage.table import EmbeddingTable

    keys = np.arange(-500, 500, 3, dtype=np.int64)
    shared = gpu_share.open_shared_cache(shm_name, 64, D, ways=4)  # what deployment opens
    assert (shared.capacity, shared.vec_size) == (64, D)
    table = CachedTable(
        "t",
        LocalTableStore(EmbeddingTable("t", keys, true_vec(keys), -1.0)),
        cache=shared,
        hit_rate_threshold=2.0,
    )
    rng = np.random.default_rng(3)
    for _ in range(20):
        q = rng.choice(np.concatenate([keys[:80], [0, 2]]), 50)  # 0 and 2 are in no table
        out = np.empty((50, D), np.float32)
        table.lookup(q, out)
        known = np.isin(q, keys)
        np.testing.assert_array_equal(out[known], true_vec(q[known]))
        assert (out[~known] == -1.0).all()
    assert table.stats.snapshot()["hits"] > 0 and shared.size() > 0
    shared.close()
