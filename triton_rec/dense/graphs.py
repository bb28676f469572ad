"""A HugeCTR network's forward pass on the GPU as CUDA graphs, one per batch-size bucket.

The executor is the one every path uses (:class:`~triton_rec.dense.hugectr_network.HugeCTRNetwork`),
here with :class:`~triton_rec.gpu.blas.CapturableCupy`: cuBLAS GEMMs (through a handle of
our own: CuPy refuses cuBLAS while capturing) and CuPy's element-wise kernels. Run op by
op it pays a launch (and Python) per layer: ~2.5 ms for the held-out DLRM whatever the
batch (measured on an H200, the issue 23 baseline). Captured
once per bucket (1, 2, 4, ... up to ``max_batch_size``) into a CUDA graph that reads fixed
input buffers and writes a fixed output buffer, a request is: its inputs copied into the
first rows of the buffers, one graph launch for the smallest bucket that holds it, its
rows of the output copied back. Rows are independent in every HugeCTR layer this project
runs (no layer mixes samples: :mod:`triton_rec.dense.hugectr_network` refuses reshapes
that would), so the rows past the request's, left from earlier ones, change nothing.

Small batches: a graph is a chain of dependent kernels (about 30 for the demo DLRM), whose
launch latencies add up to ~100 us even at batch 1, where the native CPU executor takes a
few microseconds (measured on an H200 node:
benchmarks/history/2026-11-26-gpu-path-h200.md). So at load each bucket
is timed both ways (:meth:`DenseGraphs.calibrate`), and a request of at most
:attr:`DenseGraphs.host_max_batch` samples runs the network on the host (the native
executor, the embeddings still looked up on the GPU): the latency of the CPU path, the
GPU's cache. Larger batches run as graphs (at batch 1024: ~10x faster than the CPU).

Memory: the buffers, each graph's output and the intermediate arrays come from a memory
pool of this object's own (the graphs hold raw addresses, so nothing else may ever get
those blocks); the buckets share the intermediates (a graph runs only on this object's
stream, one at a time). The native backend launches the same graphs itself
(:meth:`DenseGraphs.native_plan`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.dense import DenseModel, TableSpec
from triton_rec.gpu import SETUP_LOCK
from triton_rec.gpu.blas import CapturableCupy

#: Captures of one bucket tried before the load fails: a capture can still be broken by
#: CUDA work of a thread that does not take :data:`~triton_rec.gpu.SETUP_LOCK` (a request
#: of a model already serving).
CAPTURE_ATTEMPTS = 5


@dataclass
class DenseGpuPlan:
    """What the native backend's GPU path runs a network with
    (:meth:`DenseGraphs.native_plan`; its fields are the names the C++ reads, as for every
    part of a native plan: :mod:`triton_rec.serving.native_plan`): the device, the largest
    batch run on the host instead (``host_max_batch``), the inputs' device addresses, and
    per bucket (ascending) its batch size, graph and output's address."""

    device: int
    host_max_batch: int
    dense_in: int
    emb_in: List[int]
    buckets: List[Tuple[int, int, int]]


def buckets(max_batch_size: int) -> List[int]:
    """The batch sizes a graph is captured for: powers of two below ``max_batch_size``,
    then ``max_batch_size`` itself."""
    out, b = [], 1
    while b < int(max_batch_size):
        out.append(b)
        b *= 2
    out.append(int(max_batch_size))
    return out


