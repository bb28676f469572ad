"""How a model instance gets its lookup session: node-local tables and the shared caches.

Every Triton model instance is its own process. For one model on one node:

- each table is converted once into the node-local store (``ps_loader.node_store``) and
  memory-mapped read-only by every instance: the page cache holds one copy;
- each table has ONE embedding cache per device, shared by every instance on it:
  on CPU a shared-memory segment (:mod:`triton_rec.shm_cache`, native code), on a GPU
  device arrays shared through CUDA IPC (:mod:`triton_rec.gpu_share`, CuPy; not run on
  GPU hardware yet). The first instance creates it, the others attach;
- each instance has its own :class:`~triton_rec.session.LookupSession`, background
  inserter and refresher.

The cache of a table is named ``<model>.<device>.<table>.<content digest prefix>``, so
a new model version with new table content gets a fresh cache, and several servers on
one node serving the same content share one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from ps_loader import node_store
from triton_rec.config import ModelParams, TableParams
from triton_rec.session import LookupSession, TableSet
from triton_rec.table import EmbeddingTable


@dataclass(frozen=True)
class InstanceSpec:
    """Where an instance runs and how it loads.

    Args:
        kind: ``"CPU"`` or ``"GPU"`` (Triton's ``model_instance_kind``).
        device_id: GPU id for GPU instances (ignored on CPU).
        store_dir: node-local store directory (None: ``TRITON_REC_STORE`` or the default).
        prefault: make every page of the tables resident before serving.
        cache_dir: directory of the CPU cache segments (``/dev/shm``).
    """

    kind: str = "CPU"
    device_id: int = 0
    store_dir: Optional[str] = None
    prefault: bool = True
    cache_dir: str = "/dev/shm"

    @property
    def device(self) -> str:
        return f"gpu{self.device_id}" if self.kind.upper() == "GPU" else "cpu"


def cache_capacity(params: ModelParams, table: EmbeddingTable) -> int:
    """Rows of a table's cache: ``gpucacheper`` of its rows (0 means no cache)."""
    if not params.gpucache or params.gpucacheper <= 0:
        return 0
    return max(1, math.ceil(params.gpucacheper * table.num_rows))


def cache_name(params: ModelParams, spec: InstanceSpec, tp: TableParams, table: EmbeddingTable) -> str:
    layout = getattr(table, "layout_path", None) or table.path
    digest = os.path.splitext(os.path.basename(layout))[0][:16]
    return f"{params.model}.{spec.device}.{tp.name}.{digest}"


def open_session(params: ModelParams, spec: InstanceSpec = InstanceSpec()) -> LookupSession:
    """An ``hps`` lookup session over :func:`open_tables`."""
    ts = open_tables(params, spec)
    return LookupSession(params, ts.tables, ts.inserter, ts.refresher)


def open_tables(params: ModelParams, spec: InstanceSpec = InstanceSpec()) -> TableSet:
    """Load the model's tables from the node-local store and attach the shared caches."""

    def load(tp: TableParams) -> EmbeddingTable:
        return node_store.load_table(tp, spec.store_dir, prefault=spec.prefault)

    def open_cache(tp: TableParams, table: EmbeddingTable):
        capacity = cache_capacity(params, table)
        if capacity == 0:
            return None
        name = cache_name(params, spec, tp, table)
        if spec.device == "cpu":
            from triton_rec.shm_cache import SharedEmbeddingCache

            return SharedEmbeddingCache.open(
                name, capacity, table.vec_size, policy=params.cache_policy,
                ways=params.cache_ways, directory=spec.cache_dir,
            )
        from triton_rec.gpu_share import open_shared_cache

        shared = open_shared_cache(
            name, capacity, table.vec_size, ways=params.cache_ways, policy=params.cache_policy,
            device=spec.device_id,
        )
        return shared

    return TableSet.open(params, load_table=load, open_cache=open_cache)
