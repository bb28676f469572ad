"""``triton-rec-server plan``: will this model repository fit this node?

For every model of the repository, from its config.pbtxt and ps.json alone
(:mod:`triton_rec.serving.sizing`: table sizes from file sizes and headers, never the
data), the host memory of its tables as the node store lays them out, its CPU caches in
the shared-memory directory and, per GPU, its device caches, ``static``/``uvm`` tables,
dense network and staging; the node's totals (a table several models share counted
once); and beside them what this node has (/proc/meminfo, the shared-memory directory's
file system, each GPU's free memory through CuPy where there is one). Exit status 1 and
a line naming each model and resource that does not fit. ``--json`` prints
``{"models": {NAME: {"host_bytes", "shm_bytes", "gpu_bytes": {"0": N}, ...}}, "node":
{...}, "totals": {...}, "fits": bool, "misfits": [...]}``.

The server's load log states the same figures for each model it loads (the line
``model '<name>': sizing: ...``; :func:`log_sizing`).

``--node-ram``, ``--node-shm`` and ``--node-gpus`` plan for another node than this one
(sizes with a K/M/G/T suffix, powers of 1024).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Sequence

#: prefix of the CLI's lines on stderr
PROG = "triton-rec-server plan"


def read_model_config(path: os.PathLike) -> Dict[str, Any]:
    """A ``config.pbtxt`` as the dict Triton hands a backend (``model_config``: field
    names as in the proto, enums by name, ``parameters`` a map), parsed with Triton's
    own schema (``tritonclient``'s ``model_config_pb2``, protobuf's text format).

    Raises:
        ConfigError: the file is not a valid model configuration (the message names it).
    """
    from triton_rec.errors import ConfigError

    try:
        from google.protobuf import json_format, text_format  # type: ignore[import-untyped]
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:  # pragma: no cover - the server extra brings both
        raise ConfigError(
            f"reading config.pbtxt needs tritonclient and protobuf (pip install "
            f"'triton-rec[server]'): {e}"
        ) from e
    try:
        text = Path(path).read_text(encoding="utf-8")
        message = text_format.Parse(text, model_config_pb2.ModelConfig())
    except (OSError, UnicodeDecodeError, text_format.ParseError) as e:
        raise ConfigError(f"{path}: not a valid model configuration: {e}") from e
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def repository_models(repository: os.PathLike) -> List[Path]:
    """The model directories of a repository (those holding a config.pbtxt), by name."""
    root = Path(repository)
    return sorted(d for d in root.iterdir() if (d / "config.pbtxt").is_file())


def plan_repository(
    repository: os.PathLike, node_gpus: Optional[Sequence[int]], request_path: str
) -> list:
    """A :class:`~triton_rec.serving.sizing.ModelPlan` per model of the repository (its
    name: its directory's, as Triton names it)."""
    from triton_rec.errors import TritonRecError
    from triton_rec.serving.sizing import ModelPlan, plan_model

    plans = []
    for model_dir in repository_models(repository):
        try:
            config = read_model_config(model_dir / "config.pbtxt")
        except TritonRecError as e:
            plans.append(ModelPlan(model_dir.name, error=str(e)))
            continue
        plans.append(plan_model(model_dir.name, config, str(model_dir), node_gpus, request_path))
    return plans


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64G"`` -> 68719476736 (K, M, G, T: powers of 1024; a plain number is bytes)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 64G, 1.5T)")
    return int(float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()))


def parse_gpus(text: str) -> Dict[int, int]:
    """``"none"`` -> {}; ``"80G,80G"`` -> the free bytes of GPUs 0 and 1."""
    if text.strip().lower() in ("", "none", "0"):
        return {}
    return {i: parse_size(t) for i, t in enumerate(text.split(","))}


def add_parser(sub) -> argparse.ArgumentParser:
    """The ``plan`` subcommand of ``triton-rec-server`` (runtime.main's subparsers)."""
    q = sub.add_parser(
        "plan",
        help="size a model repository against this node (memory, /dev/shm, GPUs); "
        "exit 1 when it does not fit",
        description=__doc__.split("\n\n")[1],
    )
    q.add_argument("--model-repository", required=True, type=Path, metavar="DIR")
    q.add_argument("--json", action="store_true", help="print the plan as JSON")
    q.add_argument("--verbose", "-v", action="store_true", help="every allocation of each model")
    q.add_argument(
        "--request-path",
        choices=("native", "python"),
        help="as for serve (default: $TRITON_REC_REQUEST_PATH, else native): the python "
        "path holds a static/uvm table once per instance process",
    )
    q.add_argument("--node-ram", type=parse_size, metavar="SIZE", help="RAM available instead")
    q.add_argument("--node-shm", type=parse_size, metavar="SIZE", help="free shared memory instead")
    q.add_argument(
        "--node-gpus",
        type=parse_gpus,
        metavar="none|SIZE[,SIZE...]",
        help="the GPUs' free memory instead (GPU 0, 1, ...), or none",
    )
    return q


