"""src/native/idle_pool.hpp on its own: the pool that holds a request's buffers from one
request to the next (the native backend's Scratch, a row pool thread's workspace) and gives
them back once idle. tests/native/idle_pool.cpp, built here with the system C++ compiler,
checks: a lease takes the buffers given back last; two leases at once hold two; what no
request used for kIdleRelease is dropped by the reaper; in a child made by fork (where the
parent's reaper thread is not) the child's own reaper drops them (checked by hand to fail
with the fork handler's reset of `started_` removed). The served consequence, memory given
back after a burst, is tests/e2e/test_criteo_dlrm.py's."""

from __future__ import annotations

import subprocess

from tests.native_build import NATIVE_TESTS, ROOT, compiler


def test_idle_pool(tmp_path):
    exe = tmp_path / "idle_pool"
    build = [compiler(), "-std=c++17", "-O0", "-Wall", "-Wextra", "-Werror", "-pthread"]
    build += [f"-I{ROOT / 'src' / 'native'}", str(NATIVE_TESTS / "idle_pool.cpp"), "-o", str(exe)]
    subprocess.run(build, check=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines and all(x.startswith("ok ") for x in lines), r.stdout
    assert len(lines) == 7, r.stdout  # every check ran, the child's included
