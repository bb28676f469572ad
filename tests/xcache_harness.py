"""Holding an implementation of the device cache to the numpy reference, operation by
operation: ``ArrayEmbeddingCache`` with numpy (the specification) beside either the CPU
twin of the kernels (``_native.cache_twin_*`` over a copy of the state arrays) or the real
kernels (``ArrayEmbeddingCache`` with CuPy, tests/gpu). After every operation the answers,
the counts and every state array must be equal, bit for bit.

The key streams are random and adversarial: duplicates in a batch, the extreme int64
values, keys that all fall into one set (more new keys than ways), a set left odd by a
"dead writer", TinyLFU's admission after repeated queries, every precision.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.cache.array_cache import ArrayEmbeddingCache

MODES = {m: i for i, m in enumerate(_native.ARRAY_CACHE_WRITE_MODES)}
HIT = _native.ARRAY_CACHE_STATUS.index("hit")
TORN = _native.ARRAY_CACHE_STATUS.index("torn")


class TwinCache:
    """The kernels' CPU twin over its own copy of a reference cache's state arrays."""

    def __init__(self, ref: ArrayEmbeddingCache):
        self.arrays = {n: np.array(a, copy=True) for n, a in ref.state_arrays().items()}
        self.ref = ref
        self.view = _native.CacheView(
            {n: int(a.ctypes.data) for n, a in self.arrays.items()},
            num_sets=ref.num_sets,
            ways=ref.ways,
            dim=ref.vec_size,
            precision=ref.codec.code,
            policy=["lru", "tinylfu"].index(ref.policy),
            sketch_width=ref.sketch_width,
        )

    def query(self, keys) -> Tuple[np.ndarray, np.ndarray]:
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        out = np.empty((keys.shape[0], self.ref.vec_size), np.float32)
        status = np.empty(keys.shape[0], np.uint8)
        _native.cache_twin_query(self.view, keys, out, status)
        return out, status

    def write(self, mode: str, keys, rows=None) -> Dict[str, int]:
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        counts = _native.cache_twin_write(self.view, MODES[mode], keys, rows)
        return dict(zip(_native.ARRAY_CACHE_WRITE_COUNTS, counts))

    def clear(self) -> None:
        _native.cache_twin_clear(self.view)

    def repair(self) -> int:
        return int(_native.cache_twin_repair(self.view))

    def state(self) -> Dict[str, np.ndarray]:
        return self.arrays


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def assert_same_state(ref: ArrayEmbeddingCache, state: Dict[str, np.ndarray], what: str) -> None:
    for name, a in ref.state_arrays().items():
        b = host(state[name])
        a = np.asarray(a)
        if not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            diff = np.flatnonzero(a.reshape(-1).view(np.uint8) != b.reshape(-1).view(np.uint8))
            raise AssertionError(f"{what}: state array {name!r} differs ({diff.size} bytes)")


def keys_in_set(ref: ArrayEmbeddingCache, s: int, n: int, start: int = 0) -> np.ndarray:
    """``n`` distinct keys that all live in set ``s``."""
    out: List[int] = []
    k = start
    while len(out) < n:
        cand = np.arange(k, k + 4096, dtype=np.int64)
        sets = np.asarray(ref.set_of(cand))
        out += cand[sets == s].tolist()
        k += 4096
    return np.asarray(out[:n], dtype=np.int64)


def rows_for(ref: ArrayEmbeddingCache, keys: np.ndarray, version: int = 0) -> np.ndarray:
    """Encoded rows (the cache's precision) whose values derive from the keys."""
    base = (np.asarray(keys) % 10007).astype(np.float32)[:, None]
    vec = base * 0.001 + np.arange(ref.vec_size, dtype=np.float32)[None, :] * 0.125 + version
    return ref.codec.encode(vec.astype(np.float32))


def operations(ref: ArrayEmbeddingCache, seed: int, steps: int) -> List[Tuple[str, tuple]]:
    """A random, adversarial sequence of cache operations for ``ref``'s geometry."""
    rng = np.random.default_rng(seed)
    universe = max(16, 3 * ref.capacity)
    extremes = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 0, 1], np.int64)
    crowd = keys_in_set(ref, int(rng.integers(ref.num_sets)), 2 * ref.ways + 3)
    ops: List[Tuple[str, tuple]] = []

    def draw(n: int) -> np.ndarray:
        kind = rng.integers(5)
        if kind == 0:  # Zipf-ish: heavy repetition (duplicates in one batch)
            return (rng.zipf(1.3, n) % universe).astype(np.int64)
        if kind == 1:
            return rng.integers(-universe, universe, n).astype(np.int64)
        if kind == 2:
            return rng.choice(np.concatenate([extremes, crowd]), n)
        if kind == 3:  # every key in one set: more new keys than ways
            return rng.permutation(crowd)[:n]
        return rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, n, dtype=np.int64)

    for step in range(steps):
        n = int(rng.integers(1, 3 * ref.ways + 40))
        keys = draw(n)
        names = ["insert", "query", "update", "erase", "odd", "repair", "clear"]
        op = rng.choice(names, p=[0.3, 0.45, 0.08, 0.07, 0.04, 0.03, 0.03])
        if op == "insert":
            ops.append(("insert", (keys, rows_for(ref, keys, step))))
        elif op == "update":
            ops.append(("update", (keys, rows_for(ref, keys, step + 1000))))
        elif op == "erase":
            ops.append(("erase", (keys,)))
        elif op == "odd":  # a writer died in these sets: seq left odd
            ops.append(("odd", (rng.integers(0, ref.num_sets, 3),)))
        else:
            ops.append((str(op), (keys,) if op == "query" else ()))
    return ops


