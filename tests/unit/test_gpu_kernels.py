"""The GPU kernels without a GPU: they compile (NVRTC, to PTX for sm_80 and sm_90), and
their rules, run by the CPU twin (the same C++ the kernels include), agree bit for bit with
the numpy reference (ArrayEmbeddingCache) on random and adversarial operation sequences.
The kernels themselves run against the same reference in tests/gpu (``make gpu-check``)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.xcache_harness import (
    MANY_TABLES,
    TwinCache,
    check_one_launch,
    keys_in_set,
    operations,
    rows_for,
    run_against_reference,
)
from triton_rec import _native
from triton_rec.cache.array_cache import ArrayEmbeddingCache
from triton_rec.gpu import kernels, nvrtc

KERNELS = ("trec_lookup_tables", "trec_cache_write", "trec_cache_clear", "trec_cache_repair",
           "trec_combine_tables", "trec_scatter_rows")  # fmt: skip


@pytest.mark.parametrize("arch", kernels.CI_ARCHS)
def test_kernels_compile_to_ptx_for_each_architecture(arch):
    ptx = kernels.ptx(arch)
    assert re.search(rf"\.target sm_{arch}\b", ptx), ptx[:400]
    for name in KERNELS:  # every kernel the driver code looks up is there
        assert re.search(rf"\.entry {name}\(", ptx), name


def test_kernels_compile_for_the_oldest_architecture_nvrtc_offers():
    # what a device older than CI_ARCHS loads: an intrinsic of newer devices only (such as
    # __nanosleep, Volta on) must stay behind a __CUDA_ARCH__ check
    oldest = min(nvrtc.supported_archs())
    ptx = kernels.ptx(oldest)
    assert re.search(rf"\.target sm_{oldest}\b", ptx), ptx[:400]
    for name in KERNELS:
        assert re.search(rf"\.entry {name}\(", ptx), name


@pytest.mark.parametrize("cc", kernels.CI_ARCHS)
def test_a_device_gets_machine_code_for_its_own_architecture(cc):
    # cubin (an ELF image) loads on any driver that knows the architecture; PTX only on
    # a driver at least as new as the NVRTC that made it
    assert nvrtc.has_cubin()
    assert kernels.image(cc)[:4] == b"\x7fELF"
    assert kernels.image(cc + 1 if cc + 1 not in nvrtc.supported_archs() else 999)[:4] != b"\x7fELF"


def test_a_kernel_that_does_not_compile_is_refused_with_the_compilers_log():
    with pytest.raises(nvrtc.NvrtcError, match="(?s)broken.cu does not compile.*undefined_thing"):
        nvrtc.compile_ptx("__global__ void k() { undefined_thing(); }", "broken.cu", 80)


def test_the_embedded_sources_are_the_repository_files():
    # _native embeds them at build time: a stale build would compile other kernels
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "src" / "native"
    for name, text in kernels.sources().items():
        path = next(root.rglob(name))
        assert path.read_text() == text, f"{name}: rebuild the native module (make install)"
    assert kernels.main_file() == "cache_kernels.cu"


def test_arch_for_picks_the_newest_supported_architecture_not_above_the_device():
    archs = nvrtc.supported_archs()
    assert kernels.arch_for(90) == max(a for a in archs if a <= 90)
    assert kernels.arch_for(86) == max(a for a in archs if a <= 86)
    with pytest.raises(nvrtc.NvrtcError):
        kernels.arch_for(min(archs) - 1)


def test_the_driver_is_optional_and_says_why_it_is_missing():
    why = _native.cuda_unavailable()
    if why:  # this machine: no driver; asking for a device names the cause
        with pytest.raises(RuntimeError, match="CUDA"):
            _native.cuda_device_info(0)
    else:
        assert _native.cuda_device_info(0)["compute_capability"] >= 50


CASES = [
    # (capacity, vec_size, ways, policy, precision, seed)
    (64, 8, 8, "lru", "fp32", 1),
    (50, 5, 4, "lru", "fp32", 2),
    (300, 16, 8, "tinylfu", "fp32", 3),
    (40, 13, 1, "lru", "int8", 4),
    (200, 7, 64, "tinylfu", "fp16", 5),
    (128, 33, 32, "lru", "int8", 6),
    (90, 4, 3, "tinylfu", "int8", 7),
]


@pytest.mark.parametrize("capacity,vec,ways,policy,precision,seed", CASES)
def test_the_cpu_twin_of_the_kernels_agrees_with_the_numpy_reference(
    capacity, vec, ways, policy, precision, seed
):
    ref = ArrayEmbeddingCache(capacity, vec, ways=ways, policy=policy, precision=precision)
    twin = TwinCache(ref)

    def make_odd(sets):
        twin.arrays["seq"][sets] |= 1

    seen = run_against_reference(ref, twin, twin.state, operations(ref, seed, 120), make_odd)
    # the sequence exercised what it is there for
    assert seen["hits"] > 0 and seen["misses"] > 0 and seen["inserted"] > 0
    assert seen["evicted"] + seen["overflow"] > 0 and seen["recovered"] + seen["torn"] > 0
    if policy == "tinylfu":
        assert seen["rejected"] > 0


def test_the_twin_stamps_lru_order_and_halves_the_tinylfu_sketch_as_the_reference():
    ref = ArrayEmbeddingCache(16, 4, ways=4, policy="tinylfu")
    twin = TwinCache(ref)
    crowd = keys_in_set(ref, 0, 9)
    ops = [("insert", (crowd[:4], rows_for(ref, crowd[:4])))]
    ops += [("query", (crowd[[0, 2]],))] * 3  # 0 and 2 recent, 1 and 3 old
    ops += [("query", (np.repeat(crowd[4:6], 40),))]  # 4, 5 now frequent: admitted over 1, 3
    ops += [("insert", (crowd[4:9], rows_for(ref, crowd[4:9])))]
    ops += [("query", (np.arange(1000, dtype=np.int64),))] * 2  # past 10 x slots: aging
    seen = run_against_reference(ref, twin, twin.state, ops, lambda s: None)
    assert ref.stats()["sketch_agings"] >= 1
    # 4 ways: keys 4 and 5 (40 queries each) replace the two old ways 1 and 3; keys 6 and 7
    # (never seen) lose to 0 and 2 (queried 3 times); key 8 finds no way left to give
    assert (seen["inserted"], seen["evicted"], seen["rejected"], seen["overflow"]) == (6, 2, 2, 1)


def test_the_kernels_bindings_check_their_arguments_as_the_rest_of_native():
    ref = ArrayEmbeddingCache(16, 4, ways=4)
    view = ref.native_view()  # the cache's own view of its (numpy) arrays
    keys = np.arange(3, dtype=np.int64)
    out, status = np.empty((3, 4), np.float32), np.empty(3, np.uint8)
    _native.cache_twin_query(view, keys, out, status)  # well formed
    with pytest.raises(TypeError, match="out must be float32"):
        _native.cache_twin_query(view, keys, out.astype(np.float64), status)
    with pytest.raises(ValueError, match=r"out has shape \(4, 3\), expected \(3, 4\)"):
        _native.cache_twin_query(view, keys, np.empty((4, 3), np.float32), status)
    with pytest.raises(TypeError, match="status must be uint8"):
        _native.cache_twin_query(view, keys, out, status.view(np.int8))
    with pytest.raises(ValueError, match="keys must be 1-D"):
        _native.cache_twin_query(view, keys.reshape(1, 3), out, status)
    with pytest.raises(ValueError, match="status must be writable"):
        status.flags.writeable = False
        _native.cache_twin_query(view, keys, out, status)


def _twin_handles():
    """check_one_launch's make_cache and make_table for the twin (host memory)."""

    def make_cache(ref):
        twin = TwinCache(ref)
        return twin.view, twin.state

    def make_table(index, rows, code, dim, default, mode):
        return (index, rows, code, dim, default)

    return make_cache, make_table


