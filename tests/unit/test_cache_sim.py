"""The offline cache-policy simulator (benchmarks/cache_sim.py) on small traces."""

import numpy as np
import pytest

from tests.benchmark_scripts import load_benchmark

cs = load_benchmark("cache_sim")

ONLINE = ("lru", "tinylfu", "tinylfu_255", "lru_full", "tinylfu_full", "belady_demand")


def _hits(policy, trace, capacity, ways=8, num_sets=None, count_from=0):
    p = cs.make_policy(policy, capacity, ways, num_sets, trace)
    return p.run(trace, count_from)


def _small_trace(alpha=1.0, n=2000, length=20000, seed=3):
    return cs.zipf_trace(n, length, alpha, seed)


@pytest.mark.parametrize("alpha", [0.8, 1.2])
@pytest.mark.parametrize("capacity", [16, 64, 256])
def test_belady_hits_at_least_as_often_as_every_other_policy(alpha, capacity):
    trace = _small_trace(alpha)
    opt = _hits("belady", trace, capacity)
    for name in ONLINE:
        assert opt >= _hits(name, trace, capacity), name


def test_belady_beats_the_other_policies_on_a_scan_polluted_trace_too():
    trace = cs.scan_polluted_trace(hot=300, length=20000, scan_len=400, scan_every=1500, seed=1)
    opt = _hits("belady", trace, 128)
    for name in ONLINE:
        assert opt >= _hits(name, trace, 128), name


def test_set_associative_lru_with_one_set_equals_fully_associative_lru():
    trace = _small_trace(0.9, length=15000)
    for cap in (8, 40, 200):
        sa = cs.SetAssocLRU(cap, ways=cap, num_sets=1)
        full = cs.FullLRU(cap)
        assert [sa.access(k) for k in trace.tolist()] == [full.access(k) for k in trace.tolist()]
        assert _hits("lru", trace, cap, ways=cap, num_sets=1) == _hits("lru_full", trace, cap)


def _reference_set_assoc_lru(trace, ways, num_sets):
    """Brute force: one Python list per set, most recent last."""
    sets = [[] for _ in range(num_sets)]
    out = []
    for k in trace:
        s = sets[cs.mix64(k) % num_sets]
        if k in s:
            s.remove(k)
            s.append(k)
            out.append(True)
        else:
            if len(s) >= ways:
                s.pop(0)
            s.append(k)
            out.append(False)
    return out


@pytest.mark.parametrize("ways,num_sets", [(8, 16), (4, 8), (2, 1), (1, 32)])
def test_set_associative_lru_matches_a_list_based_reference_on_a_random_trace(ways, num_sets):
    rng = np.random.default_rng(ways * 100 + num_sets)
    trace = rng.integers(-500, 500, size=6000).tolist()  # negative keys too
    expected = _reference_set_assoc_lru(trace, ways, num_sets)
    p = cs.SetAssocLRU(ways * num_sets, ways, num_sets)
    assert [p.access(k) for k in trace] == expected
    assert cs.SetAssocLRU(ways * num_sets, ways, num_sets).run(np.array(trace)) == sum(expected)


def test_fully_associative_lru_matches_a_list_based_reference():
    rng = np.random.default_rng(7)
    trace = rng.integers(0, 300, size=5000).tolist()
    p = cs.FullLRU(50)
    assert [p.access(k) for k in trace] == _reference_set_assoc_lru(trace, 50, 1)


@pytest.mark.parametrize(
    "name", ["lru", "tinylfu", "tinylfu_255", "lru_full", "tinylfu_full", "belady", "belady_demand"]
)
def test_the_fast_run_loop_gives_the_same_hits_as_calling_access_per_key(name):
    trace = _small_trace(1.0, n=3000, length=30000, seed=5)
    cap = 128
    p = cs.make_policy(name, cap, 8, None, trace)
    per_key = sum(p.access(k) and i >= 1000 for i, k in enumerate(trace.tolist()))
    assert per_key == _hits(name, trace, cap, count_from=1000)
    assert len(p) <= cap


def test_tinylfu_beats_lru_on_a_scan_polluted_zipf_trace():
    trace = cs.scan_polluted_trace(
        hot=400, length=60000, scan_len=600, scan_every=1000, alpha=0.8, seed=2
    )
    half = len(trace) // 2
    for lru, tiny, cap in (("lru", "tinylfu", 256), ("lru_full", "tinylfu_full", 256)):
        h_lru = _hits(lru, trace, cap, count_from=half)
        h_tiny = _hits(tiny, trace, cap, count_from=half)
        assert h_tiny > 1.15 * h_lru, (lru, h_lru, h_tiny)


