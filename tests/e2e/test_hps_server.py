"""End to end: a real tritonserver serves hps models over HTTP and gRPC."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os

import numpy as np
import pytest

from tests.e2e.conftest import TWO_TABLES, WDL_TABLES, infer_raw, make_client

# -- an independent reference: read the raw files with numpy, answer with a dict ----------


def _reference(base_dir, entry, defaults):
    """Read the raw files of a ps.json entry with numpy; answer lookups with a dict."""
    tables = []
    for path, vec in zip(entry["sparse_files"], entry["embedding_vecsize_per_table"]):
        keys = np.fromfile(os.path.join(base_dir, path, "key"), dtype="<i8")
        vecs = np.fromfile(os.path.join(base_dir, path, "emb_vector"), dtype="<f4").reshape(-1, vec)
        tables.append(({int(k): i for i, k in enumerate(keys)}, vecs, keys))

    def answer(keys_per_table):
        parts = []
        for (index, vecs, _), keys, default in zip(tables, keys_per_table, defaults):
            for k in keys:
                row = index.get(int(k))
                parts.append(
                    vecs[row] if row is not None else np.full(vecs.shape[1], default, np.float32)
                )
        return np.concatenate(parts) if parts else np.empty(0, np.float32)

    return tables, answer


@pytest.fixture(scope="module")
def wdl_ref(model_repo):
    ps = json.loads((model_repo / "ps.json").read_text())
    entry = next(m for m in ps["models"] if m["model"] == "hps_wdl")
    return _reference(model_repo, entry, [t.default_value for t in WDL_TABLES])


@pytest.fixture(scope="module")
def two_ref(model_repo):
    # hps_two's ps.json is its own file; its sparse paths are relative to it.
    conf_dir = model_repo / "hps_two" / "conf"
    entry = json.loads((conf_dir / "two.json").read_text())["models"][0]
    return _reference(conf_dir, entry, [t.default_value for t in TWO_TABLES])


def _draw(tables, specs, samples, rng, unknown=0):
    out = []
    for (_, _, keys), spec in zip(tables, specs):
        k = rng.choice(keys, samples * spec.max_keys_per_sample)
        k[:unknown] = rng.integers(2**62 + 1, 2**63 - 1, unknown)  # in no table
        out.append(k.astype(np.int64))
    return out


def _hps(server, protocol, model, keys_per_table, outputs=("OUTPUT0",), flat=False):
    keys = np.concatenate(keys_per_table).astype(np.int64)
    numkeys = np.array([len(k) for k in keys_per_table], np.int32)
    if not flat:
        keys, numkeys = keys[None, :], numkeys[None, :]
    return infer_raw(
        server, protocol, model, [("KEYS", keys, "INT64"), ("NUMKEYS", numkeys, "INT32")], outputs
    )


# -- correct answers --------------------------------------------------------------------


def test_the_upstream_wdl_sample_request_is_answered_exactly(server, protocol, wdl_ref):
    tables, answer = wdl_ref
    keys = _draw(tables, WDL_TABLES, samples=10, rng=np.random.default_rng(1), unknown=3)
    assert sum(len(k) for k in keys) == 280
    out = _hps(server, protocol, "hps_wdl", keys).as_numpy("OUTPUT0")
    assert out.shape == (4180,) and out.dtype == np.float32
    np.testing.assert_array_equal(out, answer(keys))


def test_one_dimensional_numkeys_is_accepted_where_the_config_allows_it(server, protocol, wdl_ref):
    tables, answer = wdl_ref
    keys = _draw(tables, WDL_TABLES, samples=3, rng=np.random.default_rng(2))
    out = _hps(server, protocol, "hps_flat", keys, flat=True).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, answer(keys))


def test_response_information_is_available_as_outputs(server, protocol, two_ref):
    tables, answer = two_ref
    keys = _draw(tables, TWO_TABLES, samples=7, rng=np.random.default_rng(3), unknown=1)
    r = _hps(server, protocol, "hps_two", keys, outputs=("OUTPUT0", "NumSample", "DeviceID"))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), answer(keys))
    assert r.as_numpy("NumSample").tolist() == [7]
    assert r.as_numpy("DeviceID").tolist() == [0]


def test_two_models_and_two_instances_serve_concurrent_clients_correctly(server, wdl_ref, two_ref):
    jobs = []
    rng = np.random.default_rng(4)
    for i in range(48):
        model, (tables, answer), specs = (
            ("hps_two", two_ref, TWO_TABLES) if i % 2 else ("hps_wdl", wdl_ref, WDL_TABLES)
        )
        keys = _draw(tables, specs, samples=int(rng.integers(1, 40)), rng=rng, unknown=i % 3)
        jobs.append((model, keys, answer(keys), "grpc" if i % 4 < 2 else "http"))

    def run(job):
        model, keys, expected, proto = job
        out = _hps(server, proto, model, keys).as_numpy("OUTPUT0")
        return np.array_equal(out, expected)

    with cf.ThreadPoolExecutor(12) as ex:
        results = list(ex.map(run, jobs))
    assert all(results)
    # Requests did arrive together: the dynamic batcher formed batches larger than 1.
    with make_client(server, "http") as client:
        stats = client.get_inference_statistics("hps_two")
    batch_sizes = [int(b["batch_size"]) for b in stats["model_stats"][0]["batch_stats"]]
    assert batch_sizes, stats


# -- bad input: a clear error, the server stays ready, the next request is right ----------


BAD_REQUESTS = {
    "wrong KEYS dtype": (
        [
            ("KEYS", np.arange(28, dtype=np.int32)[None], "INT32"),
            ("NUMKEYS", np.array([[2, 26]], np.int32), "INT32"),
        ],
        "KEYS",
    ),
    "wrong NUMKEYS dtype": (
        [
            ("KEYS", np.arange(28, dtype=np.int64)[None], "INT64"),
            ("NUMKEYS", np.array([[2, 26]], np.int64), "INT64"),
        ],
        "NUMKEYS",
    ),
    "NUMKEYS do not sum to len(KEYS)": (
        [
            ("KEYS", np.arange(28, dtype=np.int64)[None], "INT64"),
            ("NUMKEYS", np.array([[2, 20]], np.int32), "INT32"),
        ],
        "NUMKEYS sums to 22 but KEYS has 28 keys",
    ),
    "negative count": (
        [
            ("KEYS", np.arange(28, dtype=np.int64)[None], "INT64"),
            ("NUMKEYS", np.array([[30, -2]], np.int32), "INT32"),
        ],
        "is negative: -2",
    ),
    "missing NUMKEYS": ([("KEYS", np.arange(28, dtype=np.int64)[None], "INT64")], "NUMKEYS"),
    "missing counts (one table short)": (
        [
            ("KEYS", np.arange(28, dtype=np.int64)[None], "INT64"),
            ("NUMKEYS", np.array([[28]], np.int32), "INT32"),
        ],
        "NUMKEYS has 1 counts but the model has 2 tables",
    ),
    "wrong number of tables": (
        [
            ("KEYS", np.arange(28, dtype=np.int64)[None], "INT64"),
            ("NUMKEYS", np.array([[2, 26, 0]], np.int32), "INT32"),
        ],
        "NUMKEYS has 3 counts but the model has 2 tables",
    ),
    "more samples than max_batch_size": (
        [
            ("KEYS", np.arange(65 * 4, dtype=np.int64)[None], "INT64"),
            ("NUMKEYS", np.array([[65 * 3, 65]], np.int32), "INT32"),
        ],
        "more than max_batch_size 64",
    ),
    "empty request": (
        [
            ("KEYS", np.zeros((1, 0), np.int64), "INT64"),
            ("NUMKEYS", np.array([[0, 0]], np.int32), "INT32"),
        ],
        "empty request",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_a_clear_error_and_the_server_keeps_serving(
    server, protocol, case, two_ref
):
    from tritonclient.utils import InferenceServerException

    inputs, needle = BAD_REQUESTS[case]
    model = "hps_two"
    with pytest.raises(InferenceServerException) as e:
        infer_raw(server, protocol, model, inputs)
    assert needle in str(e.value), str(e.value)
    with make_client(server, protocol) as client:
        assert client.is_server_ready() and client.is_model_ready(model)
    tables, answer = two_ref
    keys = _draw(tables, TWO_TABLES, samples=2, rng=np.random.default_rng(5))
    np.testing.assert_array_equal(
        _hps(server, protocol, model, keys).as_numpy("OUTPUT0"), answer(keys)
    )


def test_a_bad_request_batched_with_good_ones_fails_alone(server, two_ref):
    """Requests that share one execute() call: only the malformed one gets an error."""
    from tritonclient.utils import InferenceServerException

    tables, answer = two_ref
    rng = np.random.default_rng(6)

    def good(_):
        keys = _draw(
            tables, TWO_TABLES, samples=3, rng=np.random.default_rng(int(rng.integers(1 << 30)))
        )
        return np.array_equal(
            _hps(server, "grpc", "hps_two", keys).as_numpy("OUTPUT0"), answer(keys)
        )

    def bad(_):
        inputs, needle = BAD_REQUESTS["NUMKEYS do not sum to len(KEYS)"]
        try:
            infer_raw(server, "grpc", "hps_two", inputs)
        except InferenceServerException as e:
            return needle in str(e)
        return False

    with cf.ThreadPoolExecutor(8) as ex:
        futures = [ex.submit(bad if i % 3 == 0 else good, i) for i in range(30)]
        assert all(f.result() for f in futures)


# -- broken model files fail the load, naming the file ---------------------------------------


@pytest.mark.parametrize(
    "model, names",
    [
        ("bad_missing", "nowhere/t1_sparse_0.model"),
        ("bad_truncated", "bad_truncated1_sparse_0.model/emb_vector"),
    ],
)
def test_a_broken_sparse_file_fails_the_load_naming_the_file(server, model, names, wdl_ref):
    from tritonclient.utils import InferenceServerException

    with make_client(server, "http") as client:
        with pytest.raises(InferenceServerException) as e:
            client.load_model(model)
        assert names in str(e.value), str(e.value)
        assert not client.is_model_ready(model)
        # (With Triton's default strict readiness a failed load makes /v2/health/ready
        # report false; the server is live and keeps serving its other models.)
        assert client.is_server_live() and client.is_model_ready("hps_wdl")
    tables, answer = wdl_ref
    keys = _draw(tables, WDL_TABLES, samples=1, rng=np.random.default_rng(7))
    np.testing.assert_array_equal(
        _hps(server, "http", "hps_wdl", keys).as_numpy("OUTPUT0"), answer(keys)
    )


def test_the_load_log_says_which_request_path_each_instance_runs(server):
    lines = [x for x in server.log_path.read_text().splitlines() if "request path" in x]
    if server.request_path == "python":
        assert lines == []
    else:  # node-local tables and a CPU cache: every hps instance is served natively
        for model in ("hps_wdl", "hps_two", "hps_flat"):
            mine = [x for x in lines if f"model '{model}' instance" in x]
            assert mine and all("request path native" in x for x in mine), lines
