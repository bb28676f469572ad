"""End to end: hps models whose tables are stored in fp16 and int8 (issue 15), through a
real tritonserver on both request paths: through the shared cache (misses fetched
encoded from the store, hits decoded by the cache query) and straight from the mapped
table (the fused gather decodes). Expected answers are decoded here from the raw
sparse files with numpy (half precision; the fused 8-bit row-wise formula written out),
independently of triton_rec.precision."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, write_model
from tests.e2e.conftest import hps_config, infer_raw
from triton_rec.triton.runtime import TritonServer

TABLES = [
    SyntheticTable("item", rows=4000, vec_size=24, max_keys_per_sample=3, default_value=0.1),
    SyntheticTable("user", rows=1500, vec_size=8, max_keys_per_sample=1, default_value=-2.0),
]
PRECISIONS = ["fp16", "int8"]


def _decode(precision, v):
    if precision == "fp16":
        return v.astype(np.float16).astype(np.float32)
    lo = v.min(axis=1, keepdims=True)
    rng = v.max(axis=1, keepdims=True) - lo
    q = np.clip(np.rint((v - lo) * (np.float32(255.0) / (rng + np.float32(1e-8)))), 0, 255)
    scale = (rng / np.float32(255.0)).astype(np.float32)
    return (q.astype(np.float32) * scale + lo).astype(np.float32)


@pytest.fixture(scope="module")
def precision_server(tmp_path_factory, nothing_left_in_dev_shm, store_dir, request_path):
    repo = tmp_path_factory.mktemp("precision-repo")
    entries, refs = [], {}
    for cached in (True, False):
        name = f"hps_p_{'cache' if cached else 'table'}"
        entry = write_model(str(repo), name, TABLES, seed=11)
        entry.update(
            embedding_precision=PRECISIONS,
            gpucache=cached,
            hit_rate_threshold=1.1,  # every miss fetched now: exact answers
        )
        entries.append(entry)
        tables = []
        for path, t, p in zip(entry["sparse_files"], TABLES, PRECISIONS):
            keys = np.fromfile(os.path.join(repo, path, "key"), dtype="<i8")
            vecs = np.fromfile(os.path.join(repo, path, "emb_vector"), dtype="<f4")
            tables.append((keys, _decode(p, vecs.reshape(-1, t.vec_size))))
        refs[name] = tables
        (repo / name / "config.pbtxt").write_text(hps_config(name, 1))
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": entries}))
    log = tmp_path_factory.mktemp("precision-logs") / "tritonserver.log"
    with TritonServer(
        repo, log_path=log, env={"TRITON_REC_STORE": str(store_dir)}, request_path=request_path
    ) as srv:
        yield srv, refs, log


@pytest.mark.parametrize("model", ["hps_p_cache", "hps_p_table"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_encoded_tables_are_served_decoded(precision_server, model, protocol):
    srv, refs, _ = precision_server
    rng = np.random.default_rng(3)
    for _ in range(2):  # the second time through the cache: hits, decoded by the query
        parts, want = [], []
        for (keys, decoded), t in zip(refs[model], TABLES):
            idx = rng.integers(0, keys.shape[0], 5 * t.max_keys_per_sample)
            k = keys[idx]
            k[0] = 2**62 + 7  # in no table: exactly the default value
            parts.append(k)
            want.append(decoded[idx].copy())
            want[-1][0] = t.default_value
        keys = np.concatenate(parts)[None, :]
        numkeys = np.array([[len(p) for p in parts]], np.int32)
        out = infer_raw(
            srv, protocol, model, [("KEYS", keys, "INT64"), ("NUMKEYS", numkeys, "INT32")]
        ).as_numpy("OUTPUT0")
        np.testing.assert_array_equal(out, np.concatenate([w.reshape(-1) for w in want]))


def test_the_load_log_names_each_table_s_precision(precision_server, request_path):
    srv, _, log = precision_server
    text = log.read_text()
    assert text.count("item: fp16 cache=") >= 2 and text.count("user: int8 cache=") >= 2
    if request_path == "native":  # encoded tables keep the native path
        assert text.count("request path native") >= 2, text[-3000:]
