"""Opening the files a model is made of: regular files only, bounded, optionally confined.

Every file the backends read at load goes through here:

- :func:`read_json` reads every JSON file (ps.json, the HugeCTR network JSON, the
  BatchNorm statistics JSON): a regular file (a FIFO never blocks the load, a device
  such as ``/dev/zero`` is refused), at most :data:`MAX_JSON_BYTES`, nested at most
  :data:`MAX_JSON_DEPTH` levels, UTF-8, standard JSON (no ``NaN``/``Infinity``);
- :func:`open_model_file` opens the binary files (dense weights, sparse ``key`` /
  ``emb_vector`` files) with the same regular-file rule;
- :func:`confine` checks a path against the operator's allowed roots
  (:data:`ALLOWED_ROOTS_ENV`, off by default as in HPS), after resolving symlinks.
  Files opened here are checked by the path of the open descriptor, so a symlink
  swapped between the check and the open cannot escape.

Every error names the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from typing import Any, Mapping, Optional, Tuple

from triton_rec.errors import ConfigError, ModelFileError, PathNotAllowedError

# re-exported: ps_json imports ConfigFileError from here
from triton_rec.errors import ConfigFileError as ConfigFileError

#: Largest JSON file read at load (ps.json, network JSON, BatchNorm statistics), bytes.
MAX_JSON_BYTES = 64 << 20
#: Deepest nesting of arrays/objects in a JSON file read at load (ps.json needs 4,
#: HugeCTR network JSONs about 5).
MAX_JSON_DEPTH = 64
#: Environment variable of the operator: directories (separated by ``:``) that every
#: model file must resolve into. Unset or empty: no confinement (the HPS behaviour).
ALLOWED_ROOTS_ENV = "TRITON_REC_ALLOWED_ROOTS"

_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)


def allowed_roots(environ: Optional[Mapping[str, str]] = None) -> Tuple[str, ...]:
    """The allowed roots, symlinks resolved; () when confinement is off.

    Raises:
        ConfigError: a root is not an absolute path.
    """
    environ = os.environ if environ is None else environ
    raw = [r for r in (environ.get(ALLOWED_ROOTS_ENV) or "").split(os.pathsep) if r.strip()]
    for r in raw:
        if not os.path.isabs(r):
            raise ConfigError(f"{ALLOWED_ROOTS_ENV}: roots must be absolute paths, got {r!r}")
    return tuple(os.path.realpath(r) for r in raw)


def _inside(real: str, roots: Tuple[str, ...]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def confine(
    path: str, what: str, roots: Optional[Tuple[str, ...]] = None, real: Optional[str] = None
) -> None:
    """Refuse ``path`` (a ``what``, e.g. "sparse file") unless it resolves into an allowed
    root; nothing to do when confinement is off.

    Args:
        roots: the roots (default: :func:`allowed_roots`).
        real: the resolved path if known (e.g. of an open descriptor).

    Raises:
        PathNotAllowedError: naming the file, where it resolves and the roots.
    """
    roots = allowed_roots() if roots is None else roots
    if not roots:
        return
    real = os.path.realpath(path) if real is None else real
    if not _inside(real, roots):
        where = "" if real == os.path.abspath(path) else f" (resolves to {real})"
        raise PathNotAllowedError(
            path,
            f"{what}{where} is outside the allowed roots {list(roots)} "
            f"(set by the operator in {ALLOWED_ROOTS_ENV})",
        )


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_model_file(path: str, what: str, error=ModelFileError) -> Tuple[int, os.stat_result]:
    """Open ``path`` read-only; it must be a regular file inside the allowed roots.

    Opened with ``O_NONBLOCK`` (a FIFO does not block) and ``O_CLOEXEC``; the caller
    owns (and closes) the descriptor.

    Returns:
        ``(fd, fstat result)``.

    Raises:
        ``error`` (a ModelFileError class): missing, unreadable or not a regular file;
        PathNotAllowedError: outside the allowed roots.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise error(path, f"{what} not found") from e
    except OSError as e:
        raise error(path, f"cannot open the {what}: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(path, f"the {what} must be a regular file, this is {_kind(st.st_mode)}")
        roots = allowed_roots()
        if roots:
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                real = os.path.realpath(path)
            confine(path, what, roots, real)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def read_model_file(path: str, what: str, max_bytes: int, error=ModelFileError) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (see :func:`open_model_file`)."""
    fd, st = open_model_file(path, what, error)
    try:
        if st.st_size > max_bytes:
            raise error(
                path, f"the {what} has {st.st_size} bytes, more than the limit of {max_bytes} bytes"
            )
        chunks, total = [], 0
        while True:  # the file may grow while read: never read past the limit
            try:
                b = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    continue
                raise error(path, f"cannot read the {what}: {e.strerror or e}") from e
            if not b:
                break
            chunks.append(b)
            total += len(b)
            if total > max_bytes:
                raise error(path, f"the {what} holds more than the limit of {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _check_depth(raw: bytes, path: str, what: str, error) -> None:
    depth = 0
    for m in _TOKENS.finditer(raw):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise error(
                    path,
                    f"the {what} nests arrays/objects deeper than the limit of "
                    f"{MAX_JSON_DEPTH} levels (byte {m.start()})",
                )
        elif c in (b"]", b"}"):
            depth -= 1


def _no_constant(name: str):
    raise ValueError(f"{name} is not standard JSON")


def read_json(path: str, what: str = "JSON file", error=ModelFileError) -> Any:
    """Decode a JSON file read at load, within :data:`MAX_JSON_BYTES` and
    :data:`MAX_JSON_DEPTH` (see the module docstring).

    Raises:
        ``error`` naming the file: missing, not a regular file, too big, too deep, not
        UTF-8, not valid JSON; PathNotAllowedError: outside the allowed roots.
    """
    raw = read_model_file(path, what, MAX_JSON_BYTES, error)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(path, f"the {what} is not UTF-8 text (byte {e.start})") from e
    _check_depth(raw, path, what, error)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as e:  # json.JSONDecodeError and the constants refused above
        raise error(path, f"not valid JSON ({e})") from e
    except RecursionError as e:  # not reached within MAX_JSON_DEPTH; kept as a guard
        raise error(path, f"the {what} nests too deeply") from e
