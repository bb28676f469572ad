"""The device cache's per-set locks (array_cache_rules.hpp ``begin_write``), on the write
kernel's CPU twin: the native miss writes hold the cache's writer lock *shared* and lock
each set they write, so writers of other threads and processes write beside them; a set
another writer holds is waited for, then left to a retry under the lock held exclusively,
which also heals a set a dead writer left half-written (bindings_array_cache.hpp
``ArrayMissCache``). The GPU runs the same rules in ``trec_cache_write``
(tests/unit/test_gpu_host_paths.py runs its host side against the fake driver)."""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
import uuid

import numpy as np
import pytest

from triton_rec import _native
from triton_rec.cache import gpu_share
from triton_rec.cache.array_cache import ArrayEmbeddingCache
from triton_rec.cache.array_cache_state import host_array
from triton_rec.storage.table import EmbeddingTable

VEC = 4
ROWS = 2000
DEFAULT = -1.0
CAPACITY = 32  # the processes' shared cache: 8 sets of 4 ways


def _table() -> EmbeddingTable:
    keys = np.arange(ROWS, dtype=np.int64) * 3 + 1
    vectors = (keys[:, None] * 0.5 + np.arange(VEC)).astype(np.float32)
    return EmbeddingTable("t", keys, vectors, DEFAULT)


def _misses(cache: ArrayEmbeddingCache, table: EmbeddingTable):
    """LocalMisses over ``table`` inserting into ``cache`` through the twin's miss cache
    (threshold 1.1: every miss fetched and inserted before the request returns)."""
    stats = np.zeros(len(_native.TABLE_STAT_FIELDS), np.int64)
    miss_cache = cache.miss_cache()
    assert miss_cache is not None
    return _native.LocalMisses(
        miss_cache, table.index, table.vectors, 0, DEFAULT, 1.1, False, None, stats
    )


def _request(misses, keys: np.ndarray) -> np.ndarray:
    """One request whose every key missed the cache: its answers."""
    n = keys.shape[0]
    out = np.empty((n, VEC), np.float32)
    bounds = np.array([0, n], np.int64)
    defaults = np.zeros((1, 2), np.int64)
    misses.finish(keys, out, np.zeros(n, np.uint8), 0, 0, bounds, np.zeros(1, np.uint8), defaults)
    return out


def _held(cache: ArrayEmbeddingCache, keys: np.ndarray) -> set:
    _, hit = cache.query(keys)
    return set(keys[host_array(hit)].tolist())


def _set_of(cache: ArrayEmbeddingCache, keys: np.ndarray) -> np.ndarray:
    return host_array(cache.set_of(keys))


@pytest.fixture
def lock_file(tmp_path):
    fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


def _in_thread(work) -> threading.Thread:
    t = threading.Thread(target=work, daemon=True)
    t.start()
    return t


def test_a_native_write_goes_beside_a_live_writer_and_waits_only_for_its_set(lock_file):
    """See beside_a_live_writer; the twin (tests/gpu/test_set_locks_gpu.py: the kernel)."""
    beside_a_live_writer(
        lambda lock: ArrayEmbeddingCache(64 * 8, VEC, ways=8, lock=lock), lock_file
    )


