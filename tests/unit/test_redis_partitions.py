"""``volatile_db.num_partitions`` absent: HPS's default depends on the machine that wrote
the table (min(16, hardware threads), HugeCTR inference_utils.cpp L83-86), so a table HPS
filled is read with the count it was written with, found from where its keys are; a
layout that fits no count or several is refused instead of answered with default values.
The HPS-side layout is written by tests/hps_layout.py (HPS's own key hash), not by the
store under test."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.hps_layout import write_hps_redis
from tests.storage_fixtures import redis_cluster  # noqa: F401
from triton_rec.config.ps_json import default_num_partitions
from triton_rec.errors import StoreDataError
from triton_rec.storage.redis_store import PARTITIONS_META, RedisClusterStore, partition_of

_names = (f"parts.t{i}" for i in itertools.count())


def _rows(n, vec=4, seed=0):
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(-(2**62), 2**62, size=n, dtype=np.int64))
    return keys, rng.standard_normal((keys.shape[0], vec)).astype(np.float32)


@pytest.mark.parametrize("written_with", [3, 16, 24])
def test_a_table_hps_wrote_is_read_with_the_count_it_was_written_with(
    redis_cluster,  # noqa: F811
    written_with,
):
    table = next(_names)
    keys, vectors = _rows(3000)
    write_hps_redis(redis_cluster, table, keys, vectors, written_with)
    store = RedisClusterStore(redis_cluster.address, table, 4)  # num_partitions absent
    try:
        assert store.num_partitions == written_with
        out = np.empty_like(vectors)
        assert store.fetch(keys, out).all()
        np.testing.assert_array_equal(out, vectors)
        assert store.get_meta(PARTITIONS_META) == str(written_with)  # recorded for next time
    finally:
        store.close()


def test_too_few_keys_to_tell_the_count_is_refused_naming_the_fix(redis_cluster):  # noqa: F811
    # One key, in partition 0 of 16: it sits in partition 0 under 1, 2, 4, 8 and 16 too.
    # (With a few keys more the count is pinned: it must divide hash(k) - partition for
    # every key, and any other candidate fails for some key.)
    table = next(_names)
    cands = np.arange(1, 1000, dtype=np.int64)
    key = cands[partition_of(cands, 16) == 0][:1]
    write_hps_redis(redis_cluster, table, key, np.zeros((1, 4), np.float32), 16)
    with pytest.raises(StoreDataError, match="fit .* partition counts .*set volatile_db"):
        RedisClusterStore(redis_cluster.address, table, 4)


def test_keys_no_count_places_where_they_are_are_refused(redis_cluster):  # noqa: F811
    table = next(_names)
    keys, vectors = _rows(500)
    write_hps_redis(redis_cluster, table, keys, vectors, 8)
    # one more key, put where a count of 7 would put it and 8 does not
    cands = np.arange(1, 1000, dtype=np.int64)
    stray = cands[partition_of(cands, 7) != partition_of(cands, 8)][:1]
    write_hps_redis(redis_cluster, table, stray, vectors[:1], 7)
    with pytest.raises(StoreDataError, match="no partition count"):
        RedisClusterStore(redis_cluster.address, table, 4)


def test_a_count_that_contradicts_the_recorded_one_is_refused(redis_cluster):  # noqa: F811
    table = next(_names)
    RedisClusterStore(redis_cluster.address, table, 4, num_partitions=8).close()
    with pytest.raises(StoreDataError, match="written with 8 partitions"):
        RedisClusterStore(redis_cluster.address, table, 4, num_partitions=16)


def test_a_new_table_gets_hps_default_count(redis_cluster):  # noqa: F811
    store = RedisClusterStore(redis_cluster.address, next(_names), 4)
    try:
        assert store.num_partitions == default_num_partitions()
    finally:
        store.close()
