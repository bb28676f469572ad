"""The launcher's start-up checks (triton_rec/triton/runtime.py): finding the server wheel's
files without importing ``pytriton``, and refusing the Python request path where the
Triton Python backend stub cannot read the numpy of the environment it imports.

The stubs are real files (the installed wheel's, or a copy of it with the pybind11 mark
removed, as a stub built with a newer pybind11 has none); the environments are real
virtual environments with a numpy package whose version is what the test needs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import numpy as np
import pytest

from triton_rec.errors import RequestPathUnavailable, RuntimeNotFound
from triton_rec.triton import backend_dir, runtime

WHEEL = importlib.util.find_spec("pytriton") is not None


@pytest.fixture()
def wheel() -> None:
    """The Triton server wheel, which the test environment installs (the server extra):
    without it the tests that read its files fail, saying so."""
    if not WHEEL:
        pytest.fail("the Triton server wheel is not installed (pip install -e '.[server]')")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


# ---- finding the wheel's files -------------------------------------------------------------


def test_the_wheel_files_are_found_without_importing_pytriton(wheel):
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


# ---- the Python request path under numpy 2 -------------------------------------------------


def _env_with_numpy(tmp_path: Path, version: str) -> dict:
    """A server environment whose first python3 on PATH is a virtual environment holding a
    numpy package of ``version``."""
    root = tmp_path / f"venv-numpy-{version}"
    venv.create(root, with_pip=False, symlinks=True)
    (site,) = root.glob("lib/python*/site-packages")
    (site / "numpy").mkdir()
    (site / "numpy" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return {**os.environ, "PATH": os.pathsep.join([str(root / "bin"), os.environ["PATH"]])}


@pytest.fixture()
def old_stub(wheel) -> Path:
    return runtime.python_backend_stub()


@pytest.fixture()
def fixed_stub(old_stub, tmp_path) -> Path:
    """The wheel's stub as a pybind11 >= 2.12 build would be: no numpy.core.multiarray."""
    data = old_stub.read_bytes()
    mark = runtime.STUB_PRE_NUMPY2_MARK
    assert data.count(mark) == 1
    stub = tmp_path / "triton_python_backend_stub"
    stub.write_bytes(data.replace(mark, b"numpy._core\0".ljust(len(mark), b"\0")))
    return stub


def test_the_wheel_stub_is_built_with_a_pybind11_older_than_numpy_2(old_stub, fixed_stub):
    # nvidia-pytriton 0.7.0 = Triton 2.51: python_backend r24.10 pins pybind11 v2.10.0.
    assert runtime.stub_predates_numpy2(old_stub)
    assert not runtime.stub_predates_numpy2(fixed_stub)


def test_the_python_path_is_refused_with_numpy_2_and_the_old_stub(old_stub, tmp_path):
    env = _env_with_numpy(tmp_path, "2.5.2")
    assert runtime.stub_numpy_version(env) == "2.5.2"
    with pytest.raises(RequestPathUnavailable) as e:
        runtime.check_python_request_path(env, old_stub)
    message = str(e.value)
    assert "numpy 2.5.2" in message and "pybind11 older than 2.12" in message
    assert str(old_stub) in message and str(tmp_path) in message  # the stub and the env
    assert "install numpy < 2" in message  # way out 1
    assert "native request path, the default" in message  # way out 2
    assert runtime.REQUEST_PATH_ENV in message


def test_the_python_path_starts_with_numpy_1_or_a_fixed_stub(old_stub, fixed_stub, tmp_path):
    runtime.check_python_request_path(_env_with_numpy(tmp_path, "1.26.4"), old_stub)
    numpy_2 = _env_with_numpy(tmp_path, "2.0.0rc1")
    with pytest.raises(RequestPathUnavailable, match="numpy 2.0.0rc1"):
        runtime.check_python_request_path(numpy_2, old_stub)
    runtime.check_python_request_path(numpy_2, fixed_stub)
    # this environment (the one the tests run in)
    server_env = runtime.TritonServer(tmp_path, request_path="python").environment()
    if int(np.__version__.split(".")[0]) < 2:
        runtime.check_python_request_path(server_env, old_stub)
    else:
        with pytest.raises(RequestPathUnavailable):
            runtime.check_python_request_path(server_env, old_stub)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="stubs for Python >= 3.11 only")
def test_the_numpy_asked_about_ignores_pythonpath_as_the_stub_does(tmp_path):
    # pybind11 2.10 starts Python >= 3.11 isolated: PYTHONPATH never reaches the stub
    # (checked with a real server: a numpy 2 on PYTHONPATH left the stub on the venv's).
    shadow = tmp_path / "shadow"
    (shadow / "numpy").mkdir(parents=True)
    (shadow / "numpy" / "__init__.py").write_text("__version__ = '2.9.9'\n")
    server = runtime.TritonServer(tmp_path, request_path="python", env={"PYTHONPATH": str(shadow)})
    assert server.environment()["PYTHONPATH"] == str(shadow)
    assert runtime.stub_numpy_version(server.environment()) == np.__version__


@pytest.fixture()
def numpy_2_seen(monkeypatch):
    """The numpy version the stub's environment reports, set to 2.5.2 (as on the GPU node)."""
    seen = []

    def version(env):
        seen.append(env["PATH"])
        return "2.5.2"

    # where check_python_request_path looks it up (runtime re-exports it)
    monkeypatch.setattr(backend_dir, "stub_numpy_version", version)
    return seen


def test_a_server_on_the_python_path_refuses_before_starting(old_stub, numpy_2_seen, tmp_path):
    server = runtime.TritonServer(tmp_path, request_path="python", backend_dir=tmp_path / "b")
    with pytest.raises(RequestPathUnavailable, match="numpy 2.5.2"):
        server.launch()
    assert server.process is None and not (tmp_path / "b").exists()
    # the environment asked is the server's: this interpreter's directory first on PATH
    assert numpy_2_seen[0].split(os.pathsep)[0] == str(Path(sys.executable).parent)


def test_the_request_path_from_the_environment_variable_is_checked_too(
    old_stub, numpy_2_seen, tmp_path, monkeypatch
):
    monkeypatch.setenv(runtime.REQUEST_PATH_ENV, "python")
    with pytest.raises(RequestPathUnavailable):
        runtime.TritonServer(tmp_path).check_request_path()


def test_the_native_path_is_not_checked(old_stub, numpy_2_seen, tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.REQUEST_PATH_ENV, "native")
    runtime.TritonServer(tmp_path).check_request_path()
    runtime.TritonServer(tmp_path, request_path="native").check_request_path()
    assert numpy_2_seen == []


def test_the_command_line_refuses_with_the_message_and_exit_code_2(
    old_stub, numpy_2_seen, tmp_path, capsys
):
    code = runtime.main(["serve", "--model-repository", str(tmp_path), "--request-path", "python"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("triton-rec-server: the Python request path cannot run here")
    assert "numpy < 2" in err and "native request path" in err
