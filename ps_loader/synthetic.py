"""Deterministic synthetic tables in HugeCTR layout, for the demo repository and tests.

Vectors are a pure function of (seed, table index, key), so a test can recompute the
expected vector of any key independently of the files (:func:`expected_vector`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

from triton_rec.formats.hugectr_sparse import write_sparse_dir


@dataclass(frozen=True)
class SyntheticTable:
    """Args: name, rows (key count), vec_size, max_keys_per_sample, default_value."""

    name: str
    rows: int
    vec_size: int
    max_keys_per_sample: int
    default_value: float = 0.0


def table_keys(seed: int, table_index: int, rows: int) -> np.ndarray:
    """Unique, shuffled int64 keys spread over the whole int64 range (negative ones too)."""
    rng = np.random.default_rng([seed, table_index, 1])
    keys = np.unique(rng.integers(-(2**62), 2**62, size=rows + rows // 8 + 16, dtype=np.int64))
    keys = keys[:rows]
    if keys.shape[0] < rows:  # practically unreachable; keep the contract honest
        raise RuntimeError("could not draw enough unique keys")
    rng.shuffle(keys)
    return keys


def expected_vectors(seed: int, table_index: int, keys: np.ndarray, vec_size: int) -> np.ndarray:
    """The vectors that :func:`write_model` stores for ``keys`` (computed from the keys alone)."""
    k = np.asarray(keys, dtype=np.int64).astype(np.uint64)[:, None]
    j = np.arange(vec_size, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        h = (k * np.uint64(0x9E3779B97F4A7C15)) ^ (j * np.uint64(0xBF58476D1CE4E5B9))
        h ^= np.uint64(seed * 0x94D049BB133111EB % 2**64) + np.uint64(table_index)
        h = (h ^ (h >> np.uint64(31))) * np.uint64(0xD6E8FEB86659FD93)
        h ^= h >> np.uint64(32)
    # 24 random bits -> uniform in [-1, 1)
    return ((h & np.uint64(0xFFFFFF)).astype(np.float32) / np.float32(2**23)) - np.float32(1.0)


def write_model(
    repo_dir: str, model: str, tables: Sequence[SyntheticTable], seed: int = 0, version: int = 1
) -> Dict:
    """Write one HugeCTR sparse directory per table under ``<repo_dir>/<model>/<version>/``.

    Returns the ps.json ``models[]`` entry for the model, with paths relative to
    ``repo_dir`` (so a ps.json placed in ``repo_dir`` can use it as is).
    """
    files: List[str] = []
    for i, t in enumerate(tables):
        rel = os.path.join(model, str(version), f"{model}{i}_sparse_0.model")
        keys = table_keys(seed, i, t.rows)
        write_sparse_dir(
            os.path.join(repo_dir, rel), keys, expected_vectors(seed, i, keys, t.vec_size)
        )
        files.append(rel)
    return {
        "model": model,
        "sparse_files": files,
        "embedding_table_names": [t.name for t in tables],
        "embedding_vecsize_per_table": [t.vec_size for t in tables],
        "maxnum_catfeature_query_per_table_per_sample": [t.max_keys_per_sample for t in tables],
        "default_value_for_each_table": [t.default_value for t in tables],
        "deployed_device_list": [0],
        "max_batch_size": 1024,
        "gpucache": True,
        "gpucacheper": 0.5,
        "hit_rate_threshold": 0.9,
    }


# The demo models served by `make serve`.
DEMO_SEED = 2026
DEMO_MODELS = {
    # Two tables of different vector sizes.
    "hps_demo": [
        SyntheticTable("item", rows=200_000, vec_size=64, max_keys_per_sample=4, default_value=0.0),
        SyntheticTable("user", rows=50_000, vec_size=16, max_keys_per_sample=1, default_value=-1.0),
    ],
    # The upstream WDL deployment sample's layout: vec 1 and 16, 2 + 26 keys per sample.
    "hps_wdl": [
        SyntheticTable("embedding_table1", rows=20_000, vec_size=1, max_keys_per_sample=2),
        SyntheticTable("embedding_table2", rows=100_000, vec_size=16, max_keys_per_sample=26),
    ],
}
