"""End to end, the server's life cycle through the launcher (`python -m triton_rec.runtime
serve`, what `make serve` runs), issue 24: a repository with one broken model starts and
serves the others, and reports the broken one; the broken model loads once fixed, without
a restart; `--strict-startup` keeps Triton's fail-fast."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.e2e.conftest import hps_config
from triton_rec.triton.runtime import EXIT_TIMEOUT_S, TritonServer, free_ports

SEED = 61
TABLES = [SyntheticTable("t", rows=2000, vec_size=8, max_keys_per_sample=4)]


def _repo(tmp_path):
    """hps_good and hps_broken (its table directory removed) in one repository."""
    repo = tmp_path / "repo"
    entries = []
    for name in ("hps_good", "hps_broken"):
        entries.append(
            dict(write_model(str(repo), name, TABLES, seed=SEED), hit_rate_threshold=1.0)
        )
        (repo / name / "config.pbtxt").write_text(hps_config(name, 1))
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": entries}))
    shutil.rmtree(repo / entries[1]["sparse_files"][0])
    return repo, entries[1]["sparse_files"][0]


def _launch(tmp_path, store_dir, *extra):
    ports = free_ports(3)
    repo, missing = _repo(tmp_path)
    log = open(tmp_path / "launcher.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "triton_rec.runtime", "serve", "--model-repository", str(repo)]
        + [f"--http-port={ports[0]}", f"--grpc-port={ports[1]}", f"--metrics-port={ports[2]}"]
        + list(extra),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TRITON_REC_STORE": str(store_dir)},
        start_new_session=True,
    )
    srv = TritonServer(repo, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2])
    return proc, srv, log, repo, missing


def _output(tmp_path) -> str:
    return (tmp_path / "launcher.log").read_text(errors="replace")


def _infer_exact(srv, model) -> bool:
    from clients.raw_http import Client

    keys = table_keys(SEED, 0, TABLES[0].rows)[:6]
    c = Client(srv.http_url)
    try:
        out = c.infer(
            model, {"KEYS": keys[None, :], "NUMKEYS": np.array([[6]], np.int32)}, ["OUTPUT0"]
        )["OUTPUT0"]
    finally:
        c.close()
    return np.array_equal(out.reshape(-1), expected_vectors(SEED, 0, keys, 8).reshape(-1))


def _model_ready(srv, model) -> bool:
    try:
        with urllib.request.urlopen(f"http://{srv.http_url}/v2/models/{model}/ready", timeout=5):
            return True
    except OSError:
        return False


def _stop(proc, log):
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    log.close()


def test_one_broken_model_does_not_keep_the_others_from_serving(tmp_path, store_dir):
    proc, srv, log, repo, missing = _launch(tmp_path, store_dir)
    try:
        deadline = time.monotonic() + 120
        while "triton-rec: serving" not in _output(tmp_path):
            assert proc.poll() is None, _output(tmp_path)[-3000:]
            assert time.monotonic() < deadline, _output(tmp_path)[-3000:]
            time.sleep(0.2)
        time.sleep(0.5)  # the report's FAILED lines follow the first
        out = _output(tmp_path)
        # the node serves: ready, the good model exact, the broken one named with its file
        assert srv.is_ready()
        assert _infer_exact(srv, "hps_good")
        assert not _model_ready(srv, "hps_broken")
        failed = [line for line in out.splitlines() if "FAILED hps_broken" in line]
        assert failed and os.path.basename(missing) in failed[0], out[-3000:]
        assert [m["name"] for m in srv.failed_models()] == ["hps_broken"]
        # fixed on disk, loaded through the repository API: no restart
        write_model(str(repo), "hps_broken", TABLES, seed=SEED)
        req = urllib.request.Request(
            f"http://{srv.http_url}/v2/repository/models/hps_broken/load", data=b"", method="POST"
        )
        urllib.request.urlopen(req, timeout=120).close()
        assert _model_ready(srv, "hps_broken") and _infer_exact(srv, "hps_broken")
        assert srv.failed_models() == []
    finally:
        _stop(proc, log)


def test_strict_startup_keeps_fail_fast(tmp_path, store_dir):
    proc, srv, log, _, missing = _launch(tmp_path, store_dir, "--strict-startup")
    try:
        assert proc.wait(120) != 0
        out = _output(tmp_path)
        assert "failed to load" in out and os.path.basename(missing) in out, out[-3000:]
    finally:
        _stop(proc, log)


@pytest.mark.parametrize("strict", [False, True])
def test_the_server_command_follows_the_startup_mode(tmp_path, strict):
    cmd = TritonServer(tmp_path, strict_startup=strict).command()
    assert ("--exit-on-error=false" in cmd) is not strict


# -- the drained stop under load ---------------------------------------------------------

#: Runs per request path of the stop test (issue 24 asks for 20 each: TREC_STOP_RUNS=20).
STOP_RUNS = int(os.environ.get("TREC_STOP_RUNS", "2"))
#: Requests sent this long before the SIGTERM must be answered (the drain begins when the
#: launcher receives the signal; a request sent just before may reach a model after it:
#: on 2 busy cores, one sent 50 ms before was once still unread by the server).
ACCEPTED_MARGIN_S = 0.25
OK, REFUSED, CONNECTION, OTHER = "ok", "refused (retryable)", "connection closed", "other"


class _StopLoad(threading.Thread):
    """One client (HTTP keep-alive or gRPC) sending requests back to back until the server
    is gone; records (sent, outcome) and checks every answer."""

    def __init__(self, srv, protocol, seed):
        super().__init__(daemon=True)
        self.srv, self.protocol = srv, protocol
        self.rng = np.random.default_rng(seed)
        self.keys = table_keys(SEED, 0, TABLES[0].rows)
        self.results, self.wrong, self.messages = [], 0, {}
        self.done = threading.Event()

    def _one(self, client, keys):
        nk = np.array([[keys.shape[1]]], np.int32)
        if self.protocol == "http":
            from clients.raw_http import InferError

            try:
                return OK, client.infer("hps_good", {"KEYS": keys, "NUMKEYS": nk})["OUTPUT0"]
            except InferError as e:
                return (REFUSED if e.status == 503 else OTHER), e.message
        import tritonclient.grpc as tc
        from tritonclient.utils import InferenceServerException

        ins = [
            tc.InferInput("KEYS", list(keys.shape), "INT64"),
            tc.InferInput("NUMKEYS", [1, 1], "INT32"),
        ]
        ins[0].set_data_from_numpy(keys)
        ins[1].set_data_from_numpy(nk)
        try:
            return OK, client.infer("hps_good", ins, client_timeout=20).as_numpy("OUTPUT0")
        except InferenceServerException as e:
            status = str(e.status())
            if "UNAVAILABLE" in status:  # refused by a model, or the connection is gone
                return (REFUSED if "stopping" in str(e) else CONNECTION), str(e)[:200]
            return OTHER, f"{status}: {str(e)[:200]}"

    def run(self):
        from clients.raw_http import Client

        deadline = time.monotonic() + 60
        client = None
        while not self.done.is_set() and time.monotonic() < deadline:
            if client is None:
                if self.protocol == "http":
                    client = Client(self.srv.http_url, timeout=20)
                else:
                    import tritonclient.grpc as tc

                    client = tc.InferenceServerClient(self.srv.grpc_url)
            keys = self.keys[self.rng.integers(0, len(self.keys), size=(1, 6))]
            sent = time.monotonic()
            try:
                outcome, out = self._one(client, keys)
            except (OSError, ConnectionError, http.client.HTTPException) as e:
                outcome, out = CONNECTION, repr(e)[:200]
                client.close()
                client = None
                time.sleep(0.005)
            self.results.append((sent, outcome))
            if outcome == OK:
                want = expected_vectors(SEED, 0, keys.reshape(-1), TABLES[0].vec_size)
                self.wrong += not np.array_equal(out.reshape(-1), want.reshape(-1))
            else:
                key = (outcome, out)
                self.messages[key] = self.messages.get(key, 0) + 1
                if outcome == CONNECTION and self.protocol == "grpc":
                    time.sleep(0.005)
        if client is not None:
            client.close()


def _new_shm(before, store_dir):
    """What this server left in /dev/shm: its Python-backend stubs' regions (backend
    ``hps``) and its store's namespace directory (other test sessions may run beside)."""
    from triton_rec.cache.shm_security import NAMESPACE_DIR_PREFIX, NAMESPACE_FILE

    token_file = Path(store_dir) / NAMESPACE_FILE
    ours = NAMESPACE_DIR_PREFIX + token_file.read_text().strip() if token_file.exists() else None
    return sorted(
        e
        for e in set(os.listdir("/dev/shm")) - before
        if e.startswith("triton_hps_backend_shm_region_") or e == ours
    )


