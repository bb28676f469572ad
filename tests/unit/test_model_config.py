"""config.pbtxt checks of the hps backend (run once in initialize)."""

import re

import pytest

from triton_rec.config.model_config import (
    check_hps_model_config,
    check_hugectr_model_config,
    check_hugectr_parameters,
    hugectr_cache_parameters,
    model_parameter,
)
from triton_rec.errors import ConfigError


def _cfg(inputs=None, outputs=None, **kw):
    c = {
        "name": "m",
        "input": inputs
        if inputs is not None
        else [
            {"name": "KEYS", "data_type": "TYPE_INT64"},
            {"name": "NUMKEYS", "data_type": "TYPE_INT32"},
        ],
        "output": outputs
        if outputs is not None
        else [{"name": "OUTPUT0", "data_type": "TYPE_FP32"}],
    }
    c.update(kw)
    return c


def test_the_hps_interface_is_accepted_and_the_output_name_comes_from_the_config():
    assert check_hps_model_config(_cfg()) == ("OUTPUT0", ())
    outs = [
        {"name": "emb", "data_type": "TYPE_FP32"},
        {"name": "NumSample", "data_type": "TYPE_INT32"},
    ]
    assert check_hps_model_config(_cfg(outputs=outs)) == ("emb", ("NumSample",))


@pytest.mark.parametrize(
    "cfg, needle",
    [
        (_cfg(inputs=[{"name": "KEYS", "data_type": "TYPE_INT64"}]), "missing input 'NUMKEYS'"),
        (
            _cfg(
                inputs=[
                    {"name": "KEYS", "data_type": "TYPE_INT32"},
                    {"name": "NUMKEYS", "data_type": "TYPE_INT32"},
                ]
            ),
            "input 'KEYS' must be TYPE_INT64",
        ),
        (
            _cfg(
                inputs=[
                    {"name": "KEYS", "data_type": "TYPE_INT64"},
                    {"name": "NUMKEYS", "data_type": "TYPE_INT32"},
                    {"name": "X", "data_type": "TYPE_INT32"},
                ]
            ),
            "unexpected inputs ['X']",
        ),
        (_cfg(outputs=[]), "expected exactly one embedding output"),
        (_cfg(outputs=[{"name": "o", "data_type": "TYPE_FP16"}]), "must be TYPE_FP32"),
        (
            _cfg(
                outputs=[
                    {"name": "o", "data_type": "TYPE_FP32"},
                    {"name": "DeviceID", "data_type": "TYPE_FP32"},
                ]
            ),
            "'DeviceID' must be TYPE_INT32",
        ),
    ],
)
def test_a_wrong_interface_names_the_model_and_field(cfg, needle):
    with pytest.raises(ConfigError) as e:
        check_hps_model_config(cfg)
    assert needle in str(e.value) and "model 'm'" in str(e.value)


def test_string_parameters_are_read_from_config_pbtxt():
    cfg = _cfg(parameters={"ps": {"string_value": "../ps.json"}})
    assert model_parameter(cfg, "ps") == "../ps.json"
    assert model_parameter(cfg, "other") is None
    assert model_parameter(_cfg(), "ps") is None


def _hugectr(cat="TYPE_UINT32", outputs=None):
    return {
        "name": "dcn",
        "input": [
            {"name": "DES", "data_type": "TYPE_FP32"},
            {"name": "CATCOLUMN", "data_type": cat},
            {"name": "ROWINDEX", "data_type": "TYPE_INT32"},
        ],
        "output": outputs
        if outputs is not None
        else [{"name": "OUTPUT0", "data_type": "TYPE_FP32"}],
    }


def test_the_hugectr_interface_takes_uint32_or_int64_keys():
    assert check_hugectr_model_config(_hugectr("TYPE_UINT32")) == ("OUTPUT0", ())
    assert check_hugectr_model_config(_hugectr("TYPE_INT64")) == ("OUTPUT0", ())
    with pytest.raises(
        ConfigError, match="input 'CATCOLUMN' must be TYPE_UINT32 or TYPE_INT64, got TYPE_INT32"
    ):
        check_hugectr_model_config(_hugectr("TYPE_INT32"))
    with pytest.raises(ConfigError, match="expected one TYPE_FP32 output"):
        check_hugectr_model_config(_hugectr(outputs=[]))


