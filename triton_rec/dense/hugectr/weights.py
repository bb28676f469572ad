"""A HugeCTR network's files beside its JSON: the dense file (every trainable parameter,
its size checked exactly) and the BatchNorm running statistics.

Part of :mod:`triton_rec.dense.hugectr_network`.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, cast

import numpy as np

from triton_rec.config.model_files import open_model_file, read_json
from triton_rec.dense.hugectr.plan import NetworkPlan
from triton_rec.errors import ConfigError, ModelFileError

# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def read_dense_file(plan: NetworkPlan, path: str) -> np.ndarray:
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


def read_non_trainable(plan: NetworkPlan, path: Optional[str]) -> Dict[str, dict]:
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
    doc = read_json(path, "BatchNorm statistics JSON")
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
