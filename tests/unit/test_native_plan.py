"""What the native backend's hot path is handed (LookupSession.native_plan) and the
Python half it calls back (CachedTable.finish_query): checked through the addresses
themselves, as the C++ side reads them.

The plan's fields are the ones the C++ reads (``_native.PLAN_FIELDS``, from
src/native/plan_fields.hpp) and the reader itself (src/triton_backend/trec/plan.cpp's
read_plan, built here with tests/native/plan_reader.cpp around it) refuses a plan that lacks
one or holds it with the wrong type, naming it: the model's load fails then.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Callable, List, Mapping, Sequence

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from tests.native_build import NativeBuild, run
from triton_rec import _native
from triton_rec.cache.cached_table import NATIVE_FIELDS, CachedTable
from triton_rec.config.ps_json import parse_ps_config
from triton_rec.dense.hugectr_network import HugeCTRNetwork
from triton_rec.serving.deployment import InstanceSpec, open_session
from triton_rec.serving.native_plan import PLAN_TYPES, NativePlan, PlanLimits
from triton_rec.serving.ranking import DenseSession
from triton_rec.serving.session import LookupSession
from triton_rec.storage.backing_store import DictStore

ROOT = Path(__file__).resolve().parents[2]

SEED = 4
TABLES = [
    SyntheticTable("a", rows=2000, vec_size=8, max_keys_per_sample=3, default_value=-1.0),
    SyntheticTable("b", rows=300, vec_size=4, max_keys_per_sample=1, default_value=-2.0),
]


@pytest.fixture
def session(tmp_path, request):
    entry = write_model(str(tmp_path / "repo"), "m", TABLES, SEED)
    entry.update(request.param)
    params = parse_ps_config(
        {"supportlonglong": True, "models": [entry]}, base_dir=str(tmp_path / "repo")
    ).models[0]
    s = open_session(params, InstanceSpec(store_dir=str(tmp_path / "store")))
    yield s
    s.close()


def _floats(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(addr)).copy()


@pytest.mark.parametrize("session", [{"gpucache": False}], indirect=True)
def test_without_a_cache_the_plan_points_at_the_mapped_index_and_vectors(session):
    plan = session.native_plan()
    assert plan.max_batch_size == session.params.max_batch_size
    assert plan.maxnum == [3, 1]
    for entry, ct, spec in zip(plan.tables, session.cached_tables, TABLES):
        assert entry.cache is None and entry.misses is None and entry.finish is None
        table = ct.store.table
        vec_addr, rows = entry.vectors
        assert rows == spec.rows and entry.vec_size == spec.vec_size
        first_rows = _floats(vec_addr, 2 * spec.vec_size)
        np.testing.assert_array_equal(first_rows, table.vectors[:2].ravel())
        index_addr, capacity = entry.index
        assert capacity == table.index.shape[0]
        slots = np.ctypeslib.as_array((ctypes.c_int64 * 4).from_address(index_addr))
        np.testing.assert_array_equal(slots, table.index.ravel()[:4])
        assert entry.default_value == spec.default_value


@pytest.mark.parametrize("session", [{"gpucache": True, "gpucacheper": 0.5}], indirect=True)
def test_with_a_cache_the_plan_points_at_the_shared_segment(session):
    plan = session.native_plan()
    for entry, ct in zip(plan.tables, session.cached_tables):
        addr, size = entry.cache
        assert entry.index is None and entry.misses == ct.local_misses.address
        # the same bytes the session's own mapping holds (the segment's header)
        head = bytes((ctypes.c_char * 64).from_address(addr))
        assert head == bytes(ct.cache._mm[:64])
        assert size >= ct.cache.capacity * ct.vec_size * 4


@pytest.mark.parametrize("session", [{"gpucache": True}], indirect=True)
def test_what_the_hot_path_counts_shows_in_the_table_statistics(session):
    ct = session.cached_tables[0]
    addr = session.native_plan().tables[0].stats
    counters = np.ctypeslib.as_array((ctypes.c_int64 * len(NATIVE_FIELDS)).from_address(addr))
    before = ct.stats.snapshot()
    counters[NATIVE_FIELDS.index("lookups")] += 7
    counters[NATIVE_FIELDS.index("hits")] += 5
    after = ct.stats.snapshot()
    assert after["lookups"] - before["lookups"] == 7
    assert after["hits"] - before["hits"] == 5
    assert after["misses"] == before["misses"]


def test_a_store_that_is_not_node_local_and_has_no_cache_gets_no_plan():
    params = parse_ps_config(
        {
            "supportlonglong": True,
            "models": [
                {
                    "model": "d",
                    "sparse_files": ["x"],
                    "embedding_vecsize_per_table": [4],
                    "maxnum_catfeature_query_per_table_per_sample": [1],
                    "gpucache": False,
                }
            ],
        },
        base_dir=".",
    ).models[0]
    store = DictStore(4, default_value=0.0)
    s = LookupSession(params, [CachedTable("t", store)])
    assert s.native_plan() is None


@pytest.mark.parametrize("session", [{"gpucache": True, "hit_rate_threshold": 1.1}], indirect=True)
def test_finish_query_after_an_outside_query_answers_like_lookup(session):
    """The native path queries the cache itself, then hands the misses over."""
    ct = session.cached_tables[0]
    rng = np.random.default_rng(2)
    keys = rng.choice(table_keys(SEED, 0, TABLES[0].rows), 40, replace=False).astype(np.int64)
    ct.lookup(keys[:10], np.empty((10, 8), np.float32))  # some keys cached, the rest not
    out = np.empty((40, 8), np.float32)
    hit = np.empty(40, np.uint8)
    hits = ct.cache.query(keys, out, hit)
    assert 0 < hits < 40
    before = ct.stats.snapshot()
    assert ct.finish_query(keys, out, hit, hits, query_ns=1000) == hits
    np.testing.assert_array_equal(out, expected_vectors(SEED, 0, keys, 8))
    snap = {k: v - before[k] for k, v in ct.stats.snapshot().items()}
    assert (snap["lookups"], snap["hits"], snap["sync_fetched"]) == (40, hits, 40 - hits)
    assert snap["cache_ns"] >= 1000


# ---- the plan's fields: the dataclasses' and the C++ reader's --------------------------------


def field_mismatches(native: Mapping[str, Sequence[str]], dataclasses_: Mapping[str, type]):
    """Where the fields the C++ reads (``native``: type name -> fields) and the plan's
    dataclasses differ, one line each (empty when they agree, order included)."""
    out = []
    for name in sorted(set(native) | set(dataclasses_)):
        if name not in dataclasses_:
            out.append(f"{name}: the C++ reads it, no dataclass of the plan has that name")
        elif name not in native:
            out.append(f"{name}: a dataclass of the plan the C++ does not read")
        else:
            have = [f.name for f in dataclasses.fields(dataclasses_[name])]
            if have != list(native[name]):
                out.append(f"{name}: the C++ reads {list(native[name])}, the dataclass has {have}")
    return out


def test_the_native_backend_reads_exactly_the_fields_of_the_plan_dataclasses():
    assert field_mismatches(_native.PLAN_FIELDS, PLAN_TYPES) == []


def test_a_field_renamed_on_one_side_only_is_reported():
    renamed = dataclasses.make_dataclass("PlanLimits", [("des", int), ("keys", int), ("rows", int)])
    assert field_mismatches(_native.PLAN_FIELDS, {**PLAN_TYPES, "PlanLimits": renamed}) == [
        "PlanLimits: the C++ reads ['des', 'cat', 'rows'], "
        "the dataclass has ['des', 'keys', 'rows']"
    ]
    table = tuple("dim" if f == "vec_size" else f for f in _native.PLAN_FIELDS["TablePlan"])
    found = field_mismatches({**_native.PLAN_FIELDS, "TablePlan": table}, PLAN_TYPES)
    assert len(found) == 1 and found[0].startswith("TablePlan: the C++ reads ['dim', ")
    assert field_mismatches({**_native.PLAN_FIELDS, "Extra": ("a",)}, PLAN_TYPES) == [
        "Extra: the C++ reads it, no dataclass of the plan has that name"
    ]


# ---- the reader: tests/native/plan_reader.cpp around plan.cpp ------------------------------


@pytest.fixture(scope="module")
def plan_reader(native_build: NativeBuild) -> Path:
    """tests/native/plan_reader.cpp and plan.cpp as a shared library, beside the fake
    libcuda.so.1 of tests/native/fake_cuda.cpp (for the GPU plans)."""
    nb = native_build
    lib = nb.dir / "libplan_reader.so"
    run(
        [nb.cxx, "-shared", "-o", str(lib), nb.obj("plan_reader"), nb.obj("plan")]
        + nb.python_link()
    )
    return lib


@pytest.fixture(scope="module")
def read_plan(plan_reader) -> Callable[[object], str]:
    """read_plan of the native backend, as ``read_plan(plan) -> str``: ``ok ...`` (what it
    read), ``none``, ``field: ...`` (a PlanFieldError: the load fails) or ``refused: ...``."""
    fn = ctypes.PyDLL(str(plan_reader)).trec_read_plan
    fn.argtypes, fn.restype = [ctypes.py_object], ctypes.c_char_p
    return lambda plan: fn(plan).decode()


def _without(obj, name: str) -> types.SimpleNamespace:
    """``obj``'s fields but ``name``: a plan whose dataclass lost (or renamed) a field."""
    return types.SimpleNamespace(**{k: v for k, v in vars(obj).items() if k != name})