def run(args: argparse.Namespace, out: Optional[IO[str]] = None) -> int:
    """Run ``plan``, writing to ``out`` (default: stdout); the exit status (0 fits, 1 does
    not fit or a model cannot be sized, 2 no such repository)."""
    out = out if out is not None else sys.stdout
    from triton_rec.serving.sizing import misfits, node_resources, totals
    from triton_rec.triton.runtime import resolve_request_path

    repo: Path = args.model_repository
    if not repo.is_dir():
        print(f"{PROG}: {repo}: no such model repository", file=sys.stderr)
        return 2
    node = node_resources(probe_gpus=args.node_gpus is None)
    if args.node_ram is not None:
        node.ram_available = node.ram_total = args.node_ram
    if args.node_shm is not None:
        node.shm_free = node.shm_total = args.node_shm
    if args.node_gpus is not None:
        node.gpus = {d: (n, n) for d, n in args.node_gpus.items()}
        node.gpu_source = "--node-gpus"
    path = resolve_request_path(args.request_path)
    plans = plan_repository(repo, sorted(node.gpus), path)
    lines = misfits(plans, node)
    if args.json:
        doc = {
            "models": {p.name: p.to_json() for p in plans},
            "node": node.to_json(),
            "totals": totals(plans),
            "request_path": path,
            "fits": not lines,
            "misfits": lines,
        }
        json.dump(doc, out, indent=1)
        out.write("\n")
    else:
        write_table(plans, node, lines, path, args.verbose, out)
    return 1 if lines else 0


def write_table(plans, node, lines: List[str], path: str, verbose: bool, out: IO[str]) -> None:
    """The plan for people: a line per model, the node's totals, what it has, the verdict."""
    from triton_rec.serving.sizing import ESTIMATES, format_bytes, totals

    def gpus(by_device: Dict[Any, int]) -> str:
        return ", ".join(f"{d}: {format_bytes(n)}" for d, n in by_device.items()) or "-"

    rows = [("MODEL", "BACKEND", "HOST", "/DEV/SHM", "GPU")]
    for p in plans:
        if p.error is not None:
            rows.append((p.name, p.backend, "?", "?", "?"))
            continue
        rows.append(
            (
                p.name,
                p.backend,
                format_bytes(p.host_bytes),
                format_bytes(p.shm_bytes),
                gpus(p.gpu_bytes),
            )
        )
    t = totals(plans)
    rows.append(
        (
            "node total",
            "",
            format_bytes(t["host_bytes"]),
            format_bytes(t["shm_bytes"]),
            gpus(t["gpu_bytes"]),
        )
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def text(r) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n"

    out.write(text(rows[0]))
    for p, r in zip(plans, rows[1:]):
        out.write(text(r))
        if p.error is not None:
            out.write(f"    cannot be sized: {p.error}\n")
        for note in p.notes:
            out.write(f"    note: {note}\n")
        for part in p.parts if verbose else ():
            where = f"GPU {part.device}" if part.resource == "gpu" else part.resource
            est = " (estimate)" if any(part.what.startswith(e) for e in ESTIMATES) else ""
            out.write(f"    {where}: {part.what}: {format_bytes(part.bytes)}{est}\n")
    out.write("-" * (sum(widths) + 2 * (len(widths) - 1)) + "\n")
    out.write(text(rows[-1]))
    have_gpus = (
        ", ".join(f"{d}: {format_bytes(f)} free" for d, (f, _) in node.gpus.items())
        or f"none ({node.gpu_source})"
    )
    out.write(
        f"this node: RAM {format_bytes(node.ram_available)} available of "
        f"{format_bytes(node.ram_total)}; shared memory {node.shm_dir}: "
        f"{format_bytes(node.shm_free)} free of {format_bytes(node.shm_total)}; "
        f"GPUs: {have_gpus}\n"
    )
    out.write(f"request path: {path}; host counts the node store's tables and pinned memory\n")
    for line in lines:
        out.write(f"does not fit: {line}\n")
    out.write("fits: yes\n" if not lines else "fits: no\n")


# -- the load log ----------------------------------------------------------------------

_loaded: Dict[str, int] = {}
_loaded_lock = threading.Lock()


def log_sizing(pb_utils, model_name: str, config: Dict[str, Any], args: Dict[str, str]) -> None:
    """At a model instance's load: the model's plan figures in the server log, once per
    model while it is loaded in this process (the native backend hosts every instance in
    the server process: one line per model; the Python request path: one per instance
    process). Never fails the load."""
    with _loaded_lock:
        _loaded[model_name] = _loaded.get(model_name, 0) + 1
        if _loaded[model_name] > 1:
            return
    try:
        from triton_rec.serving.sizing import plan_model

        path = "native" if getattr(pb_utils, "IN_PROCESS", False) else "python"
        plan = plan_model(model_name, config, args["model_repository"], None, path)
        if plan.error is not None:
            raise RuntimeError(plan.error)
        pb_utils.Logger.log_info(
            f"model '{model_name}': sizing: {plan.summary()} (triton-rec-server plan)"
        )
    except Exception as e:  # the figures are for people: never a failed load
        pb_utils.Logger.log_warn(f"model '{model_name}': sizing not computed: {e!r}")


def forget_sizing(model_name: str) -> None:
    """An instance of ``model_name`` unloaded (its next first load logs its figures)."""
    with _loaded_lock:
        n = _loaded.get(model_name, 0) - 1
        if n > 0:
            _loaded[model_name] = n
        else:
            _loaded.pop(model_name, None)
