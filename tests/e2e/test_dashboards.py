"""Every metric the shipped dashboard (deploy/grafana/triton-rec.json) and alert rules
(deploy/prometheus/alerts.yml) name is one a real server exports.

A tritonserver on the demo repository (the native request path, the default, which
exports ``trec_python_calls_total``) answers a few requests, good and malformed, so every
series exists; its ``/metrics`` is scraped until each name the dashboard and the rules
use is there, or a minute has passed (publication is asynchronous: the instances' metrics
threads). A name no series carries fails the test, naming where it is used.
"""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest

from tests.e2e.conftest import DEMO_REPO, infer_raw
from tests.promql import exported, is_exported, referenced_metrics
from triton_rec.storage.node_store import STORE_ENV
from triton_rec.triton.runtime import TritonServer

SCRAPE_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def native_demo_server(tmp_path_factory, nothing_left_in_dev_shm):
    if not (DEMO_REPO / "hps_demo" / "1" / "hps_demo0_sparse_0.model" / "key").exists():
        pytest.fail("the demo repository is missing: run `make demo`")
    logs = tmp_path_factory.mktemp("dashboard-logs")
    env = {STORE_ENV: str(tmp_path_factory.mktemp("dashboard-store"))}
    with TritonServer(
        DEMO_REPO, log_path=logs / "server.log", env=env, request_path="native"
    ) as srv:
        yield srv


def test_every_metric_of_the_dashboard_and_the_alerts_is_exported(native_demo_server):
    srv = native_demo_server
    keys = np.array([[11, 12, 13, 14, 15]], np.int64)
    counts = np.array([[4, 1]], np.int32)
    for _ in range(3):
        infer_raw(srv, "http", "hps_demo", [("KEYS", keys, "INT64"), ("NUMKEYS", counts, "INT32")])
    with pytest.raises(Exception, match="NUMKEYS has 1 counts"):  # a rejected request
        infer_raw(
            srv,
            "http",
            "hps_demo",
            [("KEYS", keys, "INT64"), ("NUMKEYS", np.array([[5]], np.int32), "INT32")],
        )
    wanted = referenced_metrics()
    assert wanted, "no metric found in the dashboard and the rules"
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    while True:
        with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
            samples, families = exported(r.read().decode())
        missing = {n: w for n, w in wanted.items() if not is_exported(n, samples, families)}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, {n: sorted(w) for n, w in missing.items()}
