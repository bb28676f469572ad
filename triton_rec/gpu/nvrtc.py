"""NVRTC through ctypes: CUDA C++ source -> PTX, without a CUDA toolkit or a device.

The library is looked for, in order: ``$TRITON_REC_NVRTC`` (a path), the NVIDIA wheels
in this environment (``nvidia-cuda-nvrtc-cu12``: ``nvidia/cuda_nvrtc/lib/libnvrtc.so.12``;
CUDA 13: ``nvidia/cu13/lib/libnvrtc.so.13``), then the dynamic loader's search
(``libnvrtc.so.13``, ``.12``, ``.11.2``, ``libnvrtc.so``: a CUDA toolkit's or the
system's). The API used (``nvrtcCreateProgram``, ``nvrtcCompileProgram``,
``nvrtcGetPTX``...) is the same in every release since CUDA 11.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import site
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from triton_rec.errors import TritonRecError

#: Environment variable naming the NVRTC library to use.
NVRTC_ENV = "TRITON_REC_NVRTC"
_SONAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so")
_WHEEL_GLOBS = ("nvidia/cu13/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*")


class NvrtcError(TritonRecError):
    """NVRTC is not there, or a program failed to compile (the message holds its log)."""


def _site_dirs() -> List[str]:
    dirs = list(sys.path)
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some virtualenv layouts
        pass
    return [d for d in dict.fromkeys(dirs) if d and os.path.isdir(d)]


def _candidates() -> List[str]:
    env = os.environ.get(NVRTC_ENV)
    if env:
        return [env]
    found = []
    for d in _site_dirs():
        for pattern in _WHEEL_GLOBS:
            # libnvrtc.so.12 (not the builtins library, libnvrtc-builtins.so.*)
            found += sorted(p for p in glob.glob(os.path.join(d, pattern)) if "builtins" not in p)
    return found + list(_SONAMES)


@functools.cache
def _library() -> Tuple[ctypes.CDLL, str]:
    tried = []
    for name in _candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name}: {e}")
            continue
        _declare(lib)
        return lib, name
    raise NvrtcError(
        "NVRTC (the CUDA runtime compiler) was not found; install the wheel of your CUDA "
        "version (pip install nvidia-cuda-nvrtc-cu12, or the gpu extra) or set "
        f"{NVRTC_ENV} to libnvrtc.so. Tried: " + "; ".join(tried)
    )


def _declare(lib: ctypes.CDLL) -> None:
    p, c_int, c_size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    strs = ctypes.POINTER(ctypes.c_char_p)
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(c_int), ctypes.POINTER(c_int)]
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [c_int]
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_char_p,
                                       c_int, strs, strs]  # fmt: skip
    lib.nvrtcCompileProgram.argtypes = [p, c_int, strs]
    lib.nvrtcGetProgramLogSize.argtypes = [p, ctypes.POINTER(c_size)]
    lib.nvrtcGetProgramLog.argtypes = [p, ctypes.c_char_p]
    lib.nvrtcGetPTXSize.argtypes = [p, ctypes.POINTER(c_size)]
    lib.nvrtcGetPTX.argtypes = [p, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(p)]
    for f in ("nvrtcGetNumSupportedArchs", "nvrtcGetSupportedArchs"):
        if hasattr(lib, f):
            getattr(lib, f).argtypes = [ctypes.POINTER(c_int)]
    if hasattr(lib, "nvrtcGetCUBIN"):  # NVRTC 11.1+
        lib.nvrtcGetCUBINSize.argtypes = [p, ctypes.POINTER(c_size)]
        lib.nvrtcGetCUBIN.argtypes = [p, ctypes.c_char_p]


def has_cubin() -> bool:
    """Whether this NVRTC compiles to SASS (cubin) as well as PTX (11.1 and newer)."""
    return hasattr(_library()[0], "nvrtcGetCUBIN")


def library_path() -> str:
    """The NVRTC library in use (NvrtcError when there is none)."""
    return _library()[1]


def version() -> Tuple[int, int]:
    """NVRTC's (major, minor) version."""
    lib = _library()[0]
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def supported_archs() -> List[int]:
    """The compute capabilities this NVRTC compiles for (e.g. ``[50, ..., 90]``)."""
    lib = _library()[0]
    if not hasattr(lib, "nvrtcGetSupportedArchs"):
        return [52, 60, 70, 75, 80, 86, 90]
    n = ctypes.c_int()
    _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * n.value)()
    _check(lib, lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return list(archs)


def _check(lib, result: int, what: str) -> None:
    if result != 0:
        text = lib.nvrtcGetErrorString(result)
        raise NvrtcError(f"{what} failed: {text.decode() if text else result}")


def _strings(values: Sequence[str]):
    arr = (ctypes.c_char_p * max(1, len(values)))()
    for i, v in enumerate(values):
        arr[i] = v.encode()
    return arr


def compile_ptx(
    source: str,
    name: str,
    arch: int,
    headers: Optional[Dict[str, str]] = None,
    options: Sequence[str] = (),
) -> str:
    """Compile CUDA C++ ``source`` (its file name ``name``, for messages) to PTX for the
    virtual architecture ``compute_<arch>`` (e.g. 90). ``headers`` maps the names its
    ``#include "..."`` lines use to their text. Raises NvrtcError with the compiler's log
    when it does not compile."""
    return _compile(source, name, f"compute_{int(arch)}", headers, options, False).decode()


def compile_cubin(
    source: str,
    name: str,
    arch: int,
    headers: Optional[Dict[str, str]] = None,
    options: Sequence[str] = (),
) -> bytes:
    """As :func:`compile_ptx`, to machine code (cubin) for ``sm_<arch>``: a driver loads it
    as it is, whatever PTX version it understands (PTX from an NVRTC newer than the
    driver's CUDA would not load)."""
    return _compile(source, name, f"sm_{int(arch)}", headers, options, True)


def _compile(source, name, target, headers, options, cubin: bool) -> bytes:
    lib = _library()[0]
    headers = dict(headers or {})
    prog = ctypes.c_void_p()
    names = list(headers)
    _check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog),
            source.encode(),
            name.encode(),
            len(names),
            _strings([headers[n] for n in names]),
            _strings(names),
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = [f"--gpu-architecture={target}", "--std=c++17", *options]
        result = lib.nvrtcCompileProgram(prog, len(opts), _strings(opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        if result != 0:
            raise NvrtcError(
                f"{name} does not compile for {target} "
                f"(NVRTC {'.'.join(map(str, version()))}):\n{log.value.decode(errors='replace')}"
            )
        get_size, get = (
            (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            if cubin
            else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        )
        _check(lib, get_size(prog, ctypes.byref(size)), "nvrtcGet(PTX|CUBIN)Size")
        image = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, image), "nvrtcGet(PTX|CUBIN)")
        return image.raw.rstrip(b"\0") if not cubin else image.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
