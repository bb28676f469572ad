"""Whole-model inference (the ``hugectr`` backend): embeddings + dense network -> predictions.

A :class:`RankingSession` answers HugeCTR-style requests (``DES``/``CATCOLUMN``/
``ROWINDEX``, see :mod:`triton_rec.serving.hugectr_request`): per table it looks the keys up
through the shared cache / node-local table (the same :class:`~triton_rec.serving.session.TableSet`
the ``hps`` backend uses: never a private copy), combines each slot's vectors with
the table's combiner (sum or mean, multi-hot slots allowed), and runs the dense
network on all samples at once.

Requests that reach one ``execute`` call are answered together: one lookup per table
and one dense forward pass for all their samples.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from triton_rec.cache.cached_table import DEFAULT_CAUSES
from triton_rec.config.ps_json import ModelParams
from triton_rec.dense import Combiner, DenseModel, combine_slots, to_host
from triton_rec.dense.graphs import DenseGraphs
from triton_rec.errors import ConfigError
from triton_rec.serving.hugectr_request import (
    HugeCTRRequest,
    parse_embedding_request,
    parse_hugectr_request,
)
from triton_rec.serving.native_plan import (
    NativePlan,
    gpu_entry,
    gpu_plan,
    plan_limits,
    table_plans,
)
from triton_rec.serving.session import TableSet


class RankingSession:
    """One model instance's whole-model session.

    Args:
        params: the model's ps.json entry (tables in the order of the network's
            embedding layers).
        tables: the instance's tables (shared caches, node-local stores).
        dense: the dense network.

    Raises:
        ConfigError: the tables do not match the network's embedding inputs.
    """

    def __init__(self, params: ModelParams, tables: TableSet, dense: DenseModel):
        specs = dense.tables
        if len(specs) != params.num_tables:
            raise ConfigError(
                f"model '{params.model}': the dense network has {len(specs)} embedding inputs "
                f"but ps.json names {params.num_tables} sparse files"
            )
        for i, (spec, tp) in enumerate(zip(specs, params.tables)):
            if spec.vec_size != tp.vec_size:
                raise ConfigError(
                    f"model '{params.model}': table {i} ('{tp.name}') has vec_size {tp.vec_size} "
                    f"in ps.json but {spec.vec_size} in the network"
                )
        self.params = params
        self.table_set = tables
        self.dense = dense
        self.slots = [int(s.slot_num) for s in specs]
        self.combiners = [s.combiner for s in specs]
        self._slot_array = np.asarray(self.slots, np.int64)  # what the native regrouping takes

    @property
    def cached_tables(self):
        """The session's :class:`~triton_rec.cached_table.CachedTable` objects, one per table."""
        return self.table_set.tables

    def input_limits(self, catcolumn_itemsize: int = 8):
        """The most elements each input of a valid request holds (see
        :data:`triton_rec.triton.request_loop.InputLimits`), from max_batch_size, the network's
        dense_dim and slots and the most keys per sample of each table."""
        return hugectr_input_limits(
            self.params.max_batch_size,
            self.dense,
            self.slots,
            keys_per_sample(self.params, self.dense),
            catcolumn_itemsize,
        )

    def parse_request(
        self, des: np.ndarray, catcolumn: np.ndarray, rowindex: np.ndarray
    ) -> HugeCTRRequest:
        """Validate one request (RequestError says what is wrong)."""
        return parse_hugectr_request(
            self.params.model,
            des,
            catcolumn,
            rowindex,
            self._slot_array,
            self.dense.dense_dim,
            self.params.max_batch_size,
        )

    def predict_many(self, requests: Sequence[HugeCTRRequest]) -> List[np.ndarray]:
        """Predictions for each request: float32 ``[num_samples]``, or
        ``[num_samples, label_dim]`` for label_dim > 1."""
        if not requests:
            return []
        if len(requests) == 1:  # the usual case at low load: nothing to concatenate
            r = requests[0]
            keys, ptrs, dense = r.keys, r.row_ptrs, r.dense
        else:
            key_parts: List[np.ndarray] = []
            ptr_parts: List[np.ndarray] = []
            for t in range(len(self.slots)):
                key_parts.append(np.concatenate([r.keys[t] for r in requests]))
                # Row pointers of all requests, shifted into the concatenated key array.
                shifted, offset = [np.zeros(1, np.int64)], 0
                for r in requests:
                    shifted.append(r.row_ptrs[t][1:] + offset)
                    offset += r.keys[t].shape[0]
                ptr_parts.append(np.concatenate(shifted))
            keys, ptrs = tuple(key_parts), tuple(ptr_parts)
            dense = np.concatenate([r.dense for r in requests], axis=0)
        embeddings = []
        exact = [r.exact for r in requests]
        defaults = np.zeros((len(requests), len(DEFAULT_CAUSES)), dtype=np.int64)
        for t, table in enumerate(self.cached_tables):
            vectors = np.empty((keys[t].shape[0], table.vec_size), dtype=np.float32)
            # the cache's hit rate is judged per request (None: one request)
            segments = [r.keys[t].shape[0] for r in requests] if len(requests) > 1 else None
            table.lookup(keys[t], vectors, segments, exact, defaults)
            embeddings.append(
                combine_slots(vectors, ptrs[t], self.combiners[t], slot_num=self.slots[t])
            )
        for r, d in zip(requests, defaults):
            r.defaults[:] = d
        # the dense model's array module may be CuPy: bring the prediction back to the host
        out = to_host(self.dense.predict(dense, embeddings)).astype(np.float32, copy=False)
        # upstream's shape [num_samples] (hugectr_backend src/hugectr.cc L2352-2373); with
        # label_dim > 1 [num_samples, label_dim] (upstream returns the first num_samples
        # floats of the sample-major buffer there, which mixes samples)
        shape = (-1,) if self.dense.label_dim == 1 else (-1, self.dense.label_dim)
        if len(requests) == 1:
            return [out.reshape(shape)]
        answers, pos = [], 0
        for r in requests:
            answers.append(np.ascontiguousarray(out[pos : pos + r.num_samples]).reshape(shape))
            pos += r.num_samples
        return answers

    def native_plan(self, key_itemsize: int = 8) -> Optional[NativePlan]:
        """What the native backend needs to answer this session's requests without
        Python, or None (a table needs Python for every lookup, or the dense network has
        no native program): the tables
        (:func:`~triton_rec.serving.native_plan.table_plans`), slots and combiner
        (``mean``) per table, ``dense_dim``, ``max_batch_size``, ``label_dim``, the most
        elements of each input (``limits``), CATCOLUMN's type and the network's native
        executor ``dense_net``
        (:meth:`~triton_rec.dense.hugectr_network.HugeCTRNetwork.native_net`)."""
        tables = table_plans(self.cached_tables)
        if tables is None:
            return None
        gpu = gpu_plan(tables)
        make_net = getattr(self.dense, "native_net", None)
        net = make_net() if make_net is not None else None
        # on a GPU: the network as CUDA graphs (DenseGraphs); on the host: its executor
        dense_gpu = self.dense.native_plan() if isinstance(self.dense, DenseGraphs) else None
        if (gpu is None and net is None) or (gpu is not None and dense_gpu is None):
            return None
        return NativePlan(
            kind="hugectr",
            tables=tables,
            max_batch_size=int(self.params.max_batch_size),
            gpu=gpu,
            dense_gpu=dense_gpu,
            slots=list(self.slots),
            mean=[Combiner(c) == Combiner.MEAN for c in self.combiners],
            dense_dim=int(self.dense.dense_dim),
            label_dim=int(self.dense.label_dim),
            limits=plan_limits(self.input_limits(key_itemsize), "CATCOLUMN"),
            dense_net=net,
            key_type="UINT32" if key_itemsize == 4 else "INT64",
        )

    def close(self) -> None:
        """Close the tables (caches, stores, background threads)."""
        self.table_set.close()


