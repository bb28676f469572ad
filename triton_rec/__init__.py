"""triton_rec: embedding lookup and recommendation-model engine behind the Triton backends.

Importable and testable without Triton. Main entry points:

- :func:`triton_rec.config.ps_json.load_ps_config` parses a HugeCTR/HPS ``ps.json``.
- :class:`triton_rec.serving.session.LookupSession` answers HPS-style lookups for one model.
"""

from triton_rec.errors import (  # noqa: F401
    ConfigError,
    DuplicateKeyError,
    ModelFileError,
    RequestError,
    TritonRecError,
)

__version__ = "0.1.0"
