"""The backends' ``execute`` makes no call to the server but returning responses, and
their metrics still get published, by the instance's own thread, within the interval.

``backend/hps/model.py``, ``backend/hugectr/model.py`` and ``backend/dense/model.py`` run
in-process against
:mod:`tests.fake_pb_utils`, which records every custom-metric call (in Triton's stub,
each one is a round trip to the server process) with the thread that made it. The
tables, caches and dense network are the real ones. Metrics reaching Triton's metrics
port is checked end to end in tests/e2e/test_tiers_server.py and test_hps_server.py.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.fake_pb_utils import HPS_INPUTS, HUGECTR_INPUTS, Request, start_instance, triton_config

SEED = 11
TABLES = [SyntheticTable("item", 4000, 8, 2, -1.0), SyntheticTable("user", 1000, 4, 1, 0.5)]


def wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def hps_instance(tmp_path):
    """An initialized ``hps`` instance (cache on) over two synthetic tables."""
    entry = write_model(str(tmp_path), "m", TABLES, seed=SEED)
    entry["hit_rate_threshold"] = 1.5  # every miss answered synchronously: exact answers
    (tmp_path / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": [entry]}))
    pb, model = start_instance(
        tmp_path,
        triton_config(
            "m", "hps", HPS_INPUTS, instances=2, store_dir=tmp_path / "store", metrics_interval=0.05
        ),
    )
    yield pb, model
    model.finalize()


def hps_request(rng, n_item, n_user):
    keys = [
        table_keys(SEED, 0, TABLES[0].rows)[rng.integers(0, TABLES[0].rows, n_item)],
        table_keys(SEED, 1, TABLES[1].rows)[rng.integers(0, TABLES[1].rows, n_user)],
    ]
    req = Request(
        KEYS=np.concatenate(keys)[None, :], NUMKEYS=np.array([[n_item, n_user]], np.int32)
    )
    expected = np.concatenate(
        [expected_vectors(SEED, t, k, TABLES[t].vec_size).reshape(-1) for t, k in enumerate(keys)]
    )
    return req, expected


def test_hps_execute_calls_no_metric_and_the_thread_publishes_within_the_interval(hps_instance):
    pb, model = hps_instance
    rng = np.random.default_rng(0)
    me = threading.get_ident()
    for _ in range(20):
        batch = [hps_request(rng, 6, 3) for _ in range(3)]
        responses = model.execute([r for r, _ in batch])
        for resp, (_, expected) in zip(responses, batch):
            assert not resp.has_error()
            np.testing.assert_array_equal(resp.output("OUTPUT0"), expected)
    assert not [c for c in pb.metric_calls if c[0] == me], "execute called Metric.set/increment"

    # The instance's thread publishes the lookups it counted (20 x 3 x 9 keys).
    def published():
        return (
            sum(
                c[4]
                for c in pb.metric_calls
                if c[1] == "increment" and c[2] == "trec_cache_lookups_total"
            )
            == 20 * 3 * 9
        )

    assert wait_for(published, 5.0), pb.metric_calls[-10:]
    assert all(c[0] != me for c in pb.metric_calls)


def test_an_idle_instance_publishes_nothing(hps_instance):
    pb, model = hps_instance
    model.execute([hps_request(np.random.default_rng(1), 2, 1)[0]])
    assert wait_for(lambda: any(c[2] == "trec_cache_lookups_total" for c in pb.metric_calls), 5.0)
    time.sleep(0.2)  # the cache's own counters settle (background inserts)
    n = len(pb.metric_calls)
    time.sleep(0.3)  # six intervals with nothing new
    assert len(pb.metric_calls) == n, pb.metric_calls[n:]


def test_the_load_log_names_the_thread_setting(hps_instance):
    pb, _ = hps_instance
    lines = [m for _, m in pb.log_lines if "intra_op_threads=" in m]
    assert lines and "2 instances x 1 threads" in lines[0], pb.log_lines


@pytest.fixture(scope="module")
def dlrm_repo(tmp_path_factory):
    """The tiny trained DLRM, exported as the hugectr backend serves it."""
    from examples.dlrm import torch_dlrm as td

    repo = tmp_path_factory.mktemp("dlrm_repo")
    _, entry = td.train_and_export(
        str(repo / "dlrm" / "1"), td.TINY_CONFIG, td.TINY_SETTINGS, ps_root=str(repo), onnx=False
    )
    entry["hit_rate_threshold"] = 1.5  # exact answers: no miss answered with the default
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": [entry]}))
    return repo


def test_hugectr_execute_calls_no_metric_and_predicts(dlrm_repo, tmp_path):
    from examples.dlrm import torch_dlrm as td

    pb, model = start_instance(
        dlrm_repo,
        triton_config(
            "dlrm", "hugectr", HUGECTR_INPUTS, store_dir=tmp_path / "store", metrics_interval=0.05
        ),
    )
    try:
        data = td.HiddenModel(td.TINY_CONFIG, 5).sample(8, np.random.default_rng(2))
        want = td.load_trained(str(dlrm_repo / "dlrm" / "1")).predict(data.dense, data.sparse)
        me = threading.get_ident()
        got = []
        for a in range(0, 8, 2):
            req = data.hugectr_request(a, a + 2)
            resp = model.execute([Request(**{k: v[None, :] for k, v in req.items()})])[0]
            assert not resp.has_error()
            got.append(resp.output("OUTPUT0"))
        np.testing.assert_allclose(np.concatenate(got), np.asarray(want).reshape(-1), atol=1e-5)
        assert not [c for c in pb.metric_calls if c[0] == me], "execute called Metric.set/increment"
        assert wait_for(
            lambda: any(c[2] == "trec_cache_lookups_total" for c in pb.metric_calls), 5.0
        )
    finally:
        model.finalize()


def test_hugectr_answers_with_num_sample_and_device_id_like_hps(dlrm_repo, tmp_path):
    # hugectr_backend src/hugectr.cc L2470-2480 sends NumSample and DeviceID; the 2.51
    # Python backend has no response parameters, so they are the declared INT32 outputs
    from examples.dlrm import torch_dlrm as td

    cfg = triton_config("dlrm", "hugectr", HUGECTR_INPUTS, store_dir=tmp_path / "store")
    cfg["output"] += [
        {"name": "NumSample", "data_type": "TYPE_INT32", "dims": [1]},
        {"name": "DeviceID", "data_type": "TYPE_INT32", "dims": [1]},
    ]
    pb, model = start_instance(dlrm_repo, cfg)
    try:
        data = td.HiddenModel(td.TINY_CONFIG, 5).sample(3, np.random.default_rng(4))
        req = data.hugectr_request(0, 3)
        resp = model.execute([Request(**{k: v[None, :] for k, v in req.items()})])[0]
        assert not resp.has_error()
        assert resp.output("OUTPUT0").shape == (3,)  # upstream's [num_samples]
        assert resp.output("NumSample").tolist() == [3] and resp.output("DeviceID").tolist() == [0]
    finally:
        model.finalize()


def test_a_hugectr_parameter_that_contradicts_the_network_fails_the_load(dlrm_repo, tmp_path):
    cfg = triton_config(
        "dlrm", "hugectr", HUGECTR_INPUTS, store_dir=tmp_path / "store", des_feature_num=999
    )
    with pytest.raises(Exception, match="des_feature_num is 999 but the network's dense input"):
        start_instance(dlrm_repo, cfg)
    # the check runs on the network before any table is opened: this instance's store was
    # never created, so neither was its shared-memory namespace (a machine-wide look at
    # /dev/shm would see the segments of other servers of the suite)
    assert not (tmp_path / "store").exists()


DENSE_INPUTS = (("DES", "TYPE_FP32"), ("EMBEDDINGS", "TYPE_FP32"), ("ROWINDEX", "TYPE_INT32"))


def test_dense_answers_its_predictions_only_and_publishes_its_request_counters(dlrm_repo):
    """The dense step of an hps -> dense ensemble (the network of ps.json's ``dlrm`` entry),
    set up as every backend is (BackendModel: its ps.json entry, instance, response and
    metrics): one-hot slots, so its input is each table's vectors as they are."""
    from triton_rec.config.ps_json import load_ps_config
    from triton_rec.dense.hugectr_network import HugeCTRNetwork

    entry = load_ps_config(str(dlrm_repo / "ps.json")).model("dlrm")
    net = HugeCTRNetwork.load(entry.network_file, entry.dense_file)
    cfg = triton_config("dlrm_dense", "dense", DENSE_INPUTS, ps_model="dlrm", metrics_interval=0.05)
    pb, model = start_instance(dlrm_repo, cfg)
    try:
        rng = np.random.default_rng(5)
        n = 3
        des = rng.standard_normal((n, net.dense_dim)).astype(np.float32)
        embs = [
            rng.standard_normal((n, t.slot_num, t.vec_size)).astype(np.float32) for t in net.tables
        ]
        rows = np.concatenate([np.arange(n * t.slot_num + 1) for t in net.tables]).astype(np.int32)
        req = Request(
            DES=des.reshape(1, -1),
            EMBEDDINGS=np.concatenate([e.reshape(-1) for e in embs])[None, :],
            ROWINDEX=rows[None, :],
        )
        me = threading.get_ident()
        resp = model.execute([req])[0]
        assert not resp.has_error()
        assert [t.name() for t in resp.output_tensors] == ["OUTPUT0"]
        np.testing.assert_allclose(resp.output("OUTPUT0"), net.predict(des, embs).reshape(-1))
        assert not [c for c in pb.metric_calls if c[0] == me], "execute called Metric.set/increment"
        bad = Request(
            DES=des.reshape(1, -1),
            EMBEDDINGS=req.tensors[1].as_numpy()[:, 1:],
            ROWINDEX=rows[None, :],
        )
        assert model.execute([bad])[0].has_error()  # counted as invalid, then published
        assert wait_for(
            lambda: any(c[2] == "trec_requests_rejected_total" for c in pb.metric_calls), 5.0
        )
        assert not any(c[2].startswith("trec_cache") for c in pb.metric_calls), pb.metric_calls
    finally:
        model.finalize()
