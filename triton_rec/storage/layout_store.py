"""The node-local store's directory (:mod:`triton_rec.storage.node_store`, "Store
directory"): layouts by content digest, aliases by source fingerprint, the converters'
locks; and a conversion's writing: the layout written to a temporary file while its
pieces are hashed, then published atomically.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from typing import Iterator, Optional, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.errors import DuplicateKeyError, ModelFileError, StoreError
from triton_rec.precision import DEFAULT_PRECISION, RowCodec
from triton_rec.storage.layout_digest import Progress, TreeHash, chunks, content_person, hash_pool
from triton_rec.storage.layout_file import (
    HEADER_SIZE,
    SUFFIX,
    layout_offsets,
    map_layout,
    pack_header,
    read_header,
)
from triton_rec.storage.table import MADV_POPULATE_READ, mapping_of, page_span
from triton_rec.util.procfs import flock_exclusive

log = logging.getLogger("triton_rec.storage.node_store")  # the node store logs as one

STORE_ENV = "TRITON_REC_STORE"


def default_store_dir() -> str:
    """``$TRITON_REC_STORE`` if set and non-empty, else ``~/.cache/triton-rec/store``."""
    env = os.environ.get(STORE_ENV, "").strip()
    return os.path.abspath(os.path.expanduser(env or "~/.cache/triton-rec/store"))


# -- the store -------------------------------------------------------------------------


class Store:
    """The store directory (node_store's "Store directory"), its folders made."""

    def __init__(self, store_dir: Optional[str]):
        self.root = os.path.abspath(os.path.expanduser(store_dir or default_store_dir()))
        self.layouts = os.path.join(self.root, "layouts")
        self.sources = os.path.join(self.root, "sources")
        self.locks = os.path.join(self.root, "locks")
        try:
            for d in (self.layouts, self.sources, self.locks):
                os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.root}: cannot create the table store ({e.strerror})") from e

    def layout(self, digest: str) -> str:
        """The path of the layout of content ``digest``."""
        return os.path.join(self.layouts, digest + SUFFIX)

    def alias(self, fp: str) -> str:
        """The path of the alias of source fingerprint ``fp``."""
        return os.path.join(self.sources, fp)

    def read_alias(self, fp: str) -> Optional[str]:
        """The layout the alias of ``fp`` points at, or None."""
        try:
            target = os.readlink(self.alias(fp))
        except OSError:
            return None
        name = os.path.basename(target)
        return self.layout(name[: -len(SUFFIX)]) if name.endswith(SUFFIX) else None

    def set_alias(self, fp: str, digest: str, fsync: bool = False) -> None:
        """Point the alias of ``fp`` at the layout of ``digest`` (atomically)."""
        tmp = f"{self.alias(fp)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        os.symlink(os.path.join("..", "layouts", digest + SUFFIX), tmp)
        os.replace(tmp, self.alias(fp))
        if fsync:
            fsync_dir(self.sources)

    def drop_alias(self, fp: str) -> None:
        """Remove the alias of ``fp`` if there is one."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.alias(fp))

    @contextlib.contextmanager
    def lock(self, fp: str) -> Iterator[None]:
        """Hold the converters' lock of source ``fp`` (waits for another holder)."""
        path = os.path.join(self.locks, fp + ".lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            flock_exclusive(
                fd,
                None,
                on_wait=lambda: log.info(
                    "waiting for another process converting the same table (%s)", path
                ),
            )
            yield
        finally:
            os.close(fd)  # releases the lock

    def same_shape_exists(self, n: int, d: int, precision: str) -> bool:
        """Is there a layout of N rows x D in ``precision`` (worth computing the source's
        digest for)?"""
        try:
            names = os.listdir(self.layouts)
        except OSError:
            return False
        for name in names:
            if name.startswith(".") or not name.endswith(SUFFIX):
                continue
            try:
                h = read_header(os.path.join(self.layouts, name))
            except ModelFileError:
                continue
            if (h.n_rows, h.vec_size, h.precision) == (n, d, precision):
                return True
        return False

    def remove_stale_temps(self, fp: str) -> None:
        """Temporary files of this source: their writer is dead (we hold its lock)."""
        prefix = f".tmp-{fp}-"
        for name in os.listdir(self.layouts):
            if name.startswith(prefix):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.layouts, name))
                    log.warning("removed %s, left by an interrupted conversion", name)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- conversion ------------------------------------------------------------------------


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf.nbytes:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


