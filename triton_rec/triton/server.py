"""A tritonserver process of this project (:class:`TritonServer`): its command, its
environment (the stub's library path, the allocator), its start, readiness, drained stop
and supervision. Part of the launcher, :mod:`triton_rec.triton.runtime`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, List, Mapping, Optional, Sequence, Tuple, Union

from triton_rec.errors import TritonRecError
from triton_rec.triton.backend_dir import (
    check_python_request_path,
    default_backend_dir,
    prepare_backend_dir,
    resolve_request_path,
    runtime_library_dir,
    tritonserver_binary,
)
from triton_rec.triton.drain import (
    DRAIN_FILE_ENV,
    DRAIN_WAIT_S,
    DrainFile,
    close_front_ends,
)

if TYPE_CHECKING:
    from triton_rec.triton.supervisor import Supervisor


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now."""
    return free_ports(1)[0]


def free_ports(count: int, taken: Sequence[int] = ()) -> List[int]:
    """``count`` distinct TCP ports free on the loopback interface right now, none of them
    in ``taken``. The sockets are held until all are picked: ports picked one at a time
    may repeat (tritonserver then refuses to start: "cannot listen to HTTP requests and
    metrics requests at the same address and port")."""
    held: List[socket.socket] = []
    ports: List[int] = []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in taken:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


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
#: Triton's own default (``exit_timeout_secs_ = 30``, the core's server.cc): with 10 s, a
#: model on Triton's Python backend stopped under load on 2 busy cores was once still
#: unloading when it ran out, and the server exited with status 1 without finalizing.
EXIT_TIMEOUT_S = 30


#: ``TRITON_REC_MALLOC``: the server's memory allocator, ``jemalloc`` (the default, where
#: the system has it: Debian's ``libjemalloc2``, which ``make`` installs) or ``system``
#: (glibc's). With glibc, unloading and loading models through the repository API grew
#: tritonserver by ~27 kB a cycle for good (freed blocks of 64 kB-1 MB it keeps; jemalloc:
#: no growth; benchmarks/history/2026-11-26-stop-start-reload.md). Triton's own documentation
#: recommends jemalloc or tcmalloc for the same reason (model_management.md).
MALLOC_ENV = "TRITON_REC_MALLOC"
JEMALLOC_LIBRARY = "libjemalloc.so.2"
#: jemalloc's settings (``MALLOC_CONF``, unless set already; :func:`jemalloc_conf` adds the
#: rest): freed memory goes back to the system within about a second, by a background
#: thread, also when the server is idle (by default jemalloc purges only on later
#: allocations: 94 MiB of refused 64 MiB requests stayed resident, where glibc gave them
#: back; docs/operations.md); each thread caches blocks of at most 4 KiB (jemalloc: 32 KiB):
#: Triton's ~40 threads, mostly idle, kept their caches' blocks after a burst of large
#: requests, while a served request makes 75-140 allocations, 1.4-3.6 of them above 4 KiB
#: (benchmarks/history/2026-12-08-allocator-caches.md). ``lg_tcache_max``: jemalloc 5.2's
#: name, which 5.3 still reads (src/jemalloc.c, ``CONF_MATCH("lg_tcache_max")``).
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,lg_tcache_max:12"
#: From jemalloc 5.3 (its opt.tcache_nslots_small_max; 5.2 warns of an unknown setting):
#: at most 40 blocks of a small size a thread (jemalloc: 200).
JEMALLOC_CONF_5_3 = "tcache_nslots_small_max:40"


def jemalloc_version(library: str) -> Tuple[int, int]:
    """(major, minor) of the jemalloc in ``library``, read from the version string it embeds
    (``5.3.0-0-g<commit>``, its ``JEMALLOC_VERSION``), or (0, 0) where there is none."""
    try:
        with open(library, "rb") as f:
            found = re.search(rb"(\d+)\.(\d+)\.\d+-\d+-g[0-9a-f]{40}", f.read())
    except OSError:
        return (0, 0)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def jemalloc_conf(version: Tuple[int, int], cpus: Optional[int] = None) -> str:
    """The ``MALLOC_CONF`` for a jemalloc of ``version``: :data:`JEMALLOC_CONF`, one arena
    per CPU (``os.cpu_count()``; jemalloc's default is four, each with its own partly used
    pages), and from 5.3 :data:`JEMALLOC_CONF_5_3`."""
    conf = f"{JEMALLOC_CONF},narenas:{max(1, cpus or os.cpu_count() or 1)}"
    return f"{conf},{JEMALLOC_CONF_5_3}" if version >= (5, 3) else conf


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
        exit_timeout_s: tritonserver's exit timeout (default :data:`EXIT_TIMEOUT_S`).
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
        exit_timeout_s: int = EXIT_TIMEOUT_S,
    ):
        self.model_repository = Path(model_repository).resolve()
        self.strict_startup = strict_startup
        self.exit_timeout_s = int(exit_timeout_s)
        given = [p for p in (http_port, grpc_port, metrics_port) if p]
        picked = iter(free_ports(3 - len(given), taken=given))
        self.http_port = http_port or next(picked)
        self.grpc_port = grpc_port or next(picked)
        self.metrics_port = metrics_port or next(picked)
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
            f"--exit-timeout-secs={self.exit_timeout_s}",
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
            env.setdefault("MALLOC_CONF", jemalloc_conf(jemalloc_version(allocator)))
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
        """Whether the server answers ready on ``/v2/health/ready`` and every endpoint it
        opens listens. tritonserver opens gRPC, then HTTP, then metrics (``StartEndpoints``
        in its src/main.cc), so HTTP answers ready a moment before the metrics port
        accepts a connection."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                if r.status != 200:
                    return False
        except OSError:
            return False
        return not self.metrics_enabled() or self._metrics_listens()

    def metrics_enabled(self) -> bool:
        """Whether this server opens its metrics port: :meth:`command` allows metrics, and
        a later ``--allow-metrics`` in ``extra_args`` wins, as on tritonserver's own
        command line."""
        flags = [a for a in self.extra_args if a.startswith("--allow-metrics")]
        return not flags or flags[-1].partition("=")[2].lower() not in ("false", "0")

    def _metrics_listens(self) -> bool:
        addresses = [a for a in self.extra_args if a.startswith("--metrics-address=")]
        host = addresses[-1].partition("=")[2] if addresses else ""
        try:
            with socket.create_connection(
                (host if host not in ("", "0.0.0.0") else "127.0.0.1", self.metrics_port),
                timeout=2,
            ):
                return True
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
