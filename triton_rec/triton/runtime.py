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
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence, Union

from triton_rec.errors import RequestPathUnavailable, RuntimeNotFound, TritonRecError
from triton_rec.triton.drain import (
    DRAIN_FILE_ENV,
    DRAIN_WAIT_S,
    DrainFile,
    close_front_ends,
)

if TYPE_CHECKING:
    from triton_rec.triton.supervisor import Supervisor

#: One ``<name>/model.py`` folder per Python-based backend. ``triton_rec/triton/backend`` is
#: a symlink to the repository's top-level ``backend/`` folder, so the wheel ships the
#: backends as package data and a checkout (or editable install) finds them at the same
#: place.
BACKEND_SOURCES = Path(__file__).resolve().parent / "backend"
#: The native backends benchmarks and tests measure against (``trec_floor``: Triton and a
#: C++ backend that does no work): built by CMake in a checkout's build folder
#: (``build/<wheel tag>``), never installed; the backend directory gets them where they
#: are built (:func:`benchmark_backend_library`).
BENCHMARK_BACKENDS = ("trec_floor",)
#: The checkout this module runs from (its build folder holds :data:`BENCHMARK_BACKENDS`);
#: for an installed wheel, a folder without one.
CHECKOUT = Path(__file__).resolve().parents[2]
#: Backends served by the native backend (``src/triton_backend/trec/``): one
#: library, ``libtriton_trec.so`` (:data:`HOSTED_LIBRARY`), installed as
#: ``<name>/libtriton_<name>.so``, which hosts ``<name>/model.py`` in the server process and
#: answers natively what has a native plan. Without it, Triton runs the same model.py in
#: the Python backend.
HOSTED_BACKENDS = ("hps", "hugectr", "dense")
HOSTED_LIBRARY = "trec"
#: How ``hps`` and ``hugectr`` requests are served: ``native`` (C++ backend, Python hosted
#: in-process) or ``python`` (Triton's Python backend, one process per instance).
REQUEST_PATHS = ("native", "python")
#: Environment variable choosing the request path of servers this launcher starts.
REQUEST_PATH_ENV = "TRITON_REC_REQUEST_PATH"


def resolve_request_path(path: Optional[str] = None) -> str:
    """The request path to use: ``path``, else ``$TRITON_REC_REQUEST_PATH``, else native."""
    path = path or os.environ.get(REQUEST_PATH_ENV) or REQUEST_PATHS[0]
    if path not in REQUEST_PATHS:
        raise ValueError(f"request path must be one of {', '.join(REQUEST_PATHS)}, got {path!r}")
    return path


def benchmark_backend_library(name: str) -> Optional[Path]:
    """The ``libtriton_<name>.so`` of a benchmark backend a checkout has built (the newest
    of its build folders), or None (an installed wheel, or not built)."""
    built = sorted(
        (CHECKOUT / "build").glob(f"*/libtriton_{name}.so"), key=lambda p: p.stat().st_mtime
    )
    return built[-1] if built else None


def native_backend_library(name: str) -> Path:
    """The built ``libtriton_<name>.so`` of a native backend (RuntimeNotFound if absent)."""
    import triton_rec

    lib = f"libtriton_{name}.so"
    for root in triton_rec.__path__:
        candidate = Path(root) / "triton" / "native_backends" / lib
        if candidate.is_file():
            return candidate
    raise RuntimeNotFound(f"native backend {lib} not built: reinstall triton-rec (pip install .)")


