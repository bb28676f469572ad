"""Run the perf_analyzer that ``tritonclient[all]`` installs, with its library path set.

The binary (``<venv>/bin/perf_analyzer``) links ``libcudart.so.12`` even on a CPU-only
node; the PyPI package ``nvidia-cuda-runtime-cu12`` (in the ``server`` extra) ships that
library, but not on the default library path. This module finds it, so users and the
benchmarks run::

    triton-rec-perf -m hps_demo --input-data in.json -i grpc --concurrency-range 1:8

(console script; every argument goes to perf_analyzer unchanged), or from Python
:func:`command` / :func:`environment`.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Sequence


def binary() -> Path:
    """The perf_analyzer executable of this environment (beside the Python running us)."""
    here = Path(sys.executable).parent / "perf_analyzer"
    if here.exists():
        return here
    found = shutil.which("perf_analyzer")
    if found is None:
        raise FileNotFoundError(
            "perf_analyzer not found: pip install 'tritonclient[all]==2.50.0' "
            "(or 'triton-rec[server]')"
        )
    return Path(found)


def cuda_runtime_lib_dir() -> Optional[str]:
    """The ``lib`` directory of the ``nvidia-cuda-runtime-cu12`` package, if installed."""
    try:
        import nvidia.cuda_runtime as cr  # namespace package: no __file__
    except ImportError:
        return None
    for base in getattr(cr, "__path__", []):
        lib = os.path.join(base, "lib")
        if os.path.isdir(lib):
            return lib
    return None


def environment(base: Optional[dict] = None) -> dict:
    """``base`` (default: this process's environment) with the CUDA runtime's directory
    first on ``LD_LIBRARY_PATH``."""
    env = dict(os.environ if base is None else base)
    lib = cuda_runtime_lib_dir()
    if lib:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    return env


def command(args: Sequence[str]) -> List[str]:
    """``[perf_analyzer, *args]``."""
    return [str(binary()), *args]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console script ``triton-rec-perf``: exec perf_analyzer with ``argv``."""
    args = list(sys.argv[1:] if argv is None else argv)
    cmd = command(args)
    os.execve(cmd[0], cmd, environment())
    return 0  # unreachable


if __name__ == "__main__":
    sys.exit(main())
