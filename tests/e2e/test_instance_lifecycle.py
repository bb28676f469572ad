"""End to end: an instance process never outlives its server, even when the server
dies (SIGKILL) while the instance is publishing metrics.

In Triton's Python-backend stub, a metric call waits for the server's answer while
holding the stub's IPC mutex (and, for Metric.set, the GIL); the stub's own exit path
needs that mutex, so a call in flight when the server dies used to leave the instance
process alive for good, with its memory and cache attachment. The native parent
watchdog (triton_rec.triton_glue.prepare_process) ends such an orphan after
ORPHAN_GRACE_S. Publishing every millisecond under load keeps a call in flight most of
the time, so without the watchdog this test fails most of the time.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np

from ps_loader.synthetic import SyntheticTable, table_keys, write_model
from tests.e2e.conftest import hps_config, make_client
from triton_rec.runtime import TritonServer
from triton_rec.triton_glue import ORPHAN_GRACE_S

SEED = 31
TABLES = [SyntheticTable("t", rows=5000, vec_size=8, max_keys_per_sample=4)]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_instances_exit_when_the_server_is_killed_mid_publication(tmp_path, store_dir):
    repo = tmp_path / "repo"
    entry = write_model(str(repo), "hps_life", TABLES, seed=SEED)
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": [entry]}))
    (repo / "hps_life" / "config.pbtxt").write_text(hps_config(
        "hps_life", 2, extra='parameters { key: "metrics_interval" value: { string_value: "0.001" } }'))
    srv = TritonServer(repo, log_path=tmp_path / "server.log", env={"TRITON_REC_STORE": str(store_dir)})
    shm_before = set(os.listdir("/dev/shm"))
    srv.start()
    stop = threading.Event()
    keys = table_keys(SEED, 0, TABLES[0].rows)[:8][None, :]

    def load():
        import tritonclient.grpc as tc

        with make_client(srv, "grpc") as client:
            while not stop.is_set():
                ins = [tc.InferInput("KEYS", list(keys.shape), "INT64"),
                       tc.InferInput("NUMKEYS", [1, 1], "INT32")]
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
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [p for p in pids if not _gone(p)]
        assert not alive, f"instance processes {alive} outlived the server by {deadline - killed:.0f} s"
    finally:
        stop.set()
        srv.stop()  # kills what is left of the process group
        # A SIGKILLed tritonserver cannot unlink the shared-memory regions it made for
        # its Python-backend instances; remove them as a supervisor would.
        for entry in set(os.listdir("/dev/shm")) - shm_before:
            if entry.startswith("triton_") and "_shm_region_" in entry:
                os.unlink(os.path.join("/dev/shm", entry))
