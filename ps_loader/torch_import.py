"""Embedding tables from PyTorch state dicts -> HugeCTR sparse directories or ``.npz`` tables.

    python -m ps_loader.torch_import state.pt --out DIR [--table NAME]... \\
        [--keys NAME=keys.npy]... [--format hugectr|npz] [--prefix P] [--list]

Files are read with ``torch.load(path, weights_only=True)``: plain tensors and
containers only. A file that needs arbitrary objects unpickled is refused (the error
names the file and the object); nothing from it is executed.

Layouts found without ``--table`` (nested checkpoints such as ``{"state_dict": {...}}``
are flattened with ``.``-joined keys first):

- TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection``:
  ``[<module prefix>.]embedding_bags.<table>.weight`` or ``...embeddings.<table>.weight``
  (e.g. ``model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight``);
  the table is called ``<table>``;
- an ``nn.Embedding`` / ``nn.EmbeddingBag`` state dict (only ``weight``), or a bare tensor:
  one table named after the file;
- ``<prefix>.weight`` of a module whose name contains ``emb`` and that has no bias
  (``nn.Embedding`` / ``nn.EmbeddingBag`` inside a model): the table is ``<prefix>``.

``--table NAME`` picks tables explicitly (in that order): a table name from the list
above, a state-dict key, or a module prefix (``NAME.weight``).

Row i of a ``[N, D]`` weight gets key i, unless keys are given for the table (int64,
N unique values, e.g. the ids the model was trained with).

Precision (issue 15; :mod:`triton_rec.precision`): float16 weights stay fp16 and 8-bit
row-wise quantized weights stay int8, row for row, in an encoded ``.npz`` (the ps.json
fields printed then include ``embedding_precision``); other floating dtypes (bfloat16,
float64) are stored as float32. Quantized layouts read:

- TorchRec's quantized ``EmbeddingBagCollection`` / ``EmbeddingCollection`` saved with
  split scale and bias (``quant_state_dict_split_scale_bias=True``): ``<table>.weight``
  uint8 ``[N, D]`` beside ``<table>.weight_qscale`` and ``<table>.weight_qbias``
  (float16 ``[N, 1]`` each; ``[N]`` and float32 accepted too): found by itself, the
  scale and bias widened to float32 (exact) behind the D bytes.
- a uint8 weight whose layout the file does not say: name it with
  ``--quantized NAME=LAYOUT``: ``fused8`` (FBGEMM/caffe2 fused 8-bit row-wise,
  ``FloatToFused8BitRowwiseQuantized``: D bytes then float32 scale and bias, our int8
  layout byte for byte), ``tbe-int8:D`` (a TorchRec/TBE INT8 row as that state dict holds
  it unsplit: float16 scale, float16 bias, D bytes, padding), ``tbe-fp16:D`` (the bytes
  of D float16 values, then padding).

int4/int2 tables are refused, naming the tensor (TorchRec saves their weights as its
``UInt4Tensor`` / ``UInt2Tensor`` subclasses, which weights-only loading refuses; the
message then says so).

Where TorchRec's names and shapes come from (pytorch/torchrec at a48cef79, pytorch/FBGEMM
at 71d6f8b2):

- ``torchrec/quant/embedding_modules.py`` lines 457-488 (``EmbeddingBagCollection
  .__init__``) and 847-869 (``EmbeddingCollection``): per table, the module
  ``embedding_bags[<name>]`` / ``embeddings[<name>]`` registers the buffer ``weight``
  and, in split mode only, ``weight_qscale`` and ``weight_qbias``, from
  ``split_embedding_weights_with_scale_bias(split_scale_bias_mode=2 if
  quant_state_dict_split_scale_bias else 0)``;
- ``torchrec/distributed/quant_state.py`` lines 57-97 (``post_state_dict_hook``): the
  sharded modules write the same ``<prefix>.<table>.weight`` / ``.weight_qscale`` /
  ``.weight_qbias`` keys (always split: mode 2, line 156);
- ``fbgemm_gpu/fbgemm_gpu/split_table_batched_embeddings_ops_inference.py`` line 1705
  (``split_embedding_weights_with_scale_bias``): mode 2 drops the row padding and
  returns ``q [N, D]`` and ``scale``, ``bias`` as ``[N, 1]`` float16 views of the 4
  bytes in front of each row (behind it with ``reverse_qparam``); mode 0 returns the
  padded row as it is (``rounded_row_size_in_bytes``, line 74: ``D + 4`` bytes rounded
  up to ``row_alignment``): the ``tbe-int8:D`` layout. FP16 tables come out as uint8
  bytes (``[N, 2 D]`` and padding): ``tbe-fp16:D``. Mode 1 (``q`` plus a uint8
  ``[N, 4]`` scale-bias tensor) is in no TorchRec state dict, and no TorchRec module
  names a combined ``qscalebias`` tensor.

An unsplit uint8 weight is not guessed: a TBE row (``4 + D`` bytes and padding) and an
FBGEMM fused row (``D + 8`` bytes) can have the same width.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from triton_rec.errors import ModelFileError, TritonRecError
from triton_rec.formats.tables import write_table_rows
from triton_rec.precision import INT8_TRAILER_BYTES, RowCodec

FORMATS = ("hugectr", "npz")
#: ``--quantized`` layouts of a uint8 weight (see the module docstring)
QUANTIZED_LAYOUTS = ("fused8", "tbe-int8", "tbe-fp16")
_TBE_SCALE_BIAS_BYTES = 4  # float16 scale + float16 bias in front of a TBE INT8 row
_TORCHREC_RE = re.compile(r"(?:^|\.)(?:embedding_bags|embeddings)\.([^.]+)\.weight$")
_LISTED_KEYS = 40
# the tensor subclasses of TorchRec's int4 / int2 table weights (torchrec/tensor_types.py
# lines 157 and 168), registered as the weight by torchrec/quant/embedding_modules.py 474-477
_SUBBYTE_TENSOR_CLASSES = ("UInt4Tensor", "UInt2Tensor")


@dataclass(frozen=True)
class TorchTable:
    """One embedding table found in a state dict.

    Args:
        name: table name (used in file listings and ps.json ``embedding_table_names``).
        key: the state-dict key of its weight.
        data: the table's rows in ``codec``'s precision (float32 ``[rows, vec_size]``
            for fp32).
        codec: the precision of ``data`` (default fp32).
    """

    name: str
    key: str
    data: np.ndarray
    codec: Optional[RowCodec] = None

    def __post_init__(self):
        if self.codec is None:
            object.__setattr__(self, "codec", RowCodec("fp32", int(self.data.shape[1])))

    @property
    def precision(self) -> str:
        """``fp32``, ``fp16`` or ``int8``."""
        return self.codec.precision

    @property
    def weight(self) -> np.ndarray:
        """float32 ``[rows, vec_size]`` (decoded when the table is quantized)."""
        return self.data if self.precision == "fp32" else self.codec.decode(self.data)

    @property
    def rows(self) -> int:
        """Rows of the table."""
        return int(self.data.shape[0])

    @property
    def vec_size(self) -> int:
        """Embedding vector size."""
        return int(self.codec.dim)


@dataclass(frozen=True)
class ImportedTable:
    """A table written by :func:`write_tables`: where from, where to, how big."""

    name: str
    key: str
    rows: int
    vec_size: int
    path: str
    precision: str = "fp32"


def load_state_dict(path: str) -> Dict[str, Any]:
    """``torch.load(path, weights_only=True)``, flattened to ``{dotted key: tensor}``.

    Raises:
        ModelFileError: naming ``path``: missing, not a PyTorch file, or needing
            arbitrary objects unpickled (refused).
    """
    if not os.path.isfile(path):
        raise ModelFileError(path, "PyTorch state dict file does not exist")
    import pickle

    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # The type torch.load(weights_only=True) raises when its restricted unpickler
        # refuses the file. Its text (worded differently by each torch version) advises
        # loading with weights_only=False, which is exactly what must not be done with a
        # file of unknown origin: only our own words are shown ("from None").
        unsafe = _unsafe_globals(torch, path)
        subbyte = [g for g in unsafe if g.rsplit(".", 1)[-1] in _SUBBYTE_TENSOR_CLASSES]
        if subbyte:
            raise ModelFileError(
                path,
                f"refused: it holds TorchRec int4/int2 quantized weights ({', '.join(subbyte)}); "
                "only fp32, fp16 and 8-bit row-wise (int8) tables can be imported",
            ) from None
        if unsafe:
            raise ModelFileError(
                path,
                f"refused: loading it needs arbitrary Python objects unpickled (global "
                f"{', '.join(unsafe)}); only files that torch.load(weights_only=True) accepts "
                "are read (save the model's state_dict(), not the model)",
            ) from None
        raise ModelFileError(
            path,
            "not a readable PyTorch file (torch.load(weights_only=True) refuses its pickle; "
            "only plain tensors and containers are read)",
        ) from None
    except Exception as e:  # noqa: BLE001 - torch's loader raises anything on a foreign file
        first = str(e).splitlines()[0] if str(e).strip() else ""
        first = f"{type(e).__name__}: {first}" if first else type(e).__name__
        raise ModelFileError(path, f"not a readable PyTorch file ({first})") from e
    return flatten_state(obj)


def _unsafe_globals(torch, path: str) -> List[str]:
    """The globals of a checkpoint that weights_only loading does not allow (torch's own
    static scan of the pickle, nothing executed); [] if torch cannot say."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - not a zip checkpoint, or an older torch
        return []