@pytest.fixture
def dense_plan(tmp_path) -> List[NativePlan]:
    """The demo DLRM's dense step (random weights) as DenseSession plans it."""
    path = ROOT / "model_repository" / "dlrm" / "1" / "dlrm.json"
    dense_file = tmp_path / "dense.model"
    n = HugeCTRNetwork.parse(str(path)).num_params
    (np.random.default_rng(1).standard_normal(n) * 0.1).astype("<f4").tofile(dense_file)
    network = HugeCTRNetwork.load(str(path), str(dense_file))
    session = DenseSession("dlrm_dense", network, 64)
    plan = session.native_plan()
    assert plan is not None
    return [plan, session, network]  # the session and network hold what the plan points to


@pytest.mark.parametrize("session", [{"gpucache": False}], indirect=True)
def test_the_reader_reads_a_host_plan_as_the_session_made_it(session, read_plan):
    plan = session.native_plan().responding("OUTPUT0", ["DefaultNotFound"], 0)
    got = read_plan(plan)
    batch = session.params.max_batch_size
    assert got.startswith(f"ok kind=hps batch={batch} output=OUTPUT0 info=DefaultNotFound "), got
    assert f" maxnum=3,1 max_keys={batch * 4} " in got
    assert got.endswith(" tables=8/-1.000000/index/none;4/-2.000000/index/none"), got