def default_backend_dir(path: Optional[str] = None) -> Path:
    """Where the launcher lays out Triton's backend directory when none is given: one per
    Python environment (the stub it holds is built for this interpreter) and request path
    (:func:`resolve_request_path`), under the user's cache,
    ``~/.cache/triton-rec/backends/<env>-<path>`` (``$XDG_CACHE_HOME`` if set)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    env = hashlib.sha256(os.fsencode(sys.prefix)).hexdigest()[:12]
    ver = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return Path(cache) / "triton-rec" / "backends" / f"{ver}-{env}-{resolve_request_path(path)}"


def _pytriton_root() -> Path:
    """The wheel's ``pytriton/tritonserver`` folder, found without importing ``pytriton``:
    its ``__init__`` imports pytriton's client and tritonclient, which a node that only
    serves may lack. :func:`importlib.util.find_spec` of a top-level package runs none of
    its code."""
    spec = importlib.util.find_spec("pytriton")
    for location in (spec.submodule_search_locations or ()) if spec is not None else ():
        root = Path(location).resolve() / "tritonserver"
        if root.is_dir():
            return root
    raise RuntimeNotFound(
        "the Triton server wheel is missing: pip install 'triton-rec[server]' "
        "(or nvidia-pytriton==0.7.0)"
    )


def tritonserver_binary() -> Path:
    """Path of the ``tritonserver`` executable shipped in the wheel."""
    return _pytriton_root() / "bin" / "tritonserver"


def runtime_library_dir() -> Path:
    """Directory of the shared libraries the server and the stub link (``nvidia_pytriton.libs``)."""
    return _pytriton_root().parent.parent / "nvidia_pytriton.libs"


def python_backend_stub() -> Path:
    """The wheel's Python backend stub built for this interpreter's Python version."""
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = _pytriton_root() / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeNotFound(
            f"no Triton Python backend stub for Python {ver} in {stub.parent.parent}"
        )
    return stub


#: A Python backend stub holds these bytes exactly when it was built with a pybind11 older
#: than 2.12, the first release that supports numpy 2. Such a stub reads a dtype's item
#: size at numpy 1's descriptor offsets (``PyArrayDescr_Proxy``), which numpy 2 changed:
#: ``pb_utils.Tensor.as_numpy()`` then returns arrays of the right shape and dtype but not
#: the request's values (seen on a GPU node with numpy 2.5 and the 3.12 stub: ROWINDEX
#: [0, 1, 2, ...] read as [0, 0, 0, ...]; on a CPU machine with numpy 2.2 and the 3.11
#: stub: an INT64 input [0, ..., 5] read as six zeros, and the array returned refused
#: with "output tensor shape does not match size of output").
#:
#: Where this comes from: pybind11's ``include/pybind11/numpy.h`` imports numpy's C API with
#: ``module_::import("numpy.core.multiarray")`` up to v2.11 (a literal in the binary); from
#: v2.12 on it builds the name at run time (``numpy._core`` under numpy 2), and no other
#: code of the stub names ``numpy.core`` (python_backend's ``src/``). python_backend's
#: ``CMakeLists.txt`` fetches pybind11 v2.10.0 up to branch r24.10, which is Triton 2.51,
#: the server of the PyPI wheel nvidia-pytriton 0.7.0 (its stubs hold these bytes), and
#: v2.12.0 from r24.11 (Triton 2.52; python_backend PR #384). Keyed on the stub itself, not
#: on a version: a wheel whose stub is fixed, or a stub built from source with a newer
#: pybind11, starts without a refusal (and the wheel's files hold the Triton version as no
#: string: libtritonserver builds it from instruction operands; only a running server
#: reports it).
STUB_PRE_NUMPY2_MARK = b"numpy.core.multiarray\0"


def stub_predates_numpy2(stub: Path) -> bool:
    """Whether the Python backend stub ``stub`` cannot read numpy >= 2 arrays
    (:data:`STUB_PRE_NUMPY2_MARK`)."""
    return STUB_PRE_NUMPY2_MARK in Path(stub).read_bytes()


def stub_python(env: Mapping[str, str]) -> str:
    """The interpreter whose environment the Python backend stub takes in a server with
    environment ``env``: the stub embeds libpython, which finds its prefix (and so its
    site-packages) through the first ``python3`` on ``PATH`` (:meth:`TritonServer.environment`
    puts this environment's first)."""
    return shutil.which("python3", path=env.get("PATH")) or sys.executable


#: :func:`stub_numpy_version`'s answers, per interpreter and the variables that decide
#: what it imports.
_NUMPY_VERSIONS: Dict[tuple, Optional[str]] = {}


def stub_numpy_version(env: Mapping[str, str]) -> Optional[str]:
    """The version of the numpy that a Python backend stub built with pybind11 < 2.12
    imports in a server with environment ``env`` (None where it imports none), asked of
    :func:`stub_python` the way such a stub starts it: pybind11 2.10/2.11 initialize
    Python >= 3.11 with ``PyConfig_InitIsolatedConfig`` (``PYTHONPATH`` and the other
    ``PYTHON*`` variables and the user site ignored: ``python3 -I``), older Pythons with
    ``Py_InitializeEx`` (the environment honoured). The stub is the one of this
    interpreter's version. Cached per interpreter and the variables it reads (one numpy
    import, ~0.2 s)."""
    python = stub_python(env)
    isolated = sys.version_info >= (3, 11)
    key: tuple = (python, isolated)
    if not isolated:
        key += (env.get("HOME"), *sorted((k, v) for k, v in env.items() if k.startswith("PYTHON")))
    if key not in _NUMPY_VERSIONS:
        version = None
        cmd = [
            python,
            *(["-I"] if isolated else []),
            "-c",
            "import numpy; print(numpy.__version__)",
        ]
        try:
            out = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=60)
            if out.returncode == 0:
                version = out.stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            pass
        _NUMPY_VERSIONS[key] = version
    return _NUMPY_VERSIONS[key]


