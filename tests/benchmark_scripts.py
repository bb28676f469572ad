"""Import a script of ``benchmarks/`` by name, for the tests that run it on tiny sizes
(the scripts are not a package: each is loaded from its file, once per process)."""

import importlib.util
import os
import sys
from types import ModuleType

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def load_benchmark(name: str) -> ModuleType:
    """The module ``benchmarks/<name>.py`` (registered as ``sys.modules[name]``)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
