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
