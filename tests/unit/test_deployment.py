"""open_session: node-local tables and one shared cache per (model, device, table)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from triton_rec.cache.array_cache import CupyUnavailableError
from triton_rec.config.ps_json import parse_ps_config
from triton_rec.serving.deployment import InstanceSpec, cache_capacity, open_session

SEED = 9
TABLES = [
    SyntheticTable("a", rows=3000, vec_size=16, max_keys_per_sample=2, default_value=-1.0),
    SyntheticTable("b", rows=500, vec_size=4, max_keys_per_sample=1, default_value=-2.0),
]


@pytest.fixture
def params(tmp_path):
    def make(**over):
        entry = write_model(
            str(tmp_path / "repo"),
            f"m{abs(hash(repr(sorted(over.items())))) % 10**6}",
            TABLES,
            SEED,
        )
        entry.update({"gpucacheper": 0.5, **over})
        return parse_ps_config(
            {"supportlonglong": True, "models": [entry]}, base_dir=str(tmp_path / "repo")
        ).models[0]

    return make


def _request(session, rng, samples=2):
    keys = [
        rng.choice(table_keys(SEED, t, s.rows), samples * s.max_keys_per_sample)
        for t, s in enumerate(TABLES)
    ]
    counts = np.array([len(k) for k in keys], np.int32)
    return keys, session.parse_request(np.concatenate(keys), counts)


def _truth(keys):
    return np.concatenate(
        [expected_vectors(SEED, t, k, TABLES[t].vec_size).reshape(-1) for t, k in enumerate(keys)]
    )


def test_two_sessions_of_one_model_share_tables_and_caches(params, tmp_path):
    p = params(hit_rate_threshold=0.0)  # misses: default now, inserted in the background
    spec = InstanceSpec(store_dir=str(tmp_path / "store"))
    a, b = open_session(p, spec), open_session(p, spec)
    try:
        assert [t.layout_path for t in a.tables] == [t.layout_path for t in b.tables]
        assert [ct.cache.path for ct in a.cached_tables] == [
            ct.cache.path for ct in b.cached_tables
        ]
        keys, req = _request(a, np.random.default_rng(0))
        first = a.lookup(req)
        assert np.all(first[: len(keys[0]) * 16] == -1.0)  # cold: defaults
        assert a.inserter.drain()
        np.testing.assert_array_equal(b.lookup(req), _truth(keys))  # b hits what a inserted
        assert b.cached_tables[0].stats.snapshot()["hits"] == len(keys[0])
    finally:
        a.close()
        b.close()
    assert not glob.glob(f"/dev/shm/trec_{p.model}.*") + glob.glob(
        f"/dev/shm/trec-ns-*/trec_{p.model}.*"
    )


def test_a_new_table_content_gets_a_new_cache(params, tmp_path):
    spec = InstanceSpec(store_dir=str(tmp_path / "store"))
    p = params()
    s1 = open_session(p, spec)
    try:
        name1 = s1.cached_tables[0].cache.path
    finally:
        s1.close()
    # Rewrite the first table with other content (another seed): another digest, another cache.
    write_model(str(tmp_path / "repo"), p.model, TABLES, seed=SEED + 1)
    s2 = open_session(p, spec)
    try:
        assert s2.cached_tables[0].cache.path != name1
    finally:
        s2.close()


def test_init_ec_alone_leaves_a_dynamic_cache_empty_as_hps_does(params, tmp_path):
    # HPS runs init_ec only with a refresh percentage > 0 (hier_parameter_server.cpp L221-232)
    s = open_session(params(init_ec=True), InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        assert all(ct.cache.size() == 0 for ct in s.cached_tables)
    finally:
        s.close()


def test_init_ec_fills_an_empty_shared_cache(params, tmp_path):
    p = params(init_ec=True, cache_refresh_percentage_per_iteration=0.5)
    s = open_session(p, InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        for t, (ct, spec) in enumerate(zip(s.cached_tables, TABLES)):
            # Set-associative: `capacity` random keys fill most, not all, of the ways.
            assert ct.cache.size() >= 0.8 * min(ct.cache.capacity, spec.rows)
            keys = np.asarray(ct.cache.keys())
            out = np.empty((keys.shape[0], spec.vec_size), np.float32)
            assert ct.cache.query(keys, out, np.zeros(keys.shape[0], np.uint8)) == keys.shape[0]
            np.testing.assert_array_equal(out, expected_vectors(SEED, t, keys, spec.vec_size))
    finally:
        s.close()


def test_gpucache_off_means_no_cache(params, tmp_path):
    s = open_session(params(gpucache=False), InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        assert all(ct.cache is None for ct in s.cached_tables)
        keys, req = _request(s, np.random.default_rng(1))
        np.testing.assert_array_equal(s.lookup(req), _truth(keys))
    finally:
        s.close()


def test_cache_capacity_follows_gpucacheper(params):
    class T:
        num_rows = 1001

    assert cache_capacity(params(gpucacheper=0.1), T) == 101
    assert cache_capacity(params(gpucacheper=0.0), T) == 0


def test_a_gpu_instance_without_cupy_fails_clearly_and_leaves_nothing(params, tmp_path):
    p = params()
    with pytest.raises(CupyUnavailableError, match="(?i)cupy"):
        open_session(p, InstanceSpec(kind="GPU", device_id=0, store_dir=str(tmp_path / "store")))
    assert not [e for e in os.listdir("/dev/shm") if p.model in e]
    assert not glob.glob(f"/dev/shm/trec-ns-*/*{p.model}*")


def test_a_gpu_instance_on_a_device_not_in_deployed_device_list_fails_the_load(params, tmp_path):
    """HPS's rule (hps backend src/model_state.cpp, Create_EmbeddingCache), checked before
    anything is opened: the model and the device named, nothing left behind."""
    from triton_rec.errors import ConfigError

    p = params(deployed_device_list=[1, 3])
    spec = InstanceSpec(kind="GPU", device_id=2, store_dir=str(tmp_path / "store"))
    with pytest.raises(ConfigError) as e:
        open_session(p, spec)
    assert str(e.value) == (
        f"model '{p.model}': Please confirm that device 2 is added to 'deployed_device_list' "
        "in the ps configuration file (it lists [1, 3])"
    )
    assert not os.path.exists(tmp_path / "store")
    # a hugectr model: refused before its network is loaded (this entry has none, which
    # would fail the load otherwise: "names no 'dense_file'")
    from triton_rec.serving.deployment import open_ranking_session

    with pytest.raises(ConfigError, match="device 2 is added to 'deployed_device_list'"):
        open_ranking_session(p, spec, str(tmp_path))
    # a listed device gets past the rule (to the missing CuPy, here), a CPU instance ignores it
    with pytest.raises(CupyUnavailableError):
        open_session(p, dataclasses.replace(spec, device_id=3))
    open_session(p, InstanceSpec(store_dir=str(tmp_path / "store"))).close()


def test_each_device_of_a_model_gets_its_own_cache(params):
    """One cache per (model, device): the names of two GPU instances' caches differ only in
    the device, the instances of one device share theirs."""
    from triton_rec.serving import deployment

    p = params()

    class T:
        path = "/store/layouts/0123456789abcdef0123.tbl"

    tp = p.tables[0]
    name = {
        d: deployment.cache_name(p, InstanceSpec("GPU", d, model_version="1"), tp, T)
        for d in (0, 1)
    }
    assert name[0] != name[1] and name[0].replace(".gpu0.", ".gpu1.") == name[1]
    assert name[1] == deployment.cache_name(p, InstanceSpec("GPU", 1, model_version="1"), tp, T)


def test_a_static_table_caches_every_row_and_never_answers_a_stored_key_with_the_default(
    params, tmp_path
):
    # HPS's static table: sized to the whole table (gpucacheper ignored), warmed at load,
    # hit_rate_threshold ignored (static_table.cpp L28-106, hier_parameter_server.cpp L221-232)
    p = params(embedding_cache_type="static", hit_rate_threshold=0.0, gpucacheper=0.01)
    s = open_session(p, InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        assert s.inserter is None  # every miss fetched: no background inserter thread
        for ct, spec in zip(s.cached_tables, TABLES):
            assert ct.cache.capacity >= spec.rows and ct.inserter is None
            assert ct.cache.size() >= 0.8 * spec.rows  # warmed at load
        rng = np.random.default_rng(3)
        for _ in range(3):
            keys, req = _request(s, rng)
            np.testing.assert_array_equal(s.lookup(req), _truth(keys))
        assert all(ct.stats.snapshot()["default_answered"] == 0 for ct in s.cached_tables)
    finally:
        s.close()


def test_requests_merged_in_one_execute_are_judged_each_by_its_own_hit_rate(params, tmp_path):
    # HPS computes the hit rate per request (embedding_cache.cpp L349-456): a cold request
    # batched with a warm one gets its real vectors, not the defaults
    p = params(hit_rate_threshold=0.5)
    s = open_session(p, InstanceSpec(store_dir=str(tmp_path / "store")))
    try:
        warm_keys, warm = _request(s, np.random.default_rng(1))
        s.lookup(warm)  # 0% hits < 0.5: fetched and cached now
        cold_keys, cold = _request(s, np.random.default_rng(2))
        got_warm, got_cold = s.lookup_many([warm, cold])
        np.testing.assert_array_equal(got_warm, _truth(warm_keys))
        np.testing.assert_array_equal(got_cold, _truth(cold_keys))
    finally:
        s.close()


def test_a_device_cache_is_named_after_the_model_version_and_the_server(params, monkeypatch):
    from triton_rec.serving import deployment

    p = params()

    class T:
        path = "/store/layouts/0123456789abcdef0123.tbl"

    tp = p.tables[0]
    cpu = deployment.cache_name(p, InstanceSpec(model_version="1"), tp, T)
    assert cpu == deployment.cache_name(p, InstanceSpec(model_version="2"), tp, T)
    gpu = {
        v: deployment.cache_name(p, InstanceSpec(kind="GPU", model_version=v), tp, T)
        for v in ("1", "2")
    }
    assert gpu["1"] != gpu["2"] and ".v1.gpu0." in gpu["1"] and ".v2.gpu0." in gpu["2"]
    assert gpu["1"].endswith("." + deployment.server_token())
    monkeypatch.setattr(deployment, "server_token", lambda: "another-server")
    assert deployment.cache_name(p, InstanceSpec(kind="GPU", model_version="1"), tp, T) != gpu["1"]


# ---------------------------------------------------------------- the GPU path, numpy as xp
class NumpyAsDevice:
    """numpy standing in for CuPy as a dense executor's array module (counts its calls)."""

    def __init__(self):
        self.calls: dict = {}

    def __getattr__(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        return getattr(np, name)


class DeviceArray:
    """Stands in for a CuPy array: ``np.asarray`` refuses it (as CuPy does), ``.get()``
    copies it to the host."""

    def __init__(self, a):
        self._a = np.asarray(a)

    def get(self):
        return self._a.copy()

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")


def _small_network(tmp_path, dense_dim=2, vec=4):
    """A HugeCTR network (dense + one 1-slot table -> concat -> 1 output) and its weights."""
    layers = [
        {
            "name": "data",
            "type": "Data",
            "label": {"top": "label", "label_dim": 1},
            "dense": {"top": "dense", "dense_dim": dense_dim},
            "sparse": [{"top": "d0", "type": "DistributedSlot", "slot_num": 1}],
        },
        {
            "name": "emb0",
            "type": "DistributedSlotSparseEmbeddingHash",
            "bottom": "d0",
            "top": "emb0",
            "sparse_embedding_hparam": {"embedding_vec_size": vec, "combiner": "sum"},
        },
        {"name": "r", "type": "Reshape", "bottom": "emb0", "top": "r", "leading_dim": vec},
        {"name": "c", "type": "Concat", "bottom": ["dense", "r"], "top": "c"},
        {
            "name": "fc",
            "type": "InnerProduct",
            "bottom": "c",
            "top": "fc",
            "fc_param": {"num_output": 1},
        },
    ]
    net = tmp_path / "net.json"
    net.write_text(json.dumps({"layers": layers}))
    weights = np.arange(dense_dim + vec + 1, dtype="<f4")  # W [dense_dim + vec, 1], then b
    dense_file = tmp_path / "_dense_0.model"
    weights.tofile(str(dense_file))
    return str(net), str(dense_file), weights


def test_load_dense_model_runs_the_network_in_the_array_module_it_is_given(params, tmp_path):
    from triton_rec.serving.deployment import load_dense_model

    net, dense_file, w = _small_network(tmp_path)
    p = dataclasses.replace(params(), dense_file=dense_file, network_file=net)
    xp = NumpyAsDevice()
    dense = load_dense_model(p, str(tmp_path), xp=xp)
    assert dense.xp is xp and xp.calls.get("asarray", 0) > 0  # weights went through xp
    before = xp.calls["asarray"]
    x, e = np.ones((3, 2), np.float32), np.ones((3, 1, 4), np.float32)
    out = dense.predict(x, [e])
    assert xp.calls["asarray"] > before  # the inputs are moved with xp.asarray
    np.testing.assert_allclose(out, np.full((3, 1), w[:6].sum() + w[6]))


def test_sessions_bring_a_device_prediction_back_to_the_host():
    from triton_rec.dense import DenseModel, TableSpec, to_host
    from triton_rec.serving.ranking import DenseSession

    class OnDevice(DenseModel):
        dense_dim, label_dim = 2, 1
        tables = (TableSpec("t", 1, 3),)

        def predict(self, dense, embeddings):
            return DeviceArray(np.asarray(dense).sum(axis=1, keepdims=True))

    with pytest.raises(TypeError):
        np.asarray(DeviceArray([1.0]), dtype=np.float32)  # what the sessions did before
    np.testing.assert_array_equal(to_host(DeviceArray([1.0, 2.0])), [1.0, 2.0])
    a = np.ones(2)
    assert to_host(a) is a
    s = DenseSession("m", OnDevice(), max_batch_size=8)
    req = (2, np.array([[1, 2], [3, 4]], np.float32), [np.ones((2, 3), np.float32)], [[0, 1, 2]])
    (out,) = s.predict_many([req])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [3.0, 7.0])


