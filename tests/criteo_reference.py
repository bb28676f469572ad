"""An independent numpy reference of the generated Criteo DLRM (``ps-loader criteo-dlrm``).

Reads the files on disk directly (the dense file as raw float32, the HugeCTR sparse
directories as raw int64/float32) and runs the network in float64 from the shape the
issue specifies, written out here: dense 13 -> 512 -> 256 -> 128 (ReLU after each), dot
interaction over [bottom MLP output, 26 embeddings] (HugeCTR's order: the MLP output,
then the strict lower triangle (1,0), (2,0), (2,1), ... row by row, then one 0 pad:
shared/reference/hugectr-layers.md, Interaction) -> 480 -> 1024 -> 1024 -> 512 -> 256
(ReLU after each) -> 1 -> sigmoid. Nothing here goes through triton_rec's network code.
"""

from __future__ import annotations

import os
from typing import List, Tuple

import numpy as np

TABLES = 26
DIM = 128
BOTTOM = [(13, 512), (512, 256), (256, 128)]
TOP = [(128 + 27 * 26 // 2 + 1, 1024), (1024, 1024), (1024, 512), (512, 256), (256, 1)]
DENSE_FLOATS = sum(i * o + o for i, o in BOTTOM + TOP)


def load_dense(path: str) -> Tuple[List, List]:
    """(bottom, top): lists of (W [in, out], b [out]) float64, in the dense file's order
    (each layer's W row-major, then its b)."""
    flat = np.fromfile(path, "<f4")
    assert flat.size == DENSE_FLOATS, (flat.size, DENSE_FLOATS)
    pos, layers = 0, []
    for i, o in BOTTOM + TOP:
        w = flat[pos : pos + i * o].reshape(i, o)
        pos += i * o
        layers.append((w.astype(np.float64), flat[pos : pos + o].astype(np.float64)))
        pos += o
    return layers[: len(BOTTOM)], layers[len(BOTTOM) :]


def load_sparse_dirs(paths: List[str]) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per table (keys sorted, their float32 vectors), from HugeCTR sparse directories."""
    out = []
    for p in paths:
        keys = np.fromfile(os.path.join(p, "key"), "<i8")
        vecs = np.fromfile(os.path.join(p, "emb_vector"), "<f4").reshape(keys.size, DIM)
        order = np.argsort(keys)
        out.append((keys[order], vecs[order]))
    return out


def lookup(table, keys: np.ndarray, default: float = 0.0) -> np.ndarray:
    """float64 vectors of ``keys`` (``default`` in every element of an unknown key)."""
    k, v = table
    i = np.minimum(np.searchsorted(k, keys), k.size - 1)
    hit = k[i] == keys
    return np.where(hit[:, None], v[i].astype(np.float64), default)


def predict(bottom, top, tables, des: np.ndarray, cat: np.ndarray) -> np.ndarray:
    """Click probabilities of ``des [B, 13]`` and one key per table ``cat [B, 26]``."""
    x = des.astype(np.float64)
    for w, b in bottom:
        x = np.maximum(x @ w + b, 0.0)
    z = np.stack([x] + [lookup(tables[t], cat[:, t]) for t in range(TABLES)], axis=1)
    gram = np.einsum("bid,bjd->bij", z, z)
    rows, cols = [], []
    for i in range(1, TABLES + 1):
        for j in range(i):
            rows.append(i)
            cols.append(j)
    h = np.concatenate([x, gram[:, rows, cols], np.zeros((x.shape[0], 1))], axis=1)
    for k, (w, b) in enumerate(top):
        h = h @ w + b
        if k < len(top) - 1:
            h = np.maximum(h, 0.0)
    return 1.0 / (1.0 + np.exp(-h[:, 0]))
