"""The node-wide CPU embedding cache: one POSIX shared-memory segment per (model, device, table).

Every Triton model instance is its own process; :meth:`SharedEmbeddingCache.open` with the
same ``name`` gives all of them the same cache, a file ``<directory>/trec_<name>``
(``/dev/shm`` by default, a tmpfs) mapped into each process. The cache itself (layout,
seqlocks, robust per-set mutexes, LRU / TinyLFU) is native code: ``src/native/shm_cache.hpp``.

Capacity: the cache is set-associative. ``num_sets`` is the smallest power of two
``>= ceil(capacity / ways)``, so the actual capacity (``.capacity``) is ``num_sets * ways``,
at least the requested one.

Life cycle of a segment (the rule):

* **create**: a process that finds no segment formats a fresh, unnamed file
  (``O_TMPFILE``), registers itself in it, and links it into place with ``link(2)``,
  which fails if the name already exists: of processes starting at once exactly one
  wins, the others attach to the winner's segment. A visible segment is therefore
  always fully formatted.
* **attach**: under an exclusive ``flock`` of the segment file, a process checks the
  configuration (a checksum of the layout: sets, ways, vec_size, policy), drops the
  attachments of processes that no longer exist and registers its own.
* **attachments**: a table of 256 slots inside the segment, each holding a token =
  PID + the process start time (so a recycled PID is not mistaken for the original
  process; a zombie counts as dead).
* **close**: under the same ``flock``, a process removes its attachment; if no live
  process remains attached, it unlinks the file (the memory is freed once every
  mapping is gone).
* **stale segments**: a segment none of whose attached processes is alive (e.g. every
  server was SIGKILLed) is free. The next :meth:`~SharedEmbeddingCache.open` unlinks it
  and creates a fresh, empty one, whatever its configuration was.
* **configuration mismatch**: a segment in use by a live process with another
  configuration is never touched; ``open`` raises :class:`CacheConfigMismatchError`
  naming the file.

* **privacy** (:mod:`triton_rec.cache.shm_security`): a segment is created mode 0600 and
  opened (without following symbolic links) only if it is a regular file owned by this
  process's euid with no group/other permission bits; anything else raises
  :class:`~triton_rec.cache.shm_security.SharedMemorySecurityError` naming the file, its
  owner and mode, before it is read or locked. With a ``namespace`` (what the backends
  pass: the node store's token) segments live in ``<directory>/trec-ns-<token>/``, a
  directory of mode 0700 that the last close of its last segment removes.

All processes sharing a segment must run in the same PID namespace (robust mutexes and
the liveness check identify processes by PID).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from triton_rec import _native
from triton_rec._native import ShmCacheView
from triton_rec.cache import shm_security
from triton_rec.config.ps_json import CACHE_POLICIES, CachePolicy
from triton_rec.errors import CacheConfigMismatchError, CacheError
from triton_rec.precision import DEFAULT_PRECISION, PRECISIONS, RowCodec
from triton_rec.util.procfs import flock_exclusive, process_alive, start_time

log = logging.getLogger(__name__)

__all__ = ["SharedEmbeddingCache", "InsertResult", "segment_path", "shm_dir", "POLICIES"]

POLICIES = CACHE_POLICIES  # the names of triton_rec.config.ps_json.CachePolicy
DEFAULT_DIRECTORY = "/dev/shm"
#: the environment variable that moves every shared file of a server (the CPU caches'
#: segments, a GPU cache's shared handles and lock) out of DEFAULT_DIRECTORY
SHM_DIR_VARIABLE = "TRITON_REC_SHM_DIR"


def shm_dir(directory: Optional[str] = None) -> str:
    """Where shared files go: ``directory``, else ``$TRITON_REC_SHM_DIR``, else
    ``/dev/shm`` (the system temp directory where there is no /dev/shm). A tmpfs mounted
    with ``huge=within_size`` there gives the caches 2 MiB pages (docs/configuration.md)."""
    d = directory or os.environ.get(SHM_DIR_VARIABLE)
    if d:
        return d
    return DEFAULT_DIRECTORY if os.path.isdir(DEFAULT_DIRECTORY) else tempfile.gettempdir()


SEGMENT_PREFIX = "trec_"
# Longest sanitized name kept verbatim (file names are limited to 255 bytes).
_MAX_NAME = 160
_PID_BITS = 22  # Linux PID_MAX_LIMIT is 2**22
_PID_MASK = (1 << _PID_BITS) - 1
_OPEN_TIMEOUT = 60.0


class InsertResult(NamedTuple):
    """What :meth:`SharedEmbeddingCache.insert` did with a batch."""

    inserted: int  # new keys stored (evicting or not)
    evicted: int  # keys evicted to make room
    rejected: int  # new keys refused by TinyLFU admission


# ---------------------------------------------------------------------------------------
# names, configuration checksum, process tokens


def segment_file_name(name: str) -> str:
    """``trec_<name>`` with every character other than letters, digits, ``_ - .``
    replaced by ``_``. If that changed the name (or it is very long) a short hash of
    the original name is appended, so distinct names never share a segment."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"cache name must be a non-empty string, got {name!r}")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    if safe != name or len(safe) > _MAX_NAME:
        digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
        safe = f"{safe[:_MAX_NAME]}-{digest}"
    return SEGMENT_PREFIX + safe


