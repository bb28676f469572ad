"""Node-local table layouts (triton_rec.storage.node_store): convert once, map everywhere."""

import hashlib
import multiprocessing
import os
import struct

import numpy as np
import pytest

from ps_loader.__main__ import main as ps_loader_main
from triton_rec import _native
from triton_rec.config.ps_json import TableParams
from triton_rec.errors import DuplicateKeyError, ModelFileError
from triton_rec.formats.tables import write_table
from triton_rec.storage import node_store
from triton_rec.storage.table import EmbeddingTable


def _table(n=3000, d=8, seed=0):
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(-(10**9), 10**9, size=2 * n + 16, dtype=np.int64))[:n] * 7
    rng.shuffle(keys)
    return keys, rng.standard_normal((n, d)).astype(np.float32)


def _source(tmp_path, name="t0_sparse_0.model", n=3000, d=8, seed=0):
    keys, vecs = _table(n, d, seed)
    path = str(tmp_path / "src" / name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_table(path, keys, vecs)
    return path, keys, vecs


def _query(keys, seed=1):
    """Known keys in random order plus keys that are not in the table."""
    rng = np.random.default_rng(seed)
    known = rng.choice(keys, size=min(500, keys.size), replace=False) if keys.size else keys
    unknown = rng.integers(10**12, 10**13, size=200, dtype=np.int64)
    q = np.concatenate([known, unknown])
    rng.shuffle(q)
    return q


def _params(path, d=8, default=-2.5, name="t"):
    return TableParams(name, path, d, 4, default)


def _forbid(monkeypatch, *names):
    def boom(*a, **k):
        raise AssertionError("the source was read or converted again")

    for n in names:
        monkeypatch.setattr(node_store, n, boom)


def _layouts(store):
    return sorted(os.listdir(os.path.join(store, "layouts")))


def test_a_layout_serves_exactly_the_lookups_of_a_privately_built_table(tmp_path):
    src, keys, vecs = _source(tmp_path)
    mapped = node_store.load_table(_params(src), str(tmp_path / "store"))
    private = EmbeddingTable("t", keys, vecs, -2.5, src)
    np.testing.assert_array_equal(mapped.keys, keys)
    np.testing.assert_array_equal(mapped.vectors, vecs)
    np.testing.assert_array_equal(mapped.index, _native.build_index(keys))
    q = _query(keys)
    got, got_misses = mapped.lookup(q)
    want, want_misses = private.lookup(q)
    assert got_misses == want_misses == 200
    np.testing.assert_array_equal(got, want)
    assert (mapped.name, mapped.default_value) == ("t", -2.5)
    assert (mapped.num_rows, mapped.vec_size) == (3000, 8)
    assert mapped.path == src and mapped.layout_path.startswith(str(tmp_path / "store"))


def test_the_layout_file_follows_the_documented_byte_layout(tmp_path):
    src, keys, vecs = _source(tmp_path, n=1000, d=5)
    path = node_store.convert_table(src, 5, str(tmp_path / "store"))
    raw = open(path, "rb").read()
    magic, version, hsize, n, d, cap, ko, vo, io, size = struct.unpack_from("<8sIIQQQQQQQ", raw)
    assert (magic, version, hsize, n, d) == (b"TRECTBL\0", 2, 4096, 1000, 5)
    assert cap == 2048 and (ko, vo, io) == (4096, 4096 + 8192, 4096 + 8192 + 20480)
    assert size == len(raw) == io + 16 * cap
    assert raw[ko : ko + 8000] == keys.astype("<i8").tobytes()
    assert raw[vo : vo + 20000] == vecs.astype("<f4").tobytes()
    assert raw[io:] == _native.build_index(keys).tobytes()
    assert raw[4064:4096] == hashlib.blake2b(raw[:4064], digest_size=32).digest()
    assert raw[170 : 170 + len(src)] == src.encode()
    assert struct.unpack_from("<I", raw, 2224) == (0,)  # precision code: fp32


def test_the_content_digest_is_the_documented_tree_hash(tmp_path):
    src, keys, vecs = _source(tmp_path, n=100, d=3)
    h = node_store.read_header(node_store.convert_table(src, 3, str(tmp_path / "store")))

    def leaf(b):
        return hashlib.blake2b(b, digest_size=32, person=b"trec-leaf").digest()

    root = hashlib.blake2b(digest_size=32, person=b"trec-content")
    root.update(struct.pack("<QQQ", 64 << 20, 100, 3) + leaf(keys.tobytes()) + leaf(vecs.tobytes()))
    assert h.content_digest == root.hexdigest()
    assert os.path.basename(h.source) == "t0_sparse_0.model"


def test_a_second_load_takes_the_fast_path_and_never_reads_the_source(tmp_path, monkeypatch):
    src, keys, vecs = _source(tmp_path)
    store = str(tmp_path / "store")
    first = node_store.ensure_layout(src, 8, store)
    assert first.action == "converted"
    _forbid(monkeypatch, "read_table_rows", "content_digest", "_write_layout", "_build_index")
    again = node_store.ensure_layout(src, 8, store)
    assert again.action == "reused" and again.path == first.path
    table = node_store.load_table(_params(src), store)
    np.testing.assert_array_equal(table.lookup(keys[:50])[0], vecs[:50])
    assert _layouts(store) == [os.path.basename(first.path)]


def test_a_touched_or_copied_source_with_the_same_content_is_found_by_digest(tmp_path, monkeypatch):
    src, keys, vecs = _source(tmp_path)
    store = str(tmp_path / "store")
    first = node_store.convert_table(src, 8, store)
    st = os.stat(os.path.join(src, "key"))
    os.utime(os.path.join(src, "key"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    copy, _, _ = _source(tmp_path, name="copy_sparse_0.model")  # same seed: same content
    _forbid(monkeypatch, "_write_layout")
    touched = node_store.ensure_layout(src, 8, store)
    copied = node_store.ensure_layout(copy, 8, store)
    assert (touched.action, copied.action) == ("aliased", "aliased")
    assert touched.path == copied.path == first
    # The new fingerprints are recorded: next time both take the fast path.
    assert node_store.ensure_layout(src, 8, store).action == "reused"
    assert node_store.ensure_layout(copy, 8, store).action == "reused"


def test_changed_content_is_converted_anew_and_served(tmp_path):
    src, keys, vecs = _source(tmp_path)
    store = str(tmp_path / "store")
    old = node_store.convert_table(src, 8, store)
    new_vecs = vecs + 1.0
    write_table(src, keys, new_vecs)
    res = node_store.ensure_layout(src, 8, store)
    assert res.action == "converted" and res.path != old
    assert node_store.verify_layout(res.path).content_digest == res.digest
    table = node_store.load_table(_params(src), store)
    np.testing.assert_array_equal(table.lookup(keys)[0], new_vecs)
    assert len(_layouts(store)) == 2  # the old layout stays for processes that map it


def _truncate(p):
    os.truncate(p, os.path.getsize(p) - 4096)


def _flip_header_byte(p):
    with open(p, "r+b") as f:
        f.seek(20)
        b = f.read(1)
        f.seek(20)
        f.write(bytes([b[0] ^ 1]))


def _clobber_magic(p):
    with open(p, "r+b") as f:
        f.write(b"NOTATBL\0")


def _scramble_index(p):
    io = node_store.read_header(p).index_offset
    with open(p, "r+b") as f:
        f.seek(io)
        f.write(b"\xff" * (os.path.getsize(p) - io))


@pytest.mark.parametrize(
    "damage, needle",
    [
        (_truncate, "incomplete"),
        (lambda p: os.truncate(p, 100), "truncated"),
        (_flip_header_byte, "checksum"),
        (_clobber_magic, "bad magic"),
        (_scramble_index, "index"),
    ],
    ids=["truncated", "header-cut-short", "header-bit-flip", "not-a-layout", "garbage-index"],
)
def test_a_damaged_layout_is_named_on_open_and_reconverted_by_load(tmp_path, damage, needle):
    src, keys, vecs = _source(tmp_path)
    store = str(tmp_path / "store")
    path = node_store.convert_table(src, 8, store)
    os.chmod(path, 0o644)  # layouts are read-only on purpose
    damage(path)
    with pytest.raises(node_store.CorruptLayoutError, match=needle) as e:
        node_store.open_table(path, "t")
    assert e.value.path == path and path in str(e.value)
    table = node_store.load_table(_params(src), store)
    np.testing.assert_array_equal(table.lookup(keys)[0], vecs)
    assert node_store.ensure_layout(src, 8, store).action == "reused"


def test_a_missing_layout_is_a_model_file_error_naming_it(tmp_path):
    path = str(tmp_path / "nope.tbl")
    with pytest.raises(ModelFileError, match="does not exist") as e:
        node_store.open_table(path, "t")
    assert e.value.path == path


def test_verify_reads_everything_and_catches_a_flipped_vector_bit_that_open_does_not(tmp_path):
    src, keys, vecs = _source(tmp_path)
    path = node_store.convert_table(src, 8, str(tmp_path / "store"))
    assert node_store.verify_layout(path).n_rows == 3000
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(node_store.read_header(path).vectors_offset + 4 * 777)
        f.write(b"\x00\x00\xc0\x7f")  # a NaN
    node_store.open_table(path, "t")  # cheap checks only: the data is not read
    with pytest.raises(node_store.CorruptLayoutError, match="content digest") as e:
        node_store.verify_layout(path)
    assert e.value.path == path


def test_an_npz_source_works_and_shares_the_layout_of_the_same_hugectr_table(tmp_path):
    keys, vecs = _table()
    npz = str(tmp_path / "t.npz")
    write_table(npz, keys, vecs)
    store = str(tmp_path / "store")
    res = node_store.ensure_layout(npz, 8, store)
    assert res.action == "converted"
    table = node_store.load_table(_params(npz), store)
    np.testing.assert_array_equal(table.lookup(keys)[0], vecs)
    assert node_store.ensure_layout(npz, 8, store).action == "reused"
    # The digest is over the table, not the file format.
    src, _, _ = _source(tmp_path)
    assert node_store.ensure_layout(src, 8, store).path == res.path


def test_duplicate_keys_fail_naming_the_source_file_and_leave_nothing_behind(tmp_path):
    keys, vecs = _table(n=100)
    keys[70] = keys[3]
    src = str(tmp_path / "dup_sparse_0.model")
    write_table(src, keys, vecs)
    store = str(tmp_path / "store")
    with pytest.raises(DuplicateKeyError) as e:
        node_store.load_table(_params(src), store)
    assert e.value.path == src and f"duplicate key {keys[3]}" in str(e.value)
    assert "rows 3 and 70" in str(e.value)
    assert _layouts(store) == [] and os.listdir(os.path.join(store, "sources")) == []


@pytest.mark.parametrize(
    "damage, names",
    [
        (lambda p: os.unlink(os.path.join(p, "emb_vector")), "emb_vector"),
        (lambda p: os.truncate(os.path.join(p, "emb_vector"), 100 * 32 - 4), "emb_vector"),
    ],
)
def test_a_broken_source_fails_naming_its_file(tmp_path, damage, names):
    src, _, _ = _source(tmp_path, n=100)
    damage(src)
    with pytest.raises(ModelFileError) as e:
        node_store.convert_table(src, 8, str(tmp_path / "store"))
    assert e.value.path.endswith(names)


def test_a_store_without_room_fails_before_writing_and_names_the_store(tmp_path, monkeypatch):
    src, _, _ = _source(tmp_path)
    store = str(tmp_path / "store")
    real_statvfs = os.statvfs

    def nearly_full(path):
        st = tuple(real_statvfs(path))
        return os.statvfs_result(st[:4] + (1,) + st[5:])  # f_bavail: one block

    monkeypatch.setattr(os, "statvfs", nearly_full)
    with pytest.raises(node_store.StoreError, match="GB free") as e:
        node_store.convert_table(src, 8, store)
    assert os.path.join(store, "layouts") in str(e.value) and src in str(e.value)
    assert _layouts(store) == []


def test_the_arrays_of_a_loaded_table_are_read_only_views_of_one_mapping(tmp_path):
    src, _, _ = _source(tmp_path)
    t = node_store.load_table(_params(src), str(tmp_path / "store"))
    for a in (t.keys, t.vectors, t.index):
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[0] = 1
    assert t.vectors.base is not None and np.shares_memory(t.keys.base, t.vectors.base)
    assert oct(os.stat(t.layout_path).st_mode & 0o777) == "0o444"


def _resident(path: str) -> int:
    """Bytes of ``path`` mapped and resident in this process (/proc/self/smaps Rss)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                mine = len(parts) > 5 and os.path.realpath(parts[5]) == os.path.realpath(path)
            elif mine and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    return total


@pytest.mark.parametrize("keys_are", ["scattered", "a range"])
def test_prefault_makes_resident_what_a_lookup_reads_and_changes_nothing(tmp_path, keys_are):
    # a lookup reads the vectors and, unless the keys are a range, the index; never the
    # keys section (the index holds the keys), which stays out of the process's memory
    keys, vecs = _table(n=20_000, d=8)
    if keys_are == "a range":
        keys = np.arange(-5_000, 15_000, dtype=np.int64)
    src = str(tmp_path / "src" / "t0_sparse_0.model")
    os.makedirs(os.path.dirname(src))
    write_table(src, keys, vecs)
    mapped = node_store.load_table(_params(src), str(tmp_path / "store"), prefault=True)
    reads = vecs.nbytes + (0 if keys_are == "a range" else mapped.index.nbytes)
    assert mapped.key_base == (-5_000 if keys_are == "a range" else None)
    assert mapped.prefault() == reads
    resident = _resident(mapped.layout_path)
    # Besides what lookups read: the header's page, the pages of the load's 16 index
    # probes, and what the kernel maps around a faulting page of a file in the page cache
    # (fault-around: up to 16 pages; 27 pages in all once in a full run). Fewer than the
    # keys' 39 pages, which would all be resident had the load not let them go.
    assert reads <= resident < reads + keys.nbytes, (resident, reads, keys.nbytes)
    private = EmbeddingTable("p", keys, vecs, default_value=-2.5)
    assert private.key_base == mapped.key_base and private.prefault() == reads
    q = _query(keys)
    np.testing.assert_array_equal(mapped.lookup(q)[0], private.lookup(q)[0])
    np.testing.assert_array_equal(mapped.lookup(keys)[0], vecs)


def test_an_empty_table_converts_and_answers_defaults(tmp_path):
    src = str(tmp_path / "empty.model")
    write_table(src, np.empty(0, np.int64), np.empty((0, 4), np.float32))
    t = node_store.load_table(_params(src, d=4, default=7.0), str(tmp_path / "store"))
    out, misses = t.lookup(np.array([1, 2], np.int64))
    assert misses == 2 and (out == 7.0).all() and t.num_rows == 0


def test_from_layout_takes_a_ready_index_and_rejects_one_of_the_wrong_capacity():
    keys, vecs = _table(n=100)
    index = _native.build_index(keys)
    t = EmbeddingTable.from_layout("t", keys, vecs, index, 1.0, "/models/t")
    assert t.index is index and t.path == "/models/t" and t.layout_path is None
    with pytest.raises(ValueError, match="expected \\(256, 2\\)"):
        EmbeddingTable.from_layout("t", keys, vecs, _native.build_index(keys[:10]))
    with pytest.raises(ValueError, match="vectors"):
        EmbeddingTable.from_layout("t", keys, vecs[:, 0], index)


def test_the_store_defaults_to_the_environment_then_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_REC_STORE", str(tmp_path / "s"))
    assert node_store.default_store_dir() == str(tmp_path / "s")
    monkeypatch.delenv("TRITON_REC_STORE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert node_store.default_store_dir() == str(tmp_path / "home/.cache/triton-rec/store")


def test_the_convert_command_converts_each_table_once_and_prints_the_layouts(tmp_path, capsys):
    src_a, _, _ = _source(tmp_path, name="a_sparse_0.model", seed=1)
    src_b, _, _ = _source(tmp_path, name="b_sparse_0.model", d=4, seed=2)
    ps = tmp_path / "ps.json"
    ps.write_text(  # %-format: JSON, whose braces a format string would need doubled
        '{"supportlonglong": true, "models": [{"model": "m", "sparse_files": ["%s", "%s"],'  # noqa: UP031
        ' "embedding_vecsize_per_table": [8, 4], "embedding_table_names": ["a", "b"],'
        ' "maxnum_catfeature_query_per_table_per_sample": [1, 1], "max_batch_size": 8}]}'
        % (src_a, src_b)
    )
    store = str(tmp_path / "store")
    assert ps_loader_main(["convert", str(ps), "--store", store]) == 0
    out = capsys.readouterr().out
    for name in _layouts(store):
        assert os.path.join(store, "layouts", name) in out
    assert out.count("converted") == 2 and "MB/s" in out
    assert ps_loader_main(["convert", str(ps), "--store", store, "--model", "m"]) == 0
    assert capsys.readouterr().out.count("up to date") == 2


def _load_in_child(src, store, log_path, barrier, results):
    """Run in a spawned process: load the table, count conversions, report what it sees."""
    import time

    from triton_rec.storage import node_store as ns

    write_layout = ns._write_layout

    def counted(*a, **k):
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # hold the lock long enough for the others to queue behind it
        return write_layout(*a, **k)

    ns._write_layout = counted
    barrier.wait(timeout=60)
    t = ns.load_table(TableParams("t", src, 8, 4, -2.5), store)
    out, misses = t.lookup(np.arange(-(10**9), 10**9, 7 * 997, dtype=np.int64))
    seen = (os.stat(t.layout_path).st_ino, t.layout_path, hashlib.sha256(out).hexdigest(), misses)
    results.put(seen)


def test_four_processes_loading_at_once_convert_exactly_once_and_see_the_same_data(tmp_path):
    src, keys, vecs = _source(tmp_path, n=20000)
    store, log_path = str(tmp_path / "store"), str(tmp_path / "conversions.log")
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [
        ctx.Process(target=_load_in_child, args=(src, store, log_path, barrier, results))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    seen = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(open(log_path).read().split()) == 1
    assert len(set(seen)) == 1
    ino, path, digest, misses = seen[0]
    want, want_misses = EmbeddingTable("t", keys, vecs, -2.5).lookup(
        np.arange(-(10**9), 10**9, 7 * 997, dtype=np.int64)
    )
    assert (digest, misses) == (hashlib.sha256(want).hexdigest(), want_misses)
    assert _layouts(store) == [os.path.basename(path)]  # no temporary file left either