class DenseGraphs(DenseModel):
    """``network`` (a :class:`HugeCTRNetwork` built with :class:`CapturableCupy`, see
    :meth:`load`) captured per batch bucket on ``device``.

    ``predict`` takes host (numpy) or device inputs and returns a host array (the
    :class:`~triton_rec.dense.DenseModel` interface); larger batches than
    ``max_batch_size`` run in chunks. Thread-safety: one call at a time (a lock).
    """

    def __init__(self, network: Any, max_batch_size: int, device: int, host_network: Any = None):
        import cupy  # only here: a GPU instance

        if not isinstance(network.xp, CapturableCupy):
            raise TypeError("DenseGraphs needs a network built with CapturableCupy (load())")
        self.network = network
        #: the same network on the host: its native executor runs the batches of at most
        #: host_max_batch samples (calibrate); None: every batch on the GPU
        self.host_network = host_network
        self.host_max_batch = 0
        self._host_net: Any = None  # the native executor of host_network, once calibrated
        self.device = int(device)
        self.max_batch_size = max(1, int(max_batch_size))
        self._lock = threading.Lock()
        self._cupy = cupy
        self._pool = cupy.cuda.MemoryPool()
        self._graphs: Dict[int, Tuple[Any, Any]] = {}
        with SETUP_LOCK, cupy.cuda.Device(self.device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            with cupy.cuda.using_allocator(self._pool.malloc), self.stream:
                mb = self.max_batch_size
                self.dense_in = cupy.zeros((mb, network.dense_dim), dtype=cupy.float32)
                self.emb_in = [
                    cupy.zeros((mb, int(t.slot_num), int(t.vec_size)), dtype=cupy.float32)
                    for t in network.tables
                ]
                for b in buckets(mb):
                    self._graphs[b] = self._capture(b)
            self.stream.synchronize()

    @classmethod
    def load(
        cls,
        network_file: str,
        dense_file: str,
        non_trainable_file: Any = None,
        max_batch_size: int = 1,
        device: int = 0,
        math: str = "fp32",
    ) -> DenseGraphs:
        """Load a HugeCTR network onto ``device`` and capture its graphs, its GEMMs in
        ``math`` (:class:`~triton_rec.gpu.blas.CapturableCupy`). A reduced ``math`` applies
        to the batches run as graphs; those of at most :attr:`host_max_batch` samples run
        on the host in float32."""
        import cupy

        from triton_rec.dense.hugectr_network import HugeCTRNetwork

        host = HugeCTRNetwork.shared(network_file, dense_file, non_trainable_file)
        with SETUP_LOCK:  # cuBLAS set up, weights copied, graphs captured and timed
            xp = CapturableCupy(cupy, device, math)
            graphs = cls(
                HugeCTRNetwork.load(network_file, dense_file, non_trainable_file, xp=xp),
                max_batch_size,
                device,
                host,
            )
            graphs.calibrate()
        return graphs

    def calibrate(self, reps: int = 20) -> int:
        """Time each bucket on the GPU (inputs in, prediction out) and with the host
        network's native executor; :attr:`host_max_batch` becomes the largest bucket up to
        which the host is at least twice as fast (0 when it never is, or without a native
        program). Returns it."""
        import time

        net = self.native_net()
        self.host_max_batch = 0
        if net is None:
            return 0
        self._host_net = None  # time the graphs themselves
        rng = np.random.default_rng(0)
        for b in sorted(self._graphs):
            dense = rng.standard_normal((b, self.dense_dim)).astype(np.float32)
            embs = [
                rng.standard_normal((b, int(t.slot_num), int(t.vec_size))).astype(np.float32)
                for t in self.tables
            ]
            best = {}
            for name, fn in (("gpu", self.predict), ("host", net.predict)):
                fn(dense, embs)
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(dense, embs)
                best[name] = (time.perf_counter() - t0) / reps
            if 2 * best["host"] > best["gpu"]:
                break
            self.host_max_batch = b
        self._host_net = net if self.host_max_batch else None
        return self.host_max_batch

    def native_net(self):
        """The host network's native executor (the batches of at most
        :attr:`host_max_batch` samples: :meth:`HugeCTRNetwork.native_net
        <triton_rec.dense.hugectr_network.HugeCTRNetwork.native_net>`, one per process
        for every instance sharing the network), or None."""
        return None if self.host_network is None else self.host_network.native_net()

    def _capture(self, b: int):
        inputs = (self.dense_in[:b], [e[:b] for e in self.emb_in])
        # eager run first: CuPy compiles and loads its kernels, cuBLAS sets up, and the pool
        # gets the blocks the captured run will reuse (nothing is allocated while capturing)
        self.network.predict(*inputs)
        self.stream.synchronize()
        for attempt in range(1, CAPTURE_ATTEMPTS + 1):
            _native.CudaGraph.begin_capture(self.device, self.stream.ptr)
            failure: Optional[BaseException] = None
            try:
                out = self.network.predict(*inputs)
            except Exception as e:  # a launch into a broken capture fails (cuBLAS status 13)
                failure = e
            try:
                graph = _native.CudaGraph.end_capture(self.device, self.stream.ptr)
            except RuntimeError as e:
                # broken by another thread's CUDA work: capture again
                if "CAPTURE_INVALIDATED" not in str(e) or attempt == CAPTURE_ATTEMPTS:
                    raise e from failure
                self.stream.synchronize()
                continue
            if failure is not None:
                raise failure
            return graph, out
        raise AssertionError("unreachable")

    # -- DenseModel ---------------------------------------------------------------------
    @property
    def dense_dim(self) -> int:
        """Dense features per sample."""
        return int(self.network.dense_dim)

    @property
    def label_dim(self) -> int:
        """Predictions per sample."""
        return int(self.network.label_dim)

    @property
    def tables(self) -> Tuple[TableSpec, ...]:
        """The network's embedding inputs."""
        return tuple(self.network.tables)

    def bucket(self, n: int) -> int:
        """The smallest captured batch size that holds ``n`` samples."""
        return next(b for b in self._graphs if b >= n)

    def predict(self, dense, embeddings: Sequence) -> np.ndarray:
        """Predictions ``[B, label_dim]`` (host float32) of a batch (host or device inputs)."""
        cupy = self._cupy
        batch = int(np.shape(dense)[0])
        _, dense, embeddings = self._check_inputs(dense, embeddings, np)
        if self._host_net is not None and batch <= self.host_max_batch:
            return self._host_net.predict(dense, embeddings)
        out = np.empty((batch, self.label_dim), dtype=np.float32)
        with self._lock, cupy.cuda.Device(self.device):
            for start in range(0, batch, self.max_batch_size):
                n = min(self.max_batch_size, batch - start)
                self.dense_in[:n].set(dense[start : start + n], stream=self.stream)
                for buf, emb in zip(self.emb_in, embeddings):
                    buf[:n].set(emb[start : start + n], stream=self.stream)
                graph, result = self._graphs[self.bucket(n)]
                graph.launch(self.stream.ptr)
                out[start : start + n] = result[:n].get(stream=self.stream)
        return out

    def native_plan(self) -> DenseGpuPlan:
        """What the native backend's GPU path runs the network with: the device addresses
        of the inputs, and per bucket (ascending) its batch size, graph and output."""
        return DenseGpuPlan(
            device=int(self.device),
            host_max_batch=int(self.host_max_batch),
            dense_in=int(self.dense_in.data.ptr),
            emb_in=[int(e.data.ptr) for e in self.emb_in],
            buckets=[(int(b), int(g.exec), int(o.data.ptr)) for b, (g, o) in self._graphs.items()],
        )

    def __repr__(self) -> str:
        return f"DenseGraphs({self.network!r}, GPU {self.device}, buckets {sorted(self._graphs)})"
