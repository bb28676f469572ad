"""A device cache's misses in C++ (``_native.LocalMisses`` with the cache's write kernel,
``DeviceCache.miss_cache``) against the engine's Python rules on the same kind of cache:
the same requests give the same answers, default counts, counters and cache contents
(tests/unit/test_local_misses.py runs the same comparison on the CPU, with the kernel's
twin)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_local_misses import ROWS, VEC, PythonRulesStore, _counters, _table
from triton_rec.cache.cached_table import DEFAULT_CAUSES, BackgroundInserter, CachedTable
from triton_rec.storage.backing_store import LocalTableStore


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("threshold", [0.0, 0.8, 1.1])
def test_device_cache_misses_natively_as_the_python_rules(cupy, tmp_path, precision, threshold):
    from triton_rec.cache.gpu_share import open_shared_cache

    table = _table(precision)
    shared, tables = [], []
    for i, store_type in enumerate((LocalTableStore, PythonRulesStore)):
        s = open_shared_cache(
            f"lm{i}", 8 * ROWS, VEC, device=0, directory=str(tmp_path), precision=precision
        )
        shared.append(s)
        cache = s.cache.host_view()
        ct = CachedTable("t", store_type(table), cache, threshold, BackgroundInserter())
        tables.append(ct)
    native, python = tables
    assert native.local_misses is not None and python.local_misses is None
    rng = np.random.default_rng(7)
    try:
        for step in range(30):
            requests = int(rng.integers(1, 4))
            segments = [int(rng.integers(0, 60)) for _ in range(requests)]
            m = sum(segments)
            hot = table.keys[rng.integers(0, 80, m)]
            cold = table.keys[rng.integers(0, ROWS, m)]
            absent = rng.integers(0, 10**6, m) * 7 + 5
            pick, warm = rng.random(m), rng.uniform(0.3, 1.0)
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
        snap = _counters(native)
        assert snap["misses"] > 0 and snap["not_found"] > 0
        assert snap["sync_fetched"] > 0 or threshold == 0.0
    finally:
        for ct in tables:
            ct.inserter.close()
        for s in shared:
            s.close(linger=0)
