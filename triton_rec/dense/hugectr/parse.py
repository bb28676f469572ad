"""A HugeCTR network JSON -> a checked :class:`~triton_rec.dense.hugectr.plan.NetworkPlan`:
the Data layer, the embedding layers, the tensor graph (every top unique, every bottom
defined and consumed once), each dense layer through its builder.

Part of :mod:`triton_rec.dense.hugectr_network` (where the rules come from, "CN", is said
there).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, cast

from triton_rec.config.model_files import read_json
from triton_rec.dense import Combiner, TableSpec
from triton_rec.dense.hugectr.layers import BUILDERS, SUPPORTED_LAYER_TYPES, Built, LayerSpec
from triton_rec.dense.hugectr.plan import (
    EMBEDDING_TYPES,
    LOSS_TYPES,
    LayerPlan,
    NetworkPlan,
    ParamBlock,
    Shape,
)
from triton_rec.errors import ConfigError

# --------------------------------------------------------------------------------------
# Parsing the network
# --------------------------------------------------------------------------------------


def read_network_json(path: str, what: str = "network JSON") -> Any:
    """The JSON document at ``path`` (ModelFileError naming ``what`` when it cannot be)."""
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


def _parse_data(spec: LayerSpec):  # noqa: C901  (one branch per data-layer field)
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


def _embedding_table(spec: LayerSpec, bottoms, tops, sparse_inputs, sparse_by_top, graph: _Graph):
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
    spec: LayerSpec, bottoms, tops, graph: _Graph, label_dim: int, offset: int
) -> LayerPlan:
    """Check one dense layer against the graph and plan it; its parameters start at
    ``offset`` floats in the dense file."""
    where = f"layer '{spec.name}' ({spec.type})"
    builder = BUILDERS.get(spec.type)
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
    built: Built = builder(spec, in_shapes)
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


def parse_network(doc: Any, source: str, dense: bool = True):
    """The :class:`NetworkPlan` of a network JSON; with ``dense=False`` only its tables
    (a tuple of :class:`TableSpec`): the Data layer and the embedding layers get every
    check, the other layers only the generic ones (an object with a type, bottom/top
    names), so a network whose dense part runs elsewhere (ONNX) is read by this same code."""
    raw_layers = _layers_of(doc, source)
    dense_top, dense_dim, label_dim, label_tops, sparse_inputs = _parse_data(
        LayerSpec(source, 0, raw_layers[0])
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
        spec = LayerSpec(source, i, raw_layers[i])
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
