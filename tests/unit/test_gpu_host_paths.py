"""The GPU paths' host code, run without a GPU.

tests/native/gpu_host_paths.cpp (the harness) runs the real src/triton_backend/trec/
gpu_paths.cpp, plan.cpp and combine.cpp, and src/native/gpu_ops.hpp, against
tests/native/fake_cuda.cpp, a libcuda.so.1 whose device memory is host memory, whose copies
and kernel arguments are checked against their allocations, and whose streams run only at a
synchronization (their comments say what each checks and what it cannot). Built here with the
system C++ compiler; a machine without one fails this test (the project always builds C++).

The stand-in has two devices: a context per device, current per thread; every copy, launch
and graph launch must go to a stream of the current context's device and touch only that
device's memory. test_two_devices serves one model from an instance on each (issue 37).

Run twice: plainly (a copy's source changed while it is pending is reported), and with
FAKE_POISON=1 (a copy to the host fills its destination with garbage until it runs).
Checked by hand to fail on each of these mutations of the GPU paths:
  - the answer read before the synchronization (dense_gpu's memcpy to `answer` moved
    above lane.sync()): wrong answers, in both runs;
  - staging written while a copy from it is pending (a memset of dense_gpu's vectors in the
    staging after lane.to_device): the plain run;
  - a short EMBEDDINGS copy (dense_gpu copying one float fewer of `emb` into the staging):
    wrong answers, in both runs;
  - a short copy back of the statuses (lookup_tables copying one byte fewer): both runs;
  - hugectr_gpu's lane guard dropped (`(void)lane.enter();`): work left pending after a
    failing finish_query or flush, in both runs;
  - a failing flush swallowed (hugectr_gpu's `pending.flush()` in a try/catch): the
    failure not reported to the caller, in both runs;
  - Lane::enter no longer making its device current: copies and launches queued on a
    stream of device 1 while device 0 (or none, on a fresh thread) is current;
  - the targets' device memory reserved before the lane is entered (DeviceArray::upload,
    as it was): device 1's lookups read targets in device 0's memory (the bug this test
    found and that is fixed).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.native_build import NativeBuild, run


@pytest.fixture(scope="module")
def harness(native_build: NativeBuild) -> Path:
    """The harness linked to the fake driver (beside it, as libcuda.so.1)."""
    nb = native_build
    exe = nb.dir / "gpu_host_paths"
    objects = [nb.obj(n) for n in ("gpu_host_paths", "gpu_paths", "plan", "combine")]
    run([nb.cxx, "-o", str(exe), *objects, str(nb.fake_driver), *nb.python_link()])
    return exe


@pytest.mark.parametrize("poison", ["0", "1"], ids=["plain", "poison"])
def test_gpu_host_paths(harness: Path, poison: str) -> None:
    env = dict(os.environ, FAKE_POISON=poison)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(harness.parent), env.get("LD_LIBRARY_PATH")) if p
    )
    r = subprocess.run([str(harness)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "failures 0, driver reports 0" in r.stdout, r.stdout + r.stderr
