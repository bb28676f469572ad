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

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from triton_rec.config.model_files import open_model_file, read_json
from triton_rec.dense import Combiner, DenseModel, TableSpec
from triton_rec.errors import ConfigError, ModelFileError

__all__ = ["SUPPORTED_LAYER_TYPES", "HugeCTRNetwork", "LayerPlan", "NetworkPlan", "ParamBlock"]

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


def _fmt(shape: Shape) -> str:
    rows = "B" if shape[0] == 1 else f"B*{shape[0]}"
    return "[" + ", ".join([rows] + [str(d) for d in shape[1:]]) + "]"


def _per_sample(shape: Shape) -> int:
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
        return _per_sample(self.output_shape)

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


# --------------------------------------------------------------------------------------
# JSON access with errors that name the layer and key
# --------------------------------------------------------------------------------------


class _Spec:
    """One layer's JSON object, with typed getters raising ConfigError naming layer and key."""

    def __init__(self, source: str, index: int, obj: Any):
        if not isinstance(obj, dict):
            raise ConfigError(
                f"{source}: layers[{index}] must be an object, got {type(obj).__name__}"
            )
        self.source = source
        self.index = index
        self.obj = obj
        name = obj.get("name")
        self.name = name if isinstance(name, str) and name else f"layers[{index}]"
        layer_type = obj.get("type")
        if not isinstance(layer_type, str) or not layer_type:
            raise ConfigError(f"{source}: layer '{self.name}' has no 'type'")
        self.type = layer_type

    def where(self) -> str:
        return f"{self.source}: layer '{self.name}' ({self.type})"

    def fail(self, problem: str):
        raise ConfigError(f"{self.where()}: {problem}")

    def get(self, path: str, default=..., kind=None):
        """Value at ``a.b.c``; ``default`` when absent (``...`` = required)."""
        cur = self.obj
        for part in path.split("."):
            if not isinstance(cur, dict) or part not in cur:
                if default is ...:
                    self.fail(f"missing key '{path}'")
                return default
            cur = cur[part]
        if kind is not None:
            cur = self._convert(path, cur, kind)
        return cur

    def _convert(self, path, value, kind):
        if kind is int:
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or int(value) != value
            ):
                self.fail(f"'{path}' must be an integer, got {value!r}")
            return int(value)
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self.fail(f"'{path}' must be a number, got {value!r}")
            return float(value)
        if kind is bool:
            if not isinstance(value, bool):
                self.fail(f"'{path}' must be true or false, got {value!r}")
            return value
        if kind is str:
            if not isinstance(value, str):
                self.fail(f"'{path}' must be a string, got {value!r}")
            return value
        if kind == "int_list":
            if not isinstance(value, list):
                self.fail(f"'{path}' must be a list of integers, got {value!r}")
            return [self._convert(path, v, int) for v in value]
        raise AssertionError(kind)

    def positive(self, path: str, default=...) -> int:
        v = self.get(path, default, int)
        if v is not None and v < 1:
            self.fail(f"'{path}' must be >= 1, got {v}")
        return v

    def names(self, key: str) -> Tuple[str, ...]:
        """``bottom`` / ``top``: a string or a list of strings
        (include/parser.hpp ``get_layer_names``)."""
        value = self.get(key)
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(v, str) and v for v in items):
            self.fail(f"'{key}' must be a tensor name or a non-empty list of names, got {value!r}")
        return tuple(items)


# --------------------------------------------------------------------------------------
# Layers: static shapes, parameters, forward functions
# --------------------------------------------------------------------------------------


@dataclass
class _Built:
    out_shapes: List[Shape]
    params: List[Tuple[str, Tuple[int, ...]]]
    make: Callable  # make(params: list, stats: dict|None, xp) -> forward(*inputs) -> list
    reads: int = -1  # how many bottoms forward() takes (-1: all)
    non_trainable: Optional[dict] = None
    # Optional: the same as `make`, for a forward that may overwrite its one input (the
    # executor uses it when that input is a temporary no other layer sees).
    make_in_place: Optional[Callable] = None
    # What the native executor (src/native/dense_net.hpp) needs of this layer beyond its
    # shapes and parameters; None: the layer has no native implementation.
    native: Optional[dict] = None


def _need_inputs(spec: _Spec, shapes, n=None, at_least=None):
    if n is not None and len(shapes) != n:
        spec.fail(f"needs {n} bottom tensor(s), got {len(shapes)}")
    if at_least is not None and len(shapes) < at_least:
        spec.fail(f"needs at least {at_least} bottom tensors, got {len(shapes)}")


def _need_ndim(spec: _Spec, shape: Shape, allowed, what="input"):
    if len(shape) not in allowed:
        dims = " or ".join(f"{d}-D" for d in allowed)
        spec.fail(f"{what} must be {dims}, got {_fmt(shape)}")


#: Layers whose forward always returns new arrays (never a view of its input), so a
#: following layer may work in place on them.
_NEW_OUTPUT = frozenset({"InnerProduct", "MLP", "Interaction", "Concat", "FmOrder2", "MultiCross"})


def _then(f, g):
    """The forward of layer g applied to the one output of layer f."""
    return lambda *v: g(*f(*v))


def _sigmoid(xp, x):
    # 1 / (1 + exp(-x)) (src/layers/sigmoid_layer.cu, sigmoid kernel). Clipping to
    # [-88, 88] keeps exp finite in float32 (no overflow warning) and changes nothing
    # above 88 (both give 1.0) and only denormals below -88 (< 1e-38). A NaN stays NaN
    # (np.clip keeps it; so does dense_net.hpp's sigmoid: docs/backends.md, "Extreme inputs").
    z = xp.exp(-xp.clip(x, -88.0, 88.0))
    z += 1.0
    return xp.reciprocal(z, out=z).astype(xp.float32, copy=False)


