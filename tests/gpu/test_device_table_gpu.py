"""static and uvm tables on the GPU: the whole node-store table in device memory, or in
pinned host memory the kernel reads directly, answering exactly what the CPU lookup of the
same index and rows answers (every precision, absent keys get the default value)."""

from __future__ import annotations

import numpy as np
import pytest

from triton_rec import _native
from triton_rec.gpu.kernels import load_kernels
from triton_rec.precision import RowCodec


@pytest.mark.parametrize("mode", ["static", "uvm"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_a_device_table_answers_as_the_cpu_lookup(cupy, mode, precision):
    rng = np.random.default_rng(5)
    n, dim = 50_000, 13
    keys = rng.choice(np.arange(-(10**9), 10**9), n, replace=False).astype(np.int64)
    codec = RowCodec(precision, dim)
    rows = codec.encode(rng.standard_normal((n, dim)).astype(np.float32))
    index = _native.build_index(keys)
    table = _native.DeviceTable(load_kernels(0), index, rows, codec.code, dim, -0.5, mode)
    assert table.uvm == (mode == "uvm")
    ask = np.concatenate([rng.choice(keys, 30_000), rng.integers(2 * 10**9, 3 * 10**9, 500)])
    out = np.empty((ask.size, dim), np.float32)
    status = np.empty(ask.size, np.uint8)
    absent = table.lookup(ask, out, status)
    want = np.empty_like(out)
    want_absent = _native.lookup(index, rows, ask, want, -0.5, precision=codec.code)
    assert absent == want_absent == 500
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(status, (np.arange(ask.size) < 30_000).astype(np.uint8))