def beside_a_live_writer(make_cache, lock_file: int) -> None:
    """Another writer holds the cache's lock (shared, as a native write does) and is in
    one set (its sequence number odd). A request whose misses fall in other sets is
    written at once, beside it (under one lock for the whole cache it would wait); one
    with a key in that set waits, and the set is not healed from under the live writer
    (its keys stay); once the writer leaves it, the key goes in."""
    table = _table()
    lock = _native.WriterLock(lock_file)
    cache = make_cache(lock)
    misses = _misses(cache, table)
    first = table.keys[:40].copy()
    _request(misses, first)
    assert _held(cache, first) == set(first.tolist())

    sets = _set_of(cache, table.keys)
    busy_set = int(sets[0])
    in_busy = table.keys[sets == busy_set]
    earlier = np.array([k for k in first.tolist() if k in set(in_busy.tolist())], np.int64)
    assert earlier.shape[0]  # the set holds keys the heal would drop
    others = table.keys[(sets != busy_set) & (np.arange(ROWS) >= 40)][:30].copy()
    late = np.array([k for k in in_busy.tolist() if k not in earlier][:1], np.int64)

    lock.acquire_shared()
    cache.seq[busy_set] += 1  # the live writer is in the set
    try:
        beside = _in_thread(lambda: _request(misses, others))
        beside.join(20)
        assert not beside.is_alive(), "a write of other sets waited for the live writer"
        assert _held(cache, others) == set(others.tolist())
        waiting = _in_thread(lambda: _request(misses, late))
        time.sleep(0.3)
        assert waiting.is_alive(), "a key of the held set was written from under its writer"
        assert int(cache.seq[busy_set]) % 2 == 1
    finally:
        cache.seq[busy_set] += 1  # the writer leaves the set, then the lock
        lock.release_shared()
    waiting.join(20)
    assert not waiting.is_alive()
    assert _held(cache, late) == set(late.tolist())
    assert _held(cache, earlier) == set(earlier.tolist()), "the live writer's set was healed"
    assert cache.stats()["recovered_sets"] == 0


def test_a_set_a_dead_writer_left_is_healed_by_the_next_native_write(lock_file):
    """See after_a_dead_writer; the twin (tests/gpu/test_set_locks_gpu.py: the kernel)."""
    after_a_dead_writer(lambda lock: ArrayEmbeddingCache(64 * 8, VEC, ways=8, lock=lock), lock_file)


def after_a_dead_writer(make_cache, lock_file: int) -> None:
    """A writer died in a set (its sequence number left odd, its lock given back by its
    death): the next native write of a key there waits for the set, gives up, takes the
    lock exclusively, heals the set (its keys dropped: their rows may be torn) and writes."""
    table = _table()
    cache = make_cache(_native.WriterLock(lock_file))
    misses = _misses(cache, table)
    sets = _set_of(cache, table.keys)
    dead_set = int(sets[0])
    in_set = table.keys[sets == dead_set]
    _request(misses, in_set[:2].copy())
    cache.seq[dead_set] += 1
    key = in_set[2:3].copy()
    out = _request(misses, key)
    np.testing.assert_array_equal(out, table.vectors[sets == dead_set][2:3])
    assert _held(cache, in_set[:3]) == {int(key[0])}
    assert int(cache.seq[dead_set]) % 2 == 0
    assert cache.stats()["recovered_sets"] == 1


