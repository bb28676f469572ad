"""The C++ test programs of tests/native, compiled once per test session (the
``native_build`` fixture of tests/conftest.py): the backend's own sources they link
(src/triton_backend/trec/plan.cpp, gpu_paths.cpp, combine.cpp), the two harnesses
(tests/native/gpu_host_paths.cpp, plan_reader.cpp) and the fake CUDA driver
(tests/native/fake_cuda.cpp, as ``libcuda.so.1``), every translation unit at once on every
core, with the system C++ compiler (a machine without one fails: the project always builds
C++). ``-O0``: the tests check behaviour, and plan.cpp alone takes 16 s to compile at ``-O1``
(9 s at ``-O0``) on one core of the development machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE_TESTS = ROOT / "tests" / "native"
TREC = ROOT / "src" / "triton_backend" / "trec"
INCLUDES = [ROOT / "src" / "native", ROOT / "src" / "triton_backend", TREC]
#: the objects, by name: the backend's sources (the rest need Triton or the interpreter's
#: embedding) and the harnesses
UNITS = {
    "plan": TREC / "plan.cpp",
    "gpu_paths": TREC / "gpu_paths.cpp",
    "combine": TREC / "combine.cpp",
    "gpu_host_paths": NATIVE_TESTS / "gpu_host_paths.cpp",
    "plan_reader": NATIVE_TESTS / "plan_reader.cpp",
}


def compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    pytest.fail("no C++ compiler (CXX, c++, g++, clang++) on PATH: the project needs one")


def run(cmd: List[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))}\nexit {r.returncode}\n{r.stdout}\n{r.stderr}")


@dataclass(frozen=True)
class NativeBuild:
    """Where the objects (``<name>.o``) and the fake driver (``libcuda.so.1``) are."""

    dir: Path
    cxx: str

    def obj(self, name: str) -> str:
        return str(self.dir / f"{name}.o")

    @property
    def fake_driver(self) -> Path:
        return self.dir / "libcuda.so.1"

    @staticmethod
    def python_link() -> List[str]:
        """Linking the interpreter's library, as the backend does (plan.cpp reads plans
        from Python)."""
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        pylib = f"-lpython{sysconfig.get_config_var('LDVERSION')}"
        return [f"-L{libdir}", pylib, f"-Wl,-rpath,{libdir}", "-ldl", "-lpthread"]


def build(out: Path) -> NativeBuild:
    """Compiles every unit of :data:`UNITS` and the fake driver into ``out``."""
    cxx = compiler()
    flags = ["-std=c++17", "-O0", "-g0", "-fPIC", "-Wall", "-Wextra"]
    flags += [f"-I{d}" for d in INCLUDES] + [f"-I{sysconfig.get_paths()['include']}"]
    nb = NativeBuild(out, cxx)
    jobs = [[cxx, *flags, "-c", str(src), "-o", nb.obj(name)] for name, src in UNITS.items()]
    fake = ["-shared", "-Wl,-soname,libcuda.so.1", str(NATIVE_TESTS / "fake_cuda.cpp")]
    jobs.insert(1, [cxx, *flags, *fake, "-o", str(nb.fake_driver)])  # early: plan.cpp is long
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(run, jobs))
    return nb
