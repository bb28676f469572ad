"""``static`` and ``uvm`` tables on a GPU: the whole node-local table where the kernel reads it.

HPS's static embedding cache holds a whole table in GPU memory, its UVM cache keeps it
in host memory the GPU reads; both answer every stored key exactly
(docs/upstream-notes.md, "Embedding cache types"). A KIND_GPU instance of such a model
gets a :class:`DeviceTableCache` for each node-local table instead of the set-associative
device cache: the table's index (the node store's layout, ``hash_index.hpp``) and rows
copied once into device memory (``static``) or into pinned host memory mapped into the
device (``uvm``), looked up by ``trec_lookup_tables`` (one launch for all of a request's
tables).

One copy per (table content, device, mode) in a process, shared by its instances (the
native backend runs every instance in one process); counted, freed with the last.
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Tuple

import numpy as np

from triton_rec import _native
from triton_rec.cache.device_plans import DevicePlacement, DeviceTablePlan
from triton_rec.gpu import SETUP_LOCK
from triton_rec.precision import RowCodec
from triton_rec.storage.table import EmbeddingTable

log = logging.getLogger(__name__)

#: ps.json ``embedding_cache_type`` values served by a DeviceTableCache on a GPU
DEVICE_TABLE_MODES = ("static", "uvm")
#: the alignment of the rows after the index in a table's one allocation
#: (``gpu::align256`` in src/native/gpu_ops.hpp)
_ALIGN = 256


def device_table_bytes(n_rows: int, codec: RowCodec) -> int:
    """The one allocation of a whole table on a GPU (``_native.DeviceTable``): its hash
    index (16 bytes a slot, ``_native.index_capacity`` slots), aligned to 256 bytes, then
    its encoded rows. Device memory for ``static``, pinned host memory for ``uvm``. The
    node plan (:mod:`triton_rec.serving.sizing`) uses this rule; the native table sizes its
    allocation the same way, and :class:`DeviceTableCache` checks the two agree."""
    index = 16 * int(_native.index_capacity(int(n_rows)))
    return -(-index // _ALIGN) * _ALIGN + int(n_rows) * codec.row_bytes


_lock = threading.Lock()
_shared: Dict[Tuple[str, int, str], list] = {}  # key -> [DeviceTable, users]


class DeviceTableCache:
    """A whole table on a GPU behind the ``EmbeddingCache`` protocol of
    :mod:`triton_rec.cache.cached_table` (numpy in, numpy out).

    Args:
        table: the node-local table (its index and encoded rows).
        mode: ``"static"`` (device memory) or ``"uvm"`` (pinned host memory).
        device: the CUDA device.
    """

    #: it holds every row of its table (:class:`~triton_rec.serving.session.TableSet` makes
    #: its table exact: a miss is a key no tier holds)
    whole = True

    def __init__(self, table: EmbeddingTable, mode: str, device: int):
        from triton_rec.gpu.kernels import load_kernels

        if mode not in DEVICE_TABLE_MODES:
            raise ValueError(f"mode must be one of {DEVICE_TABLE_MODES}, got {mode!r}")
        self.mode, self.device = mode, int(device)
        self.codec = table.codec
        self.vec_size = int(table.codec.dim)
        self.capacity = int(table.keys.shape[0])
        self.policy = mode
        self._index, self._table_keys = table.index, table.keys
        self._key = (getattr(table, "layout_path", None) or table.path, self.device, mode)
        with _lock:
            entry = _shared.get(self._key)
            if entry is None:
                with SETUP_LOCK:  # not while another thread captures a graph
                    dt = _native.DeviceTable(
                        load_kernels(self.device),
                        table.index,
                        np.ascontiguousarray(table.vectors),
                        table.codec.code,
                        self.vec_size,
                        float(table.default_value),
                        mode,
                    )
                entry = _shared[self._key] = [dt, 0]
                planned = device_table_bytes(self.capacity, self.codec)
                if int(dt.nbytes) != planned:  # the plan's rule no longer the native one's
                    log.warning(
                        "%s table %s on GPU %d: %d bytes allocated, the plan's rule says %d",
                        mode,
                        self._key[0],
                        self.device,
                        int(dt.nbytes),
                        planned,
                    )
            entry[1] += 1
        self._table = entry[0]
        self._closed = False
        self._stats = dict.fromkeys(("lookups", "hits", "misses"), 0)

    def query(self, keys: np.ndarray, out: np.ndarray, hit_mask: np.ndarray) -> int:
        """``out[i]`` = the vector of ``keys[i]`` (the default value where the table lacks
        it: ``hit_mask[i] = 0``); returns the keys found."""
        k = np.ascontiguousarray(keys, dtype=np.int64)
        status = hit_mask if hit_mask.dtype == np.uint8 else np.empty(k.shape[0], np.uint8)
        absent = int(self._table.lookup(k, out, status))
        if status is not hit_mask:
            hit_mask[:] = status
        n = int(k.shape[0])
        self._stats["lookups"] += n
        self._stats["hits"] += n - absent
        self._stats["misses"] += absent
        return n - absent

    def insert(self, keys: np.ndarray, vectors: np.ndarray) -> Dict[str, int]:
        """Nothing to insert: the table is whole (keys it lacks are in no tier either)."""
        return {"inserted": 0}

    def update(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Overwrite the rows of the ``keys`` the table holds (online updates); returns how
        many it holds."""
        k = np.ascontiguousarray(keys, dtype=np.int64)
        rows = np.empty(k.shape[0], np.int64)
        _native.probe(self._index, k, rows)
        held = rows >= 0
        if held.any():
            self._table.write_rows(
                np.ascontiguousarray(rows[held]), np.ascontiguousarray(vectors[held])
            )
        return int(np.count_nonzero(held))

    def keys(self) -> np.ndarray:
        """Every key of the table."""
        return self._table_keys

    def size(self) -> int:
        """Rows held: the whole table."""
        return self.capacity

    def stats(self) -> Dict[str, int]:
        """This process's lookups, hits and misses (keys the table lacks), and the size."""
        return dict(self._stats, size=self.capacity)

    def memory_use(self) -> Tuple[str, int]:
        """``(where, bytes)`` of the table's copy: ``gpu<N>`` (static) or ``pinned``
        (uvm: page-locked host memory the GPU reads)."""
        where = "pinned" if self.mode == "uvm" else f"gpu{self.device}"
        return where, int(self._table.nbytes) if self._table is not None else 0

    def device_plan(self) -> DevicePlacement:
        """What the native backend's GPU path reads the table with: its device and
        ``device_table`` (the native table's addresses, by the names the C++ reads)."""
        return DevicePlacement(self.device, device_table=DeviceTablePlan(**self._table.plan()))

    def close(self) -> None:
        """Drop this instance's use; the copy is freed with the last."""
        if self._closed:
            return
        self._closed = True
        with _lock:
            entry = _shared.get(self._key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del _shared[self._key]
        self._table = None