def test_dense_placement_puts_a_hugectr_network_of_a_gpu_instance_on_its_device(
    params, monkeypatch
):
    from triton_rec.cache import array_cache
    from triton_rec.serving.deployment import dense_placement

    p = params()
    gpu = InstanceSpec(kind="GPU", device_id=1)
    cpu_side = dense_placement(p, InstanceSpec())
    assert (cpu_side.xp, cpu_side.on_device) == (np, False)
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy absent here anyway
    no_cupy = dense_placement(p, gpu)
    assert (no_cupy.xp, no_cupy.on_device) == (np, False) and "CuPy" in no_cupy.why

    used = []

    class FakeCupy:
        class cuda:
            class Device:
                def __init__(self, i):
                    self.i = i

                def use(self):
                    used.append(self.i)

    monkeypatch.setattr(array_cache, "resolve_xp", lambda xp: FakeCupy)
    on_gpu = dense_placement(p, gpu)
    assert (on_gpu.xp, on_gpu.on_device, used) == (FakeCupy, True, [1])
    onnx = dense_placement(dataclasses.replace(p, dense_file="/m/dense.onnx"), gpu)
    assert not onnx.on_device and "onnxruntime" in onnx.why


def test_a_gpu_instance_logs_what_it_puts_on_the_gpu(params):
    from triton_rec.serving.deployment import DensePlacement, gpu_placement

    gpu = InstanceSpec(kind="GPU", device_id=0)
    assert gpu_placement(params(), InstanceSpec()) is None  # KIND_CPU: no line
    off = gpu_placement(params(gpucache=False), gpu)
    assert (
        "embedding cache on the GPU: no" in off and "nothing of this instance is on the GPU" in off
    )
    host = DensePlacement(np, False, "runs on the host with numpy: no CuPy")
    line = gpu_placement(params(), gpu, host)
    assert "embedding cache on the GPU: yes" in line
    assert "dense executor on the GPU: no, runs on the host" in line and "nothing" not in line
    device = DensePlacement(np, True, "CuPy on GPU 0")
    both_off = gpu_placement(params(gpucache=False), gpu, device)
    assert "dense executor on the GPU: yes" in both_off and "nothing" not in both_off
    assert "embedding cache on the GPU: none" in gpu_placement(None, gpu, device)


def test_the_cpu_caches_live_where_triton_rec_shm_dir_says(params, tmp_path, monkeypatch):
    """TRITON_REC_SHM_DIR moves a server's shared files, the CPU caches' segments too (a
    tmpfs mounted with huge=within_size gives them 2 MiB pages: docs/configuration.md);
    an InstanceSpec's own cache_dir wins over it."""
    p = params()
    spec = InstanceSpec(store_dir=str(tmp_path / "store"))
    for env, own in ((tmp_path / "shm-env", None), (tmp_path / "shm-env", tmp_path / "own")):
        for d in (env, own):
            if d is not None:
                d.mkdir(exist_ok=True)
        monkeypatch.setenv("TRITON_REC_SHM_DIR", str(env))
        s = open_session(p, dataclasses.replace(spec, cache_dir=own and str(own)))
        try:
            where = own or env
            paths = [ct.cache.path for ct in s.cached_tables]
            assert paths and all(path.startswith(str(where) + os.sep) for path in paths)
            assert all(os.path.exists(path) for path in paths)
        finally:
            s.close()