def flatten_state(obj: Any, prefix: str = "") -> Dict[str, Any]:
    """Tensors of a (nested) state dict / checkpoint as ``{dotted key: tensor}``.

    A bare tensor becomes ``{"weight": tensor}``; non-tensor leaves are dropped.
    """
    import torch

    out: Dict[str, Any] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix or "weight"] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            out.update(flatten_state(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flatten_state(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def _describe(state: Mapping[str, Any]) -> str:
    items = [f"{k} {list(v.shape)}" for k, v in state.items()]
    more = len(items) - _LISTED_KEYS
    text = ", ".join(items[:_LISTED_KEYS]) or "none"
    return text + (f", ... ({more} more)" if more > 0 else "")


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:120] or "table"


def _candidates(state: Mapping[str, Any], default_name: str) -> Dict[str, str]:
    """Auto-detected tables: ``{table name: state-dict key}`` in state-dict order."""
    two_d = [k for k, v in state.items() if getattr(v, "ndim", 0) == 2]
    found: List[tuple] = []
    for k in two_d:
        m = _TORCHREC_RE.search(k)
        if m:
            found.append((m.group(1), k))
    if not found and list(state) == ["weight"] and two_d == ["weight"]:
        found.append((default_name, "weight"))
    if not found:
        for k in two_d:
            if not k.endswith(".weight"):
                continue
            module = k[: -len(".weight")]
            if "emb" in module.rsplit(".", 1)[-1].lower() and f"{module}.bias" not in state:
                found.append((module, k))
    names = [n for n, _ in found]
    # A table name seen twice (two collections) is qualified by its full module path.
    return {_safe_name(n if names.count(n) == 1 else k[: -len(".weight")]): k for n, k in found}


def find_tables(
    state: Mapping[str, Any],
    names: Optional[Sequence[str]] = None,
    source: str = "<state dict>",
    quantized: Optional[Mapping[str, str]] = None,
) -> List[TorchTable]:
    """Embedding tables of a flattened state dict (see the module docstring).

    Args:
        state: ``{key: tensor}`` (nested dicts are flattened here too).
        names: tables to take, in order (table name, state-dict key or module prefix);
            None: every auto-detected table.
        source: the file, for messages (also the default name of a bare table).
        quantized: per table name, the layout of its uint8 weight (``fused8``,
            ``tbe-int8:D``, ``tbe-fp16:D``).

    Raises:
        ModelFileError: naming ``source``: no table found / a name matching nothing,
            with the tensors the file holds; a weight that is not a 2-D float tensor
            or a quantized table of a known layout.
    """
    state = flatten_state(state)
    stem = os.path.splitext(os.path.basename(source))[0] if source != "<state dict>" else "table"
    auto = _candidates(state, _safe_name(stem))
    if names is None:
        if not auto:
            raise ModelFileError(
                source,
                "no embedding table found (expected TorchRec-style "
                "'embedding_bags.<table>.weight' / 'embeddings.<table>.weight', an "
                "nn.Embedding/EmbeddingBag state dict holding 'weight', or '<module>.weight' "
                "of a module named *emb*; choose tensors with --table). "
                f"Tensors found: {_describe(state)}",
            )
        chosen = list(auto.items())
    else:
        chosen = []
        for n in names:
            if n in auto:
                chosen.append((n, auto[n]))
            elif n in state:
                chosen.append((_safe_name(n[: -len(".weight")] if n.endswith(".weight") else n), n))
            elif f"{n}.weight" in state:
                chosen.append((_safe_name(n), f"{n}.weight"))
            else:
                raise ModelFileError(
                    source,
                    f"no table or tensor named '{n}'. Tables found: "
                    f"{sorted(auto) or 'none'}; tensors found: {_describe(state)}",
                )
    seen = [n for n, _ in chosen]
    if len(set(seen)) != len(seen):
        raise ModelFileError(source, f"table names repeat: {seen}")
    quantized = dict(quantized or {})
    unknown = sorted(set(quantized) - set(seen))
    if unknown:
        raise ModelFileError(source, f"--quantized names unknown tables {unknown}; tables: {seen}")
    return [TorchTable(n, k, *_table_rows(state, k, source, quantized.get(n))) for n, k in chosen]


def _table_rows(state: Mapping[str, Any], key: str, source: str, layout: Optional[str]):
    """``(rows, codec)`` of the weight at ``key`` in its own precision (codec None: fp32)."""
    import torch

    t = state[key]
    if t.ndim != 2:
        raise ModelFileError(source, f"'{key}' is {t.dtype} {list(t.shape)}, not a 2-D weight")
    t = t.detach().to(device="cpu").contiguous()
    if layout is not None and t.dtype != torch.uint8:
        raise ModelFileError(
            source, f"--quantized {layout} for '{key}', which is {t.dtype}, not uint8"
        )
    if t.dtype == torch.float16:
        return t.numpy(), RowCodec("fp16", int(t.shape[1]))
    if torch.is_floating_point(t):
        return t.to(torch.float32).numpy(), None
    if t.dtype == torch.uint8:
        return _quantized_rows(state, key, t.numpy(), source, layout)
    raise ModelFileError(
        source,
        f"'{key}' is {t.dtype} {list(t.shape)}: not a floating-point weight or an 8-bit "
        "row-wise quantized one (int4/int2 tables are not supported)",
    )


def _quantized_rows(state, key: str, q: np.ndarray, source: str, layout: Optional[str]):
    """A uint8 weight in our int8 (or fp16) layout, from the layouts of the module doc."""
    n, width = q.shape
    module = key[: -len(".weight")] if key.endswith(".weight") else key
    qscale, qbias = state.get(f"{module}.weight_qscale"), state.get(f"{module}.weight_qbias")
    if layout is None and qscale is not None and qbias is not None:  # TorchRec, split
        scale = _column(qscale, f"{module}.weight_qscale", n, source)
        bias = _column(qbias, f"{module}.weight_qbias", n, source)
        codec = RowCodec("int8", width)
        return codec.pack_int8(q, scale, bias), codec
    if layout is None:
        raise ModelFileError(
            source,
            f"'{key}' is uint8 {list(q.shape)}: a quantized table whose layout the file does "
            "not say; name it with --quantized NAME=fused8 (FBGEMM fused 8-bit row-wise: "
            "D bytes, then float32 scale and bias), tbe-int8:D (TorchRec/TBE INT8 rows: "
            "float16 scale and bias, D bytes, padding) or tbe-fp16:D",
        )
    kind, _, dim_text = layout.partition(":")
    if kind == "fused8" and not dim_text:
        if width <= INT8_TRAILER_BYTES:
            raise ModelFileError(source, f"'{key}' [{n}, {width}] is not a fused8 table")
        return np.ascontiguousarray(q), RowCodec("int8", width - INT8_TRAILER_BYTES)
    if kind not in QUANTIZED_LAYOUTS[1:] or not dim_text.isdigit() or int(dim_text) < 1:
        raise ModelFileError(
            source, f"unknown --quantized layout {layout!r} (fused8, tbe-int8:D, tbe-fp16:D)"
        )
    d = int(dim_text)
    if kind == "tbe-fp16":
        if width < 2 * d:
            raise ModelFileError(source, f"'{key}' rows of {width} bytes hold no {d} float16")
        return np.ascontiguousarray(q[:, : 2 * d]).view(np.float16), RowCodec("fp16", d)
    if width < _TBE_SCALE_BIAS_BYTES + d:
        raise ModelFileError(source, f"'{key}' rows of {width} bytes hold no {d} int8 values")
    sb = np.ascontiguousarray(q[:, :_TBE_SCALE_BIAS_BYTES]).view(np.float16)  # [N, 2]
    data = q[:, _TBE_SCALE_BIAS_BYTES : _TBE_SCALE_BIAS_BYTES + d]
    codec = RowCodec("int8", d)
    return codec.pack_int8(data, sb[:, :1], sb[:, 1:]), codec


def _column(t: Any, key: str, n: int, source: str) -> np.ndarray:
    """A float ``[n, 1]`` (or ``[n]``) tensor as float32 ``[n, 1]``."""
    import torch

    if not torch.is_floating_point(t) or t.numel() != n or t.shape[0] != n:
        raise ModelFileError(
            source, f"'{key}' is {t.dtype} {list(t.shape)}, not a float [{n}, 1] column"
        )
    return t.detach().to(device="cpu", dtype=torch.float32).reshape(n, 1).numpy()


def _check_keys(table: TorchTable, keys: Any) -> np.ndarray:
    keys = np.asarray(keys)
    if keys.ndim != 1 or keys.shape[0] != table.rows:
        raise ValueError(
            f"table {table.name}: {table.rows} keys needed (one per row), got shape {keys.shape}"
        )
    if keys.size and not np.issubdtype(keys.dtype, np.integer):
        raise ValueError(f"table {table.name}: keys must be integers, got {keys.dtype}")
    keys = keys.astype(np.int64)
    if np.unique(keys).shape[0] != keys.shape[0]:
        raise ValueError(f"table {table.name}: keys are not unique")
    return keys


def table_path(
    out_dir: str, index: int, fmt: str = "hugectr", prefix: str = "", iteration: int = 0
) -> str:
    """HugeCTR ``<prefix><i>_sparse_<iteration>.model`` (directory) or ``<prefix><i>.npz``."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "npz":
        return os.path.join(out_dir, f"{prefix}{index}.npz")
    return os.path.join(out_dir, f"{prefix}{index}_sparse_{iteration}.model")


def write_tables(
    tables: Sequence[TorchTable],
    out_dir: str,
    keys: Optional[Mapping[str, Any]] = None,
    fmt: str = "hugectr",
    prefix: str = "",
    iteration: int = 0,
) -> List[ImportedTable]:
    """Write table i to :func:`table_path` (``out_dir`` is created).

    Args:
        keys: per table name, the key of every row (default: row ids 0..N-1).
    """
    keys = dict(keys or {})
    unknown = set(keys) - {t.name for t in tables}
    if unknown:
        raise ValueError(
            f"keys given for unknown tables {sorted(unknown)}; tables: {[t.name for t in tables]}"
        )
    checked = {
        t.name: (
            _check_keys(t, keys[t.name]) if t.name in keys else np.arange(t.rows, dtype=np.int64)
        )
        for t in tables
    }
    os.makedirs(out_dir, exist_ok=True)
    out = []
    for i, t in enumerate(tables):
        # HugeCTR sparse files hold float32 only: a quantized table goes to an .npz
        path = table_path(out_dir, i, fmt if t.precision == "fp32" else "npz", prefix, iteration)
        write_table_rows(path, checked[t.name], t.data, t.codec)
        out.append(ImportedTable(t.name, t.key, t.rows, t.vec_size, path, t.precision))
    return out


def import_tables(
    path: str,
    out_dir: str,
    names: Optional[Sequence[str]] = None,
    keys: Optional[Mapping[str, Any]] = None,
    fmt: str = "hugectr",
    prefix: str = "",
    iteration: int = 0,
    quantized: Optional[Mapping[str, str]] = None,
) -> List[ImportedTable]:
    """:func:`load_state_dict` + :func:`find_tables` + :func:`write_tables`."""
    tables = find_tables(load_state_dict(path), names, source=path, quantized=quantized)
    return write_tables(tables, out_dir, keys, fmt, prefix, iteration)


def _parse_keys(specs: Sequence[str]) -> Dict[str, np.ndarray]:
    out = {}
    for spec in specs:
        name, sep, file = spec.partition("=")
        if not sep or not name or not file:
            raise ValueError(f"--keys wants NAME=FILE.npy, got {spec!r}")
        try:
            out[name] = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ModelFileError(file, f"cannot read keys as a .npy array ({e})") from e
    return out


def _parse_quantized(specs: Sequence[str]) -> Dict[str, str]:
    out = {}
    for spec in specs:
        name, sep, layout = spec.partition("=")
        if not sep or not name or not layout:
            raise ValueError(f"--quantized wants NAME=LAYOUT, got {spec!r}")
        out[name] = layout
    return out


def main(argv=None) -> int:
    """Command line entry point (``python -m ps_loader.torch_import``); returns the exit status."""
    p = argparse.ArgumentParser(
        prog="python -m ps_loader.torch_import",
        description="Embedding tables from a PyTorch state dict (torch.load weights_only=True) "
        "-> HugeCTR sparse directories or .npz tables.",
    )
    p.add_argument("state", help="a .pt/.pth file saved with torch.save(model.state_dict())")
    p.add_argument("--out", help="output directory (required unless --list)")
    p.add_argument(
        "--table",
        action="append",
        dest="tables",
        metavar="NAME",
        help="table to take (repeatable; order = table index): table name, "
        "state-dict key or module prefix; default: every table found",
    )
    p.add_argument(
        "--keys",
        action="append",
        default=[],
        metavar="NAME=FILE.npy",
        help="int64 key of every row of table NAME (default: row ids)",
    )
    p.add_argument(
        "--quantized",
        action="append",
        default=[],
        metavar="NAME=LAYOUT",
        help="layout of table NAME's uint8 weight: fused8, tbe-int8:D or tbe-fp16:D",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="hugectr",
        help="of float32 tables (fp16/int8 tables are always written as .npz)",
    )
    p.add_argument(
        "--prefix", default="", help="file name prefix (HugeCTR: <prefix><i>_sparse_0.model)"
    )
    p.add_argument("--iteration", type=int, default=0, help="HugeCTR file name iteration number")
    p.add_argument("--list", action="store_true", help="list the tables found, write nothing")
    args = p.parse_args(argv)
    if not args.list and not args.out:
        p.error("--out is required (or --list)")
    try:
        tables = find_tables(
            load_state_dict(args.state),
            args.tables,
            source=args.state,
            quantized=_parse_quantized(args.quantized),
        )
        print(f"{args.state}: {len(tables)} table(s)")
        for i, t in enumerate(tables):
            print(f"  {i}: {t.name}: {t.rows} rows x {t.vec_size} {t.precision} ({t.key})")
        if args.list:
            return 0
        written = write_tables(
            tables, args.out, _parse_keys(args.keys), args.format, args.prefix, args.iteration
        )
    except (TritonRecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for w in written:
        print(f"wrote {w.path}")
    print("ps.json: " + json_fields(written))
    return 0


def json_fields(written: Sequence[ImportedTable]) -> str:
    """The ps.json ``models[]`` fields these tables fill, as JSON text."""
    import json

    fields = {
        "sparse_files": [w.path for w in written],
        "embedding_table_names": [w.name for w in written],
        "embedding_vecsize_per_table": [w.vec_size for w in written],
    }
    if any(w.precision != "fp32" for w in written):
        fields["embedding_precision"] = [w.precision for w in written]
    return json.dumps(fields)


if __name__ == "__main__":
    sys.exit(main())
