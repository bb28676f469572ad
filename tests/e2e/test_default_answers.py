"""End to end: every hps response says how many of its keys were answered with the
default value, by cause; ``exact: true`` makes a request fetch every miss; the
Prometheus counter per table (issue 15).

``hps_two`` (conftest) has a cache with HPS's default ``hit_rate_threshold`` 0.9, two
instances, and declares the optional INT32 outputs ``DefaultNotFound`` /
``DefaultAsync``. The native request path also sends them as response parameters (the
2.51 Python backend cannot attach response parameters).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import numpy as np
import pytest

from tests.e2e.conftest import MAPPED_TABLE, TWO_TABLES, client_module, make_client

OUTPUTS = ("OUTPUT0", "DefaultNotFound", "DefaultAsync")


@pytest.fixture(scope="module")
def two_tables(model_repo):
    conf_dir = model_repo / "hps_two" / "conf"
    entry = json.loads((conf_dir / "two.json").read_text())["models"][0]
    tables = []
    for path, vec in zip(entry["sparse_files"], entry["embedding_vecsize_per_table"]):
        keys = np.fromfile(os.path.join(conf_dir, path, "key"), dtype="<i8")
        vecs = np.fromfile(os.path.join(conf_dir, path, "emb_vector"), dtype="<f4")
        tables.append((keys, vecs.reshape(-1, vec)))
    return tables


def _infer(server, protocol, keys_per_table, parameters=None):
    tc = client_module(protocol)
    keys = np.concatenate(keys_per_table).astype(np.int64)[None, :]
    numkeys = np.array([[len(k) for k in keys_per_table]], np.int32)
    ins = [tc.InferInput("KEYS", list(keys.shape), "INT64")]
    ins.append(tc.InferInput("NUMKEYS", list(numkeys.shape), "INT32"))
    ins[0].set_data_from_numpy(keys)
    ins[1].set_data_from_numpy(numkeys)
    outs = [tc.InferRequestedOutput(o) for o in OUTPUTS]
    with make_client(server, protocol) as client:
        return client.infer("hps_two", ins, outputs=outs, parameters=parameters)


def _response_parameters(result, protocol):
    if protocol == "http":
        return dict(result.get_response().get("parameters") or {})
    params = result.get_response().parameters
    return {k: params[k].int64_param for k in params}


def _counts(result):
    return int(result.as_numpy("DefaultNotFound")[0]), int(result.as_numpy("DefaultAsync")[0])


def _fresh(tables, rng, n_item, n_user, unknown=0):
    """Keys no earlier test asked for (drawn from the tail of a shuffled table)."""
    out = []
    for (keys, _), n in zip(tables, (n_item, n_user)):
        k = rng.choice(keys, n, replace=False)
        k[:unknown] = rng.integers(2**62 + 1, 2**63 - 1, unknown)  # in no table
        out.append(k.astype(np.int64))
    return out


def _expected(tables, keys_per_table):
    parts = []
    for (keys, vecs), spec, ks in zip(tables, TWO_TABLES, keys_per_table):
        row = {int(k): i for i, k in enumerate(keys)}
        for k in ks:
            i = row.get(int(k))
            parts.append(vecs[i] if i is not None else np.full(vecs.shape[1], spec.default_value))
    return np.concatenate(parts).astype(np.float32)


def test_keys_no_tier_holds_are_counted_in_every_response(
    server, protocol, two_tables, request_path
):
    rng = np.random.default_rng(101 + (protocol == "grpc"))
    keys = _fresh(two_tables, rng, 3, 1, unknown=1)  # one unknown key in each table
    for _ in range(2):  # not cached: the second answer counts them again
        r = _infer(server, protocol, keys)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), _expected(two_tables, keys))
        assert _counts(r) == (2, 0)
    if request_path == "native":
        params = _response_parameters(r, protocol)
        assert params["DefaultNotFound"] == 2 and params["DefaultAsync"] == 0


def test_misses_answered_asynchronously_are_counted_and_exact_fetches_them(
    server, protocol, two_tables
):
    rng = np.random.default_rng(202 + (protocol == "grpc"))
    warm = _fresh(two_tables, rng, 60, 1)
    assert _counts(_infer(server, protocol, warm)) == (0, 0)  # hit rate 0: fetched now
    new = _fresh(two_tables, rng, 1, 0)[0]
    # 61 distinct item keys, 60 cached: hit rate >= 0.9, so the new key is answered
    # with the default at once and inserted in the background
    keys = [np.concatenate([warm[0], new]), warm[1]]
    r = _infer(server, protocol, keys)
    assert _counts(r) == (0, 1)
    out = r.as_numpy("OUTPUT0")
    item_vec = 32
    assert (out[60 * item_vec : 61 * item_vec] == TWO_TABLES[0].default_value).all()
    # the same kind of request with exact: true gets the stored row
    newer = _fresh(two_tables, rng, 1, 0)[0]
    keys = [np.concatenate([warm[0], newer]), warm[1]]
    r = _infer(server, protocol, keys, parameters={"exact": True})
    assert _counts(r) == (0, 0)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), _expected(two_tables, keys))


def test_a_malformed_exact_parameter_is_an_error_and_the_server_stays_ready(
    server, protocol, two_tables
):
    tc = client_module(protocol)
    keys = _fresh(two_tables, np.random.default_rng(303), 2, 1)
    with pytest.raises(tc.InferenceServerException, match="request parameter 'exact'"):
        _infer(server, protocol, keys, parameters={"exact": "maybe"})
    r = _infer(server, protocol, keys, parameters={"exact": "true"})
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), _expected(two_tables, keys))


def test_prometheus_counts_keys_no_tier_holds_per_table(server, two_tables):
    keys = _fresh(two_tables, np.random.default_rng(404), 2, 1, unknown=1)
    _infer(server, "http", keys)

    def counter():
        text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        lines = [
            ln
            for ln in text.splitlines()
            if ln.startswith("trec_cache_default_not_found_total")
            and 'model="hps_two"' in ln
            and 'table="item"' in ln
        ]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    deadline = time.monotonic() + 20
    while counter() < 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert counter() >= 1


def _python_calls(server, model):
    """trec_python_calls_total of ``model``, by ``what`` (absent series: 0)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    calls = {"request": 0.0, "misses": 0.0}
    for ln in text.splitlines():
        if ln.startswith("trec_python_calls_total{") and f'model="{model}"' in ln:
            what = ln.split('what="', 1)[1].split('"', 1)[0]
            calls[what] = float(ln.rsplit(" ", 1)[1])
    return calls


