"""``triton-rec-server plan`` and its rules (triton_rec/serving/sizing.py, plan_cli.py).

Each figure of a plan comes from the rule the allocating code uses: these tests hold each
rule to what is allocated (a layout converted into the store, a /dev/shm segment, the
device cache's state arrays on their CPU twin), and the command line to its verdicts: a
repository larger than the node is refused with the model named, and so is a KIND_GPU
model on a node without a GPU. Table sizes are read from file sizes and headers: a table
of 2^39 rows made with ``truncate`` (no data on disk) is sized in milliseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, write_model
from tests.fake_pb_utils import make_module
from triton_rec import _native
from triton_rec.cache.device_table import device_table_bytes
from triton_rec.cache.gpu_share import device_cache_bytes, open_shared_cache
from triton_rec.cache.shm_cache import SharedEmbeddingCache, segment_bytes
from triton_rec.config.ps_json import load_ps_config
from triton_rec.errors import ModelFileError
from triton_rec.formats.hugectr_sparse import KEY_FILE, VECTOR_FILE
from triton_rec.formats.tables import read_table_rows, table_shape, write_table_rows
from triton_rec.precision import RowCodec
from triton_rec.serving import sizing
from triton_rec.serving.deployment import cache_rows
from triton_rec.storage import node_store
from triton_rec.triton import plan_cli
from triton_rec.triton.runtime import main

HPS_CONFIG = """name: "{name}"
backend: "hps"
max_batch_size: 64
input [
  {{ name: "KEYS" data_type: TYPE_INT64 dims: [ -1 ] }},
  {{ name: "NUMKEYS" data_type: TYPE_INT32 dims: [ -1 ] }}
]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
{groups}
"""
TABLES = [
    SyntheticTable("item", rows=3000, vec_size=16, max_keys_per_sample=2),
    SyntheticTable("user", rows=500, vec_size=4, max_keys_per_sample=1),
]


def write_repo(root: Path, models: dict, **entry) -> Path:
    """A repository of ``hps`` models ``{name: instance_group text}``, tables of TABLES."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, groups in models.items():
        e = write_model(str(root), name, TABLES, seed=3)
        e.update(entry)
        entries.append(e)
        (root / name / "config.pbtxt").write_text(HPS_CONFIG.format(name=name, groups=groups))
    (root / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": entries}))
    return root


def sparse_file(path: Path, size: int) -> None:
    """A file of ``size`` bytes with no data on disk (a hole: ``truncate``)."""
    with open(path, "wb") as f:
        f.truncate(size)


def config_of(repo: Path, name: str) -> dict:
    return plan_cli.read_model_config(repo / name / "config.pbtxt")


def run_plan(capsys, *args) -> tuple:
    code = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- table sizes from metadata ---------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_table_shape_is_what_reading_the_table_gives(tmp_path, precision):
    keys = np.arange(7, 7 + 321, dtype=np.int64)
    vectors = np.random.default_rng(0).standard_normal((321, 12)).astype(np.float32)
    codec = RowCodec(precision, 12)
    path = str(tmp_path / ("t.npz" if precision != "fp32" else "t_sparse_0.model"))
    write_table_rows(path, keys, codec.encode(vectors), codec)
    k, rows, read = read_table_rows(path, 12)
    assert table_shape(path, 12) == (k.shape[0], read) == (321, codec)


def test_a_plain_npz_table_is_sized_from_its_headers(tmp_path):
    path = str(tmp_path / "t.npz")
    np.savez_compressed(path, keys=np.arange(50, dtype=np.int64), vectors=np.ones((50, 3), "f4"))
    assert table_shape(path, 3) == (50, RowCodec("fp32", 3))
    with pytest.raises(ModelFileError, match="3 columns but the config says vec_size 4"):
        table_shape(path, 4)


def test_a_sparse_table_is_sized_from_its_file_sizes_alone(tmp_path):
    d = tmp_path / "huge_sparse_0.model"
    d.mkdir()
    rows = 1 << 39  # 4 TiB of keys: made sparse, nothing is written, nothing is read
    sparse_file(d / KEY_FILE, 8 * rows)
    sparse_file(d / VECTOR_FILE, 4 * rows)
    assert table_shape(str(d), 1) == (rows, RowCodec("fp32", 1))
    # the reader's own checks: sizes that disagree are refused, naming the directory
    with pytest.raises(ModelFileError, match="holds 549755813888 keys but 'emb_vector' holds"):
        table_shape(str(d), 2)
    with pytest.raises(ModelFileError, match="does not exist"):
        table_shape(str(tmp_path / "nowhere"), 1)


# -- each rule is what is allocated ----------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_the_plan_of_a_table_is_the_size_of_its_layout_in_the_store(tmp_path, precision):
    repo = write_repo(tmp_path / "repo", {"m": ""}, embedding_precision=[precision, precision])
    plan = sizing.plan_model("m", config_of(repo, "m"), str(repo / "m"), [])
    assert plan.error is None, plan.error
    store = tmp_path / "store"
    for tp in load_ps_config(str(repo / "ps.json")).model("m").tables:
        layout = node_store.ensure_layout(
            tp.sparse_file, tp.vec_size, str(store), precision=tp.precision
        )
        planned = [
            p for p in plan.parts if p.what.startswith(f"table '{tp.name}' in the node store")
        ]
        assert [p.bytes for p in planned] == [os.path.getsize(layout.path)]
    assert plan.host_bytes == sum(f.stat().st_size for f in (store / "layouts").glob("*.tbl"))


@pytest.mark.parametrize("policy, ways, precision", [("lru", 8, "fp32"), ("tinylfu", 4, "int8")])
def test_the_plan_of_a_cpu_cache_is_the_size_of_its_segment(tmp_path, policy, ways, precision):
    with SharedEmbeddingCache.open(
        "plan-test",
        1000,
        24,
        policy=policy,
        ways=ways,
        precision=precision,
        directory=str(tmp_path),
    ) as cache:
        assert cache.nbytes == os.path.getsize(cache.path) == cache.memory_use()[1]
        assert cache.nbytes == segment_bytes(1000, 24, policy, ways, precision)


@pytest.mark.parametrize("policy, precision", [("lru", "fp32"), ("tinylfu", "fp16")])
def test_the_plan_of_a_device_cache_is_its_state_arrays(tmp_path, policy, precision):
    # the CPU twin of the GPU cache: the same state arrays (the GPU path allocates them
    # with allocate_device_arrays; tests/gpu/test_sizing_gpu.py checks it there)
    shared = open_shared_cache(
        "plan-test", 777, 16, ways=8, policy=policy, precision=precision, directory=str(tmp_path)
    )
    try:
        arrays = shared.cache.state_arrays().values()
        assert sum(a.nbytes for a in arrays) == device_cache_bytes(777, 16, 8, policy, precision)
        assert shared.memory_use() == ("shm", device_cache_bytes(777, 16, 8, policy, precision))
    finally:
        shared.close()


def test_the_device_table_rule_is_index_then_rows():
    codec = RowCodec("int8", 16)
    index = 16 * _native.index_capacity(1000)
    assert device_table_bytes(1000, codec) == -(-index // 256) * 256 + 1000 * (16 + 8)


def test_cache_rows_follow_gpucacheper_and_the_cache_type(tmp_path):
    repo = write_repo(tmp_path / "repo", {"m": ""})
    params = load_ps_config(str(repo / "ps.json")).model("m")
    assert cache_rows(params, 3000) == 1500
    assert cache_rows(params, 1) == 1
    import dataclasses

    from triton_rec.config.ps_json import EmbeddingCacheType

    static = dataclasses.replace(params, embedding_cache_type=EmbeddingCacheType.STATIC)
    assert cache_rows(static, 3000) == 3000
    assert cache_rows(dataclasses.replace(params, gpucache=False), 3000) == 0
    assert cache_rows(dataclasses.replace(params, gpucacheper=0.0), 3000) == 0


# -- instance groups, versions, GPUs -----------------------------------------------------


def test_instance_groups_follow_tritons_defaults():
    groups, refusals = sizing.instance_groups({}, [])
    assert [(g.kind, g.count) for g in groups] == [("CPU", 1)] and refusals == []
    groups, _ = sizing.instance_groups({"instance_group": [{"count": 2}]}, [0, 1])
    assert [(g.kind, g.count, g.devices) for g in groups] == [("GPU", 2, (0, 1))]
    groups, refusals = sizing.instance_groups(
        {"instance_group": [{"kind": "KIND_GPU", "gpus": [1]}]}, [0]
    )
    assert groups == [] and "GPUs [1], which this node lacks" in refusals[0]
    # as Triton hands the config to a model at load: taken as resolved
    groups, refusals = sizing.instance_groups(
        {"instance_group": [{"kind": "KIND_GPU", "count": 3, "gpus": [2]}]}, None
    )
    assert [(g.kind, g.count, g.devices) for g in groups] == [("GPU", 3, (2,))] and not refusals


def test_loaded_versions_follow_the_version_policy(tmp_path):
    for v in ("1", "2", "10", "notes"):
        (tmp_path / v).mkdir()
    assert sizing.loaded_versions({}, str(tmp_path)) == [10]
    assert sizing.loaded_versions({"version_policy": {"all": {}}}, str(tmp_path)) == [1, 2, 10]
    specific = {"version_policy": {"specific": {"versions": ["1", "2"]}}}
    assert sizing.loaded_versions(specific, str(tmp_path)) == [1, 2]
    latest = {"version_policy": {"latest": {"num_versions": 2}}}
    assert sizing.loaded_versions(latest, str(tmp_path)) == [2, 10]


@pytest.mark.parametrize("cache_type", ["dynamic", "static", "uvm"])
@pytest.mark.parametrize("request_path", ["native", "python"])
def test_a_gpu_model_is_planned_per_gpu_version_and_instance(tmp_path, cache_type, request_path):
    groups = "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] } ]"
    repo = write_repo(
        tmp_path / "repo",
        {"g": groups},
        embedding_cache_type=cache_type,
        deployed_device_list=[0, 1],
    )
    config = config_of(repo, "g")
    plan = sizing.plan_model("g", config, str(repo / "g"), [0, 1], request_path)
    assert plan.error is None and not plan.refusals
    params = load_ps_config(str(repo / "ps.json")).model("g")
    staging = sizing.staging_bytes(params.max_batch_size, [(2, 16), (1, 4)])
    per_gpu = 2 * staging  # two instances on each GPU
    tables = 0
    for t in TABLES:
        codec = RowCodec("fp32", t.vec_size)
        if cache_type == "dynamic":  # one per GPU and version, shared by its instances
            tables += device_cache_bytes(cache_rows(params, t.rows), t.vec_size)
        else:  # whole, once per GPU in the server process; once per instance process
            tables += device_table_bytes(t.rows, codec) * (2 if request_path == "python" else 1)
    layouts = sum(p.bytes for p in plan.parts if "node store" in p.what)
    assert plan.shm_bytes == 0  # no KIND_CPU instance: no CPU cache
    if cache_type == "uvm":  # pinned host memory, for each GPU
        assert plan.gpu_bytes == {0: per_gpu, 1: per_gpu}
        assert plan.host_bytes == layouts + 2 * per_gpu + 2 * tables
    else:
        assert plan.gpu_bytes == {0: per_gpu + tables, 1: per_gpu + tables}
        assert plan.host_bytes == layouts + 2 * per_gpu


def test_models_sharing_a_table_count_it_once_on_the_node(tmp_path):
    repo = write_repo(tmp_path / "repo", {"a": "", "b": ""})
    ps = json.loads((repo / "ps.json").read_text())
    ps["models"][1]["sparse_files"] = ps["models"][0]["sparse_files"]  # b serves a's tables
    (repo / "ps.json").write_text(json.dumps(ps))
    plans = plan_cli.plan_repository(repo, [], "native")
    a, b = plans
    assert a.host_bytes == b.host_bytes > 0 and a.shm_bytes == b.shm_bytes > 0
    t = sizing.totals(plans)
    assert t["host_bytes"] == a.host_bytes  # one layout per table on the node
    assert t["shm_bytes"] == 2 * a.shm_bytes  # a cache per model


# -- the command line ------------------------------------------------------------------


def test_plan_prints_each_model_and_the_node_and_fits(tmp_path, capsys):
    repo = write_repo(tmp_path / "repo", {"a": "instance_group [ { count: 2 kind: KIND_CPU } ]"})
    code, out, _ = run_plan(capsys, "--model-repository", repo, "--node-gpus", "none", "-v")
    assert code == 0, out
    assert out.splitlines()[0].split() == ["MODEL", "BACKEND", "HOST", "/DEV/SHM", "GPU"]
    assert "table 'item' in the node store (3000 rows, fp32)" in out
    assert "this node: RAM" in out and out.rstrip().endswith("fits: yes")
    code, out, _ = run_plan(capsys, "--model-repository", repo, "--json", "--node-gpus", "none")
    doc = json.loads(out)
    assert code == 0 and doc["fits"] is True and doc["misfits"] == []
    model = doc["models"]["a"]
    assert set(model) >= {"host_bytes", "shm_bytes", "gpu_bytes"} and model["gpu_bytes"] == {}
    assert model["host_bytes"] > 0 and model["shm_bytes"] > 0
    assert doc["node"]["ram_total_bytes"] > 0 and doc["node"]["gpus"] == {}


def test_a_repository_larger_than_the_node_is_refused(tmp_path, capsys):
    repo = write_repo(tmp_path / "repo", {"small": ""})
    big = repo / "big" / "1" / "big0_sparse_0.model"
    big.mkdir(parents=True)
    rows = 1 << 39  # sparse files: a 4 TiB key file and a 2 TiB vector file, no data
    sparse_file(big / KEY_FILE, 8 * rows)
    sparse_file(big / VECTOR_FILE, 4 * rows)
    ps = json.loads((repo / "ps.json").read_text())
    ps["models"].append(
        dict(
            ps["models"][0],
            model="big",
            sparse_files=["big/1/big0_sparse_0.model"],
            embedding_table_names=["huge"],
            embedding_vecsize_per_table=[1],
            maxnum_catfeature_query_per_table_per_sample=[1],
            default_value_for_each_table=[0.0],
        )
    )
    (repo / "ps.json").write_text(json.dumps(ps))
    (repo / "big" / "config.pbtxt").write_text(HPS_CONFIG.format(name="big", groups=""))
    code, out, _ = run_plan(capsys, "--model-repository", repo, "--node-gpus", "none")
    assert code == 1, out
    refused = [line for line in out.splitlines() if line.startswith("does not fit:")]
    assert any("model 'big': host memory" in line for line in refused), out
    assert any("model 'big': shared memory" in line for line in refused), out
    assert not any("'small'" in line for line in refused), out
    assert out.rstrip().endswith("fits: no")
    code, out, _ = run_plan(capsys, "--model-repository", repo, "--json", "--node-gpus", "none")
    doc = json.loads(out)
    assert code == 1 and doc["fits"] is False
    assert doc["models"]["big"]["host_bytes"] > 16 * rows  # keys, rows, index
    assert all("'big'" in line for line in doc["misfits"])


def test_models_that_fit_alone_but_not_together_are_named_together(tmp_path, capsys):
    repo = write_repo(tmp_path / "repo", {"a": "", "b": ""})
    plans = plan_cli.plan_repository(repo, [], "native")
    one = plans[0].host_bytes + plans[0].shm_bytes
    code, out, _ = run_plan(
        capsys, "--model-repository", repo, "--node-gpus", "none", "--node-ram", str(one + one // 2)
    )
    assert code == 1
    (line,) = [x for x in out.splitlines() if x.startswith("does not fit:")]
    assert "models 'a'" in line and "'b'" in line and "together: host memory" in line


def test_a_gpu_model_on_a_node_without_a_gpu_is_refused(tmp_path, capsys):
    gpu = "instance_group [ { count: 1 kind: KIND_GPU } ]"
    repo = write_repo(tmp_path / "repo", {"on_gpu": gpu, "on_cpu": ""})
    code, out, _ = run_plan(capsys, "--model-repository", repo, "--node-gpus", "none")
    assert code == 1
    refused = [line for line in out.splitlines() if line.startswith("does not fit:")]
    assert refused == [
        "does not fit: model 'on_gpu': GPU: instance_group 0 is KIND_GPU and this node has no GPU"
    ]
    code, out, _ = run_plan(capsys, "--model-repository", repo, "--node-gpus", "80G")
    assert code == 0, out


def test_a_gpu_not_in_deployed_device_list_is_refused(tmp_path, capsys):
    """HPS refuses a KIND_GPU instance on a GPU that ps.json's deployed_device_list lacks
    (hps backend src/model_state.cpp, Create_EmbeddingCache); so does the plan."""
    groups = "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0, 1, 2 ] } ]"
    repo = write_repo(tmp_path / "repo", {"g": groups}, deployed_device_list=[1])
    code, out, _ = run_plan(capsys, "--model-repository", repo, "--node-gpus", "80G,80G,80G")
    assert code == 1
    refused = [line for line in out.splitlines() if line.startswith("does not fit:")]
    assert len(refused) == 2, out
    for device, line in zip((0, 2), refused):
        assert (
            line.startswith("does not fit: model 'g': GPU: ")
            and (
                f"Please confirm that device {device} is added to 'deployed_device_list' in the "
                "ps configuration file (it lists [1])"
            )
            in line
        ), line
    groups = "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 1 ] } ]"
    repo = write_repo(tmp_path / "repo2", {"g": groups}, deployed_device_list=[1])
    code, out, _ = run_plan(capsys, "--model-repository", repo, "--node-gpus", "80G,80G,80G")
    assert code == 0, out


def test_a_model_that_cannot_be_sized_is_named(tmp_path, capsys):
    repo = write_repo(tmp_path / "repo", {"m": ""})
    ps = json.loads((repo / "ps.json").read_text())
    ps["models"][0]["sparse_files"][1] = "m/1/missing_sparse_0.model"
    (repo / "ps.json").write_text(json.dumps(ps))
    code, out, _ = run_plan(capsys, "--model-repository", repo, "--node-gpus", "none")
    assert code == 1
    assert "does not fit: model 'm': cannot be sized:" in out and "missing_sparse_0.model" in out
    code, _, err = run_plan(capsys, "--model-repository", tmp_path / "none")
    assert code == 2 and "no such model repository" in err


def test_sizes_on_the_command_line():
    assert plan_cli.parse_size("512") == 512
    assert plan_cli.parse_size("1.5K") == 1536
    assert plan_cli.parse_size("64GiB") == 64 << 30
    assert plan_cli.parse_gpus("none") == {}
    assert plan_cli.parse_gpus("80G,40G") == {0: 80 << 30, 1: 40 << 30}


# -- the load log ----------------------------------------------------------------------


def test_the_load_log_states_the_plans_figures_once_per_model(tmp_path):
    repo = write_repo(tmp_path / "repo", {"m": "instance_group [ { count: 2 kind: KIND_CPU } ]"})
    pb = make_module()
    pb.log_lines.clear()
    config = config_of(repo, "m")
    args = {"model_repository": str(repo / "m")}
    plan = sizing.plan_model("m", config, str(repo / "m"), None, "python")
    for _ in range(2):  # two instances load in this process
        plan_cli.log_sizing(pb, "m", config, args)
    lines = [msg for _, msg in pb.log_lines if "sizing" in msg]
    assert lines == [f"model 'm': sizing: {plan.summary()} (triton-rec-server plan)"]
    assert f"host_bytes={plan.host_bytes}" in lines[0] and f"shm_bytes={plan.shm_bytes}" in lines[0]
    for _ in range(2):
        plan_cli.forget_sizing("m")
    plan_cli.log_sizing(pb, "m", config, args)  # loaded again: said again
    assert len([msg for _, msg in pb.log_lines if "sizing" in msg]) == 2
    plan_cli.forget_sizing("m")


def test_whole_table_max_bytes_holds_small_tables_whole_on_the_gpu(tmp_path):
    """ps.json ``whole_table_max_bytes`` (our extension): a dynamic cache's table whose whole
    copy fits in it is held whole on the GPU (a static table), the others cached; the plan
    counts each as it is opened (deployment.device_table_mode, the one rule)."""
    import dataclasses

    from triton_rec.config.ps_json import EmbeddingCacheType
    from triton_rec.serving.deployment import device_table_mode

    item, user = (device_table_bytes(t.rows, RowCodec("fp32", t.vec_size)) for t in TABLES)
    assert user < item
    groups = "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]"
    repo = write_repo(tmp_path / "repo", {"g": groups}, whole_table_max_bytes=user)
    params = load_ps_config(str(repo / "ps.json")).model("g")
    assert params.whole_table_max_bytes == user
    modes = [device_table_mode(params, t.rows, RowCodec("fp32", t.vec_size)) for t in TABLES]
    assert modes == [None, "static"]
    plan = sizing.plan_model("g", config_of(repo, "g"), str(repo / "g"), [0], "native")
    staging = sizing.staging_bytes(params.max_batch_size, [(2, 16), (1, 4)])
    cached = device_cache_bytes(cache_rows(params, TABLES[0].rows), TABLES[0].vec_size)
    assert plan.gpu_bytes == {0: staging + cached + user}
    whats = [p.what for p in plan.parts if p.resource == "gpu"]
    assert "table 'user' whole on the GPU (static)" in whats
    assert any(w.startswith("table 'item': GPU cache of") for w in whats)

    def mode(**change):
        p = dataclasses.replace(params, **change)
        return device_table_mode(p, TABLES[1].rows, RowCodec("fp32", TABLES[1].vec_size))

    assert mode(whole_table_max_bytes=user - 1) is None
    assert mode(whole_table_max_bytes=0) is None  # the default: HPS's caches
    assert mode(gpucache=False) is None
    assert mode(embedding_cache_type=EmbeddingCacheType.UVM, whole_table_max_bytes=0) == "uvm"
    tiers = dataclasses.replace(params.volatile_db, type="redis_cluster")
    assert mode(volatile_db=tiers) is None  # a whole table is node-local


@pytest.mark.parametrize("value", [-1, 1.5, "64MiB", True])
def test_whole_table_max_bytes_must_be_a_byte_count(tmp_path, value):
    from triton_rec.errors import ConfigError

    repo = write_repo(tmp_path / "repo", {"g": ""}, whole_table_max_bytes=value)
    with pytest.raises(ConfigError, match="whole_table_max_bytes"):
        load_ps_config(str(repo / "ps.json"))
    default = write_repo(tmp_path / "default", {"g": ""})
    assert load_ps_config(str(default / "ps.json")).model("g").whole_table_max_bytes == 0
