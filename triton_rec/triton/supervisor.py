"""Supervision of a tritonserver's Python-backend instance processes (self-healing).

Triton's Python backend (r24.10) never replaces a dead instance process (a *stub*):
requests routed to it fail after about a second each, the model stays READY, and an
explicit ``load`` of the unchanged model keeps the dead instance (see
docs/upstream-notes.md, "Dead instance processes"). :class:`Supervisor` closes that gap
from outside the server, off the request path:

- every ``interval`` seconds it lists the server's live (non-zombie) stub children in
  ``/proc`` and groups them by model (the stub's first argument is
  ``<model directory>/<version>/model.py``); nothing else happens while that set of
  processes is unchanged;
- when a stub has vanished it asks the server (HTTP repository index and model config)
  which models are READY and how many instances each should have; a READY model with
  fewer live instances than configured, seen on two consecutive passes, is *degraded*;
- a degraded model is unloaded (it then reports not ready, and requests fail at once
  instead of after a one-second timeout) and loaded again, through Triton's repository
  API (the server must run with ``--model-control-mode=explicit``). Other models are
  not touched. Each step is one line on the supervisor's log, and
  :attr:`Supervisor.replacements` counts the reloads per model.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, Optional, Set

from triton_rec.util import procfs

#: Seconds between two scans of the server's instance processes.
SUPERVISE_INTERVAL_S = 0.5
#: Seconds the supervisor waits for one load of a model.
RELOAD_TIMEOUT_S = 300.0
#: Seconds the supervisor waits for the unload of a degraded model before loading it.
UNLOAD_WAIT_S = 3.0
STUB_NAME = "triton_python_backend_stub"


def stub_processes(server_pid: int) -> Dict[str, Set[int]]:
    """Live (non-zombie) Python-backend stub children of ``server_pid``, by model name.

    A SIGKILLed stub stays a zombie child of the server until the server reaps it (at
    the model's unload), so zombies count as dead."""
    models: Dict[str, Set[int]] = {}
    for pid in procfs.children(server_pid):
        argv = procfs.cmdline(pid)
        if len(argv) < 2 or not argv[0].endswith(STUB_NAME):
            continue
        # argv[1] is <model directory>/<version>/<model.py>; the directory is the model's name.
        model = Path(argv[1]).parent.parent.name
        models.setdefault(model, set()).add(pid)
    return models


def expected_instances(config: dict) -> int:
    """Instance processes a model config asks for (count per group, per listed GPU)."""
    total = 0
    for group in config.get("instance_group", []) or [{}]:
        count = int(group.get("count", 1))
        gpus = group.get("gpus") or []
        total += count * (len(gpus) if group.get("kind") == "KIND_GPU" and gpus else 1)
    return total


class Supervisor:
    """Watches one tritonserver and reloads a model whose instance process died.

    Args:
        server_pid: the tritonserver process.
        http_url: ``host:port`` of its HTTP endpoint (repository API).
        interval: seconds between scans (:data:`SUPERVISE_INTERVAL_S`).
        log: receives one line per event (default: stderr with a prefix).
    """

    def __init__(
        self,
        server_pid: int,
        http_url: str,
        interval: float = SUPERVISE_INTERVAL_S,
        log: Optional[Callable[[str], None]] = None,
    ):
        self.server_pid = server_pid
        self.http_url = http_url
        self.interval = float(interval)
        self.log = log or (
            lambda line: print(f"triton-rec supervisor: {line}", file=sys.stderr, flush=True)
        )
        #: Reloads done per model (a dead instance replaced).
        self.replacements: Dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last: Dict[str, Set[int]] = {}  # stubs seen at the last pass
        self._gone: Dict[str, Set[int]] = {}  # stubs that vanished, per model under watch
        self._suspect: Set[str] = set()  # degraded at the last pass

    # -- the server's repository API ------------------------------------------------
    def _http(self, method: str, path: str, timeout: float = 10.0):
        req = urllib.request.Request(
            f"http://{self.http_url}{path}", method=method, data=b"{}" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def _ready_models(self) -> Dict[str, str]:
        return {
            m["name"]: m.get("state", "") for m in self._http("POST", "/v2/repository/index") or []
        }

    def _expected(self, model: str) -> int:
        return expected_instances(self._http("GET", f"/v2/models/{model}/config"))

    # -- the loop -------------------------------------------------------------------
    def start(self) -> Supervisor:
        """Start the supervising thread; returns ``self``."""
        self._thread = threading.Thread(target=self._run, name="trec-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it (at most ``RELOAD_TIMEOUT_S``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(RELOAD_TIMEOUT_S)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception as e:  # the supervisor must outlive a bad pass
                self.log(f"check failed: {e!r}")

    def check(self) -> None:
        """One pass: find degraded models and reload them."""
        if procfs.is_gone(self.server_pid):
            return
        now = stub_processes(self.server_pid)
        for model, pids in self._last.items():
            gone = pids - now.get(model, set())
            if gone:
                self._gone.setdefault(model, set()).update(gone)
        candidates = set(self._gone)
        if not candidates:
            self._last = now
            return
        try:
            states = self._ready_models()
        except (OSError, ValueError):
            return  # not serving yet, or stopping: look again next pass
        degraded = set()
        for model in candidates:
            try:
                if states.get(model) == "READY" and len(now.get(model, ())) < self._expected(model):
                    degraded.add(model)
            except (OSError, ValueError):
                degraded.add(model)  # asked again next pass
        for model in sorted(degraded & self._suspect):
            self._reload(model, len(now.get(model, ())), self._gone.get(model, set()))
            degraded.discard(model)
        # A model with its instances complete (or unloaded on purpose) is forgotten.
        self._gone = {m: p for m, p in self._gone.items() if m in degraded}
        self._suspect = degraded
        self._last = stub_processes(self.server_pid)

    def _reload(self, model: str, live: int, gone: Set[int]) -> None:
        want = self._expected(model)
        old = stub_processes(self.server_pid).get(model, set())
        self.log(
            f"model '{model}': {live} of {want} instance processes running "
            f"(exited: {sorted(gone)}); unloading it (not ready) and loading it again"
        )
        t0 = time.monotonic()
        try:
            self._http("POST", f"/v2/repository/models/{model}/unload", RELOAD_TIMEOUT_S)
            # A request that was in the dead instance is never released (Triton r24.10),
            # so the unload may never finish; a load does not wait for it.
            deadline = t0 + UNLOAD_WAIT_S
            while (
                self._ready_models().get(model) not in ("UNAVAILABLE", None)
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            stuck = self._ready_models().get(model) == "UNLOADING"
            self._http("POST", f"/v2/repository/models/{model}/load", RELOAD_TIMEOUT_S)
        except urllib.error.HTTPError as e:
            self.log(f"model '{model}': reload failed: {e.read().decode(errors='replace')}")
            return
        except (OSError, ValueError) as e:
            self.log(f"model '{model}': reload failed: {e!r}")
            return
        self.replacements[model] = self.replacements.get(model, 0) + 1
        self.log(
            f"model '{model}': reloaded in {time.monotonic() - t0:.1f} s "
            f"({self.replacements[model]} replacement(s) so far)"
        )
        if stuck:
            # The old model's surviving instances would wait forever for that unload,
            # holding their memory: end them (the server reaps them if the unload ever
            # completes).
            left = old & stub_processes(self.server_pid).get(model, set())
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.log(
                f"model '{model}': the old instances' unload is stuck in the server "
                f"(a request lost with the dead instance); ended their processes {sorted(left)}"
            )
