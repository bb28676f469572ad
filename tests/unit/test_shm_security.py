"""Private shared memory (issue 11): segments planted by another user are never used,
non-private files are refused, and every node store has its own segments.

The attacker is a real process of another uid: a child forked from the test (which
runs as root) that drops to uid/gid 65534 (nobody) before creating its files, and stays
alive while the server side opens its caches.
"""

from __future__ import annotations

import contextlib
import os
import uuid

import numpy as np
import pytest

from ps_loader.synthetic import SyntheticTable, expected_vectors, table_keys, write_model
from triton_rec.cache import gpu_share
from triton_rec.cache.shm_cache import SharedEmbeddingCache, segment_path
from triton_rec.config.ps_json import parse_ps_config
from triton_rec.errors import CacheConfigMismatchError, CacheError
from triton_rec.serving.deployment import InstanceSpec, cache_capacity, cache_name, open_session

SHM = "/dev/shm"
NOBODY = 65534
FORGED = 666.0
SEED = 5
TABLES = [SyntheticTable("a", rows=400, vec_size=8, max_keys_per_sample=2, default_value=-1.0)]

#: Only the cases that plant files as a second user need root (setuid/chown); the
#: checks of our own uid's files run everywhere. These machines (and CI) run as root.
needs_other_uid = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


@contextlib.contextmanager
def as_nobody(plant):
    """Run ``plant()`` in a forked child as uid/gid 65534; it stays alive (holding what
    it created) until the block ends, then runs the cleanup ``plant`` returned."""
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            os.close(ready_r)
            os.close(hold_w)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.umask(0)
            cleanup = plant()
            os.write(ready_w, b"ready")
            os.read(hold_r, 1)  # until the parent closes its end
            cleanup()
            code = 0
        except BaseException as e:  # report to the parent, never run pytest in the child
            os.write(ready_w, f"error: {e!r}".encode()[:4000])
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(hold_r)
    try:
        msg = os.read(ready_r, 4096).decode()
        assert msg == "ready", f"attacker process failed: {msg}"
        yield pid
    finally:
        os.close(hold_w)
        os.close(ready_r)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def plant_segment(name, directory, capacity, vec_size, keys, mode=0o666, **kw):
    """What an attacker does: a real cache segment under our name, world-writable, full
    of forged vectors for our keys, attached by its own live process."""

    def plant():
        cache = SharedEmbeddingCache.open(name, capacity, vec_size, directory=directory, **kw)
        os.chmod(cache.path, mode)
        k = np.asarray(keys, np.int64)
        cache.insert(k, np.full((k.shape[0], vec_size), FORGED, np.float32))
        return cache.close

    return plant


def query(cache, keys):
    keys = np.asarray(keys, np.int64)
    out = np.zeros((keys.shape[0], cache.vec_size), np.float32)
    hit = np.zeros(keys.shape[0], np.uint8)
    cache.query(keys, out, hit)
    return out, hit.astype(bool)


@pytest.fixture
def name():
    n = f"pytest-sec-{uuid.uuid4().hex[:8]}.cpu.t"
    yield n
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(n))


# ---------------------------------------------------------------------------------------
# the segment itself


@needs_other_uid
@pytest.mark.parametrize("same_config", [True, False])
def test_a_segment_planted_by_another_uid_is_refused_and_never_read(name, same_config):
    keys = np.arange(50)
    with as_nobody(plant_segment(name, SHM, 64, 8 if same_config else 4, keys)):
        path = segment_path(name)
        st = os.stat(path)
        assert st.st_uid == NOBODY and st.st_mode & 0o777 == 0o666
        with pytest.raises(CacheError) as exc:
            cache = SharedEmbeddingCache.open(name, 64, 8, directory=SHM)
            try:  # only reached if it attached: show what it would serve
                out, hit = query(cache, keys)
                pytest.fail(
                    f"attached to a foreign segment: hits {hit.sum()}, "
                    f"forged values served: {bool((out == FORGED).any())}"
                )
            finally:
                cache.close()
        msg = str(exc.value)
        assert path in msg and f"owner uid {NOBODY}" in msg and "mode 0666" in msg
        assert not isinstance(exc.value, CacheConfigMismatchError)  # never read its header
        assert os.stat(path).st_ino == st.st_ino  # left alone


@pytest.mark.parametrize("how", ["mode 0644", "symlink"])
def test_a_non_private_segment_of_our_own_uid_is_refused(name, how, tmp_path):
    with SharedEmbeddingCache.open(name, 64, 8, directory=str(tmp_path)) as mine:
        if how == "mode 0644":
            os.chmod(mine.path, 0o644)
            path = mine.path
        else:
            path = segment_path(name, str(tmp_path / "links"))
            os.mkdir(os.path.dirname(path), 0o700)
            os.symlink(mine.path, path)
        with pytest.raises(
            CacheError, match="mode 0644" if how == "mode 0644" else "symbolic link"
        ):
            SharedEmbeddingCache.open(name, 64, 8, directory=os.path.dirname(path)).close()


# ---------------------------------------------------------------------------------------
# through the backends' deployment: namespaces per node store


def _params(repo, **over):
    entry = write_model(str(repo), "msec", TABLES, SEED)
    entry.update({"gpucacheper": 0.5, "hit_rate_threshold": 1.1, **over})  # misses: exact
    return parse_ps_config({"supportlonglong": True, "models": [entry]}, base_dir=str(repo)).models[
        0
    ]


def _lookup(session, keys):
    return session.lookup(session.parse_request(keys, np.array([len(keys)], np.int32)))


def _ns_dirs():
    return sorted(e for e in os.listdir(SHM) if e.startswith("trec-ns-"))


