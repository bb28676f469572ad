"""The misses of a node-local table in C++ (``_native.LocalMisses``,
src/native/local_misses.hpp) against the engine's Python rules (CachedTable.finish_query
over any other store): the same requests on two caches in the same state must give the
same answers, the same default counts per request and cause, the same counters and the
same cache contents afterwards, for every threshold, precision, merged requests, ``exact``
requests, repeated keys and keys no tier holds.

Each test runs in front of both kinds of cache LocalMisses inserts into: the shared-memory
cache of KIND_CPU instances (``shm``) and the device cache's algorithm (``array``: its
write kernel's CPU twin, ``_native.cache_twin_miss_cache``, where a GPU instance runs the
kernel itself; the Python rules insert with the numpy reference)."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from tests.threads import run_in_threads
from triton_rec import _native
from triton_rec.cache.array_cache import ArrayEmbeddingCache
from triton_rec.cache.cached_table import DEFAULT_CAUSES, BackgroundInserter, CachedTable
from triton_rec.cache.shm_cache import SharedEmbeddingCache
from triton_rec.precision import RowCodec
from triton_rec.storage.backing_store import LocalTableStore
from triton_rec.storage.table import EmbeddingTable

VEC = 6
ROWS = 3000
DEFAULT = -1.5
TIMINGS = ("cache_ns", "store_ns")


class PythonRulesStore(LocalTableStore):
    """The same table, without the native view: CachedTable answers its misses in Python."""

    def native_table(self):
        return None


def _table(precision: str) -> EmbeddingTable:
    rng = np.random.default_rng(5)
    keys = rng.permutation(np.arange(ROWS, dtype=np.int64) * 7 + 3)
    vectors = rng.standard_normal((ROWS, VEC)).astype(np.float32)
    codec = RowCodec(precision, VEC)
    return EmbeddingTable("t", keys, codec.encode(vectors), DEFAULT, codec=codec)


@pytest.fixture(params=["shm", "array"])
def caches(request):
    opened = []

    def make(precision: str):
        # room for every row: no eviction, so the contents do not depend on the order in
        # which a lookup's own inserts and the background thread's land
        if request.param == "array":
            return ArrayEmbeddingCache(8 * ROWS, VEC, ways=8, precision=precision).host_view()
        c = SharedEmbeddingCache.open(
            f"test-lm-{uuid.uuid4().hex[:10]}", 8 * ROWS, VEC, ways=8, precision=precision
        )
        opened.append(c)
        return c

    yield make
    for c in opened:
        c.close()


def _native_cache(cache):
    """What LocalMisses takes for ``cache``: the shared-memory view, or a MissCache."""
    return cache.shm_view() if hasattr(cache, "shm_view") else cache.miss_cache()


def _pair(caches, precision, threshold, exact_table=False):
    table = _table(precision)
    tables = []
    for store_type in (LocalTableStore, PythonRulesStore):
        inserter = None if exact_table else BackgroundInserter()
        ct = CachedTable(
            "t",
            store_type(table),
            caches(precision),
            hit_rate_threshold=threshold,
            inserter=inserter,
            exact=exact_table,
        )
        tables.append(ct)
    native, python = tables
    assert native.local_misses is not None and python.local_misses is None
    return table, native, python


def _close(*tables):
    for ct in tables:
        if ct.inserter is not None:
            ct.inserter.close()


def _counters(ct):
    return {k: v for k, v in ct.stats.snapshot().items() if k not in TIMINGS}


def _finish_all_missed(misses, keys, out, defaults=None):
    """``misses.finish`` of one request whose every key missed the cache."""
    n = keys.shape[0]
    defaults = np.zeros((1, 2), np.int64) if defaults is None else defaults
    bounds = np.array([0, n], np.int64)
    misses.finish(keys, out, np.zeros(n, np.uint8), 0, 0, bounds, np.zeros(1, np.uint8), defaults)


def compare_rules(table, native, python, rng, steps: int) -> dict:
    """``steps`` random lookups (1-3 merged requests of hot, cold and absent keys, some
    ``exact``) through ``native`` and ``python``: the same answers, default counts,
    counters and cache contents after each. Returns the counters at the end."""
    for step in range(steps):
        requests = int(rng.integers(1, 4))
        segments = [int(rng.integers(0, 60)) for _ in range(requests)]
        m = sum(segments)
        # hot keys (repeats), cold keys and keys no tier holds
        hot = table.keys[rng.integers(0, 80, m)]
        cold = table.keys[rng.integers(0, ROWS, m)]
        absent = rng.integers(0, 10**6, m) * 7 + 5  # never = 3 mod 7
        pick, warm = rng.random(m), rng.uniform(0.3, 1.0)  # hit rates around the threshold
        keys = np.where(pick < warm, hot, np.where(pick < 0.97, cold, absent)).astype(np.int64)
        exact = tuple(bool(rng.random() < 0.3) for _ in range(requests))
        answers = []
        for ct in (native, python):
            out = np.empty((m, VEC), np.float32)
            defaults = np.zeros((requests, len(DEFAULT_CAUSES)), np.int64)
            ct.lookup(keys, out, segments, exact, defaults)
            assert ct.inserter.drain(10.0)
            answers.append((out, defaults))
        np.testing.assert_array_equal(answers[0][0], answers[1][0], err_msg=f"step {step}")
        np.testing.assert_array_equal(answers[0][1], answers[1][1], err_msg=f"step {step}")
        assert _counters(native) == _counters(python), f"step {step}"
        assert sorted(native.cache.keys().tolist()) == sorted(python.cache.keys().tolist())
    return _counters(native)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.8, 1.0, 1.1])
def test_native_and_python_rules_agree(caches, precision, threshold):
    table, native, python = _pair(caches, precision, threshold)
    rng = np.random.default_rng(int(threshold * 10) + len(precision))
    try:
        snap = compare_rules(table, native, python, rng, 40)
        # the counts say the test met every rule
        assert snap["misses"] > 0 and snap["not_found"] > 0
        if threshold < 1.0:  # at 1.0 a request with a miss is below the threshold
            assert snap["default_answered"] > 0
        if threshold > 0.0:
            assert snap["sync_fetched"] > 0
    finally:
        _close(native, python)


def test_a_static_table_fetches_every_miss_natively(caches):
    table, native, python = _pair(caches, "fp32", 0.0, exact_table=True)
    keys = table.keys[:100].copy()
    for ct in (native, python):
        out = np.empty((100, VEC), np.float32)
        ct.lookup(keys, out)
        np.testing.assert_array_equal(out, table.vectors[:100])
    assert _counters(native) == _counters(python)
    assert _counters(native)["sync_fetched"] == 100


def test_a_full_queue_drops_and_counts(caches):
    """A batch the background queue has no room for is dropped and counted; the answer is
    the default all the same."""
    table = _table("fp32")
    queue = _native.InsertQueue(1)
    cache = caches("fp32")
    ct = CachedTable("t", LocalTableStore(table), cache, hit_rate_threshold=0.0)
    stats = np.zeros(len(_native.TABLE_STAT_FIELDS), np.int64)
    misses = _native.LocalMisses(
        _native_cache(cache), table.index, table.vectors, 0, DEFAULT, 0.0, True, queue, stats
    )
    keys = table.keys[:20].copy()
    out = np.empty((20, VEC), np.float32)
    hit = np.zeros(20, np.uint8)
    bounds = np.array([0, 20], np.int64)
    defaults = np.zeros((1, 2), np.int64)
    for _ in range(200):  # faster than one thread inserts: some batches find it full
        misses.finish(keys, out, hit, 0, 0, bounds, np.zeros(1, np.uint8), defaults)
    assert queue.drain(10.0)
    fields = dict(zip(_native.TABLE_STAT_FIELDS, stats.tolist()))
    assert fields["default_answered"] == 200 * 20
    assert fields["queued"] + fields["dropped"] == 200 * 20
    assert fields["dropped"] > 0
    assert defaults.tolist() == [[0, 200 * 20]]
    np.testing.assert_array_equal(out, np.full((20, VEC), DEFAULT, np.float32))
    assert set(cache.keys().tolist()) == set(keys.tolist())  # the queued ones went in
    queue.close()
    del misses, ct


def test_bad_arguments_are_refused_with_a_message(caches):
    table = _table("fp32")
    cache = caches("fp32")
    stats = np.zeros(len(_native.TABLE_STAT_FIELDS), np.int64)
    with pytest.raises(ValueError, match="insert queue"):
        _native.LocalMisses(
            _native_cache(cache), table.index, table.vectors, 0, DEFAULT, 0.5, True, None, stats
        )
    with pytest.raises(TypeError, match="ShmCacheView or a MissCache"):
        _native.LocalMisses(table, table.index, table.vectors, 0, DEFAULT, 0.5, False, None, stats)
    with pytest.raises(ValueError, match="stats"):
        _native.LocalMisses(
            _native_cache(cache),
            table.index,
            table.vectors,
            0,
            DEFAULT,
            0.5,
            False,
            None,
            stats[:3],
        )
    misses = _native.LocalMisses(
        _native_cache(cache), table.index, table.vectors, 0, DEFAULT, 0.5, False, None, stats
    )
    keys = table.keys[:4].copy()
    out = np.empty((4, VEC), np.float32)
    with pytest.raises(ValueError, match="bounds"):
        misses.finish(
            keys,
            out,
            np.zeros(4, np.uint8),
            0,
            0,
            np.array([0, 3], np.int64),
            np.zeros(1, np.uint8),
            np.zeros((1, 2), np.int64),
        )
    with pytest.raises(ValueError, match="hits"):
        misses.finish(
            keys,
            out,
            np.zeros(4, np.uint8),
            2,
            0,
            np.array([0, 4], np.int64),
            np.zeros(1, np.uint8),
            np.zeros((1, 2), np.int64),
        )


def test_a_failed_background_insert_is_counted_and_logged(caches, caplog):
    """A batch whose insert fails (here: an index that names a row the table lacks) is
    counted by the native queue and logged by the inserter; serving goes on."""
    table = _table("fp32")
    index = np.array(table.index, copy=True)
    used = np.flatnonzero(index[:, 1] >= 0)
    index[used, 1] = ROWS + 5  # every key now maps outside the table
    inserter = BackgroundInserter()
    cache = caches("fp32")
    stats = np.zeros(len(_native.TABLE_STAT_FIELDS), np.int64)
    misses = _native.LocalMisses(
        _native_cache(cache), index, table.vectors, 0, DEFAULT, 0.0, True, inserter.native, stats
    )
    keys = table.keys[:8].copy()
    out = np.empty((8, VEC), np.float32)
    with caplog.at_level("ERROR", logger="triton_rec"):
        _finish_all_missed(misses, keys, out)
        assert inserter.native.drain(10.0)
        failed, last = inserter.native.failures
        assert failed == 1 and "corrupt index" in last
        deadline = time.monotonic() + 5
        while "background insert failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "background insert failed" in caplog.text and "corrupt index" in caplog.text
    np.testing.assert_array_equal(out, np.full((8, VEC), DEFAULT, np.float32))
    inserter.close()
    del misses


def test_sync_misses_of_many_threads_all_land_in_the_cache(caches):
    """Eight threads answer requests that all miss, at once (threshold above 1.0: every miss
    fetched and inserted before the request returns). Every answer is the table's row and
    every key ends up cached: nothing is lost when inserts meet (on the device cache, and
    its twin here, they are gathered into shared writes: InsertBatcher)."""
    table = _table("fp32")
    cache = caches("fp32")
    stats = np.zeros(len(_native.TABLE_STAT_FIELDS), np.int64)
    misses = _native.LocalMisses(
        _native_cache(cache), table.index, table.vectors, 0, DEFAULT, 1.1, False, None, stats
    )

    def work(t):
        for r in range(25):
            first = (t * 25 + r) * 12
            keys = table.keys[first : first + 12].copy()
            out = np.empty((12, VEC), np.float32)
            defaults = np.zeros((1, 2), np.int64)
            _finish_all_missed(misses, keys, out, defaults)
            np.testing.assert_array_equal(out, table.vectors[first : first + 12])
            assert defaults.tolist() == [[0, 0]]

    run_in_threads(work, 8)
    assert set(cache.keys().tolist()) == set(table.keys[: 8 * 25 * 12].tolist())
    fields = dict(zip(_native.TABLE_STAT_FIELDS, stats.tolist()))
    assert fields["sync_fetched"] == fields["misses"] == 8 * 25 * 12


def _tables_of(precisions, caches_of, threshold=1.1):
    """One LocalMisses per precision over its own table and a fresh cache from
    ``caches_of(precision)`` (threshold 1.1: every miss fetched and inserted at once)."""
    out = []
    for precision in precisions:
        table = _table(precision)
        cache = caches_of(precision)
        stats = np.zeros(len(_native.TABLE_STAT_FIELDS), np.int64)
        misses = _native.LocalMisses(
            _native_cache(cache),
            table.index,
            table.vectors,
            RowCodec(precision, VEC).code,
            DEFAULT,
            threshold,
            False,
            None,
            stats,
        )
        out.append((table, cache, misses, stats))
    return out


def _query(cache, keys):
    out = np.empty((keys.shape[0], VEC), np.float32)
    hit = np.zeros(keys.shape[0], np.uint8)
    cache.query(keys, out, hit)
    return out, hit


def _array_cache(precision, lock=None):
    return ArrayEmbeddingCache(ROWS // 2, VEC, ways=4, precision=precision, lock=lock).host_view()


def test_a_requests_tables_insert_together_as_each_alone(caches):
    """The GPU paths answer a request's tables' misses with their inserts gathered and
    written together (PendingInserts: the device caches in one write, staged as
    gpu::write_many stages them; here the write kernel's twin, and a cache of the
    fixture's kind, which shm inserts alone). See compare_together."""
    compare_together(_array_cache, caches)


def compare_together(array_cache, other_cache, steps: int = 40) -> None:
    """A request's tables answered with finish_tables against the same tables answered one
    by one, each inserting at once: the same answers, default counts, counters and cache
    contents (keys and rows) after every request. Three tables on ``array_cache(precision)``
    (small enough to evict; fp32, fp16, int8) and one on ``other_cache("fp32")``; a table
    without keys now and then, and one whose keys all hit."""
    precisions = ("fp32", "fp16", "int8")
    together = _tables_of(precisions, array_cache) + _tables_of(("fp32",), other_cache)
    alone = _tables_of(precisions, array_cache) + _tables_of(("fp32",), other_cache)
    rng = np.random.default_rng(11)
    for step in range(steps):
        keys = []
        for t, (table, *_) in enumerate(together):
            n = 0 if t == 1 and step % 5 == 0 else int(rng.integers(1, 90))
            k = table.keys[rng.integers(0, ROWS, n)]
            k[: n // 10] = rng.integers(0, 10**6, n // 10) * 7 + 5  # no tier holds these
            keys.append(k.astype(np.int64))
        if step % 7 == 3:  # a table whose keys were all just inserted: every one hits
            keys[2] = keys[2][keys[2] % 7 == 3][:5]
        answers = []
        for tables in (together, alone):
            outs, hits, defaults = [], [], np.zeros(len(DEFAULT_CAUSES), np.int64)
            for (_, cache, _, _), k in zip(tables, keys):
                out, hit = _query(cache, k)
                outs.append(out)
                hits.append(hit)
            if tables is together:
                _native.finish_tables([t[2] for t in tables], keys, outs, hits, False, defaults)
            else:
                for (_, _, misses, _), k, out, hit in zip(tables, keys, outs, hits):
                    if hit.all():
                        continue
                    d = np.zeros((1, len(DEFAULT_CAUSES)), np.int64)
                    bounds = np.array([0, k.shape[0]], np.int64)
                    misses.finish(k, out, hit, int(hit.sum()), 0, bounds, np.zeros(1, np.uint8), d)
                    defaults += d[0]
            answers.append((outs, defaults))
        for t in range(len(together)):
            np.testing.assert_array_equal(answers[0][0][t], answers[1][0][t], err_msg=f"{step}")
        np.testing.assert_array_equal(answers[0][1], answers[1][1], err_msg=f"step {step}")
        for (_, ct, _, st), (_, ca, _, sa) in zip(together, alone):
            counted = {k: v for k, v in zip(_native.TABLE_STAT_FIELDS, st) if k not in TIMINGS}
            expect = {k: v for k, v in zip(_native.TABLE_STAT_FIELDS, sa) if k not in TIMINGS}
            assert counted == expect, f"step {step}"
            cached = np.sort(ct.keys())
            np.testing.assert_array_equal(cached, np.sort(ca.keys()), err_msg=f"step {step}")
            np.testing.assert_array_equal(_query(ct, cached)[0], _query(ca, cached)[0])
    assert all(int(st[_native.TABLE_STAT_FIELDS.index("sync_fetched")]) > 0 for *_, st in together)
    # the writes' time is the tables' cache time, as when each inserts alone (the queries
    # here are timed as 0 on both sides)
    ns = _native.TABLE_STAT_FIELDS.index("cache_ns")
    assert all(int(st[ns]) > 0 for *_, st in together), [int(t[3][ns]) for t in together]


def test_tables_written_together_take_their_writer_locks_in_one_order(tmp_path):
    """A request's device caches are written under all of their writer locks, taken in one
    order in every process (WriterLock.order: the lock file's inode), whatever the order of
    the tables: two writers of the same caches never wait for each other in a circle. Here
    the lock that comes later in that order is held while a thread writes the request's
    tables, that cache's table first: the thread must already hold the other lock (a
    non-blocking flock of its file fails) while it waits; then every insert lands."""
    import fcntl
    import os
    import threading

    paths = [tmp_path / f"lock{i}" for i in range(2)]
    fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in paths]
    first, later = sorted(range(2), key=lambda i: os.stat(paths[i]).st_ino)
    locks = [_native.WriterLock(fd) for fd in fds]
    try:
        made = iter(locks)
        tables = _tables_of(("fp32", "fp32"), lambda p: _array_cache(p, next(made)))
        order = [tables[later], tables[first]]  # the later lock's table first
        keys = [t[0].keys[:8].copy() for t in order]
        outs, hits = zip(*(_query(t[1], k) for t, k in zip(order, keys)))
        d = np.zeros(len(DEFAULT_CAUSES), np.int64)
        args = ([t[2] for t in order], keys, list(outs), list(hits), True, d)
        with locks[later]:
            writer = threading.Thread(target=_native.finish_tables, args=args)
            writer.start()
            probe = os.open(paths[first], os.O_RDWR)
            try:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # until the writer holds the first lock
                    try:
                        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        break
                    fcntl.flock(probe, fcntl.LOCK_UN)
                    time.sleep(0.01)
                else:
                    pytest.fail("the writer waited for the later lock without the first one")
            finally:
                os.close(probe)
            assert writer.is_alive()  # and it waits for the later one, held here
        writer.join(10)
        assert not writer.is_alive()
    finally:
        for fd in fds:
            os.close(fd)
    for table, cache, _, _ in tables:
        out, hit = _query(cache, table.keys[:8].copy())
        assert hit.all()
        np.testing.assert_array_equal(out, table.vectors[:8])


def test_requests_written_together_across_instances_of_one_cache(tmp_path):
    """The requests of several instances, each with its own attachment of the same cache
    (its own writer lock on the cache's lock file, another descriptor), are written
    together (PartsBatcher): while one thread writes, the requests that arrive wait and
    the next write takes them all, the cache's lock file locked once (a second flock of
    it through the other descriptor would wait for this very thread forever). Every
    answer is the table's row and every key lands. In a child process: a write that waits
    for itself hangs, and the child is killed after 60 s."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; from tests.unit.test_local_misses import writes_across_instances; "
        "writes_across_instances(sys.argv[1])"
    )
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a write of several instances' requests waited for itself (60 s)")
    assert done.returncode == 0, done.stderr[-3000:]


def writes_across_instances(directory: str) -> None:
    """The scenario of test_requests_written_together_across_instances_of_one_cache."""
    import os
    import threading

    path = os.path.join(directory, "lock")
    fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for _ in range(2)]
    locks = [_native.WriterLock(fd) for fd in fds]
    first = ArrayEmbeddingCache(ROWS, VEC, ways=4, lock=locks[0])
    second = ArrayEmbeddingCache.from_arrays(first.state_arrays(), lock=locks[1])
    table = _table("fp32")
    misses = [
        _native.LocalMisses(
            c.miss_cache(), table.index, table.vectors, 0, DEFAULT, 1.1, False, None,
            np.zeros(len(_native.TABLE_STAT_FIELDS), np.int64),
        )
        for c in (first, second)
    ]  # fmt: skip
    failures = []

    def request(i, which):
        try:
            keys = table.keys[i * 10 : (i + 1) * 10].copy()
            out = np.empty((10, VEC), np.float32)
            d = np.zeros(len(DEFAULT_CAUSES), np.int64)
            hit = np.zeros(10, np.uint8)
            _native.finish_tables([misses[which]], [keys], [out], [hit], True, d)
            np.testing.assert_array_equal(out, table.vectors[i * 10 : (i + 1) * 10])
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    with locks[0]:  # the first request's write waits here; the others queue behind it
        threads = [threading.Thread(target=request, args=(0, 0))]
        threads[0].start()
        time.sleep(0.2)
        for i in range(1, 7):
            threads.append(threading.Thread(target=request, args=(i, i % 2)))
            threads[-1].start()
        time.sleep(0.3)
    for t in threads:
        t.join()
    assert failures == [], failures
    assert set(first.host_view().keys().tolist()) == set(table.keys[:70].tolist())
