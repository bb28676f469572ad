"""The GPU kernels: their sources, compiled to PTX with NVRTC, loaded on a device.

The sources are ``src/native/kernels/cache_kernels.cu`` and the headers it shares with the
native core (``hd.hpp``, ``array_cache_rules.hpp``: the per-key and per-set rules the CPU
twin runs too), embedded in ``_native`` when it is built (``_native.GPU_KERNEL_SOURCES``),
so an installed wheel and a checkout compile exactly what the native core was built with.

On a device the kernels are compiled to machine code (cubin) for its architecture when
NVRTC knows it (:func:`image`): a driver loads that whatever PTX version it understands,
so an NVRTC newer than the driver's CUDA still works; else to PTX for the newest virtual
architecture below the device, which the driver compiles at load. CI compiles PTX for
:data:`CI_ARCHS` with no device (tests/unit/test_gpu_kernels.py).
"""

from __future__ import annotations

import functools
import hashlib
import threading
from typing import Dict

from triton_rec import _native
from triton_rec.gpu import nvrtc

#: Architectures every change must compile for (A100, H100/H200): CI compiles both.
CI_ARCHS = (80, 90)

_lock = threading.Lock()
_loaded: Dict[int, object] = {}


def sources() -> Dict[str, str]:
    """File name -> text of the kernels' sources (the main file is :func:`main_file`)."""
    return dict(_native.GPU_KERNEL_SOURCES)


def main_file() -> str:
    """The name of the file NVRTC compiles (the others are its headers)."""
    return str(_native.GPU_KERNEL_MAIN)


def digest() -> str:
    """A short hash of the sources (names the kernels in logs and benchmarks)."""
    h = hashlib.sha256()
    for name, text in sorted(sources().items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:12]


def arch_for(compute_capability: int) -> int:
    """The virtual architecture to compile for on a device of ``compute_capability``
    (e.g. 90): the newest NVRTC supports that is not newer than the device."""
    usable = [a for a in nvrtc.supported_archs() if a <= int(compute_capability)]
    if not usable:
        raise nvrtc.NvrtcError(
            f"NVRTC {nvrtc.version()} compiles for none of the architectures up to "
            f"compute_{compute_capability}"
        )
    return max(usable)


def _program():
    src = sources()
    main = main_file()
    return src[main], main, {name: text for name, text in src.items() if name != main}


@functools.cache
def ptx(arch: int) -> str:
    """The kernels compiled to PTX for ``compute_<arch>`` (cached per process)."""
    source, main, headers = _program()
    return nvrtc.compile_ptx(source, main, int(arch), headers)


@functools.cache
def image(compute_capability: int) -> bytes:
    """What a device of ``compute_capability`` loads: cubin for ``sm_<cc>`` when this NVRTC
    compiles for it, else the PTX of :func:`arch_for` (cached per process)."""
    cc = int(compute_capability)
    if nvrtc.has_cubin() and cc in nvrtc.supported_archs():
        source, main, headers = _program()
        return nvrtc.compile_cubin(source, main, cc, headers)
    return ptx(arch_for(cc)).encode()


def device_info(device: int) -> dict:
    """Name, compute capability, multiprocessors and driver version of a CUDA device
    (``_native.CudaError`` without a driver or device)."""
    return dict(_native.cuda_device_info(int(device)))


def load_kernels(device: int):
    """The kernels loaded on ``device`` (``_native.GpuKernels``), one per device and process:
    compiled for its architecture, loaded into its primary context (the one CuPy uses)."""
    device = int(device)
    with _lock:
        k = _loaded.get(device)
        if k is None:
            k = _native.GpuKernels(device, image(device_info(device)["compute_capability"]))
            _loaded[device] = k
        return k


def plan_image(device: int) -> bytes:
    """The module a native backend instance on ``device`` loads (the same as
    :func:`load_kernels`'s)."""
    return image(device_info(int(device))["compute_capability"])
