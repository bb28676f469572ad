"""``ps-loader criteo-dlrm``: the generated Criteo DLRM's sizes, files, perf inputs, --help.

Expected values come from the issue and upstream, written out here: MLPerf's 40M-capped
Criteo 1TB row counts (HugeCTR samples/dlrm/dgx_a100.py, ``slot_size_array``), the
network's layer widths; served answers are checked in tests/e2e/test_criteo_dlrm.py.
"""

from __future__ import annotations

import base64
import json
import math
import os

import numpy as np
import pytest

from ps_loader import criteo
from ps_loader.__main__ import main
from tests.criteo_reference import DENSE_FLOATS, load_dense, load_sparse_dirs, predict
from triton_rec.config.ps_json import load_ps_config
from triton_rec.dense.hugectr_network import HugeCTRNetwork
from triton_rec.formats.tables import read_table, read_table_rows

UPSTREAM_ROWS = [
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
    2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771,
    25641295, 39664984, 585935, 12972, 108, 36,
]  # fmt: skip
SMALL = {5: 3, 8: 63, 12: 10, 15: 155, 16: 4, 17: 976, 18: 14, 24: 108, 25: 36}  # <= 1000 rows


def test_the_tables_are_mlperf_s_criteo_1tb_tables():
    assert list(criteo.CRITEO_1TB_ROWS) == UPSTREAM_ROWS
    assert sum(UPSTREAM_ROWS) == 187_767_399


def test_row_counts_at_a_scale_are_the_full_counts_times_the_scale_rounded_up():
    rows = criteo.table_rows(0.001)
    assert rows[0] == 39_885  # 39,884.406 rounded up
    assert rows[9] == 38_533 and rows[19] == 39_980 and rows[21] == 39_665
    assert rows[10] == 2_954 and rows[11] == 1_000  # 403.346 -> never fewer than 1,000
    assert rows[1] == 1_000  # 39.043 -> 1,000
    assert criteo.table_rows(1.0) == UPSTREAM_ROWS
    assert criteo.table_rows(0.5)[0] == 19_942_203


def test_small_tables_are_kept_whole_and_no_table_gets_fewer_than_min_rows():
    rows = criteo.table_rows(1e-6)
    for t, r in enumerate(rows):
        assert r == SMALL.get(t, 1000), t
    rows = criteo.table_rows(1e-6, min_rows=50)
    assert [r for r in rows if r < 50] == [3, 10, 4, 14, 36]


def _generate(tmp_path, **kw):
    args = dict(scale=1e-5, min_rows=60, batch_sizes=(), seed=7)
    args.update(kw)
    return criteo.write_criteo_dlrm(str(tmp_path), **args)


def test_the_fp32_files_are_read_by_the_project_s_readers(tmp_path):
    w = _generate(tmp_path, name="m")
    params = load_ps_config(str(tmp_path / "ps.json")).model("m")
    assert len(params.tables) == 26
    offset = 0
    for t, (table, rows) in enumerate(zip(params.tables, w.rows)):
        keys, vectors = read_table(table.sparse_file, table.vec_size)
        assert table.vec_size == 128 and keys.shape == (rows,)
        np.testing.assert_array_equal(keys, np.arange(rows) + offset)
        np.testing.assert_array_equal(vectors, criteo.table_vectors(7, t, keys))
        offset += UPSTREAM_ROWS[t]  # a table's keys start after the full-size tables before it
    vectors = read_table(params.tables[0].sparse_file, 128)[1]
    assert np.abs(vectors).max() <= 0.25 and vectors.std() > 0.1
    net = HugeCTRNetwork.load(params.network_file, params.dense_file)
    assert net.dense_dim == 13 and net.label_dim == 1 and len(net.tables) == 26
    assert os.path.getsize(params.dense_file) == 4 * DENSE_FLOATS == 4 * 2_369_921


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_reduced_precision_tables_are_encoded_npz_tables(tmp_path, precision):
    _generate(tmp_path, name="q", precision=precision)
    params = load_ps_config(str(tmp_path / "ps.json")).model("q")
    assert [t.precision for t in params.tables] == [precision] * 26
    t = params.tables[3]
    keys, rows, codec = read_table_rows(t.sparse_file, 128)
    assert t.sparse_file.endswith(".npz") and codec.precision == precision
    np.testing.assert_array_equal(rows, codec.encode(criteo.table_vectors(7, 3, keys)))