@needs_other_uid
def test_the_backends_never_serve_a_segment_planted_by_another_uid(tmp_path):
    p = _params(tmp_path / "repo")
    spec = InstanceSpec(store_dir=str(tmp_path / "store"))
    keys = table_keys(SEED, 0, TABLES[0].rows)[:32]
    truth = expected_vectors(SEED, 0, keys, 8).reshape(-1)
    s = open_session(p, spec)
    try:
        table = s.tables[0]
        name, capacity = cache_name(p, spec, p.tables[0], table), cache_capacity(p, table)
        # What another user sees of it in a listing of /dev/shm:
        seen = [e for e in os.listdir(SHM) if e.startswith("trec")]
    finally:
        s.close()
    ns_dir = next((os.path.join(SHM, e) for e in seen if e.startswith("trec-ns-")), None)

    def plant():
        cleanups = [plant_segment(name, SHM, capacity, 8, keys)()]  # today's name
        if ns_dir:  # the namespace directory it saw, re-created as its own (after a reboot)
            os.mkdir(ns_dir, 0o700)
            cleanups.append(plant_segment(name, ns_dir, capacity, 8, keys)())
            os.chmod(ns_dir, 0o777)
            cleanups.append(lambda: os.rmdir(ns_dir))
        return lambda: [c() for c in cleanups]

    with as_nobody(plant):
        s = open_session(p, spec)
        try:
            got = _lookup(s, keys)
            assert not (got == FORGED).any()
            np.testing.assert_array_equal(got, truth)
            path = s.cached_tables[0].cache.path
            assert os.stat(path).st_uid == os.geteuid() and os.path.dirname(path) != ns_dir
            assert os.path.basename(os.path.dirname(path)).startswith("trec-ns-")
        finally:
            s.close()
        assert not os.path.exists(os.path.dirname(path))  # removed with its last segment


def test_two_node_stores_never_share_or_clash(tmp_path):
    p8, p4 = _params(tmp_path / "repo"), _params(tmp_path / "repo", cache_ways=4)
    old_umask = os.umask(0)
    a = open_session(p8, InstanceSpec(store_dir=str(tmp_path / "store_a")))
    try:
        # another store, other cache settings: loads (no CacheConfigMismatchError) ...
        b = open_session(p4, InstanceSpec(store_dir=str(tmp_path / "store_b")))
        try:
            ca, cb = a.cached_tables[0].cache, b.cached_tables[0].cache
            assert ca.path != cb.path and os.path.basename(ca.path) == os.path.basename(cb.path)
            for c in (ca, cb):  # private: 0600 files in 0700 directories, whatever the umask
                assert os.stat(c.path).st_mode & 0o777 == 0o600
                assert os.stat(os.path.dirname(c.path)).st_mode & 0o777 == 0o700
            keys = table_keys(SEED, 0, TABLES[0].rows)[:16]
            _lookup(a, keys)  # inserted into a's cache only
            assert query(ca, keys)[1].all() and not query(cb, keys)[1].any()
        finally:
            b.close()
        # ... while the same store keeps one segment per model and refuses other settings
        with pytest.raises(CacheConfigMismatchError):
            open_session(p4, InstanceSpec(store_dir=str(tmp_path / "store_a"))).close()
    finally:
        a.close()
        os.umask(old_umask)


@pytest.mark.parametrize("how", [pytest.param("another uid", marks=needs_other_uid), "mode 0644"])
def test_a_namespace_file_not_private_to_us_is_refused(tmp_path, how):
    store = tmp_path / "store"
    store.mkdir()
    f = store / "shm-namespace"
    f.write_text("0123456789abcdef0123456789abcdef\n")
    os.chmod(f, 0o644 if how == "mode 0644" else 0o600)
    if how == "another uid":
        os.chown(f, NOBODY, NOBODY)
    with pytest.raises(CacheError, match="shm-namespace.*mode 06"):
        open_session(_params(tmp_path / "repo"), InstanceSpec(store_dir=str(store))).close()


# ---------------------------------------------------------------------------------------
# the GPU/CUDA-IPC publishing files (their CPU-testable parts)


@needs_other_uid
@pytest.mark.parametrize("suffix", ["", ".lock", ".cudaipc.json"])
def test_gpu_share_never_uses_a_file_planted_by_another_uid(suffix):
    name = f"pytest-sec-{uuid.uuid4().hex[:8]}"

    def plant():
        if suffix == "":
            sa = gpu_share.share_numpy_arrays(name, {"x": np.full(4, FORGED, np.float32)}, SHM)
            os.chmod(sa.path, 0o666)
            return sa.close
        path = gpu_share.shared_path(name, suffix, SHM)
        with open(path, "w") as f:
            f.write(
                f'{{"format": "{gpu_share.HANDLES_FORMAT}", "pid": {os.getpid()}, "arrays": {{}}}}'
            )
        os.chmod(path, 0o666)
        return lambda: os.unlink(path)

    with as_nobody(plant):
        with pytest.raises(CacheError, match=f"owner uid {NOBODY}"):
            if suffix == "":
                gpu_share.attach_numpy_arrays(name, SHM)
            elif suffix == ".lock":
                gpu_share.FileLock(gpu_share.shared_path(name, suffix, SHM))
            else:
                gpu_share.read_handles(gpu_share.shared_path(name, suffix, SHM))


def test_gpu_share_files_live_in_the_store_namespace_directory():
    ns = uuid.uuid4().hex
    with gpu_share.open_shared_cache("t", 64, 4, namespace=ns, directory=SHM) as c:
        d = os.path.join(SHM, f"trec-ns-{ns}")
        assert all(os.path.dirname(p) == d for p in c.files)
        st = os.stat(d)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o700
        assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in c.files)
    assert not os.path.exists(d)
