"""End to end: a dead instance process is replaced (triton_rec.triton.supervisor), and the
launcher (`python -m triton_rec.runtime serve`, i.e. `make serve`) stops cleanly.

Triton's Python backend never replaces a dead instance itself: requests routed to it
fail after about a second each, for good, while the model stays READY.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.e2e.conftest import hps_config, make_client
from tests.e2e.test_instance_lifecycle import NO_ORPHAN_S, remove_server_shm
from triton_rec.triton.runtime import REQUEST_PATHS, TritonServer, free_ports
from triton_rec.util.procfs import children, cmdline, group_members

SEED = 47
TABLES = [SyntheticTable("t", rows=4000, vec_size=8, max_keys_per_sample=4)]
#: Seconds after the kill by which requests must stop failing.
HEAL_S = 10.0


def _repo(tmp_path):
    repo = tmp_path / "repo"
    entries = []
    for name, count in (("hps_heal", 2), ("hps_other", 1)):
        entry = write_model(str(repo), name, TABLES, seed=SEED)
        # Misses always fetched (HPS answers misses with the default value when the hit rate
        # of a batch is >= the threshold): every answer must then be exact.
        entries.append(dict(entry, hit_rate_threshold=1.0))
        (repo / name / "config.pbtxt").write_text(hps_config(name, count))
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": entries}))
    return repo


class Load(threading.Thread):
    """Sends requests for one model until stopped; records (time, ok) and checks every
    answer against the generator's vectors."""

    def __init__(self, srv, model, seed):
        super().__init__(daemon=True)
        self.srv, self.model, self.rng = srv, model, np.random.default_rng(seed)
        self.keys = table_keys(SEED, 0, TABLES[0].rows)
        self.stop = threading.Event()
        self.results = []  # (monotonic time the request was sent, ok)
        self.wrong = 0
        self.wrong_at = []
        self.errors = {}  # message -> count

    def run(self):
        import tritonclient.grpc as tc

        vec = TABLES[0].vec_size
        with make_client(self.srv, "grpc") as client:
            while not self.stop.is_set():
                keys = self.keys[self.rng.integers(0, len(self.keys), size=(1, 8))]
                ins = [
                    tc.InferInput("KEYS", list(keys.shape), "INT64"),
                    tc.InferInput("NUMKEYS", [1, 1], "INT32"),
                ]
                ins[0].set_data_from_numpy(keys)
                ins[1].set_data_from_numpy(np.array([[keys.shape[1]]], np.int32))
                sent = time.monotonic()
                try:
                    out = client.infer(self.model, ins, client_timeout=5).as_numpy("OUTPUT0")
                except Exception as e:
                    msg = str(e)[:200]
                    self.errors[msg] = self.errors.get(msg, 0) + 1
                    self.results.append((sent, False))
                    time.sleep(0.01)
                    continue
                want = expected_vectors(SEED, 0, keys.reshape(-1), vec)
                if not np.array_equal(out.reshape(-1), want.reshape(-1)):
                    self.wrong += 1
                    bad = np.flatnonzero((out.reshape(want.shape) != want).any(axis=1))
                    self.wrong_at.append(
                        (
                            sent,
                            keys.reshape(-1)[bad].tolist(),
                            out.reshape(want.shape)[bad].tolist(),
                            want[bad].tolist(),
                        )
                    )
                self.results.append((sent, True))


def _model_ready(srv, model) -> bool:
    try:
        with urllib.request.urlopen(
            f"http://{srv.http_url}/v2/models/{model}/ready", timeout=2
        ) as r:
            return r.status == 200
    except OSError:
        return False


