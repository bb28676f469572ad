"""HugeCTR network JSON + dense file -> a :class:`~triton_rec.dense.DenseModel`.

``HugeCTRNetwork.load(network_json, dense_file, non_trainable_params_file=None, xp=numpy)``
parses the network HugeCTR's inference parser reads (``{"layers": [Data, embedding
layers..., dense layers...]}``), checks the graph and every shape statically, checks the
dense file's size exactly, and runs the network's inference semantics.

Where each rule comes from: HugeCTR tag ``v23.08.00`` (commit 0c8c125e), paths relative
to ``HugeCTR/``; "CN" is ``src/parsers/create_network.cpp`` of that tag. Function names
are given next to line numbers so a rule can be found in later tags too. Nothing here is
copied from upstream; ``shared/reference/hugectr-layers.md`` (the project's reference notes)
summarizes the rules.

Decisions that differ from upstream, on purpose:

- The dense file must be *exactly* as long as the network's parameters. Upstream reads
  the prefix it needs and ignores the rest (``src/network.cpp``,
  ``Network::upload_params_to_device_inference``); a longer file fails here, because a
  file that does not fit the JSON almost always means the wrong file or the wrong JSON,
  and we never truncate silently. A shorter file fails upstream too (short read).
- ``BatchNorm`` needs its running mean/variance from ``non_trainable_params_file``;
  without one the load fails (upstream, the HugeCTR Triton backend never passes that file
  and the statistics stay uninitialized).
- Shapes are per sample: a tensor whose first dimension is ``B * r`` (HugeCTR reshapes
  may put ``r`` rows of one sample in a tensor) is checked for every batch size ``B``; a
  ``Reshape`` whose rows would mix samples (``leading_dim`` not dividing the per-sample
  element count) and a ``ReduceSum`` over axis 0 (over the batch) are rejected, since their
  result would depend on how samples are batched.
- Pre-v2.1 networks (a top-level ``"data"`` object, no ``Data`` layer) are rejected.
- The prediction is ``[B, label_dim]`` with ``label_dim`` the per-sample width of the last
  tensor (upstream returns the first ``B`` floats of it, which is the same thing for the
  usual ``[B, 1]``). ``Data.label.label_dim`` is kept (``NetworkPlan.data_label_dim``) but
  not enforced: a softmax head has more outputs than labels.
- ``MLP`` accepts ``act_type`` (the Python API's name) as an alias of ``activation``.

What is accepted at the top level: ``{"layers": [...]}`` with any other keys ignored
(``solver``, ``optimizer``, the v3.0 samples' ``inference``), or a bare list of layers;
``label.top`` may be absent (v3.0 samples), ``combiner`` may be ``0``/``1`` (v3.0) or
``"sum"``/``"mean"``.

Array module: every operation is written once over the subset of the array API numpy and
CuPy share (``xp``; matrix products as ``xp.matmul``, which the GPU graphs route to a cuBLAS
handle of their own: :mod:`triton_rec.gpu.blas`). CuPy is imported by the caller, never
here; CI runs numpy, tests/gpu runs the CuPy executor as CUDA graphs on a GPU.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.dense import DenseModel, TableSpec
from triton_rec.dense.hugectr.layers import NEW_OUTPUT, SUPPORTED_LAYER_TYPES, then
from triton_rec.dense.hugectr.native_program import (
    DENSE_PROGRAM_MAGIC,
    NATIVE_OPS,
    native_program,
)
from triton_rec.dense.hugectr.parse import parse_network, read_network_json
from triton_rec.dense.hugectr.plan import (
    EMBEDDING_TYPES,
    LOSS_TYPES,
    LayerPlan,
    NetworkPlan,
    ParamBlock,
    Shape,
    per_sample,
)
from triton_rec.dense.hugectr.weights import read_dense_file, read_non_trainable

__all__ = [
    "DENSE_PROGRAM_MAGIC",
    "EMBEDDING_TYPES",
    "LOSS_TYPES",
    "NATIVE_OPS",
    "SUPPORTED_LAYER_TYPES",
    "HugeCTRNetwork",
    "LayerPlan",
    "NetworkPlan",
    "ParamBlock",
    "Shape",
]

# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------

#: HugeCTRNetwork.shared's networks, by their files' identities; held weakly: a network
#: goes when the last model instance holding it does
_SHARED: weakref.WeakValueDictionary[tuple, HugeCTRNetwork] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def _file_identity(path) -> Optional[tuple]:
    """What tells one file from another for :meth:`HugeCTRNetwork.shared` (None: no file);
    a missing file has none and fails in ``load``, naming it."""
    if path is None:
        return None
    real = os.path.realpath(os.fspath(path))
    try:
        st = os.stat(real)
    except OSError:
        return (real,)
    return (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class HugeCTRNetwork(DenseModel):
    """A HugeCTR network with its weights, ready to predict. Build with :meth:`load`.

    Tables (:attr:`tables`) are the Data layer's sparse inputs in order; table ``t`` is
    the ``t``-th embedding layer and the ``t``-th ps.json sparse file; ``predict`` takes
    its slots combined (``[B, slot_num, vec_size]``, see
    :func:`triton_rec.dense.combine_slots` and :attr:`TableSpec.combiner`).
    """

    def __init__(self, plan: NetworkPlan, weights: np.ndarray, stats: Dict[str, dict], xp=np):
        self.plan = plan
        self.xp = xp
        # The network as a program over numbered registers (one per tensor), so that
        # predict runs no name lookups: [forward, input registers, output registers,
        # registers to free]. Every tensor has exactly one consumer (the graph checks it),
        # so a one-input layer that reads the one output of the layer before it runs
        # fused with it: fewer steps, the same operations.
        regs: Dict[str, int] = {}

        def reg(name: str) -> int:
            return regs.setdefault(name, len(regs))

        self._dense_reg = reg(plan.dense_input)
        self._table_regs = [reg(spec.output_name) for spec in plan.tables]
        # Tensors that must survive their consumer (multi-task outputs), with their widths.
        keep = set(plan.output) if len(plan.output) > 1 else set()
        program: List[list] = []
        self._stats = stats
        self._arrays: List[list] = []  # per layer: its parameter arrays (native_program)
        self._native: Optional[np.ndarray] = None  # native_program's, made once
        self._native_made = False
        self._native_lock = threading.Lock()
        self._net: Any = None  # native_net's: once made, predict runs it
        for layer in plan.layers:
            arrays = [
                xp.asarray(
                    weights[p.offset : p.offset + p.count].reshape(p.shape), dtype=xp.float32
                )
                for p in layer.params
            ]
            self._arrays.append(arrays)
            ins, outs = tuple(reg(b) for b in layer.bottoms), tuple(reg(t) for t in layer.tops)
            prev = program[-1] if program else None
            if (
                prev is not None
                and len(ins) == 1
                and prev[2] == ins
                and layer.bottoms[0] not in keep
            ):
                # Its input is the step before's output, seen by no one else; it may be
                # overwritten if that step made it new (not a view of a network input).
                make = (layer.make_in_place if prev[3] else None) or layer.make
                prev[0] = then(prev[0], make(arrays, stats.get(layer.name), xp))
                prev[2] = outs
                prev[3] = layer.type in NEW_OUTPUT or make is layer.make_in_place
            else:
                program.append(
                    [
                        layer.make(arrays, stats.get(layer.name), xp),
                        ins,
                        outs,
                        layer.type in NEW_OUTPUT,
                    ]
                )
        kept = {regs[t] for t in keep}
        self._program = [
            (f, ins, outs, tuple(i for i in ins if i not in kept)) for f, ins, outs, _ in program
        ]
        self._num_regs = len(regs)
        self._out_regs = [regs[t] for t in plan.output]
        widths = {
            t: per_sample(s) for layer in plan.layers for t, s in zip(layer.tops, layer.out_shapes)
        }
        self._widths = [widths[t] for t in plan.output]

    # ---- construction -----------------------------------------------------------------

    @staticmethod
    def parse(network_json) -> NetworkPlan:
        """Parse and check a network (path or already-loaded JSON) without weights.

        Raises:
            ModelFileError: the file is missing or not JSON.
            ConfigError: the structure is wrong (the message names layer and key).
        """
        if isinstance(network_json, (str, os.PathLike)):
            source = os.fspath(network_json)
            doc = read_network_json(source)
        else:
            source, doc = "<network json>", network_json
        return parse_network(doc, source)

    @classmethod
    def load(
        cls, network_json, dense_file, non_trainable_params_file=None, xp=np
    ) -> HugeCTRNetwork:
        """Load a network and its dense file.

        Args:
            network_json: path of the network JSON (or the parsed JSON object).
            dense_file: the raw float32 dense file (``<prefix>_dense_<iter>.model``): every
                trainable layer's parameters concatenated in JSON order, no header.
            non_trainable_params_file: the JSON with BatchNorm running statistics
                (required when the network has BatchNorm layers).
            xp: numpy (default) or cupy.

        Raises:
            ModelFileError: a file is missing, unreadable, or of the wrong size (the
                message names the file, the bytes expected and the per-layer breakdown).
            ConfigError: the network is malformed or uses an unsupported layer type (the
                message names the layer and its type).
        """
        plan = cls.parse(network_json)
        weights = read_dense_file(plan, os.fspath(dense_file))
        nt_path = os.fspath(non_trainable_params_file) if non_trainable_params_file else None
        stats = read_non_trainable(plan, nt_path)
        return cls(plan, weights, stats, xp)

    @classmethod
    def shared(cls, network_file, dense_file, non_trainable_params_file=None) -> HugeCTRNetwork:
        """The host (numpy) network of these files, loaded once per process while anyone
        holds it: every instance of a model (and every model naming the same files) shares
        its weights, and through :meth:`native_program` the native executor's packed copy
        (``src/triton_backend/trec/plan.cpp``), instead of one copy of each per instance.
        Files are the same when their resolved path, device, inode, size and modification
        time are: a file rewritten or replaced loads anew. A network is immutable once
        loaded and ``predict`` keeps no state, so instances may run it at once."""
        paths = [network_file, dense_file, non_trainable_params_file]
        if not all(p is None or isinstance(p, (str, os.PathLike)) for p in paths):
            return cls.load(*paths)  # a parsed JSON: nothing to tell it by
        key = tuple(_file_identity(p) for p in paths)
        with _SHARED_LOCK:
            network = _SHARED.get(key)
            if network is None:
                network = cls.load(*paths)
                if key == tuple(_file_identity(p) for p in paths):  # not replaced meanwhile
                    _SHARED[key] = network
            return network

    @staticmethod
    def parse_tables(network_json) -> Tuple[TableSpec, ...]:
        """The embedding tables of a network (path or already-loaded JSON), in order:
        slots, vector size, combiner. The dense layers are not planned, so this also
        reads the network JSON of a model whose dense part runs elsewhere (ONNX).

        Raises:
            ModelFileError: the file is missing or not JSON.
            ConfigError: the Data layer or an embedding layer is malformed (a missing
                ``combiner`` included: HugeCTR requires it), as :meth:`parse` says it.
        """
        if isinstance(network_json, (str, os.PathLike)):
            source = os.fspath(network_json)
            doc = read_network_json(source)
        else:
            source, doc = "<network json>", network_json
        return parse_network(doc, source, dense=False)

    # ---- DenseModel --------------------------------------------------------------------

    @property
    def dense_dim(self) -> int:
        """Width of the dense input."""
        return self.plan.dense_dim

    @property
    def label_dim(self) -> int:
        """Number of outputs per sample."""
        return self.plan.label_dim

    @property
    def tables(self) -> Tuple[TableSpec, ...]:
        """The embedding tables the network takes, in input order."""
        return self.plan.tables

    @property
    def num_params(self) -> int:
        """Total number of parameters of the network."""
        return self.plan.num_params

    def predict(self, dense, embeddings: Sequence):
        """Run the network on a batch; returns predictions of shape (B, label_dim)."""
        xp = self.xp
        batch, dense, embeddings = self._check_inputs(dense, embeddings, xp)
        if self._net is not None:  # native_net made: the weights are its own
            return self._net.predict(dense, list(embeddings))
        regs: List[Any] = [None] * self._num_regs
        regs[self._dense_reg] = dense
        for r, emb in zip(self._table_regs, embeddings):
            regs[r] = emb
        for fwd, ins, outs, free in self._program:
            results = fwd(*[regs[i] for i in ins])
            for i in free:  # consumed: let it go as soon as possible
                regs[i] = None
            for i, v in zip(outs, results):
                regs[i] = v
        if len(self._out_regs) > 1:
            out = xp.concatenate(
                [regs[r].reshape(batch, w) for r, w in zip(self._out_regs, self._widths)], axis=1
            )
        else:
            out = regs[self._out_regs[0]]
        return xp.ascontiguousarray(
            out.reshape(batch, self.label_dim).astype(xp.float32, copy=False)
        )

    def native_program(self) -> Optional[np.ndarray]:
        """The network as the native executor's program (``src/native/dense_net.hpp``, the
        format's only other reader; its layout: :func:`~triton_rec.dense.hugectr.
        native_program.native_program`), or None when a layer has no native implementation
        or the weights are not host arrays. The program holds the addresses of this
        object's weight arrays: it is valid while this object lives and until
        :meth:`native_net` lets them go (then this raises)."""
        with self._native_lock:
            return self._native_program()

    def _native_program(self) -> Optional[np.ndarray]:
        if self.xp is not np:
            return None
        if self._net is not None:
            raise RuntimeError(
                f"{self.plan.source}: the weights went to the native executor (native_net)"
            )
        if not self._native_made:  # once: every instance sharing this network shares it
            made = native_program(self.plan, self._arrays, self._stats)
            if made is not None:
                self._native, self._native_keep = made  # the arrays it points to
            self._native_made = True
        return self._native

    def native_net(self) -> Any:
        """The native executor of this network (``triton_rec._native.DenseNet`` of
        :meth:`native_program`, every thread rule its default), made once; None when the
        network has no native program. It holds its own copy of everything it reads (the
        packed matrices), so from then on :meth:`predict` runs it and the numpy weights
        are let go: one copy of the weights per process for every model instance sharing
        this network (:meth:`shared`; the native Triton backend runs this very executor,
        ``src/triton_backend/trec/plan.cpp``)."""
        with self._native_lock:
            if self._net is None:
                program = self._native_program()
                if program is None:
                    return None
                self._net = _native.DenseNet(program, self._native_keep)
                # what pointed into the weights: the arrays, the numpy program's closures
                self._arrays, self._program = [], []
                self._native, self._native_keep = None, []
            return self._net

    def __repr__(self) -> str:
        kinds: Dict[str, int] = {}
        for layer in self.plan.layers:
            kinds[layer.type] = kinds.get(layer.type, 0) + 1
        tables = ", ".join(
            f"{t.name}:{t.slot_num}x{t.vec_size}/{t.combiner.value}" for t in self.tables
        )
        return (
            f"HugeCTRNetwork({self.plan.source}: dense_dim={self.dense_dim}, tables=[{tables}], "
            f"{len(self.plan.layers)} dense layers, {self.num_params} parameters, "
            f"label_dim={self.label_dim})"
        )
