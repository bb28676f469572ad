"""The native plan: what the native backend (``src/triton_backend/trec/``)
answers one model instance's requests with, without Python. Defined here once, typed:

- the sessions fill it (:meth:`~triton_rec.serving.session.LookupSession.native_plan`,
  :meth:`~triton_rec.serving.ranking.RankingSession.native_plan`,
  :meth:`~triton_rec.serving.ranking.DenseSession.native_plan`), each table through
  :func:`table_plans`;
- the backend's ``model.py`` names the response (:meth:`NativePlan.responding`);
- the C++ reads it field by field (``read_plan``), by the names of
  ``src/native/plan_fields.hpp``, which ``triton_rec._native.PLAN_FIELDS`` exports and
  tests/unit/test_native_plan.py holds equal to these dataclasses' fields
  (:data:`PLAN_TYPES`); a plan that lacks a field, or holds one of the wrong type, fails
  the model's load naming it.

Every part is a dataclass built in one place: :class:`TablePlan` (:func:`table_plans`),
:class:`GpuPlan` (:func:`gpu_entry`), :class:`PlanLimits` (:func:`plan_limits`),
:class:`~triton_rec.cache.device_plans.DeviceCachePlan` and
:class:`~triton_rec.cache.device_plans.DeviceTablePlan` (by the caches,
``device_plan``), :class:`~triton_rec.dense.graphs.DenseGpuPlan`
(:meth:`~triton_rec.dense.graphs.DenseGraphs.native_plan`).

Addresses point into what the instance's tables own (caches, the node store's mappings,
statistics, the misses' handlers): valid while the instance's session is open.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from triton_rec.cache.cached_table import CachedTable
from triton_rec.cache.device_plans import DeviceCachePlan, DevicePlacement, DeviceTablePlan
from triton_rec.cache.shm_cache import SharedEmbeddingCache
from triton_rec.dense.graphs import DenseGpuPlan

#: The interfaces the native backend answers: ``hps`` (KEYS/NUMKEYS), ``hugectr``
#: (DES/CATCOLUMN/ROWINDEX), ``dense`` (DES/EMBEDDINGS/ROWINDEX, no tables).
PLAN_KINDS = ("hps", "hugectr", "dense")

#: (address, count): a mapped array as the C++ reads it
Span = Tuple[int, int]


@dataclass
class TablePlan:
    """How the native path reads one table. Exactly one of ``cache`` (a CPU shared cache:
    base address and bytes), ``device_cache`` / ``device_table`` (on a GPU, with
    ``device``) or ``index`` + ``vectors`` (the node-local table without a cache: index
    address and capacity, rows address and count). A cache names its miss handler:
    ``misses`` (the address of its :class:`~triton_rec._native.LocalMisses`, a node-local
    table: answered in C++) or ``finish`` (:meth:`CachedTable.native_finish`, called with
    the GIL)."""

    vec_size: int
    precision: int  # the rows' RowCodec.code
    default_value: float
    stats: int  # address of its NATIVE_FIELDS counters (TableStats.native)
    cache: Optional[Span] = None
    index: Optional[Span] = None
    vectors: Optional[Span] = None
    device: Optional[int] = None
    device_cache: Optional[DeviceCachePlan] = None  # ArrayEmbeddingCache.native_plan
    device_table: Optional[DeviceTablePlan] = None  # DeviceTableCache.device_plan
    misses: Optional[int] = None
    finish: Optional[Callable[..., Tuple[int, int]]] = None


@dataclass
class GpuPlan:
    """The GPU a plan's tables and network live on: its device and the kernels' module
    (:func:`triton_rec.gpu.kernels.plan_image`), which the native backend loads there."""

    device: int
    image: bytes


@dataclass
class PlanLimits:
    """The most elements of each input of a valid hugectr or dense request
    (:data:`triton_rec.triton.request_loop.InputLimits`): ``DES``, the second input
    (``CATCOLUMN`` of hugectr, ``EMBEDDINGS`` of dense) and ``ROWINDEX``."""

    des: int
    cat: int
    rows: int


@dataclass
class NativePlan:
    """What one instance's requests are answered with (see the module docstring)."""

    kind: str  # one of PLAN_KINDS
    tables: List[TablePlan]
    max_batch_size: int
    #: the response: the output's name, the INT32 info outputs declared, DeviceID
    output: str = "OUTPUT0"
    info_outputs: List[str] = field(default_factory=list)
    device_id: int = 0
    #: tables (or the network) on a GPU: the device and the kernels' module; None on the host
    gpu: Optional[GpuPlan] = None
    #: hps: the most keys per sample of each table
    maxnum: List[int] = field(default_factory=list)
    #: hugectr and dense: per table its slots and combiner (mean), the network's shape,
    #: the most elements of each input, the network's native executor (a
    #: ``triton_rec._native.DenseNet``: HugeCTRNetwork.native_net)
    slots: List[int] = field(default_factory=list)
    mean: List[bool] = field(default_factory=list)
    dense_dim: int = 0
    label_dim: int = 1
    limits: Optional[PlanLimits] = None
    dense_net: Any = None
    #: hugectr: CATCOLUMN's type (INT64 or UINT32); the network as CUDA graphs on a GPU
    key_type: str = "INT64"
    dense_gpu: Optional[DenseGpuPlan] = None
    #: dense: the width of each table's vectors in EMBEDDINGS
    vec_sizes: List[int] = field(default_factory=list)

    def __post_init__(self):
        if self.kind not in PLAN_KINDS:
            raise ValueError(f"native plan kind must be one of {PLAN_KINDS}, got {self.kind!r}")

    def responding(self, output: str, info_outputs: Sequence[str], device_id: int) -> NativePlan:
        """This plan answering with the model's response names and ``DeviceID``
        (:meth:`triton_rec.triton.request_loop.Responder.native_fields`)."""
        return dataclasses.replace(
            self, output=output, info_outputs=list(info_outputs), device_id=int(device_id)
        )