def test_a_killed_instance_is_replaced_under_load(tmp_path, store_dir):
    lines = []
    srv = TritonServer(
        _repo(tmp_path),
        log_path=tmp_path / "server.log",
        supervise=True,
        supervisor_log=lines.append,
        env={"TRITON_REC_STORE": str(store_dir)},
        request_path="python",  # instance processes to kill and replace
        # its stop waits out the exit timeout (30 s by default) for the killed instance's
        # leftovers: what is checked is the serving around the kill, not that wait
        exit_timeout_s=5,
    )
    shm_before = set(os.listdir("/dev/shm"))
    srv.start()
    loads = [Load(srv, "hps_heal", 1), Load(srv, "hps_heal", 2), Load(srv, "hps_other", 3)]
    try:
        for t in loads:
            t.start()
        time.sleep(2.0)
        victim = srv.backend_pids("hps_heal")[0]
        assert len(srv.backend_pids("hps_heal")) == 2 and len(srv.backend_pids("hps_other")) == 1
        others = srv.backend_pids("hps_other")
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        not_ready_seen = False
        while time.monotonic() < killed + HEAL_S + 5.0:
            not_ready_seen |= not _model_ready(srv, "hps_heal")
            time.sleep(0.05)
    except BaseException:  # the server must not outlive a failure here either
        for t in loads:
            t.stop.set()
        srv.stop()
        remove_server_shm(shm_before)
        raise
    finally:
        for t in loads:
            t.stop.set()
        for t in loads:
            t.join(15)
    try:
        heal = [r for t in loads[:2] for r in t.results]
        failed = [ts - killed for ts, ok in heal if not ok]
        print(
            f"supervision: {len(failed)} of {len(heal)} hps_heal requests failed, the last sent "
            f"{max(failed, default=0):.1f} s after the kill; supervisor: {lines}"
        )
        late_failures = [
            round(ts - killed, 2) for ts, ok in heal if not ok and ts > killed + HEAL_S
        ]
        assert not late_failures, (
            f"{len(late_failures)} requests sent {late_failures[:3]}.. s after the kill "
            f"failed: {[t.errors for t in loads]}; supervisor: {lines}"
        )
        assert sum(ok for ts, ok in heal if ts > killed + HEAL_S) > 20, (
            "no answers after the replacement"
        )
        assert all(t.wrong == 0 for t in loads), [
            [(round(w[0] - killed, 2),) + w[1:] for w in t.wrong_at] for t in loads
        ]
        other = loads[2].results
        assert other and all(ok for _, ok in other), "the other model failed"
        assert srv.backend_pids("hps_other") == others, "the other model was touched"
        assert len(srv.backend_pids("hps_heal")) == 2
        assert victim not in srv.backend_pids("hps_heal")
        assert not_ready_seen, "hps_heal never reported not ready while an instance was missing"
        assert any("hps_heal" in line and "1 of 2" in line for line in lines), lines
        assert srv.supervisor.replacements == {"hps_heal": 1}
    finally:
        srv.stop()
        remove_server_shm(shm_before)


def _launcher(tmp_path, store_dir, path="python"):
    ports = free_ports(3)
    log = open(tmp_path / "launcher.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "triton_rec.runtime",
            "serve",
            "--model-repository",
            str(_repo(tmp_path)),
            "--http-port",
            str(ports[0]),
            "--grpc-port",
            str(ports[1]),
            "--metrics-port",
            str(ports[2]),
            f"--request-path={path}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TRITON_REC_STORE": str(store_dir)},
        start_new_session=True,
    )
    srv = TritonServer(tmp_path, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2])
    deadline = time.monotonic() + 120
    while not srv.is_ready():
        assert proc.poll() is None and time.monotonic() < deadline, (
            tmp_path / "launcher.log"
        ).read_text()
        time.sleep(0.2)
    server_pid = [p for p in children(proc.pid) if (cmdline(p) or [""])[0].endswith("tritonserver")]
    assert len(server_pid) == 1
    return proc, server_pid[0], log


def _assert_all_gone(proc, server_pid, timeout):
    deadline = time.monotonic() + timeout
    while (proc.poll() is None or group_members(server_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is not None, "the launcher did not exit"
    assert not group_members(server_pid), f"left behind: {group_members(server_pid)}"


@pytest.mark.parametrize("path", REQUEST_PATHS)
def test_the_launcher_stops_everything_on_ctrl_c(tmp_path, store_dir, path):
    shm_before = set(os.listdir("/dev/shm"))
    proc, server_pid, log = _launcher(tmp_path, store_dir, path)
    try:
        # tritonserver and three instance processes; native: the server alone
        assert len(group_members(server_pid)) == (4 if path == "python" else 1)
        os.kill(proc.pid, signal.SIGINT)  # what Ctrl-C sends to the foreground process
        _assert_all_gone(proc, server_pid, 30)
        assert proc.returncode == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        remove_server_shm(shm_before)


def test_no_orphans_when_the_launcher_is_killed(tmp_path, store_dir):
    shm_before = set(os.listdir("/dev/shm"))
    proc, server_pid, log = _launcher(tmp_path, store_dir)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # tritonserver gets SIGTERM (parent-death signal), stops within its exit timeout.
        _assert_all_gone(proc, server_pid, 10 + NO_ORPHAN_S)
    finally:
        try:
            os.killpg(server_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
        remove_server_shm(shm_before)