@pytest.mark.parametrize("session", [{"gpucache": True}], indirect=True)
def test_the_reader_reads_the_caches_and_their_miss_handlers(session, read_plan):
    got = read_plan(session.native_plan())
    assert got.endswith(" tables=8/-1.000000/cache/misses;4/-2.000000/cache/misses"), got


def test_the_reader_reads_a_dense_plan_and_its_limits(dense_plan, read_plan):
    plan, session, network = dense_plan
    limits = session.input_limits()
    des, cat, rows = (limits[k][0] for k in ("DES", "EMBEDDINGS", "ROWINDEX"))
    got = read_plan(plan)
    assert got.startswith("ok kind=dense batch=64 "), got
    assert f" limits={des},{cat},{rows} " in got and " net=1 " in got
    assert f" dense_dim={network.dense_dim} label_dim={network.label_dim} " in got


@pytest.mark.parametrize("session", [{"gpucache": False}], indirect=True)
def test_a_plan_without_a_field_fails_naming_it(session, read_plan):
    plan = session.native_plan()
    assert read_plan(_without(plan, "max_batch_size")) == (
        "field: native plan: NativePlan.max_batch_size is missing "
        "(a types.SimpleNamespace has no 'max_batch_size')"
    )
    plan.tables[1] = _without(plan.tables[1], "default_value")
    assert read_plan(plan).startswith("field: native plan: TablePlan.default_value is missing")


@pytest.mark.parametrize("session", [{"gpucache": False}], indirect=True)
def test_a_field_of_the_wrong_type_fails_naming_it(session, read_plan):
    plan = session.native_plan()
    plan.tables[0].vec_size = "8"
    assert read_plan(plan) == "field: native plan: TablePlan.vec_size must be an int, got str"
    plan = session.native_plan()
    plan.tables[0].index = [1, 2]
    assert read_plan(plan) == (
        "field: native plan: TablePlan.index must be an (address, count) tuple, got list"
    )
    plan = session.native_plan()
    plan.maxnum = [3, 1.0]
    assert read_plan(plan) == (
        "field: native plan: NativePlan.maxnum items must be an int, got float"
    )


def test_limits_the_reader_cannot_read_fail_the_load_instead_of_sending_requests_to_python(
    dense_plan, read_plan
):
    """A missing limit read as -1, so that every request seemed too large for the native
    path and went to Python; now the load fails naming the limit."""
    plan, _, _ = dense_plan
    limits = plan.limits
    assert isinstance(limits, PlanLimits)
    plan.limits = None
    assert read_plan(plan) == "field: native plan: NativePlan.limits is None"
    plan.limits = _without(limits, "des")
    assert read_plan(plan).startswith("field: native plan: PlanLimits.des is missing")
    plan.limits = dataclasses.replace(limits, cat=True)
    assert read_plan(plan) == "field: native plan: PlanLimits.cat must be an int, got bool"


