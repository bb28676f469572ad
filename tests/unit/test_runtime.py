"""The launcher's start-up checks (triton_rec/triton/runtime.py): finding the server wheel's
files without importing ``pytriton``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from triton_rec.errors import RuntimeNotFound
from triton_rec.triton import runtime

WHEEL = importlib.util.find_spec("pytriton") is not None
needs_wheel = pytest.mark.skipif(not WHEEL, reason="the Triton server wheel is not installed")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


# ---- finding the wheel's files -------------------------------------------------------------


@needs_wheel
def test_the_wheel_files_are_found_without_importing_pytriton():
    out = _python(
        """
        import sys
        from triton_rec.triton import runtime as r
        print(r.tritonserver_binary().is_file(), r.runtime_library_dir().is_dir(),
              r.python_backend_stub().is_file(), "pytriton" in sys.modules)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "False"]


def test_a_wheel_whose_init_cannot_be_imported_is_still_found(tmp_path):
    # As on a GPU node without tritonclient: pytriton/__init__.py fails on import.
    pkg = tmp_path / "pytriton"
    (pkg / "tritonserver" / "bin").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('No module named tritonclient')\n")
    (pkg / "tritonserver" / "bin" / "tritonserver").write_text("")
    out = _python(
        """
        import sys
        from triton_rec.triton import runtime as r
        print(r.tritonserver_binary())
        print(r.runtime_library_dir())
        print("pytriton" in sys.modules)
        """,
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    )
    assert out.returncode == 0, out.stderr
    binary, libs, imported = out.stdout.splitlines()
    assert binary == str(pkg.resolve() / "tritonserver" / "bin" / "tritonserver")
    assert libs == str(tmp_path.resolve() / "nvidia_pytriton.libs")
    assert imported == "False"


def test_a_missing_wheel_is_named_with_the_package_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pytriton", None)  # what find_spec reports as absent
    with pytest.raises(RuntimeNotFound, match=r"the Triton server wheel is missing: pip install"):
        runtime.tritonserver_binary()
