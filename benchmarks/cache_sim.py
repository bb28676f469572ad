#!/usr/bin/env python3
"""Offline cache-policy simulator: hit rate vs cache size on Zipf traces.

Simulates the embedding-cache policies of triton_rec (``cache_policy`` in ps.json) on
synthetic traces, next to Belady's clairvoyant optimum as the upper limit. Every policy
is a demand-filled cache of ``capacity`` rows exposing ``access(key) -> hit``; on a miss
it inserts the key (unless its admission policy rejects it).

Registry (``POLICIES``, by name, like Caffeine's simulator Registry):

  lru           set-associative (``ways`` per set, num_sets a power of two,
                set = mix64(key) & (num_sets - 1)); a miss inserts, evicting the least
                recently used way of a full set (NVIDIA HPS's policy).
  tinylfu       the same sets and LRU victim + TinyLFU admission: a count-min sketch
                (4 rows of 4-bit counters saturating at 15, width = max(64, power of
                two >= 8 x capacity)) records EVERY access; after 10 x capacity recorded
                accesses all counters are halved. A miss that must evict from a full set
                is admitted only if estimate(new) > estimate(LRU victim); a miss that
                finds a free way is always admitted.
  lru_full      fully associative LRU (reference).
  tinylfu_255   tinylfu with 8-bit counters saturating at 255 instead of 15 (what
                triton_rec/cache/array_cache.py, the numpy/CuPy cache, uses; not in the
                default run).
  tinylfu_full  fully associative LRU + TinyLFU admission (victim = global LRU key).
  belady        Belady's MIN, fully associative and clairvoyant: on a miss with a full
                cache, among the cached keys AND the incoming key the one whose next use
                is farthest in the future is dropped (if that is the incoming key it is
                not inserted: bypass). With bypass it is optimal over every policy of the
                same capacity, admission policies such as TinyLFU included.
  belady_demand the same but always inserts the missed key (optimal among demand-fill
                policies only; not in the default run).

mix64 is the splitmix64 finalizer, the one src/native/hash_index.hpp uses. The real
caches pick sets and sketch counters with other bits/seeds of the same mixer
(shm_cache.hpp: the high bits for the set; array_cache.py: ``(mix64 * num_sets) >> 64``,
the high bits too); with a strong mixer that only reshuffles which keys collide, so hit
rates agree up to noise.

Sizes: a requested size (fraction of N) is rounded to a capacity every policy can have
(the CPU cache rounds num_sets UP to a power of two, up to 2x the request, the array/GPU
cache up to a whole set; here the nearest power of two, so that the rows stay near the
asked size):
``ways x num_sets`` with num_sets the power of two nearest (in log scale) to
``fraction x N / ways``; all policies of one row of the table get that same capacity, and
the table reports it. With the default N = 163840 = 5 x 2^15, 5/10/20 % are exact and
1 % becomes 2048 rows (1.25 %).

Warm-up: the whole trace is simulated and hits are counted over its second half only.

Traces: ``zipf_trace`` draws ranks r in 1..N with P(r) proportional to r^-alpha (inverse
CDF over the exact finite distribution) and maps ranks to unique random 62-bit key ids,
so popularity is uncorrelated with key value and set.

    python benchmarks/cache_sim.py [--n 163840] [--length 1000000] [--seed 1]
        [--alphas 0.9,1.05,1.2] [--sizes 0.01,0.05,0.1,0.2]
        [--policies lru,tinylfu,lru_full,tinylfu_full,belady] [--ways 8] [--jobs 2]
        [--out-md table.md] [--json results.json] [--png plot.png]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import sys
import time
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import machine_info  # noqa: E402

_M64 = (1 << 64) - 1
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
# Seeds of the 4 sketch rows: row i hashes mix64(key ^ _ROW_SEEDS[i]).
_ROW_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
SKETCH_ROWS = 4
SKETCH_MAX = 15
CHUNK = 1 << 16  # accesses converted to Python lists at a time (bounds memory)


# --------------------------------------------------------------------------- hashing


def mix64(z: int) -> int:
    """splitmix64 finalizer of a (signed or unsigned) 64-bit int, as a Python int."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _C1) & _M64
    z = ((z ^ (z >> 27)) * _C2) & _M64
    return z ^ (z >> 31)


