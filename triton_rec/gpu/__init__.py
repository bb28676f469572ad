"""The GPU layer: kernels compiled at run time, and what drives them.

- :mod:`triton_rec.gpu.nvrtc`: NVRTC through ctypes (the library of PyPI's
  ``nvidia-cuda-nvrtc-cu12``/``-cu13`` wheels, CuPy's or the system's): CUDA C++ source ->
  PTX, with no CUDA toolkit and no device.
- :mod:`triton_rec.gpu.kernels`: the kernels' sources (``src/native/kernels/*.cu`` and the
  headers they share with the native core, embedded in ``_native`` at build time), compiled
  for a device or an architecture, cached; :func:`~triton_rec.gpu.kernels.load_kernels`
  loads them on a device for the engine (``_native.GpuKernels``).

(A HugeCTR network's forward pass captured as CUDA graphs is a dense executor:
:mod:`triton_rec.dense.graphs`.)

The kernels run through the CUDA driver API that ``_native`` loads at run time
(``src/native/cuda_driver.hpp``); CuPy allocates the device arrays and shares them
between processes (CUDA IPC). Everything here imports on a machine without CUDA.
"""

import threading

#: One GPU set-up at a time in a process: a network's captures and calibration
#: (:class:`~triton_rec.dense.graphs.DenseGraphs`), a device cache's creation or attachment
#: (:mod:`triton_rec.cache.gpu_share`), a table copied to the device
#: (:class:`~triton_rec.cache.device_table.DeviceTableCache`). Triton loads models,
#: and each model's instances, on parallel threads; CUDA work of one thread (allocations,
#: frees, memsets, module loads) can break a stream capture in progress on another, which
#: showed on an H200 as ``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`` at the end of a capture
#: and as ``cublasSgemm failed: cuBLAS status 13`` inside one
#: (benchmarks/history/2026-11-26-gpu-path-h200.md, issue 23). Re-entrant: a set-up may
#: call another.
SETUP_LOCK = threading.RLock()