@pytest.mark.parametrize("run", range(STOP_RUNS))
@pytest.mark.parametrize("path", ["native", "python"])
def test_sigterm_under_load_answers_what_it_accepted_and_exits_cleanly(
    tmp_path, store_dir, path, run
):
    shm_before = set(os.listdir("/dev/shm"))
    proc, srv, log, _, _ = _launch(tmp_path, store_dir, f"--request-path={path}")
    loads = []
    try:
        deadline = time.monotonic() + 120
        while not _model_ready(srv, "hps_good"):
            assert proc.poll() is None and time.monotonic() < deadline, _output(tmp_path)[-3000:]
            time.sleep(0.2)
        loads = [_StopLoad(srv, proto, seed) for seed, proto in enumerate(["http", "grpc"] * 8)]
        for t in loads:
            t.start()
        time.sleep(1.5)
        told = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        # A stop held up (by HTTP connections left open, by requests still in a model)
        # runs out tritonserver's exit timeout: it logs "Exit timeout expired" and exits
        # with status 1, both checked below, and the launcher kills what is left
        # EXIT_TIMEOUT_S + 20 s after the signal (status 137). No bound on how long the
        # stop takes: this wait only catches a launcher that hangs.
        code = proc.wait(EXIT_TIMEOUT_S + 90)
        for t in loads:
            t.done.set()
        for t in loads:
            t.join(30)
        out = _output(tmp_path)
        assert code == 0, out[-3000:]
        assert "Signal (11)" not in out and "Exit timeout expired" not in out, out[-3000:]
        results = [r for t in loads for r in t.results]
        before = [o for sent, o in results if sent < told - ACCEPTED_MARGIN_S]
        after = [o for sent, o in results if sent >= told - ACCEPTED_MARGIN_S]
        messages = {m: n for t in loads for m, n in t.messages.items()}
        assert len(before) > 100 and set(before) == {OK}, (
            {o: before.count(o) for o in set(before)},
            messages,
        )
        assert OTHER not in after, [(m, n) for (o, m), n in messages.items() if o == OTHER]
        assert sum(t.wrong for t in loads) == 0
        assert _new_shm(shm_before, store_dir) == [], _new_shm(shm_before, store_dir)
    finally:
        for t in loads:
            t.done.set()
        _stop(proc, log)