@pytest.mark.parametrize("name", ["lru_full", "belady"])
def test_hit_rate_does_not_decrease_with_cache_size(name):
    trace = _small_trace(0.9, n=3000, length=20000, seed=11)
    hits = [_hits(name, trace, cap) for cap in (1, 8, 32, 100, 400, 1500, 3000)]
    assert hits == sorted(hits), hits
    assert hits[-1] == len(trace) - len(np.unique(trace))  # everything fits: only cold misses


@pytest.mark.parametrize("alpha", [0.9, 1.05, 1.2])
def test_the_zipf_generator_top_key_frequency_is_close_to_theory(alpha):
    n, length = 20000, 400000
    keys, ranks, key_of_rank = cs.zipf_trace(n, length, alpha, seed=1, return_ranks=True)
    p1 = 1.0 / np.sum(np.arange(1, n + 1, dtype=np.float64) ** -alpha)
    f1 = np.mean(keys == key_of_rank[0])
    sd = np.sqrt(p1 * (1 - p1) / length)
    assert abs(f1 - p1) < 5 * sd, (f1, p1)
    assert np.array_equal(keys, key_of_rank[ranks])
    assert len(np.unique(key_of_rank)) == n


def test_zipf_traces_are_seeded_and_key_ids_are_not_ordered_by_popularity():
    a = cs.zipf_trace(5000, 10000, 1.05, seed=4)
    assert np.array_equal(a, cs.zipf_trace(5000, 10000, 1.05, seed=4))
    assert not np.array_equal(a, cs.zipf_trace(5000, 10000, 1.05, seed=5))
    _, _, key_of_rank = cs.zipf_trace(5000, 10, 1.05, seed=4, return_ranks=True)
    rho = np.corrcoef(np.arange(5000), key_of_rank.astype(np.float64))[0, 1]
    assert abs(rho) < 0.1


def test_the_count_min_sketch_saturates_at_15_and_halves_after_ten_times_capacity():
    sk = cs.CountMinSketch(capacity=4)
    assert sk.width == 64 and sk.sample == 40
    assert cs.CountMinSketch(capacity=100).width == 1024
    for _ in range(20):
        sk.record(123)
    assert sk.estimate(123) == 15
    for _ in range(19):
        sk.record(456)  # 39 recorded: not yet halved
    assert sk.estimate(123) == 15 and sk.resets == 0
    sk.record(456)
    assert sk.resets == 1 and sk.estimate(123) == 7 and sk.count == 0


def test_tinylfu_always_admits_into_a_free_way_and_rejects_a_cold_key_against_a_hot_victim():
    p = cs.SetAssocTinyLFU(4, ways=4, num_sets=1)
    for k in (1, 2, 3, 4):
        assert p.access(k) is False
    assert len(p) == 4 and p.rejected == 0
    for _ in range(3):
        for k in (1, 2, 3, 4):
            assert p.access(k) is True
    assert p.access(99) is False and p.rejected == 1 and 99 not in p.sets[0]
    # once 99 has become more frequent than the LRU victim, it gets in
    for _ in range(5):
        p.access(99)
    assert 99 in p.sets[0]


def test_effective_capacity_rounds_to_ways_times_a_power_of_two_sets():
    assert cs.effective_capacity(0.05, 163840, 8) == (8192, 1024)
    assert cs.effective_capacity(0.01, 163840, 8) == (2048, 256)
    assert cs.effective_capacity(0.0001, 100, 8) == (8, 1)


def test_the_command_line_writes_the_table_and_the_json(tmp_path):
    md, js = tmp_path / "t.md", tmp_path / "r.json"
    assert (
        cs.main(
            [
                "--n",
                "2000",
                "--length",
                "6000",
                "--alphas",
                "1.0",
                "--sizes",
                "0.05,0.2",
                "--policies",
                "lru,tinylfu,belady",
                "--jobs",
                "1",
                "--out-md",
                str(md),
                "--json",
                str(js),
            ]
        )
        == 0
    )
    text = md.read_text()
    assert "| alpha |" in text and "unbounded" in text and text.count("\n") == 4
    import json

    doc = json.loads(js.read_text())
    assert len(doc["results"]) == 6 and doc["machine"]["nproc"] >= 1
    for r in doc["results"]:
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["accesses"] == 3000


def test_belady_never_exceeds_the_unbounded_cache_and_reaches_it_when_everything_fits():
    trace = _small_trace(1.1, n=1000, length=8000, seed=2)
    half = len(trace) // 2
    ceiling = cs.infinite_cache_hit_rate(trace, half)
    for cap in (16, 128, 1000):
        assert _hits("belady", trace, cap, count_from=half) <= round(ceiling * (len(trace) - half))
    assert _hits("belady", trace, 1000, count_from=half) == round(ceiling * (len(trace) - half))


def test_an_8_bit_sketch_keeps_counting_past_15():
    sk = cs.CountMinSketch(capacity=100, max_count=255)
    for _ in range(300):
        sk.record(5)
    assert sk.estimate(5) == 255 and cs.CountMinSketch(100).max == 15