def run_against_reference(
    ref: ArrayEmbeddingCache,
    other,
    state: Callable[[], Dict[str, np.ndarray]],
    ops: List[Tuple[str, tuple]],
    make_odd: Callable[[np.ndarray], None],
) -> Dict[str, int]:
    """Apply ``ops`` to the reference and to ``other`` (a TwinCache-like object: query
    returning (out, status), write(mode, keys, rows) returning counts, clear, repair);
    assert after each that answers, counts and state agree. Returns what was exercised."""
    seen = dict.fromkeys(["hits", "misses", "torn", "inserted", "evicted", "rejected",
                          "overflow", "updated", "erased", "recovered"], 0)  # fmt: skip
    for i, (op, args) in enumerate(ops):
        what = f"step {i} ({op})"
        if op == "query":
            (keys,) = args
            torn_before = ref.stats()["torn"]
            vec, hit = ref.query(keys)
            out, status = other.query(keys)
            torn = ref.stats()["torn"] - torn_before
            assert np.array_equal(host(hit), host(status) == HIT), what
            assert int((host(status) == TORN).sum()) == torn, what
            assert np.array_equal(np.asarray(vec).view(np.uint32), host(out).view(np.uint32)), what
            seen["hits"] += int(np.count_nonzero(hit))
            seen["misses"] += int(len(keys) - np.count_nonzero(hit))
            seen["torn"] += torn
        elif op == "insert":
            keys, rows = args
            got, want = other.write("insert", keys, rows), ref.insert(keys, rows)
            for k, v in want.items():
                assert got[k] == v, f"{what}: {k} {got[k]} != {v}"
                seen[k if k != "updated" else "updated"] += v
        elif op == "update":
            keys, rows = args
            n = ref.update(keys, rows)
            assert other.write("update", keys, rows)["updated"] == n, what
            seen["updated"] += n
        elif op == "erase":
            (keys,) = args
            n = ref.erase(keys)
            assert other.write("erase", keys)["erased"] == n, what
            seen["erased"] += n
        elif op == "odd":
            (sets,) = args
            ref.seq[sets] |= 1
            make_odd(sets)
        elif op == "repair":
            n = ref.repair()
            assert other.repair() == n, what
        elif op == "clear":
            ref.clear()
            other.clear()
        assert_same_state(ref, state(), what)
    seen["recovered"] = ref.stats()["recovered_sets"]  # by repair and by writes into odd sets
    return seen