def table_plans(tables: Sequence[CachedTable]) -> Optional[List[TablePlan]]:
    """Per table, what the native path reads it with (:class:`TablePlan`), or None if a
    table needs Python for every lookup (a tier store without a cache in front)."""
    out = []
    for ct in tables:
        plan = TablePlan(
            vec_size=int(ct.vec_size),
            precision=int(ct.codec.code),
            default_value=float(ct.default_value),
            stats=int(ct.stats.native.ctypes.data),
        )
        device_plan = getattr(ct.cache, "device_plan", None)
        gpu: Optional[DevicePlacement] = device_plan() if device_plan is not None else None
        if ct.cache is not None:  # the misses: in C++ (a node-local table) or in Python
            if ct.local_misses is not None:
                plan.misses = int(ct.local_misses.address)
            else:
                plan.finish = ct.native_finish
        if isinstance(ct.cache, SharedEmbeddingCache):
            plan.cache = ct.cache.native_address()
        elif gpu is not None:
            plan.device = int(gpu.device)
            plan.device_cache, plan.device_table = gpu.device_cache, gpu.device_table
        elif ct.cache is None and (table := ct.store.native_table()) is not None:
            index, vectors = table
            plan.index = (int(index.ctypes.data), int(index.shape[0]))
            plan.vectors = (int(vectors.ctypes.data), int(vectors.shape[0]))
        else:  # a device cache in host memory, or a tier store without a cache
            return None
        out.append(plan)
    return out


def gpu_plan(tables: Sequence[TablePlan]) -> Optional[GpuPlan]:
    """The ``gpu`` entry of a plan whose tables live on a GPU: the device and the kernels'
    module (:func:`triton_rec.gpu.kernels.plan_image`); None for host tables, and for
    tables on several devices or some on the host (then Python answers)."""
    devices = {t.device for t in tables if t.device is not None}
    if not devices:
        return None
    if len(devices) > 1 or any(t.device is None for t in tables):
        return None
    (device,) = devices
    return gpu_entry(int(device))


def gpu_entry(device: int) -> GpuPlan:
    """The ``gpu`` entry of a plan that runs on GPU ``device``: the device and the
    kernels' module (:func:`triton_rec.gpu.kernels.plan_image`)."""
    from triton_rec.gpu.kernels import plan_image

    return GpuPlan(device=int(device), image=plan_image(int(device)))


def plan_limits(input_limits: Mapping[str, Tuple[int, ...]], cat: str) -> PlanLimits:
    """The plan's :class:`PlanLimits` from a session's ``input_limits()`` (per input its
    most elements first), ``cat`` naming the second input (``CATCOLUMN`` or
    ``EMBEDDINGS``)."""
    return PlanLimits(
        des=int(input_limits["DES"][0]),
        cat=int(input_limits[cat][0]),
        rows=int(input_limits["ROWINDEX"][0]),
    )


#: Every dataclass of a native plan by the name the C++ knows it by
#: (``triton_rec._native.PLAN_FIELDS``: the fields it reads of each).
PLAN_TYPES: Dict[str, type] = {
    t.__name__: t
    for t in (
        NativePlan,
        TablePlan,
        GpuPlan,
        DeviceCachePlan,
        DeviceTablePlan,
        DenseGpuPlan,
        PlanLimits,
    )
}