def test_config_pbtxt_parameters_override_refresh_and_freeze_sparse():
    from triton_rec.config.model_config import with_model_parameters
    from triton_rec.config.ps_json import parse_ps_config

    entry = {
        "model": "m",
        "sparse_files": ["x"],
        "embedding_vecsize_per_table": [4],
        "maxnum_catfeature_query_per_table_per_sample": [1],
        "max_batch_size": 8,
        "refresh_interval": 5,
    }
    params = parse_ps_config({"supportlonglong": True, "models": [entry]}).models[0]

    def cfg(**kv):
        return {"parameters": {k: {"string_value": v} for k, v in kv.items()}}

    assert with_model_parameters(cfg(), params) == params
    p = with_model_parameters(
        cfg(refresh_interval="0.5", refresh_delay="2", freeze_sparse="true"), params
    )
    assert (p.refresh_interval, p.refresh_delay, p.freeze_sparse) == (0.5, 2.0, True)
    for bad in (dict(refresh_interval="-1"), dict(refresh_delay="soon"), dict(freeze_sparse="yes")):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            with_model_parameters(cfg(**bad), params)


@pytest.mark.parametrize("value, seconds", [(None, 2.0), ("0", 0.0), ("0.25", 0.25), ("10", 10.0)])
def test_seconds_parameters_default_or_parse(value, seconds):
    from triton_rec.config.model_config import model_seconds

    config = {"parameters": {} if value is None else {"metrics_interval": {"string_value": value}}}
    assert model_seconds(config, "metrics_interval", 2.0) == seconds


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_malformed_seconds_parameters_are_refused_naming_them(value):
    from triton_rec.config.model_config import model_seconds

    config = {"parameters": {"metrics_interval": {"string_value": value}}}
    with pytest.raises(ConfigError, match="metrics_interval"):
        model_seconds(config, "metrics_interval", 2.0)


def _settings(params, environ):
    from triton_rec.config.model_config import InstanceSettings

    config = {"parameters": {k: {"string_value": v} for k, v in params.items()}}
    return InstanceSettings.from_config(config, environ)


def test_intra_op_threads_default_is_one_per_instance():
    s = _settings({}, {})
    assert (s.intra_op_threads, s.intra_op_source) == (1, "default")


