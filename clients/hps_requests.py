"""Build HPS lookup requests (``KEYS``/``NUMKEYS``) from per-table key lists.

Pure numpy, shared by the command-line client, the perf_analyzer input generator,
the benchmarks and the tests.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np


def hps_inputs(keys_per_table: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """``(KEYS [1, total] int64, NUMKEYS [1, T] int32)`` for table-major key lists."""
    arrays = [np.asarray(k, dtype=np.int64).reshape(-1) for k in keys_per_table]
    keys = np.concatenate(arrays) if arrays else np.empty(0, np.int64)
    numkeys = np.array([[a.shape[0] for a in arrays]], dtype=np.int32)
    return keys[None, :], numkeys


def split_output(
    output: np.ndarray, counts: Sequence[int], vec_sizes: Sequence[int]
) -> List[np.ndarray]:
    """Cut a flat HPS answer into one ``[count, vec_size]`` array per table."""
    parts, pos = [], 0
    flat = np.asarray(output).reshape(-1)
    for n, d in zip(counts, vec_sizes):
        parts.append(flat[pos : pos + n * d].reshape(n, d))
        pos += n * d
    if pos != flat.shape[0]:
        raise ValueError(f"output has {flat.shape[0]} floats, expected {pos}")
    return parts


def perf_analyzer_data(
    key_pools: Sequence[np.ndarray],
    keys_per_sample: Sequence[int],
    samples: int,
    requests: int,
    seed: int = 0,
    zipf_alpha: float = 0.0,
) -> Dict:
    """perf_analyzer ``--input-data`` JSON for an hps model.

    Args:
        key_pools: per table, the keys to draw from (include unknown keys to test misses).
        keys_per_sample: ``maxnum_catfeature_query_per_table_per_sample``.
        samples: samples per request.
        requests: distinct requests (perf_analyzer cycles through them).
        seed: RNG seed.
        zipf_alpha: 0 for uniform draws, else a Zipf(alpha) popularity over each pool.
    """
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(requests):
        per_table = []
        for pool, k in zip(key_pools, keys_per_sample):
            n = samples * k
            if zipf_alpha > 0:
                ranks = np.arange(1, len(pool) + 1, dtype=np.float64)
                p = ranks**-zipf_alpha
                idx = rng.choice(len(pool), n, p=p / p.sum())
            else:
                idx = rng.integers(0, len(pool), n)
            per_table.append(np.asarray(pool)[idx])
        keys, numkeys = hps_inputs(per_table)
        data.append(
            {
                "KEYS": {"content": keys.reshape(-1).tolist(), "shape": list(keys.shape[1:])},
                "NUMKEYS": {
                    "content": numkeys.reshape(-1).tolist(),
                    "shape": list(numkeys.shape[1:]),
                },
            }
        )
    return {"data": data}
