"""How much the demo DLRM's answers move when its tables are stored in fp16 or int8.

The committed model (``model_repository/dlrm/1``) is served by the engine exactly as the
``hugectr`` backend serves it (:func:`triton_rec.serving.deployment.open_ranking_session`:
node store layout in the table's precision, shared CPU cache holding the same encoding,
the HugeCTR dense network) once per precision, on fresh samples of the hidden model it
was trained on (not its training or evaluation set). Reported per precision: held-out
AUC, and the largest and mean absolute difference of the predictions from fp32's.

Every request is sent with ``exact`` (every cache miss fetched from the store now), so
the figures measure the encoding, not which keys the cache happened to hold.

    .venv/bin/python -m examples.dlrm.precision_accuracy [--samples 20000] [--json out.json]

Imports torch only through :mod:`examples.dlrm.torch_dlrm` (for the hidden model and
the AUC); the engine itself does not need it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Optional

import numpy as np

from triton_rec.config.ps_json import parse_ps_config
from triton_rec.precision import PRECISIONS, RowCodec
from triton_rec.serving.deployment import InstanceSpec, open_ranking_session

#: the committed demo model
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / "dlrm" / "1"
#: samples drawn with this stream of the hidden model's RNG: neither the training nor the
#: evaluation stream of ``train()``
HELD_OUT_STREAM = 15
#: requests of this many samples (the model's max_batch_size is 1024)
BATCH = 1024


def held_out(model_dir: Path, samples: int):
    """Fresh samples of the hidden model the committed model was trained on."""
    from examples.dlrm import torch_dlrm as td

    meta = json.loads((Path(model_dir) / "dlrm_meta.json").read_text())
    config = td.DLRMConfig.from_meta(meta)
    truth = td.HiddenModel(config, meta["seed"])
    return truth.sample(samples, np.random.default_rng([meta["seed"], HELD_OUT_STREAM]))


def model_params(model_dir: Path, precision: Optional[str]):
    """The model's ps.json entry with every table in ``precision``, parsed (``None``: the
    committed entry as it is, without ``embedding_precision``: the plain fp32 path)."""
    model_dir = Path(model_dir)
    entry = json.loads((model_dir / "dlrm_ps_entry.json").read_text())
    if precision is not None:
        entry["embedding_precision"] = [precision] * len(entry["sparse_files"])
    # the entry's paths are relative to the model repository (two levels up)
    doc = {"supportlonglong": True, "models": [entry]}
    return parse_ps_config(doc, str(model_dir.parents[1])).models[0]


def predict(
    model_dir: Path, precision: Optional[str], data, store_dir: str, cache_dir: str
) -> np.ndarray:
    """Predictions of the served model with its tables in ``precision`` (``None``: the
    committed entry as it is, see :func:`model_params`)."""
    params = model_params(model_dir, precision)
    spec = InstanceSpec(store_dir=store_dir, cache_dir=cache_dir, prefault=False)
    session = open_ranking_session(params, spec, str(model_dir))
    want = precision or "fp32"
    try:
        for table in session.cached_tables:  # the served tables really are encoded
            if table.codec != RowCodec(want, table.vec_size):
                raise AssertionError(f"{table.name}: served as {table.codec}, not {want}")
        out = []
        for a in range(0, len(data), BATCH):
            r = data.hugectr_request(a, min(len(data), a + BATCH))
            req = session.parse_request(r["DES"], r["CATCOLUMN"], r["ROWINDEX"])
            out.append(session.predict_many([dataclasses.replace(req, exact=True)])[0])
        return np.concatenate(out).astype(np.float64)
    finally:
        session.close()


def measure(
    model_dir: Path = DEFAULT_MODEL_DIR,
    precisions: Iterable[str] = PRECISIONS,
    samples: int = 20000,
    store_dir: Optional[str] = None,
) -> Dict[str, Dict[str, float]]:
    """Per precision: ``auc``, ``max_abs_diff`` and ``mean_abs_diff`` (against fp32),
    ``row_bytes`` (of a table row) and the ``predictions`` themselves."""
    from examples.dlrm.torch_dlrm import auc

    data = held_out(model_dir, samples)
    results: Dict[str, Dict] = {}
    with tempfile.TemporaryDirectory(prefix="trec-accuracy-") as tmp:
        store = store_dir or os.path.join(tmp, "store")
        with tempfile.TemporaryDirectory(prefix="trec-accuracy-", dir="/dev/shm") as shm:
            preds = {p: predict(model_dir, p, data, store, shm) for p in ["fp32", *precisions]}
    base = preds["fp32"]
    vec = model_params(model_dir, "fp32").tables[0].vec_size
    for p in precisions:
        d = np.abs(preds[p] - base)
        results[p] = {
            "auc": auc(data.labels, preds[p]),
            "max_abs_diff": float(d.max()),
            "mean_abs_diff": float(d.mean()),
            "row_bytes": RowCodec(p, vec).row_bytes,
            "samples": len(data),
            "predictions": preds[p],
        }
    return results


def table_md(results: Dict[str, Dict]) -> str:
    """The results as a markdown table."""
    lines = [
        "| precision | row bytes | held-out AUC | AUC - fp32 | max abs diff vs fp32 | mean |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = results["fp32"]["auc"] if "fp32" in results else float("nan")
    for p, r in results.items():
        lines.append(
            f"| {p} | {r['row_bytes']} | {r['auc']:.6f} | {r['auc'] - base:+.1e} | "
            f"{r['max_abs_diff']:.2e} | {r['mean_abs_diff']:.2e} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    """Command line: print the table (and write ``--json``); returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    results = measure(Path(args.model_dir), samples=args.samples)
    print(f"demo DLRM ({args.model_dir}), {args.samples} held-out samples\n")
    print(table_md(results))
    if args.json:
        slim = {k: {f: v for f, v in r.items() if f != "predictions"} for k, r in results.items()}
        Path(args.json).write_text(json.dumps(slim, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
