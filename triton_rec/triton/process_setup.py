"""How an instance process is set up on a node where every model instance is a process.

Three things the defaults of the libraries get wrong there, each measured on 2 cores:

- **Thread pools.** numpy's OpenBLAS (and any OpenMP runtime) starts one thread per core
  in every process that loads it; with several instance processes on few cores, each
  small matrix product wakes threads that compete with the other instances and spin:
  a small DLRM served by 2 instances went from p50 5.9 ms to 0.85 ms with one BLAS
  thread per instance. The rule is ``instances x threads <= cores``;
  :class:`~triton_rec.config.model_config.InstanceSettings` chooses the count (config.pbtxt
  ``intra_op_threads``, else ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS``/
  ``MKL_NUM_THREADS``, else 1). :func:`limit_thread_pools`.
- **Memory of large requests.** In Triton's Python-backend stub every temporary of a few
  MB was mapped fresh and returned to the kernel after each request (about 4,200 page
  faults and 10 ms of CPU per 1,024-sample DLRM request; none in a plain Python process
  running the same code). :func:`tune_allocator` keeps such memory in the process.
- **BLAS kernels.** numpy's OpenBLAS picks its kernels by CPU detection and can fall
  back to pre-AVX2 ones on a CPU it does not know (seen on a VM).
  :func:`server_blas_environment` names the right ones for the server's processes.
"""

from __future__ import annotations

import ctypes
import os
from typing import Dict, Iterable, Mapping, Optional

from triton_rec.config.model_config import THREAD_ENV_VARS


def limit_thread_pools(threads: int) -> Dict[str, str]:
    """Limit the BLAS and OpenMP pools of this process to ``threads`` threads.

    Libraries already loaded are limited now (threadpoolctl); libraries loaded later in
    this process see the same count through :data:`THREAD_ENV_VARS` (set where unset).
    onnxruntime has its own pool: the dense executors pass the count to its session.

    Returns ``{library: "<threads> thread(s)[, <kernel architecture>]"}`` of the pools
    found, for the load log. The architecture is worth reading: numpy's OpenBLAS picks
    its kernels by CPU detection, and on some virtual machines it falls back to slow
    generic ones (seen: ``Prescott`` on a Sapphire Rapids VM, where
    ``OPENBLAS_CORETYPE=Haswell`` in the server's environment made the DLRM's matrix
    products at 1,024 samples about 1.5x faster;
    benchmarks/history/2026-11-23-served-overhead-python-backend.md).
    """
    from threadpoolctl import threadpool_info, threadpool_limits

    threads = int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    for var in THREAD_ENV_VARS:
        os.environ.setdefault(var, str(threads))
    threadpool_limits(limits=threads)  # stays in force: never used as a context manager
    return {
        i.get("internal_api", "?"): f"{i['num_threads']} thread(s)"
        + (f", {i['architecture']}" if i.get("architecture") else "")
        for i in threadpool_info()
    }


#: OpenBLAS kernel sets without AVX2: on a CPU that has AVX2 they mean its detection failed.
_PRE_AVX2_KERNELS = frozenset(
    {
        "katmai",
        "coppermine",
        "northwood",
        "prescott",
        "banias",
        "core2",
        "penryn",
        "dunnington",
        "nehalem",
        "atom",
        "athlon",
        "opteron",
        "opteron_sse3",
        "barcelona",
        "bobcat",
        "sandybridge",
    }
)
_AVX512_FLAGS = ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset:
    """The instruction-set flags of the first CPU in ``cpuinfo`` (empty if unreadable)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def blas_coretype_fix(architecture: Optional[str], flags: Iterable[str]) -> Optional[str]:
    """The ``OPENBLAS_CORETYPE`` to set when OpenBLAS chose kernels older than the CPU
    (``architecture`` as threadpoolctl reports it), else None.

    Seen on a Sapphire Rapids VM: numpy's OpenBLAS 0.3.23 picked its ``Prescott`` (SSE3)
    kernels; the DLRM's dense network at 1,024 samples ran 1.5-1.7x slower than with
    ``Haswell``/``SkylakeX`` kernels
    (benchmarks/history/2026-11-23-served-overhead-python-backend.md).
    """
    if not architecture or architecture.lower() not in _PRE_AVX2_KERNELS:
        return None
    flags = frozenset(flags)
    if all(f in flags for f in _AVX512_FLAGS):
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def server_blas_environment(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """What a server launcher adds to the environment of tritonserver so that every
    instance process loads numpy's OpenBLAS with kernels for this CPU: ``{}`` unless
    OpenBLAS (as loaded by this process) chose pre-AVX2 kernels on an AVX2 CPU and
    ``OPENBLAS_CORETYPE`` is not set already (the user's choice always stands)."""
    environ = os.environ if environ is None else environ
    if "OPENBLAS_CORETYPE" in environ:
        return {}
    import numpy  # noqa: F401  (loads OpenBLAS)
    from threadpoolctl import threadpool_info

    arch = next(
        (i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"),
        None,
    )
    fix = blas_coretype_fix(arch, cpu_flags())
    return {"OPENBLAS_CORETYPE": fix} if fix else {}


# glibc's mallopt parameters (malloc.h) and what the instances set them to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Allocations below this come from the heap, not from a fresh mapping (glibc's maximum
#: for M_MMAP_THRESHOLD on 64-bit: 32 MiB).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap beyond this is returned to the kernel.
TRIM_THRESHOLD = 128 << 20


def tune_allocator(environ: Optional[Mapping[str, str]] = None) -> str:
    """Keep the memory of large temporaries in this process between requests (glibc).

    A request's arrays of a few MB (a 1,024-sample DLRM: keys, vectors, activations)
    are otherwise mapped fresh and unmapped after every request in a Python-backend
    stub: page faults and zeroing on each one. The fixed thresholds here make them
    come from the heap, reused request after request; the price is that an instance
    keeps up to about :data:`TRIM_THRESHOLD` of freed memory. Malloc settings given in
    ``GLIBC_TUNABLES`` are left alone. Returns what was done, for the load log.
    """
    environ = os.environ if environ is None else environ
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "malloc: GLIBC_TUNABLES settings kept"
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return "malloc: not glibc, unchanged"
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    return (
        f"malloc: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold "
        f"{TRIM_THRESHOLD >> 20} MiB"
        if ok
        else "malloc: mallopt refused, unchanged"
    )
