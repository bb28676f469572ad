"""HugeCTR's layers: each type's static checks (shapes, attributes), its parameters in
dense-file order and its forward, written once over numpy/CuPy (``xp``).

Part of :mod:`triton_rec.dense.hugectr_network` (where the rules come from, "CN", is said
there). :class:`LayerSpec` reads one layer's JSON object with errors that name the layer and
key; :data:`BUILDERS` maps a layer type to its builder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from triton_rec.dense.hugectr.plan import Shape, fmt_shape, per_sample
from triton_rec.errors import ConfigError

# --------------------------------------------------------------------------------------
# JSON access with errors that name the layer and key
# --------------------------------------------------------------------------------------


class LayerSpec:
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
        """``<source>: layer '<name>' (<type>)``, the start of every message about it."""
        return f"{self.source}: layer '{self.name}' ({self.type})"

    def fail(self, problem: str):
        """Raise ConfigError naming the layer and ``problem``."""
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
        """An integer >= 1 at ``path`` (as :meth:`get`)."""
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
class Built:
    """What a layer's builder gives: its per-sample output shapes, its parameters
    ``(label, shape)`` in dense-file order, and how to make its forward."""

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


def _need_inputs(spec: LayerSpec, shapes, n=None, at_least=None):
    if n is not None and len(shapes) != n:
        spec.fail(f"needs {n} bottom tensor(s), got {len(shapes)}")
    if at_least is not None and len(shapes) < at_least:
        spec.fail(f"needs at least {at_least} bottom tensors, got {len(shapes)}")


def _need_ndim(spec: LayerSpec, shape: Shape, allowed, what="input"):
    if len(shape) not in allowed:
        dims = " or ".join(f"{d}-D" for d in allowed)
        spec.fail(f"{what} must be {dims}, got {fmt_shape(shape)}")


#: Layers whose forward always returns new arrays (never a view of its input), so a
#: following layer may work in place on them.
NEW_OUTPUT = frozenset({"InnerProduct", "MLP", "Interaction", "Concat", "FmOrder2", "MultiCross"})


def then(f, g):
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
    def build(spec: LayerSpec, ins):
        _need_inputs(spec, ins, 1)
        return Built([ins[0]], [], lambda p, s, xp: lambda x: [fn(xp, x)], native=native)

    return build


def _build_relu(spec: LayerSpec, ins):
    # src/layers/relu_layer.cu: x > 0 ? x : 0, except that a NaN stays NaN here (np.maximum;
    # as in PyTorch and onnxruntime): HugeCTR's kernel turns it into 0, which hid an
    # overflow (inf - inf) behind an ordinary-looking prediction (issue 24).
    _need_inputs(spec, ins, 1)
    return Built(
        [ins[0]],
        [],
        lambda p, s, xp: lambda x: [xp.maximum(x, 0)],
        make_in_place=lambda p, s, xp: lambda x: [xp.maximum(x, 0, out=x)],
        native={},
    )


def _build_inner_product(spec: LayerSpec, ins):
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

    return Built([x[:-1] + (n_out,)], [("W", (d_in, n_out)), ("b", (n_out,))], make, native={})


def _build_mlp(spec: LayerSpec, ins):
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

    return Built(
        [(x[0], outs[-1])], params, make, native={"relu": acts, "bias": biases, "outs": outs}
    )


def _build_concat(spec: LayerSpec, ins):
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
                    + ", ".join(fmt_shape(t) for t in ins)
                )
        out = (first[0], sum(s[1] for s in ins))
        return Built(
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
                "dimension, got " + ", ".join(fmt_shape(t) for t in ins)
            )
    dims = list(first)
    dims[axis] = sum(s[axis] for s in ins)
    return Built(
        [tuple(dims)],
        [],
        lambda p, st, xp: lambda *v: [xp.concatenate(v, axis=axis)],
        native={"axis": axis},
    )


def _build_reshape(spec: LayerSpec, ins):
    # CN case Reshape (~1265-1341) and src/layers/reshape_layer.cu.
    _need_inputs(spec, ins, 1)
    x = ins[0]
    floats = per_sample(x)
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
            return Built(
                [out], [], lambda p, st, xp: lambda v: [v.reshape(v.shape[0], -1)], native={}
            )
        out = (x[0], len(sel) * x[2])

        def make_sel(p, st, xp):
            idx = xp.asarray(np.asarray(sel, dtype=np.int64))
            return lambda v: [v[:, idx, :].reshape(v.shape[0], -1)]

        return Built([out], [], make_sel, native={"selected": list(sel)})
    # General reshape: row-major reinterpretation of the whole tensor. leading_dim defaults
    # to the elements of one row (num_elements / dims[0]); time_step 0 -> [N/ld, ld],
    # else [N/(ld*ts), ts, ld].
    row = per_sample(x[1:])
    ld = spec.positive("leading_dim", row)
    ts = spec.get("time_step", 0, int)
    if ts < 0:
        spec.fail(f"'time_step' must be >= 0, got {ts}")
    unit = ld * (ts if ts else 1)
    if floats % unit:
        spec.fail(
            f"cannot reshape {fmt_shape(x)} ({floats} floats per sample) into rows of "
            f"{unit} floats: rows would mix samples"
        )
    if ts:
        out = (floats // unit, ts, ld)
        return Built([out], [], lambda p, st, xp: lambda v: [v.reshape(-1, ts, ld)], native={})
    out = (floats // unit, ld)
    return Built([out], [], lambda p, st, xp: lambda v: [v.reshape(-1, ld)], native={})


def _build_interaction(spec: LayerSpec, ins):
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
        spec.fail(f"inputs {fmt_shape(mlp)} and {fmt_shape(emb)} must be [B, d] and [B, S, d]")
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

    return Built([out], [], make, native={})


def _build_multi_cross(spec: LayerSpec, ins):
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

    return Built([x], params, make, native={"layers": layers, "projection": proj})


def _build_fm_order2(spec: LayerSpec, ins):
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

    return Built([(x[0], d)], [], make, native={})


def _build_slice(spec: LayerSpec, ins):
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
            spec.fail(f"range {r} must satisfy 0 <= start < end <= {width} (input {fmt_shape(x)})")
        if a < prev[0] or b < prev[1]:
            spec.fail(f"range {r} comes before {list(prev)}: starts and ends must not decrease")
        parsed.append((a, b))
        prev = (a, b)
    outs = [x[:-1] + (b - a,) for a, b in parsed]

    def make(p, st, xp):
        return lambda v: [v[..., a:b] for a, b in parsed]

    return Built(outs, [], make, native={"ranges": [list(r) for r in parsed]})


def _build_weight_multiply(spec: LayerSpec, ins):
    # CN case WeightMultiply (~1395-1431); src/layers/weight_multiply_layer.cu: input
    # [B, S] 2-D, weight_dims [S, E] (the weight, in the dense file), output [B, S*E] with
    # out[b, s*E + e] = x[b, s] * W[s, e].
    _need_inputs(spec, ins, 1)
    x = ins[0]
    _need_ndim(spec, x, (2,))
    dims = spec.get("weight_dims", kind="int_list")
    if len(dims) != 2 or dims[0] != x[1] or dims[1] < 1:
        spec.fail(f"'weight_dims' must be [{x[1]}, E] for input {fmt_shape(x)}, got {dims}")
    s, e = dims

    def make(p, st, xp):
        (w,) = p
        return lambda v: [(v[:, :, None] * w[None, :, :]).reshape(v.shape[0], s * e)]

    return Built([(x[0], s * e)], [("W", (s, e))], make, native={})


def _build_reduce_sum(spec: LayerSpec, ins):
    # CN case ReduceSum (~1474-1491); src/layers/reduce_sum_layer.cu: sum over "axis",
    # which stays as a dimension of size 1.
    _need_inputs(spec, ins, 1)
    x = ins[0]
    axis = spec.get("axis", kind=int)
    if axis < 0 or axis >= len(x):
        spec.fail(f"'axis' {axis} is out of range for input {fmt_shape(x)}")
    if axis == 0:
        spec.fail("'axis' 0 sums over the batch: not supported at inference")
    out = tuple(1 if i == axis else d for i, d in enumerate(x))
    return Built(
        [out],
        [],
        lambda p, st, xp: lambda v: [v.sum(axis=axis, keepdims=True)],
        native={"axis": axis},
    )


def _build_elementwise(op):
    # Add (src/layers/add_layer.cu) / ElementwiseMultiply
    # (src/layers/elementwise_multiply_layer.cu): at least 2 inputs of identical shape.
    def build(spec: LayerSpec, ins):
        _need_inputs(spec, ins, at_least=2)
        if any(s != ins[0] for s in ins):
            shapes = ", ".join(fmt_shape(s) for s in ins)
            spec.fail("inputs must have the same shape, got " + shapes)

        def make(p, st, xp):
            def forward(*v):
                acc = v[0]
                for t in v[1:]:
                    acc = acc + t if op == "add" else acc * t
                return [acc]

            return forward

        return Built([ins[0]], [], make, native={})

    return build


def _build_batch_norm(spec: LayerSpec, ins):
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

    return Built(
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
    def build(spec: LayerSpec, ins):
        _need_inputs(spec, ins, 2)
        x = ins[0]
        # create_layers, after the loop: "the prediction tensor for each task must be two dim".
        _need_ndim(spec, x, (2,), "prediction input")
        fn = _sigmoid if kind == "sigmoid" else _softmax
        return Built(
            [x],
            [],
            lambda p, st, xp: lambda v: [fn(xp, v)],
            reads=1,
            native={} if kind == "sigmoid" else None,
        )

    return build


def _build_softmax(spec: LayerSpec, ins):
    # CN case Softmax: one bottom -> SoftmaxLayer; two bottoms is the masked softmax.
    if len(ins) != 1:
        spec.fail("masked Softmax (two bottoms) is not supported")
    return Built([ins[0]], [], lambda p, st, xp: lambda v: [_softmax(xp, v)])


BUILDERS: Dict[str, Callable] = {
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

SUPPORTED_LAYER_TYPES = frozenset(BUILDERS)
