"""End to end: whole models (backend "hugectr") from the upstream HugeCTR sample configs.

The sample config.pbtxt and network JSON files are used as shipped, except for two
things a CPU node forces: KIND_GPU -> KIND_CPU, and the absolute `config` path
(`/model/<name>/1/<name>.json`) pointed at the temporary repository.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.conftest import infer_raw, make_client
from triton_rec.dense import combine_slots
from triton_rec.dense.hugectr_network import HugeCTRNetwork
from triton_rec.formats.tables import write_table
from triton_rec.triton.runtime import TritonServer

DATA = Path(__file__).resolve().parents[1] / "data"
SAMPLES = {"dcn": 16, "deepfm": 11}  # model -> embedding_vec_size in its network JSON
ROWS = 4000


DENSE_CONFIG = """name: "{name}"
backend: "dense"
max_batch_size: 0
input [
  {{ name: "DES" data_type: TYPE_FP32 dims: [ -1 ] }},
  {{ name: "EMBEDDINGS" data_type: TYPE_FP32 dims: [ -1 ] }},
  {{ name: "ROWINDEX" data_type: TYPE_INT32 dims: [ -1 ] }}
]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "ps_model" value: {{ string_value: "{ps_model}" }} }}
"""


def _cpu(config_text: str, name: str, model_dir: Path) -> str:
    out = config_text.replace("kind : KIND_GPU\n    gpus:[0]", "kind : KIND_CPU")
    out = out.replace(f"/model/{name}/1/{name}.json", str(model_dir / "1" / f"{name}.json"))
    assert out.count("KIND_GPU") == 0 and "/model/" not in out
    return out


@pytest.fixture(scope="module")
def samples(tmp_path_factory, nothing_left_in_dev_shm, store_dir, request_path):
    repo = tmp_path_factory.mktemp("hugectr-repo")
    rng = np.random.default_rng(0)
    entries, refs = [], {}
    for name, vec in SAMPLES.items():
        model_dir = repo / name
        (model_dir / "1").mkdir(parents=True)
        shutil.copy(DATA / f"{name}.json", model_dir / "1" / f"{name}.json")
        (model_dir / "config.pbtxt").write_text(
            _cpu((DATA / f"{name}_config.pbtxt").read_text(), name, model_dir)
        )
        # Keys fit UINT32 (the samples' CATCOLUMN type).
        keys = rng.permutation(np.arange(ROWS, dtype=np.int64) * 97 + 5)
        vectors = rng.standard_normal((ROWS, vec)).astype(np.float32) * 0.1
        write_table(str(model_dir / "1" / f"{name}0_sparse_0.model"), keys, vectors)
        plan = HugeCTRNetwork.parse(json.loads((DATA / f"{name}.json").read_text()))
        weights = (rng.standard_normal(plan.num_params) * 0.05).astype(np.float32)
        weights.tofile(model_dir / "1" / f"{name}_dense_0.model")
        entries.append(
            {
                "model": name,
                "sparse_files": [f"{name}/1/{name}0_sparse_0.model"],
                "dense_file": f"{name}/1/{name}_dense_0.model",
                "embedding_vecsize_per_table": [vec],
                "maxnum_catfeature_query_per_table_per_sample": [26],
                "max_batch_size": 64,
                "gpucache": True,
                "gpucacheper": 0.5,
                "hit_rate_threshold": 1.1,
            }
        )
        # the dense step of an hps -> dense ensemble on the same network: fed the
        # looked-up vectors (EMBEDDINGS) instead of the keys
        dense_dir = repo / f"{name}_dense"
        (dense_dir / "1").mkdir(parents=True)
        (dense_dir / "config.pbtxt").write_text(
            DENSE_CONFIG.format(name=f"{name}_dense", ps_model=name)
            + f'parameters {{ key: "config" value: {{ string_value: '
            f'"{model_dir / "1" / f"{name}.json"}" }} }}\n'
        )
        refs[name] = (
            keys,
            vectors,
            HugeCTRNetwork.load(
                str(model_dir / "1" / f"{name}.json"),
                str(model_dir / "1" / f"{name}_dense_0.model"),
            ),
        )
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": False, "models": entries}))
    log = tmp_path_factory.mktemp("hugectr-logs") / "tritonserver.log"
    with TritonServer(
        repo, log_path=log, env={"TRITON_REC_STORE": str(store_dir)}, request_path=request_path
    ) as srv:
        yield srv, refs


def _request(rng, keys, n, multi_hot=False):
    """n samples of 13 dense features and 26 slots (one key per slot, or 0-2 keys; with
    "balanced", as many keys as slots but not one per slot: one-hot's count, not its
    layout, which the native path passes to the network uncombined)."""
    counts = rng.integers(0, 3, n * 26) if multi_hot else np.ones(n * 26, np.int64)
    if multi_hot == "balanced":
        counts = np.ones(n * 26, np.int64)
        counts[[0, 5 * 26 + 3]], counts[[1, 5 * 26 + 4]] = 2, 0
    cat = rng.choice(keys, int(counts.sum()))
    cat[:3] = [1, 2, 3]  # unknown keys: default value (0) vectors
    rowindex = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    des = rng.standard_normal(n * 13).astype(np.float32)
    return des, cat.astype(np.uint32), rowindex


def _batch1(inputs):
    """Upstream clients send every tensor as one row: shape [1, n] (batch size 1)."""
    return [(name, arr[None, :], dtype) for name, arr, dtype in inputs]


def _expected(ref, des, cat, rowindex):
    keys, vectors, net = ref
    index = {int(k): i for i, k in enumerate(keys)}
    looked = np.stack(
        [
            vectors[index[int(k)]] if int(k) in index else np.zeros(vectors.shape[1], np.float32)
            for k in cat
        ]
    )
    n = (len(rowindex) - 1) // 26
    emb = combine_slots(looked, rowindex, net.tables[0].combiner, slot_num=26)
    return np.asarray(net.predict(des.reshape(n, 13), [emb]), np.float32).reshape(-1)


@pytest.mark.parametrize("name", sorted(SAMPLES))
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_upstream_sample_models_serve_predictions(samples, name, protocol):
    srv, refs = samples
    rng = np.random.default_rng(1)
    for n, multi in ((1, False), (10, True), (64, True), (8, "balanced")):
        des, cat, rowindex = _request(rng, refs[name][0], n, multi)
        out = infer_raw(
            srv,
            protocol,
            name,
            _batch1(
                [
                    ("DES", des, "FP32"),
                    ("CATCOLUMN", cat, "UINT32"),
                    ("ROWINDEX", rowindex, "INT32"),
                ]
            ),
        ).as_numpy("OUTPUT0")
        assert out.shape == (n,)
        np.testing.assert_allclose(
            out, _expected(refs[name], des, cat, rowindex), rtol=1e-5, atol=1e-6
        )
        assert np.all((out > 0) & (out < 1))


def _bad(rng, keys):
    des, cat, rowindex = _request(rng, keys, 4)
    decreasing = rowindex.copy()
    decreasing[5] = decreasing[4] - 1
    return {
        "ROWINDEX not non-decreasing": (
            [("DES", des, "FP32"), ("CATCOLUMN", cat, "UINT32"), ("ROWINDEX", decreasing, "INT32")],
            "decreases at position",
        ),
        "ROWINDEX past the end of CATCOLUMN": (
            [
                ("DES", des, "FP32"),
                ("CATCOLUMN", cat[:-2], "UINT32"),
                ("ROWINDEX", rowindex, "INT32"),
            ],
            "points past the end",
        ),
        "DES length not a multiple of dense_dim": (
            [
                ("DES", des[:-1], "FP32"),
                ("CATCOLUMN", cat, "UINT32"),
                ("ROWINDEX", rowindex, "INT32"),
            ],
            "not a multiple of dense_dim 13",
        ),
        "sample counts disagree": (
            [
                ("DES", des[:26], "FP32"),
                ("CATCOLUMN", cat, "UINT32"),
                ("ROWINDEX", rowindex, "INT32"),
            ],
            "DES holds 2 samples but ROWINDEX holds 4",
        ),
        "wrong key dtype": (
            [
                ("DES", des, "FP32"),
                ("CATCOLUMN", cat.astype(np.int32), "INT32"),
                ("ROWINDEX", rowindex, "INT32"),
            ],
            "CATCOLUMN",
        ),
        "NaN in DES": (
            [
                ("DES", np.where(np.arange(52) == 20, np.nan, des).astype(np.float32), "FP32"),
                ("CATCOLUMN", cat, "UINT32"),
                ("ROWINDEX", rowindex, "INT32"),
            ],
            "non-finite value (nan) at sample 1, feature 7",
        ),
        "inf in DES": (
            [
                ("DES", np.where(np.arange(52) == 0, -np.inf, des).astype(np.float32), "FP32"),
                ("CATCOLUMN", cat, "UINT32"),
                ("ROWINDEX", rowindex, "INT32"),
            ],
            "non-finite value (-inf)",
        ),
    }


BAD_CASES = [
    "ROWINDEX not non-decreasing",
    "ROWINDEX past the end of CATCOLUMN",
    "DES length not a multiple of dense_dim",
    "sample counts disagree",
    "wrong key dtype",
    "NaN in DES",
    "inf in DES",
    "more samples than max_batch_size",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(samples, case):
    from tritonclient.utils import InferenceServerException

    srv, refs = samples
    rng = np.random.default_rng(2)
    if case == "more samples than max_batch_size":
        des, cat, rowindex = _request(rng, refs["dcn"][0], 65)
        inputs, needle = (
            [("DES", des, "FP32"), ("CATCOLUMN", cat, "UINT32"), ("ROWINDEX", rowindex, "INT32")],
            "holds 65 samples, more than max_batch_size 64",
        )
    else:
        inputs, needle = _bad(rng, refs["dcn"][0])[case]
    with pytest.raises(InferenceServerException) as e:
        infer_raw(srv, "grpc", "dcn", _batch1(inputs))
    assert needle in str(e.value), str(e.value)
    with make_client(srv, "http") as client:
        assert client.is_server_ready() and client.is_model_ready("dcn")
    des, cat, rowindex = _request(rng, refs["dcn"][0], 3)
    out = infer_raw(
        srv,
        "http",
        "dcn",
        _batch1(
            [("DES", des, "FP32"), ("CATCOLUMN", cat, "UINT32"), ("ROWINDEX", rowindex, "INT32")]
        ),
    ).as_numpy("OUTPUT0")
    np.testing.assert_allclose(
        out, _expected(refs["dcn"], des, cat, rowindex), rtol=1e-5, atol=1e-6
    )


def _looked_up(ref, cat):
    keys, vectors, _ = ref
    index = {int(k): i for i, k in enumerate(keys)}
    zero = np.zeros(vectors.shape[1], np.float32)
    return np.stack([vectors[index[int(k)]] if int(k) in index else zero for k in cat])


@pytest.mark.parametrize("name", sorted(SAMPLES))
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_dense_step_of_an_ensemble_predicts_from_the_embeddings(samples, name, protocol):
    """backend "dense" on a HugeCTR network (natively on the native path): the same
    predictions as the whole model; a malformed request is refused, naming EMBEDDINGS,
    and the next one is answered."""
    srv, refs = samples
    rng = np.random.default_rng(7)
    for n, multi in ((1, False), (10, True), (64, True), (8, "balanced")):
        des, cat, rowindex = _request(rng, refs[name][0], n, multi)
        emb = _looked_up(refs[name], cat).reshape(-1)
        inputs = [
            ("DES", des, "FP32"),
            ("EMBEDDINGS", emb, "FP32"),
            ("ROWINDEX", rowindex, "INT32"),
        ]
        out = infer_raw(srv, protocol, f"{name}_dense", inputs).as_numpy("OUTPUT0")
        assert out.shape == (n,)
        np.testing.assert_allclose(
            out, _expected(refs[name], des, cat, rowindex), rtol=1e-5, atol=1e-6
        )
    short = [
        ("DES", des, "FP32"),
        ("EMBEDDINGS", emb[:-1], "FP32"),
        ("ROWINDEX", rowindex, "INT32"),
    ]
    with pytest.raises(Exception, match="EMBEDDINGS has"):
        infer_raw(srv, protocol, f"{name}_dense", short)
    # the native check reads a chunk at a time: a value in the first and in the last
    for at, value in ((5, np.nan), (emb.size - 1, -np.inf)):
        bad = emb.copy()
        bad[at] = value
        with pytest.raises(Exception, match="EMBEDDINGS holds a non-finite value"):
            infer_raw(
                srv, protocol, f"{name}_dense", [inputs[0], ("EMBEDDINGS", bad, "FP32"), inputs[2]]
            )
    again = infer_raw(srv, protocol, f"{name}_dense", inputs).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(again, out)


def test_the_load_log_says_which_request_path_each_instance_runs(samples):
    srv, refs = samples
    log = srv.log_path.read_text()
    for name in [*refs, *(f"{r}_dense" for r in refs)]:
        lines = [x for x in log.splitlines() if f"model '{name}' instance" in x]
        if srv.request_path == "python":
            assert lines == [], lines  # the Python backend: no native library loaded
        else:  # every upstream sample network and its tables run without Python
            assert lines and all("request path native" in x for x in lines), lines


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_keys_answered_with_the_default_are_reported_and_exact_is_taken(
    samples, protocol, request_path
):
    """Issue 15: keys 1, 2, 3 of every request are in no table. The native backend sends
    the counts as response parameters (the 2.51 Python backend cannot); both paths take
    the request parameter ``exact``."""
    from tests.e2e.conftest import client_module

    srv, refs = samples
    name = sorted(SAMPLES)[0]
    tc = client_module(protocol)
    des, cat, rowindex = _request(np.random.default_rng(7), refs[name][0], 2)
    ins = []
    for n, arr, dt in _batch1(
        [("DES", des, "FP32"), ("CATCOLUMN", cat, "UINT32"), ("ROWINDEX", rowindex, "INT32")]
    ):
        ins.append(tc.InferInput(n, list(arr.shape), dt))
        ins[-1].set_data_from_numpy(arr)
    with make_client(srv, protocol) as client:
        r = client.infer(name, ins, parameters={"exact": True})
    np.testing.assert_allclose(
        r.as_numpy("OUTPUT0"), _expected(refs[name], des, cat, rowindex), rtol=1e-5, atol=1e-6
    )
    if request_path == "native":
        if protocol == "http":
            params = r.get_response()["parameters"]
        else:
            p = r.get_response().parameters
            params = {k: p[k].int64_param for k in p}
        assert params["DefaultNotFound"] == 3 and params["DefaultAsync"] == 0
        assert params["NumSample"] == 2