def mix64_np(keys: np.ndarray) -> np.ndarray:
    """Vectorized :func:`mix64` (uint64 arithmetic wraps modulo 2^64)."""
    z = np.asarray(keys).astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(_C1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_C2)
        z ^= z >> np.uint64(31)
    return z


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# --------------------------------------------------------------------------- sketch


class CountMinSketch:
    """4-row count-min sketch of saturating counters (``max_count``: 15 = 4 bits) with
    periodic halving.

    ``width`` = max(64, power of two >= 8 x capacity) (64: the floor both real caches
    use); ``sample`` = 10 x capacity recorded accesses between two halvings (every
    :meth:`record` call counts as one, as in src/native/shm_cache.hpp).
    """

    def __init__(self, capacity: int, max_count: int = SKETCH_MAX):
        self.max = int(max_count)
        if not 1 <= self.max <= 255:
            raise ValueError("max_count must be in 1..255 (bytearray counters)")
        self.width = max(64, _pow2_at_least(8 * int(capacity)))
        self.mask = self.width - 1
        self.sample = 10 * int(capacity)
        self.table = bytearray(SKETCH_ROWS * self.width)
        self.count = 0
        self.resets = 0

    def indices(self, key: int) -> Tuple[int, int, int, int]:
        m, w = self.mask, self.width
        return tuple(r * w + (mix64(key ^ s) & m) for r, s in enumerate(_ROW_SEEDS))

    def indices_np(self, keys: np.ndarray) -> np.ndarray:
        """``[len(keys), 4]`` int64 flat counter indices (same as :meth:`indices`)."""
        k = np.asarray(keys).astype(np.uint64)
        cols = [
            (mix64_np(k ^ np.uint64(s)) & np.uint64(self.mask)).astype(np.int64) + r * self.width
            for r, s in enumerate(_ROW_SEEDS)
        ]
        return np.stack(cols, axis=1)

    def record_idx(self, i0: int, i1: int, i2: int, i3: int) -> None:
        t, mx = self.table, self.max
        if t[i0] < mx:
            t[i0] += 1
        if t[i1] < mx:
            t[i1] += 1
        if t[i2] < mx:
            t[i2] += 1
        if t[i3] < mx:
            t[i3] += 1
        self.count += 1
        if self.count >= self.sample:
            self.halve()

    def estimate_idx(self, i0: int, i1: int, i2: int, i3: int) -> int:
        t = self.table
        return min(t[i0], t[i1], t[i2], t[i3])

    def record(self, key: int) -> None:
        self.record_idx(*self.indices(key))

    def estimate(self, key: int) -> int:
        return self.estimate_idx(*self.indices(key))

    def halve(self) -> None:
        arr = np.frombuffer(self.table, dtype=np.uint8)
        arr >>= 1
        self.count = 0
        self.resets += 1


# --------------------------------------------------------------------------- policies


class Policy:
    """A demand-filled cache of ``capacity`` rows. Subclasses implement :meth:`access`.

    :meth:`run` simulates a whole trace (it may precompute hashes with numpy, but gives
    the same hits as calling :meth:`access` on every key) and returns the number of hits
    among accesses ``count_from`` and later.
    """

    name = "?"

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = int(capacity)

    def access(self, key: int) -> bool:
        raise NotImplementedError

    def run(self, trace: np.ndarray, count_from: int = 0) -> int:
        hits = 0
        access = self.access
        for i, k in enumerate(np.asarray(trace).tolist()):
            if access(k) and i >= count_from:
                hits += 1
        return hits

    def __len__(self) -> int:
        raise NotImplementedError


