#!/usr/bin/env python3
"""How far a GPU instance's reduced-precision dense layers (config.pbtxt ``dense_math``:
``tf32``, ``fp16``) move the MLPerf-shaped DLRM's predictions from ``fp32``, measured on
the host with their twin (triton_rec/dense/emulated_math.py: the GEMMs' operands rounded
as the GPU's tensor cores take them, float32 accumulation).

    .venv/bin/python benchmarks/bench_dense_math.py [--samples 4096] [--seeds 0,1,2]
    make bench-dense-math

The network and inputs are the generator's (``ps-loader criteo-dlrm``, ps_loader/criteo.py:
its dense weights for each seed, DES as its perf inputs draw them, one vector of each of
the 26 tables per sample drawn from its tables' distribution). Per math: the largest and
the 99.9th-percentile absolute difference of the predictions (probabilities) from fp32's,
and the share of samples whose side of 0.5 changes. :data:`BOUNDS` are the documented
bounds (docs/precision.md, "Reduced-precision dense layers"), which tests/unit/
test_dense_math.py holds the twin to and tests/gpu/test_dense_math_gpu.py the device.

Writes benchmarks/data/dense_math.json (--out to change).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import datetime, timezone
from typing import Dict, List

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_dense_cpu import write_network  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from ps_loader import criteo  # noqa: E402
from triton_rec.dense.emulated_math import EmulatedMath  # noqa: E402
from triton_rec.dense.hugectr_network import HugeCTRNetwork  # noqa: E402

#: The documented bounds: the largest absolute difference of a prediction from fp32's.
BOUNDS = {"tf32": 5e-3, "fp16": 4e-3}


def inputs(seed: int, samples: int):
    """``(des [n, 13], embeddings: 26 x [n, 1, 128])`` as the generator's requests have
    them (keys: each table's power law over its rows at scale 0.01)."""
    rng = np.random.default_rng([seed, 0x3A7])
    req = criteo.perf_request(rng, criteo.table_rows(0.01), samples, unseen_fraction=0.0)
    des = req["DES"].reshape(samples, criteo.DENSE_DIM)
    cat = req["CATCOLUMN"].reshape(samples, criteo.NUM_TABLES)
    embs = [
        criteo.table_vectors(seed, t, cat[:, t]).reshape(samples, 1, criteo.EMBEDDING_DIM)
        for t in range(criteo.NUM_TABLES)
    ]
    return des, embs


def measure(samples: int, seeds: List[int], maths=tuple(BOUNDS)) -> Dict:
    """Per math, the differences from fp32 over ``samples`` samples of each seed's network."""
    diffs: Dict[str, List[np.ndarray]] = {m: [] for m in maths}
    flips = {m: 0 for m in maths}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            net, dense, _ = write_network(tmp, seed)
            des, embs = inputs(seed, samples)
            want = HugeCTRNetwork.load(net, dense).predict(des, embs).reshape(-1)
            for m in maths:
                got = HugeCTRNetwork.load(net, dense, xp=EmulatedMath(m)).predict(des, embs)
                got = got.reshape(-1).astype(np.float64)
                diffs[m].append(np.abs(got - want))
                flips[m] += int(((got > 0.5) != (want > 0.5)).sum())
    out = {}
    for m in maths:
        d = np.concatenate(diffs[m])
        out[m] = {
            "max_abs": float(d.max()),
            "p999_abs": float(np.quantile(d, 0.999)),
            "mean_abs": float(d.mean()),
            "decision_flips": flips[m],
            "samples": int(d.size),
            "bound": BOUNDS[m],
            "within": bool(d.max() <= BOUNDS[m]),
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=32768, help="samples per seed")
    ap.add_argument("--seeds", default="0,1,2,3", help="the generator's seeds (networks)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "data", "dense_math.json"))
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    result = measure(args.samples, seeds)
    print(f"{'math':6} {'max |dp|':>10} {'p99.9':>10} {'mean':>10} {'flips':>6}  bound")
    for m, r in result.items():
        print(
            f"{m:6} {r['max_abs']:10.2e} {r['p999_abs']:10.2e} {r['mean_abs']:10.2e} "
            f"{r['decision_flips']:6d}  {r['bound']:.0e} {'ok' if r['within'] else 'OVER'}"
        )
    doc = {
        "benchmark": "bench_dense_math",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            ["python", "benchmarks/bench_dense_math.py"]
            + [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--out")]
        ),
        "machine": machine_info(),
        "note": "the GPU's reduced-precision GEMMs emulated on the host "
        "(triton_rec/dense/emulated_math.py); not a GPU run",
        "samples_per_seed": args.samples,
        "seeds": seeds,
        "rows": [{"math": m, **r} for m, r in result.items()],
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return 0 if all(r["within"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
