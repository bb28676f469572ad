"""ONNX dense models, run in-process with onnxruntime.

Contract of the ONNX file (what ``model_repository/dlrm/train.py`` exports):

- input ``dense``: float32 ``[B, dense_dim]``;
- one input per table, ``emb_0``, ``emb_1``, ...: float32 ``[B, slot_num_t, vec_size_t]``,
  the embeddings already combined per slot (static slot and vector dims);
- the first output: float32 ``[B, label_dim]`` (or ``[B]``), the predictions.

The combiner of each table (how a multi-hot slot's vectors are combined before the
network) is not part of ONNX: it comes from the embedding layers of a HugeCTR network
JSON when one is given (``network_file``), else ``sum``. That JSON is read by the
HugeCTR executor's parser (:meth:`HugeCTRNetwork.parse_tables
<triton_rec.dense.hugectr_network.HugeCTRNetwork.parse_tables>`): the same embedding
layer types, the same rules and the same errors for both dense executors.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np

from triton_rec.config.model_config import InstanceSettings
from triton_rec.config.model_files import open_model_file
from triton_rec.dense import Combiner, DenseModel, TableSpec
from triton_rec.dense.hugectr_network import HugeCTRNetwork
from triton_rec.errors import ConfigError, ModelFileError

#: Most samples one onnxruntime run is given: a larger batch (the requests of one execute
#: call together) runs in parts. onnxruntime keeps its CPU arena at the largest run's
#: size for the session's life (its memory pattern per input shape costs nothing
#: measurable), so this bounds an instance's arena at what 1024 samples need. Measured
#: on the demo DLRM (OnnxDenseModel.load, one thread), 300 predicts of 1..65536 samples:
#: +132 MiB of anonymous memory kept when each ran whole, +2.2 MiB in parts, no slower.
RUN_SAMPLES = 1024


def network_combiners(network_file: str) -> List[Combiner]:
    """The combiner of each embedding layer of a HugeCTR network JSON, in order, as
    :meth:`HugeCTRNetwork.parse_tables` reads them (ConfigError/ModelFileError as it
    raises them)."""
    return [t.combiner for t in HugeCTRNetwork.parse_tables(network_file)]


class OnnxDenseModel(DenseModel):
    """An ONNX dense network (see the module docstring for the contract).

    Args:
        session: an ``onnxruntime.InferenceSession``.
        path: the file, for messages.
        combiners: per table; default ``sum``.
    """

    def __init__(self, session, path: str, combiners: Optional[Sequence] = None):
        self.session = session
        self.path = path
        inputs = {i.name: i for i in session.get_inputs()}
        if "dense" not in inputs:
            raise ModelFileError(
                path, f"ONNX model has no input 'dense' (inputs: {sorted(inputs)})"
            )
        emb = sorted((n for n in inputs if re.fullmatch(r"emb_\d+", n)), key=lambda n: int(n[4:]))
        if [int(n[4:]) for n in emb] != list(range(len(emb))) or not emb:
            raise ModelFileError(
                path, f"ONNX model needs inputs emb_0, emb_1, ... (inputs: {sorted(inputs)})"
            )
        extra = sorted(set(inputs) - {"dense", *emb})
        if extra:
            raise ModelFileError(path, f"ONNX model has unexpected inputs {extra}")
        combiners = list(combiners) if combiners else [Combiner.SUM] * len(emb)
        if len(combiners) != len(emb):
            raise ConfigError(
                f"{path}: {len(emb)} embedding inputs but {len(combiners)} combiners "
                "from the network JSON"
            )
        self._dense_dim = self._static(inputs["dense"], 1)
        specs = []
        for t, name in enumerate(emb):
            specs.append(
                TableSpec(
                    name=name,
                    slot_num=self._static(inputs[name], 1),
                    vec_size=self._static(inputs[name], 2),
                    combiner=combiners[t],
                    input_name=name,
                )
            )
        self._tables = tuple(specs)
        out = session.get_outputs()[0]
        self.output_name = out.name
        shape = out.shape
        self._label_dim = int(shape[1]) if len(shape) == 2 and isinstance(shape[1], int) else 1

    def _static(self, node, axis: int) -> int:
        shape = node.shape
        if len(shape) <= axis or not isinstance(shape[axis], int):
            raise ModelFileError(
                self.path, f"input '{node.name}' needs a static dimension {axis}, got {shape}"
            )
        return int(shape[axis])

    @classmethod
    def load(
        cls,
        path: str,
        network_file: Optional[str] = None,
        threads: int = InstanceSettings.intra_op_threads,
    ) -> OnnxDenseModel:
        """Open ``path`` with onnxruntime (CPU; ``threads`` intra-op threads per instance)."""
        os.close(open_model_file(path, "ONNX dense model")[0])  # regular, allowed
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise ConfigError("ONNX dense models need onnxruntime: pip install onnxruntime") from e
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1  # one graph, run sequentially: no inter-op parallelism
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Pool threads must not spin between runs: other instance processes share the cores.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            session = ort.InferenceSession(
                path, sess_options=opts, providers=["CPUExecutionProvider"]
            )
        except Exception as e:  # onnxruntime raises its own exception types
            raise ModelFileError(path, f"onnxruntime cannot load it: {e}") from e
        combiners = network_combiners(network_file) if network_file else None
        return cls(session, path, combiners)

    @property
    def dense_dim(self) -> int:
        """Width of the dense input."""
        return self._dense_dim

    @property
    def label_dim(self) -> int:
        """Number of outputs per sample."""
        return self._label_dim

    @property
    def tables(self) -> Tuple[TableSpec, ...]:
        """The embedding tables the model takes, in input order."""
        return self._tables

    def predict(self, dense, embeddings: Sequence) -> np.ndarray:
        """Run the ONNX session on a batch; returns float32 predictions of shape (B, -1).
        A batch of more than :data:`RUN_SAMPLES` samples is run in parts of that many."""
        batch, dense, embs = self._check_inputs(dense, embeddings, np)
        arrays = [np.ascontiguousarray(dense), *(np.ascontiguousarray(e) for e in embs)]
        names = ["dense", *(spec.input_name for spec in self._tables)]
        outs = []
        for a in range(0, max(batch, 1), RUN_SAMPLES):
            feeds = {n: x[a : a + RUN_SAMPLES] for n, x in zip(names, arrays)}
            outs.append(self.session.run([self.output_name], feeds)[0])
        out = outs[0] if len(outs) == 1 else np.concatenate(outs, axis=0)
        return np.asarray(out, dtype=np.float32).reshape(batch, -1)

    def __repr__(self) -> str:
        return (
            f"OnnxDenseModel({os.path.basename(self.path)!r}, dense_dim={self._dense_dim}, "
            f"tables={[(t.slot_num, t.vec_size, t.combiner.value) for t in self._tables]})"
        )
