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

Memory: the buffers, each graph's output and the intermediate arrays come from a memory
pool of this object's own (the graphs hold raw addresses, so nothing else may ever get
those blocks); the buckets share the intermediates (a graph runs only on this object's
stream, one at a time). The native backend launches the same graphs itself
(:meth:`DenseGraphs.native_plan`).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.dense import DenseModel, TableSpec
from triton_rec.gpu.blas import CapturableCupy


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

    def __init__(self, network: Any, max_batch_size: int, device: int):
        import cupy  # only here: a GPU instance

        if not isinstance(network.xp, CapturableCupy):
            raise TypeError("DenseGraphs needs a network built with CapturableCupy (load())")
        self.network = network
        self.device = int(device)
        self.max_batch_size = max(1, int(max_batch_size))
        self._lock = threading.Lock()
        self._cupy = cupy
        self._pool = cupy.cuda.MemoryPool()
        self._graphs: Dict[int, Tuple[Any, Any]] = {}
        with cupy.cuda.Device(self.device):
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
    ) -> DenseGraphs:
        """Load a HugeCTR network onto ``device`` and capture its graphs."""
        import cupy

        from triton_rec.dense.hugectr_network import HugeCTRNetwork

        xp = CapturableCupy(cupy, device)
        return cls(
            HugeCTRNetwork.load(network_file, dense_file, non_trainable_file, xp=xp),
            max_batch_size,
            device,
        )

    def _capture(self, b: int):
        inputs = (self.dense_in[:b], [e[:b] for e in self.emb_in])
        # eager run first: CuPy compiles and loads its kernels, cuBLAS sets up, and the pool
        # gets the blocks the captured run will reuse (nothing is allocated while capturing)
        self.network.predict(*inputs)
        self.stream.synchronize()
        _native.CudaGraph.begin_capture(self.device, self.stream.ptr)
        try:
            out = self.network.predict(*inputs)
        finally:
            graph = _native.CudaGraph.end_capture(self.device, self.stream.ptr)
        return graph, out

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

    def native_plan(self) -> Dict[str, Any]:
        """What the native backend's GPU path runs the network with: the device addresses
        of the inputs, and per bucket (ascending) its batch size, graph and output."""
        return {
            "device": self.device,
            "dense_in": int(self.dense_in.data.ptr),
            "emb_in": [int(e.data.ptr) for e in self.emb_in],
            "buckets": [
                (int(b), int(g.exec), int(o.data.ptr)) for b, (g, o) in self._graphs.items()
            ],
        }

    def __repr__(self) -> str:
        return f"DenseGraphs({self.network!r}, GPU {self.device}, buckets {sorted(self._graphs)})"
