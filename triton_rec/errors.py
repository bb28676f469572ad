"""Exception hierarchy of the engine: every error class of ``triton_rec`` and
``ps_loader`` is defined here.

One root (:class:`TritonRecError`) with narrow subclasses, so callers can catch
exactly what they can handle. The Triton backends translate these into
``pb_utils.TritonError`` (bad request) or a failed model load (bad files/config).
The modules that raise an error re-export its class (``triton_rec.storage.backing_store.StoreError``
is ``triton_rec.errors.StoreError``), so either import path names the same class.

::

    TritonRecError
    +-- ConfigError
    |   +-- ConfigFileError (also a ModelFileError)
    |   +-- PathNotAllowedError (also a ModelFileError)
    |   +-- CacheConfigMismatchError (also a CacheError)
    +-- ModelFileError
    |   +-- DuplicateKeyError
    |   +-- CorruptLayoutError
    +-- RequestError
    |   +-- RequestTooLarge
    +-- CacheError
    |   +-- SharedMemorySecurityError
    |   +-- StaleHandlesError
    +-- StoreError
    |   +-- ReadOnlyStoreError
    |   +-- StoreUnavailableError
    |   +-- StoreDataError
    +-- UpdateMessageError
    +-- CupyUnavailableError (also an ImportError)
    +-- RuntimeNotFound (also a RuntimeError)
    +-- RequestPathUnavailable (also a RuntimeError)

The native extension's own classes derive from this root too (src/native/bindings.cpp,
bindings_shm_cache.cpp):
``_native.DuplicateKeyError`` and ``_native.CorruptIndexError`` are TritonRecErrors and
ValueErrors, ``_native.ShmCacheError`` a CacheError and a RuntimeError.
"""

from __future__ import annotations


class TritonRecError(Exception):
    """Root of every error raised on purpose by ``triton_rec`` and ``ps_loader``."""


class ConfigError(TritonRecError):
    """A ps.json / config.pbtxt value is missing, of the wrong type or inconsistent."""


class ModelFileError(TritonRecError):
    """A trained model file is missing, truncated or inconsistent.

    Args:
        path: the file or directory at fault (always part of the message).
        problem: what is wrong with it.
    """

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class DuplicateKeyError(ModelFileError):
    """A table holds the same key twice."""


class RequestError(TritonRecError):
    """A lookup request is malformed (counts, sizes, batch limits)."""


class CacheError(TritonRecError):
    """The shared embedding cache cannot be created, attached to or used."""


class CacheConfigMismatchError(ConfigError, CacheError):
    """A shared cache segment exists, in use, with another configuration.

    Args:
        path: the segment file (always part of the message).
        problem: how the configurations differ.
    """

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ConfigFileError(ModelFileError, ConfigError):
    """A configuration file (ps.json, network JSON) cannot be read or decoded; the message
    starts with the file."""


class PathNotAllowedError(ModelFileError, ConfigError):
    """A model file resolves outside the allowed roots
    (:data:`triton_rec.config.model_files.ALLOWED_ROOTS_ENV`)."""


class CorruptLayoutError(ModelFileError):
    """A layout file of the node store is truncated, incomplete, of another format
    version or corrupt.

    :func:`triton_rec.storage.node_store.load_table` deletes such a layout and converts the source
    again.
    """


class RequestTooLarge(RequestError):
    """An input is larger than the model's largest valid request."""


class SharedMemorySecurityError(CacheError):
    """A shared-memory file or directory is not private to this server's user (another
    owner, group/other permissions, a symbolic link, not a regular file): never used."""


class StaleHandlesError(CacheError):
    """Published IPC handles belong to a process that no longer exists."""


class StoreError(TritonRecError):
    """A store cannot do what was asked (root of the store errors): a backing store
    (tier) operation failed, or the node-local store directory cannot be used (not
    writable, disk full, ...)."""


class ReadOnlyStoreError(StoreError):
    """A write (:meth:`~triton_rec.storage.backing_store.BackingStore.upsert`,
    :meth:`~triton_rec.storage.backing_store.BackingStore.delete`) to a read-only store."""


class StoreUnavailableError(StoreError):
    """A store cannot be reached or opened (connection refused or timed out, locked DB).

    The message names the address or path.
    """


class StoreDataError(StoreError):
    """A store holds data that is not a valid row (e.g. a value of the wrong length).

    The message names the table and the key; no part of such a value is ever returned.
    """


class UpdateMessageError(TritonRecError):
    """A message that is not a valid HPS update (the message says what is wrong)."""


class CupyUnavailableError(TritonRecError, ImportError):
    """A GPU cache was requested but CuPy (or a CUDA device) is not available."""


class RuntimeNotFound(TritonRecError, RuntimeError):
    """The Triton server wheel (nvidia-pytriton) is not installed in this environment."""


class RequestPathUnavailable(TritonRecError, RuntimeError):
    """The chosen request path cannot serve in this environment (the Python path where
    Triton's Python backend stub cannot read the environment's numpy); the message names
    the cause and the ways out."""