def check_python_request_path(env: Mapping[str, str], stub: Optional[Path] = None) -> None:
    """Refuse (:class:`~triton_rec.errors.RequestPathUnavailable`) a Python request path whose
    stub (default: :func:`python_backend_stub`) cannot read the numpy that a server with
    environment ``env`` gives it: numpy >= 2 with a stub built before pybind11 supported it
    (:data:`STUB_PRE_NUMPY2_MARK`). The native request path never calls this."""
    stub = Path(stub) if stub is not None else python_backend_stub()
    if not stub_predates_numpy2(stub):
        return
    version = stub_numpy_version(env)
    try:
        major = int(version.split(".")[0]) if version else 0
    except ValueError:
        return
    if major < 2:
        return
    raise RequestPathUnavailable(
        f"the Python request path cannot run here: its Triton Python backend stub ({stub}) "
        "was built with a pybind11 older than 2.12, which predates numpy 2 (the stubs of "
        "Triton 2.51 and earlier, as in nvidia-pytriton 0.7.0), and the environment it "
        f"imports ({stub_python(env)}) has numpy {version}: request tensors would read as "
        "wrong values (every element as the first). Either install numpy < 2 in that environment "
        "(pip install 'numpy<2'), or serve on the native request path, the default (leave "
        f"out --request-path python and unset {REQUEST_PATH_ENV})."
    )


def _install(src: Path, dst: Path) -> None:
    # Copy next to the target, then rename over it: a server already running from this
    # directory keeps its (busy) files, and nobody sees a half-copied one.
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def prepare_backend_dir(dest: Optional[Path] = None, path: Optional[str] = None) -> Path:
    """(Re)create the backend directory (default: :func:`default_backend_dir`) for request
    path ``path`` (:func:`resolve_request_path`) and return it. Cheap; safe to call every start,
    also while another server runs from it."""
    path = resolve_request_path(path)
    dest = Path(dest) if dest is not None else default_backend_dir(path)
    root = _pytriton_root()
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _install(root / "backends" / "python" / name, py / name)
    _install(python_backend_stub(), py / "triton_python_backend_stub")
    if not (BACKEND_SOURCES / "hps" / "model.py").is_file():
        raise RuntimeNotFound(f"the backends' model.py files are missing in {BACKEND_SOURCES}")
    for name in BENCHMARK_BACKENDS:
        lib = benchmark_backend_library(name)
        if lib is not None:
            # a real file (Triton refuses a library whose real path is outside the directory)
            (dest / name).mkdir(exist_ok=True)
            _install(lib, dest / name / f"libtriton_{name}.so")
    for src in sorted(BACKEND_SOURCES.iterdir()):
        if (src / "model.py").exists():
            (dest / src.name).mkdir(exist_ok=True)
            for f in src.iterdir():
                if f.is_file() and f.suffix == ".py":
                    _install(f, dest / src.name / f.name)
    for name in HOSTED_BACKENDS:
        lib = dest / name / f"libtriton_{name}.so"
        if path == "native":
            _install(native_backend_library(HOSTED_LIBRARY), lib)
            # the interpreter the library embeds: this environment's (its site-packages)
            (dest / name / "trec_python").write_text(sys.executable + "\n")
        else:  # Triton picks the library over model.py when both are there
            lib.unlink(missing_ok=True)
    return dest


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_library_dir() -> str:
    """The directory of this interpreter's own ``libpython3.X.so.1.0``, if it has one.

    The backend stub links ``libpython3.X.so.1.0`` and would otherwise load the system's
    (e.g. Debian's 3.11.2) while importing this interpreter's standard library (e.g.
    3.11.7): C modules such as ``_ssl`` then fail with undefined symbols (seen with
    pyenv), and packages needing them (redis-py) cannot be imported in the stub.
    Returns "" when the interpreter is not a shared build.
    """
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    if libdir and soname and os.path.exists(os.path.join(libdir, soname)):
        return libdir
    return ""


