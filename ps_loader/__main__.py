"""Command line: ``python -m ps_loader {demo,validate,convert,quantize,criteo-dlrm} ...``
(or ``ps-loader ...``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from triton_rec.config.ps_json import load_ps_config
from triton_rec.errors import TritonRecError
from triton_rec.precision import PRECISIONS


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
                precision=t.precision,
            )
            mb = res.data_bytes / 1e6
            rate = mb / max(res.seconds, 1e-9)
            how = {
                "converted": f"converted {mb:,.1f} MB in {res.seconds:.2f} s, {rate:,.0f} MB/s",
                "aliased": f"same content as an existing layout, hashed in {res.seconds:.2f} s, "
                f"{res.n_rows * (8 + 4 * res.vec_size) / 1e6 / max(res.seconds, 1e-9):,.0f} MB/s",
                "reused": f"up to date, {res.seconds * 1e3:.1f} ms",
            }[res.action]
            print(
                f"{label}: {res.n_rows} rows x {res.vec_size} {t.precision} -> {res.path} [{how}]"
            )
    return 0


def _quantize_problem(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the arguments of ``quantize``, or None."""
    is_ps = args.source.endswith(".json")
    if is_ps == (args.vec_size is not None):
        return (
            "give either a ps.json, or a table (HugeCTR sparse directory or .npz) with --vec-size"
        )
    if not args.write_ps_json:
        return None
    if not is_ps:
        return "--write-ps-json needs a ps.json source"
    if args.table:  # a model's other tables would be left out of the copy
        return "--write-ps-json rewrites whole models: drop --table"
    src_dir = os.path.dirname(os.path.abspath(args.source))
    if os.path.dirname(os.path.abspath(args.write_ps_json)) != src_dir:
        # every relative path of the copy (dense files, tiers, ...) keeps its meaning
        return (
            f"--write-ps-json must name a file in {src_dir} (the source ps.json's "
            "directory, against which its relative paths resolve)"
        )
    return None


def _quantize_jobs(args: argparse.Namespace) -> list:
    """``(model or None, label, source, vec_size)`` of every table to quantize."""
    if not args.source.endswith(".json"):
        label = os.path.basename(os.path.normpath(args.source))
        return [(None, label, args.source, args.vec_size)]
    cfg = load_ps_config(args.source)
    return [
        (m.model, f"{m.model}.{t.name}", t.sparse_file, t.vec_size)
        for m in ([cfg.model(args.model)] if args.model else list(cfg.models))
        for t in m.tables
        if not args.table or t.name in args.table
    ]


def _quantize(args: argparse.Namespace) -> int:
    from ps_loader.quantize import (
        as_json,
        describe,
        output_name,
        quantize_table,
        rewrite_ps_json,
    )

    problem = _quantize_problem(args)
    jobs = [] if problem else _quantize_jobs(args)
    if not problem and not jobs:
        problem = f"no table named {args.table} in {args.source}"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    written, per_model = [], {}
    for model, label, source, vec_size in jobs:
        path = os.path.join(args.out, output_name(label, args.precision))
        t = quantize_table(source, vec_size, args.precision, path, label)
        written.append(t)
        if model is not None:
            per_model.setdefault(model, []).append(t)
        if not args.json:
            print(describe(t), flush=True)
    if args.write_ps_json:
        rewrite_ps_json(args.source, per_model, args.write_ps_json)
        if not args.json:
            print(f"wrote {args.write_ps_json}")
    if args.json:
        print(as_json(written))
    return 0