class SetAssocLRU(Policy):
    """``ways``-way set-associative LRU; set = mix64(key) % num_sets (a mask when pow2)."""

    name = "lru"

    def __init__(self, capacity: int, ways: int = 8, num_sets: Optional[int] = None):
        if num_sets is None:
            if capacity % ways:
                raise ValueError(f"capacity {capacity} is not a multiple of ways {ways}")
            num_sets = capacity // ways
        super().__init__(ways * num_sets)
        self.ways = int(ways)
        self.num_sets = int(num_sets)
        self.sets: List[OrderedDict] = [OrderedDict() for _ in range(self.num_sets)]

    def set_of(self, key: int) -> int:
        return mix64(key) % self.num_sets

    def sets_np(self, keys: np.ndarray) -> np.ndarray:
        return (mix64_np(keys) % np.uint64(self.num_sets)).astype(np.int64)

    def access(self, key: int) -> bool:
        return self._access(key, self.set_of(key))

    def _access(self, key: int, s: int) -> bool:
        d = self.sets[s]
        if key in d:
            d.move_to_end(key)
            return True
        if len(d) >= self.ways:
            d.popitem(last=False)
        d[key] = None
        return False

    def run(self, trace: np.ndarray, count_from: int = 0) -> int:
        trace = np.asarray(trace)
        sets, ways, hits = self.sets, self.ways, 0
        for c0 in range(0, len(trace), CHUNK):
            keys = trace[c0 : c0 + CHUNK]
            sids = self.sets_np(keys).tolist()
            for j, (k, s) in enumerate(zip(keys.tolist(), sids)):
                d = sets[s]
                if k in d:
                    d.move_to_end(k)
                    if c0 + j >= count_from:
                        hits += 1
                else:
                    if len(d) >= ways:
                        d.popitem(last=False)
                    d[k] = None
        return hits

    def __len__(self) -> int:
        return sum(len(d) for d in self.sets)


class SetAssocTinyLFU(SetAssocLRU):
    """Set-associative LRU victim choice + TinyLFU admission (see module docstring)."""

    name = "tinylfu"

    def __init__(
        self,
        capacity: int,
        ways: int = 8,
        num_sets: Optional[int] = None,
        sketch_max: int = SKETCH_MAX,
    ):
        super().__init__(capacity, ways, num_sets)
        self.sketch = CountMinSketch(self.capacity, sketch_max)
        self.rejected = 0

    def _access(self, key: int, s: int) -> bool:
        sk = self.sketch
        sk.record(key)
        d = self.sets[s]
        if key in d:
            d.move_to_end(key)
            return True
        if len(d) >= self.ways:
            victim = next(iter(d))
            if sk.estimate(key) <= sk.estimate(victim):
                self.rejected += 1
                return False
            del d[victim]
        d[key] = None
        return False

    def run(self, trace: np.ndarray, count_from: int = 0) -> int:
        trace = np.asarray(trace)
        sets, ways, hits = self.sets, self.ways, 0
        sk = self.sketch
        t, sample, MAX = sk.table, sk.sample, sk.max
        # Sketch indices of cached keys, to estimate victims without rehashing.
        idx_of: Dict[int, Tuple[int, int, int, int]] = {}
        rejected = 0
        for c0 in range(0, len(trace), CHUNK):
            keys = trace[c0 : c0 + CHUNK]
            sids = self.sets_np(keys).tolist()
            ix = sk.indices_np(keys).tolist()
            for j, (k, s, ii) in enumerate(zip(keys.tolist(), sids, ix)):
                i0, i1, i2, i3 = ii
                if t[i0] < MAX:
                    t[i0] += 1
                if t[i1] < MAX:
                    t[i1] += 1
                if t[i2] < MAX:
                    t[i2] += 1
                if t[i3] < MAX:
                    t[i3] += 1
                sk.count += 1
                if sk.count >= sample:
                    sk.halve()
                d = sets[s]
                if k in d:
                    d.move_to_end(k)
                    if c0 + j >= count_from:
                        hits += 1
                    continue
                if len(d) >= ways:
                    victim = next(iter(d))
                    vi = idx_of.get(victim)
                    v0, v1, v2, v3 = vi if vi is not None else sk.indices(victim)
                    if min(t[i0], t[i1], t[i2], t[i3]) <= min(t[v0], t[v1], t[v2], t[v3]):
                        rejected += 1
                        continue
                    del d[victim]
                    idx_of.pop(victim, None)
                d[k] = None
                idx_of[k] = ii
        self.rejected += rejected
        return hits