def _softmax(xp, x):
    # Softmax over the last dimension (src/layers/softmax_layer.cu: hidden_size_ = last dim).
    z = xp.exp(x - x.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(xp.float32)


def _same_shape_unary(fn, native=None):
    def build(spec: _Spec, ins):
        _need_inputs(spec, ins, 1)
        return _Built([ins[0]], [], lambda p, s, xp: lambda x: [fn(xp, x)], native=native)

    return build


def _build_relu(spec: _Spec, ins):
    # src/layers/relu_layer.cu: x > 0 ? x : 0, except that a NaN stays NaN here (np.maximum;
    # as in PyTorch and onnxruntime): HugeCTR's kernel turns it into 0, which hid an
    # overflow (inf - inf) behind an ordinary-looking prediction (issue 24).
    _need_inputs(spec, ins, 1)
    return _Built(
        [ins[0]],
        [],
        lambda p, s, xp: lambda x: [xp.maximum(x, 0)],
        make_in_place=lambda p, s, xp: lambda x: [xp.maximum(x, 0, out=x)],
        native={},
    )


def _build_inner_product(spec: _Spec, ins):
    # CN case InnerProduct (~815-877): out = in dims with the last replaced by num_output,
    # 2-D or 3-D input. src/layers/fully_connected_layer.cu FullyConnectedLayer<float>:
    # weight [in, out] then bias [1, out] (constructor set_weight(0/1)); fprop is a GEMM of
    # the row-major [rows, in] input (leading dims flattened) by W, plus the bias per row.
    _need_inputs(spec, ins, 1)
    x = ins[0]
    _need_ndim(spec, x, (2, 3))
    n_out = spec.positive("fc_param.num_output")
    d_in = x[-1]

    def make(p, stats, xp):
        w, b = p

        def forward(v):
            y = xp.matmul(v, w)  # xp.matmul: a capturable GEMM on the GPU
            y += b  # y is new: add the bias in place
            return [y]

        return forward

    return _Built([x[:-1] + (n_out,)], [("W", (d_in, n_out)), ("b", (n_out,))], make, native={})


def _build_mlp(spec: _Spec, ins):
    # CN case MLP (~678-790): mlp_param.num_outputs (list), activation / activations
    # ("Relu" | "None", include/parser.hpp ACTIVATION_TYPE_MAP), use_bias / biases.
    # src/layers/mlp_layer.cu MLPLayer::MLPLayer: per layer i, set_weight(2i, [in, out]) and
    # set_weight(2i+1, [1, out]) *always*, so the dense file holds every bias even when
    # use_bias is false (it is then not added). Input size = bottom dims[1] (2-D).
    # fprop: src/layers/functors/fused_fc_layer_functors.cu set_fprop_attr: row-major
    # [B, in] x [in, out], bias and activation fused into the epilogue of every layer,
    # the last one included.
    _need_inputs(spec, ins, 1)
    x = ins[0]
    _need_ndim(spec, x, (2,))
    outs = spec.get("mlp_param.num_outputs", kind="int_list")
    if not outs or any(o < 1 for o in outs):
        spec.fail(f"'mlp_param.num_outputs' must be a non-empty list of sizes >= 1, got {outs}")
    n = len(outs)

    def act_of(value, key):
        if not isinstance(value, str) or value.lower() not in ("relu", "none"):
            spec.fail(f"'{key}' must be 'Relu' or 'None', got {value!r}")
        return value.lower() == "relu"

    # "act_type" is the Python API's name for "activation"; accepted as an alias.
    act_key = "mlp_param.activation"
    if spec.get(act_key, None) is None and spec.get("mlp_param.act_type", None) is not None:
        act_key = "mlp_param.act_type"
    act = act_of(spec.get(act_key, "Relu"), act_key)
    acts_json = spec.get("mlp_param.activations", None)
    if acts_json is not None:
        if not isinstance(acts_json, list) or len(acts_json) != n:
            spec.fail(f"'mlp_param.activations' must list {n} activations, got {acts_json!r}")
        acts = [act_of(a, "mlp_param.activations") for a in acts_json]
    else:
        acts = [act] * n
    use_bias = spec.get("mlp_param.use_bias", True, bool)
    biases_json = spec.get("mlp_param.biases", None)
    if biases_json is not None:
        if (
            not isinstance(biases_json, list)
            or len(biases_json) != n
            or not all(isinstance(b, bool) for b in biases_json)
        ):
            spec.fail(f"'mlp_param.biases' must list {n} booleans, got {biases_json!r}")
        biases = list(biases_json)
    else:
        biases = [use_bias] * n

    params = []
    d_in = x[1]
    for i, d_out in enumerate(outs):
        params += [(f"W{i}", (d_in, d_out)), (f"b{i}", (d_out,))]
        d_in = d_out

    def make(p, stats, xp):
        def forward(v):
            for i in range(n):
                v = xp.matmul(v, p[2 * i])  # a new array: bias and activation in place
                if biases[i]:
                    v += p[2 * i + 1]
                if acts[i]:
                    xp.maximum(v, 0, out=v)
            return [v]

        return forward

    return _Built(
        [(x[0], outs[-1])], params, make, native={"relu": acts, "bias": biases, "outs": outs}
    )


def _build_concat(spec: _Spec, ins):
    # CN case Concat (~372-407): 2-D first input -> ConcatLayer (axis ignored,
    # src/layers/concat_layer.cu: all 2-D, same height, columns in bottom order);
    # 3-D -> Concat3DLayer along "axis" (default 1; src/layers/concat_3d_layer.cu, 1 or 2).
    _need_inputs(spec, ins, at_least=1)
    first = ins[0]
    _need_ndim(spec, first, (2, 3), "first input")
    if len(first) == 2:
        for s in ins:
            if len(s) != 2 or s[0] != first[0]:
                spec.fail(
                    "2-D concat needs 2-D inputs of the same height, got "
                    + ", ".join(_fmt(t) for t in ins)
                )
        out = (first[0], sum(s[1] for s in ins))
        return _Built(
            [out], [], lambda p, st, xp: lambda *v: [xp.concatenate(v, axis=1)], native={"axis": 1}
        )
    axis = spec.get("axis", 1, int)
    if axis not in (1, 2):
        spec.fail(f"'axis' of a 3-D concat must be 1 or 2, got {axis}")
    keep = 2 if axis == 1 else 1
    for s in ins:
        if len(s) != 3 or s[0] != first[0] or s[keep] != first[keep]:
            spec.fail(
                f"3-D concat along axis {axis} needs 3-D inputs agreeing on every other "
                "dimension, got " + ", ".join(_fmt(t) for t in ins)
            )
    dims = list(first)
    dims[axis] = sum(s[axis] for s in ins)
    return _Built(
        [tuple(dims)],
        [],
        lambda p, st, xp: lambda *v: [xp.concatenate(v, axis=axis)],
        native={"axis": axis},
    )


def _build_reshape(spec: _Spec, ins):
    # CN case Reshape (~1265-1341) and src/layers/reshape_layer.cu.
    _need_inputs(spec, ins, 1)
    x = ins[0]
    per_sample = _per_sample(x)
    selected = spec.get("selected", None)
    if selected is not None:
        # Selective reshape: [B, S, V] -> [B, len(selected) * V], the listed slots in list
        # order (reshape_kernel: input_slot_id = selected[output_slot_id]); an empty list
        # is a plain [B, S * V] reshape (in_place_ = selected.empty()).
        sel = spec.get("selected", kind="int_list")
        _need_ndim(spec, x, (3,), "input of a 'selected' reshape")
        bad = [s for s in sel if s < 0 or s >= x[1]]
        if bad:
            spec.fail(f"'selected' slots must be in [0, {x[1]}), got {bad}")
        if not sel:
            out: Shape = (x[0], x[1] * x[2])
            return _Built(
                [out], [], lambda p, st, xp: lambda v: [v.reshape(v.shape[0], -1)], native={}
            )
        out = (x[0], len(sel) * x[2])

        def make_sel(p, st, xp):
            idx = xp.asarray(np.asarray(sel, dtype=np.int64))
            return lambda v: [v[:, idx, :].reshape(v.shape[0], -1)]

        return _Built([out], [], make_sel, native={"selected": list(sel)})
    # General reshape: row-major reinterpretation of the whole tensor. leading_dim defaults
    # to the elements of one row (num_elements / dims[0]); time_step 0 -> [N/ld, ld],
    # else [N/(ld*ts), ts, ld].
    row = _per_sample(x[1:])
    ld = spec.positive("leading_dim", row)
    ts = spec.get("time_step", 0, int)
    if ts < 0:
        spec.fail(f"'time_step' must be >= 0, got {ts}")
    unit = ld * (ts if ts else 1)
    if per_sample % unit:
        spec.fail(
            f"cannot reshape {_fmt(x)} ({per_sample} floats per sample) into rows of "
            f"{unit} floats: rows would mix samples"
        )
    if ts:
        out = (per_sample // unit, ts, ld)
        return _Built([out], [], lambda p, st, xp: lambda v: [v.reshape(-1, ts, ld)], native={})
    out = (per_sample // unit, ld)
    return _Built([out], [], lambda p, st, xp: lambda v: [v.reshape(-1, ld)], native={})


def _build_interaction(spec: _Spec, ins):
    # CN case Interaction (~916-949); src/layers/interaction_layer.cu: inputs mlp [B, d]
    # and emb [B, S, d]; Z = [mlp; emb_0..emb_{S-1}] (n = S+1 rows); output
    # [B, d + n(n-1)/2 + 1] = mlp, then <Z_i, Z_j> for the strict lower triangle in
    # row-major order (i = 1..n-1, j = 0..i-1: the kernels index pairs (row, col), col > row,
    # at col*(col-1)/2 + row), then one padding element. The fp32 kernel leaves the pad
    # unwritten (fresh buffer), the fp16 kernel writes 0: we write 0.
    _need_inputs(spec, ins, 2)
    mlp, emb = ins
    _need_ndim(spec, mlp, (2,), "first input (bottom MLP)")
    _need_ndim(spec, emb, (3,), "second input (embeddings)")
    if mlp[0] != emb[0] or mlp[1] != emb[2]:
        spec.fail(f"inputs {_fmt(mlp)} and {_fmt(emb)} must be [B, d] and [B, S, d]")
    n = emb[1] + 1
    out = (mlp[0], mlp[1] + n * (n - 1) // 2 + 1)

    def make(p, st, xp):
        ii, jj = np.tril_indices(n, -1)
        ii, jj = xp.asarray(ii), xp.asarray(jj)

        def forward(m, e):
            z = xp.concatenate([m[:, None, :], e], axis=1)
            gram = xp.matmul(z, z.transpose(0, 2, 1))
            pad = xp.zeros((m.shape[0], 1), dtype=xp.float32)
            return [xp.concatenate([m, gram[:, ii, jj], pad], axis=1)]

        return forward

    return _Built([out], [], make, native={})


def _build_multi_cross(spec: _Spec, ins):
    # CN case MultiCross (~950-1001): mc_param.num_layers, mc_param.projection_dim (absent
    # or 0 -> DCN v1). src/layers/multi_cross_layer.cu MultiCrossLayer constructor:
    # v1 per layer set_weight(2i, [1, d]), set_weight(2i+1, [1, d]) -> w_i, b_i;
    # v2 per layer U [d, p], V [p, d], b [1, d] (set_weight 3i, 3i+1, 3i+2).
    # v1 forward (MultiCrossForwardFunctor): x_{i+1} = x0 * (x_i . w_i) + x_i + b_i.
    # v2 forward (MultiCrossForwardFunctorv2): x_{i+1} = x0 * (x_i U_i V_i + b_i) + x_i.
    _need_inputs(spec, ins, 1)
    x = ins[0]
    _need_ndim(spec, x, (2,))
    layers = spec.positive("mc_param.num_layers")
    proj = spec.get("mc_param.projection_dim", 0, int)
    if proj < 0:
        spec.fail(f"'mc_param.projection_dim' must be >= 0, got {proj}")
    d = x[1]
    params = []
    for i in range(layers):
        if proj:
            params += [(f"U{i}", (d, proj)), (f"V{i}", (proj, d)), (f"b{i}", (d,))]
        else:
            params += [(f"w{i}", (d,)), (f"b{i}", (d,))]

    def make(p, st, xp):
        def forward(x0):
            xl = x0
            for i in range(layers):
                if proj:
                    u, v, b = p[3 * i : 3 * i + 3]
                    xl = x0 * (xp.matmul(xp.matmul(xl, u), v) + b) + xl
                else:
                    w, b = p[2 * i : 2 * i + 2]
                    xl = x0 * xp.matmul(xl, w)[:, None] + xl + b
            return [xl]

        return forward

    return _Built([x], params, make, native={"layers": layers, "projection": proj})


def _build_fm_order2(spec: _Spec, ins):
    # CN case FmOrder2 (~1432-1451): out [B, out_dim]; src/layers/fm_order2_layer.cu:
    # input [B, S*D] 2-D, D = out_dim, in width % D == 0;
    # out[d] = 0.5 * ((sum_s x[s,d])^2 - sum_s x[s,d]^2).
    _need_inputs(spec, ins, 1)
    x = ins[0]
    _need_ndim(spec, x, (2,))
    d = spec.positive("out_dim")
    if x[1] % d:
        spec.fail(f"input width {x[1]} is not a multiple of out_dim {d}")

    def make(p, st, xp):
        def forward(v):
            v3 = v.reshape(v.shape[0], -1, d)
            s = v3.sum(axis=1)
            return [0.5 * (s * s - (v3 * v3).sum(axis=1))]

        return forward

    return _Built([(x[0], d)], [], make, native={})


def _build_slice(spec: _Spec, ins):
    # CN case Slice (~1365-1394); src/layers/slice_layer.cu SliceLayer constructor: one
    # output per range, half-open [a, b) on the last dimension; a < b, both >= 0, a and b
    # each non-decreasing from range to range (overlap allowed), b <= width.
    _need_inputs(spec, ins, 1)
    x = ins[0]
    ranges = spec.get("ranges")
    if not isinstance(ranges, list) or not ranges:
        spec.fail(f"'ranges' must be a non-empty list of [start, end] pairs, got {ranges!r}")
    parsed = []
    prev = (-1, 0)
    width = x[-1]
    for r in ranges:
        if (
            not isinstance(r, list)
            or len(r) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in r)
        ):
            spec.fail(f"each range must be [start, end] with integers, got {r!r}")
        a, b = r
        if a < 0 or a >= b or b > width:
            spec.fail(f"range {r} must satisfy 0 <= start < end <= {width} (input {_fmt(x)})")
        if a < prev[0] or b < prev[1]:
            spec.fail(f"range {r} comes before {list(prev)}: starts and ends must not decrease")
        parsed.append((a, b))
        prev = (a, b)
    outs = [x[:-1] + (b - a,) for a, b in parsed]

    def make(p, st, xp):
        return lambda v: [v[..., a:b] for a, b in parsed]

    return _Built(outs, [], make, native={"ranges": [list(r) for r in parsed]})


def _build_weight_multiply(spec: _Spec, ins):
    # CN case WeightMultiply (~1395-1431); src/layers/weight_multiply_layer.cu: input
    # [B, S] 2-D, weight_dims [S, E] (the weight, in the dense file), output [B, S*E] with
    # out[b, s*E + e] = x[b, s] * W[s, e].
    _need_inputs(spec, ins, 1)
    x = ins[0]
    _need_ndim(spec, x, (2,))
    dims = spec.get("weight_dims", kind="int_list")
    if len(dims) != 2 or dims[0] != x[1] or dims[1] < 1:
        spec.fail(f"'weight_dims' must be [{x[1]}, E] for input {_fmt(x)}, got {dims}")
    s, e = dims

    def make(p, st, xp):
        (w,) = p
        return lambda v: [(v[:, :, None] * w[None, :, :]).reshape(v.shape[0], s * e)]

    return _Built([(x[0], s * e)], [("W", (s, e))], make, native={})


def _build_reduce_sum(spec: _Spec, ins):
    # CN case ReduceSum (~1474-1491); src/layers/reduce_sum_layer.cu: sum over "axis",
    # which stays as a dimension of size 1.
    _need_inputs(spec, ins, 1)
    x = ins[0]
    axis = spec.get("axis", kind=int)
    if axis < 0 or axis >= len(x):
        spec.fail(f"'axis' {axis} is out of range for input {_fmt(x)}")
    if axis == 0:
        spec.fail("'axis' 0 sums over the batch: not supported at inference")
    out = tuple(1 if i == axis else d for i, d in enumerate(x))
    return _Built(
        [out],
        [],
        lambda p, st, xp: lambda v: [v.sum(axis=axis, keepdims=True)],
        native={"axis": axis},
    )


def _build_elementwise(op):
    # Add (src/layers/add_layer.cu) / ElementwiseMultiply
    # (src/layers/elementwise_multiply_layer.cu): at least 2 inputs of identical shape.
    def build(spec: _Spec, ins):
        _need_inputs(spec, ins, at_least=2)
        if any(s != ins[0] for s in ins):
            spec.fail("inputs must have the same shape, got " + ", ".join(_fmt(s) for s in ins))

        def make(p, st, xp):
            def forward(*v):
                acc = v[0]
                for t in v[1:]:
                    acc = acc + t if op == "add" else acc * t
                return [acc]

            return forward

        return _Built([ins[0]], [], make, native={})

    return build


def _build_batch_norm(spec: _Spec, ins):
    # CN case BatchNorm (~200-253): bn_param.eps (bn_param.factor is training only).
    # src/layers/batch_norm_layer.cu: 2-D input, CUDNN_BATCHNORM_PER_ACTIVATION over the
    # features; set_weight(0) gamma [n], set_weight(1) beta [n]; inference
    # (cudnnBatchNormalizationForwardInference) y = gamma * (x - mean) / sqrt(var + eps) + beta
    # with the running mean/var, which only come from the non-trainable parameters file
    # (src/network.cpp Network::upload_non_trainable_params_to_device_inference).
    _need_inputs(spec, ins, 1)
    x = ins[0]
    _need_ndim(spec, x, (2,))
    eps = spec.get("bn_param.eps", kind=float)
    if eps < 0:
        spec.fail(f"'bn_param.eps' must be >= 0, got {eps}")
    n = x[1]

    def make(p, stats, xp):
        gamma, beta = p
        mean = xp.asarray(stats["mean"], dtype=xp.float32)
        var = xp.asarray(stats["var"], dtype=xp.float32)
        inv_std = (1.0 / xp.sqrt(var + xp.float32(eps))).astype(xp.float32)
        return lambda v: [gamma * ((v - mean) * inv_std) + beta]

    return _Built(
        [x],
        [("gamma", (n,)), ("beta", (n,))],
        make,
        non_trainable={"features": n},
        native={"eps": eps},
    )


def _build_loss(kind):
    # CN cases BinaryCrossEntropyLoss (~307-340), MultiCrossEntropyLoss (~1003-1035):
    # with inference_flag the layer becomes a Sigmoid of bottom[0]; CrossEntropyLoss
    # (~408-437) becomes a Softmax. Bottom [prediction, label]; the label is never read.
    def build(spec: _Spec, ins):
        _need_inputs(spec, ins, 2)
        x = ins[0]
        # create_layers, after the loop: "the prediction tensor for each task must be two dim".
        _need_ndim(spec, x, (2,), "prediction input")
        fn = _sigmoid if kind == "sigmoid" else _softmax
        return _Built(
            [x],
            [],
            lambda p, st, xp: lambda v: [fn(xp, v)],
            reads=1,
            native={} if kind == "sigmoid" else None,
        )

    return build


def _build_softmax(spec: _Spec, ins):
    # CN case Softmax: one bottom -> SoftmaxLayer; two bottoms is the masked softmax.
    if len(ins) != 1:
        spec.fail("masked Softmax (two bottoms) is not supported")
    return _Built([ins[0]], [], lambda p, st, xp: lambda v: [_softmax(xp, v)])


_BUILDERS: Dict[str, Callable] = {
    "InnerProduct": _build_inner_product,
    "MLP": _build_mlp,
    "ReLU": _build_relu,
    "Sigmoid": _same_shape_unary(_sigmoid, native={}),
    # src/layers/dropout_layer.cu fprop(is_train=false): a copy.
    "Dropout": _same_shape_unary(lambda xp, x: x, native={}),
    "Softmax": _build_softmax,
    "Concat": _build_concat,
    "Reshape": _build_reshape,
    "Interaction": _build_interaction,
    "MultiCross": _build_multi_cross,
    "FmOrder2": _build_fm_order2,
    "Slice": _build_slice,
    "WeightMultiply": _build_weight_multiply,
    "ReduceSum": _build_reduce_sum,
    "Add": _build_elementwise("add"),
    "ElementwiseMultiply": _build_elementwise("mul"),
    "BatchNorm": _build_batch_norm,
    "BinaryCrossEntropyLoss": _build_loss("sigmoid"),
    "MultiCrossEntropyLoss": _build_loss("sigmoid"),
    "CrossEntropyLoss": _build_loss("softmax"),
}

SUPPORTED_LAYER_TYPES = frozenset(_BUILDERS)

#: Layer type -> op code of the native executor (``enum class DenseOp`` of
#: ``src/native/dense_net.hpp``, same order). Both loss layers that become a sigmoid
#: at inference share one code.
NATIVE_OPS: Dict[str, int] = {
    "InnerProduct": 0,
    "MLP": 1,
    "ReLU": 2,
    "Sigmoid": 3,
    "Dropout": 4,
    "Concat": 5,
    "Reshape": 6,
    "Interaction": 7,
    "MultiCross": 8,
    "FmOrder2": 9,
    "Slice": 10,
    "WeightMultiply": 11,
    "Add": 12,
    "ElementwiseMultiply": 13,
    "BatchNorm": 14,
    "BinaryCrossEntropyLoss": 15,
    "MultiCrossEntropyLoss": 15,
    "ReduceSum": 16,
}
#: First word of a native program ("trecdns1").
DENSE_PROGRAM_MAGIC = 0x74726563646E7331


# --------------------------------------------------------------------------------------
# Parsing the network
# --------------------------------------------------------------------------------------


def _read_json(path: str, what: str = "network JSON") -> Any:
    return read_json(path, what)


def _layers_of(doc: Any, source: str) -> list:
    # Accepted: {"layers": [...], ...any other keys ("solver", "optimizer", "inference")};
    # a bare list of layers. The v3.0 samples carry an "inference" object next to "layers".
    if isinstance(doc, list):
        layers = doc
    elif isinstance(doc, dict):
        if "layers" not in doc:
            if "data" in doc:
                raise ConfigError(
                    f"{source}: pre-v2.1 network format (top-level 'data', no Data layer) "
                    "is not supported: the first layer must be of type 'Data'"
                )
            raise ConfigError(f"{source}: no 'layers' array")
        layers = doc["layers"]
    else:
        raise ConfigError(f"{source}: the network JSON must be an object with 'layers'")
    if not isinstance(layers, list) or not layers:
        raise ConfigError(f"{source}: 'layers' must be a non-empty array")
    return layers


def _parse_data(spec: _Spec):  # noqa: C901  (one branch per data-layer field)
    # src/parsers/inference_parser.cpp InferenceParser::InferenceParser and
    # include/parser.hpp check_graph: dense {top, dense_dim}; label {label_dim, top?}
    # (label_dim and top may be lists: multi-task); sparse [{top, slot_num,
    # nnz_per_slot | max_feature_num_per_sample}].
    if spec.type != "Data":
        spec.fail("the first layer must be the Data layer (type 'Data')")
    dense_top = spec.get("dense.top", kind=str)
    dense_dim = spec.get("dense.dense_dim", kind=int)
    if dense_dim < 0:
        spec.fail(f"'dense.dense_dim' must be >= 0, got {dense_dim}")
    label_dims = spec.get("label.label_dim", 1)
    label_dims = label_dims if isinstance(label_dims, list) else [label_dims]
    label_dim = 0
    for v in label_dims:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            spec.fail(
                f"'label.label_dim' must be an integer or a list of integers, got {label_dims}"
            )
        label_dim += v
    label_tops = spec.get("label.top", None)
    if label_tops is None:
        label_tops = ()
    elif isinstance(label_tops, str):
        label_tops = (label_tops,)
    elif isinstance(label_tops, list) and all(isinstance(t, str) for t in label_tops):
        label_tops = tuple(label_tops)
    else:
        spec.fail(f"'label.top' must be a name or a list of names, got {label_tops!r}")
    sparse = spec.get("sparse", [])
    if not isinstance(sparse, list):
        spec.fail("'sparse' must be an array")
    inputs = []
    for k, entry in enumerate(sparse):
        key = f"sparse[{k}]"
        if not isinstance(entry, dict):
            spec.fail(f"'{key}' must be an object")
        top = entry.get("top")
        if not isinstance(top, str) or not top:
            spec.fail(f"'{key}.top' must be a tensor name")
        slot_num = spec._convert(f"{key}.slot_num", entry.get("slot_num"), int)
        if slot_num < 1:
            spec.fail(f"'{key}.slot_num' must be >= 1, got {slot_num}")
        # include/parser.hpp get_max_nnz_from_nnz_per_slot /
        # get_max_feature_num_per_sample_from_nnz_per_slot; v3.0 files give
        # max_feature_num_per_sample instead.
        max_nnz = max_feat = None
        nnz = entry.get("nnz_per_slot")
        if isinstance(nnz, list):
            nnz = spec._convert(f"{key}.nnz_per_slot", nnz, "int_list")
            if len(nnz) != slot_num:
                spec.fail(f"'{key}.nnz_per_slot' has {len(nnz)} entries for {slot_num} slots")
            max_nnz, max_feat = max(nnz), sum(nnz)
        elif nnz is not None:
            max_nnz = spec._convert(f"{key}.nnz_per_slot", nnz, int)
            max_feat = max_nnz * slot_num
        if "max_feature_num_per_sample" in entry:
            max_feat = spec._convert(
                f"{key}.max_feature_num_per_sample", entry["max_feature_num_per_sample"], int
            )
        inputs.append((top, slot_num, max_nnz, max_feat))
    return dense_top, dense_dim, label_dim, label_tops, inputs


class _Graph:
    """Tensor bookkeeping (include/parser.hpp check_graph / activate_tensor /
    deactivate_tensor): every top name unique, every bottom defined and consumed at most
    once. Unconsumed tensors are fine."""

    def __init__(self, source: str):
        self.source = source
        self.shapes: Dict[str, Shape] = {}  # tensors available at inference
        self.producer: Dict[str, str] = {}
        self.consumer: Dict[str, str] = {}

    def define(self, name: str, shape: Optional[Shape], by: str):
        if name in self.producer:
            raise ConfigError(
                f"{self.source}: tensor '{name}' is produced twice ({self.producer[name]} and "
                f"{by}); top names must be unique"
            )
        self.producer[name] = by
        if shape is not None:
            self.shapes[name] = shape

    def consume(self, name: str, by: str):
        if name not in self.producer:
            raise ConfigError(
                f"{self.source}: {by} reads tensor '{name}', which no earlier layer produces"
            )
        if name in self.consumer:
            raise ConfigError(
                f"{self.source}: tensor '{name}' is read by both {self.consumer[name]} and {by}; "
                "HugeCTR lets a tensor be consumed once (duplicate it with a Slice layer)"
            )
        self.consumer[name] = by


def _embedding_table(spec: _Spec, bottoms, tops, sparse_inputs, sparse_by_top, graph: _Graph):
    """(table index, TableSpec) of an embedding layer.

    src/parsers/inference_parser.cpp create_embedding: a layer whose (single) bottom is a
    sparse input is that input's embedding; combiner "sum"/"mean" (v3.0: 0/1); output
    [B, slot_num, embedding_vec_size] (src/inference/embedding_feature_combiner.cu).
    """
    if spec.type not in EMBEDDING_TYPES:
        reads = [b for b in bottoms if b in sparse_by_top]
        spec.fail(
            f"reads the sparse input '{reads[0]}' but is not an embedding layer "
            f"(one of {sorted(EMBEDDING_TYPES)})"
        )
    if len(bottoms) != 1 or bottoms[0] not in sparse_by_top:
        spec.fail(f"an embedding layer's bottom must be one Data.sparse input, got {list(bottoms)}")
    if len(tops) != 1:
        spec.fail(f"an embedding layer has one top, got {list(tops)}")
    k = sparse_by_top[bottoms[0]]
    top_in, slot_num, max_nnz, max_feat = sparse_inputs[k]
    vec = spec.positive("sparse_embedding_hparam.embedding_vec_size")
    comb = Combiner.parse(
        spec.get("sparse_embedding_hparam.combiner"),
        f"{spec.where()}: 'sparse_embedding_hparam.combiner'",
    )
    where = f"layer '{spec.name}' ({spec.type})"
    graph.consume(bottoms[0], where)
    graph.define(tops[0], (1, slot_num, vec), where)
    table = TableSpec(
        name=spec.name,
        slot_num=slot_num,
        vec_size=vec,
        combiner=comb,
        max_nnz=max_nnz,
        max_feature_num_per_sample=max_feat,
        input_name=top_in,
        output_name=tops[0],
    )
    return k, table


def _dense_layer(
    spec: _Spec, bottoms, tops, graph: _Graph, label_dim: int, offset: int
) -> LayerPlan:
    """Check one dense layer against the graph and plan it; its parameters start at
    ``offset`` floats in the dense file."""
    where = f"layer '{spec.name}' ({spec.type})"
    builder = _BUILDERS.get(spec.type)
    if builder is None:
        raise ConfigError(
            f"{spec.source}: layer '{spec.name}' has unsupported type '{spec.type}' "
            f"(supported: {', '.join(sorted(SUPPORTED_LAYER_TYPES))})"
        )
    is_loss = spec.type in LOSS_TYPES
    if is_loss and len(bottoms) != 2:
        spec.fail(f"a loss layer needs 2 bottoms [prediction, label], got {list(bottoms)}")
    reads = bottoms[:1] if is_loss else bottoms
    for b in reads:
        if b not in graph.producer:
            graph.consume(b, where)  # raises: undefined
        if b not in graph.shapes:
            spec.fail(f"tensor '{b}' is not available at inference (a label or sparse input)")
    in_shapes = [graph.shapes[b] for b in reads]
    if is_loss:
        in_shapes.append((1, label_dim))  # the label: counted, never read
    built: _Built = builder(spec, in_shapes)
    if len(built.out_shapes) != len(tops):
        spec.fail(f"produces {len(built.out_shapes)} tensor(s) but names {len(tops)} top(s)")
    for b in bottoms:
        if is_loss and b != bottoms[0] and b not in graph.producer:
            continue  # an undeclared label name (v3.0 files have no label top)
        graph.consume(b, where)
    for t, shape in zip(tops, built.out_shapes):
        graph.define(t, shape, where)
    blocks = []
    for label, shape in built.params:
        blocks.append(ParamBlock(spec.name, spec.type, label, tuple(shape), offset))
        offset += blocks[-1].count
    return LayerPlan(
        index=spec.index,
        name=spec.name,
        type=spec.type,
        bottoms=tuple(reads),
        tops=tops,
        in_shapes=tuple(in_shapes[: len(reads)]),
        out_shapes=tuple(built.out_shapes),
        params=tuple(blocks),
        make=built.make,
        consumed=bottoms,
        non_trainable=built.non_trainable,
        make_in_place=built.make_in_place,
        native=built.native,
    )


def _parse(doc: Any, source: str, dense: bool = True):
    """The :class:`NetworkPlan` of a network JSON; with ``dense=False`` only its tables
    (a tuple of :class:`TableSpec`): the Data layer and the embedding layers get every
    check, the other layers only the generic ones (an object with a type, bottom/top
    names), so a network whose dense part runs elsewhere (ONNX) is read by this same code."""
    raw_layers = _layers_of(doc, source)
    dense_top, dense_dim, label_dim, label_tops, sparse_inputs = _parse_data(
        _Spec(source, 0, raw_layers[0])
    )
    graph = _Graph(source)
    graph.define(dense_top, (1, dense_dim), "the Data layer (dense)")
    for t in label_tops:
        graph.define(t, None, "the Data layer (label)")  # never fed at inference
    sparse_by_top = {}
    for k, entry in enumerate(sparse_inputs):
        graph.define(entry[0], None, f"the Data layer (sparse[{k}])")
        sparse_by_top[entry[0]] = k

    tables: List[Optional[TableSpec]] = [None] * len(sparse_inputs)
    table_order: List[int] = []
    plans: List[LayerPlan] = []
    offset = 0
    for i in range(1, len(raw_layers)):
        spec = _Spec(source, i, raw_layers[i])
        bottoms, tops = spec.names("bottom"), spec.names("top")
        # CN get_input_tensor_and_output_name: a bottom may not also be a top.
        both = set(bottoms) & set(tops)
        if both:
            spec.fail(f"tensor(s) {sorted(both)} are both bottom and top")
        if spec.type in EMBEDDING_TYPES or any(b in sparse_by_top for b in bottoms):
            k, tables_k = _embedding_table(spec, bottoms, tops, sparse_inputs, sparse_by_top, graph)
            tables[k] = tables_k
            table_order.append(k)
            continue
        if dense:
            plans.append(_dense_layer(spec, bottoms, tops, graph, label_dim, offset))
            offset += plans[-1].num_params

    missing = [sparse_inputs[k][0] for k, t in enumerate(tables) if t is None]
    if missing:
        raise ConfigError(
            f"{source}: sparse input(s) {missing} of the Data layer have no embedding layer"
        )
    if table_order != sorted(table_order):
        # Upstream takes slot counts from Data.sparse order but vector sizes, row pointers
        # and sparse files from embedding-layer order (inference_parser.cpp): they must agree.
        raise ConfigError(
            f"{source}: the embedding layers must follow the order of the Data layer's sparse "
            f"inputs ({[s[0] for s in sparse_inputs]})"
        )
    if not dense:
        return tuple(tables)
    if not plans:
        raise ConfigError(f"{source}: the network has no dense layers")
    losses = [p.tops[0] for p in plans if p.type in LOSS_TYPES]
    if len(losses) > 1:
        # CN create_layers, end: with more than one loss layer at inference the prediction
        # is the concatenation of the tasks' outputs ("multi_task_combined_pred").
        output = tuple(losses)
        if any(graph.shapes[t][0] != 1 for t in losses):
            raise ConfigError(f"{source}: multi-task outputs {losses} must be [B, n]")
        output_shape: Shape = (1, sum(graph.shapes[t][1] for t in losses))
    else:
        # The prediction is the last tensor entry (CN Network::create_network:
        # evaluate_tensor_entries.back()): the last top of the last layer.
        output = (plans[-1].tops[-1],)
        output_shape = graph.shapes[output[0]]
    return NetworkPlan(
        source=source,
        dense_dim=dense_dim,
        data_label_dim=label_dim,
        dense_input=dense_top,
        label_inputs=label_tops,
        tables=cast(Tuple[TableSpec, ...], tuple(tables)),  # none missing (checked above)
        layers=tuple(plans),
        output=output,
        output_shape=output_shape,
        layout=tuple(p for plan in plans for p in plan.params),
    )


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def _read_dense_file(plan: NetworkPlan, path: str) -> np.ndarray:
    """The dense file's floats, after checking its size exactly (see the module docstring)."""
    fd, st = open_model_file(path, "dense file")
    with os.fdopen(fd, "rb") as f:
        return _read_dense_floats(plan, path, f, st.st_size)


def _read_dense_floats(plan: NetworkPlan, path: str, f, size: int) -> np.ndarray:
    want = plan.dense_file_bytes
    if size < want:
        have = size // 4
        raise ModelFileError(
            path,
            f"dense file too short: the network {plan.source} needs {want} bytes "
            f"({plan.num_params} float32 parameters) but the file has {size} bytes. "
            f"Parameters per layer, in file order:\n{plan.breakdown(mark_offset=have)}",
        )
    if size > want:
        raise ModelFileError(
            path,
            f"dense file too long: the network {plan.source} needs exactly {want} bytes "
            f"({plan.num_params} float32 parameters) but the file has {size} bytes "
            f"({size - want} bytes more). HugeCTR would read the first {want} bytes and ignore "
            "the rest; we refuse, because a file that does not fit its JSON is almost always "
            "the wrong file or the wrong JSON. Parameters per layer, in file order:\n"
            f"{plan.breakdown()}",
        )
    try:
        data = np.fromfile(f, dtype="<f4", count=plan.num_params)
    except OSError as e:
        raise ModelFileError(path, f"cannot read the dense file: {e}") from e
    if data.shape[0] != plan.num_params:
        raise ModelFileError(path, f"read {data.shape[0]} floats, expected {plan.num_params}")
    return data.astype(np.float32, copy=False)


def _read_non_trainable(plan: NetworkPlan, path: Optional[str]) -> Dict[str, dict]:
    """Running statistics per BatchNorm layer name.

    Format (src/network.cpp Network::upload_non_trainable_params_to_device_inference):
    ``{"layers": [{"type": "BatchNorm", "mean": [...], "var": [...]}, ...]}``, the k-th entry
    belonging to the k-th layer with non-trainable parameters (only BatchNorm has any).
    """
    bn_layers = [p for p in plan.layers if p.non_trainable is not None]
    if not bn_layers:
        return {}
    if path is None:
        names = ", ".join(f"'{p.name}'" for p in bn_layers)
        raise ConfigError(
            f"{plan.source}: BatchNorm layer(s) {names} need running mean/variance: pass "
            "non_trainable_params_file (ps.json 'non_trainable_params_file')"
        )
    doc = _read_json(path, "BatchNorm statistics JSON")
    entries = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ModelFileError(
            path, 'expected {"layers": [{"type": "BatchNorm", "mean": [...], "var": [...]}, ...]}'
        )
    if len(entries) != len(bn_layers):
        raise ModelFileError(
            path,
            f"has {len(entries)} entries but the network {plan.source} has {len(bn_layers)} "
            f"BatchNorm layer(s) ({', '.join(p.name for p in bn_layers)}), "
            "one entry each, in order",
        )
    stats = {}
    for k, (entry, layer) in enumerate(zip(entries, bn_layers)):
        n = cast(dict, layer.non_trainable)["features"]  # bn_layers: not None
        if not isinstance(entry, dict) or entry.get("type") != "BatchNorm":
            raise ModelFileError(
                path, f"layers[{k}] must have type 'BatchNorm' (for layer '{layer.name}')"
            )
        arrays = {}
        for key in ("mean", "var"):
            try:
                arr = np.asarray(entry.get(key), dtype=np.float32)
            except (TypeError, ValueError) as e:
                raise ModelFileError(path, f"layers[{k}].{key} must be a list of numbers") from e
            if arr.ndim != 1 or arr.shape[0] != n:
                raise ModelFileError(
                    path,
                    f"layers[{k}].{key} must hold {n} values for BatchNorm layer '{layer.name}', "
                    f"got shape {list(arr.shape)}",
                )
            arrays[key] = arr
        if np.any(arrays["var"] < 0):
            raise ModelFileError(path, f"layers[{k}].var has negative values")
        stats[layer.name] = arrays
    return stats


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------


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
                prev[0] = _then(prev[0], make(arrays, stats.get(layer.name), xp))
                prev[2] = outs
                prev[3] = layer.type in _NEW_OUTPUT or make is layer.make_in_place
            else:
                program.append(
                    [
                        layer.make(arrays, stats.get(layer.name), xp),
                        ins,
                        outs,
                        layer.type in _NEW_OUTPUT,
                    ]
                )
        kept = {regs[t] for t in keep}
        self._program = [
            (f, ins, outs, tuple(i for i in ins if i not in kept)) for f, ins, outs, _ in program
        ]
        self._num_regs = len(regs)
        self._out_regs = [regs[t] for t in plan.output]
        widths = {
            t: _per_sample(s) for layer in plan.layers for t, s in zip(layer.tops, layer.out_shapes)
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
            doc = _read_json(source)
        else:
            source, doc = "<network json>", network_json
        return _parse(doc, source)

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
        weights = _read_dense_file(plan, os.fspath(dense_file))
        nt_path = os.fspath(non_trainable_params_file) if non_trainable_params_file else None
        stats = _read_non_trainable(plan, nt_path)
        return cls(plan, weights, stats, xp)

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
            doc = _read_json(source)
        else:
            source, doc = "<network json>", network_json
        return _parse(doc, source, dense=False)

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
        format's only other reader), or None when a layer has no native implementation
        or the weights are not host arrays. The program holds the addresses of this
        object's weight arrays: it is valid while this object lives.

        Layout (int64 words): magic, number of registers, [one width (floats per sample)
        per register], dense register, [table registers], [output registers], label_dim,
        number of layers, then per layer: op code (:data:`NATIVE_OPS`), [input registers],
        [output registers], one [shape] per input and per output (per sample), number of
        parameters and per parameter its address and [shape], [attributes]. ``[...]`` is
        a length followed by that many words.
        """
        if self.xp is not np or any(
            layer.native is None or layer.type not in NATIVE_OPS for layer in self.plan.layers
        ):
            return None
        plan = self.plan
        regs: Dict[str, int] = {}
        widths: Dict[int, int] = {}

        def reg(name: str, shape=None) -> int:
            r = regs.setdefault(name, len(regs))
            if shape is not None:
                widths[r] = _per_sample(shape)
            return r

        def seq(values) -> List[int]:
            values = [int(v) for v in values]
            return [len(values), *values]

        dense_reg = reg(plan.dense_input, (plan.dense_dim,))
        table_regs = [reg(t.output_name, (t.slot_num, t.vec_size)) for t in plan.tables]
        body: List[int] = []
        self._native_keep: List[np.ndarray] = []  # arrays the program points to
        for layer, arrays in zip(plan.layers, self._arrays):
            ins = [reg(b) for b in layer.bottoms]
            outs = [reg(t, shape) for t, shape in zip(layer.tops, layer.out_shapes)]
            params = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
            attrs: List[int] = []
            native = layer.native or {}
            if layer.type == "MLP":
                attrs = [len(native["outs"]), *native["relu"], *native["bias"]]
            elif layer.type == "Reshape":
                attrs = list(native.get("selected", []))
            elif layer.type == "MultiCross":
                attrs = [native["layers"], native["projection"]]
            elif layer.type in ("Concat", "ReduceSum"):
                attrs = [native["axis"]]
            elif layer.type == "Slice":
                attrs = [v for r in native["ranges"] for v in r]
            elif layer.type == "BatchNorm":
                eps = np.float32(native["eps"])
                st = self._stats[layer.name]
                var = np.asarray(st["var"], np.float32)
                params += [
                    np.ascontiguousarray(st["mean"], dtype=np.float32),
                    (1.0 / np.sqrt(var + eps)).astype(np.float32),
                ]
            self._native_keep += params
            body += [NATIVE_OPS[layer.type], *seq(ins), *seq(outs)]
            for shape in (*layer.in_shapes, *layer.out_shapes):
                body += seq(shape)
            body.append(len(params))
            for a in params:
                body += [a.ctypes.data, *seq(a.shape)]
            body += seq(attrs)
        head = [DENSE_PROGRAM_MAGIC, len(regs), *seq(widths[r] for r in range(len(regs)))]
        head += [dense_reg, *seq(table_regs), *seq(regs[t] for t in plan.output)]
        head += [self.label_dim, len(plan.layers)]
        return np.asarray(head + body, dtype=np.int64)

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
