"""Configuration hardening (issue 11): every file a model is made of is read through one
reader (regular files only, size and depth limits, errors naming the file), ps.json
values checked against documented limits, relative ``store_dir`` resolved like ``ps``,
and the operator's opt-in path confinement (``TRITON_REC_ALLOWED_ROOTS``)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, write_model
from tests.fake_pb_utils import HPS_INPUTS, start_instance, triton_config
from triton_rec.config import model_files
from triton_rec.config.ps_json import (
    MAX_BATCH_SIZE,
    MAX_CACHE_WAYS,
    MAX_TIER_BATCH_SIZE,
    MAX_VEC_SIZE,
    load_ps_config,
    model_relative_path,
    parse_ps_config,
)
from triton_rec.dense.hugectr_network import HugeCTRNetwork
from triton_rec.errors import ConfigError, ModelFileError
from triton_rec.storage import node_store

REPO_ROOT = Path(__file__).resolve().parents[2]


def _model(**over):
    m = {
        "model": "m",
        "sparse_files": ["a.model", "b.model"],
        "embedding_table_names": ["ta", "tb"],
        "embedding_vecsize_per_table": [4, 8],
        "maxnum_catfeature_query_per_table_per_sample": [2, 3],
        "max_batch_size": 64,
    }
    m.update(over)
    return m


def _doc(model=None, **top):
    return {"supportlonglong": True, "models": [model or _model()], **top}


def _in_child(code: str, timeout: float = 30.0):
    """Run ``code`` in a Python child limited to 2 GB of address space and ``timeout``
    seconds: what hangs or reads without bound today cannot take the machine with it.
    Returns (exit code or "timeout", output)."""
    prog = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        + textwrap.dedent(code)
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", prog],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO_ROOT,
        )
    except subprocess.TimeoutExpired:
        return "timeout", ""
    return r.returncode, r.stdout + r.stderr


_NET = {
    "layers": [
        {
            "name": "data",
            "type": "Data",
            "dense": {"top": "dense", "dense_dim": 2},
            "label": {"top": "label", "label_dim": 1},
            "sparse": [],
        },
        {
            "name": "fc",
            "type": "InnerProduct",
            "bottom": "dense",
            "top": "fc",
            "fc_param": {"num_output": 1},
        },
    ]
}


# ---- one reader: regular files, size and depth limits ------------------------------------


def test_a_fifo_as_ps_json_is_refused_at_once_naming_the_file(tmp_path):
    fifo = tmp_path / "ps.json"
    os.mkfifo(fifo)
    rc, out = _in_child(
        f"""
        from triton_rec.config.ps_json import load_ps_config
        from triton_rec.errors import ConfigError
        try:
            load_ps_config({str(fifo)!r})
        except ConfigError as e:
            print("ERR", e)
    """,
        timeout=20,
    )
    assert rc == 0, out  # today: blocks in open() until the timeout
    assert f"ERR {fifo}: the ps.json must be a regular file, this is a FIFO" in out


def test_dev_zero_as_network_json_is_refused_not_read(tmp_path):
    link = tmp_path / "net.json"
    link.symlink_to("/dev/zero")
    rc, out = _in_child(f"""
        from triton_rec.dense.hugectr_network import HugeCTRNetwork
        from triton_rec.errors import ModelFileError
        try:
            HugeCTRNetwork.parse({str(link)!r})
        except ModelFileError as e:
            print("ERR", e)
    """)
    assert rc == 0, out  # today: reads /dev/zero until MemoryError
    assert f"ERR {link}: the network JSON must be a regular file, this is a character device" in out


def test_a_fifo_as_dense_or_sparse_file_is_refused_naming_the_file(tmp_path):
    net = tmp_path / "net.json"
    net.write_text(json.dumps(_NET))
    dense = tmp_path / "dense.model"
    os.mkfifo(dense)
    with pytest.raises(
        ModelFileError, match=f"^{dense}: the dense file must be a regular file, this is a FIFO"
    ):
        HugeCTRNetwork.load(str(net), str(dense))
    table = tmp_path / "t.model"
    table.mkdir()
    (table / "key").write_bytes(np.arange(3, dtype="<i8").tobytes())
    os.mkfifo(table / "emb_vector")
    with pytest.raises(
        ModelFileError,
        match="emb_vector: the sparse vector file must be a regular file, this is a FIFO",
    ):
        node_store.read_table(str(table), 2)


def test_a_ps_json_over_the_size_limit_is_refused_without_reading_it(tmp_path):
    big = tmp_path / "ps.json"
    with open(big, "wb") as f:
        f.truncate(model_files.MAX_JSON_BYTES + 1)  # sparse: nothing is written
    with pytest.raises(
        ConfigError,
        match=rf"^{big}: the ps.json has {model_files.MAX_JSON_BYTES + 1} "
        rf"bytes, more than the limit of {model_files.MAX_JSON_BYTES}",
    ):
        load_ps_config(str(big))


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_deep_json_is_a_clear_error_naming_the_file_not_a_recursion_error(tmp_path, opener):
    deep = tmp_path / "ps.json"
    deep.write_text(opener * 100_000)
    with pytest.raises(
        ConfigError,
        match=rf"^{deep}: the ps.json nests arrays/objects deeper than "
        rf"the limit of {model_files.MAX_JSON_DEPTH} levels",
    ):
        load_ps_config(str(deep))
    net = tmp_path / "net.json"
    net.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelFileError, match=rf"^{net}: the network JSON nests"):
        HugeCTRNetwork.parse(str(net))


def test_depth_within_the_limit_and_brackets_inside_strings_are_fine(tmp_path):
    p = tmp_path / "x.json"
    inner = "[" * (model_files.MAX_JSON_DEPTH - 1) + "]" * (model_files.MAX_JSON_DEPTH - 1)
    p.write_text(json.dumps({"s": "[[[[{{{{" * 100, "a": json.loads(inner)}))
    assert model_files.read_json(str(p))["s"].startswith("[[[[")


def test_non_utf8_and_non_standard_constants_name_the_file(tmp_path):
    p = tmp_path / "ps.json"
    p.write_bytes(b'{"supportlonglong": true, "x": "\xff"}')
    with pytest.raises(ConfigError, match=rf"^{p}: the ps.json is not UTF-8 text \(byte 32\)"):
        load_ps_config(str(p))
    doc = json.dumps(_doc()).replace('"max_batch_size": 64', '"max_batch_size": 64, "x": NaN')
    p.write_text(doc)
    with pytest.raises(ConfigError, match=rf"^{p}: not valid JSON \(NaN is not standard JSON\)"):
        load_ps_config(str(p))


# ---- ps.json values: documented limits, named file/model/table/key ------------------------


def test_cache_ways_out_of_range_names_file_model_and_limit():
    with pytest.raises(
        ConfigError,
        match=rf"^ps\.json: model 'm'\.cache_ways: must be within "
        rf"\[1, {MAX_CACHE_WAYS}\], got 1000$",
    ):
        parse_ps_config(_doc(_model(cache_ways=1000)), source="ps.json")
    assert MAX_CACHE_WAYS == 64
    assert parse_ps_config(_doc(_model(cache_ways=64))).models[0].cache_ways == 64


def test_a_vector_size_over_the_native_limit_names_the_table_and_key():
    with pytest.raises(
        ConfigError,
        match=rf"^ps\.json: model 'm': table 'tb': "
        rf"embedding_vecsize_per_table\[1\]: must be within "
        rf"\[1, {MAX_VEC_SIZE}\], got 65537$",
    ):
        parse_ps_config(_doc(_model(embedding_vecsize_per_table=[4, 65537])), source="ps.json")
    assert MAX_VEC_SIZE == 65536


@pytest.mark.parametrize("doc", ["[4.0, NaN]", "[4.0, Infinity]", "[4.0, -1e999]"])
def test_non_finite_default_values_are_refused(tmp_path, doc):
    p = tmp_path / "ps.json"
    text = json.dumps(_doc()).replace(
        '"max_batch_size": 64', f'"max_batch_size": 64, "default_value_for_each_table": {doc}'
    )
    p.write_text(text)
    with pytest.raises(ConfigError, match=f"^{p}: "):
        load_ps_config(str(p))
    # and decoded values (a caller handing a dict) are refused naming the table
    with pytest.raises(
        ConfigError,
        match=r"table 'tb': default_value_for_each_table\[1\]: "
        r"expected a finite number, got nan",
    ):
        parse_ps_config(_doc(_model(default_value_for_each_table=[0.0, float("nan")])))


@pytest.mark.parametrize(
    "value, why",
    [
        (1e12, "must be within"),
        (1.5, "expected an integer"),
        (float("inf"), "expected an integer"),
        (0, "must be within"),
    ],
)
def test_absurd_max_batch_sizes_are_refused_with_the_range(value, why):
    with pytest.raises(ConfigError, match=rf"model 'm'\.max_batch_size: {why}"):
        parse_ps_config(_doc(_model(max_batch_size=value)))
    with pytest.raises(ConfigError, match=rf"volatile_db\.max_batch_size: {why}"):
        parse_ps_config(
            _doc(
                volatile_db={"type": "redis_cluster", "max_batch_size": value},
                persistent_db={"type": "rocks_db"},
            )
        )
    with pytest.raises(ConfigError, match=rf"persistent_db\.max_batch_size: {why}"):
        parse_ps_config(_doc(persistent_db={"type": "rocks_db", "max_batch_size": value}))
    assert str(MAX_BATCH_SIZE) in str(
        pytest.raises(ConfigError, parse_ps_config, _doc(_model(max_batch_size=1e12))).value
    )
    assert str(MAX_TIER_BATCH_SIZE) in str(
        pytest.raises(
            ConfigError,
            parse_ps_config,
            _doc(persistent_db={"type": "rocks_db", "max_batch_size": 1e12}),
        ).value
    )


def test_keys_per_request_must_fit_int32():
    with pytest.raises(
        ConfigError, match=r"max_batch_size: 1000000000 samples x 5 keys per sample"
    ):
        parse_ps_config(_doc(_model(max_batch_size=1_000_000_000)))


@pytest.mark.parametrize(
    "key, value",
    [
        ("hit_rate_threshold", float("inf")),
        ("refresh_interval", 1e999),
        ("refresh_delay", float("nan")),
    ],
)
def test_other_model_numbers_are_checked(key, value):
    with pytest.raises(ConfigError, match=rf"model 'm'.*{key}"):
        parse_ps_config(_doc(_model(**{key: value})))


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("volatile_db", "num_partitions", 10**9),
        ("volatile_db", "connect_timeout", float("nan")),
        ("persistent_db", "num_threads", 10**6),
        ("update_source", "poll_timeout_ms", 1e12),
    ],
)
def test_other_tier_numbers_are_checked(section, key, value):
    tiers = {"volatile_db": {"type": "redis_cluster"}, "persistent_db": {"type": "rocks_db"}}
    tiers.setdefault(section, {})[key] = value
    with pytest.raises(ConfigError, match=rf"{section}\.{key}: "):
        parse_ps_config(_doc(**tiers))


def _write_repo(repo: Path) -> None:
    entry = write_model(
        str(repo), "m", [SyntheticTable("t", rows=50, vec_size=4, max_keys_per_sample=2)]
    )
    (repo / "ps.json").write_text(json.dumps({"supportlonglong": True, "models": [entry]}))


# ---- relative store_dir ---------------------------------------------------------------------


def test_a_relative_store_dir_resolves_against_the_model_directory_like_ps(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    _write_repo(repo)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert model_relative_path(str(repo / "m"), "store") == str(repo / "m" / "store")
    assert model_relative_path(str(repo / "m"), "/abs/store") == "/abs/store"
    assert model_relative_path(str(repo / "m"), None) is None
    _, model = start_instance(
        repo,
        triton_config(
            "m", "hps", HPS_INPUTS, store_dir="store", prefault="false", metrics_interval="0"
        ),
    )
    try:
        assert any((repo / "m" / "store").iterdir())
        assert not (elsewhere / "store").exists()
    finally:
        model.finalize()


# ---- path confinement --------------------------------------------------------------------------


@pytest.fixture
def roots(tmp_path, monkeypatch):
    inside = tmp_path / "inside"
    outside = tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    monkeypatch.setenv(model_files.ALLOWED_ROOTS_ENV, f"{inside}{os.pathsep}{tmp_path / 'other'}")
    return inside, outside


def test_confinement_is_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(model_files.ALLOWED_ROOTS_ENV, raising=False)
    assert model_files.allowed_roots() == ()
    model_files.confine("/etc/passwd", "anything")


def test_relative_roots_are_refused(monkeypatch):
    monkeypatch.setenv(model_files.ALLOWED_ROOTS_ENV, "models")
    with pytest.raises(
        ConfigError, match=rf"{model_files.ALLOWED_ROOTS_ENV}: roots must be absolute"
    ):
        model_files.allowed_roots()


def test_a_ps_json_outside_the_roots_is_refused_naming_file_and_roots(roots):
    inside, outside = roots
    p = outside / "ps.json"
    p.write_text(json.dumps(_doc()))
    with pytest.raises(model_files.PathNotAllowedError) as e:
        load_ps_config(str(p))
    assert str(e.value).startswith(f"{p}: ps.json is outside the allowed roots ['{inside}', ")
    assert model_files.ALLOWED_ROOTS_ENV in str(e.value)
    q = inside / "ps.json"
    q.write_text(json.dumps(_doc()))
    assert load_ps_config(str(q)).models[0].model == "m"


def test_a_symlink_inside_a_root_is_judged_by_its_target(roots):
    inside, outside = roots
    (outside / "ps.json").write_text(json.dumps(_doc()))
    link = inside / "ps.json"
    link.symlink_to(outside / "ps.json")
    with pytest.raises(
        model_files.PathNotAllowedError,
        match=rf"^{link}: ps.json \(resolves to {outside / 'ps.json'}\) is outside",
    ):
        load_ps_config(str(link))
    # a root reached through a symlink counts as its real directory
    alias = outside / "alias"
    alias.symlink_to(inside)
    (inside / "x.json").write_text("{}")
    assert model_files.read_json(str(alias / "x.json")) == {}


def test_sparse_and_dense_files_outside_the_roots_are_refused(roots, tmp_path, monkeypatch):
    inside, outside = roots
    ps = write_model(
        str(outside), "m", [SyntheticTable("t", rows=20, vec_size=4, max_keys_per_sample=1)]
    )
    cfg = parse_ps_config({"supportlonglong": True, "models": [ps]}, str(outside), "ps.json")
    tp = cfg.models[0].tables[0]
    with pytest.raises(
        model_files.PathNotAllowedError, match=r"key: sparse file is outside the allowed roots"
    ):
        node_store.load_table(tp, str(tmp_path / "store"))
    # a table already converted into the store is refused as well (checked before reuse)
    monkeypatch.delenv(model_files.ALLOWED_ROOTS_ENV)
    node_store.load_table(tp, str(tmp_path / "store"))
    monkeypatch.setenv(model_files.ALLOWED_ROOTS_ENV, str(inside))
    with pytest.raises(model_files.PathNotAllowedError):
        node_store.load_table(tp, str(tmp_path / "store"))
    dense = outside / "d.model"
    dense.write_bytes(b"\0" * 12)
    net = inside / "net.json"
    net.write_text(json.dumps(_NET))
    with pytest.raises(model_files.PathNotAllowedError, match=rf"^{dense}: dense file is outside"):
        HugeCTRNetwork.load(str(net), str(dense))


def test_a_store_dir_from_config_pbtxt_outside_the_roots_is_refused(roots, tmp_path):
    inside, outside = roots
    _write_repo(inside)
    with pytest.raises(
        Exception, match=r"store_dir \(config.pbtxt parameter\) is outside the allowed roots"
    ):
        start_instance(
            inside,
            triton_config(
                "m",
                "hps",
                HPS_INPUTS,
                store_dir=str(outside / "store"),
                prefault="false",
                metrics_interval="0",
            ),
        )
    assert not (outside / "store").exists()
