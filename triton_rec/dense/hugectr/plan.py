"""A parsed, checked HugeCTR network without its weights, and per-sample shapes.

Part of :mod:`triton_rec.dense.hugectr_network` (where the rules come from is said there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

from triton_rec.dense import TableSpec

# Embedding layer types the inference parser knows (include/parser.hpp EMBEDDING_TYPE_MAP;
# src/parsers/inference_parser.cpp InferenceParser::InferenceParser reads the first three).
EMBEDDING_TYPES = frozenset(
    {
        "DistributedSlotSparseEmbeddingHash",
        "LocalizedSlotSparseEmbeddingHash",
        "LocalizedSlotSparseEmbeddingOneHot",
        "HybridSparseEmbedding",
    }
)
LOSS_TYPES = frozenset({"BinaryCrossEntropyLoss", "MultiCrossEntropyLoss", "CrossEntropyLoss"})

# A shape is per sample: (r, d1, ..., dk) stands for the tensor [B*r, d1, ..., dk].
Shape = Tuple[int, ...]


def fmt_shape(shape: Shape) -> str:
    """A per-sample shape for messages: ``[B*r, d1, ...]``."""
    rows = "B" if shape[0] == 1 else f"B*{shape[0]}"
    return "[" + ", ".join([rows] + [str(d) for d in shape[1:]]) + "]"


def per_sample(shape: Shape) -> int:
    """Floats a shape takes per sample."""
    return int(math.prod(shape))


@dataclass(frozen=True)
class ParamBlock:
    """One parameter array of one layer, as stored in the dense file.

    Args:
        layer: the layer's name.
        layer_type: its type.
        label: what it is (``W``, ``b``, ``W0``, ``gamma``...).
        shape: its shape (row-major in the file).
        offset: position of its first float in the dense file, in floats.
    """

    layer: str
    layer_type: str
    label: str
    shape: Tuple[int, ...]
    offset: int

    @property
    def count(self) -> int:
        """Floats it takes."""
        return int(math.prod(self.shape))


@dataclass
class LayerPlan:
    """One dense layer after static checks.

    Args:
        index: position in the JSON ``layers`` array.
        name: the layer's name (``layers[i]`` when it has none).
        type: the layer's type.
        bottoms: input tensor names it reads (a loss layer reads only its first bottom).
        tops: output tensor names.
        in_shapes / out_shapes: per-sample shapes (see :data:`Shape`).
        params: its parameter blocks, in dense-file order.
        make: ``make(param_arrays, stats, xp) -> forward(*inputs) -> list of outputs``.
        consumed: every bottom it takes from the graph (a loss layer's label too).
    """

    index: int
    name: str
    type: str
    bottoms: Tuple[str, ...]
    tops: Tuple[str, ...]
    in_shapes: Tuple[Shape, ...]
    out_shapes: Tuple[Shape, ...]
    params: Tuple[ParamBlock, ...]
    make: Callable
    consumed: Tuple[str, ...] = ()
    non_trainable: Optional[dict] = None  # BatchNorm: {"features": n, "eps": e}
    make_in_place: Optional[Callable] = None  # `make` for a forward that may overwrite its input
    native: Optional[dict] = None  # attributes for the native executor; None: not native

    @property
    def num_params(self) -> int:
        """Total number of trainable parameters of this layer."""
        return sum(p.count for p in self.params)

    def describe(self) -> str:
        """Short name of this layer for messages: ``layer '<name>' (<type>)``."""
        return f"layer '{self.name}' ({self.type})"


@dataclass
class NetworkPlan:
    """A parsed, checked network without its weights.

    Args:
        source: where the JSON came from (a path, or ``<dict>``).
        dense_dim: dense features per sample.
        data_label_dim: ``Data.label.label_dim`` (summed when it is a list).
        dense_input: the dense input tensor's name.
        label_inputs: the label tensor names (may be empty).
        tables: the embedding inputs, in table order.
        layers: the dense layers in execution (JSON) order.
        output: the tensor returned as the prediction, or the names concatenated when
            the network has more than one loss layer (multi-task).
        output_shape: its per-sample shape.
    """

    source: str
    dense_dim: int
    data_label_dim: int
    dense_input: str
    label_inputs: Tuple[str, ...]
    tables: Tuple[TableSpec, ...]
    layers: Tuple[LayerPlan, ...]
    output: Tuple[str, ...]
    output_shape: Shape
    layout: Tuple[ParamBlock, ...] = field(default=())

    @property
    def num_params(self) -> int:
        """Floats the dense file must hold."""
        return sum(p.count for p in self.layout)

    @property
    def dense_file_bytes(self) -> int:
        """Exact size of the dense file."""
        return 4 * self.num_params

    @property
    def label_dim(self) -> int:
        """Width of the prediction."""
        return per_sample(self.output_shape)

    def breakdown(self, mark_offset: Optional[int] = None) -> str:
        """One line per trainable layer: floats, offset; ``mark_offset`` marks the layer
        holding that float (where a short file runs out)."""
        lines = []
        for layer in self.layers:
            if not layer.params:
                continue
            start = layer.params[0].offset
            end = start + layer.num_params
            parts = " + ".join(f"{p.label} {list(p.shape)}" for p in layer.params)
            mark = ""
            if mark_offset is not None and start <= mark_offset < end:
                mark = "   <-- the file ends here"
            lines.append(
                f"  {layer.describe()}: {parts} = {layer.num_params} floats, "
                f"bytes [{4 * start}, {4 * end}){mark}"
            )
        return "\n".join(lines) if lines else "  (no trainable layers)"
