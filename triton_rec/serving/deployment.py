"""How a model instance gets its lookup session: node-local tables and the shared caches.

Every Triton model instance is its own process. For one model on one node:

- each table is converted once into the node-local store (``triton_rec.storage.node_store``) and
  memory-mapped read-only by every instance: the page cache holds one copy;
- each table has ONE embedding cache per device, shared by every instance on it:
  on CPU a shared-memory segment (:mod:`triton_rec.cache.shm_cache`, native code), on a GPU
  device arrays shared through CUDA IPC (:mod:`triton_rec.cache.gpu_share`, CuPy; not run on
  GPU hardware yet). The first instance creates it, the others attach;
- each instance has its own :class:`~triton_rec.serving.session.LookupSession`, background
  inserter and refresher.

The cache of a table is named ``<model>.<device>.<table>.<content digest prefix>``, so
a new model version with new table content gets a fresh cache; it lives in the private
shared-memory namespace of the node store holding the table (:func:`shm_namespace`), so
servers with the same store share it and servers with different stores never do. A
device (GPU) cache's name also carries the model version and the server process
(:func:`cache_name`): its memory belongs to the instance process that created it and is
freed when that one exits, so another version or another server must never attach to it.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Tuple

import numpy as np

from triton_rec.cache.device_table import (
    DEVICE_TABLE_MODES,
    DeviceTableCache,
    device_table_bytes,
)
from triton_rec.config.model_config import InstanceSettings
from triton_rec.config.model_files import confine
from triton_rec.config.ps_json import (
    EmbeddingCacheType,
    ModelParams,
    TableParams,
    model_relative_path,
)
from triton_rec.errors import ConfigError
from triton_rec.serving.session import LookupSession, TableSet
from triton_rec.storage import node_store
from triton_rec.storage.backing_store import BackingStore, LocalTableStore, tier_table_name
from triton_rec.storage.table import EmbeddingTable
from triton_rec.storage.tiers import SOURCE_META, Tier, TieredStore, import_table
from triton_rec.util.procfs import start_time

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InstanceSpec:
    """Where an instance runs and how it loads.

    Args:
        kind: ``"CPU"`` or ``"GPU"`` (Triton's ``model_instance_kind``).
        device_id: GPU id for GPU instances (ignored on CPU).
        store_dir: node-local store directory (None: ``TRITON_REC_STORE`` or the default).
        prefault: make every page of the tables resident before serving.
        cache_dir: directory of the CPU cache segments and a GPU cache's shared files
            (None: :func:`~triton_rec.cache.shm_cache.shm_dir`, ``$TRITON_REC_SHM_DIR`` or
            ``/dev/shm``).
        intra_op_threads: threads of the dense executor's own pool (onnxruntime).
        model_version: the version being loaded (Triton's ``model_version``); part of
            a device cache's name.
        dense_math: the arithmetic of the dense layers on a GPU
            (:data:`~triton_rec.config.model_config.DENSE_MATHS`).
    """

    kind: str = "CPU"
    device_id: int = 0
    store_dir: Optional[str] = None
    prefault: bool = True
    cache_dir: Optional[str] = None
    intra_op_threads: int = InstanceSettings.intra_op_threads
    model_version: str = ""
    dense_math: str = InstanceSettings.dense_math

    @property
    def device(self) -> str:
        """The cache's device name: ``cpu`` or ``gpu<device_id>``."""
        return f"gpu{self.device_id}" if self.kind.upper() == "GPU" else "cpu"


def undeployed_devices(params: ModelParams, devices: Iterable[int]) -> List[str]:
    """HPS's rule for KIND_GPU instances of a model with tables: they run only on GPUs of
    ps.json's ``deployed_device_list`` (hps backend ``src/model_state.cpp``,
    ``ModelState::Create_EmbeddingCache``: every GPU of the instance groups, cache or not).
    Upstream's message for each of ``devices`` not listed."""
    listed = list(params.deployed_device_list)
    return [
        f"Please confirm that device {d} is added to 'deployed_device_list' in the ps "
        f"configuration file (it lists {listed})"
        for d in sorted({int(d) for d in devices})
        if d not in listed
    ]


def check_deployed(params: ModelParams, spec: InstanceSpec) -> None:
    """ConfigError (the model named) for a KIND_GPU instance on a GPU that ps.json's
    ``deployed_device_list`` lacks (:func:`undeployed_devices`): before the instance
    opens anything, its dense network included."""
    gpus = [spec.device_id] if spec.device != "cpu" else []
    for undeployed in undeployed_devices(params, gpus):
        raise ConfigError(f"model '{params.model}': {undeployed}")


def caches_enabled(params: ModelParams) -> bool:
    """Whether the model's tables get an embedding cache (``gpucache`` and a positive
    ``gpucacheper``, or a ``static`` cache, which ignores ``gpucacheper``); on a KIND_GPU
    instance that cache is the device cache."""
    if not params.gpucache:
        return False
    return params.gpucacheper > 0 or params.embedding_cache_type == EmbeddingCacheType.STATIC


def cache_rows(params: ModelParams, num_rows: int) -> int:
    """Rows of the cache of a table of ``num_rows`` rows: ``gpucacheper`` of them (0
    means no cache); a ``static`` table's cache holds all of them, as HPS's static table
    does (gpucacheper ignored, static_table.cpp L28-106). The one rule: the caches opened
    here and the node plan (:mod:`triton_rec.serving.sizing`) use it."""
    if not caches_enabled(params):
        return 0
    if params.embedding_cache_type == EmbeddingCacheType.STATIC:
        return max(1, int(num_rows))
    return max(1, math.ceil(params.gpucacheper * int(num_rows)))


def device_table_mode(params: ModelParams, num_rows: int, codec) -> Optional[str]:
    """How a KIND_GPU instance holds a table whole, or None (a cache of :func:`cache_rows`
    rows, or no cache): ``static``/``uvm`` when the model's ``embedding_cache_type`` says so;
    ``static`` for a ``dynamic`` cache's table whose whole copy
    (:func:`~triton_rec.cache.device_table.device_table_bytes`: index and rows) is at most
    ps.json's ``whole_table_max_bytes`` (our extension; 0 never), since a small table's
    cache of ``gpucacheper`` of its rows holds fewer rows than its requests use and misses
    on every one (benchmarks/history/2026-11-27-criteo-dlrm-on-an-h200.md). Never for a
    model whose tables live in Redis/RocksDB tiers (a whole table is node-local). The one
    rule: the caches opened here and the node plan (:mod:`triton_rec.serving.sizing`) use
    it."""
    if not caches_enabled(params) or uses_tiers(params):
        return None
    if params.embedding_cache_type.value in DEVICE_TABLE_MODES:
        return params.embedding_cache_type.value
    limit = params.whole_table_max_bytes
    if limit > 0 and device_table_bytes(int(num_rows), codec) <= limit:
        return EmbeddingCacheType.STATIC.value
    return None


def cache_capacity(params: ModelParams, table: EmbeddingTable) -> int:
    """Rows of a table's cache (:func:`cache_rows` of its rows)."""
    return cache_rows(params, table.num_rows)


def server_token() -> str:
    """The serving process, as a name part: ``<pid>-<start time>`` (hex) of this process's
    parent, the Triton server for a Python-backend instance. Every instance of one
    server agrees on it; another server, or the same one restarted, differs."""
    ppid = os.getppid()
    return f"{ppid:x}-{start_time(ppid):x}"


def cache_name(
    params: ModelParams, spec: InstanceSpec, tp: TableParams, table: EmbeddingTable
) -> str:
    """Name of a table's shared cache: model, device, table and the digest of its layout file.

    A device cache (GPU) is owned by the instance process that created it and its memory
    goes with that process (:mod:`triton_rec.cache.gpu_share`), so its name also carries
    the model version and the server (:func:`server_token`):
    ``<model>.v<version>.<device>.<table>.<digest>.<server>``. A new version loaded next
    to an old one, or another server sharing the store, never attaches to memory that the
    old one's unload frees. (The CPU segment is reference-counted and outlives any one
    process: versions with the same content share it.)"""
    layout = getattr(table, "layout_path", None) or table.path
    digest = os.path.splitext(os.path.basename(layout))[0][:16]
    if spec.device == "cpu":
        return f"{params.model}.{spec.device}.{tp.name}.{digest}"
    version = spec.model_version or "0"
    return f"{params.model}.v{version}.{spec.device}.{tp.name}.{digest}.{server_token()}"


def shm_namespace(table: EmbeddingTable, parent: str) -> str:
    """The shared-memory namespace token of the node store holding ``table``'s layout
    (``<store>/layouts/<digest>.tbl``, see :mod:`triton_rec.storage.node_store`), for segments in
    ``parent`` (:func:`triton_rec.cache.shm_security.store_namespace`)."""
    from triton_rec.cache.shm_security import store_namespace
    from triton_rec.errors import CacheError

    layout = getattr(table, "layout_path", None)
    if not layout:
        raise CacheError(f"{table.path}: a shared cache needs a table of the node store")
    return store_namespace(os.path.dirname(os.path.dirname(layout)), parent)


def open_session(params: ModelParams, spec: InstanceSpec = InstanceSpec()) -> LookupSession:
    """An ``hps`` lookup session over :func:`open_tables`."""
    ts = open_tables(params, spec)
    return LookupSession(params, ts.tables, ts.inserter, ts.refresher, ts.services)


def uses_tiers(params: ModelParams) -> bool:
    """Whether the model's tables live in database tiers (else: the node-local store only)."""
    return not (params.volatile_db.type == "hash_map" and params.persistent_db.type == "disabled")


def content_digest(table: EmbeddingTable) -> str:
    """The content digest of a node-local table (its layout file is named by it)."""
    layout = getattr(table, "layout_path", None) or table.path
    return os.path.splitext(os.path.basename(layout))[0]


def open_tier_store(params: ModelParams, tp: TableParams, table: EmbeddingTable) -> BackingStore:
    """The store a table's cache sits in front of, per the ps.json tier sections.

    - ``hash_map`` volatile and no persistent tier: the node-local table itself;
    - otherwise a :class:`~triton_rec.storage.tiers.TieredStore`: [node-local table (hash map
      types) | Redis Cluster (``redis_cluster``)] then [RocksDB (``rocks_db``)].
      Tables are named ``hps_et.<model>.<table>`` (:func:`tier_table_name`) and both
      tiers use HPS's layout (RocksDB: one database at ``persistent_db.path`` for every
      model, a column family per table; Redis: ``hps_et{<name>/p<i>}v`` hashes), so
      what HPS filled can be served as it is.

    The writable tiers get the sparse files' rows on first use (:func:`import_table`,
    once per content and tier; ``freeze_sparse`` keeps an existing import) from the
    node-local table ``table``, which was converted from them.
    """
    vol, per = params.volatile_db, params.persistent_db
    if not uses_tiers(params):
        return LocalTableStore(table)
    name = tier_table_name(params.model, tp.tier_name)
    digest = content_digest(table)
    # tables fused into one tier table (HPS fuse_embedding_table) import each its own rows
    marker: str = SOURCE_META
    siblings: Tuple[str, ...] = ()
    if tp.fused_into is not None:
        marker = f"{SOURCE_META}.{tp.name}"
        siblings = tuple(
            f"{SOURCE_META}.{t.name}"
            for t in params.tables
            if t.fused_into == tp.fused_into and t.name != tp.name
        )
    row_bytes = table.codec.row_bytes
    opened: List[Tier] = []
    persistent: Optional[Tier] = None

    def imported(store: BackingStore, role: str, fraction: float = 1.0) -> None:
        progress = node_store.ProgressLogger(f"importing {name} into the {role} tier")
        result = import_table(
            store,
            table.keys,
            table.vectors,
            digest,
            fraction=fraction,
            freeze=params.freeze_sparse,
            progress=lambda d, t: progress(d * row_bytes, t * row_bytes),
            marker=marker,
            sibling_markers=siblings,
        )
        log.info("%s: %s tier %r: %s", name, role, store, result)

    try:
        if vol.type == "hash_map":
            opened.append(Tier("local", LocalTableStore(table)))
        if per.type == "rocks_db":
            # imported here, as redis-py below: only a process whose tiers use them pays for them
            from triton_rec.storage.rocksdb_store import NodeRocksDBTable, RocksDBStore

            path = per.path
            store: BackingStore
            if per.read_only:
                store = RocksDBStore(
                    path,
                    name,
                    tp.vec_size,
                    tp.default_value,
                    read_only=True,
                    max_batch_size=per.max_batch_size,
                    num_threads=per.num_threads,
                    precision=tp.precision,
                )
            else:
                store = NodeRocksDBTable(
                    path,
                    name,
                    tp.vec_size,
                    tp.default_value,
                    max_batch_size=per.max_batch_size,
                    num_threads=per.num_threads,
                    precision=tp.precision,
                )
            persistent = Tier("persistent", store, per.on_unavailable, per.update_filters)
            if not per.read_only:
                imported(store, "persistent")
        if vol.type == "redis_cluster":
            from triton_rec.storage.redis_store import RedisClusterStore  # redis-py: 12 MB

            store = RedisClusterStore(
                vol.redis.address,
                name,
                tp.vec_size,
                tp.default_value,
                num_partitions=vol.num_partitions,
                max_batch_size=vol.max_batch_size,
                overflow_margin=vol.overflow_margin,
                overflow_policy=vol.overflow_policy,
                overflow_resolution_target=vol.overflow_resolution_target,
                refresh_time_after_fetch=vol.refresh_time_after_fetch,
                precision=tp.precision,
                **vol.redis.client_kwargs(),
            )
            opened.append(Tier("volatile", store, vol.on_unavailable, vol.update_filters))
            imported(store, "volatile", vol.initial_cache_rate if persistent else 1.0)
        if persistent is not None:
            opened.append(persistent)
    except BaseException:
        for t in opened:
            t.store.close()
        if persistent is not None and persistent not in opened:
            persistent.store.close()
        raise
    return TieredStore(tp.name, opened, cache_missed_embeddings=vol.cache_missed_embeddings)


def confine_directories(params: ModelParams, spec: InstanceSpec) -> None:
    """The operator's allowed roots (:mod:`triton_rec.config.model_files`) for the paths a model
    names that are not files read through :func:`~triton_rec.config.model_files.open_model_file`:
    a ``store_dir`` set in config.pbtxt (the operator's ``TRITON_REC_STORE`` / default
    store is trusted), the RocksDB directory and the Redis TLS files of ps.json."""
    if spec.store_dir:
        confine(spec.store_dir, "store_dir (config.pbtxt parameter)")
    if params.persistent_db.type == "rocks_db":
        confine(params.persistent_db.path, "persistent_db.path")
    used = (
        ("volatile_db", params.volatile_db.type == "redis_cluster"),
        ("update_source", params.update_source.enabled),
    )
    for section in (name for name, on in used if on):
        redis = getattr(params, section).redis
        for key in ("tls_ca_certificate", "tls_client_certificate", "tls_client_key"):
            if getattr(redis, key):
                confine(getattr(redis, key), f"{section}.{key}")


def open_tables(params: ModelParams, spec: InstanceSpec = InstanceSpec()) -> TableSet:
    """Load the model's tables (node-local store, then the database tiers of ps.json),
    attach the shared caches and start the online-update consumer if configured."""

    confine_directories(params, spec)
    check_deployed(params, spec)

    def load(tp: TableParams) -> EmbeddingTable:
        return node_store.load_table(tp, spec.store_dir, prefault=spec.prefault)

    def open_cache(tp: TableParams, table: EmbeddingTable):
        capacity = cache_capacity(params, table)
        if capacity == 0:
            return None
        name = cache_name(params, spec, tp, table)
        from triton_rec.cache.shm_cache import SharedEmbeddingCache, shm_dir

        directory = shm_dir(spec.cache_dir)
        if spec.device == "cpu":
            return SharedEmbeddingCache.open(
                name,
                capacity,
                table.vec_size,
                policy=params.cache_policy,
                ways=params.cache_ways,
                precision=tp.precision,
                directory=directory,
                namespace=shm_namespace(table, directory),
            )
        mode = device_table_mode(params, table.num_rows, table.codec)
        if mode is not None:  # the whole node-local table on the GPU (device_table.py)
            return DeviceTableCache(table, mode, spec.device_id)
        from triton_rec.cache.gpu_share import open_shared_cache

        shared = open_shared_cache(
            name,
            capacity,
            table.vec_size,
            ways=params.cache_ways,
            policy=params.cache_policy,
            precision=tp.precision,
            device=spec.device_id,
            directory=directory,
            namespace=shm_namespace(table, directory),
        )
        return shared

    ts = TableSet.open(
        params,
        load_table=load,
        open_cache=open_cache,
        open_store=lambda tp, table: open_tier_store(params, tp, table),
    )
    if params.update_source.enabled:
        try:
            from triton_rec.updates.online import start_update_consumer

            ts.services.append(start_update_consumer(params, ts.tables))
        except BaseException:
            ts.close()
            raise
    return ts


@dataclass(frozen=True)
class DensePlacement:
    """Where an instance runs its dense executor (:func:`dense_placement`).

    Attributes:
        xp: the array module of a HugeCTR network (numpy, or CuPy on the device).
        on_device: the executor runs on the instance's GPU.
        why: the reason, for the load log.
        device: the GPU it runs on (None on the host).
        math: the arithmetic of its GEMMs on the GPU (``fp32`` on the host).
    """

    xp: Any
    on_device: bool
    why: str
    device: Optional[int] = None
    math: str = "fp32"


def dense_placement(params: ModelParams, spec: InstanceSpec) -> DensePlacement:
    """Where the instance ``spec`` runs the model's dense network: a KIND_GPU instance
    runs a HugeCTR network on its GPU with CuPy (the device made current for this
    process), if CuPy and the device are there; anything else runs on the host (numpy,
    or onnxruntime for an ONNX file)."""
    if spec.device == "cpu":
        why = "KIND_CPU instance"
        if spec.dense_math != "fp32":  # said, never silently ignored
            why += f" (dense_math {spec.dense_math} is for KIND_GPU instances: fp32 here)"
        return DensePlacement(np, False, why)
    if params.dense_file and params.dense_file.endswith(".onnx"):
        return DensePlacement(np, False, "ONNX models run in onnxruntime on the host")
    from triton_rec.cache.array_cache import resolve_xp
    from triton_rec.errors import CupyUnavailableError

    try:
        cupy = resolve_xp("cupy")
    except CupyUnavailableError as e:
        return DensePlacement(np, False, f"runs on the host with numpy: {e}")
    cupy.cuda.Device(spec.device_id).use()  # this process's arrays go to its GPU
    why = f"CUDA graphs (cuBLAS + CuPy) on GPU {spec.device_id}"
    if spec.dense_math != "fp32":
        why += f", GEMMs on tensor cores in {spec.dense_math} (dense_math)"
    return DensePlacement(cupy, True, why, spec.device_id, spec.dense_math)


def gpu_placement(
    params: Optional[ModelParams],
    spec: InstanceSpec,
    dense: Optional[DensePlacement] = None,
) -> Optional[str]:
    """The load-log line of a KIND_GPU instance: what it actually puts on its GPU
    (None for a CPU instance). ``params`` None: the instance has no tables (the dense
    backend); ``dense`` None: no dense executor (the hps backend)."""
    if spec.device == "cpu":
        return None
    if params is None:
        cache = "none (no tables)"
    elif caches_enabled(params):
        cache = "yes (one per table, shared through CUDA IPC)"
    else:
        cache = "no (gpucache is false or gpucacheper is 0)"
    if dense is None:
        executor = "none (embedding lookup only)"
    else:
        executor = ("yes, " if dense.on_device else "no, ") + dense.why
    line = (
        f"KIND_GPU instance on GPU {spec.device_id}: embedding cache on the GPU: {cache}; "
        f"dense executor on the GPU: {executor}"
    )
    if not (params is not None and caches_enabled(params)) and not (dense and dense.on_device):
        line += "; nothing of this instance is on the GPU"
    return line


def load_dense_model(
    params: ModelParams,
    model_dir: str,
    config_network: Optional[str] = None,
    threads: int = InstanceSettings.intra_op_threads,
    xp: Any = None,
    device: Optional[int] = None,
    math: str = "fp32",
):
    """The dense part of a whole model, from its ps.json entry (``threads``: onnxruntime's
    intra-op pool; the numpy executor runs in BLAS's pool, sized per process; ``xp``:
    the array module of a HugeCTR network, :attr:`DensePlacement.xp`, default numpy;
    ``device``: a GPU, where a HugeCTR network runs as CUDA graphs per batch-size bucket,
    :class:`~triton_rec.dense.graphs.DenseGraphs`, with ``math``, its GEMMs' arithmetic).

    - ``dense_file`` ending in ``.onnx``: run with onnxruntime (tables' layout from the
      ONNX inputs, combiners from ``network_file`` if given, else ``sum``);
    - otherwise a HugeCTR dense file with its network JSON: ``network_file`` of ps.json,
      else the config.pbtxt parameter ``config`` (relative to the model directory), as
      the upstream HugeCTR backend samples have it.
    """

    if not params.dense_file:
        raise ConfigError(f"model '{params.model}': ps.json names no 'dense_file'")
    network = params.network_file or model_relative_path(model_dir, config_network)
    if params.dense_file.endswith(".onnx"):
        from triton_rec.dense.onnx_model import OnnxDenseModel

        return OnnxDenseModel.load(params.dense_file, network_file=network, threads=threads)
    if network is None:
        raise ConfigError(
            f"model '{params.model}': a HugeCTR dense file needs a network JSON "
            "('network_file' in ps.json or the config.pbtxt parameter 'config')"
        )
    if device is not None:
        from triton_rec.dense.graphs import DenseGraphs

        return DenseGraphs.load(
            network,
            params.dense_file,
            params.non_trainable_params_file,
            max(1, int(params.max_batch_size)),
            int(device),
            math,
        )
    from triton_rec.dense.hugectr_network import HugeCTRNetwork

    if xp is None or xp is np:  # the host's: one per process, whatever the instances
        return HugeCTRNetwork.shared(network, params.dense_file, params.non_trainable_params_file)
    return HugeCTRNetwork.load(network, params.dense_file, params.non_trainable_params_file, xp=xp)


def open_ranking_session(
    params: ModelParams,
    spec: InstanceSpec,
    model_dir: str,
    config_network: Optional[str] = None,
    placement: Optional[DensePlacement] = None,
    check_dense: Optional[Callable[[Any], None]] = None,
):
    """A ``hugectr`` whole-model session: the dense model (where ``placement`` says,
    default :func:`dense_placement`) + :func:`open_tables`. ``check_dense(dense)`` runs
    between the two, so a model refused for what its network says opens no table."""
    from triton_rec.serving.ranking import RankingSession

    check_deployed(params, spec)  # before the network is put on the GPU
    where = placement or dense_placement(params, spec)
    dense = load_dense_model(
        params,
        model_dir,
        config_network,
        spec.intra_op_threads,
        where.xp,
        where.device,
        where.math,
    )
    if check_dense is not None:
        check_dense(dense)
    tables = open_tables(params, spec)
    try:
        return RankingSession(params, tables, dense)
    except BaseException:
        tables.close()
        raise
