"""The network as the native executor's program (``src/native/dense_net.hpp``, the
format's only other reader). Part of :mod:`triton_rec.dense.hugectr_network`."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.dense.hugectr.plan import NetworkPlan, per_sample

#: Layer type -> op code of the native executor (``enum class DenseOp`` of
#: ``src/native/dense_net.hpp``, where the codes are defined, exported by the bindings as
#: ``_native.DENSE_OPS``). Both loss layers that become a sigmoid at inference share one code.
NATIVE_OPS: Dict[str, int] = {str(k): int(v) for k, v in _native.DENSE_OPS.items()}
#: First word of a native program ("trecdns1"; ``kDenseProgramMagic`` of dense_net.hpp).
DENSE_PROGRAM_MAGIC = int(_native.DENSE_PROGRAM_MAGIC)


def native_program(
    plan: NetworkPlan, arrays: Sequence[Sequence[np.ndarray]], stats: Dict[str, dict]
) -> Optional[Tuple[np.ndarray, List[np.ndarray]]]:
    """``(program, arrays it points to)`` of a network whose weights are host arrays
    (``arrays``: per layer its parameter arrays; ``stats``: BatchNorm statistics per layer
    name), or None when a layer has no native implementation. The program is valid while
    the arrays it points to live.

    Layout (int64 words): magic, number of registers, [one width (floats per sample)
    per register], dense register, [table registers], [output registers], label_dim,
    number of layers, then per layer: op code (:data:`NATIVE_OPS`), [input registers],
    [output registers], one [shape] per input and per output (per sample), number of
    parameters and per parameter its address and [shape], [attributes]. ``[...]`` is
    a length followed by that many words.
    """
    if any(layer.native is None or layer.type not in NATIVE_OPS for layer in plan.layers):
        return None
    regs: Dict[str, int] = {}
    widths: Dict[int, int] = {}

    def reg(name: str, shape=None) -> int:
        r = regs.setdefault(name, len(regs))
        if shape is not None:
            widths[r] = per_sample(shape)
        return r

    def seq(values) -> List[int]:
        values = [int(v) for v in values]
        return [len(values), *values]

    dense_reg = reg(plan.dense_input, (plan.dense_dim,))
    table_regs = [reg(t.output_name, (t.slot_num, t.vec_size)) for t in plan.tables]
    body: List[int] = []
    keep: List[np.ndarray] = []  # arrays the program points to
    for layer, layer_arrays in zip(plan.layers, arrays):
        ins = [reg(b) for b in layer.bottoms]
        outs = [reg(t, shape) for t, shape in zip(layer.tops, layer.out_shapes)]
        params = [np.ascontiguousarray(a, dtype=np.float32) for a in layer_arrays]
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
            st = stats[layer.name]
            var = np.asarray(st["var"], np.float32)
            params += [
                np.ascontiguousarray(st["mean"], dtype=np.float32),
                (1.0 / np.sqrt(var + eps)).astype(np.float32),
            ]
        keep += params
        body += [NATIVE_OPS[layer.type], *seq(ins), *seq(outs)]
        for shape in (*layer.in_shapes, *layer.out_shapes):
            body += seq(shape)
        body.append(len(params))
        for a in params:
            body += [a.ctypes.data, *seq(a.shape)]
        body += seq(attrs)
    head = [DENSE_PROGRAM_MAGIC, len(regs), *seq(widths[r] for r in range(len(regs)))]
    head += [dense_reg, *seq(table_regs), *seq(regs[t] for t in plan.output)]
    head += [plan.label_dim, len(plan.layers)]
    return np.asarray(head + body, dtype=np.int64), keep
