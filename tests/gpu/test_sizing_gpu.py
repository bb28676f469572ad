"""The node plan's GPU rules against what a GPU allocates (docs/operations.md, "Sizing a
node"): a whole table (``static``/``uvm``, allocated by the native ``DeviceTable``) and a
device cache's state arrays (``allocate_device_arrays``), as much as
:func:`~triton_rec.cache.device_table.device_table_bytes` and
:func:`~triton_rec.cache.gpu_share.device_cache_bytes` say (a static table's device memory in use
grows by at least that much)."""

from __future__ import annotations

import numpy as np
import pytest

from triton_rec import _native
from triton_rec.cache.array_cache import ArrayEmbeddingCache
from triton_rec.cache.device_table import device_table_bytes
from triton_rec.cache.gpu_share import allocate_device_arrays, allocation_bytes, device_cache_bytes
from triton_rec.gpu.kernels import load_kernels
from triton_rec.precision import RowCodec


@pytest.mark.parametrize("mode", ["static", "uvm"])
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_whole_table_on_the_gpu_is_what_the_plan_says(cupy, mode, precision):
    n, dim = 30_000, 24
    codec = RowCodec(precision, dim)
    keys = np.arange(1, n + 1, dtype=np.int64) * 7
    rows = codec.encode(np.random.default_rng(2).standard_normal((n, dim)).astype(np.float32))
    index = _native.build_index(keys)
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    table = _native.DeviceTable(load_kernels(0), index, rows, codec.code, dim, 0.0, mode)
    assert table.nbytes == device_table_bytes(n, codec)
    if mode == "static":  # device memory (the driver allocates in pages: at least as much)
        assert free_before - cupy.cuda.runtime.memGetInfo()[0] >= table.nbytes
    del table


@pytest.mark.parametrize("policy, precision", [("lru", "fp32"), ("tinylfu", "fp16")])
def test_a_device_cache_is_what_the_plan_says(cupy, policy, precision):
    layout = ArrayEmbeddingCache.state_layout(5000, 32, 8, policy, precision)
    arrays = allocate_device_arrays(layout, 0)
    held = sum(int(a.data.mem.size) for a in arrays.values())
    assert held == sum(allocation_bytes(s, d) for s, d in layout.values())
    assert held == device_cache_bytes(5000, 32, 8, policy, precision)
    del arrays