def segment_path(
    name: str, directory: Optional[str] = None, namespace: Optional[str] = None
) -> str:
    """The file of the segment called ``name`` in ``directory`` (None: :func:`shm_dir`;
    in the namespace's private directory if one is given)."""
    directory = shm_dir(directory)
    if namespace is not None:
        directory = shm_security.namespace_directory(directory, namespace)
    return os.path.join(directory, segment_file_name(name))


def layout_for(capacity: int, ways: int) -> int:
    """num_sets for a requested capacity: next power of two >= ceil(capacity / ways)."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if not 1 <= ways <= _native.SHM_CACHE_MAX_WAYS:
        raise ValueError(f"ways must be in [1, {_native.SHM_CACHE_MAX_WAYS}], got {ways}")
    need = -(-capacity // ways)
    return 1 << max(0, (need - 1).bit_length())


def segment_params(
    capacity: int,
    vec_size: int,
    policy: str = CachePolicy.LRU,
    ways: int = 8,
    precision: str = DEFAULT_PRECISION,
) -> Dict[str, Any]:
    """The layout of the segment of a cache asked to hold ``capacity`` rows, as the native
    view takes it (``num_sets``, ``ways``, ``vec_size``, ``policy``, ``precision`` code);
    ValueError for a bad policy, vec_size or ways."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if vec_size < 1:
        raise ValueError(f"vec_size must be >= 1, got {vec_size}")
    return dict(
        num_sets=layout_for(int(capacity), int(ways)),
        ways=int(ways),
        vec_size=int(vec_size),
        policy=CachePolicy(policy).value,  # a plain str for the native layer and the checksum
        precision=RowCodec(precision, int(vec_size)).code,
    )


def segment_bytes(
    capacity: int,
    vec_size: int,
    policy: str = CachePolicy.LRU,
    ways: int = 8,
    precision: str = DEFAULT_PRECISION,
) -> int:
    """Bytes of the segment file :meth:`SharedEmbeddingCache.open` creates for these
    arguments (what it reserves in the shared-memory directory): the one rule, which the
    node plan (:mod:`triton_rec.serving.sizing`) uses too."""
    return int(
        _native.ShmCacheView.required_bytes(
            **segment_params(capacity, vec_size, policy, ways, precision)
        )
    )


def config_checksum(
    num_sets: int, ways: int, vec_size: int, policy: str, precision: int = 0
) -> int:
    """64-bit checksum of the configuration that determines the layout."""
    text = f"v{_native.SHM_CACHE_LAYOUT_VERSION}:{num_sets}:{ways}:{vec_size}:{policy}:{precision}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _self_token() -> int:
    pid = os.getpid()
    return (start_time(pid) << _PID_BITS) | pid


def _token_alive(token: int) -> bool:
    """Whether the process of an attachment token still exists (recycled PIDs and
    zombies count as dead)."""
    return process_alive(token & _PID_MASK, token >> _PID_BITS)


