"""End to end: an instance process never outlives its server, even when the server
dies (SIGKILL) while the instance is publishing metrics, stops with a client still
connected, has a dead sibling instance, or exits because a model failed to load.

How the instance processes of a server are found: the server is started in its own
session (TritonServer), so its process group id is its pid, and the Python-backend stubs
it forks inherit that group; once the server has exited, every live (non-zombie)
member of that group is an orphan (:func:`triton_rec.util.procfs.group_members`).

In Triton's Python-backend stub, a metric call waits for the server's answer while
holding the stub's IPC mutex (and, for Metric.set, the GIL); the stub's own exit path
needs that mutex, so a call in flight when the server dies used to leave the instance
process alive for good, with its memory and cache attachment. The native parent
watchdog (triton_rec.triton.instance.prepare_process) ends such an orphan after
ORPHAN_GRACE_S. Publishing every millisecond under load keeps a call in flight most of
the time, so without the watchdog this test fails most of the time.
"""

from __future__ import annotations

# These tests are about Triton's Python backend, whose instances are processes: they run
# on that request path (the native backend's instances are threads of the server).
import contextlib
import json
import os
import signal
import threading
import time

import numpy as np

from ps_loader.synthetic import SyntheticTable, table_keys, write_model
from tests.e2e.conftest import hps_config, make_client
from triton_rec.triton.instance import ORPHAN_GRACE_S
from triton_rec.triton.runtime import TritonServer
from triton_rec.util.procfs import group_members, is_gone

SEED = 31
TABLES = [SyntheticTable("t", rows=5000, vec_size=8, max_keys_per_sample=4)]


#: Seconds after the server's exit by which no instance process of it may remain.
NO_ORPHAN_S = 10.0
#: the exit timeout of the servers whose stop waits it out (an idle keep-alive connection, a
#: dead instance's model): what these tests check is what is left once the server exits,
#: not how long Triton waits (30 s by default: EXIT_TIMEOUT_S)
QUICK_EXIT_S = 5


def assert_no_orphans(pgid: int, exited_at: float) -> None:
    """Within NO_ORPHAN_S of ``exited_at`` (monotonic) no process of the group remains."""
    deadline = exited_at + NO_ORPHAN_S
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = group_members(pgid)
    assert not left, f"processes {left} of the server's group outlived it by {NO_ORPHAN_S:g} s"


#: Models of the servers these tests kill (their cache segments are removed afterwards).
KILLED_MODELS = ("hps_life", "hps_heal", "hps_other")


def remove_server_shm(before) -> None:
    # A tritonserver that did not finalize an instance cannot unlink the shared-memory
    # region it made for it, and an instance that was killed or _exited by its watchdog
    # does not detach from its cache segment (the next load from the same store reclaims
    # it as stale); remove both as a supervisor would.
    for entry in set(os.listdir("/dev/shm")) - before:
        if entry.startswith("triton_") and "_shm_region_" in entry:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", entry))
    for entry in os.listdir("/dev/shm"):
        if not entry.startswith("trec-ns-"):
            continue
        ns = os.path.join("/dev/shm", entry)
        with contextlib.suppress(OSError):
            for seg in os.listdir(ns):
                if seg.startswith(tuple(f"trec_{m}." for m in KILLED_MODELS)):
                    os.unlink(os.path.join(ns, seg))
            os.rmdir(ns)  # only when empty: another server's live segments stay


def life_repo(tmp_path, count=2, interval="0.001", broken=False):
    """hps_life (``count`` instances publishing metrics every ``interval`` s) and, with
    ``broken``, a model whose table file is missing."""
    repo = tmp_path / "repo"
    entry = write_model(str(repo), "hps_life", TABLES, seed=SEED)
    models = [entry]
    (repo / "hps_life" / "config.pbtxt").write_text(
        hps_config(
            "hps_life",
            count,
            extra=f'parameters {{ key: "metrics_interval" '
            f'value: {{ string_value: "{interval}" }} }}',
        )
    )
    if broken:
        bad = write_model(str(repo), "hps_broken", TABLES, seed=SEED)
        bad["sparse_files"] = ["nowhere/t_sparse_0.model"]
        models.append(bad)
        (repo / "hps_broken" / "config.pbtxt").write_text(hps_config("hps_broken", 1))
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": models}))
    return repo


def _infer_some(srv, n=50):
    import tritonclient.http as tc

    keys = table_keys(SEED, 0, TABLES[0].rows)[:8][None, :]
    with make_client(srv, "http") as client:
        for _ in range(n):
            ins = [
                tc.InferInput("KEYS", list(keys.shape), "INT64"),
                tc.InferInput("NUMKEYS", [1, 1], "INT32"),
            ]
            ins[0].set_data_from_numpy(keys)
            ins[1].set_data_from_numpy(np.array([[keys.shape[1]]], np.int32))
            client.infer("hps_life", ins)


