"""Run a real Triton Inference Server with this project's backends.

The server binary comes from the PyPI wheel ``nvidia-pytriton`` (Triton 2.51, CPU-capable).
:func:`prepare_backend_dir` lays out a backend directory Triton accepts:

- ``python/``: the Python backend (``libtriton_python.so`` and its utils, *copied*:
  Triton refuses a backend library whose real path escapes the backend directory) and
  the stub built for the running Python version (``triton_python_backend_stub``);
- ``hps/``, ``hugectr/``, ``dense/``: the Python-based backends, each a ``model.py``
  (:data:`BACKEND_SOURCES`, package data of the wheel);
- ``trec_floor/``: the benchmarks' native floor (:data:`BENCHMARK_BACKENDS`), where a
  checkout has built it (never in a wheel).

:class:`TritonServer` starts it on given (or free) loopback ports with the stub's
library path and this virtual environment first on ``PATH`` (the stub uses the
site-packages of the first Python on ``PATH``), waits until it is ready and stops it.

The Python request path needs a stub that can read the numpy its environment imports:
:func:`check_python_request_path` refuses to start one that cannot
(:data:`STUB_PRE_NUMPY2_MARK`).

Command line: ``triton-rec-server serve --model-repository DIR`` or
``python -m triton_rec.runtime serve ...`` (used by
``make serve``: tritonserver in the foreground, its instance processes supervised by
:mod:`triton_rec.triton.supervisor`) and ``python -m triton_rec.runtime prepare`` (backend
directory only).

Its parts: :mod:`triton_rec.triton.backend_dir` (where everything is, the backend directory,
the stub's check), :mod:`triton_rec.triton.server` (:class:`TritonServer`); here the command
line. Their public names are importable from here.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, List

from triton_rec.errors import (  # RequestPathUnavailable, RuntimeNotFound: re-exported
    RequestPathUnavailable,
    RuntimeNotFound,
    TritonRecError,
)
from triton_rec.triton.backend_dir import (
    BACKEND_SOURCES,
    BENCHMARK_BACKENDS,
    CHECKOUT,
    HOSTED_BACKENDS,
    HOSTED_LIBRARY,
    REQUEST_PATH_ENV,
    REQUEST_PATHS,
    STUB_PRE_NUMPY2_MARK,
    benchmark_backend_library,
    check_python_request_path,
    default_backend_dir,
    native_backend_library,
    prepare_backend_dir,
    python_backend_stub,
    resolve_request_path,
    runtime_library_dir,
    stub_numpy_version,
    stub_predates_numpy2,
    stub_python,
    tritonserver_binary,
)
from triton_rec.triton.server import (
    EXIT_TIMEOUT_S,
    JEMALLOC_CONF,
    JEMALLOC_CONF_5_3,
    JEMALLOC_LIBRARY,
    MALLOC_ENV,
    SERVER_LIMIT_FLAGS,
    TritonServer,
    free_port,
    free_ports,
    jemalloc_conf,
    jemalloc_version,
    python_library_dir,
    server_allocator,
)

__all__ = [
    "BACKEND_SOURCES",
    "BENCHMARK_BACKENDS",
    "CHECKOUT",
    "EXIT_TIMEOUT_S",
    "HOSTED_BACKENDS",
    "HOSTED_LIBRARY",
    "JEMALLOC_CONF",
    "JEMALLOC_CONF_5_3",
    "JEMALLOC_LIBRARY",
    "jemalloc_conf",
    "jemalloc_version",
    "MALLOC_ENV",
    "REQUEST_PATHS",
    "REQUEST_PATH_ENV",
    "RequestPathUnavailable",
    "RuntimeNotFound",
    "SERVER_LIMIT_FLAGS",
    "STUB_PRE_NUMPY2_MARK",
    "TritonServer",
    "benchmark_backend_library",
    "check_python_request_path",
    "default_backend_dir",
    "free_port",
    "free_ports",
    "main",
    "native_backend_library",
    "prepare_backend_dir",
    "python_backend_stub",
    "python_library_dir",
    "report_start",
    "resolve_request_path",
    "runtime_library_dir",
    "serve",
    "server_allocator",
    "stub_numpy_version",
    "stub_predates_numpy2",
    "stub_python",
    "tritonserver_binary",
]


class _PublicServer(TritonServer):
    """Listens on every interface (the test fixtures keep loopback)."""

    def command(self) -> List[str]:
        return [
            a for a in super().command() if not a.startswith(("--http-address", "--grpc-address"))
        ]


def report_start(server: TritonServer, out: IO[str] = sys.stderr) -> None:
    """Once ``server`` answers (its start-up loads done), one line with how many models it
    serves and, for each model that failed to load, a line with the cause and how to load
    it again once fixed. Returns quietly if the server exits first."""
    while not server.is_live():
        if server.process is None or server.process.poll() is not None:
            return
        time.sleep(0.2)
    try:
        index = server.model_index()
    except OSError:
        return
    ready = [m["name"] for m in index if m.get("state") == "READY"]
    failed = [m for m in index if m.get("state") == "UNAVAILABLE" and m.get("reason")]
    print(f"triton-rec: serving {len(ready)} model(s): {', '.join(sorted(ready))}", file=out)
    if failed:
        how = (
            f"once fixed, load it without a restart: POST http://HOST:{server.http_port}"
            "/v2/repository/models/<model>/load"
            if server.explicit or server.supervise
            else "once fixed, restart the server (it runs without explicit model control)"
        )
        print(f"triton-rec: {len(failed)} model(s) failed to load; {how}", file=out)
        for m in failed:
            print(
                f"triton-rec: FAILED {m['name']} (version {m.get('version')}): {m['reason']}",
                file=out,
            )
    out.flush()


def serve(server: TritonServer) -> int:
    """Run ``server`` in the foreground until it exits. SIGINT, SIGTERM or SIGHUP of this
    process stop it once, drained (:meth:`TritonServer.drain_and_signal`: refuse new
    requests as retryable, answer those in the models, then stop tritonserver). Returns
    its exit status after its instance processes have gone."""
    stopping: List[int] = []
    told = threading.Event()

    def forward(signum, _frame):
        if server.process is None or server.process.poll() is not None:
            return
        if stopping:
            print("triton-rec: already stopping", file=sys.stderr, flush=True)
            return
        stopping.append(signum)
        told.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    server.launch(die_with_parent=True)
    assert server.process is not None  # set by launch()
    threading.Thread(target=report_start, args=(server,), daemon=True).start()
    while server.process.poll() is None and not told.wait(0.2):
        pass
    if stopping and server.process.poll() is None:
        print(
            "triton-rec: stopping: refusing new requests (retryable)", file=sys.stderr, flush=True
        )
    # drained while it runs (stop(): refuse new requests, answer those in the models, stop
    # tritonserver, kill it if it is not gone after its exit timeout and a margin), then
    # whatever is left of the server's process group
    sig = signal.SIGINT if stopping[:1] == [signal.SIGINT] else signal.SIGTERM
    server.stop(EXIT_TIMEOUT_S + 20, sig)
    code = server.process.wait()
    return code if code >= 0 else 128 - code


def main(argv=None) -> int:
    """Command-line entry point (prepare / serve / plan); returns the exit code."""
    p = argparse.ArgumentParser(prog="triton-rec-server", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="create the backend directory and print its path")
    s = sub.add_parser("serve", help="run tritonserver in the foreground until Ctrl-C")
    for q in (prep, s):
        q.add_argument(
            "--backend-directory",
            type=Path,
            metavar="DIR",
            help="Triton's backend directory to lay out (default: one per Python environment "
            "under ~/.cache/triton-rec/backends)",
        )
    for q in (prep, s):
        q.add_argument(
            "--request-path",
            choices=REQUEST_PATHS,
            help="serve hps/hugectr models through the native backend (Python hosted in the "
            f"server) or Triton's Python backend (default: ${REQUEST_PATH_ENV}, else native)",
        )
    s.add_argument("--model-repository", required=True)
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument(
        "--no-supervise",
        action="store_true",
        help="do not replace dead instance processes (and keep Triton's default model control)",
    )
    s.add_argument(
        "--strict-startup",
        action="store_true",
        help="exit when any model fails to load at start-up (default: serve the models that "
        "load and report the others)",
    )
    s.add_argument("--print-command", action="store_true", help="print the command and exit")
    s.add_argument(
        "--allowed-roots",
        metavar="DIR[:DIR...]",
        help="confine every model file to these directories (sets "
        "TRITON_REC_ALLOWED_ROOTS for the backends; default: no confinement)",
    )
    from triton_rec.triton import plan_cli

    plan_cli.add_parser(sub)
    args = p.parse_args(argv)
    if args.cmd == "plan":
        return plan_cli.run(args)
    if args.cmd == "prepare":
        print(prepare_backend_dir(args.backend_directory, args.request_path))
        return 0
    from triton_rec.config.model_files import ALLOWED_ROOTS_ENV

    env = {ALLOWED_ROOTS_ENV: args.allowed_roots} if args.allowed_roots else None
    server = _PublicServer(
        args.model_repository,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        supervise=not args.no_supervise,
        inherit_output=True,
        env=env,
        backend_dir=args.backend_directory,
        request_path=args.request_path,
        strict_startup=args.strict_startup,
    )
    try:
        if args.print_command:
            print(" ".join(server.command()))
            return 0
        server.check_request_path()
        server_allocator(os.environ)
    except (TritonRecError, ValueError) as e:  # no wheel, a request path or allocator missing
        print(f"triton-rec-server: {e}", file=sys.stderr)
        return 2
    return serve(server)


if __name__ == "__main__":
    sys.exit(main())