def keys_per_sample(params: Optional[ModelParams], dense: DenseModel) -> List[int]:
    """Most keys of each table in one valid sample: the largest of ps.json's
    ``maxnum_catfeature_query_per_table_per_sample`` and what the network declares
    (``max_feature_num_per_sample``, ``slot_num x nnz_per_slot``)."""
    out = []
    for t, spec in enumerate(dense.tables):
        bounds = [int(spec.slot_num)]
        if params is not None and t < params.num_tables:
            bounds.append(int(params.tables[t].max_keys_per_sample))
        if spec.max_feature_num_per_sample:
            bounds.append(int(spec.max_feature_num_per_sample))
        if spec.max_nnz:
            bounds.append(int(spec.slot_num) * int(spec.max_nnz))
        out.append(max(bounds))
    return out


def hugectr_input_limits(
    max_batch_size: int,
    dense: DenseModel,
    slots: Sequence[int],
    keys: Sequence[int],
    key_itemsize: int = 8,
    vec_sizes=None,
):
    """Input limits of the HugeCTR layout (``DES``, ``CATCOLUMN`` or, with ``vec_sizes``,
    the ensemble's ``EMBEDDINGS``, ``ROWINDEX``); see :meth:`RankingSession.input_limits`."""
    mbs, dim, total_slots = int(max_batch_size), int(dense.dense_dim), int(sum(slots))
    per_sample = int(sum(keys))
    limits = {
        "DES": (mbs * dim, 4, f"max_batch_size {mbs} x dense_dim {dim}"),
        "ROWINDEX": (
            mbs * total_slots + len(slots),
            4,
            f"max_batch_size {mbs} x {total_slots} slots + {len(slots)} tables",
        ),
    }
    if vec_sizes is None:
        limits["CATCOLUMN"] = (
            mbs * per_sample,
            key_itemsize,
            f"max_batch_size {mbs} x {per_sample} keys per sample",
        )
    else:
        floats = int(sum(k * v for k, v in zip(keys, vec_sizes)))
        limits["EMBEDDINGS"] = (
            mbs * floats,
            4,
            f"max_batch_size {mbs} x {floats} floats per sample",
        )
    return limits


