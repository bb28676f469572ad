"""ps.json parsing: the one parser every component uses."""

import json
import os

import pytest

from triton_rec.config.ps_json import find_ps_config, load_ps_config, parse_ps_config
from triton_rec.errors import ConfigError

DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def _model(**over):
    m = {
        "model": "m",
        "sparse_files": ["a.model", "/abs/b.model"],
        "embedding_vecsize_per_table": [1, 16],
        "maxnum_catfeature_query_per_table_per_sample": [2, 26],
        "max_batch_size": 64,
    }
    m.update(over)
    return m


def _doc(*models, **top):
    d = {"supportlonglong": True, "models": list(models) or [_model()]}
    d.update(top)
    return d


def test_the_upstream_wdl_sample_parses_unchanged_with_its_obsolete_keys():
    cfg = load_ps_config(os.path.join(DATA, "hps_wdl_upstream.json"))
    m = cfg.model("hps_wdl")
    assert [t.vec_size for t in m.tables] == [1, 16]
    assert [t.max_keys_per_sample for t in m.tables] == [2, 26]
    assert [t.name for t in m.tables] == ["embedding_table1", "embedding_table2"]
    assert m.keys_per_sample == 28
    assert m.max_batch_size == 1024
    assert m.tables[0].sparse_file == "/hps_infer/embedding/hps_wdl/1/wdl0_sparse_20000.model"
    assert m.gpucache is True and m.gpucacheper == 0.5 and m.hit_rate_threshold == 0.9
    assert m.extra["num_of_worker_buffer_in_pool"] == 3
    assert m.unknown_keys == ()
    assert cfg.volatile_db.type == "hash_map" and cfg.volatile_db.max_batch_size == 100000
    assert cfg.volatile_db.extra["max_get_batch_size"] == 100000  # obsolete key kept, not fatal
    assert cfg.volatile_db.ignored_settings() == ("overflow_margin=10000000",)
    assert m.volatile_db is cfg.volatile_db and m.persistent_db.type == "disabled"


def test_relative_paths_resolve_against_the_file_that_names_them(tmp_path):
    sub = tmp_path / "cfg"
    sub.mkdir()
    (sub / "ps.json").write_text(json.dumps(_doc(_model(dense_file="d/dense.model"))))
    m = load_ps_config(str(sub / "ps.json")).model("m")
    assert m.tables[0].sparse_file == str(sub / "a.model")
    assert m.tables[1].sparse_file == "/abs/b.model"
    assert m.dense_file == str(sub / "d" / "dense.model")


def test_defaults_fill_table_names_and_default_values():
    m = parse_ps_config(_doc()).model("m")
    assert [t.name for t in m.tables] == ["sparse_embedding0", "sparse_embedding1"]
    assert [t.default_value for t in m.tables] == [0.0, 0.0]


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"embedding_vecsize_per_table": [1]}, "'embedding_vecsize_per_table' has 1 entries"),
        ({"maxnum_catfeature_query_per_table_per_sample": [2, 0]}, "must be within [1, "),
        ({"default_value_for_each_table": [0.0, "x"]}, "expected a finite number"),
        ({"embedding_table_names": ["t", "t"]}, "duplicates"),
        ({"embedding_table_names": ["t", "a b"]}, "'embedding_table_names' must be letters"),
        ({"max_batch_size": 0}, "max_batch_size: must be within [1, "),
        ({"max_batch_size": 2.5}, "expected an integer"),
        ({"sparse_files": []}, "non-empty list"),
        ({"gpucacheper": 1.5}, "gpucacheper"),
        ({"gpucache": "maybe"}, "expected a boolean"),
        ({"cache_policy": "fifo"}, "'cache_policy' must be one of ['lru', 'tinylfu']"),
        ({"cache_ways": 0}, "cache_ways: must be within [1, 64]"),
        ({"refresh_interval": -1}, "'refresh_interval' must be >= 0 seconds"),
        ({"cache_refresh_percentage_per_iteration": 2}, "within [0, 1]"),
    ],
)
def test_bad_model_values_name_the_model_and_key(override, needle):
    with pytest.raises(ConfigError) as e:
        parse_ps_config(_doc(_model(**override)), source="x/ps.json")
    assert needle in str(e.value)
    assert "x/ps.json" in str(e.value) and "'m'" in str(e.value)


@pytest.mark.parametrize(
    "key",
    [
        "sparse_files",
        "embedding_vecsize_per_table",
        "maxnum_catfeature_query_per_table_per_sample",
    ],
)
def test_required_model_keys_are_required(key):
    m = _model()
    del m[key]
    with pytest.raises(ConfigError, match=f"missing required key '{key}'"):
        parse_ps_config(_doc(m))


def test_top_level_rules():
    with pytest.raises(ConfigError, match="supportlonglong"):
        parse_ps_config({"models": [_model()]})
    with pytest.raises(ConfigError, match="'models' must be a non-empty list"):
        parse_ps_config({"supportlonglong": True, "models": []})
    with pytest.raises(ConfigError, match="appears twice"):
        parse_ps_config(_doc(_model(), _model()))
    with pytest.raises(ConfigError, match="'volatile_db' must be an object"):
        parse_ps_config(_doc(volatile_db=[1]))


def test_cache_keys_are_parsed_with_hps_defaults():
    m = parse_ps_config(_doc()).model("m")
    assert (m.cache_policy, m.cache_ways, m.init_ec, m.refresh_interval) == ("lru", 8, True, 0.0)
    assert m.cache_refresh_percentage_per_iteration == 0.0 and m.gpucacheper == 0.2
    m = parse_ps_config(
        _doc(
            _model(
                cache_policy="tinylfu",
                init_ec=True,
                refresh_interval=2.5,
                refresh_delay=1,
                cache_refresh_percentage_per_iteration=0.3,
            )
        )
    ).model("m")
    assert (m.cache_policy, m.init_ec, m.refresh_interval, m.refresh_delay) == (
        "tinylfu",
        True,
        2.5,
        1.0,
    )
    assert m.cache_refresh_percentage_per_iteration == 0.3


def test_model_names_follow_hugectrs_rule():
    with pytest.raises(ConfigError, match="model names may only hold"):
        parse_ps_config(_doc(_model(model="a/b")))


def test_unknown_keys_are_reported_not_fatal():
    cfg = parse_ps_config(_doc(_model(brand_new_knob=1), future_section={}))
    assert cfg.model("m").unknown_keys == ("brand_new_knob",)
    assert cfg.unknown_keys == ("future_section",)


def test_asking_for_a_model_that_is_not_there_lists_the_others():
    with pytest.raises(ConfigError, match=r"no entry in 'models' for model 'other' \(found: 'm'\)"):
        parse_ps_config(_doc()).model("other")


def test_missing_or_broken_files_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="ps.json not found"):
        load_ps_config(str(tmp_path / "ps.json"))
    (tmp_path / "ps.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"ps.json: not valid JSON"):
        load_ps_config(str(tmp_path / "ps.json"))


def test_the_model_finds_its_ps_json_by_parameter_or_at_the_repository_root(tmp_path):
    model_dir = tmp_path / "repo" / "m"
    assert find_ps_config(str(model_dir), None) == str(tmp_path / "repo" / "ps.json")
    assert find_ps_config(str(model_dir), "conf/ps.json") == str(model_dir / "conf" / "ps.json")
    assert find_ps_config(str(model_dir), "/etc/ps.json") == "/etc/ps.json"
