"""ps.json means what it means to HPS: upstream's defaults and spellings (HugeCTR v23.09,
file and line of each in docs/upstream-notes.md, "Defaults and spellings"), and the two
places where upstream's default is a hazard and this parser refuses instead."""

from __future__ import annotations

import os

import pytest

from triton_rec.config.ps_json import (
    EmbeddingCacheType,
    OverflowPolicy,
    config_warnings,
    default_num_partitions,
    parse_ps_config,
)
from triton_rec.errors import ConfigError


def _model(**over):
    m = {
        "model": "m",
        "sparse_files": ["a.model", "b.model", "c.model"],
        "embedding_vecsize_per_table": [4, 8, 16],
        "maxnum_catfeature_query_per_table_per_sample": [1, 2, 3],
        "max_batch_size": 16,
    }
    m.update(over)
    return m


def _cfg(model=None, **top):
    return parse_ps_config({"supportlonglong": True, "models": [model or _model()], **top})


def test_model_defaults_are_hps_ones():
    doc = _model()
    del doc["max_batch_size"]
    m = _cfg(doc).model("m")
    assert m.max_batch_size == 64  # inference_utils.cpp L519
    assert m.hit_rate_threshold == 0.9 and m.gpucacheper == 0.2 and m.gpucache is True
    assert m.init_ec is True  # L670
    assert m.cache_refresh_percentage_per_iteration == 0.0  # L553-554
    assert m.embedding_cache_type == EmbeddingCacheType.DYNAMIC


def test_tier_defaults_are_hps_ones():
    cfg = _cfg(
        volatile_db={"type": "redis_cluster"},
        persistent_db={"type": "rocks_db", "path": "/tmp/x"},
    )
    vol, per = cfg.volatile_db, cfg.persistent_db
    assert vol.max_batch_size == 65536 and per.max_batch_size == 65536  # hpp L170
    assert vol.overflow_policy == OverflowPolicy.EVICT_RANDOM  # hpp L180
    assert vol.overflow_resolution_target == 0.8 and vol.overflow_margin is None
    # num_partitions absent: detected from a table the cluster holds, else HPS's default
    assert vol.num_partitions is None
    assert default_num_partitions() == max(1, min(16, os.cpu_count() or 1))  # L83-86


def test_a_volatile_section_without_type_is_disabled_and_a_missing_one_is_the_hash_map():
    with_rocks = {"persistent_db": {"type": "rocks_db", "path": "/tmp/x"}}
    assert _cfg(volatile_db={"max_batch_size": 10}, **with_rocks).volatile_db.type == "disabled"
    assert _cfg(**with_rocks).volatile_db.type == "hash_map"
    assert _cfg().volatile_db.type == "hash_map"


def test_a_volatile_section_without_type_and_no_persistent_tier_is_refused_with_the_reason():
    # HPS would answer every key with the default value; we refuse and say why
    with pytest.raises(ConfigError, match="has no 'type': HPS reads that as disabled"):
        _cfg(volatile_db={"num_partitions": 4})


@pytest.mark.parametrize(
    "section, spelling, expected",
    [
        ("volatile_db", "hashmap", "hash_map"),
        ("volatile_db", "hash", "hash_map"),
        ("volatile_db", "map", "hash_map"),
        ("volatile_db", "parallel_hashmap", "hash_map"),
        ("volatile_db", "parallel_map", "hash_map"),
        ("volatile_db", "multi_process_hash", "hash_map"),
        ("volatile_db", "redis", "redis_cluster"),
        ("volatile_db", "Redis_Cluster", "redis_cluster"),
        ("volatile_db", "none", "disabled"),
        ("volatile_db", "disable", "disabled"),
        ("persistent_db", "rocks", "rocks_db"),
        ("persistent_db", "rocksdb", "rocks_db"),
        ("persistent_db", "none", "disabled"),
    ],
)
def test_every_database_type_spelling_hps_accepts(section, spelling, expected):
    other = (
        {"persistent_db": {"type": "rocks_db", "path": "/tmp/x"}}
        if section == "volatile_db"
        else {}
    )
    cfg = _cfg(**{section: {"type": spelling}}, **other)
    assert getattr(cfg, section).type == expected


@pytest.mark.parametrize(
    "spelling, expected",
    [
        ("random", OverflowPolicy.EVICT_RANDOM),
        ("oldest", OverflowPolicy.EVICT_OLDEST),
        ("least_used", OverflowPolicy.EVICT_LEAST_USED),
        ("EVICT_OLDEST", OverflowPolicy.EVICT_OLDEST),
    ],
)
def test_every_overflow_policy_spelling_hps_accepts(spelling, expected):
    vol = {"type": "redis", "overflow_policy": spelling}
    assert _cfg(volatile_db=vol).volatile_db.overflow_policy == expected


@pytest.mark.parametrize("spelling", ["null", "none", "NULL"])
def test_update_source_null_spellings(spelling):
    assert not _cfg(update_source={"type": spelling}).update_source.enabled


def test_an_unknown_spelling_is_refused_not_silently_defaulted():
    # HPS falls back to its default on an unknown string; a typo must not do that here
    with pytest.raises(ConfigError, match="volatile_db.type: must be one of"):
        _cfg(volatile_db={"type": "redis_clustr"})


def test_a_short_default_value_list_is_padded_with_zero_and_said_at_load():
    m = _cfg(_model(default_value_for_each_table=[1.5])).model("m")
    assert [t.default_value for t in m.tables] == [1.5, 0.0, 0.0]
    (note,) = [w for w in config_warnings("ps.json", m) if "default_value_for_each_table" in w]
    assert "the last 2 tables default to 0.0" in note


def test_a_long_default_value_list_loses_its_extra_entries_and_says_so():
    m = _cfg(_model(default_value_for_each_table=[1, 2, 3, 4])).model("m")
    assert [t.default_value for t in m.tables] == [1.0, 2.0, 3.0]
    assert any("the extra 1 are ignored" in w for w in config_warnings("ps.json", m))


@pytest.mark.parametrize(
    "over, expected",
    [
        ({"embedding_cache_type": "static"}, EmbeddingCacheType.STATIC),
        ({"embedding_cache_type": "UVM"}, EmbeddingCacheType.UVM),
        ({"embedding_cache_type": "stochastic"}, EmbeddingCacheType.STOCHASTIC),
        ({"use_static_table": True}, EmbeddingCacheType.STATIC),
        ({"use_static_table": True, "embedding_cache_type": "dynamic"}, EmbeddingCacheType.STATIC),
    ],
)
def test_embedding_cache_types_and_use_static_table(over, expected):
    m = _cfg(_model(**over)).model("m")
    assert m.embedding_cache_type == expected
    assert m.embedding_cache_type.exact == (expected in ("static", "uvm"))


def test_uvm_and_stochastic_say_how_they_are_served():
    for typ, served in (("uvm", "static (every miss fetched)"), ("stochastic", "dynamic")):
        m = _cfg(_model(embedding_cache_type=typ)).model("m")
        assert any(f"is served as {served}" in w for w in config_warnings("ps.json", m))


def test_each_gpu_only_option_is_named_with_what_it_means_here():
    m = _cfg(_model(fp8_quant=True, use_context_stream=False, thread_pool_size=4)).model("m")
    warnings = config_warnings("ps.json", m)
    assert any("'fp8_quant' has no effect on this node: fp8 storage" in w for w in warnings)
    assert any("'use_context_stream' has no effect" in w for w in warnings)
    assert any("'thread_pool_size' has no effect" in w for w in warnings)
    assert not any("unknown key" in w for w in warnings)
