"""A device cache's misses in C++ (``_native.LocalMisses`` with the cache's write kernel,
``DeviceCache.miss_cache``) against the engine's Python rules on the same kind of cache:
the same requests give the same answers, default counts, counters and cache contents
(tests/unit/test_local_misses.py runs the same comparison on the CPU, with the kernel's
twin)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.test_local_misses import (
    ROWS,
    VEC,
    PythonRulesStore,
    _array_cache,
    _table,
    compare_rules,
    compare_together,
)
from triton_rec.cache.cached_table import BackgroundInserter, CachedTable
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
    try:
        snap = compare_rules(table, native, python, np.random.default_rng(7), 30)
        assert snap["misses"] > 0 and snap["not_found"] > 0
        assert snap["sync_fetched"] > 0 or threshold == 0.0
    finally:
        for ct in tables:
            ct.inserter.close()
        for s in shared:
            s.close(linger=0)


def test_a_requests_device_caches_insert_together_as_each_alone(cupy):
    """The inserts of a request's device caches in one write (gpu::write_many: one staging
    copy, a write launch per cache, one synchronization), as each cache inserting alone:
    tests/unit/test_local_misses.py's comparison with the write kernel itself, beside a
    twin cache (another kind: inserted alone)."""
    from triton_rec.cache.array_cache import ArrayEmbeddingCache

    def device_cache(precision):
        return ArrayEmbeddingCache(ROWS // 2, VEC, ways=4, precision=precision, xp=cupy).host_view()

    compare_together(device_cache, _array_cache)
