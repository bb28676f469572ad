"""Thread pools sized for a node where every model instance is its own process.

numpy's OpenBLAS (and any OpenMP runtime) starts one thread per core in every process
that loads it. With several instance processes on few cores, each small matrix product
wakes threads that compete with the other instances and spin while they wait:
measured on 2 cores, a small DLRM served by 2 instances went from p50 5.9 ms to 0.85 ms
with one BLAS thread per instance. The rule is ``instances x threads <= cores``;
:class:`~triton_rec.model_config.InstanceSettings` chooses the count (config.pbtxt
``intra_op_threads``, else ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS``/
``MKL_NUM_THREADS``, else 1).
"""

from __future__ import annotations

import os
from typing import Dict

from triton_rec.model_config import THREAD_ENV_VARS


def limit_thread_pools(threads: int) -> Dict[str, int]:
    """Limit the BLAS and OpenMP pools of this process to ``threads`` threads.

    Libraries already loaded are limited now (threadpoolctl); libraries loaded later in
    this process see the same count through :data:`THREAD_ENV_VARS` (set where unset).
    onnxruntime has its own pool: the dense executors pass the count to its session.

    Returns ``{library: threads}`` of the pools found, for the load log.
    """
    from threadpoolctl import threadpool_info, threadpool_limits

    threads = int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    for var in THREAD_ENV_VARS:
        os.environ.setdefault(var, str(threads))
    threadpool_limits(limits=threads)  # stays in force: never used as a context manager
    return {i.get("internal_api", "?"): int(i["num_threads"]) for i in threadpool_info()}
