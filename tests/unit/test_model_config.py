"""config.pbtxt checks of the hps backend (run once in initialize)."""

import pytest

from triton_rec.errors import ConfigError
from triton_rec.model_config import check_hps_model_config, check_hugectr_model_config, model_parameter


def _cfg(inputs=None, outputs=None, **kw):
    c = {
        "name": "m",
        "input": inputs if inputs is not None else [
            {"name": "KEYS", "data_type": "TYPE_INT64"},
            {"name": "NUMKEYS", "data_type": "TYPE_INT32"},
        ],
        "output": outputs if outputs is not None else [{"name": "OUTPUT0", "data_type": "TYPE_FP32"}],
    }
    c.update(kw)
    return c


def test_the_hps_interface_is_accepted_and_the_output_name_comes_from_the_config():
    assert check_hps_model_config(_cfg()) == ("OUTPUT0", ())
    outs = [{"name": "emb", "data_type": "TYPE_FP32"}, {"name": "NumSample", "data_type": "TYPE_INT32"}]
    assert check_hps_model_config(_cfg(outputs=outs)) == ("emb", ("NumSample",))


@pytest.mark.parametrize(
    "cfg, needle",
    [
        (_cfg(inputs=[{"name": "KEYS", "data_type": "TYPE_INT64"}]), "missing input 'NUMKEYS'"),
        (_cfg(inputs=[{"name": "KEYS", "data_type": "TYPE_INT32"},
                      {"name": "NUMKEYS", "data_type": "TYPE_INT32"}]), "input 'KEYS' must be TYPE_INT64"),
        (_cfg(inputs=[{"name": "KEYS", "data_type": "TYPE_INT64"},
                      {"name": "NUMKEYS", "data_type": "TYPE_INT32"},
                      {"name": "X", "data_type": "TYPE_INT32"}]), "unexpected inputs ['X']"),
        (_cfg(outputs=[]), "expected exactly one embedding output"),
        (_cfg(outputs=[{"name": "o", "data_type": "TYPE_FP16"}]), "must be TYPE_FP32"),
        (_cfg(outputs=[{"name": "o", "data_type": "TYPE_FP32"},
                       {"name": "DeviceID", "data_type": "TYPE_FP32"}]), "'DeviceID' must be TYPE_INT32"),
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
        "input": [{"name": "DES", "data_type": "TYPE_FP32"}, {"name": "CATCOLUMN", "data_type": cat},
                  {"name": "ROWINDEX", "data_type": "TYPE_INT32"}],
        "output": outputs if outputs is not None else [{"name": "OUTPUT0", "data_type": "TYPE_FP32"}],
    }


def test_the_hugectr_interface_takes_uint32_or_int64_keys():
    assert check_hugectr_model_config(_hugectr("TYPE_UINT32")) == "OUTPUT0"
    assert check_hugectr_model_config(_hugectr("TYPE_INT64")) == "OUTPUT0"
    with pytest.raises(ConfigError, match="input 'CATCOLUMN' must be TYPE_UINT32 or TYPE_INT64, got TYPE_INT32"):
        check_hugectr_model_config(_hugectr("TYPE_INT32"))
    with pytest.raises(ConfigError, match="expected one TYPE_FP32 output"):
        check_hugectr_model_config(_hugectr(outputs=[]))