# The tables of one request looked up together (trec_lookup_tables), in request order:
# ("cache", capacity, vec_size, ways, policy, precision, asked) or ("table", mode,
# precision); a cache not asked gets no keys. ONE_LAUNCH: each policy and precision, a
# cache without keys between them, both whole-table modes. MANY_TABLES: 70 tables, more
# than one launch serves (_native's 64), caches and whole tables in turn, the first table
# of the second launch without keys.
ONE_LAUNCH = [
    ("cache", 4096, 16, 8, "lru", "fp32", True),
    ("cache", 1024, 4, 4, "lru", "fp32", False),
    ("cache", 2048, 8, 4, "tinylfu", "fp16", True),
    ("table", "static", "fp16"),
    ("table", "uvm", "int8"),
]
MANY_TABLES = [
    ("cache", 64, 4, 4, "lru", "fp32", t != 64) if t % 2 == 0
    else ("table", ("static", "uvm")[t // 2 % 2], "fp32")
    for t in range(70)
]  # fmt: skip


def check_one_launch(
    make_cache: Callable[[ArrayEmbeddingCache], Tuple[object, Callable[[], Dict[str, np.ndarray]]]],
    make_table: Callable[[np.ndarray, np.ndarray, int, int, float, str], object],
    lookup: Callable[[list, list, list, list], None],
    layout: List[tuple] = ONE_LAUNCH,
) -> None:
    """The tables of ``layout`` (ONE_LAUNCH, MANY_TABLES) looked up as one request: each
    answers as alone (a cache as the numpy reference, a whole table as the CPU lookup) and
    each cache's state ends as the reference's (ticks and sketch included; one without keys
    untouched). make_cache(ref) -> (handle, state()) copies ref's state; make_table(index,
    rows, precision code, dim, default, mode) -> handle; lookup(handles, keys, outs,
    statuses) is the launch under test."""
    from triton_rec.precision import RowCodec

    rng = np.random.default_rng(11)
    handles, keys, checks = [], [], []
    for spec in layout:
        if spec[0] == "cache":
            capacity, vec, ways, policy, precision, asked = spec[1:]
            ref = ArrayEmbeddingCache(capacity, vec, ways=ways, policy=policy, precision=precision)
            held = rng.integers(0, 50_000, 3_000).astype(np.int64)
            ref.insert(held, rows_for(ref, held))
            handle, state = make_cache(ref)
            ask = np.concatenate([rng.choice(held, 700), rng.integers(60_000, 90_000, 300)])
            if not asked:
                ask = np.empty(0, np.int64)
            checks.append(("cache", ref, state, vec))
        else:
            mode, precision = spec[1:]
            stored = rng.choice(np.arange(10**6), 5_000, replace=False).astype(np.int64)
            codec = RowCodec(precision, 5)
            rows = codec.encode(rng.standard_normal((stored.size, 5)).astype(np.float32))
            index = _native.build_index(stored)
            handle = make_table(index, rows, codec.code, 5, -1.5, mode)
            ask = np.concatenate([rng.choice(stored, 900), np.arange(2 * 10**6, 2 * 10**6 + 100)])
            want = np.empty((ask.size, 5), np.float32)
            _native.lookup(index, rows, ask, want, -1.5, precision=codec.code)
            checks.append(("table", want, None, 5))
        handles.append(handle)
        keys.append(ask.astype(np.int64))
    outs = [np.full((k.size, c[3]), np.nan, np.float32) for k, c in zip(keys, checks)]
    statuses = [np.full(k.size, 9, np.uint8) for k in keys]
    lookup(handles, keys, outs, statuses)
    for t, (kind, expected, state, _dim) in enumerate(checks):
        out, status = outs[t], statuses[t]
        if kind == "cache":
            if keys[t].size:
                vec, hit = expected.query(keys[t])
                assert np.array_equal(status, hit.astype(np.uint8)), f"table {t}: statuses"
                assert np.array_equal(out.view(np.uint32), vec.view(np.uint32)), f"table {t}"
            assert_same_state(expected, state(), f"table {t} after the launch")
        else:
            assert np.array_equal(out.view(np.uint32), expected.view(np.uint32)), f"table {t}"
            assert np.array_equal(status, (np.arange(status.size) < 900).astype(np.uint8))