#: Server-wide settings that keep a node serving (docs/operations.md, "Readiness" and
#: "Request limits and accounting"; upstream sources in docs/upstream-notes.md):
#:
#: - ``--strict-readiness=false``: ``/v2/health/ready`` is the server's own state. With
#:   Triton's default (true) one model that failed to load keeps the whole node "not
#:   ready" until it loads, also after it is unloaded; per-model readiness
#:   (``/v2/models/<m>/ready``) stays exact either way.
#: - ``--grpc-infer-allocation-pool-size=0``: the gRPC frontend keeps up to this many
#:   request objects for reuse, each with the capacity of the largest request it ever
#:   held (default 8: 8 x 64 MB stayed resident after 64 MB requests); 0 frees each
#:   request when it is answered.
#:
#: Triton 2.51 has no request-size flag (``--http-max-input-size`` appears in 2.59;
#: gRPC accepts up to 2 GB): the backends refuse what exceeds a model's largest valid
#: request (:func:`triton_rec.triton.request_loop.check_input_size`).
SERVER_LIMIT_FLAGS = ("--strict-readiness=false", "--grpc-infer-allocation-pool-size=0")

#: tritonserver's exit timeout (``--exit-timeout-secs``): how long it waits for in-flight
#: inferences and model unloads once told to stop (after the drain: triton_rec.triton.drain).
EXIT_TIMEOUT_S = 10


#: ``TRITON_REC_MALLOC``: the server's memory allocator, ``jemalloc`` (the default, where
#: the system has it: Debian's ``libjemalloc2``, which ``make`` installs) or ``system``
#: (glibc's). With glibc, unloading and loading models through the repository API grew
#: tritonserver by ~27 kB a cycle for good (freed blocks of 64 kB-1 MB it keeps; jemalloc:
#: no growth; benchmarks/history/2026-11-26-stop-start-reload.md). Triton's own documentation
#: recommends jemalloc or tcmalloc for the same reason (model_management.md).
MALLOC_ENV = "TRITON_REC_MALLOC"
JEMALLOC_LIBRARY = "libjemalloc.so.2"
#: jemalloc's settings (``MALLOC_CONF``, unless set already): freed memory goes back to the
#: system within about a second, by a background thread, also when the server is idle
#: (by default jemalloc purges only on later allocations: 94 MiB of refused 64 MiB
#: requests stayed resident, where glibc gave them back; docs/operations.md).
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0"


def server_allocator(env: Mapping[str, str]) -> str:
    """The allocator library to preload into tritonserver (``$TRITON_REC_MALLOC``, see
    :data:`MALLOC_ENV`), or "" for glibc's. Raises ValueError for an unknown value, and
    TritonRecError where jemalloc is asked for by name and not installed."""
    choice = env.get(MALLOC_ENV, "")
    if choice not in ("", "jemalloc", "system"):
        raise ValueError(f"{MALLOC_ENV} must be 'jemalloc' or 'system', not {choice!r}")
    if choice == "system":
        return ""
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        path = os.path.join(d, JEMALLOC_LIBRARY)
        if os.path.exists(path):
            return path
    if choice == "jemalloc":
        raise TritonRecError(
            f"{MALLOC_ENV}=jemalloc but {JEMALLOC_LIBRARY} is not installed "
            "(Debian/Ubuntu: apt-get install libjemalloc2)"
        )
    return ""