def _live_tokens(view) -> List[int]:
    """Attachment tokens of live processes; frees the slots of dead ones."""
    live = []
    for token in view._tokens():
        if _token_alive(token):
            live.append(token)
        else:
            view._unregister_token(token, all=True)
    return live


# ---------------------------------------------------------------------------------------
# file helpers


def _flock(fd: int, deadline: float, path: str) -> None:
    flock_exclusive(
        fd, deadline, lambda: CacheError(f"{path}: timed out waiting for the segment's file lock")
    )


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _open_unnamed(dfd: int):
    """An unnamed file (mode 0600) in the directory open as ``dfd`` (O_TMPFILE), or a
    uniquely named one if the file system lacks O_TMPFILE. Returns (fd, temporary name
    relative to ``dfd``, or None)."""
    if hasattr(os, "O_TMPFILE"):
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            os.fchmod(fd, 0o600)  # whatever the umask
            return fd, None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    tmp = f".trec_tmp-{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(
        tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd
    )
    os.fchmod(fd, 0o600)
    return fd, tmp


def _link_into_place(fd: int, tmp: Optional[str], dfd: int, fname: str) -> None:
    """link(2) the new segment to ``fname`` in ``dfd``; FileExistsError if the name is taken."""
    if tmp:
        os.link(tmp, fname, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        return
    # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names an O_TMPFILE file. (os.link only
    # uses linkat, and so follows the /proc symlink, when a dir_fd is given.)
    os.link(f"/proc/self/fd/{fd}", fname, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=True)


# ---------------------------------------------------------------------------------------

_open_caches: weakref.WeakSet[SharedEmbeddingCache] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:  # pragma: no cover - exercised by process exit
    for cache in list(_open_caches):
        try:
            cache.close()
        except Exception:
            log.exception("closing shared cache %s at exit failed", cache.path)


class SharedEmbeddingCache:
    """A set-associative embedding cache in shared memory, shared by every process of the
    node that opens the same name. Create with :meth:`open`; release with :meth:`close`
    (or a ``with`` block; open caches are also closed at interpreter exit).

    Every data method is safe to call from any number of threads and processes at once.
    ``query`` never takes a lock and never returns a partially written vector; writers
    lock one set at a time with a process-shared robust mutex, so a process killed at
    any moment leaves at most one set to repair, which the next process touching that
    set does automatically (its keys are dropped, never served torn).
    """

    def __init__(
        self,
        *,
        name: str,
        path: str,
        fd: int,
        mm: mmap.mmap,
        view,
        token: int,
        namespace_dir: Optional[str] = None,
    ):
        # Private: use SharedEmbeddingCache.open().
        self.name = name
        self.path = path
        self._namespace_dir = namespace_dir
        self._fd = fd
        self._mm = mm
        self._view = view
        self._token = token
        self._owner_pid = os.getpid()
        self._closed = False
        self._close_lock = threading.Lock()
        _open_caches.add(self)

    # ---- creation / attachment -------------------------------------------------------

    @classmethod
    def open(
        cls,
        name: str,
        capacity: int,
        vec_size: int,
        policy: str = CachePolicy.LRU,
        ways: int = 8,
        directory: Optional[str] = None,
        timeout: float = _OPEN_TIMEOUT,
        namespace: Optional[str] = None,
        precision: str = DEFAULT_PRECISION,
    ) -> SharedEmbeddingCache:
        """Create the segment ``<directory>/trec_<name>`` (with a ``namespace``:
        ``<directory>/trec-ns-<namespace>/trec_<name>``) or attach to it (see the module
        docstring for the exact rule).

        Args:
            name: cache name, e.g. ``f"{model}.{device}.{table}"`` (sanitized to letters,
                digits, ``_ - .``).
            capacity: requested number of vectors; the actual capacity is
                ``num_sets * ways`` with ``num_sets`` the next power of two >=
                ``ceil(capacity / ways)``.
            vec_size: floats per vector.
            policy: ``"lru"`` (evict the least recently used way of the set, as HPS does)
                or ``"tinylfu"`` (same victim, plus TinyLFU admission: a new key replaces
                the victim only if it was queried more often recently).
            ways: associativity (1..64).
            precision: how the cache holds the rows (:mod:`triton_rec.precision`):
                :meth:`insert`/:meth:`update` take rows in it, :meth:`query` decodes.
            directory: where segments live (a tmpfs; None: :func:`shm_dir`,
                ``$TRITON_REC_SHM_DIR`` or ``/dev/shm``).
            timeout: seconds to wait for other processes' file locks.
            namespace: the node store's token
                (:func:`triton_rec.cache.shm_security.store_namespace`):
                the segment lives in that store's private directory (mode 0700, removed
                with its last segment). Without it, directly in ``directory``.

        Raises:
            SharedMemorySecurityError: the segment (or the namespace directory) is not
                private to this process's user: another owner, group/other permission
                bits, a symbolic link (:mod:`triton_rec.cache.shm_security`). Never read from.
            CacheConfigMismatchError: the segment exists, is in use by a live process and
                has another configuration (the message names the file).
            CacheError: the segment cannot be created/attached (no space, not a cache
                segment, attachment table full, lock timeout).

        Thread/process safety: safe to call concurrently from any processes and threads;
        all of them end up on one segment.
        """
        params = segment_params(capacity, vec_size, policy, ways, precision)
        checksum = config_checksum(**params)
        nbytes = segment_bytes(capacity, vec_size, policy, ways, precision)
        directory = shm_dir(directory)
        fname = segment_file_name(name)
        token = _self_token()
        deadline = time.monotonic() + timeout
        while True:
            # Every file operation is relative to the checked directory's fd; a namespace
            # directory removed meanwhile (its last segment closed) fails with ENOENT and
            # the loop starts over.
            dfd, seg_dir = shm_security.open_segment_dir(directory, namespace)
            ns_dir = seg_dir if namespace is not None else None
            path = os.path.join(seg_dir, fname)
            try:
                if time.monotonic() > deadline:
                    raise CacheError(f"{path}: could not create or attach within {timeout} s")
                try:
                    fd = shm_security.open_private_file(
                        path, os.O_RDWR, "shared cache segment", dir_fd=dfd, name=fname
                    )
                except FileNotFoundError:
                    cache = cls._create(
                        name, path, dfd, fname, ns_dir, params, nbytes, checksum, token
                    )
                    if cache is not None:
                        return cache
                    continue  # another process linked its segment first: attach to it
                cache = cls._attach(
                    name, path, dfd, fname, ns_dir, fd, params, checksum, token, deadline
                )
                if cache is not None:
                    return cache
            except BaseException:
                if ns_dir is not None:
                    shm_security.remove_namespace_dir(ns_dir)  # if we left it empty
                raise
            finally:
                os.close(dfd)

    @classmethod
    def _create(cls, name, path, dfd, fname, ns_dir, params, nbytes, checksum, token):
        """Format an unnamed file and link it to ``path``; None if ``path`` appeared
        meanwhile (or its namespace directory was removed)."""
        try:
            fd, tmp = _open_unnamed(dfd)
        except FileNotFoundError:
            return None  # the namespace directory was removed: start over
        mm = view = None
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve tmpfs pages now: no SIGBUS later
            except OSError as e:
                raise CacheError(
                    f"{path}: cannot allocate {nbytes} bytes in {os.path.dirname(path)}: "
                    f"{e.strerror}"
                ) from None
            mm = mmap.mmap(fd, nbytes)
            view = _native.ShmCacheView.initialize(mm, checksum=checksum, **params)
            view._register_token(token)
            try:
                _link_into_place(fd, tmp, dfd, fname)
            except (FileExistsError, FileNotFoundError):  # taken, or the directory is gone
                view.release()
                mm.close()
                os.close(fd)
                return None
            return cls(
                name=name, path=path, fd=fd, mm=mm, view=view, token=token, namespace_dir=ns_dir
            )
        except BaseException:
            if view is not None and not view.released:
                view.release()
            if mm is not None and not mm.closed:
                mm.close()
            try:
                os.close(fd)
            except OSError:
                pass
            raise
        finally:
            if tmp:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass

    @classmethod
    def _attach(cls, name, path, dfd, fname, ns_dir, fd, params, checksum, token, deadline):
        """Attach to the segment open as ``fd``; None to start over (replaced or stale)."""
        mm = view = None
        keep = False
        try:
            _flock(fd, deadline, path)
            if not _same_file(fd, path):  # (the directory is ours or sticky: path is stable)
                return None  # unlinked or replaced while we waited
            size = os.fstat(fd).st_size
            if size == 0:
                raise CacheError(f"{path}: empty file, not a shared cache segment; remove it")
            mm = mmap.mmap(fd, size)
            try:
                view = _native.ShmCacheView.attach(mm)
            except _native.ShmCacheError as e:
                raise CacheError(f"{path}: {e}; remove the file if no server is using it") from None
            live = _live_tokens(view)
            if not live:
                os.unlink(fname, dir_fd=dfd)  # stale: nobody alive uses it; recreate it
                log.info("replaced stale shared cache segment %s", path)
                return None
            if view.checksum != checksum:
                have = (
                    f"capacity {view.capacity} ({view.num_sets} sets x {view.ways} ways), "
                    f"vec_size {view.vec_size}, policy {view.policy}, "
                    f"precision {PRECISIONS[view.precision]}"
                )
                want = (
                    f"capacity {params['num_sets'] * params['ways']} ({params['num_sets']} "
                    f"sets x {params['ways']} ways), vec_size {params['vec_size']}, "
                    f"policy {params['policy']}, precision {PRECISIONS[params['precision']]}"
                )
                pids = sorted({t & _PID_MASK for t in live})
                raise CacheConfigMismatchError(
                    path,
                    f"shared cache segment in use by PIDs {pids} with another configuration: "
                    f"it has {have}, requested {want}. Give every instance the same cache "
                    f"settings, or stop the processes using it.",
                )
            if not view._register_token(token):
                raise CacheError(
                    f"{path}: attachment table full "
                    f"({_native.SHM_CACHE_ATTACH_SLOTS} live attachments)"
                )
            keep = True
            return cls(
                name=name, path=path, fd=fd, mm=mm, view=view, token=token, namespace_dir=ns_dir
            )
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            if not keep:
                if view is not None:
                    view.release()
                if mm is not None:
                    mm.close()
                os.close(fd)

    # ---- properties ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Actual capacity: num_sets * ways (>= the requested capacity)."""
        return self._native().capacity

    @property
    def num_sets(self) -> int:
        """Number of sets in the segment."""
        return self._native().num_sets

    @property
    def ways(self) -> int:
        """Slots per set (associativity)."""
        return self._native().ways

    @property
    def vec_size(self) -> int:
        """Floats per cached vector."""
        return self._native().vec_size

    @property
    def codec(self) -> RowCodec:
        """How the cache holds the rows (:meth:`insert` takes rows of it)."""
        v = self._native()
        return RowCodec.from_code(v.precision, v.vec_size)

    @property
    def policy(self) -> str:
        """The segment's cache policy name."""
        return self._native().policy

    @property
    def nbytes(self) -> int:
        """Size of the segment in bytes."""
        return self._native().nbytes

    def memory_use(self) -> Tuple[str, int]:
        """``("shm", bytes of the segment)``: where the cache's memory is, and how much
        (the metric ``trec_cache_bytes``)."""
        return "shm", int(self.nbytes)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closed

    def _native(self):
        if self._closed:
            raise CacheError(f"{self.path}: cache is closed")
        return self._view

    def shm_view(self) -> ShmCacheView:
        """The native view of the segment (what :class:`~triton_rec._native.LocalMisses`
        answers misses into)."""
        return self._native()

    def native_address(self) -> Tuple[int, int]:
        """``(base address, bytes)`` of the mapped cache: the native backend queries it
        there directly (valid until :meth:`close`)."""
        return tuple(self._native()._address())

    # ---- data ---------------------------------------------------------------------------

    def query(self, keys: np.ndarray, out: np.ndarray, hit_mask: np.ndarray) -> int:
        """Look keys up: ``out[i]`` = vector of ``keys[i]`` and ``hit_mask[i] = 1`` when
        cached, else ``hit_mask[i] = 0`` and ``out[i]`` unspecified. Returns the hits.

        ``keys`` int64 ``[M]``, ``out`` float32 ``[M, vec_size]``, ``hit_mask`` uint8 or
        bool ``[M]``, all C-contiguous (never converted). A hit refreshes the key's
        recency; under TinyLFU every key also counts as an access in the frequency sketch.

        Thread/process safety: lock-free (seqlocks), GIL released; never returns a
        partially written vector. Waits on a set lock only if a writer holds that set for
        long (or died holding it, in which case the set is repaired).
        """
        return self._native().query(keys, out, hit_mask)

    def insert(self, keys: np.ndarray, vectors: np.ndarray) -> InsertResult:
        """Insert ``keys[i] -> vectors[i]`` in order (a repeated key: the last one wins; a
        key already cached is overwritten, counted in ``stats()['updates']``). A full set
        evicts its least recently used key; under TinyLFU a new key enters a full set only
        if its estimated frequency is higher than that victim's, else it is rejected.

        Thread/process safety: safe; each key locks its set (process-shared robust
        mutex) for the copy only. GIL released.
        """
        return InsertResult(*self._native().insert(keys, vectors))

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Overwrite the vectors of the keys that are cached (refresh / online updates);
        never inserts, does not change recency. Returns how many were cached.

        Thread/process safety: as :meth:`insert`.
        """
        return self._native().update(keys, vectors)

    def erase(self, keys: np.ndarray) -> int:
        """Remove keys; returns how many were cached. Thread/process safety: as :meth:`insert`."""
        return self._native().erase(keys)

    def clear(self) -> None:
        """Remove every key (set by set: concurrent inserts may land right after). Counters
        and the TinyLFU sketch are kept. Thread/process safety: safe."""
        self._native().clear()

    def keys(self) -> np.ndarray:
        """int64 snapshot of the cached keys (each set read consistently, sets one after
        the other). Thread/process safety: lock-free, safe."""
        return self._native().keys()

    def size(self) -> int:
        """Number of cached keys (scans every set). Thread/process safety: lock-free, safe."""
        return int(self._native().size())

    def stats(self) -> Dict[str, int]:
        """Node-wide counters since the segment was created, summed over every process:
        lookups, hits, misses, inserts, updates, evictions, rejected_admissions, erased,
        recovered_sets (sets repaired after a writer died), sketch_agings.
        Thread/process safety: safe (relaxed atomic reads; not a consistent snapshot)."""
        return dict(self._native().stats())

    def hit_rate(self) -> float:
        """Node-wide hits / lookups since creation (0.0 before the first lookup)."""
        s = self.stats()
        return s["hits"] / s["lookups"] if s["lookups"] else 0.0

    def attached_pids(self) -> List[int]:
        """PIDs of the live processes attached to the segment (a PID appears once per
        open). Thread/process safety: safe."""
        return [t & _PID_MASK for t in self._native()._tokens() if _token_alive(t)]

    # ---- closing ------------------------------------------------------------------------

    def close(self, timeout: float = _OPEN_TIMEOUT) -> None:
        """Detach. If no live process remains attached the segment file is removed.

        Waits for calls still running in other threads of this process; any later call
        raises :class:`CacheError`. Idempotent. In a forked child that did not open the
        cache itself this only unmaps it.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _open_caches.discard(self)
        locked = False
        try:
            if os.getpid() == self._owner_pid:
                try:
                    _flock(self._fd, time.monotonic() + timeout, self.path)
                    locked = True
                except CacheError:
                    log.warning("%s: lock timeout; detached without cleanup", self.path)
                self._view._unregister_token(self._token)
                if locked and not _live_tokens(self._view) and _same_file(self._fd, self.path):
                    os.unlink(self.path)
                    if self._namespace_dir is not None:
                        shm_security.remove_namespace_dir(self._namespace_dir)
        finally:
            if locked:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._view.release()
            self._mm.close()
            os.close(self._fd)

    def __enter__(self) -> SharedEmbeddingCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"<SharedEmbeddingCache {self.path} (closed)>"
        v = self._view
        return (
            f"<SharedEmbeddingCache {self.path} policy={v.policy} capacity={v.capacity} "
            f"({v.num_sets} sets x {v.ways} ways) vec_size={v.vec_size}>"
        )