def test_the_environment_overrides_the_default_and_config_pbtxt_overrides_both():
    s = _settings({}, {"OPENBLAS_NUM_THREADS": "3"})
    assert (s.intra_op_threads, s.intra_op_source) == (3, "OPENBLAS_NUM_THREADS")
    s = _settings({}, {"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "3"})
    assert (s.intra_op_threads, s.intra_op_source) == (2, "OMP_NUM_THREADS")
    s = _settings({"intra_op_threads": "4"}, {"OMP_NUM_THREADS": "2"})
    assert (s.intra_op_threads, s.intra_op_source) == (4, "config.pbtxt")
    # An unusable environment value is not a setting: the default stands.
    assert _settings({}, {"OMP_NUM_THREADS": "auto"}).intra_op_threads == 1


@pytest.mark.parametrize("value", ["0", "-1", "1.5", "two"])
def test_a_malformed_intra_op_threads_fails_the_load_naming_it(value):
    with pytest.raises(ConfigError, match="intra_op_threads"):
        _settings({"intra_op_threads": value}, {})


def test_metrics_interval_defaults_to_one_second():
    assert _settings({}, {}).metrics_interval == 1.0
    assert _settings({"metrics_interval": "0"}, {}).metrics_interval == 0.0


def test_oversubscription_is_instances_times_threads_against_usable_cores():
    from triton_rec.config.model_config import InstanceSettings, usable_cores

    cores = usable_cores()
    config = {"instance_group": [{"count": cores, "kind": "KIND_CPU"}]}
    assert not InstanceSettings(intra_op_threads=1).oversubscribes(config)
    assert InstanceSettings(intra_op_threads=2).oversubscribes(config)
    assert "OVERSUBSCRIBED" in InstanceSettings(intra_op_threads=2).describe(config)


def test_an_absurd_max_batch_size_is_refused_naming_the_model_and_field():
    from triton_rec.config.model_config import MAX_BATCH_SIZE_LIMIT, check_hps_model_config
    from triton_rec.errors import ConfigError

    config = {
        "name": "m",
        "max_batch_size": 1000000000000,
        "input": [
            {"name": "KEYS", "data_type": "TYPE_INT64"},
            {"name": "NUMKEYS", "data_type": "TYPE_INT32"},
        ],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32"}],
    }
    with pytest.raises(
        ConfigError, match=r"model 'm' config.pbtxt: max_batch_size .*1000000000000"
    ):
        check_hps_model_config(config)
    config["max_batch_size"] = MAX_BATCH_SIZE_LIMIT
    assert check_hps_model_config(config) == ("OUTPUT0", ())


# ---- the HugeCTR backend's config.pbtxt parameters (hugectr_backend src/hugectr.cc) ------


def test_the_hugectr_interface_may_declare_the_info_outputs_like_hps():
    outs = [
        {"name": "OUTPUT0", "data_type": "TYPE_FP32"},
        {"name": "NumSample", "data_type": "TYPE_INT32"},
        {"name": "DeviceID", "data_type": "TYPE_INT32"},
    ]
    assert check_hugectr_model_config(_hugectr(outputs=outs)) == (
        "OUTPUT0",
        ("NumSample", "DeviceID"),
    )
    outs[1]["data_type"] = "TYPE_FP32"
    with pytest.raises(ConfigError, match="output 'NumSample' must be TYPE_INT32"):
        check_hugectr_model_config(_hugectr(outputs=outs))


def _with(config, **params):
    return {**config, "parameters": {k: {"string_value": v} for k, v in params.items()}}


def _ps_model(**over):
    from triton_rec.config.ps_json import parse_ps_config

    entry = {
        "model": "dcn",
        "sparse_files": ["a"],
        "embedding_vecsize_per_table": [16],
        "maxnum_catfeature_query_per_table_per_sample": [26],
        "max_batch_size": 64,
        "gpucacheper": 0.5,
        "hit_rate_threshold": 0.9,
        **over,
    }
    return parse_ps_config({"supportlonglong": True, "models": [entry]}, "/m").models[0]


def test_hugectr_cache_parameters_may_only_lower_ps_json_and_gpucache_must_agree():
    p = hugectr_cache_parameters(
        _with(_hugectr(), gpucacheper="0.25", hit_rate_threshold="0.5"), _ps_model()
    )
    assert (p.gpucacheper, p.hit_rate_threshold) == (0.25, 0.5)
    with pytest.raises(ConfigError, match="gpucacheper 0.75 is above ps.json's 0.5"):
        hugectr_cache_parameters(_with(_hugectr(), gpucacheper="0.75"), _ps_model())
    with pytest.raises(ConfigError, match="gpucache is false but ps.json says true"):
        hugectr_cache_parameters(_with(_hugectr(), gpucache="false"), _ps_model())


_NET = dict(
    dense_dim=13,
    slots=26,
    label_dim=1,
    keys_per_sample=26,
    paths={"sparse_files": ("/m/1/a",), "dense_file": ("/m/1/d",)},
    model_dir="/m",
)


def test_hugectr_parameters_that_agree_pass_and_the_unused_ones_are_named():
    cfg = _with(
        _hugectr("TYPE_INT64"),
        des_feature_num="13",
        slots="26",
        label_dim="1",
        cat_feature_num="26",
        embedding_vector_size="16",
        embeddingkey_long_type="true",
        sparse_files="1/a",
        dense_file="/m/1/d",
        max_nnz="2",
        mixed_precision="true",
    )
    notes = check_hugectr_parameters(cfg, "dcn", **_NET)
    assert any("'max_nnz' has no effect here" in n for n in notes)
    assert any("'mixed_precision' has no effect here" in n for n in notes)
    assert any("'embedding_vector_size' has no effect here" in n for n in notes)


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"des_feature_num": "12"}, "des_feature_num is 12 but the network's dense input gives 13"),
        ({"slots": "27"}, "slots is 27"),
        ({"label_dim": "2"}, "label_dim is 2"),
        ({"cat_feature_num": "20"}, "cat_feature_num is 20"),
        (
            {"embeddingkey_long_type": "false"},
            "embeddingkey_long_type is false but input CATCOLUMN",
        ),
        ({"sparse_files": "1/b"}, "sparse_files '1/b' differs from ps.json's /m/1/a"),
        ({"slots": "many"}, "an integer >= 1"),
    ],
)
def test_hugectr_parameters_that_contradict_the_network_or_ps_json_are_refused(params, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        check_hugectr_parameters(_with(_hugectr("TYPE_INT64"), **params), "dcn", **_NET)