def _die_with_parent() -> None:
    """In the forked server, before exec: SIGTERM when the launching thread dies (Linux)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class TritonServer:
    """A tritonserver process serving ``model_repository`` on loopback.

    Args:
        model_repository: the repository directory.
        http_port, grpc_port, metrics_port: ports; free ones are picked when None.
        explicit: start in explicit model-control mode (load models with the client).
        load_models: with ``explicit``, models to load at start (``--load-model``).
        log_path: file that receives the server's output.
        extra_args: more tritonserver flags.
        env: extra environment variables for the server and its backends
            (e.g. ``TRITON_REC_STORE``).
        supervise: replace dead instance processes
            (:class:`~triton_rec.triton.supervisor.Supervisor`,
            run by this object while the server runs). Needs explicit model control:
            without ``explicit`` the server runs in that mode with every model loaded
            at start (``--load-model=*``), which serves what the default mode would.
        supervisor_log: receives the supervisor's lines (default: stderr).
        inherit_output: the server writes to this process's stdout/stderr (no log_path).
        request_path: ``native`` or ``python`` (:func:`resolve_request_path`; default
            ``$TRITON_REC_REQUEST_PATH``, else native).
        strict_startup: exit when a model fails to load at start-up (Triton's default).
            Without it the server serves every model that loads, the failed ones reported
            by :meth:`failed_models` (and by :func:`serve`).
    """

    def __init__(
        self,
        model_repository: os.PathLike,
        http_port: Optional[int] = None,
        grpc_port: Optional[int] = None,
        metrics_port: Optional[int] = None,
        explicit: bool = False,
        load_models: Sequence[str] = (),
        log_path: Optional[os.PathLike] = None,
        extra_args: Sequence[str] = (),
        backend_dir: Optional[os.PathLike] = None,
        env: Optional[dict] = None,
        supervise: bool = False,
        supervisor_log: Optional[Callable[[str], None]] = None,
        inherit_output: bool = False,
        request_path: Optional[str] = None,
        strict_startup: bool = False,
    ):
        self.model_repository = Path(model_repository).resolve()
        self.strict_startup = strict_startup
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.explicit = explicit
        self.load_models = list(load_models)
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = list(extra_args)
        self.request_path = resolve_request_path(request_path)
        self.backend_dir = (
            Path(backend_dir) if backend_dir else default_backend_dir(self.request_path)
        )
        self.extra_env = dict(env or {})
        self.supervise = supervise
        self.supervisor_log = supervisor_log
        self.inherit_output = inherit_output
        self.supervisor: Optional[Supervisor] = None
        self.process: Optional[subprocess.Popen] = None
        self._log: Optional[IO[bytes]] = None
        self.drain_file: Optional[DrainFile] = None
        self._drain_dir: Optional[str] = None

    @property
    def http_url(self) -> str:
        """The server's HTTP endpoint, ``host:port``."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """The server's gRPC endpoint, ``host:port``."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """URL of the server's Prometheus metrics."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def command(self) -> List[str]:
        """The ``tritonserver`` command line for this configuration."""
        cmd = [
            str(tritonserver_binary()),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.backend_dir.resolve()}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--allow-metrics=true",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            # Our configs are complete; auto-completion would start an extra stub per
            # model (with a fixed 1 s wait inside the Python backend) at every load.
            "--disable-auto-complete-config",
            *SERVER_LIMIT_FLAGS,
        ]
        if not self.strict_startup:
            # one broken model does not keep the others from serving (docs/operations.md,
            # "Start-up with a broken model")
            cmd.append("--exit-on-error=false")
        if self.explicit or self.supervise:
            # The supervisor reloads models through the repository API (explicit mode only).
            cmd.append("--model-control-mode=explicit")
            cmd += [f"--load-model={m}" for m in (self.load_models if self.explicit else ["*"])]
        return cmd + self.extra_args

    def environment(self) -> dict:
        """The environment the server runs with (library paths, Python, extra variables)."""
        env = dict(os.environ)
        libdir = str(runtime_library_dir())
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (python_library_dir(), libdir, env.get("LD_LIBRARY_PATH", "")) if p
        )
        # The stub runs the first `python` environment on PATH: make it ours.
        env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
        env["VIRTUAL_ENV"] = sys.prefix
        # numpy's OpenBLAS may pick generic kernels on a CPU it does not recognize
        # (seen on VMs); name the right ones for every instance process.
        from triton_rec.triton.process_setup import server_blas_environment

        env.update(server_blas_environment(env))
        env.update(self.extra_env)
        allocator = server_allocator(env)
        if allocator:
            env["LD_PRELOAD"] = " ".join(p for p in (allocator, env.get("LD_PRELOAD", "")) if p)
            env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
        return env

    def check_request_path(self) -> None:
        """Refuse a request path that cannot serve with this server's environment
        (:class:`~triton_rec.errors.RequestPathUnavailable`): the Python path where its stub
        cannot read the environment's numpy (:func:`check_python_request_path`). The native
        path has nothing to check."""
        if self.request_path == "python":
            check_python_request_path(self.environment())

    def launch(self, die_with_parent: bool = False) -> TritonServer:
        """Start the server process (in its own session: its process group is its pid)
        and, with ``supervise``, its supervisor; does not wait. ``die_with_parent``: the
        server gets SIGTERM (a graceful stop) if this process dies first. Raises
        :class:`~triton_rec.errors.RequestPathUnavailable` before starting anything where
        :meth:`check_request_path` refuses."""
        self.check_request_path()
        prepare_backend_dir(self.backend_dir, self.request_path)
        out: Union[int, IO[bytes], None] = subprocess.DEVNULL
        err: Optional[int] = subprocess.STDOUT
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "wb")
            out = self._log
        elif self.inherit_output:
            out = err = None
        env = self.environment()
        # the drained stop's shared file (triton_rec.triton.drain), private to this server
        if self._drain_dir is not None:  # launched before: that server is gone
            shutil.rmtree(self._drain_dir, ignore_errors=True)
        self._drain_dir = tempfile.mkdtemp(prefix="triton-rec-")
        self.drain_file = DrainFile.create(self._drain_dir)
        env[DRAIN_FILE_ENV] = str(self.drain_file.path)
        self.process = subprocess.Popen(
            self.command(),
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
        if self.supervise:
            from triton_rec.triton.supervisor import Supervisor

            self.supervisor = Supervisor(
                self.process.pid, self.http_url, log=self.supervisor_log
            ).start()
        return self

    def start(self, timeout: float = 120.0) -> TritonServer:
        """Start the server and wait until it reports ready (or raise with its log tail)."""
        self.launch()
        assert self.process is not None  # set by launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._stop_supervisor()
                raise RuntimeError(
                    f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if self.is_ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout} s:\n{self.log_tail()}")

    def is_ready(self) -> bool:
        """Whether the server answers ready on ``/v2/health/ready``."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def is_live(self) -> bool:
        """Whether the server answers live on ``/v2/health/live``."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/live", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def model_index(self) -> List[dict]:
        """The repository index (``POST /v2/repository/index``): one entry per model
        version with ``name``, ``version``, ``state`` and, for a failed one, ``reason``."""
        req = urllib.request.Request(
            f"http://{self.http_url}/v2/repository/index", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def failed_models(self) -> List[dict]:
        """The index entries of the models that failed to load (state ``UNAVAILABLE`` with
        a reason; a model unloaded on purpose has none)."""
        return [
            m for m in self.model_index() if m.get("state") == "UNAVAILABLE" and m.get("reason")
        ]

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the server log."""
        if not self.log_path or not self.log_path.exists():
            return "(no log file)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def backend_pids(self, model: Optional[str] = None) -> List[int]:
        """PIDs of the live Python backend stub processes (one per model instance),
        optionally only those of ``model``."""
        if not self.process:
            return []
        from triton_rec.triton.supervisor import stub_processes

        by_model = stub_processes(self.process.pid)
        if model is not None:
            return sorted(by_model.get(model, ()))
        return sorted(p for pids in by_model.values() for p in pids)

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGINT) -> None:
        """The drained stop (:meth:`drain_and_signal` with ``sig``), then SIGKILL of the
        whole process group if the server has not exited after ``timeout`` seconds."""
        self._stop_supervisor()
        if self.process and self.process.poll() is None:
            self.drain_and_signal(sig)
            try:
                self.wait_closing_idle_connections(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        if self.process:
            self._wait_group_gone(timeout)
        if self._log:
            self._log.close()
            self._log = None
        if self._drain_dir is not None:
            shutil.rmtree(self._drain_dir, ignore_errors=True)
            self._drain_dir = None

    def drain_and_signal(self, sig: int = signal.SIGTERM, wait: float = DRAIN_WAIT_S) -> None:
        """Take the server out of service, then tell it to stop (:mod:`triton_rec.triton.drain`):
        every request from now on is refused as retryable; once the requests already in a
        model are answered (at most ``wait`` seconds), tritonserver gets ``sig``. Follow
        with :meth:`wait_closing_idle_connections`."""
        assert self.process is not None
        if self.drain_file is not None:
            self.drain_file.start_draining()
            deadline = time.monotonic() + wait
            while self.drain_file.in_flight and time.monotonic() < deadline:
                time.sleep(0.002)
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait_closing_idle_connections(self, timeout: float) -> int:
        """Wait for the signalled server to exit (its status), closing its idle HTTP
        keep-alive connections and its gRPC endpoint meanwhile (:func:`close_front_ends`:
        Triton 2.51 waits for every HTTP connection to close before it stops, and answers
        gRPC requests NOT_FOUND once it has unloaded the models).
        Raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.process.wait(0.05)
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise
            close_front_ends(self.process.pid, self.http_port, self.grpc_port)

    def _stop_supervisor(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None

    def _wait_group_gone(self, timeout: float) -> None:
        # Python-backend stub processes share the server's process group and clean up
        # their shared memory after the server itself has exited: wait for them.
        assert self.process is not None  # stop() calls this only with a process
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


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