class _Populator:
    """Faults in the pages of chunks of a file-mapped array before they are written out.

    ``write(2)`` straight from mapped pages that are not yet faulted in copies in small
    steps, and the page cache of the layout gets 4 KiB folios, mapped later with 4 KiB
    TLB entries. With the source range populated first (``MADV_POPULATE_READ``), the
    copy goes in large steps into large folios, mapped with 2 MiB pages (ext4, Linux
    6.x). Measured here (2 vCPU VM): random lookups over a 2 GB layout 7.5 vs 5.2 M
    keys/s (median, 64k-key batches, D=64). The price is kernel CPU at conversion
    (large-folio allocation): 11-13 s instead of ~5 s of system time for 4.3 GB, once
    per table content. A layout read back from disk gets large folios either way
    (readahead). No-op for in-memory arrays and on kernels before 5.14.
    """

    def __init__(self, a: np.ndarray):
        self.mm = mapping_of(a)

    def __call__(self, chunk: memoryview) -> None:
        if self.mm is None:
            return
        start, length = page_span(self.mm, np.frombuffer(chunk, np.uint8).ctypes.data, chunk.nbytes)
        try:
            self.mm.madvise(MADV_POPULATE_READ, start, length)
        except (OSError, ValueError):
            self.mm = None  # not supported here: plain writes, still correct


def build_index(keys: np.ndarray, source_path: str) -> np.ndarray:
    """The hash index of ``keys``; DuplicateKeyError naming the source on a repeated key."""
    try:
        return _native.build_index(keys)
    except ValueError as e:
        if "duplicate" in str(e):
            raise DuplicateKeyError(source_path, str(e)) from e
        raise


def write_layout(
    store: Store,
    fp: str,
    source_path: str,
    keys: np.ndarray,
    vectors: np.ndarray,
    index: np.ndarray,
    progress: Optional[Progress],
    fsync: bool,
    replace: bool,
    digest: Optional[str] = None,
    codec: Optional[RowCodec] = None,
) -> Tuple[str, str]:
    """Write and publish the layout of one table; returns ``(path, content digest)``.

    Keys, vectors and index are written sequentially in HASH_CHUNK pieces while worker
    threads hash the same pieces (the content is not hashed again if ``digest``, its
    content digest, is given).
    """
    codec = codec or RowCodec(DEFAULT_PRECISION, int(vectors.shape[1]))
    n, d = vectors.shape[0], codec.dim
    cap = index.shape[0]
    _, vec_off, idx_off, file_size = layout_offsets(n, codec, cap)
    total = keys.nbytes + vectors.nbytes + index.nbytes
    tmp = os.path.join(store.layouts, f".tmp-{fp}-{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}")
    # A full disk should fail now, not after gigabytes. (Not posix_fallocate: writing
    # into preallocated extents with large folios measured ~40% slower on ext4.)
    st = os.statvfs(store.layouts)
    if st.f_bavail * st.f_frsize < file_size:
        raise StoreError(
            f"{store.layouts}: {st.f_bavail * st.f_frsize / 1e9:.2f} GB free, the layout of "
            f"{source_path} needs {file_size / 1e9:.2f} GB"
        )
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StoreError(f"{store.layouts}: cannot create a layout file ({e.strerror})") from e
    try:
        if progress:
            progress(0, total)
        done = 0
        with hash_pool() as pool:
            content = None if digest else TreeHash(pool, content_person(codec), n, d)
            index_tree = TreeHash(pool, b"trec-index", cap, 2)
            for a, offset, tree in (
                (keys, HEADER_SIZE, content),
                (vectors, vec_off, content),
                (index, idx_off, index_tree),
            ):
                populate = _Populator(a)
                for c in chunks(a):
                    populate(c)
                    if tree is not None:
                        tree.add(c)  # hashed from the source itself, in worker threads
                    _pwrite_all(fd, c, offset)
                    offset += c.nbytes
                    done += c.nbytes
                    if progress and done < total:
                        progress(done, total)
            if content is not None:
                digest = content.hexdigest()
            index_digest = index_tree.hexdigest()
        assert digest is not None  # given, or computed from the content just above
        os.pwrite(fd, pack_header(n, codec, cap, digest, index_digest, fp, source_path), 0)
        os.fchmod(fd, 0o444)
        if fsync:
            os.fsync(fd)
    except BaseException as e:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise StoreError(f"{tmp}: cannot write the layout ({e.strerror or e})") from e
        raise
    os.close(fd)
    if progress:
        progress(total, total)
    final = store.layout(digest)
    publish(tmp, final, replace)
    if fsync:
        fsync_dir(store.layouts)
    return final, digest


def publish(tmp: str, final: str, replace: bool) -> None:
    """Give ``tmp`` its final name atomically.

    A valid layout already there (same content, written by a concurrent converter of
    another source) is kept: processes may map it already, and a second inode would
    hold a second copy in the page cache. An invalid one is replaced.
    """
    if not replace:
        try:
            os.link(tmp, final)
        except FileExistsError:
            try:
                map_layout(final)
            except ModelFileError:
                pass  # broken: replace below
            else:
                os.unlink(tmp)
                return
        except OSError:
            pass  # no hard links here: fall back to rename
        else:
            os.unlink(tmp)
            return
    os.replace(tmp, final)