class GrpcLoad:
    """A client thread sending requests over gRPC until stopped, errors ignored (after
    SIGINT, Triton stops HTTP first and keeps serving gRPC until its exit timeout, so
    the instances stay busy, publishing metrics, while the server goes away)."""

    def __init__(self, srv):
        self.srv, self.stop, self.answers = srv, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import tritonclient.grpc as tc

        keys = table_keys(SEED, 0, TABLES[0].rows)[:8][None, :]
        with make_client(self.srv, "grpc") as client:
            while not self.stop.is_set():
                ins = [
                    tc.InferInput("KEYS", list(keys.shape), "INT64"),
                    tc.InferInput("NUMKEYS", [1, 1], "INT32"),
                ]
                ins[0].set_data_from_numpy(keys)
                ins[1].set_data_from_numpy(np.array([[keys.shape[1]]], np.int32))
                try:
                    client.infer("hps_life", ins, client_timeout=5)
                    self.answers += 1
                except Exception:
                    time.sleep(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


def _interrupt_and_wait(srv, timeout=60.0) -> float:
    """SIGINT the server (a graceful stop), wait for its exit; returns when it exited."""
    srv.process.send_signal(signal.SIGINT)
    srv.process.wait(timeout)
    return time.monotonic()


def test_no_orphans_after_sigint_with_an_idle_keep_alive_client(tmp_path, store_dir):
    import socket

    srv = TritonServer(
        life_repo(tmp_path),
        log_path=tmp_path / "server.log",
        env={"TRITON_REC_STORE": str(store_dir)},
        request_path="python",
        exit_timeout_s=QUICK_EXIT_S,
    )
    shm_before = set(os.listdir("/dev/shm"))
    srv.start()
    try:
        _infer_some(srv)
        assert len(srv.backend_pids("hps_life")) == 2
        # An idle HTTP/1.1 keep-alive connection: the server waits its exit timeout for it.
        conn = socket.create_connection(("127.0.0.1", srv.http_port))
        conn.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        assert b"200" in conn.recv(4096)
        try:
            with GrpcLoad(srv):
                time.sleep(1.0)
                exited = _interrupt_and_wait(srv)
            assert_no_orphans(srv.process.pid, exited)
        finally:
            conn.close()
    finally:
        srv.stop()
        remove_server_shm(shm_before)


def test_no_orphans_after_a_sibling_instance_died(tmp_path, store_dir):
    srv = TritonServer(
        life_repo(tmp_path),
        log_path=tmp_path / "server.log",
        env={"TRITON_REC_STORE": str(store_dir)},
        request_path="python",
        exit_timeout_s=QUICK_EXIT_S,
    )
    shm_before = set(os.listdir("/dev/shm"))
    srv.start()
    try:
        _infer_some(srv)
        pids = srv.backend_pids("hps_life")
        assert len(pids) == 2
        with GrpcLoad(srv):
            time.sleep(1.0)
            os.kill(pids[0], signal.SIGKILL)
            time.sleep(1.0)
            exited = _interrupt_and_wait(srv)
        assert_no_orphans(srv.process.pid, exited)
    finally:
        srv.stop()
        remove_server_shm(shm_before)


def test_no_orphans_after_a_failed_start_up(tmp_path, store_dir):
    # strict start-up: the server exits when a model fails (the default serves the others,
    # tests/e2e/test_lifecycle.py)
    srv = TritonServer(
        life_repo(tmp_path, broken=True),
        log_path=tmp_path / "server.log",
        env={"TRITON_REC_STORE": str(store_dir)},
        request_path="python",
        strict_startup=True,
    )
    shm_before = set(os.listdir("/dev/shm"))
    try:
        try:
            srv.start()
        except RuntimeError as e:  # the server exited: hps_broken failed to load
            assert "hps_broken" in str(e) or "exited" in str(e)
        else:
            raise AssertionError("the server started although hps_broken cannot load")
        assert_no_orphans(srv.process.pid, time.monotonic())
    finally:
        srv.stop()
        remove_server_shm(shm_before)


def test_instances_exit_when_the_server_is_killed_mid_publication(tmp_path, store_dir):
    repo = tmp_path / "repo"
    entry = write_model(str(repo), "hps_life", TABLES, seed=SEED)
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": [entry]}))
    (repo / "hps_life" / "config.pbtxt").write_text(
        hps_config(
            "hps_life",
            2,
            extra='parameters { key: "metrics_interval" value: { string_value: "0.001" } }',
        )
    )
    srv = TritonServer(
        repo,
        log_path=tmp_path / "server.log",
        env={"TRITON_REC_STORE": str(store_dir)},
        request_path="python",
    )
    shm_before = set(os.listdir("/dev/shm"))
    srv.start()
    stop = threading.Event()
    keys = table_keys(SEED, 0, TABLES[0].rows)[:8][None, :]

    def load():
        import tritonclient.grpc as tc

        with make_client(srv, "grpc") as client:
            while not stop.is_set():
                ins = [
                    tc.InferInput("KEYS", list(keys.shape), "INT64"),
                    tc.InferInput("NUMKEYS", [1, 1], "INT32"),
                ]
                ins[0].set_data_from_numpy(keys)
                ins[1].set_data_from_numpy(np.array([[keys.shape[1]]], np.int32))
                try:
                    client.infer("hps_life", ins)
                except Exception:  # the server is gone
                    return

    try:
        pids = srv.backend_pids("hps_life")
        assert len(pids) == 2
        loader = threading.Thread(target=load)
        loader.start()
        time.sleep(1.5)  # requests counted, published every millisecond
        os.kill(srv.process.pid, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + ORPHAN_GRACE_S + 5.0
        while not all(is_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in pids if not is_gone(p)]
        assert not alive, (
            f"instance processes {alive} outlived the server by {deadline - killed:.0f} s"
        )
    finally:
        stop.set()
        srv.stop()  # kills what is left of the process group
        # A SIGKILLed tritonserver cannot unlink the shared-memory regions it made for
        # its Python-backend instances, and its _exited instances left their cache
        # segments: remove both as a supervisor would.
        remove_server_shm(shm_before)