class DenseSession:
    """The dense half of an ensemble: ``DES`` + the ``hps`` model's ``EMBEDDINGS`` +
    ``ROWINDEX`` -> predictions
    (see :func:`~triton_rec.serving.hugectr_request.parse_embedding_request`).

    Args:
        model: model name, for messages.
        dense: the dense network.
        max_batch_size: most samples one request may hold.
    """

    def __init__(
        self,
        model: str,
        dense: DenseModel,
        max_batch_size: int,
        params: Optional[ModelParams] = None,
    ):
        self.model = model
        self.dense = dense
        self.max_batch_size = int(max_batch_size)
        self.slots = [int(t.slot_num) for t in dense.tables]
        self.vec_sizes = [int(t.vec_size) for t in dense.tables]
        self.params = params

    def input_limits(self):
        """The most elements each input of a valid request holds (``DES``,
        ``EMBEDDINGS``, ``ROWINDEX``), as :meth:`RankingSession.input_limits`."""
        return hugectr_input_limits(
            self.max_batch_size,
            self.dense,
            self.slots,
            keys_per_sample(self.params, self.dense),
            vec_sizes=self.vec_sizes,
        )

    def parse_request(self, des: np.ndarray, embeddings: np.ndarray, rowindex: np.ndarray):
        """Validate one request (RequestError says what is wrong)."""
        return parse_embedding_request(
            self.model,
            des,
            embeddings,
            rowindex,
            self.slots,
            self.vec_sizes,
            self.dense.dense_dim,
            self.max_batch_size,
        )

    def predict_many(self, requests) -> List[np.ndarray]:
        """Predictions for each parsed request, one dense forward pass for all of them."""
        if not requests:
            return []
        combined = []
        for t, spec in enumerate(self.dense.tables):
            per_request = [
                combine_slots(r[2][t], r[3][t], spec.combiner, slot_num=self.slots[t])
                for r in requests
            ]
            combined.append(np.concatenate(per_request, axis=0))
        dense = np.concatenate([r[1] for r in requests], axis=0)
        out = to_host(self.dense.predict(dense, combined)).astype(np.float32, copy=False)
        answers, pos = [], 0
        for r in requests:
            answers.append(np.ascontiguousarray(out[pos : pos + r[0]]).reshape(-1))
            pos += r[0]
        return answers

    def native_plan(self) -> Optional[NativePlan]:
        """What the native backend needs to answer this session's requests without Python
        (``kind`` ``dense``: no tables; per table its slots, combiner and vector width,
        ``dense_dim``, ``label_dim``, ``max_batch_size``, the most elements of each input
        and the network's native executor ``dense_net``), or None when the network has no
        native program
        (ONNX): then Python answers. A network on a GPU (:class:`DenseGraphs`) adds the
        ``gpu`` entry and its graphs (``dense_gpu``): the native path combines the slots
        and runs the graph of a batch on the GPU, and a batch of at most its
        ``host_max_batch`` samples on the host with ``dense_net``, as ``hugectr``'s does."""
        make_net = getattr(self.dense, "native_net", None)
        net = make_net() if make_net is not None else None
        graphs = self.dense if isinstance(self.dense, DenseGraphs) else None
        if net is None and graphs is None:
            return None
        return NativePlan(
            kind="dense",
            tables=[],
            max_batch_size=self.max_batch_size,
            slots=list(self.slots),
            mean=[Combiner(t.combiner) == Combiner.MEAN for t in self.dense.tables],
            vec_sizes=list(self.vec_sizes),
            dense_dim=int(self.dense.dense_dim),
            label_dim=int(self.dense.label_dim),
            limits=plan_limits(self.input_limits(), "EMBEDDINGS"),
            dense_net=net,
            gpu=gpu_entry(graphs.device) if graphs is not None else None,
            dense_gpu=graphs.native_plan() if graphs is not None else None,
        )

    def close(self) -> None:
        """Nothing to release (the dense network lives as long as the session)."""
        pass
