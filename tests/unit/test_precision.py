"""fp16 / int8 embedding rows (issue 15): one encoding, held by the store, the caches and
the tiers, decoded by the fused native gathers exactly as the numpy reference does.

Expected values are computed here independently of :mod:`triton_rec.precision`
(``astype(float16)``, the fused 8-bit row-wise formula written out), never taken from
the code under test.
"""

import os
import struct

import numpy as np
import pytest

from tests.storage_fixtures import redis_cluster, rocksdb_dir  # noqa: F401  (fixtures)
from triton_rec import _native
from triton_rec.cache.array_cache import ArrayEmbeddingCache
from triton_rec.cache.cached_table import BackgroundInserter, CachedTable
from triton_rec.cache.shm_cache import SharedEmbeddingCache
from triton_rec.config.ps_json import parse_ps_config
from triton_rec.errors import CacheConfigMismatchError, ConfigError
from triton_rec.formats.tables import write_table
from triton_rec.precision import PRECISIONS, RowCodec
from triton_rec.storage import node_store
from triton_rec.storage.backing_store import LocalTableStore
from triton_rec.storage.rocksdb_store import RocksDBStore

ENCODED = ("fp16", "int8")


def _vectors(n, d, seed=0):
    rng = np.random.default_rng(seed)
    v = rng.normal(0, 0.3, size=(n, d)).astype(np.float32)
    if n > 2:
        v[1] = 0.25  # a constant row: range 0
        v[2, : max(1, d // 2)] = -7.5  # a wide row
    return v


def _int8_reference(v):
    """caffe2 FloatToFused8BitRowwiseQuantized__base, written out: uint8 q[D], then
    float32 scale = range / 255 and float32 bias = min."""
    v = v.astype(np.float32)
    lo = v.min(axis=1, keepdims=True)
    rng = v.max(axis=1, keepdims=True) - lo
    inv = np.float32(255.0) / (rng + np.float32(1e-8))
    q = np.clip(np.rint((v - lo) * inv), 0, 255).astype(np.uint8)
    tail = np.concatenate([rng / np.float32(255.0), lo], axis=1).astype("<f4")
    return np.concatenate([q, tail.view(np.uint8)], axis=1)


def _decoded_reference(precision, v):
    if precision == "fp32":
        return v
    if precision == "fp16":
        return v.astype(np.float16).astype(np.float32)
    rows = _int8_reference(v)
    d = v.shape[1]
    sb = rows[:, d:].copy().view("<f4")
    return rows[:, :d].astype(np.float32) * sb[:, :1] + sb[:, 1:]


# -- the encodings ----------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 7, 8, 33, 128])
def test_the_encodings_are_ieee_half_and_fused_8bit_rowwise(d):
    v = _vectors(50, d)
    np.testing.assert_array_equal(RowCodec("fp16", d).encode(v), v.astype(np.float16))
    np.testing.assert_array_equal(RowCodec("int8", d).encode(v), _int8_reference(v))
    assert RowCodec("int8", d).row_bytes == d + 8 and RowCodec("fp16", d).row_bytes == 2 * d


@pytest.mark.parametrize("precision", ENCODED)
@pytest.mark.parametrize("d", [1, 7, 8, 9, 16, 33, 128])
@pytest.mark.parametrize("portable", [False, True])
def test_native_decoders_equal_the_numpy_reference_bit_for_bit(precision, d, portable):
    codec = RowCodec(precision, d)
    v = _vectors(97, d, seed=d)
    if precision == "fp16":  # subnormal, infinities, NaN, signed zero
        v[0, 0] = 3e-6
        v[3, 0] = np.inf
        v[4, 0] = -np.inf
        v[5, 0] = -0.0
    rows = codec.encode(v)
    got = np.empty((97, d), np.float32)
    _native.decode_rows(rows, got, codec.code, portable)
    want = codec.decode(rows)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(want, _decoded_reference(precision, v))


def test_the_error_of_each_encoding_is_within_its_bound():
    v = _vectors(200, 64)
    fp16 = RowCodec("fp16", 64).roundtrip_error(v)[0]
    assert 0 < fp16 <= np.abs(v).max() * 2.0**-11
    int8 = RowCodec("int8", 64).decode(RowCodec("int8", 64).encode(v))
    half_step = (v.max(axis=1) - v.min(axis=1)) / 255 / 2
    assert (np.abs(int8 - v).max(axis=1) <= half_step * 1.001 + 1e-7).all()


def test_a_wrong_row_array_is_refused_with_its_shape():
    codec = RowCodec("int8", 4)
    with pytest.raises(ValueError, match=r"int8 rows .*uint8 \[2, 12\]"):
        codec.check_rows(np.zeros((2, 4), np.uint8), 2, "rows")
    with pytest.raises(ValueError, match="precision must be one of"):
        RowCodec("bf16", 4)
    with pytest.raises(ValueError, match="too few for an int8 row"):
        _native.decode_rows(np.zeros((1, 8), np.uint8), np.zeros((1, 0), np.float32), 2)


# -- the node store ---------------------------------------------------------------------


def _source(tmp_path, n=3000, d=16, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.choice(1 << 40, size=n, replace=False).astype(np.int64)
    vecs = _vectors(n, d, seed)
    path = str(tmp_path / f"t{seed}.npz")
    write_table(path, keys, vecs)
    return path, keys, vecs


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_layout_holds_the_encoded_rows_and_the_gather_decodes_them(tmp_path, precision):
    src, keys, vecs = _source(tmp_path)
    codec = RowCodec(precision, 16)
    res = node_store.ensure_layout(src, 16, str(tmp_path / "store"), precision=precision)
    raw = open(res.path, "rb").read()
    h = node_store.read_header(res.path)
    assert h.precision == precision and struct.unpack_from("<I", raw, 2224) == (codec.code,)
    encoded = vecs.astype(np.float16) if precision == "fp16" else _int8_reference(vecs)
    if precision == "fp32":
        encoded = vecs
    assert raw[h.vectors_offset : h.vectors_offset + encoded.nbytes] == encoded.tobytes()
    assert h.index_offset - h.vectors_offset >= len(keys) * codec.row_bytes
    node_store.verify_layout(res.path)

    table = node_store.open_table(res.path, "t", default_value=0.1)
    query = np.concatenate([keys[:100], [12345678901234]]).astype(np.int64)
    out, misses = table.lookup(query)
    assert misses == 1
    np.testing.assert_array_equal(out[:100], _decoded_reference(precision, vecs[:100]))
    assert (out[100] == np.float32(0.1)).all()  # exactly the default, in every precision


def test_each_precision_is_its_own_layout_and_a_second_load_reuses_it(tmp_path):
    src, _, _ = _source(tmp_path)
    store = str(tmp_path / "store")
    paths = {p: node_store.ensure_layout(src, 16, store, precision=p).path for p in PRECISIONS}
    assert len(set(paths.values())) == 3
    again = node_store.ensure_layout(src, 16, store, precision="int8")
    assert again.action == "reused" and again.path == paths["int8"]
    sizes = {p: node_store.read_header(paths[p]).data_bytes for p in PRECISIONS}
    assert sizes["fp16"] < sizes["fp32"] and sizes["int8"] < sizes["fp16"]


def test_a_version_1_layout_is_still_read_as_fp32(tmp_path):
    src, keys, vecs = _source(tmp_path)
    path = node_store.convert_table(src, 16, str(tmp_path / "store"))
    raw = bytearray(open(path, "rb").read())
    struct.pack_into("<I", raw, 8, 1)  # format version 1 (no precision field)
    raw[2224:2228] = b"\0\0\0\0"
    import hashlib

    raw[4064:4096] = hashlib.blake2b(bytes(raw[:4064]), digest_size=32).digest()
    old = str(tmp_path / "v1.tbl")
    open(old, "wb").write(raw)
    t = node_store.open_table(old, "t")
    assert t.codec.precision == "fp32"
    np.testing.assert_array_equal(t.lookup(keys[:5])[0], vecs[:5])


# -- caches ------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ENCODED)
def test_the_shared_cache_holds_encoded_rows_and_decodes_on_query(tmp_path, precision):
    codec = RowCodec(precision, 32)
    v = _vectors(64, 32)
    keys = np.arange(64, dtype=np.int64)
    fp32 = SharedEmbeddingCache.open("f32", 256, 32, directory=str(tmp_path))
    with SharedEmbeddingCache.open(
        "enc", 256, 32, precision=precision, directory=str(tmp_path)
    ) as c:
        assert c.codec == codec and c.nbytes < fp32.nbytes
        c.insert(keys, codec.encode(v))
        out = np.empty((64, 32), np.float32)
        hit = np.empty(64, np.uint8)
        assert c.query(keys, out, hit) == 64
        np.testing.assert_array_equal(out, _decoded_reference(precision, v))
        with pytest.raises(TypeError, match="must be"):
            c.insert(keys, v)  # float32 vectors are not rows of this cache
        with pytest.raises(CacheConfigMismatchError, match="precision"):
            SharedEmbeddingCache.open("enc", 256, 32, directory=str(tmp_path))
    fp32.close()


@pytest.mark.parametrize("precision", ENCODED)
def test_the_array_cache_holds_encoded_rows_with_the_same_algorithm(precision):
    codec = RowCodec(precision, 8)
    v = _vectors(40, 8)
    c = ArrayEmbeddingCache(4096, 8, ways=8, precision=precision)  # room for every key
    assert c.vectors.dtype == codec.row_dtype and c.vectors.shape[2] == codec.row_width
    c.insert(np.arange(40), codec.encode(v))
    out, hit = c.query(np.arange(40))
    assert bool(hit.all())
    np.testing.assert_array_equal(out, _decoded_reference(precision, v))
    attached = ArrayEmbeddingCache.from_arrays(c.state_arrays())
    assert attached.codec == codec


@pytest.mark.parametrize("precision", ENCODED)
def test_a_cached_table_moves_rows_encoded_and_answers_absent_keys_with_the_exact_default(
    tmp_path, precision
):
    src, keys, vecs = _source(tmp_path, n=500, d=8)
    path = node_store.ensure_layout(src, 8, str(tmp_path / "store"), precision=precision).path
    store = LocalTableStore(node_store.open_table(path, "t", default_value=0.1))
    with SharedEmbeddingCache.open(
        "ct", 1024, 8, precision=precision, directory=str(tmp_path)
    ) as cache:
        ct = CachedTable("t", store, cache, hit_rate_threshold=1.5)
        query = np.concatenate([keys[:20], [-1]]).astype(np.int64)
        first = np.empty((21, 8), np.float32)
        second = np.empty((21, 8), np.float32)
        assert ct.lookup(query, first) == 0
        assert ct.lookup(query, second) == 20  # misses came in encoded and stay so
        want = _decoded_reference(precision, vecs[:20])
        np.testing.assert_array_equal(first[:20], want)
        np.testing.assert_array_equal(second[:20], want)
        assert (first[20] == np.float32(0.1)).all() and (second[20] == np.float32(0.1)).all()
        with pytest.raises(ValueError, match="the cache holds fp32 rows"):
            CachedTable("t", store, SharedEmbeddingCache.open("x", 64, 8, directory=str(tmp_path)))


def test_online_updates_and_refresh_reach_an_encoded_cache(tmp_path):
    from triton_rec.storage.backing_store import DictStore

    class Int8Dict(DictStore):
        _codec = RowCodec("int8", 4)

        def fetch(self, keys, out):
            tmp = np.empty((keys.shape[0], 4), np.float32)
            found = super().fetch(keys, tmp)
            out[...] = self.codec.encode(tmp) if self.codec.is_rows(out) else tmp
            return found

    store = Int8Dict(4)
    v = _vectors(10, 4)
    store.upsert(np.arange(10), v)
    with SharedEmbeddingCache.open("u", 64, 4, precision="int8", directory=str(tmp_path)) as c:
        inserter = BackgroundInserter()
        ct = CachedTable("t", store, c, hit_rate_threshold=0.0, inserter=inserter)
        out = np.empty((10, 4), np.float32)
        ct.lookup(np.arange(10), out)  # answered with defaults, inserted in the background
        assert inserter.drain()
        store.upsert(np.arange(10), v * 2)
        assert ct.refresh(1.0) == 10
        ct.lookup(np.arange(10), out)
        np.testing.assert_array_equal(out, _decoded_reference("int8", v * 2))
        inserter.close()


# -- tiers -------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ENCODED)
def test_rocksdb_values_are_encoded_rows(rocksdb_dir, precision):  # noqa: F811
    codec = RowCodec(precision, 12)
    v = _vectors(30, 12)
    s = RocksDBStore(rocksdb_dir, "hps_et.m.t", 12, 0.5, precision=precision)
    try:
        s.upsert(np.arange(30), v)  # float32 vectors: encoded once, by the store
        raw = s._cf.get((3).to_bytes(8, "little"))
        assert raw == codec.encode(v[3:4]).tobytes() and len(raw) == codec.row_bytes
        out = np.empty((31, 12), np.float32)
        found = s.fetch(np.arange(31), out)
        assert found[:30].all() and not found[30]
        np.testing.assert_array_equal(out[:30], _decoded_reference(precision, v))
        assert (out[30] == np.float32(0.5)).all()
        rows = codec.empty(30)
        s.fetch_rows(np.arange(30), rows)
        np.testing.assert_array_equal(rows, codec.encode(v))
        s.upsert(np.arange(2), rows[5:7])  # rows of the codec are written as they are
        s.fetch_rows(np.arange(2), rows[:2])
        np.testing.assert_array_equal(rows[:2], rows[5:7])
    finally:
        s.close()


def test_redis_values_are_encoded_rows(redis_cluster):  # noqa: F811
    from triton_rec.storage.redis_store import RedisClusterStore

    codec = RowCodec("int8", 6)
    v = _vectors(40, 6)
    s = RedisClusterStore(redis_cluster.address, "hps_et.prec.t", 6, 0.0, precision="int8")
    try:
        s.upsert(np.arange(40), v)
        out = np.empty((40, 6), np.float32)
        assert s.fetch(np.arange(40), out).all()
        np.testing.assert_array_equal(out, _decoded_reference("int8", v))
        rows = codec.empty(40)
        s.fetch_rows(np.arange(40), rows)
        np.testing.assert_array_equal(rows, _int8_reference(v))
    finally:
        s.delete(np.arange(40))
        s.close()


# -- ps.json -----------------------------------------------------------------------------


def _ps(tmp_path, top=None, **model):
    entry = {
        "model": "m",
        "sparse_files": ["a.npz", "b.npz"],
        "embedding_table_names": ["a", "b"],
        "embedding_vecsize_per_table": [8, 8],
        "maxnum_catfeature_query_per_table_per_sample": [1, 1],
        **model,
    }
    return parse_ps_config(
        {"supportlonglong": True, "models": [entry], **(top or {})}, str(tmp_path)
    )


def test_ps_json_sets_the_precision_per_table(tmp_path):
    m = _ps(tmp_path, embedding_precision=["fp16", "INT8"]).models[0]
    assert [t.precision for t in m.tables] == ["fp16", "int8"]
    assert [t.precision for t in _ps(tmp_path).models[0].tables] == ["fp32", "fp32"]


def test_ps_json_names_a_bad_precision_and_its_table(tmp_path):
    with pytest.raises(ConfigError, match=r"table 'b': embedding_precision\[1\].*'bf16'"):
        _ps(tmp_path, embedding_precision=["fp16", "bf16"])
    with pytest.raises(ConfigError, match="'embedding_precision' has 1 entries"):
        _ps(tmp_path, embedding_precision=["fp16"])


def test_tables_fused_into_one_tier_table_need_one_precision(tmp_path):
    with pytest.raises(ConfigError, match="fused into fused_embedding0"):
        _ps(tmp_path, {"fuse_embedding_table": True}, embedding_precision=["fp16", "int8"])


def test_the_layout_memory_per_row_of_each_precision(tmp_path):
    """What the benchmark reports, checked on a small table: the row section shrinks by
    exactly the row sizes (keys and index stay)."""
    src, keys, _ = _source(tmp_path, n=4096, d=128)
    store = str(tmp_path / "store")
    h = {
        p: node_store.read_header(node_store.ensure_layout(src, 128, store, precision=p).path)
        for p in PRECISIONS
    }
    rows = {p: h[p].index_offset - h[p].vectors_offset for p in PRECISIONS}
    assert rows["fp16"] / rows["fp32"] == pytest.approx(0.5, abs=0.01)
    assert rows["int8"] / rows["fp32"] == pytest.approx(136 / 512, abs=0.01)
    assert os.path.getsize(store + "/layouts") >= 0
