"""Private shared memory: which files and directories the shared caches may use.

Threat model (docs/operations.md, "Shared-memory security"): another, unprivileged user
of the node can create files in ``/dev/shm`` (mode 1777) and list its names. It must
never get a server to read its data (forged vectors) or to write into its files; the
worst it may achieve is a refused load with a clear message. Root and processes of the
server's own user are trusted (they can read the server's memory anyway).

The rules, applied to every segment and published file (CPU cache :mod:`shm_cache`,
GPU/CUDA-IPC files :mod:`gpu_share`):

* a file is opened without following symbolic links and used only if it is a regular
  file owned by this process's effective uid with no group/other permission bits
  (created that way: exclusive creation, mode 0600); anything else raises
  :class:`SharedMemorySecurityError` naming the file, its owner uid and mode, before a
  byte of it is read;
* the files of one node store live in a private directory
  ``<parent>/trec-ns-<token>`` (mode 0700, owned by the server's uid), where nobody
  else can create, rename or replace anything. ``<token>`` is 128 random bits kept in
  ``<store>/shm-namespace`` (mode 0600), created once per store: two stores never share
  or clash, and the name cannot be predicted before the directory first exists;
* a namespace directory found owned by someone else (its name was seen in a listing
  of ``/dev/shm`` and planted after a reboot) is never used: the store gets a new
  token (logged as a warning) and the caches are created under the new name;
* the parent (``/dev/shm``) must be owned by root or the server's user, and be sticky
  if others may write to it (else anyone could rename our files away).

Only load-time code is here; nothing runs on the request path.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from typing import Optional

from triton_rec.errors import CacheError, SharedMemorySecurityError

log = logging.getLogger(__name__)

__all__ = [
    "NAMESPACE_DIR_PREFIX",
    "NAMESPACE_FILE",
    "SharedMemorySecurityError",
    "check_private",
    "namespace_directory",
    "open_private_file",
    "open_segment_dir",
    "remove_namespace_dir",
    "store_namespace",
]

#: file in the node store directory holding the store's namespace token
NAMESPACE_FILE = "shm-namespace"
#: prefix of a store's private directory in the shared-memory parent directory
NAMESPACE_DIR_PREFIX = "trec-ns-"
_TOKEN_BYTES = 16
_TOKEN_RE = re.compile(r"[0-9a-f]{%d}" % (2 * _TOKEN_BYTES))  # noqa: UP031 (regex braces)
_ROTATIONS = 4  # new tokens tried before giving up (each one needs an attacker's guess)


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def check_private(st: os.stat_result, path: str, what: str, directory: bool = False) -> None:
    """Raise :class:`SharedMemorySecurityError` unless ``st`` is a regular file (or a
    directory) owned by our euid with no group/other permission bits."""
    euid = os.geteuid()
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        raise SharedMemorySecurityError(
            f"{path}: refusing the {what}: not a {'directory' if directory else 'regular file'}"
        )
    if st.st_uid != euid or st.st_mode & 0o077:
        raise SharedMemorySecurityError(
            f"{path}: refusing the {what}: {_describe(st)}; only files owned by uid {euid} "
            f"(this server's user) without group/other permissions are used. It was not "
            f"created by this server: remove it (another user may have planted it)"
        )


def open_private_file(
    path: str,
    flags: int,
    what: str,
    dir_fd: Optional[int] = None,
    name: Optional[str] = None,
    mode: int = 0o600,
) -> int:
    """``os.open`` that never follows a symbolic link, never blocks on a FIFO, and
    returns only a private file (:func:`check_private`). ``name`` (default ``path``)
    is opened relative to ``dir_fd``; ``path`` is what messages show.
    FileNotFoundError passes through."""
    try:
        fd = os.open(
            name or path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd
        )
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SharedMemorySecurityError(
                f"{path}: refusing the {what}: it is a symbolic link"
            ) from None
        raise
    try:
        check_private(os.fstat(fd), path, what)
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_parent(parent: str) -> None:
    try:
        st = os.stat(parent)
    except OSError as e:
        raise CacheError(f"{parent}: shared-memory directory unusable: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{parent}: shared-memory directory is not a directory")
    others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if st.st_uid not in (0, os.geteuid()) or (others_write and not st.st_mode & stat.S_ISVTX):
        raise SharedMemorySecurityError(
            f"{parent}: refusing the shared-memory directory: {_describe(st)}; it must be "
            f"owned by root or uid {os.geteuid()} and sticky (like /dev/shm, 1777) if "
            f"others may write to it"
        )


def namespace_directory(parent: str, namespace: str) -> str:
    """``<parent>/trec-ns-<namespace>``."""
    if not _TOKEN_RE.fullmatch(namespace or ""):
        raise ValueError(
            f"shared-memory namespace must be {2 * _TOKEN_BYTES} hex digits, got {namespace!r}"
        )
    return os.path.join(parent, NAMESPACE_DIR_PREFIX + namespace)


def open_segment_dir(parent: str, namespace: Optional[str]):
    """(directory fd, directory path) where the segments go: ``parent`` itself without a
    namespace, else the store's private directory in it (created mode 0700 if missing).
    Raises :class:`SharedMemorySecurityError` for a directory that is not private."""
    _check_parent(parent)
    if namespace is None:
        return os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), parent
    path = namespace_directory(parent, namespace)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SharedMemorySecurityError(
                f"{path}: refusing the shared-memory namespace directory: not a directory "
                f"(a symbolic link or a file)"
            ) from None
        raise
    try:
        check_private(os.fstat(dfd), path, "shared-memory namespace directory", directory=True)
    except BaseException:
        os.close(dfd)
        raise
    return dfd, path


def remove_namespace_dir(path: str) -> None:
    """Remove a namespace directory if it is empty (the last segment of the store is
    gone); anything else (not empty, already gone) is left alone."""
    if os.path.basename(path).startswith(NAMESPACE_DIR_PREFIX):
        try:
            os.rmdir(path)
        except OSError:
            pass


def _new_token_file(path: str, replace: bool) -> None:
    """Write a fresh token to ``path``: exclusively (first writer wins) or replacing it."""
    d = os.path.dirname(path)
    tmp = os.path.join(d, f".{NAMESPACE_FILE}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secrets.token_hex(_TOKEN_BYTES) + "\n").encode())
        os.fsync(fd)
        os.close(fd)
        fd = -1
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process created it first: use theirs
    finally:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def _read_token(fd: int, path: str) -> str:
    data = os.pread(fd, 4 * _TOKEN_BYTES, 0).decode("ascii", "replace").strip()
    if not _TOKEN_RE.fullmatch(data):
        raise SharedMemorySecurityError(
            f"{path}: not a shared-memory namespace file (expected {2 * _TOKEN_BYTES} hex "
            f"digits); remove it and a new one is created"
        )
    return data


def store_namespace(store_root: str, parent: str) -> str:
    """The shared-memory namespace token of the node store at ``store_root``, created on
    first use (``<store_root>/shm-namespace``, mode 0600). If the token's directory in
    ``parent`` exists but is not ours, a new token replaces it (see the module
    docstring). Raises :class:`SharedMemorySecurityError` for a token file that is not
    private, CacheError if the store directory cannot hold it."""
    path = os.path.join(store_root, NAMESPACE_FILE)
    for _ in range(_ROTATIONS):
        try:
            fd = open_private_file(path, os.O_RDONLY, "shared-memory namespace file")
        except FileNotFoundError:
            try:
                _new_token_file(path, replace=False)
            except OSError as e:
                raise CacheError(
                    f"{path}: cannot create the shared-memory namespace file: {e.strerror}"
                ) from None
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one rotation at a time
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if not same:
                continue  # rotated while we waited: read the new one
            token = _read_token(fd, path)
            directory = namespace_directory(parent, token)
            try:
                st = os.lstat(directory)
            except FileNotFoundError:
                return token
            try:
                check_private(st, directory, "shared-memory namespace directory", directory=True)
                return token
            except SharedMemorySecurityError as e:
                log.warning("%s; the store gets a new shared-memory namespace (%s)", e, path)
                _new_token_file(path, replace=True)
        finally:
            os.close(fd)
    raise SharedMemorySecurityError(
        f"{path}: no usable shared-memory namespace after {_ROTATIONS} new tokens: "
        f"directories named by each new token already exist in {parent}, owned by others"
    )
