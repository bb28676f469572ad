"""triton-rec-perf: the venv's perf_analyzer runs, with the CUDA runtime library it links
found for it (the bare binary fails to start without LD_LIBRARY_PATH set by hand)."""

from __future__ import annotations

import os
import subprocess
import sys

from triton_rec.triton import perf_analyzer


def test_the_environment_puts_the_cuda_runtime_library_on_the_path():
    lib = perf_analyzer.cuda_runtime_lib_dir()
    assert lib and os.path.exists(os.path.join(lib, "libcudart.so.12"))
    env = perf_analyzer.environment({"LD_LIBRARY_PATH": "/elsewhere"})
    assert env["LD_LIBRARY_PATH"].split(os.pathsep) == [lib, "/elsewhere"]


def test_the_console_script_runs_perf_analyzer():
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    out = subprocess.run(
        [sys.executable, "-m", "triton_rec.triton.perf_analyzer", "--version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Perf Analyzer" in out.stdout + out.stderr