def test_a_plan_the_native_path_cannot_serve_is_refused_not_failed(dense_plan, read_plan):
    plan, _, _ = dense_plan
    plan.vec_sizes = plan.vec_sizes[:-1]
    assert read_plan(plan) == "refused: native plan: the per-table lists differ in length"


#: A KIND_GPU hugectr plan of two tables (a device cache, a whole table) and its network as
#: graphs, over host arrays (the fake driver's device memory is host memory), then the same
#: plan with one field wrong at a time: one line each of what read_plan made of it.
GPU_PLANS = """
import ctypes, dataclasses, sys, types
import numpy as np
from triton_rec.cache.array_cache import ArrayEmbeddingCache
from triton_rec.cache.device_plans import DeviceTablePlan
from triton_rec.dense.graphs import DenseGpuPlan
from triton_rec.serving.native_plan import GpuPlan, NativePlan, PlanLimits, TablePlan

fn = ctypes.PyDLL(sys.argv[1]).trec_read_plan
fn.argtypes, fn.restype = [ctypes.py_object], ctypes.c_char_p
keep = []
def addr(a):
    keep.append(a)
    return int(a.ctypes.data)
cache = ArrayEmbeddingCache(64, 4)
index = np.full((16, 2), -1, np.int64)
sizes = [1, 2, 4, 8, 16, 32, 64]
tables = [
    TablePlan(4, 0, -1.0, addr(np.zeros(16, np.int64)), device=0,
              device_cache=cache.native_plan(), finish=lambda *a: (0, 0)),
    TablePlan(4, 0, -2.0, addr(np.zeros(16, np.int64)), device=0,
              device_table=DeviceTablePlan(addr(index), 16, addr(np.zeros((3, 4), np.float32)), 3)),
]
graphs = DenseGpuPlan(0, 0, addr(np.zeros(128, np.float32)),
                      [addr(np.zeros(64 * 4, np.float32)), addr(np.zeros(128 * 4, np.float32))],
                      [(b, i + 1, addr(np.zeros(b, np.float32))) for i, b in enumerate(sizes)])
plan = NativePlan("hugectr", tables, 64, gpu=GpuPlan(0, b"fake"), slots=[1, 2],
                  mean=[False, True], dense_dim=2, label_dim=1, limits=PlanLimits(128, 960, 193),
                  dense_gpu=graphs)
def variant(**parts):
    p = dataclasses.replace(plan, tables=list(plan.tables))
    for k, v in parts.items():
        if k.startswith("t"):
            p.tables[int(k[1])] = v
        else:
            setattr(p, k, v)
    return p
cases = [
    plan,
    variant(gpu=GpuPlan(0, "fake")),
    variant(t0=dataclasses.replace(tables[0],
            device_cache=dataclasses.replace(tables[0].device_cache, num_sets="1"))),
    variant(t1=dataclasses.replace(tables[1],
            device_table=types.SimpleNamespace(slots=1, capacity=16, vectors=1))),
    variant(t1=dataclasses.replace(tables[1], device=1)),
    variant(dense_gpu=dataclasses.replace(graphs, buckets=[[1, 1, 1]])),
    variant(dense_gpu=dataclasses.replace(graphs, device=1)),
]
for c in cases:
    print(fn(c).decode(), flush=True)
"""


def test_the_reader_reads_gpu_plans_on_the_fake_driver(plan_reader, tmp_path):
    env = dict(os.environ, FAKE_POISON="0")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(plan_reader.parent), env.get("LD_LIBRARY_PATH")) if p
    )
    script = tmp_path / "gpu_plans.py"
    script.write_text(GPU_PLANS)
    r = subprocess.run(
        [sys.executable, str(script), str(plan_reader)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=str(ROOT),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 7, r.stdout + r.stderr
    assert lines[0].startswith("ok kind=hugectr batch=64 "), lines[0]
    assert " gpu=0 buckets=7 emb_in=2 host_max_batch=0 " in lines[0], lines[0]
    tables = "4/-1.000000/device_cache/finish;4/-2.000000/device_table/none"
    assert lines[0].endswith(" tables=" + tables), lines[0]
    assert lines[1:] == [
        "field: native plan: GpuPlan.image must be the kernels' module (bytes), got str",
        "field: native plan: DeviceCachePlan.num_sets must be an int, got str",
        "field: native plan: DeviceTablePlan.rows is missing "
        "(a types.SimpleNamespace has no 'rows')",
        "refused: native plan: a table on GPU 1, the plan's GPU is 0",
        "field: native plan: DenseGpuPlan.buckets items must be (batch, graph, output) tuples",
        "refused: native plan: the network on GPU 1, the plan's GPU is 0",
    ]