# -- reloads ----------------------------------------------------------------------------


def test_a_failed_reload_cycle_stops_the_benchmarks_load(monkeypatch):
    """bench_reload's background load stops when a cycle fails (once a server died under
    the cycles and the load ran on against it for the rest of the suite: a request a
    millisecond, each failure kept, the test process at 14 GB)."""
    from tests.benchmark_scripts import load_benchmark

    bench = load_benchmark("bench_reload")

    def failing_cycle(*_args):
        raise RuntimeError("a cycle failed")

    monkeypatch.setattr(bench, "cycle", failing_cycle)
    with pytest.raises(RuntimeError, match="a cycle failed"):
        bench.main(["--cycles", "1"])
    assert not [t for t in threading.enumerate() if isinstance(t, bench.ServeLoad) and t.is_alive()]


def test_reloads_do_not_grow_the_server(tmp_path):
    """benchmarks/bench_reload.py on the demo repository, shortened to the quicker model:
    1,000 unload/load cycles of dlrm (each load once the unload finished) while hps_wdl
    serves, measured after 300; tritonserver's anonymous memory stays flat (with glibc's
    allocator it grew ~27 kB a cycle; issue 24's target is < 1 MB per 1,000 cycles of
    hps_demo and dlrm, measured by the benchmark itself:
    benchmarks/history/2026-11-28-reload-cycles.md) and every hps_wdl answer is right."""
    from tests.benchmark_scripts import load_benchmark

    bench = load_benchmark("bench_reload")
    out = tmp_path / "reload.json"
    # the floor model's cycles, a baseline this test does not assert on, kept short (each
    # cycle leaves its load bench.SETTLE_S before unloading: Triton's own race otherwise,
    # benchmarks/history/2026-11-28-reload-cycles.md)
    args = ["--cycle", "dlrm", "--cycles", "1000", "--warmup", "300", "--every", "25"]
    args += ["--floor-cycles", "100"]
    assert bench.main([*args, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["served"]["errors"] == [] and report["served"]["answered"] > 0
    # jemalloc settles in steps over the first ~500 cycles (+4.4 MB, bounded: flat after;
    # 0.9 kB a cycle from 300 to 1,000 measured) and its samples scatter by ~0.3 MB. A leak
    # is linear: the metric wrappers this test was written for gave 25 kB a cycle. Both
    # models' cycles (hps_demo's cache and threads too) settle in larger, later steps
    # (+2.5 MB at cycle 50 to 250, samples scattering by ~1 MB), too late and too noisy
    # for a run of a minute to tell from a leak: the benchmark measures them.
    assert report["models"]["slope_kb_per_cycle"] < 15, report["models"]


def test_the_server_allocator_follows_the_environment(monkeypatch):
    from triton_rec.errors import TritonRecError
    from triton_rec.triton.runtime import MALLOC_ENV, server_allocator

    assert server_allocator({MALLOC_ENV: "system"}) == ""
    with pytest.raises(ValueError, match=MALLOC_ENV):
        server_allocator({MALLOC_ENV: "tcmalloc"})
    found = server_allocator({})
    if found:  # installed (make installs libjemalloc2): preloaded by default
        assert found.endswith("libjemalloc.so.2") and os.path.exists(found)
        env = TritonServer(".", env={}).environment()
        assert found in env["LD_PRELOAD"].split()
    else:
        with pytest.raises(TritonRecError, match="libjemalloc2"):
            server_allocator({MALLOC_ENV: "jemalloc"})


def test_the_jemalloc_settings_follow_its_version(tmp_path):
    from triton_rec.triton.runtime import (
        JEMALLOC_CONF,
        JEMALLOC_CONF_5_3,
        jemalloc_conf,
        jemalloc_version,
    )

    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"\0ELF..." + b"5.2.1-0-g" + b"ab12" * 10 + b"\0more")
    assert jemalloc_version(str(lib)) == (5, 2)
    lib.write_bytes(b"\0" + b"5.3.0-0-g" + b"54eaed1d" * 5 + b"\0")
    assert jemalloc_version(str(lib)) == (5, 3)
    lib.write_bytes(b"5.3.0 but no commit")
    assert jemalloc_version(str(lib)) == (0, 0)
    assert jemalloc_version(str(tmp_path / "absent.so")) == (0, 0)
    # 5.2 does not know the 5.3 setting (it would warn at every start)
    assert jemalloc_conf((5, 2), cpus=3) == f"{JEMALLOC_CONF},narenas:3"
    assert jemalloc_conf((5, 3), cpus=16) == f"{JEMALLOC_CONF},narenas:16,{JEMALLOC_CONF_5_3}"
    assert jemalloc_conf((6, 0), cpus=1).endswith(JEMALLOC_CONF_5_3)


def test_the_server_runs_with_settings_its_jemalloc_accepts(server):
    """tritonserver runs with the launcher's MALLOC_CONF for the installed jemalloc, and
    jemalloc takes every setting of it: it names each one it does not know on stderr
    ('<jemalloc>: Invalid conf pair: ...'), which the server's log receives."""
    from triton_rec.triton.runtime import jemalloc_conf, jemalloc_version, server_allocator

    environ = dict(
        e.split("=", 1)
        for e in Path(f"/proc/{server.process.pid}/environ").read_text().split("\0")
        if "=" in e
    )
    found = server_allocator({})
    if found:
        assert found in environ.get("LD_PRELOAD", "").split(), environ.get("LD_PRELOAD")
        assert environ.get("MALLOC_CONF") == jemalloc_conf(jemalloc_version(found))
    else:  # glibc's malloc: nothing preloaded, nothing set
        assert "MALLOC_CONF" not in environ and "jemalloc" not in environ.get("LD_PRELOAD", "")
    log = server.log_path.read_text(errors="replace")
    assert "<jemalloc>" not in log, [line for line in log.splitlines() if "<jemalloc>" in line]


def test_concurrent_oversized_requests_are_refused_and_the_server_stays_up():
    """benchmarks/bench_big_requests.py, smaller: 4 requests of 40 MB at once on gRPC and
    HTTP are each refused naming KEYS, the server stays ready, a good request is answered
    (the 400 MB figures: benchmarks/history/2026-11-26-stop-start-reload.md)."""
    from tests.benchmark_scripts import load_benchmark

    bench = load_benchmark("bench_big_requests")
    assert bench.main(["--mb", "40", "--concurrent", "4", "--settle", "0"]) == 0