class FullLRU(Policy):
    """Fully associative LRU."""

    name = "lru_full"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.d: OrderedDict = OrderedDict()

    def access(self, key: int) -> bool:
        d = self.d
        if key in d:
            d.move_to_end(key)
            return True
        if len(d) >= self.capacity:
            d.popitem(last=False)
        d[key] = None
        return False

    def run(self, trace: np.ndarray, count_from: int = 0) -> int:
        d, cap, hits = self.d, self.capacity, 0
        for i, k in enumerate(np.asarray(trace).tolist()):
            if k in d:
                d.move_to_end(k)
                if i >= count_from:
                    hits += 1
            else:
                if len(d) >= cap:
                    d.popitem(last=False)
                d[k] = None
        return hits

    def __len__(self) -> int:
        return len(self.d)


class FullTinyLFU(FullLRU):
    """Fully associative LRU + TinyLFU admission (victim = the global LRU key)."""

    name = "tinylfu_full"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.sketch = CountMinSketch(self.capacity)
        self.rejected = 0

    def access(self, key: int) -> bool:
        sk = self.sketch
        sk.record(key)
        d = self.d
        if key in d:
            d.move_to_end(key)
            return True
        if len(d) >= self.capacity:
            victim = next(iter(d))
            if sk.estimate(key) <= sk.estimate(victim):
                self.rejected += 1
                return False
            del d[victim]
        d[key] = None
        return False

    def run(self, trace: np.ndarray, count_from: int = 0) -> int:
        trace = np.asarray(trace)
        d, cap, hits = self.d, self.capacity, 0
        sk = self.sketch
        t, sample, MAX = sk.table, sk.sample, sk.max
        idx_of: Dict[int, Tuple[int, int, int, int]] = {}
        rejected = 0
        for c0 in range(0, len(trace), CHUNK):
            keys = trace[c0 : c0 + CHUNK]
            ix = sk.indices_np(keys).tolist()
            for j, (k, ii) in enumerate(zip(keys.tolist(), ix)):
                i0, i1, i2, i3 = ii
                if t[i0] < MAX:
                    t[i0] += 1
                if t[i1] < MAX:
                    t[i1] += 1
                if t[i2] < MAX:
                    t[i2] += 1
                if t[i3] < MAX:
                    t[i3] += 1
                sk.count += 1
                if sk.count >= sample:
                    sk.halve()
                if k in d:
                    d.move_to_end(k)
                    if c0 + j >= count_from:
                        hits += 1
                    continue
                if len(d) >= cap:
                    victim = next(iter(d))
                    vi = idx_of.get(victim)
                    v0, v1, v2, v3 = vi if vi is not None else sk.indices(victim)
                    if min(t[i0], t[i1], t[i2], t[i3]) <= min(t[v0], t[v1], t[v2], t[v3]):
                        rejected += 1
                        continue
                    del d[victim]
                    idx_of.pop(victim, None)
                d[k] = None
                idx_of[k] = ii
        self.rejected += rejected
        return hits