def test_one_launch_looks_up_caches_and_whole_tables_as_each_alone_on_the_twin():
    # trec_lookup_tables' twin: the tables of a request (caches of each policy and
    # precision, one without keys, whole tables) in one call; the kernel runs the same case
    # in tests/gpu/test_kernels_gpu.py
    check_one_launch(*_twin_handles(), _native.twin_lookup_tables)


@pytest.mark.parametrize("n,span", [(0, 10), (1, 10), (500, 40), (5_000, 3_000), (20_000, 10**12)])
def test_group_writes_gives_each_set_its_distinct_keys_last_occurrence_in_batch_order(n, span):
    # what the write kernel is handed (array_cache_twin.hpp group_writes), against its
    # contract written out in Python: every distinct key once, at its last occurrence;
    # grouped by set, each set once; batch order within a set
    ref = ArrayEmbeddingCache(1024, 4, ways=4)
    view = ref.native_view()
    rng = np.random.default_rng(n)
    keys = rng.integers(-span, span, n).astype(np.int64)
    if n > 2:
        keys[-2:] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max]
    got_keys, src, sets, starts = _native.group_writes(view, keys)
    last = {int(k): i for i, k in enumerate(keys)}
    assert sorted(src.tolist()) == sorted(last.values())
    assert np.array_equal(keys[src], got_keys)
    assert len(set(sets.tolist())) == sets.size and starts[0] == 0 and starts[-1] == src.size
    set_of = ref.set_of(keys) if n else np.empty(0, np.int64)
    for t, s in enumerate(sets):
        part = src[starts[t] : starts[t + 1]]
        assert part.size > 0 and np.all(set_of[part] == s)
        assert np.all(np.diff(part) > 0)  # batch order


def test_a_request_of_more_tables_than_one_launch_serves_is_split_and_answered_whole():
    # 70 tables (one launch serves _native's 64): the twin runs the GPU path's split
    # (gpu_ops.hpp each_launch), and each table answers as it does alone
    check_one_launch(*_twin_handles(), _native.twin_lookup_tables, layout=MANY_TABLES)
