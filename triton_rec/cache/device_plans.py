"""What the native backend's GPU path reads a table on a GPU with: the parts of a native
plan (:mod:`triton_rec.serving.native_plan`) that the GPU caches fill, each built in one
place. Their fields are the names the C++ reads them by (``src/native/plan_fields.hpp``,
exported as ``triton_rec._native.PLAN_FIELDS``; tests/unit/test_native_plan.py holds the
two equal)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass
class DeviceCachePlan:
    """A device cache as the kernels read it
    (:meth:`~triton_rec.cache.array_cache.ArrayEmbeddingCache.native_plan`): its state
    arrays' device addresses by name (``keys``, ``valid``, ``ticks``, ``vectors``, ``seq``,
    ``meta``, and ``sketch`` with ``tinylfu``) and its geometry, as
    :class:`triton_rec._native.CacheView` takes them."""

    arrays: Dict[str, int]
    num_sets: int
    ways: int
    dim: int
    precision: int  # the rows' RowCodec.code
    policy: int  # the index of the cache's policy in POLICIES
    sketch_width: int


@dataclass
class DeviceTablePlan:
    """A whole table on a GPU (``static``, ``uvm``) as the kernels read it
    (:meth:`~triton_rec.cache.device_table.DeviceTableCache.device_plan`, from the native
    ``DeviceTable.plan``): its index slots' address and capacity, its rows' address and
    count."""

    slots: int
    capacity: int
    vectors: int
    rows: int


@dataclass
class DevicePlacement:
    """Where a table's cache puts the table for the GPU path: its device and either a
    device cache or a whole table there (the ``device``, ``device_cache`` and
    ``device_table`` of its :class:`~triton_rec.serving.native_plan.TablePlan`)."""

    device: int
    device_cache: Optional[DeviceCachePlan] = None
    device_table: Optional[DeviceTablePlan] = None