def test_a_table_written_in_chunks_is_byte_for_byte_the_table_written_at_once(tmp_path):
    for precision, name in (("fp32", "t.model"), ("int8", "t.npz")):
        a, b = str(tmp_path / f"a{name}"), str(tmp_path / f"b{name}")
        criteo.write_table(a, 1, 4, 1000, precision, chunk_rows=7)
        criteo.write_table(b, 1, 4, 1000, precision)
        (ka, ra, ca), (kb, rb, cb) = read_table_rows(a, 128), read_table_rows(b, 128)
        assert ca == cb and ca.precision == precision
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(ra, rb)
        assert not [f for f in os.listdir(tmp_path) if "partial" in f]


def test_vectors_depend_on_the_seed_the_table_and_the_key():
    keys = np.arange(5, dtype=np.int64)
    v = criteo.table_vectors(1, 2, keys)
    assert v.dtype == np.float32 and v.shape == (5, 128)
    np.testing.assert_array_equal(v[1:], criteo.table_vectors(1, 2, keys[1:]))
    assert not np.array_equal(v, criteo.table_vectors(2, 2, keys))
    assert not np.array_equal(v, criteo.table_vectors(1, 3, keys))


def _perf_file(path):
    """The requests of a perf input file, decoded here (content lists or base64)."""
    types = {"DES": "<f4", "CATCOLUMN": "<i8", "ROWINDEX": "<i4"}
    out = []
    for step in json.loads(open(path).read())["data"]:
        req = {}
        for name, value in step.items():
            if "b64" in value:
                req[name] = np.frombuffer(base64.b64decode(value["b64"]), types[name])
            else:
                req[name] = np.asarray(value["content"], types[name])
            assert value["shape"] == [req[name].size]
        out.append(req)
    return out


def test_perf_inputs_are_hugectr_requests_of_each_batch_size(tmp_path):
    w = _generate(tmp_path, name="p", batch_sizes=(3, 40), perf_requests=2, b64_from_batch=40)
    content, binary = (_perf_file(tmp_path / f"perf_p_{b}.json") for b in (3, 40))
    assert "b64" not in (tmp_path / "perf_p_3.json").read_text()
    assert '"b64"' in (tmp_path / "perf_p_40.json").read_text()
    for reqs, batch in ((content, 3), (binary, 40)):
        assert len(reqs) == 2
        for r in reqs:
            assert r["DES"].shape == (batch * 13,) and np.isfinite(r["DES"]).all()
            assert r["CATCOLUMN"].shape == (batch * 26,)
            np.testing.assert_array_equal(r["ROWINDEX"], np.tile(np.arange(batch + 1), 26))
            # sample-major: sample i's key of table t at i * 26 + t, in table t's range or unseen
            cat = r["CATCOLUMN"].reshape(batch, 26)
            offsets = np.concatenate([[0], np.cumsum(UPSTREAM_ROWS)[:-1]])
            seen = (cat >= offsets) & (cat < offsets + np.array(w.rows))
            assert (seen | (cat >= 2**31)).all()
    commands = (tmp_path / "perf_p.sh").read_text()
    assert "--input-data perf_p_40.json --shape DES:520 --shape CATCOLUMN:1040" in commands


def test_perf_keys_follow_a_power_law_with_one_percent_unseen():
    rng = np.random.default_rng(0)
    rows = [1_000_000] * 26
    req = criteo.perf_request(rng, rows, 20_000)
    cat = req["CATCOLUMN"].reshape(-1, 26)
    unseen = cat >= 2**31
    assert abs(unseen.mean() - 0.01) < 0.002
    assert np.unique(cat[unseen]).size > 0.99 * unseen.sum()  # unseen keys: spread out
    for t in (0, 13, 25):
        _, counts = np.unique(cat[~unseen[:, t], t], return_counts=True)
        assert counts.max() >= 100 * np.median(counts)
    # the rank-frequency slope of one table, in log-log: -alpha
    keys = criteo.zipf_rows(np.random.default_rng(1), 1_000_000, 400_000)
    counts = np.sort(np.unique(keys, return_counts=True)[1])[::-1][:100]
    slope = np.polyfit(np.log(np.arange(1, 101)), np.log(counts), 1)[0]
    assert -1.2 < slope < -0.9, slope


