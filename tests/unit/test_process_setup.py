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
    from triton_rec.triton.process_setup import limit_thread_pools
    after = limit_thread_pools(int(sys.argv[1]))
    print(json.dumps({"before": before, "after": after}))
""")


def probe(threads: int, env=None) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    } | (env or {})
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(threads)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_blas_runs_one_thread_after_the_limit():
    got = probe(1)
    assert got["after"]["openblas"].startswith("1 thread(s)")
    if os.cpu_count() > 1:
        assert got["before"]["openblas"] == os.cpu_count()  # what an unlimited stub would run


def test_a_larger_count_is_applied_too():
    assert probe(2)["after"]["openblas"].startswith("2 thread(s)")


def test_zero_threads_is_refused():
    from triton_rec.triton.process_setup import limit_thread_pools

    with pytest.raises(ValueError):
        limit_thread_pools(0)


def test_pre_avx2_kernels_on_an_avx2_cpu_are_corrected():
    from triton_rec.triton.process_setup import blas_coretype_fix

    avx512 = {"avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
    assert blas_coretype_fix("Prescott", avx512) == "SkylakeX"
    assert blas_coretype_fix("Prescott", {"avx2", "fma", "sse3"}) == "Haswell"
    assert blas_coretype_fix("Prescott", {"sse3"}) is None  # really an old CPU
    assert blas_coretype_fix("Cooperlake", avx512) is None  # detection worked
    assert blas_coretype_fix(None, avx512) is None


def test_the_user_setting_always_stands():
    from triton_rec.triton.process_setup import server_blas_environment

    assert server_blas_environment({"OPENBLAS_CORETYPE": "Haswell"}) == {}


def test_instances_started_with_the_server_environment_load_avx2_kernels_on_an_avx2_cpu():
    from triton_rec.triton.process_setup import (
        _PRE_AVX2_KERNELS,
        cpu_flags,
        server_blas_environment,
    )

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env.update(server_blas_environment(env))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import numpy, threadpoolctl; print(next(i['architecture'] "
            "for i in threadpoolctl.threadpool_info() if i['internal_api'] == 'openblas'))",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    if {"avx2", "fma"} <= cpu_flags():
        assert out.stdout.strip().lower() not in _PRE_AVX2_KERNELS, (
            out.stdout,
            env.get("OPENBLAS_CORETYPE"),
        )


ALLOC = textwrap.dedent("""
    import ctypes, resource, sys
    import numpy as np
    ctypes.CDLL(None).mallopt(-3, 128 << 10)  # what a host process may have set (fixed, small)
    if sys.argv[1] == "tune":
        from triton_rec.triton.process_setup import tune_allocator
        print(tune_allocator({}), file=sys.stderr)
    x = np.ones((1024, 27, 32), np.float32)
    def request():  # temporaries of a few MB, as a 1,024-sample request makes
        y = x @ x.transpose(0, 2, 1)
        return float(np.concatenate([y.reshape(1024, -1)] * 2, axis=1).sum())
    for _ in range(5):
        request()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        request()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20)
""")


def _faults_per_request(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", ALLOC, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return float(out.stdout.strip())


def test_the_tuned_allocator_keeps_large_temporaries_without_page_faults():
    untuned = _faults_per_request("none")
    assert untuned > 500, untuned  # the control: every request maps its temporaries afresh
    assert _faults_per_request("tune") < 10


def test_malloc_settings_in_glibc_tunables_stand():
    from triton_rec.triton.process_setup import tune_allocator

    assert "kept" in tune_allocator({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
