"""Reduced-precision dense layers on a GPU instance (config.pbtxt ``dense_math``): the
parameter, where it applies, and its host twin (triton_rec/dense/emulated_math.py), which
measures the accuracy against fp32 that docs/precision.md states (benchmarks/
bench_dense_math.py's BOUNDS). The device's own answers are held to the same bounds by
tests/gpu/test_dense_math_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from ps_loader import criteo
from tests.benchmark_scripts import load_benchmark
from triton_rec import _native
from triton_rec.config.model_config import DENSE_MATHS, InstanceSettings
from triton_rec.dense.emulated_math import EmulatedMath, to_fp16, to_tf32
from triton_rec.errors import ConfigError
from triton_rec.serving.deployment import InstanceSpec, dense_placement
from triton_rec.triton.plan_cli import read_model_config


def test_tf32_keeps_ten_mantissa_bits_by_truncation():
    one = np.float32(1.0)
    x = np.array(
        [1 + 2**-10, 1 + 2**-11, 1 + 2**-10 + 2**-11, -(1 + 2**-10 + 2**-12), 3.0e38, 0.0],
        np.float32,
    )
    want = np.array([1 + 2**-10, one, 1 + 2**-10, -(1 + 2**-10), None, 0.0], object)
    got = to_tf32(x)
    for g, w in zip(got[[0, 1, 2, 3, 5]], want[[0, 1, 2, 3, 5]]):
        assert g == np.float32(w), (g, w)
    assert abs(got[4] - 3.0e38) / 3.0e38 < 2**-10 and np.isfinite(got[4])
    assert got.dtype == np.float32


def test_fp16_rounds_to_nearest_and_overflows_to_infinity():
    x = np.array([1 + 2**-11, 1 + 2**-11 + 2**-12, 65504.0, 65520.0, -1e6], np.float32)
    got = to_fp16(x)
    assert got[0] == 1.0 and got[1] == np.float32(1 + 2**-10)  # ties to even, then nearest
    assert got[2] == 65504.0 and np.isinf(got[3]) and got[4] == -np.inf


def test_the_twin_rounds_what_each_math_rounds():
    rng = np.random.default_rng(0)
    a, w = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((7, 3))
    w = w.astype(np.float32)
    z = rng.standard_normal((2, 4, 6)).astype(np.float32)
    zt = z.transpose(0, 2, 1)
    assert np.array_equal(EmulatedMath("fp32").matmul(a, w), a @ w)
    assert np.array_equal(EmulatedMath("tf32").matmul(a, w), to_tf32(a) @ to_tf32(w))
    assert np.array_equal(EmulatedMath("tf32").matmul(z, zt), to_tf32(z) @ to_tf32(zt))
    assert np.array_equal(EmulatedMath("fp16").matmul(a, w), to_fp16(a) @ to_fp16(w))
    # the interaction's products of activations stay float32 in fp16 (as on the GPU)
    assert np.array_equal(EmulatedMath("fp16").matmul(z, zt), z @ zt)
    with pytest.raises(ValueError, match="bf16"):
        EmulatedMath("bf16")


def test_the_mlperf_dlrm_stays_within_the_documented_bounds():
    """A small run of benchmarks/bench_dense_math.py (the recorded one: 131,072 samples):
    each math within its bound, and each moving the answers (the twin is not fp32)."""
    bench = load_benchmark("bench_dense_math")
    result = bench.measure(samples=1024, seeds=[0])
    assert set(result) == set(DENSE_MATHS) - {"fp32"}
    for math, r in result.items():
        assert r["within"] and r["max_abs"] <= bench.BOUNDS[math], (math, r)
        assert r["max_abs"] > 1e-5, (math, r)


def test_dense_math_is_a_config_parameter_with_three_values(tmp_path):
    def from_text(text):
        (tmp_path / "config.pbtxt").write_text(text)
        return InstanceSettings.from_config(read_model_config(tmp_path / "config.pbtxt"), {})

    def settings(value):
        return from_text(f'parameters {{ key: "dense_math" value: {{ string_value: "{value}" }} }}')

    assert InstanceSettings.from_config({}, environ={}).dense_math == "fp32"
    assert [settings(m).dense_math for m in DENSE_MATHS] == list(DENSE_MATHS)
    with pytest.raises(
        ConfigError, match="'dense_math' must be one of fp32, tf32, fp16, got 'bf16'"
    ):
        settings("bf16")
    # the generator writes it (ps-loader criteo-dlrm, bench_criteo.py --dense-math)
    assert from_text(criteo.config_pbtxt("m", "KIND_GPU", 1, "tf32")).dense_math == "tf32"
    assert "dense_math" not in criteo.config_pbtxt("m", "KIND_GPU", 1)


def test_a_cpu_instance_says_that_it_runs_fp32():
    from triton_rec.config.ps_json import ModelParams

    placement = dense_placement(ModelParams(model="m", tables=()), InstanceSpec(dense_math="fp16"))
    assert not placement.on_device and placement.math == "fp32"
    assert (
        placement.why == "KIND_CPU instance (dense_math fp16 is for KIND_GPU instances: fp32 here)"
    )
    plain = dense_placement(ModelParams(model="m", tables=()), InstanceSpec())
    assert plain.why == "KIND_CPU instance"


def test_the_cublas_wrapper_refuses_an_unknown_math_before_loading_cublas():
    with pytest.raises(
        ValueError, match="cuBLAS math must be 'fp32', 'tf32' or 'fp16', not 'bf16'"
    ):
        _native.Cublas("no-such-library.so", 0, "bf16")