def test_predictions_are_spread_and_move_with_keys_and_dense_features(tmp_path):
    w = _generate(tmp_path, name="r", seed=0)
    bottom, top = load_dense(str(tmp_path / "r" / "1" / "r_dense_0.model"))
    tables = load_sparse_dirs(
        [str(tmp_path / "r" / "1" / f"r{t}_sparse_0.model") for t in range(26)]
    )
    req = criteo.perf_request(np.random.default_rng(5), w.rows, 512)
    des, cat = req["DES"].reshape(-1, 13), req["CATCOLUMN"].reshape(-1, 26)
    p = predict(bottom, top, tables, des, cat)
    lo, hi = np.percentile(p, [5, 95])
    assert 0.02 < lo and hi < 0.98 and hi - lo > 0.3, (lo, hi)
    by_keys = predict(bottom, top, tables, np.repeat(des[:1], 512, 0), cat)
    by_des = predict(bottom, top, tables, des, np.repeat(cat[:1], 512, 0))
    assert by_keys.std() > 0.05 and by_des.std() > 0.05, (by_keys.std(), by_des.std())


def test_the_cli_writes_config_and_ps_json_and_keeps_other_models(tmp_path, capsys):
    common = ["criteo-dlrm", "--out", str(tmp_path), "--scale", "0.00001", "--min-rows", "20"]
    assert main([*common, "--batch-sizes", "2", "--name", "a"]) == 0
    assert main([*common, "--batch-sizes", "", "--precision", "int8", "--kind", "KIND_GPU"]) == 0
    out = capsys.readouterr().out
    assert "table 26/26" in out and "wrote dlrm_criteo" in out
    cfg = (tmp_path / "dlrm_criteo" / "config.pbtxt").read_text()
    assert 'backend: "hugectr"' in cfg and "max_batch_size: 65536" in cfg
    assert "kind: KIND_GPU gpus: [ 0 ]" in cfg
    for name in ("DES", "CATCOLUMN", "ROWINDEX"):
        assert f'name: "{name}"' in cfg
    assert "kind: KIND_CPU" in (tmp_path / "a" / "config.pbtxt").read_text()
    doc = json.loads((tmp_path / "ps.json").read_text())
    assert [m["model"] for m in doc["models"]] == ["a", "dlrm_criteo"]
    entry = doc["models"][1]
    assert entry["gpucache"] is True and entry["gpucacheper"] == 0.2  # KIND_GPU: cached
    assert entry["whole_table_max_bytes"] == 64 << 20  # KIND_GPU: small tables whole
    assert doc["models"][0]["gpucache"] is False  # KIND_CPU: the mapped tables
    assert "whole_table_max_bytes" not in doc["models"][0]
    assert entry["hit_rate_threshold"] == 0.9 and entry["max_batch_size"] == 65536
    assert entry["deployed_device_list"] == [0] and entry["embedding_precision"] == ["int8"] * 26
    assert "embedding_precision" not in doc["models"][0]
    assert sorted(p.name for p in tmp_path.glob("perf_*")) == ["perf_a.sh", "perf_a_2.json"]


@pytest.mark.parametrize(
    "bad", [["--scale", "0"], ["--scale", "1.5"], ["--batch-sizes", "65537"], ["--min-rows", "0"]]
)
def test_the_cli_refuses_impossible_arguments(tmp_path, capsys, bad):
    args = ["criteo-dlrm", "--out", str(tmp_path), "--scale", "0.001", *bad]
    assert main(args) == 2
    assert "error:" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_help_states_the_scaling_rule_and_the_size_table(capsys):
    with pytest.raises(SystemExit) as e:
        main(["criteo-dlrm", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "at most --min-rows rows is kept whole" in text
    for scale in (0.0001, 0.001, 0.01, 0.05, 1):
        rows = [r if r <= 1000 else max(1000, math.ceil(r * scale)) for r in UPSTREAM_ROWS]
        n = sum(rows)
        gb = [(n * (8 + b) + 4 * DENSE_FLOATS) / 1e9 for b in (512, 256, 136)]
        row = f"{scale:g} {n:,} " + " ".join(f"{g:.3f}" for g in gb)
        assert row in text, row
    assert "1 187,767,399 97.649 49.580 27.048" in text
