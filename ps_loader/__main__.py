"""Command line: ``python -m ps_loader {demo,validate,convert} ...`` (or ``ps-loader ...``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from triton_rec.config.ps_json import load_ps_config
from triton_rec.errors import TritonRecError


def _demo(args: argparse.Namespace) -> int:
    from ps_loader.synthetic import DEMO_MODELS, DEMO_SEED, write_model

    entries = []
    for name, tables in DEMO_MODELS.items():
        t0 = time.perf_counter()
        entries.append(write_model(args.repo, name, tables, seed=DEMO_SEED))
        rows = sum(t.rows for t in tables)
        print(f"wrote {name}: {len(tables)} tables, {rows} rows ({time.perf_counter() - t0:.1f} s)")
    ps_path = os.path.join(args.repo, "ps.json")
    expected = {"supportlonglong": True, "models": entries}
    if args.write_ps_json or not os.path.exists(ps_path):
        with open(ps_path, "w", encoding="utf-8") as f:
            json.dump(expected, f, indent=2)
            f.write("\n")
        print(f"wrote {ps_path}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from triton_rec.serving.session import LookupSession

    cfg = load_ps_config(args.ps_json)
    models = [cfg.model(args.model)] if args.model else list(cfg.models)
    for m in models:
        t0 = time.perf_counter()
        session = LookupSession.from_params(m)
        for t in session.tables:
            print(f"{m.model}.{t.name}: {t.num_rows} rows x {t.vec_size} floats ({t.path})")
        print(f"{m.model}: OK ({time.perf_counter() - t0:.2f} s)")
        for k in m.unknown_keys:
            print(f"{m.model}: warning: unknown key '{k}' ignored")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from triton_rec.storage.node_store import ProgressLogger, default_store_dir, ensure_layout

    cfg = load_ps_config(args.ps_json)
    models = [cfg.model(args.model)] if args.model else list(cfg.models)
    store = os.path.abspath(args.store) if args.store else default_store_dir()
    print(f"store: {store}")
    for m in models:
        for t in m.tables:
            label = f"{m.model}.{t.name}"
            res = ensure_layout(
                t.sparse_file,
                t.vec_size,
                store,
                ProgressLogger(label, sys.stderr),
                fsync=args.fsync,
                force=args.force,
            )
            mb = res.data_bytes / 1e6
            rate = mb / max(res.seconds, 1e-9)
            how = {
                "converted": f"converted {mb:,.1f} MB in {res.seconds:.2f} s, {rate:,.0f} MB/s",
                "aliased": f"same content as an existing layout, hashed in {res.seconds:.2f} s, "
                f"{res.n_rows * (8 + 4 * res.vec_size) / 1e6 / max(res.seconds, 1e-9):,.0f} MB/s",
                "reused": f"up to date, {res.seconds * 1e3:.1f} ms",
            }[res.action]
            print(f"{label}: {res.n_rows} rows x {res.vec_size} -> {res.path} [{how}]")
    return 0


def main(argv=None) -> int:
    """Command line entry point (``ps-loader``); returns the exit status."""
    p = argparse.ArgumentParser(prog="ps-loader", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="generate the demo models' sparse files into a repository")
    d.add_argument("repo", help="model repository directory")
    d.add_argument("--write-ps-json", action="store_true", help="overwrite <repo>/ps.json")
    d.set_defaults(fn=_demo)
    v = sub.add_parser("validate", help="load every table of a ps.json and check it")
    v.add_argument("ps_json")
    v.add_argument("--model", help="only this model")
    v.set_defaults(fn=_validate)
    c = sub.add_parser(
        "convert",
        help="convert every table of a ps.json into node-local layouts (once per content)",
        description="Write the node-local layout of every table (keys, vectors and hash "
        "index in one file, memory-mapped by every model instance). Tables already "
        "converted, or with the content of a converted one, are not converted again.",
    )
    c.add_argument("ps_json")
    c.add_argument("--model", help="only this model")
    c.add_argument(
        "--store",
        help="store directory (default: $TRITON_REC_STORE, else ~/.cache/triton-rec/store)",
    )
    c.add_argument(
        "--fsync", action="store_true", help="flush each layout to disk before publishing"
    )
    c.add_argument("--force", action="store_true", help="convert again even if up to date")
    c.set_defaults(fn=_convert)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except TritonRecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
