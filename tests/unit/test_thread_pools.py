"""limit_thread_pools: numpy's BLAS pool of an instance process runs the threads asked for.

Each case runs in a fresh interpreter (a pool limit is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, sys
    import numpy  # loads OpenBLAS with its own default pool (one thread per core)
    from threadpoolctl import threadpool_info
    before = {i["internal_api"]: i["num_threads"] for i in threadpool_info()}
    from triton_rec.thread_pools import limit_thread_pools
    after = limit_thread_pools(int(sys.argv[1]))
    print(json.dumps({"before": before, "after": after}))
""")


def probe(threads: int, env=None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")} | (env or {})
    out = subprocess.run([sys.executable, "-c", PROBE, str(threads)], capture_output=True, text=True,
                         env=env, timeout=60, check=True)
    return json.loads(out.stdout)


def test_blas_runs_one_thread_after_the_limit():
    got = probe(1)
    assert got["after"]["openblas"] == 1
    if os.cpu_count() > 1:
        assert got["before"]["openblas"] == os.cpu_count()  # what an unlimited stub would run


def test_a_larger_count_is_applied_too():
    assert probe(2)["after"]["openblas"] == 2


def test_zero_threads_is_refused():
    from triton_rec.thread_pools import limit_thread_pools

    with pytest.raises(ValueError):
        limit_thread_pools(0)