def next_use(trace: np.ndarray) -> np.ndarray:
    """``nxt[i]`` = index of the next access to ``trace[i]``, or ``len(trace)`` if none."""
    trace = np.asarray(trace)
    n = len(trace)
    nxt = np.full(n, n, dtype=np.int64)
    if n < 2:
        return nxt
    order = np.argsort(trace, kind="stable")
    same = trace[order[1:]] == trace[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


class Belady(Policy):
    """Belady's MIN (fully associative, clairvoyant), with bypass.

    Needs the whole trace in advance: construct with the trace, then call :meth:`access`
    with its keys in order (a key other than the expected one raises), or :meth:`run`.
    A max-heap of (-next use, key) with lazy deletion finds the farthest cached key.
    """

    name = "belady"
    bypass = True

    def __init__(self, capacity: int, trace: Sequence[int]):
        super().__init__(capacity)
        self.trace = np.asarray(trace)
        self.nxt = next_use(self.trace).tolist()
        self.pos = 0
        self.cached: Dict[int, int] = {}  # key -> its next use
        self.heap: List[Tuple[int, int]] = []
        self.bypassed = 0

    def access(self, key: int) -> bool:
        i = self.pos
        if i >= len(self.nxt) or int(self.trace[i]) != key:
            raise ValueError(f"Belady: access {i} is not the precomputed trace's key")
        self.pos = i + 1
        return self._step(key, self.nxt[i])

    def _step(self, key: int, nu: int) -> bool:
        cached, heap = self.cached, self.heap
        if key in cached:
            cached[key] = nu
            heapq.heappush(heap, (-nu, key))
            if len(heap) > 4 * self.capacity + 64:
                self._compact()
            return True
        if len(cached) >= self.capacity:
            # Farthest cached key (skip stale heap entries).
            while True:
                negnu, victim = heap[0]
                if cached.get(victim) == -negnu:
                    break
                heapq.heappop(heap)
            if self.bypass and nu >= -negnu:
                self.bypassed += 1
                return False
            heapq.heappop(heap)
            del cached[victim]
        cached[key] = nu
        heapq.heappush(heap, (-nu, key))
        if len(heap) > 4 * self.capacity + 64:
            self._compact()
        return False

    def _compact(self) -> None:
        self.heap = [(-nu, k) for k, nu in self.cached.items()]
        heapq.heapify(self.heap)

    def run(self, trace: Optional[np.ndarray] = None, count_from: int = 0) -> int:
        if trace is not None and (
            len(trace) != len(self.trace) or not np.array_equal(np.asarray(trace), self.trace)
        ):
            raise ValueError("Belady.run: trace differs from the one it was built with")
        if self.pos != 0:
            raise ValueError("Belady.run: must start from the beginning of the trace")
        # _step inlined (same logic) for speed.
        cached, cap, bypass = self.cached, self.capacity, self.bypass
        push, pop = heapq.heappush, heapq.heappop
        heap = self.heap
        hits = bypassed = 0
        limit = 4 * cap + 64
        for i, (k, nu) in enumerate(zip(self.trace.tolist(), self.nxt)):
            if k in cached:
                cached[k] = nu
                push(heap, (-nu, k))
                if i >= count_from:
                    hits += 1
                if len(heap) > limit:
                    self._compact()
                    heap = self.heap
                continue
            if len(cached) >= cap:
                while True:
                    negnu, victim = heap[0]
                    if cached.get(victim) == -negnu:
                        break
                    pop(heap)
                if bypass and nu >= -negnu:
                    bypassed += 1
                    continue
                pop(heap)
                del cached[victim]
            cached[k] = nu
            push(heap, (-nu, k))
        self.bypassed += bypassed
        self.pos = len(self.nxt)
        return hits

    def __len__(self) -> int:
        return len(self.cached)


class BeladyDemand(Belady):
    """Belady without bypass: the missed key is always inserted (evicts the farthest)."""

    name = "belady_demand"
    bypass = False


# name -> factory(capacity, ways, num_sets, trace) -> Policy
PolicyFactory = Callable[[int, int, int, np.ndarray], Policy]
POLICIES: Dict[str, PolicyFactory] = {
    "lru": lambda cap, ways, sets, trace: SetAssocLRU(cap, ways, sets),
    "tinylfu": lambda cap, ways, sets, trace: SetAssocTinyLFU(cap, ways, sets),
    # 8-bit counters (saturating at 255), as triton_rec/cache/array_cache.py has them
    "tinylfu_255": lambda cap, ways, sets, trace: SetAssocTinyLFU(cap, ways, sets, 255),
    "lru_full": lambda cap, ways, sets, trace: FullLRU(cap),
    "tinylfu_full": lambda cap, ways, sets, trace: FullTinyLFU(cap),
    "belady": lambda cap, ways, sets, trace: Belady(cap, trace),
    "belady_demand": lambda cap, ways, sets, trace: BeladyDemand(cap, trace),
}
DEFAULT_POLICIES = ("lru", "tinylfu", "lru_full", "tinylfu_full", "belady")


def make_policy(
    name: str,
    capacity: int,
    ways: int = 8,
    num_sets: Optional[int] = None,
    trace: Optional[np.ndarray] = None,
) -> Policy:
    """Build a registered policy. ``capacity`` must equal ``ways x num_sets`` when given
    both; ``trace`` is required by the clairvoyant policies."""
    if name not in POLICIES:
        raise KeyError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    if num_sets is None:
        num_sets = max(1, capacity // ways)
    if name.startswith("belady") and trace is None:
        raise ValueError(f"{name} needs the trace in advance")
    return POLICIES[name](capacity, ways, num_sets, trace)


# --------------------------------------------------------------------------- traces


def zipf_probabilities(n: int, alpha: float) -> np.ndarray:
    """P(rank r) for r = 1..n, proportional to r^-alpha."""
    w = np.arange(1, n + 1, dtype=np.float64) ** (-float(alpha))
    return w / w.sum()


def random_key_ids(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` unique random int64 key ids in [0, 2^62), in random order."""
    ids = np.unique(rng.integers(0, 1 << 62, size=n + n // 8 + 16, dtype=np.int64))
    while len(ids) < n:  # astronomically unlikely
        ids = np.unique(np.concatenate([ids, rng.integers(0, 1 << 62, size=n, dtype=np.int64)]))
    ids = ids[:n]
    rng.shuffle(ids)
    return ids


def zipf_trace(n: int, length: int, alpha: float, seed: int, return_ranks: bool = False):
    """A seeded Zipf(alpha) trace over ``n`` keys: ranks (0 = most popular) mapped to
    unique random key ids. Returns keys (int64), or (keys, ranks, key_of_rank)."""
    rng = np.random.default_rng([int(seed), int(round(alpha * 1_000_000)), int(n)])
    cdf = np.cumsum(zipf_probabilities(n, alpha))
    cdf[-1] = 1.0
    ranks = np.searchsorted(cdf, rng.random(length), side="right")
    np.minimum(ranks, n - 1, out=ranks)
    key_of_rank = random_key_ids(n, rng)
    keys = key_of_rank[ranks]
    if return_ranks:
        return keys, ranks, key_of_rank
    return keys


def scan_polluted_trace(
    hot: int, length: int, scan_len: int, scan_every: int, alpha: float = 0.8, seed: int = 0
) -> np.ndarray:
    """Zipf(alpha) accesses over ``hot`` keys; every ``scan_every`` of them a scan of
    ``scan_len`` never-repeated keys is inserted."""
    rng = np.random.default_rng(seed)
    hot_keys = random_key_ids(hot, rng)
    cdf = np.cumsum(zipf_probabilities(hot, alpha))
    cdf[-1] = 1.0
    out: List[np.ndarray] = []
    total, next_scan_key = 0, 1 << 62  # scan keys are disjoint from hot ids (< 2^62)
    while total < length:
        r = np.minimum(np.searchsorted(cdf, rng.random(scan_every), side="right"), hot - 1)
        out.append(hot_keys[r])
        out.append(np.arange(next_scan_key, next_scan_key + scan_len, dtype=np.int64))
        next_scan_key += scan_len
        total += scan_every + scan_len
    return np.concatenate(out)[:length]


# --------------------------------------------------------------------------- experiment


def infinite_cache_hit_rate(trace: np.ndarray, count_from: int = 0) -> float:
    """Hit rate of an unbounded cache over accesses ``count_from``.. (1 - compulsory
    misses): the ceiling of every policy, Belady included."""
    trace = np.asarray(trace)
    counted = len(trace) - count_from
    if counted <= 0:
        return float("nan")
    _, first = np.unique(trace, return_index=True)
    return 1.0 - int(np.sum(first >= count_from)) / counted


def effective_capacity(fraction: float, n: int, ways: int) -> Tuple[int, int]:
    """(capacity, num_sets): num_sets = the power of two nearest in log scale to
    fraction x n / ways; capacity = ways x num_sets."""
    target_sets = max(fraction * n / ways, 1.0)
    num_sets = 1 << max(0, int(round(math.log2(target_sets))))
    return ways * num_sets, num_sets


_TRACES: Dict[Tuple[int, int, float, int], np.ndarray] = {}


def _trace(n: int, length: int, alpha: float, seed: int) -> np.ndarray:
    key = (n, length, alpha, seed)
    if key not in _TRACES:
        _TRACES[key] = zipf_trace(n, length, alpha, seed)
    return _TRACES[key]


def simulate(
    policy: str, trace: np.ndarray, capacity: int, ways: int, num_sets: int, count_from: int
) -> Dict:
    t0 = time.perf_counter()
    p = make_policy(policy, capacity, ways, num_sets, trace)
    hits = p.run(trace, count_from)
    counted = len(trace) - count_from
    return {
        "policy": policy,
        "hits": hits,
        "accesses": counted,
        "hit_rate": hits / counted if counted else float("nan"),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _job(args):
    n, length, seed, alpha, fraction, capacity, num_sets, ways, policy = args
    trace = _trace(n, length, alpha, seed)
    r = simulate(policy, trace, capacity, ways, num_sets, length // 2)
    r.update(
        alpha=alpha,
        size_fraction=fraction,
        capacity=capacity,
        num_sets=num_sets,
        ways=ways,
        capacity_fraction=capacity / n,
    )
    return r


def markdown_table(
    results: List[Dict],
    policies: Sequence[str],
    n: int,
    ceilings: Optional[Dict[float, float]] = None,
) -> str:
    """Hit rates in %, best non-clairvoyant policy of each row in bold; ``ceilings``
    (alpha -> unbounded-cache hit rate) adds a last column."""
    rows: Dict[Tuple[float, float], Dict[str, Dict]] = {}
    for r in results:
        rows.setdefault((r["alpha"], r["size_fraction"]), {})[r["policy"]] = r
    head = ["alpha", "size (asked)", "rows (% of N)"] + list(policies)
    if ceilings:
        head.append("unbounded")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for alpha, frac in sorted(rows):
        cells = rows[(alpha, frac)]
        any_r = next(iter(cells.values()))
        best = max(
            (c["hit_rate"] for name, c in cells.items() if not name.startswith("belady")),
            default=None,
        )
        line = [
            f"{alpha:g}",
            f"{100 * frac:g} %",
            f"{any_r['capacity']} ({100 * any_r['capacity'] / n:.2f} %)",
        ]
        for p in policies:
            c = cells.get(p)
            if c is None:
                line.append("-")
                continue
            s = f"{100 * c['hit_rate']:.2f}"
            if not p.startswith("belady") and best is not None and c["hit_rate"] == best:
                s = f"**{s}**"
            line.append(s)
        if ceilings:
            c = ceilings.get(alpha)
            line.append("-" if c is None else f"{100 * c:.2f}")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines) + "\n"


def plot_png(
    results: List[Dict],
    policies: Sequence[str],
    alphas: Sequence[float],
    path: str,
    title: str,
    ceilings: Optional[Dict[float, float]] = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "lru": ("tab:blue", "o", "-"),
        "tinylfu": ("tab:orange", "s", "-"),
        "tinylfu_255": ("tab:red", "d", "-"),
        "lru_full": ("tab:blue", "o", ":"),
        "tinylfu_full": ("tab:orange", "s", ":"),
        "belady": ("black", "^", "--"),
        "belady_demand": ("gray", "v", "--"),
    }
    fig, axes = plt.subplots(
        1, len(alphas), figsize=(5 * len(alphas), 4.2), squeeze=False, sharey=False
    )
    for ax, alpha in zip(axes[0], alphas):
        for p in policies:
            pts = sorted(
                (r["capacity_fraction"], r["hit_rate"])
                for r in results
                if r["alpha"] == alpha and r["policy"] == p
            )
            if not pts:
                continue
            color, marker, ls = styles.get(p, (None, "x", "-"))
            ax.plot(
                [100 * x for x, _ in pts],
                [100 * y for _, y in pts],
                ls,
                color=color,
                marker=marker,
                label=p,
            )
        if ceilings and alpha in ceilings:
            ax.axhline(
                100 * ceilings[alpha], color="gray", lw=0.8, ls="-.", label="unbounded cache"
            )
        ax.set_title(f"Zipf alpha = {alpha:g}")
        ax.set_xlabel("cache size (% of keys)")
        ax.set_ylabel("hit rate (%), 2nd half of trace")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=163840, help="distinct keys (N)")
    ap.add_argument("--length", type=int, default=1_000_000, help="trace length (accesses)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--alphas", type=_floats, default=[0.9, 1.05, 1.2])
    ap.add_argument(
        "--sizes",
        type=_floats,
        default=[0.01, 0.05, 0.1, 0.2],
        help="cache sizes as fractions of N (rounded to ways x 2^k rows)",
    )
    ap.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help=f"comma-separated, from {sorted(POLICIES)}",
    )
    ap.add_argument("--ways", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=0, help="worker processes (0 = nproc)")
    ap.add_argument("--out-md", help="write the markdown table here")
    ap.add_argument("--json", help="write all results (and the configuration) here")
    ap.add_argument("--png", help="write the plot here (needs matplotlib)")
    a = ap.parse_args(argv)

    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}; known: {sorted(POLICIES)}")
    if a.length < 2 or a.n < 1 or a.ways < 1:
        ap.error("--length must be >= 2, --n and --ways >= 1")

    jobs = []
    for alpha in a.alphas:
        for frac in a.sizes:
            cap, sets = effective_capacity(frac, a.n, a.ways)
            for p in policies:
                jobs.append((a.n, a.length, a.seed, alpha, frac, cap, sets, a.ways, p))
    # Slowest first, for a better balance between workers.
    cost = {"tinylfu": 3, "tinylfu_255": 3, "tinylfu_full": 3, "belady": 2, "belady_demand": 2}
    jobs.sort(key=lambda j: -cost.get(j[-1], 1))

    t0 = time.perf_counter()
    for alpha in a.alphas:  # generated before forking: workers inherit them
        _trace(a.n, a.length, alpha, a.seed)
    ceilings = {
        alpha: infinite_cache_hit_rate(_trace(a.n, a.length, alpha, a.seed), a.length // 2)
        for alpha in a.alphas
    }
    nworkers = a.jobs or machine_info()["nproc"] or 1
    if nworkers > 1:
        import multiprocessing as mp

        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        with ctx.Pool(nworkers) as pool:
            results = list(pool.imap_unordered(_job, jobs))
    else:
        results = [_job(j) for j in jobs]
    wall = time.perf_counter() - t0
    results.sort(key=lambda r: (r["alpha"], r["size_fraction"], policies.index(r["policy"])))

    table = markdown_table(results, policies, a.n, ceilings)
    print(table)
    print(
        f"N = {a.n} keys, {a.length} accesses (hits counted over the last "
        f"{a.length - a.length // 2}; 'unbounded' = an infinite cache: 1 - compulsory "
        f"misses), ways = {a.ways}, seed = {a.seed}; "
        f"wall {wall:.1f} s with {nworkers} worker(s)"
    )
    if a.out_md:
        with open(a.out_md, "w") as f:
            f.write(table)
    if a.json:
        doc = {
            "config": {
                "n": a.n,
                "length": a.length,
                "seed": a.seed,
                "alphas": a.alphas,
                "sizes": a.sizes,
                "policies": policies,
                "ways": a.ways,
                "warmup": "hits counted over accesses length//2 .. length-1",
                "command": " ".join(
                    [os.path.basename(sys.argv[0])]
                    + list(argv if argv is not None else sys.argv[1:])
                ),
            },
            "machine": machine_info(),
            "wall_seconds": round(wall, 2),
            "unbounded_hit_rate": {str(k): v for k, v in ceilings.items()},
            "results": results,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    if a.png:
        plot_png(
            results,
            policies,
            a.alphas,
            a.png,
            f"N = {a.n} keys, {a.length:,} accesses (hit rate over 2nd half), {a.ways}-way sets",
            ceilings,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
