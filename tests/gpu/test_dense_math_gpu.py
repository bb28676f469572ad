"""Reduced-precision dense layers on the device (config.pbtxt ``dense_math``): the
MLPerf-shaped DLRM's CUDA graphs with ``tf32`` and ``fp16`` GEMMs answer within the bounds
docs/precision.md states (benchmarks/bench_dense_math.py's BOUNDS, measured on the host by
the twin, triton_rec/dense/emulated_math.py) of the host's fp32 executor, and ``fp32``
graphs within float32 rounding; the inputs are the generator's (bench_dense_math.inputs).
Batches of 1,024 and 4,096 samples: run as graphs, never on the host (calibrate keeps the
host only for batches it runs twice as fast)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.benchmark_scripts import load_benchmark
from triton_rec.dense.graphs import DenseGraphs
from triton_rec.dense.hugectr_network import HugeCTRNetwork

BATCHES = (1024, 4096)


@pytest.fixture(scope="module")
def criteo_network(tmp_path_factory):
    bench = load_benchmark("bench_dense_math")  # its inputs, bounds and network writer
    tmp = tmp_path_factory.mktemp("criteo_net")
    net, dense, _ = bench.write_network(str(tmp), 0)
    return bench, net, dense


@pytest.mark.parametrize("math", ["fp32", "tf32", "fp16"])
def test_the_graphs_answer_within_the_bound_of_their_math(cupy, criteo_network, math):
    bench, net, dense = criteo_network
    want_net = HugeCTRNetwork.load(net, dense)
    graphs = DenseGraphs.load(net, dense, None, max(BATCHES), 0, math)
    assert graphs.network.xp.math == math
    for batch in BATCHES:
        assert batch > graphs.host_max_batch, (batch, graphs.host_max_batch)
        des, embs = bench.inputs(0, batch)
        want = want_net.predict(des, embs).reshape(-1)
        got = graphs.predict(des, embs).reshape(-1)
        worst = float(np.abs(got.astype(np.float64) - want).max())
        bound = 1e-4 if math == "fp32" else bench.BOUNDS[math]
        print(f"dense_math {math}, batch {batch}: max |dp| {worst:.2e} (bound {bound:.0e})")
        assert worst <= bound, (math, batch, worst)
        if math != "fp32":  # the tensor cores were used: the answers moved
            assert worst > 1e-6, (math, batch, worst)
