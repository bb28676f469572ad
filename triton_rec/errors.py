"""Exception hierarchy of the engine.

One root (:class:`TritonRecError`) with narrow subclasses, so callers can catch
exactly what they can handle. The Triton backends translate these into
``pb_utils.TritonError`` (bad request) or a failed model load (bad files/config).
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