def _write_alongside(name: str, worker: int, seconds: float, go, results) -> None:
    """Spawned process: attach to the shared cache and write through the native miss path
    for ``seconds`` (worker 0: the Python writer's updates, under the lock held
    exclusively)."""
    shared = gpu_share.open_shared_cache(name, CAPACITY, VEC, ways=4, policy="lru")
    try:
        table = _table()
        misses = _misses(shared.cache, table)
        rng = np.random.default_rng(worker)
        go.wait(60)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            keys = np.unique(table.keys[rng.integers(0, 300, 24)])
            rows = table.vectors[(keys - 1) // 3]
            out, hit = shared.cache.query(keys)
            if not np.array_equal(out[hit], rows[hit]):
                raise AssertionError("a hit's row is not the key's")
            if worker == 0:
                shared.cache.update(keys, rows)
            elif not np.array_equal(_request(misses, keys), rows):
                raise AssertionError("a request's answer is not the table's")
        results.put((worker, "ok"))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((worker, repr(e)))
    finally:
        shared.close()


def test_processes_writing_one_cache_at_once_leave_it_whole():
    """Three processes insert their misses into one small cache at once for two seconds
    (8 sets of 4 ways, 300 keys: every write evicts, and the writers meet in the same
    sets) while a fourth updates rows under the lock held exclusively; all of them read
    it too. Every hit is the key's row; no set was healed (no writer died: a set healed
    is one a writer took from under another); afterwards every held key's row is its
    own, no key is held twice in a set, and no set is left odd. (Healing from under live
    writers, as a writer under one lock for the whole cache may, did so about 600 times
    in a run.)"""
    name = f"test-setlocks-{uuid.uuid4().hex[:10]}"
    owner = gpu_share.open_shared_cache(name, CAPACITY, VEC, ways=4, policy="lru")
    procs = []
    try:
        ctx = multiprocessing.get_context("spawn")
        go, results = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(target=_write_alongside, args=(name, w, 2.0, go, results)) for w in range(4)
        ]
        for p in procs:
            p.start()
        go.set()
        got = sorted(results.get(timeout=240) for _ in procs)
        assert got == [(w, "ok") for w in range(4)]
        for p in procs:
            p.join(60)
        c = owner.cache
        assert int((c.seq % 2).sum()) == 0
        table = _table()
        for s in range(c.num_sets):
            held = c.slot_keys[s][c.valid[s].astype(bool)]
            assert len(set(held.tolist())) == held.shape[0], f"set {s} holds a key twice"
        keys = c.cached_keys()
        out, hit = c.query(keys)
        assert hit.all()
        np.testing.assert_array_equal(out, table.vectors[(keys - 1) // 3])
        stats = c.stats()
        assert stats["inserts"] > 0 and stats["evictions"] > 0
        assert stats["recovered_sets"] == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        owner.close(linger=0)


def _lock_of(path: str):
    """A WriterLock on the file at ``path`` through an open file of its own."""
    fd = os.open(path, os.O_RDWR)
    try:
        return _native.WriterLock(fd)
    finally:
        os.close(fd)


#: how long the holders go on if no writer gets in (the test's bound when it fails)
HOLDERS_GIVE_UP_S = 60.0


def _overlapping_shared_holders(lock, stop, ready, outcome) -> None:
    """Two threads holding ``lock`` (a WriterLock, or the path of its file) shared in turns
    that overlap: each lets go only once the other has come in after it (or after 0.5 s
    without that), so it is never let go of unless a writer's gate holds one of them off;
    until ``stop`` is set (or HOLDERS_GIVE_UP_S pass). ``outcome``: "stopped" or "gave up"."""
    lock = _lock_of(lock) if isinstance(lock, str) else lock
    end = time.monotonic() + HOLDERS_GIVE_UP_S
    turn = threading.Condition()
    entries, gave_up = [0], []

    def hold() -> None:
        while not stop.is_set():
            if time.monotonic() >= end:  # decided before the writer can be in
                gave_up.append(True)
                break
            lock.acquire_shared()
            with turn:
                entries[0] += 1
                mine = entries[0]
                turn.notify_all()
                turn.wait_for(lambda m=mine: entries[0] > m or stop.is_set(), timeout=0.5)
            lock.release_shared()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    ready.set()
    for t in threads:
        t.join()
    outcome.put("gave up" if gave_up else "stopped")


@pytest.mark.parametrize("where", ["same lock", "thread", "process"])
def test_a_writer_is_not_starved_by_shared_holders_that_overlap(tmp_path, where):
    # Instances inserting misses under load hold a cache's lock shared in turns that
    # overlap. Neither flock nor glibc's shared mutex keeps new shared holders out while a
    # writer waits, and a process holds the file's lock shared while any of its threads
    # does: the writer (an online update, a heal) waited for as long as the load lasted
    # (writer_lock.hpp: the writer's gate). Here the holders go on until the writer has
    # been in: it must get in while they do, not after they give up on their own. Checked
    # to fail (the holders gave up first) without the gates.
    path = str(tmp_path / "lock")
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    writer = _lock_of(path)  # an open file of its own: another holder of the flock
    shared = writer if where == "same lock" else path  # or the threads' own WriterLock
    if where == "process":
        ctx = multiprocessing.get_context("spawn")
        stop, ready, outcome = ctx.Event(), ctx.Event(), ctx.Queue()
        holders = ctx.Process(
            target=_overlapping_shared_holders, args=(shared, stop, ready, outcome)
        )
    else:
        stop, ready, outcome = threading.Event(), threading.Event(), queue.Queue()
        holders = threading.Thread(
            target=_overlapping_shared_holders, args=(shared, stop, ready, outcome)
        )
    holders.start()
    try:
        assert ready.wait(60)
        time.sleep(0.3)  # the holders' turns overlap by now
        writer.acquire()
        writer.release()
    finally:
        stop.set()
        holders.join(HOLDERS_GIVE_UP_S + 30)
    assert outcome.get(timeout=30) == "stopped"  # the writer got in while they went on
