"""What triton_rec.dense.graphs decides without a GPU: the batch sizes its CUDA graphs are
captured for (the graphs themselves: tests/gpu/test_dense_graph_gpu.py)."""

from __future__ import annotations

from triton_rec.dense.graphs import buckets


def test_buckets_are_powers_of_two_then_the_largest_batch():
    assert buckets(1) == [1]
    assert buckets(2) == [1, 2]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
