"""LookupSession: HPS request validation and table-major answers."""

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from triton_rec.config.ps_json import parse_ps_config
from triton_rec.errors import DuplicateKeyError, RequestError
from triton_rec.serving.session import LookupSession
from triton_rec.storage.table import EmbeddingTable

SEED = 11
WDL = [
    SyntheticTable(
        "embedding_table1", rows=500, vec_size=1, max_keys_per_sample=2, default_value=0.5
    ),
    SyntheticTable(
        "embedding_table2", rows=3000, vec_size=16, max_keys_per_sample=26, default_value=-2.0
    ),
]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    entry = write_model(str(repo), "wdl", WDL, seed=SEED)
    entry["max_batch_size"] = 16
    cfg = parse_ps_config({"supportlonglong": True, "models": [entry]}, base_dir=str(repo))
    return LookupSession.from_params(cfg.model("wdl"))


def _expected(keys_per_table):
    """Independent reference: the generator's formula, default value for unknown keys."""
    parts = []
    for t, keys in enumerate(keys_per_table):
        known = set(table_keys(SEED, t, WDL[t].rows).tolist())
        vec = expected_vectors(SEED, t, keys, WDL[t].vec_size)
        for i, k in enumerate(keys):
            if int(k) not in known:
                vec[i] = WDL[t].default_value
        parts.append(vec.reshape(-1))
    return np.concatenate(parts)


def _request(rng, samples, unknown=0):
    per_table = []
    for t, spec in enumerate(WDL):
        keys = rng.choice(table_keys(SEED, t, spec.rows), samples * spec.max_keys_per_sample)
        keys[:unknown] = rng.integers(2**62, 2**63 - 1, unknown)  # outside the generator's range
        per_table.append(keys.astype(np.int64))
    return per_table


def test_the_wdl_sample_request_has_the_documented_output_length(session):
    rng = np.random.default_rng(0)
    per_table = _request(rng, samples=10)
    keys = np.concatenate(per_table)[None, :]
    assert keys.shape == (1, 280)
    req = session.parse_request(keys, np.array([[20, 260]], np.int32))
    out = session.lookup(req)
    assert out.shape == (4180,) and out.dtype == np.float32
    assert req.num_samples == 10
    np.testing.assert_array_equal(out, _expected(per_table))


def test_unknown_keys_get_each_tables_default_value(session):
    rng = np.random.default_rng(1)
    per_table = _request(rng, samples=3, unknown=2)
    req = session.parse_request(np.concatenate(per_table), np.array([6, 78], np.int32))
    out = session.lookup(req)
    np.testing.assert_array_equal(out, _expected(per_table))
    assert out[0] == 0.5 and out[1] == 0.5
    assert np.all(out[6 : 6 + 32] == -2.0)


def test_several_requests_looked_up_together_equal_one_by_one(session):
    rng = np.random.default_rng(2)
    reqs, refs = [], []
    for samples in (1, 4, 2, 7):
        per_table = _request(rng, samples, unknown=1)
        counts = np.array([len(k) for k in per_table], np.int32)
        reqs.append(session.parse_request(np.concatenate(per_table), counts))
        refs.append(_expected(per_table))
    together = session.lookup_many(reqs)
    for got, ref, req in zip(together, refs, reqs):
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(got, session.lookup(req))


def test_a_table_may_receive_no_keys(session):
    rng = np.random.default_rng(3)
    keys = rng.choice(table_keys(SEED, 1, 3000), 26)
    req = session.parse_request(keys, np.array([0, 26], np.int32))
    np.testing.assert_array_equal(session.lookup(req), _expected([np.empty(0, np.int64), keys]))
    assert req.num_samples == 1


@pytest.mark.parametrize(
    "keys, numkeys, needle",
    [
        (
            np.arange(28),
            np.array([2, 26, 0], np.int32),
            "NUMKEYS has 3 counts but the model has 2 tables",
        ),
        (np.arange(28), np.array([2], np.int32), "NUMKEYS has 1 counts but the model has 2 tables"),
        (
            np.arange(28),
            np.array([[2, 26], [2, 26]], np.int32),
            "NUMKEYS must have shape [2] or [1, 2]",
        ),
        (
            np.arange(28),
            np.array([30, -2], np.int32),
            "NUMKEYS[1] (table 'embedding_table2') is negative: -2",
        ),
        (np.arange(28), np.array([2, 25], np.int32), "NUMKEYS sums to 27 but KEYS has 28 keys"),
        (np.arange(0), np.array([0, 0], np.int32), "empty request"),
        (np.arange(28).astype(np.int32), np.array([2, 26], np.int32), "KEYS must be INT64"),
        (np.arange(17 * 28), np.array([34, 17 * 26], np.int32), "holds 17 samples"),
        (np.arange(40), np.array([34, 6], np.int32), "more than max_batch_size 16"),
    ],
)
def test_malformed_requests_are_rejected_with_a_clear_message(session, keys, numkeys, needle):
    with pytest.raises(RequestError) as e:
        session.parse_request(
            keys.astype(keys.dtype if keys.dtype == np.int32 else np.int64), numkeys
        )
    assert needle in str(e.value)
    assert "model 'wdl'" in str(e.value)


def test_the_largest_allowed_batch_is_accepted(session):
    req = session.parse_request(
        np.arange(16 * 28, dtype=np.int64), np.array([32, 16 * 26], np.int32)
    )
    assert req.num_samples == 16
    assert session.lookup(req).shape == (32 + 16 * 26 * 16,)


def test_duplicate_keys_in_a_table_fail_naming_the_file():
    keys = np.array([5, 7, 5], np.int64)
    with pytest.raises(DuplicateKeyError) as e:
        EmbeddingTable("t", keys, np.zeros((3, 2), np.float32), path="/models/t0_sparse_0.model")
    assert "/models/t0_sparse_0.model" in str(e.value) and "5" in str(e.value)