def _batch_sizes(text: str) -> list:
    """``--batch-sizes``: comma-separated positive integers (empty: no perf inputs)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1: {text!r}")
    return sizes


def _criteo_dlrm(args: argparse.Namespace) -> int:
    from ps_loader.criteo import NUM_TABLES, argument_problem, write_criteo_dlrm

    problem = argument_problem(args.scale, args.min_rows, args.batch_sizes, args.kind)
    if problem is None and (args.perf_requests < 1 or args.instances < 1):
        problem = "--perf-requests and --instances must be >= 1"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    w = write_criteo_dlrm(
        args.out,
        args.scale,
        name=args.name,
        precision=args.precision,
        kind=args.kind,
        seed=args.seed,
        min_rows=args.min_rows,
        batch_sizes=args.batch_sizes,
        perf_requests=args.perf_requests,
        instances=args.instances,
        progress=lambda line: print(line, flush=True),
    )
    mb = w.table_bytes / 1e6
    print(
        f"wrote {w.name} into {w.out}: {NUM_TABLES} tables, {sum(w.rows):,} rows, "
        f"{mb:,.1f} MB of {w.precision} tables in {w.seconds_tables:.1f} s "
        f"({mb / max(w.seconds_tables, 1e-9):,.0f} MB/s); total {w.seconds:.1f} s"
    )
    for f in w.files:
        print(f"wrote {f}")
    return 0


def _add_criteo_dlrm(sub) -> None:
    from ps_loader.criteo import (
        DEFAULT_BATCH_SIZES,
        DEFAULT_MIN_ROWS,
        HELP_DESCRIPTION,
        help_epilog,
    )

    g = sub.add_parser(
        "criteo-dlrm",
        help="generate a servable DLRM of MLPerf's Criteo 1TB shape (untrained, seeded)",
        description=HELP_DESCRIPTION,
        epilog=help_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g.add_argument("--out", required=True, help="model repository directory (created)")
    g.add_argument(
        "--scale",
        required=True,
        type=float,
        help="fraction of each table's rows, in (0, 1]; tables of at most --min-rows "
        "rows are kept whole, larger ones get max(min_rows, ceil(rows * scale)) rows",
    )
    g.add_argument("--name", default="dlrm_criteo", help="model name (default dlrm_criteo)")
    g.add_argument("--precision", default="fp32", choices=list(PRECISIONS))
    g.add_argument("--kind", default="KIND_CPU", choices=["KIND_CPU", "KIND_GPU"])
    g.add_argument("--seed", type=int, default=0, help="weights and perf inputs (default 0)")
    g.add_argument(
        "--min-rows",
        type=int,
        default=DEFAULT_MIN_ROWS,
        help=f"tables of at most this many rows are kept whole, and no table gets fewer "
        f"(default {DEFAULT_MIN_ROWS})",
    )
    g.add_argument(
        "--batch-sizes",
        type=_batch_sizes,
        default=list(DEFAULT_BATCH_SIZES),
        help="samples per request of the perf_analyzer input files, comma-separated "
        f"(default {','.join(map(str, DEFAULT_BATCH_SIZES))}; '' for none)",
    )
    g.add_argument(
        "--perf-requests", type=int, default=4, help="distinct requests per perf input file"
    )
    g.add_argument("--instances", type=int, default=1, help="instance_group count (default 1)")
    g.set_defaults(fn=_criteo_dlrm)


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
    q = sub.add_parser(
        "quantize",
        help="encode tables in fp16 or int8 and report the error per table",
        description="Encode a table (HugeCTR sparse directory or .npz, with --vec-size) or "
        "every table of a ps.json into fp16 or int8 (row-wise, FBGEMM's layout) .npz "
        "tables, and print per table the bytes per row before and after and the error "
        "of the values (max abs, RMS). The node store takes such a table as it is.",
    )
    q.add_argument("source", help="a ps.json (ends with .json) or one table")
    q.add_argument("--precision", required=True, choices=[p for p in PRECISIONS if p != "fp32"])
    q.add_argument("--out", required=True, help="directory for the encoded .npz tables")
    q.add_argument("--vec-size", type=int, help="floats per vector (a table source)")
    q.add_argument("--model", help="only this model of the ps.json")
    q.add_argument("--table", action="append", help="only this table (repeatable)")
    q.add_argument(
        "--write-ps-json",
        metavar="PATH",
        help="write a copy of the ps.json (in its directory) naming the encoded tables "
        "and their precision",
    )
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.set_defaults(fn=_quantize)
    _add_criteo_dlrm(sub)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except TritonRecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
