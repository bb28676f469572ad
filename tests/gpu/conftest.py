"""The GPU suite (``make gpu-check``, ``pytest -m gpu``): every test here is marked ``gpu``
and needs a CUDA device, CuPy and NVRTC. On a machine without them each test fails,
saying what is missing; ``make test`` leaves the suite out (``-m "not gpu"``, pyproject.toml)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def cupy():
    """CuPy, on device 0 (the test fails here when there is no GPU)."""
    from triton_rec import _native

    why = _native.cuda_unavailable()
    assert not why, f"the GPU suite needs a CUDA device: {why}"
    import cupy as cp

    cp.cuda.Device(0).use()
    return cp
