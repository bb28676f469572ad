"""Facts defined once (issue 12): policy names, the name rule, ps.json defaults, the
exception hierarchy, and the one network-JSON parser of both dense executors."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from triton_rec import errors
from triton_rec.cache import array_cache, shm_cache
from triton_rec.cache.cached_table import CachedTable
from triton_rec.config import ps_json as config
from triton_rec.config.ps_json import CachePolicy, ModelParams, OverflowPolicy, parse_ps_config
from triton_rec.dense import Combiner
from triton_rec.dense.hugectr_network import HugeCTRNetwork
from triton_rec.dense.onnx_model import network_combiners
from triton_rec.errors import ConfigError, TritonRecError
from triton_rec.storage import backing_store
from triton_rec.updates import codec as updates


def _ps(**model_keys):
    model = {
        "model": "m",
        "sparse_files": ["t.npz"],
        "embedding_vecsize_per_table": [4],
        "maxnum_catfeature_query_per_table_per_sample": [2],
        "max_batch_size": 8,
        **model_keys,
    }
    return parse_ps_config({"supportlonglong": True, "models": [model]}, "/r", "ps.json")


# ---- policies and names ------------------------------------------------------------------


def test_every_cache_uses_the_one_list_of_cache_policies():
    names = tuple(p.value for p in CachePolicy)
    assert names == ("lru", "tinylfu")  # array_cache stores a policy as its index here
    assert config.CACHE_POLICIES == shm_cache.POLICIES == array_cache.POLICIES == names
    assert config.OVERFLOW_POLICIES == tuple(p.value for p in OverflowPolicy)


def test_policy_members_are_their_value_wherever_a_string_is_expected():
    m = CachePolicy.TINYLFU
    assert m == "tinylfu" and hash(m) == hash("tinylfu") and {"tinylfu": 1}[m] == 1
    # %-formatting is what this asserts on, hence the noqa
    assert f"{m}" == str(m) == "%s" % m == "tinylfu" and json.dumps(m) == '"tinylfu"'  # noqa: UP031
    assert f"{OverflowPolicy.EVICT_RANDOM:>13}" == " evict_random"


def test_parsed_policies_are_members_and_bad_ones_name_the_choices():
    p = _ps(cache_policy="tinylfu").models[0]
    assert p.cache_policy is CachePolicy.TINYLFU
    assert _ps().models[0].volatile_db.overflow_policy is OverflowPolicy.EVICT_RANDOM
    with pytest.raises(ConfigError, match=r"one of \['lru', 'tinylfu'\], got 'lfu'"):
        _ps(cache_policy="lfu")


def test_one_name_rule_for_models_tables_and_topics():
    assert backing_store._NAME_RE is config.NAME_RE
    assert updates._TOPIC_RE.pattern == rf"hps_et\.({config.NAME_PATTERN})\.({config.NAME_PATTERN})"
    assert updates.parse_topic("hps_et.m-1.t_2") == ("m-1", "t_2")


# ---- ps.json defaults ----------------------------------------------------------------------


def test_model_defaults_are_the_dataclass_field_defaults():
    fields = {
        f.name: f.default
        for f in dataclasses.fields(ModelParams)
        if f.default is not dataclasses.MISSING
    }
    assert config.MODEL_DEFAULTS == fields
    p = _ps().models[0]
    for key in (
        "gpucache",
        "gpucacheper",
        "hit_rate_threshold",
        "cache_policy",
        "cache_ways",
        "init_ec",
        "refresh_interval",
        "refresh_delay",
        "cache_refresh_percentage_per_iteration",
        "freeze_sparse",
        "deployed_device_list",
    ):
        assert getattr(p, key) == fields[key], key
    assert p.tables[0].default_value == config.TABLE_DEFAULTS["default_value"]


def test_cached_table_defaults_to_the_ps_json_hit_rate_threshold():
    default = inspect.signature(CachedTable).parameters["hit_rate_threshold"].default
    assert default == config.MODEL_DEFAULTS["hit_rate_threshold"]


# ---- errors --------------------------------------------------------------------------------


def test_every_error_class_is_defined_in_errors_under_one_root():
    classes = [
        c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, BaseException)
    ]
    assert len(classes) > 15
    for c in classes:
        assert c.__module__ == "triton_rec.errors" and issubclass(c, TritonRecError), c


def test_modules_re_export_their_errors_as_the_same_classes():
    from triton_rec.cache import gpu_share, shm_security
    from triton_rec.config import model_files
    from triton_rec.storage import node_store
    from triton_rec.triton import request_loop, runtime

    assert node_store.StoreError is backing_store.StoreError is errors.StoreError
    assert node_store.CorruptLayoutError is errors.CorruptLayoutError
    assert model_files.ConfigFileError is errors.ConfigFileError
    assert gpu_share.StaleHandlesError is errors.StaleHandlesError
    assert shm_security.SharedMemorySecurityError is errors.SharedMemorySecurityError
    assert request_loop.RequestTooLarge is errors.RequestTooLarge
    assert updates.UpdateMessageError is errors.UpdateMessageError
    assert array_cache.CupyUnavailableError is errors.CupyUnavailableError
    assert issubclass(runtime.RuntimeNotFound, RuntimeError)


def test_the_native_errors_derive_from_the_root_and_their_builtin_class():
    from triton_rec import _native

    assert issubclass(_native.DuplicateKeyError, TritonRecError)
    assert issubclass(_native.DuplicateKeyError, ValueError)
    assert issubclass(_native.CorruptIndexError, TritonRecError)
    assert issubclass(_native.CorruptIndexError, ValueError)
    assert issubclass(_native.ShmCacheError, errors.CacheError)
    assert issubclass(_native.ShmCacheError, RuntimeError)


# ---- the network JSON of the ONNX executor ------------------------------------------------


def _network(*embedding_layers):
    data = {
        "name": "data",
        "type": "Data",
        "label": {"top": "label", "label_dim": 1},
        "dense": {"top": "dense", "dense_dim": 2},
        "sparse": [
            {"top": f"s{t}", "slot_num": 2, "max_feature_num_per_sample": 4}
            for t in range(len(embedding_layers))
        ],
    }
    layers = [data]
    for t, (type_, hparam) in enumerate(embedding_layers):
        layers.append(
            {
                "name": f"emb{t}",
                "type": type_,
                "bottom": f"s{t}",
                "top": f"e{t}",
                "sparse_embedding_hparam": {"embedding_vec_size": 4, **hparam},
            }
        )
    # a dense layer the HugeCTR executor does not know: the ONNX path never plans it
    layers.append(
        {"name": "head", "type": "SomethingOnlyOnnxRuns", "bottom": ["dense", "e0"], "top": "out"}
    )
    return {"layers": layers}


def _write(tmp_path, doc):
    path = tmp_path / "net.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_onnx_combiners_come_from_the_hugectr_parser_for_every_embedding_type(tmp_path):
    path = _write(
        tmp_path,
        _network(
            ("DistributedSlotSparseEmbeddingHash", {"combiner": "mean"}),
            ("HybridSparseEmbedding", {"combiner": 0}),
        ),
    )
    assert network_combiners(path) == [Combiner.MEAN, Combiner.SUM]
    assert [t.combiner for t in HugeCTRNetwork.parse_tables(path)] == network_combiners(path)
    with pytest.raises(ConfigError, match="unsupported type 'SomethingOnlyOnnxRuns'"):
        HugeCTRNetwork.parse(path)  # the HugeCTR executor would have to run it


@pytest.mark.parametrize(
    "doc,match",
    [
        (
            _network(("DistributedSlotSparseEmbeddingHash", {})),
            r"layer 'emb0' .*missing key 'sparse_embedding_hparam.combiner'",
        ),
        (_network(("DistributedSlotSparseEmbeddingHash", {"combiner": "max"})), "combiner"),
        ({"layers": [{"name": "x", "type": "InnerProduct"}]}, "first layer must be the Data layer"),
        ({"data": {}}, "pre-v2.1 network format"),
    ],
)
def test_a_malformed_network_fails_the_onnx_path_as_it_fails_the_hugectr_path(tmp_path, doc, match):
    path = _write(tmp_path, doc)
    with pytest.raises(ConfigError, match=match) as onnx_error:
        network_combiners(path)
    with pytest.raises(ConfigError) as hugectr_error:
        HugeCTRNetwork.parse(path)
    assert str(onnx_error.value) == str(hugectr_error.value)
