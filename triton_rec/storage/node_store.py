"""Node-local table layouts: converted once per table content, mapped by every instance.

Every Triton model instance is its own process. Reading the sparse files and building a
hash index in each of them costs N private indexes and N index builds. Instead,
:func:`load_table` converts a table once into a single *layout file* holding keys, rows
and the ready hash index, and every instance memory-maps that file read-only: the page
cache holds one copy of everything, shared by all processes, and a later load only
stats the source and maps the layout (milliseconds, whatever the table size).

Store directory
---------------
``store_dir`` (a parameter everywhere; default: the ``TRITON_REC_STORE`` environment
variable, else ``~/.cache/triton-rec/store``; see :func:`default_store_dir`)::

    layouts/<digest>.tbl      one layout per table *content*; <digest> = content digest
                              (64 hex digits). Read-only (mode 0444), never modified in place.
    layouts/.tmp-<fp>-*       layouts being written; readers never open them
    sources/<fp>              symlink -> ../layouts/<digest>.tbl: "the source whose
                              fingerprint is <fp> holds this content"
    locks/<fp>.lock           flock(2) lock files: one converter per source at a time

Finding the layout of a source (:func:`ensure_layout`, used by :func:`load_table`):

1. fast path: ``sources/<fp>`` exists and its layout is valid -> reuse it. Only the
   source files' metadata is read (``stat``), never their data.
2. otherwise, under an exclusive ``flock`` on ``locks/<fp>.lock`` (concurrent loaders
   of the same source wait there, then take the fast path): if a layout of the same
   shape exists, compute the source's content digest; a layout with that digest is
   reused and ``sources/<fp>`` is pointed at it (a touched or copied file costs one
   read, no conversion);
3. otherwise convert: read the source (:func:`triton_rec.formats.tables.read_table`), build the
   index,
   write the layout to a temporary file in the store, then publish it atomically
   (``link``, or ``os.replace``), so nobody ever sees a partial file.

Its parts: :mod:`triton_rec.storage.layout_file` (the layout file's format, its header,
mapping it), :mod:`triton_rec.storage.layout_digest` (the source fingerprint and the
content digest), :mod:`triton_rec.storage.layout_store` (the store directory, writing and
publishing a layout); here the API. Their public names are importable from here.

:func:`open_table` checks the header (magic, version, checksum, that sizes and offsets
follow from N, D, capacity), that the file is exactly ``file_size`` bytes long, and
probes 16 evenly spaced keys through the index (~32 page reads: ~0.1 s when the
layout is not in the page cache, microseconds when it is); it does not read the data.
:func:`verify_layout` recomputes both digests (reads everything).

Crash safety: layouts are written to a temporary name and published atomically; a
writer that dies leaves a ``.tmp-*`` file, removed by the next converter of that
source. Without ``fsync=True`` a power loss right after a conversion may leave a
published layout whose data never reached the disk (the header checksum and size
check catch most such files; :func:`verify_layout` catches all).

Never truncate or rewrite a layout in place: processes mapping it would get SIGBUS.
Delete it (``unlink`` is safe, mapped copies live on) and let the next load reconvert.

Limits: the lock is per source fingerprint, so two *different* sources with the same
content converted at the same moment are both converted (the first layout published
is kept, the other discarded). Nothing deletes old layouts yet: a store grows by one
layout per table content ever loaded; removing ``layouts/*.tbl`` and ``sources/*`` by
hand is safe while no load is running (mapped files live on until unmapped).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from triton_rec.errors import (  # noqa: F401  (re-exported)
    CorruptLayoutError,
    DuplicateKeyError,
    ModelFileError,
    StoreError,
)
from triton_rec.formats.tables import read_table, read_table_rows  # read_table: re-exported
from triton_rec.precision import DEFAULT_PRECISION, RowCodec, transcode
from triton_rec.storage.layout_digest import (
    Progress,
    content_digest,
    fingerprint,
    hash_pool,
    index_digest,
    source_fingerprint,
)
from triton_rec.storage.layout_file import (
    ALIGN,
    FORMAT_VERSION,
    HASH_CHUNK,
    HEADER_SIZE,
    MAGIC,
    SUFFIX,
    LayoutHeader,
    Mapped,
    map_layout,
    read_header,
)
from triton_rec.storage.layout_store import STORE_ENV, Store, default_store_dir
from triton_rec.storage.layout_store import build_index as _build_index  # tests replace these
from triton_rec.storage.layout_store import write_layout as _write_layout
from triton_rec.storage.table import EmbeddingTable

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "HASH_CHUNK",
    "HEADER_SIZE",
    "MAGIC",
    "STORE_ENV",
    "SUFFIX",
    "CorruptLayoutError",
    "DuplicateKeyError",
    "LayoutHeader",
    "LayoutResult",
    "ModelFileError",
    "Progress",
    "ProgressLogger",
    "StoreError",
    "content_digest",
    "convert_table",
    "default_store_dir",
    "ensure_layout",
    "load_table",
    "open_table",
    "read_header",
    "read_table",
    "source_fingerprint",
    "verify_layout",
]

log = logging.getLogger(__name__)


def open_table(
    layout_path: str, name: str, default_value: float = 0.0, *, source_path: Optional[str] = None
) -> EmbeddingTable:
    """Map a layout file read-only as an :class:`EmbeddingTable`: no copy, no index build.

    Args:
        layout_path: a ``.tbl`` layout file.
        name, default_value: as for :class:`EmbeddingTable`.
        source_path: the table's source, used as ``table.path`` in messages
            (default: ``layout_path``).

    The arrays (``keys``, ``vectors``, ``index``) are read-only views of one shared
    mapping. Checks the header, that the file is complete and 16 index probes; not
    the data (see :func:`verify_layout`).

    Raises:
        ModelFileError: the file is missing or unreadable; CorruptLayoutError (a
            ModelFileError) naming the file: truncated, incomplete or corrupt.
    """
    m = map_layout(layout_path)
    return _table(m, name, default_value, source_path)


def _table(m: Mapped, name: str, default_value: float, source: Optional[str]) -> EmbeddingTable:
    return EmbeddingTable.from_layout(
        name,
        m.keys,
        m.vectors,
        m.index,
        default_value,
        path=source or m.path,
        layout_path=m.path,
        codec=m.header.codec,
    )


def verify_layout(path: str, threads: Optional[int] = None) -> LayoutHeader:
    """Check a layout fully: recompute its content and index digests (reads the file).

    Raises:
        CorruptLayoutError: naming the file, if anything differs.
    """
    m = map_layout(path)
    h = m.header
    if h.hash_chunk != HASH_CHUNK:
        raise CorruptLayoutError(path, f"digest chunk {h.hash_chunk}, expected {HASH_CHUNK}")
    with hash_pool(threads) as pool:
        if content_digest(m.keys, m.vectors, pool=pool, codec=h.codec) != h.content_digest:
            raise CorruptLayoutError(path, "keys/vectors do not match the content digest")
        if index_digest(m.index, pool) != h.index_digest:
            raise CorruptLayoutError(path, "the index does not match the index digest")
    return h


# -- reuse or convert ------------------------------------------------------------------


@dataclass(frozen=True)
class LayoutResult:
    """What :func:`ensure_layout` did.

    Attributes:
        path: the layout file.
        action: ``"reused"`` (fast path: source fingerprint known), ``"aliased"`` (new
            fingerprint, content digest of an existing layout) or ``"converted"``.
        fingerprint, digest: the source fingerprint and content digest (hex).
        n_rows, vec_size: table shape.
        data_bytes: keys + vectors + index bytes of the layout.
        seconds: wall time of the call.
    """

    path: str
    action: str
    fingerprint: str
    digest: str
    n_rows: int
    vec_size: int
    data_bytes: int
    seconds: float


def _valid(
    path: Optional[str],
    codec: RowCodec,
    rows: Optional[int],
    digest: Optional[str],
    repair: bool,
) -> Optional[Mapped]:
    """Map ``path`` if it is a valid layout of the expected shape; else None.

    With ``repair`` (caller holds the source's lock), a corrupt layout is deleted.
    """
    if path is None:
        return None
    try:
        m = map_layout(path)
    except CorruptLayoutError as e:
        log.warning("%s", e)
        if repair:
            with contextlib.suppress(OSError):
                os.unlink(path)
            log.warning("deleted corrupt layout %s; converting again", path)
        return None
    except ModelFileError:
        return None  # missing
    h = m.header
    name = os.path.basename(path)[: -len(SUFFIX)]
    if (
        h.codec != codec
        or (rows is not None and h.n_rows != rows)
        or h.content_digest != name
        or (digest is not None and h.content_digest != digest)
    ):
        return None
    return m


def _source_rows(
    source_path: str, codec: RowCodec, progress: Optional[Progress]
) -> Tuple[np.ndarray, np.ndarray]:
    """The keys and the rows of a source in ``codec``'s precision: as stored when the
    source holds that precision, else decoded and encoded (in chunks, with progress)."""
    keys, rows, src = read_table_rows(source_path, codec.dim)
    if src == codec:
        return keys, rows
    n = int(keys.shape[0])
    label = f"{src.precision} -> {codec.precision}"

    report = None
    if progress is not None:
        tell = progress

        def report(a: int, b: int, vectors: np.ndarray, encoded: np.ndarray) -> None:
            tell(b * codec.row_bytes, n * codec.row_bytes)

    out = transcode(rows, src, codec, HASH_CHUNK // 16, report)
    log.info("%s: encoded %d rows (%s)", source_path, n, label)
    return keys, out


def _resolve(
    source_path: str,
    vec_size: int,
    store_dir: Optional[str],
    progress: Optional[Progress],
    fsync: bool,
    force: bool,
    precision: str = DEFAULT_PRECISION,
) -> Tuple[LayoutResult, Mapped]:
    t0 = time.perf_counter()
    store = Store(store_dir)
    codec = RowCodec(precision, int(vec_size))
    fp, rows = fingerprint(source_path, vec_size, precision)

    def result(action: str, m: Mapped) -> Tuple[LayoutResult, Mapped]:
        h = m.header
        took = time.perf_counter() - t0
        r = LayoutResult(
            m.path, action, fp, h.content_digest, h.n_rows, h.vec_size, h.data_bytes, took
        )
        return r, m

    if not force:  # fast path, no lock: an alias is only ever created for a finished layout
        m = _valid(store.read_alias(fp), codec, rows, None, repair=False)
        if m is not None:
            return result("reused", m)
    with store.lock(fp):
        if not force:  # someone may have converted it while we waited
            m = _valid(store.read_alias(fp), codec, rows, None, repair=True)
            if m is not None:
                return result("reused", m)
            store.drop_alias(fp)
        store.remove_stale_temps(fp)
        keys, vectors = _source_rows(source_path, codec, progress)
        n = int(keys.shape[0])
        digest = None
        if not force and store.same_shape_exists(n, vec_size, precision):
            digest = content_digest(keys, vectors, progress, codec=codec)
            m = _valid(store.layout(digest), codec, n, digest, repair=True)
            if m is not None:
                store.set_alias(fp, digest, fsync)
                log.info("%s: same content as %s (new fingerprint)", source_path, m.path)
                return result("aliased", m)
        index = _build_index(keys, source_path)  # duplicate keys fail before any write
        path, digest = _write_layout(
            store, fp, source_path, keys, vectors, index, progress, fsync, force, digest, codec
        )
        del index
        if fingerprint(source_path, vec_size, precision)[0] == fp:
            store.set_alias(fp, digest, fsync)
        else:
            log.warning("%s changed while it was converted; not recording it", source_path)
        m = map_layout(path)
        r = result("converted", m)
        log.info(
            "converted %s -> %s (%.1f MB in %.2f s)",
            source_path,
            path,
            r[0].data_bytes / 1e6,
            r[0].seconds,
        )
        return r


def ensure_layout(
    source_path: str,
    vec_size: int,
    store_dir: Optional[str] = None,
    progress: Optional[Progress] = None,
    *,
    fsync: bool = False,
    force: bool = False,
    precision: str = DEFAULT_PRECISION,
) -> LayoutResult:
    """Make sure the store holds the layout of a table source; say how it got there.

    Args:
        source_path: HugeCTR sparse directory or ``.npz`` (as in ps.json).
        vec_size: floats per vector (from ps.json).
        store_dir: the store (default :func:`default_store_dir`).
        progress: ``progress(done_bytes, total_bytes)``, called while converting or
            hashing (e.g. :class:`ProgressLogger`).
        fsync: flush the layout to disk before publishing it.
        force: ignore what the store knows about this source; convert and replace.
        precision: the precision the layout holds the rows in (ps.json
            ``embedding_precision``; :mod:`triton_rec.precision`). A source that
            holds another precision is decoded and encoded once, at conversion.

    Raises:
        ModelFileError: naming the source file (missing, wrong size, ...);
        DuplicateKeyError: naming the source; StoreError: the store is unusable.
    """
    return _resolve(source_path, vec_size, store_dir, progress, fsync, force, precision)[0]


def convert_table(
    source_path: str,
    vec_size: int,
    store_dir: Optional[str] = None,
    progress: Optional[Progress] = None,
    *,
    fsync: bool = False,
    force: bool = False,
    precision: str = DEFAULT_PRECISION,
) -> str:
    """Convert a table source into the store (once per content); the layout's path.

    Idempotent: a source already converted, or whose content is, is not converted
    again (see :func:`ensure_layout`, which also says what it did).
    """
    return ensure_layout(
        source_path, vec_size, store_dir, progress, fsync=fsync, force=force, precision=precision
    ).path


def load_table(
    table_params,
    store_dir: Optional[str] = None,
    *,
    progress: Optional[Progress] = None,
    prefault: bool = False,
    fsync: bool = False,
) -> EmbeddingTable:
    """Convert-if-needed, then map a table (``TableParams`` from ps.json) read-only.

    Safe to call from many processes at once: one converts, the others wait and map.
    ``table.path`` is the source (for messages), ``table.layout_path`` the layout.
    With ``prefault``, every page is made resident before returning
    (:meth:`EmbeddingTable.prefault`).
    """
    t = table_params
    _, m = _resolve(
        t.sparse_file, t.vec_size, store_dir, progress, fsync, force=False, precision=t.precision
    )
    table = _table(m, t.name, t.default_value, t.sparse_file)
    if prefault:
        table.prefault()
    return table


# -- progress --------------------------------------------------------------------------


class ProgressLogger:
    """A ``progress(done_bytes, total_bytes)`` callback: percentage, MB and MB/s.

    Args:
        label: prefix of every line (e.g. ``model.table``).
        stream: where to write (e.g. ``sys.stderr``); on a terminal the line is
            rewritten in place. Without a stream, lines go to this module's logger (INFO).
        interval: seconds between two lines (default 0.5 on a terminal, else 5).
    """

    def __init__(self, label: str = "converting", stream=None, interval: Optional[float] = None):
        self.label = label
        self.stream = stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.5 if self.tty else 5.0)
        self._t0: Optional[float] = None
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        """Report progress: write a line at most every ``interval`` seconds, and at the end."""
        now = time.perf_counter()
        if self._t0 is None or done == 0:
            self._t0, self._last = now, now
            return
        final = done >= total
        if not final and now - self._last < self.interval:
            return
        self._last = now
        rate = done / max(now - self._t0, 1e-9)
        pct = 100.0 * done / total if total else 100.0
        line = (
            f"{self.label}: {pct:5.1f}%  {done / 1e6:,.0f} / {total / 1e6:,.0f} MB  "
            f"{rate / 1e6:,.0f} MB/s"
        )
        if self.stream is None:
            log.info("%s", line)
        elif self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
            self.stream.flush()
        else:
            self.stream.write(line + "\n")
            self.stream.flush()
