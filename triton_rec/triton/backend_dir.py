"""Where the server and its backends are, and Triton's backend directory laid out from
them (:mod:`triton_rec.triton.runtime` says what it holds): the wheel's tritonserver and
Python backend stub, the native backends, the request path, and whether the stub can serve
the Python request path (:func:`check_python_request_path`)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Mapping, Optional

from triton_rec.errors import RequestPathUnavailable, RuntimeNotFound

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
