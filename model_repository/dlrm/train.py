#!/usr/bin/env python3
"""Train a small DLRM on generated clicks and export it for the ``hugectr`` backend.

    .venv/bin/python model_repository/dlrm/train.py            # full run (about 8 s on 2 cores)
    .venv/bin/python model_repository/dlrm/train.py --tiny     # seconds; for tests

Writes into ``--out`` (default: ``1/`` beside this script) the HugeCTR sparse dirs, dense
file and network JSON, the ONNX dense part, the PyTorch state dict, ``dlrm_meta.json`` and
``dlrm_ps_entry.json``; prints the held-out AUC and the ps.json entry. Everything is
deterministic for a given ``--seed``. The model code is ``examples/dlrm/torch_dlrm.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _import_torch_dlrm():
    # The model code lives in the checkout (examples/dlrm/), not in the installed package.
    root = os.path.dirname(os.path.dirname(HERE))
    if root not in sys.path:
        sys.path.insert(0, root)
    from examples.dlrm import torch_dlrm

    return torch_dlrm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "1"), help="model version directory")
    p.add_argument("--name", default="dlrm", help="model name: file prefix and ps.json 'model'")
    p.add_argument("--tiny", action="store_true", help="small tables and data (unit tests)")
    p.add_argument("--seed", type=int, help="data, keys and initialisation seed")
    p.add_argument("--epochs", type=int)
    p.add_argument("--rows", type=int, help="training samples")
    p.add_argument("--eval-rows", type=int, help="held-out samples")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument(
        "--ps-root",
        help="directory the ps.json entry's paths are relative to "
        "(default: the model repository, two levels above --out)",
    )
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX export")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    td = _import_torch_dlrm()
    config = td.TINY_CONFIG if args.tiny else td.DEFAULT_CONFIG
    settings = td.TINY_SETTINGS if args.tiny else td.TrainSettings()
    overrides = {
        "seed": args.seed,
        "epochs": args.epochs,
        "train_rows": args.rows,
        "eval_rows": args.eval_rows,
        "batch_size": args.batch_size,
        "lr": args.lr,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    settings = dataclasses.replace(settings, **overrides)
    print(f"config: {json.dumps(config.to_meta())}")
    print(f"settings: {json.dumps(dataclasses.asdict(settings))}")

    result, entry = td.train_and_export(
        args.out,
        config,
        settings,
        name=args.name,
        ps_root=args.ps_root,
        onnx=not args.no_onnx,
        log=print,
    )
    m = result.metrics
    print(
        f"held-out ({m['eval_rows']} samples): AUC {m['auc']:.4f}, accuracy {m['accuracy']:.4f} "
        f"(hidden model's own AUC {m['oracle_auc']:.4f}, click rate {m['click_rate']:.3f})"
    )
    print(f"ps.json entry ({os.path.join(args.out, args.name + '_ps_entry.json')}):")
    print(json.dumps(entry, indent=2))
    print(
        f"wrote {os.path.abspath(args.out)}: data {m['data_seconds']:.1f} s, "
        f"training {m['train_seconds']:.1f} s, export {m['export_seconds']:.1f} s, "
        f"total {time.perf_counter() - t0:.1f} s (torch import included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