def test_no_well_formed_request_enters_python_misses_included(server, two_tables, request_path):
    """On the native path a node-local model's requests never call into Python, whatever
    they miss: fetched now (cold), answered with the default (warm, hit rate >= 0.9),
    ``exact``, keys no tier holds; only the malformed ones do, one call each."""
    before = _python_calls(server, "hps_two")
    if request_path != "native":  # the Python backend: no native path, no such counter
        assert before == {"request": 0.0, "misses": 0.0}
        return
    rng = np.random.default_rng(505)
    good = 0
    for protocol in ("http", "grpc"):
        warm = _fresh(two_tables, rng, 60, 1)
        assert _counts(_infer(server, protocol, warm)) == (0, 0)  # cold: fetched now
        keys = [np.concatenate([warm[0], _fresh(two_tables, rng, 1, 0)[0]]), warm[1]]
        assert _counts(_infer(server, protocol, keys)) == (0, 1)  # one miss, deferred
        keys = [np.concatenate([warm[0], _fresh(two_tables, rng, 1, 0)[0]]), warm[1]]
        r = _infer(server, protocol, keys, parameters={"exact": True})
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), _expected(two_tables, keys))
        unknown = _fresh(two_tables, rng, 3, 1, unknown=1)
        assert _counts(_infer(server, protocol, unknown)) == (2, 0)
        good += 4
    assert _python_calls(server, "hps_two") == before, f"{good} good requests entered Python"
    tc = client_module("http")
    bad = [np.arange(5, dtype=np.int64)], [np.arange(3, dtype=np.int64)]
    for keys_per_table in bad:  # NUMKEYS has one count, the model two tables
        with pytest.raises(tc.InferenceServerException, match="NUMKEYS"):
            _infer(server, "http", keys_per_table)
    after = _python_calls(server, "hps_two")
    assert after == {"request": before["request"] + 2, "misses": before["misses"]}


def test_a_large_request_to_a_mapped_table_is_answered_in_place_with_its_defaults_counted(
    server, protocol, model_repo, request_path
):
    # hps_mapped's one table has no cache: the native path looks up a large request's keys
    # of it in ranges (hps_path: 10,000 keys, three ranges of kRangeNs or more), each range
    # on the next idle core with its own default count. Every key's row lands at its own
    # place, and every unknown key, in whichever range, is answered with the default and
    # counted once.
    table = MAPPED_TABLE[0]
    sparse = model_repo / "hps_mapped" / "1" / "hps_mapped0_sparse_0.model"
    stored = np.fromfile(sparse / "key", dtype="<i8")
    vecs = np.fromfile(sparse / "emb_vector", dtype="<f4").reshape(-1, table.vec_size)
    rng = np.random.default_rng(303 + (protocol == "grpc"))
    keys = rng.choice(stored, 10_000)  # repeats included
    unknown = rng.choice(len(keys), 37, replace=False)
    keys[unknown] = rng.integers(2**62 + 1, 2**63 - 1, len(unknown))
    row = {int(k): i for i, k in enumerate(stored)}
    want = np.stack([vecs[row[int(k)]] if int(k) in row else np.full(table.vec_size,
                     table.default_value, np.float32) for k in keys])  # fmt: skip
    tc = client_module(protocol)
    ins = [
        tc.InferInput("KEYS", [1, len(keys)], "INT64"),
        tc.InferInput("NUMKEYS", [1, 1], "INT32"),
    ]
    ins[0].set_data_from_numpy(keys[None, :].astype(np.int64))
    ins[1].set_data_from_numpy(np.array([[len(keys)]], np.int32))
    outs = [tc.InferRequestedOutput(o) for o in ("OUTPUT0", "DefaultNotFound")]
    with make_client(server, protocol) as client:
        for _ in range(3):
            r = client.infer("hps_mapped", ins, outputs=outs)
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0").reshape(want.shape), want)
            assert int(r.as_numpy("DefaultNotFound")[0]) == len(unknown)
