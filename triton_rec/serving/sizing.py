"""What a model repository needs of a node, from its config.pbtxt files and ps.json alone.

``triton-rec-server plan`` (:mod:`triton_rec.triton.plan_cli`) and the load log of every
model (:func:`triton_rec.triton.model_scaffold.BackendModel.initialize`) say the figures
this module computes. Nothing heavy is loaded: a table's rows come from its files' sizes
(a HugeCTR sparse directory) or its arrays' headers (an ``.npz``), never its data
(:func:`triton_rec.formats.tables.table_shape`); a HugeCTR network is parsed without its
weights.

Every figure comes from the rule the code that allocates uses, written once:

=============================  ==========================================================
what                           rule (used by the allocator and by this module)
=============================  ==========================================================
a table in the node store      :func:`triton_rec.storage.layout_file.layout_offsets` (keys, rows
                               in the table's precision, hash index of
                               ``_native.index_capacity`` slots; the layout file's size)
a table's cache rows           :func:`triton_rec.serving.deployment.cache_rows`
the CPU cache (``/dev/shm``)   :func:`triton_rec.cache.shm_cache.segment_bytes`
a GPU's embedding cache        :func:`triton_rec.cache.gpu_share.device_cache_bytes`
a ``static``/``uvm`` table     :func:`triton_rec.cache.device_table.device_table_bytes`
                               (allocated by the native ``DeviceTable``, which the
                               Python side checks against this rule)
=============================  ==========================================================

Two GPU figures are estimates, not rules the allocator shares (:data:`ESTIMATES`): the
dense network's CUDA graphs (:func:`dense_graph_bytes`: CuPy's memory pool holds its
intermediates, ``triton_rec/dense/graphs.py``) and an instance's staging
(:func:`staging_bytes`: the native lanes grow theirs to the largest request,
``src/native/gpu_ops.hpp``).

How many of each (:func:`plan_model`): a table's layout once per node (models that name
the same source in the same precision share it); a CPU cache per model and table, shared
by all its KIND_CPU instances and versions; a GPU cache per model version, GPU and table;
a ``static``/``uvm`` table once per GPU and table content in the native backend's process
(once per instance process on the Python request path); the dense network and the staging
per instance.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from triton_rec import _native
from triton_rec.cache.device_table import device_table_bytes
from triton_rec.cache.gpu_share import device_cache_bytes
from triton_rec.cache.shm_cache import segment_bytes
from triton_rec.config.model_config import (
    hugectr_cache_parameters,
    model_parameter,
    with_model_parameters,
)
from triton_rec.config.ps_json import (
    EmbeddingCacheType,
    ModelParams,
    find_ps_config,
    load_ps_config,
    model_relative_path,
)
from triton_rec.errors import TritonRecError
from triton_rec.formats.tables import table_shape
from triton_rec.precision import RowCodec
from triton_rec.serving.deployment import (
    cache_rows,
    caches_enabled,
    device_table_mode,
    undeployed_devices,
    uses_tiers,
)
from triton_rec.storage.layout_file import layout_offsets

#: the resources a plan counts: host memory (RAM: the node store's tables, pinned
#: memory), the shared-memory directory (``/dev/shm``), a GPU's memory
RESOURCES = ("host", "shm", "gpu")
#: the backends whose models this module sizes (others, and ensembles, need nothing here)
SIZED_BACKENDS = ("hps", "hugectr", "dense")
#: the parts whose figure is an estimate (no rule shared with the allocator)
ESTIMATES = ("dense network", "staging")
#: cuBLAS workspace of each dense network's handle (``Cublas`` in src/native/bindings_gpu.cpp)
CUBLAS_WORKSPACE_BYTES = 32 << 20
#: alignment of each part of a lane's staging (``gpu::align256``, src/native/gpu_ops.hpp)
STAGING_ALIGN = 256


@dataclass(frozen=True)
class Part:
    """One allocation (or one kind of them) of a model.

    Attributes:
        resource: one of :data:`RESOURCES`.
        device: the GPU (``resource == "gpu"``), else None.
        what: a short description (``"table 'item' (node store, fp32)"``).
        bytes: its size.
        key: what it is shared by: equal keys are one allocation on the node (two models
            whose tables have the same source share its layout), counted once.
    """

    resource: str
    device: Optional[int]
    what: str
    bytes: int
    key: Tuple

    def to_json(self) -> Dict[str, Any]:
        """The part as ``plan --json`` prints it."""
        out: Dict[str, Any] = {"resource": self.resource, "what": self.what, "bytes": self.bytes}
        if self.device is not None:
            out["device"] = self.device
        if any(self.what.startswith(e) for e in ESTIMATES):
            out["estimate"] = True
        return out


@dataclass
class ModelPlan:
    """What one model needs (:func:`plan_model`).

    Attributes:
        name: the model.
        backend: config.pbtxt's ``backend`` (or ``platform``).
        parts: its allocations.
        notes: what the figures leave out, or why there are none.
        refusals: why the model cannot load on this node whatever its memory (a KIND_GPU
            instance group on a node without that GPU).
        error: why the model could not be sized (a missing file, a bad config), or None.
    """

    name: str
    backend: str = ""
    parts: List[Part] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    refusals: List[str] = field(default_factory=list)
    error: Optional[str] = None

    def total(self, resource: str, device: Optional[int] = None) -> int:
        """Bytes of ``resource`` (on ``device`` for a GPU), each shared part once."""
        return _sum_unique(
            p
            for p in self.parts
            if p.resource == resource and (device is None or p.device == device)
        )

    @property
    def host_bytes(self) -> int:
        """Host memory: its tables in the node store (and pinned memory on a GPU node)."""
        return self.total("host")

    @property
    def shm_bytes(self) -> int:
        """The shared-memory directory: its CPU caches."""
        return self.total("shm")

    @property
    def gpu_bytes(self) -> Dict[int, int]:
        """Memory per GPU."""
        devices = sorted({p.device for p in self.parts if p.resource == "gpu"}, key=_device)
        return {_device(d): self.total("gpu", d) for d in devices}

    def summary(self) -> str:
        """The load log's figures: ``host 1.2 MiB (host_bytes=N), /dev/shm ... (shm_bytes=N),
        GPU 0: ... (gpu_bytes={0: N})``."""
        gpu = self.gpu_bytes
        people = ", ".join(f"{d}: {format_bytes(n)}" for d, n in gpu.items()) or "none"
        exact = ", ".join(f"{d}: {n}" for d, n in gpu.items())
        return (
            f"host {format_bytes(self.host_bytes)} (host_bytes={self.host_bytes}), "
            f"/dev/shm {format_bytes(self.shm_bytes)} (shm_bytes={self.shm_bytes}), "
            f"GPU {people} (gpu_bytes={{{exact}}})"
        )

    def to_json(self) -> Dict[str, Any]:
        """The model as ``plan --json`` prints it."""
        out: Dict[str, Any] = {
            "backend": self.backend,
            "host_bytes": self.host_bytes,
            "shm_bytes": self.shm_bytes,
            "gpu_bytes": {str(d): n for d, n in self.gpu_bytes.items()},
            "parts": [p.to_json() for p in self.parts],
            "notes": list(self.notes),
        }
        if self.refusals:
            out["refusals"] = list(self.refusals)
        if self.error is not None:
            out["error"] = self.error
        return out


def _device(d: Optional[int]) -> int:
    return -1 if d is None else int(d)


def _sum_unique(parts: Iterable[Part]) -> int:
    seen: Dict[Tuple, int] = {}
    for p in parts:
        seen.setdefault((p.resource, p.device, p.key), p.bytes)
    return sum(seen.values())


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- the rules that are estimates ------------------------------------------------------


def _align(n: int, a: int = STAGING_ALIGN) -> int:
    return -(-int(n) // a) * a


def staging_bytes(
    max_batch: int,
    tables: Sequence[Tuple[int, int]],
    dense_dim: int = 0,
    label_dim: int = 0,
) -> int:
    """An estimate of one KIND_GPU instance's staging at its largest request (pinned host
    memory, and as much device memory): the parts the native backend's hugectr path asks
    a lane for (``hugectr_gpu`` in src/triton_backend/trec/gpu_paths.cpp), each aligned to
    256 bytes: keys, lookup and combine spans, row pointers, DES, the looked-up vectors,
    the statuses and the predictions, for ``max_batch`` samples of ``tables`` (keys per
    sample, vec_size) each. The lanes grow to the largest request they see, so this is
    the most they hold."""
    b = max(1, int(max_batch))
    keys = b * sum(int(k) for k, _ in tables)
    n = len(tables)
    parts = (
        8 * keys,
        8 * (2 * n + 1),
        8 * (3 * n + 1),
        8 * n * (b + 1),
        4 * b * int(dense_dim),
        4 * b * sum(int(k) * int(v) for k, v in tables),
        keys,
        4 * b * int(label_dim),
    )
    return sum(_align(p) for p in parts)


def dense_graph_bytes(network: Any, max_batch: int) -> Dict[str, int]:
    """An estimate of one instance's dense network on a GPU (``DenseGraphs``): its
    weights (the dense file's floats), the input buffers, every layer's output at the
    largest batch (an upper bound: CuPy's pool reuses freed blocks), each bucket's graph
    output (:func:`triton_rec.dense.graphs.buckets`) and the cuBLAS workspace.
    ``network``: a parsed network (``HugeCTRNetwork.parse``, no weights)."""
    from triton_rec.dense.graphs import buckets

    b = max(1, int(max_batch))
    embeddings = sum(int(t.slot_num) * int(t.vec_size) for t in network.tables)
    activations = sum(
        math.prod(int(x) for x in shape) for layer in network.layers for shape in layer.out_shapes
    )
    return {
        "weights": 4 * int(network.num_params),
        "workspace": 4 * b * (int(network.dense_dim) + embeddings + activations)
        + 4 * int(network.label_dim) * sum(buckets(b))
        + CUBLAS_WORKSPACE_BYTES,
    }


# -- instance groups -------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceGroup:
    """One ``instance_group`` of config.pbtxt as the node runs it.

    Attributes:
        kind: ``"CPU"`` or ``"GPU"``.
        count: instances per device (per GPU of ``devices`` for a GPU group).
        devices: the GPUs of a GPU group.
        index: its position in config.pbtxt (part of the instances' names).
    """

    kind: str
    count: int
    devices: Tuple[int, ...] = ()
    index: int = 0


def instance_groups(
    config: Dict[str, Any], node_gpus: Optional[Sequence[int]]
) -> Tuple[List[InstanceGroup], List[str]]:
    """``(groups, refusals)`` of a model config: Triton's defaults (one group of one
    instance; ``KIND_AUTO`` is the GPUs where the node has some, else the CPU; a
    ``KIND_GPU`` group without ``gpus`` runs on every GPU). ``node_gpus``: the node's
    GPUs, or None to take the config as resolved (what Triton hands a model at load)."""
    groups, refusals = [], []
    for i, g in enumerate(config.get("instance_group") or [{}]):
        kind = str(g.get("kind") or "KIND_AUTO")
        count = int(g.get("count") or 1)
        listed = tuple(int(d) for d in g.get("gpus") or ())
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if (listed or node_gpus) else "KIND_CPU"
        if kind != "KIND_GPU":
            groups.append(InstanceGroup("CPU", count, (), i))
            continue
        if node_gpus is not None:
            missing = [d for d in listed if d not in node_gpus]
            if not node_gpus:
                refusals.append(f"instance_group {i} is KIND_GPU and this node has no GPU")
                continue
            if missing:
                refusals.append(
                    f"instance_group {i} is KIND_GPU on GPUs {missing}, which this node "
                    f"lacks (it has {list(node_gpus)})"
                )
                continue
        devices = listed or tuple(node_gpus or ())
        if not devices:
            refusals.append(f"instance_group {i} is KIND_GPU and lists no GPU")
            continue
        groups.append(InstanceGroup("GPU", count, devices, i))
    return groups, refusals


def loaded_versions(config: Dict[str, Any], model_dir: str) -> List[int]:
    """The versions Triton loads of a model: its numeric subdirectories, chosen by
    ``version_policy`` (default: the latest one)."""
    try:
        found = sorted(int(n) for n in os.listdir(model_dir) if n.isdigit())
    except OSError:
        return []
    policy = config.get("version_policy") or {}
    if "all" in policy:
        return found
    if "specific" in policy:
        wanted = {int(v) for v in (policy["specific"] or {}).get("versions") or ()}
        return [v for v in found if v in wanted]
    latest = int(((policy.get("latest") or {}).get("num_versions")) or 1)
    return found[-latest:]


# -- one model -------------------------------------------------------------------------


def model_params(name: str, config: Dict[str, Any], model_dir: str) -> Optional[ModelParams]:
    """The ps.json entry a model's backend serves, with what its config.pbtxt overrides,
    as the backend reads it (``backend/*/model.py``); None for a model without one."""
    backend = config.get("backend") or ""
    if backend not in SIZED_BACKENDS:
        return None
    ps_path = find_ps_config(model_dir, model_parameter(config, "ps"))
    entry = name if backend != "dense" else (model_parameter(config, "ps_model") or name)
    params = load_ps_config(ps_path).model(entry)
    if backend == "dense":
        return params
    params = with_model_parameters(config, params)
    if backend == "hugectr":
        params = hugectr_cache_parameters(config, params)
    return params


def plan_model(
    name: str,
    config: Dict[str, Any],
    model_dir: str,
    node_gpus: Optional[Sequence[int]] = None,
    request_path: str = "native",
) -> ModelPlan:
    """What model ``name`` needs: ``config`` is its config.pbtxt as Triton hands it to the
    backend (a dict), ``model_dir`` its directory, ``node_gpus`` the node's GPUs (None:
    the config's instance groups as resolved), ``request_path`` ``native`` (every
    instance in the server process) or ``python`` (one process per instance). A
    :class:`~triton_rec.errors.TritonRecError` (a missing file, a bad ps.json) becomes
    :attr:`ModelPlan.error`."""
    plan = ModelPlan(name, str(config.get("backend") or config.get("platform") or ""))
    try:
        _plan_model(plan, config, model_dir, node_gpus, request_path)
    except TritonRecError as e:
        plan.error = str(e)
    return plan


def _plan_model(
    plan: ModelPlan,
    config: Dict[str, Any],
    model_dir: str,
    node_gpus: Optional[Sequence[int]],
    request_path: str,
) -> None:
    name = plan.name
    params = model_params(name, config, model_dir)
    if params is None:
        plan.notes.append(f"backend '{plan.backend}': nothing of triton-rec's to size")
        return
    groups, plan.refusals = instance_groups(config, node_gpus)
    if plan.backend != "dense":  # HPS's rule: each GPU of the groups in deployed_device_list
        plan.refusals += undeployed_devices(params, (d for g in groups for d in g.devices))
    versions = loaded_versions(config, model_dir)
    if not versions:
        plan.notes.append("no version directory to load")
        return
    cpu = any(g.kind == "CPU" for g in groups)
    # every instance on a GPU: (version, group, device, instance)
    gpu_instances = [
        (v, g.index, d, i)
        for v in versions
        for g in groups
        if g.kind == "GPU"
        for d in g.devices
        for i in range(g.count)
    ]
    devices = sorted({d for _, _, d, _ in gpu_instances})
    if plan.backend != "dense":
        _plan_tables(plan, params, cpu, devices, gpu_instances, versions, request_path)
    else:
        plan.notes.append(f"dense network of ps.json entry '{params.model}' (no tables)")
    network = _gpu_network(plan, params, config, model_dir) if gpu_instances else None
    mb = max(1, int(params.max_batch_size))
    has_device_work = network is not None or (plan.backend != "dense" and caches_enabled(params))
    for v, g, d, i in gpu_instances:
        who = (name, v, g, d, i)
        if network is not None:
            dense = dense_graph_bytes(network, mb)
            plan.parts.append(
                Part("gpu", d, "dense network: weights", dense["weights"], ("dense w",) + who)
            )
            plan.parts.append(
                Part(
                    "gpu",
                    d,
                    "dense network: graph buffers and cuBLAS workspace",
                    dense["workspace"],
                    ("dense ws",) + who,
                )
            )
        if has_device_work:
            tables = [(t.max_keys_per_sample, t.vec_size) for t in params.tables]
            if network is not None and plan.backend == "dense":
                tables = [(int(t.slot_num), int(t.vec_size)) for t in network.tables]
            dense_dim = int(network.dense_dim) if network is not None else 0
            label_dim = int(network.label_dim) if network is not None else 0
            staged = staging_bytes(mb, tables, dense_dim, label_dim)
            plan.parts.append(Part("gpu", d, "staging (device)", staged, ("stage d",) + who))
            plan.parts.append(Part("host", None, "staging (pinned)", staged, ("stage h",) + who))
    if gpu_instances and network is None and plan.backend in ("hugectr", "dense"):
        plan.notes.append("its dense network runs on the host (ONNX, or no dense file)")
    if uses_tiers(params):
        plan.notes.append(
            "Redis/RocksDB tiers hold the tables too: their memory and disk are not counted"
        )


def _plan_tables(
    plan: ModelPlan,
    params: ModelParams,
    cpu: bool,
    devices: List[int],
    gpu_instances: List[Tuple[int, int, int, int]],
    versions: List[int],
    request_path: str,
) -> None:
    for tp in params.tables:
        rows, _source_codec = table_shape(tp.sparse_file, tp.vec_size)
        codec = RowCodec(tp.precision, tp.vec_size)
        layout = layout_offsets(rows, codec, int(_native.index_capacity(rows)))[3]
        source = (os.path.realpath(tp.sparse_file), tp.vec_size, tp.precision)
        plan.parts.append(
            Part(
                "host",
                None,
                f"table '{tp.name}' in the node store ({rows} rows, {tp.precision})",
                layout,
                ("layout",) + source,
            )
        )
        capacity = cache_rows(params, rows)
        if capacity == 0:
            continue
        if cpu:
            shm = segment_bytes(
                capacity, tp.vec_size, params.cache_policy, params.cache_ways, tp.precision
            )
            plan.parts.append(
                Part(
                    "shm",
                    None,
                    f"table '{tp.name}': CPU cache of {capacity} rows",
                    shm,
                    ("shm", plan.name, tp.name),
                )
            )
        mode = device_table_mode(params, rows, codec)
        for d in devices:
            if mode is not None:
                size = device_table_bytes(rows, codec)
                # one copy per GPU in the native backend's process, one per instance
                # process on the Python request path
                keys: List[Tuple] = [("device table", mode, d) + source]
                if request_path == "python":
                    keys = [keys[0] + (plan.name,) + w for w in gpu_instances if w[2] == d]
                for key in keys:
                    if mode == EmbeddingCacheType.UVM.value:
                        what = f"table '{tp.name}' whole for GPU {d} (uvm: pinned host memory)"
                        plan.parts.append(Part("host", None, what, size, key))
                    else:
                        what = f"table '{tp.name}' whole on the GPU (static)"
                        plan.parts.append(Part("gpu", d, what, size, key))
                continue
            size = device_cache_bytes(
                capacity, tp.vec_size, params.cache_ways, params.cache_policy, tp.precision
            )
            for v in versions:
                plan.parts.append(
                    Part(
                        "gpu",
                        d,
                        f"table '{tp.name}': GPU cache of {capacity} rows (version {v})",
                        size,
                        ("gpu cache", plan.name, v, tp.name),
                    )
                )


def _gpu_network(
    plan: ModelPlan, params: ModelParams, config: Dict[str, Any], model_dir: str
) -> Any:
    """The parsed network a KIND_GPU instance runs on its GPU (a HugeCTR dense file), or
    None (an ``hps`` model, an ONNX network)."""
    if plan.backend not in ("hugectr", "dense") or not params.dense_file:
        return None
    if params.dense_file.endswith(".onnx"):
        return None
    network = params.network_file or model_relative_path(
        model_dir, model_parameter(config, "config")
    )
    if network is None:
        return None
    from triton_rec.dense.hugectr_network import HugeCTRNetwork

    return HugeCTRNetwork.parse(network)


# -- the node --------------------------------------------------------------------------


@dataclass
class NodeResources:
    """What a node has for the models.

    Attributes:
        ram_total, ram_available: ``MemTotal`` and ``MemAvailable`` of /proc/meminfo.
        shm_dir: the shared-memory directory (:func:`~triton_rec.cache.shm_cache.shm_dir`).
        shm_total, shm_free: its file system's size and free bytes.
        gpus: free and total bytes per GPU; ``{}`` for none.
        gpu_source: how the GPUs were found (or why none were).
    """

    ram_total: int
    ram_available: int
    shm_dir: str
    shm_total: int
    shm_free: int
    gpus: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    gpu_source: str = ""

    def to_json(self) -> Dict[str, Any]:
        """The node as ``plan --json`` prints it."""
        return {
            "ram_total_bytes": self.ram_total,
            "ram_available_bytes": self.ram_available,
            "shm_dir": self.shm_dir,
            "shm_total_bytes": self.shm_total,
            "shm_free_bytes": self.shm_free,
            "gpus": {
                str(d): {"free_bytes": f, "total_bytes": t} for d, (f, t) in self.gpus.items()
            },
            "gpu_source": self.gpu_source,
        }


def meminfo(path: str = "/proc/meminfo") -> Dict[str, int]:
    """/proc/meminfo in bytes (``{"MemTotal": ..., "MemAvailable": ...}``)."""
    out = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                scale = 1024 if fields[1:2] == ["kB"] else 1
                out[key] = int(fields[0]) * scale
    return out


def gpu_memory() -> Tuple[Dict[int, Tuple[int, int]], str]:
    """``({device: (free, total bytes)}, how)`` of this node's GPUs, through CuPy, which
    the engine's GPU code uses (the ``gpu`` extra); none without CuPy or a driver."""
    from triton_rec.cache.array_cache import resolve_xp
    from triton_rec.errors import CupyUnavailableError

    try:
        cupy = resolve_xp("cupy")
    except CupyUnavailableError:
        return {}, "no GPU visible: CuPy (the gpu extra) cannot be imported"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        gpus = {}
        for d in range(count):
            with cupy.cuda.Device(d):
                free, total = cupy.cuda.runtime.memGetInfo()
            gpus[d] = (int(free), int(total))
    except Exception as e:  # no driver, no device: CuPy's CUDARuntimeError
        return {}, f"no GPU visible to CuPy: {e}"
    return gpus, f"CuPy (CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()})"


def node_resources(shm_directory: Optional[str] = None, probe_gpus: bool = True) -> NodeResources:
    """This node: /proc/meminfo, the shared-memory directory's file system and (with
    ``probe_gpus``) each GPU's free memory (:func:`gpu_memory`)."""
    from triton_rec.cache.shm_cache import shm_dir

    mem = meminfo()
    directory = shm_dir(shm_directory)
    st = os.statvfs(directory)
    gpus, how = gpu_memory() if probe_gpus else ({}, "not probed")
    return NodeResources(
        mem.get("MemTotal", 0),
        mem.get("MemAvailable", mem.get("MemFree", 0)),
        directory,
        st.f_blocks * st.f_frsize,
        st.f_bavail * st.f_frsize,
        gpus,
        how,
    )


def misfits(plans: Sequence[ModelPlan], node: NodeResources) -> List[str]:
    """One line per model and resource that does not fit ``node`` (empty: everything
    fits): a model that cannot be sized or cannot run here (no such GPU); a model that
    alone needs more of a resource than the node has; the models that together do.
    Host memory holds the node store's tables and the shared-memory directory's caches
    (a tmpfs lives in RAM): both count against ``MemAvailable``."""
    out: List[str] = []
    for p in plans:
        if p.error is not None:
            out.append(f"model '{p.name}': cannot be sized: {p.error}")
        for why in p.refusals:
            out.append(f"model '{p.name}': GPU: {why}")
    ok = [p for p in plans if p.error is None]
    checks: List[Tuple[str, int, Any]] = [
        ("host memory (tables + /dev/shm caches)", node.ram_available, _host_and_shm),
        (f"shared memory ({node.shm_dir})", node.shm_free, lambda ps: _total(ps, "shm")),
    ]
    devices = sorted({d for p in ok for d in p.gpu_bytes})
    for d in devices:
        have = node.gpus.get(d, (0, 0))[0]

        def need(ps, d=d):
            return _total(ps, "gpu", d)

        checks.append((f"GPU {d} memory", have, need))
    for resource, have, need in checks:
        alone = [p for p in ok if need([p]) > have]
        for p in alone:
            out.append(
                f"model '{p.name}': {resource}: needs {format_bytes(need([p]))} "
                f"({need([p])} bytes), the node has {format_bytes(have)} ({have} bytes)"
            )
        total = need(ok)
        if not alone and total > have:
            users = [p for p in ok if need([p])]
            names = ", ".join(f"'{p.name}' {format_bytes(need([p]))}" for p in users)
            out.append(
                f"models {names} together: {resource}: need {format_bytes(total)} "
                f"({total} bytes), the node has {format_bytes(have)} ({have} bytes)"
            )
    return out


def _total(plans: Sequence[ModelPlan], resource: str, device: Optional[int] = None) -> int:
    return _sum_unique(
        part
        for p in plans
        for part in p.parts
        if part.resource == resource and (device is None or part.device == device)
    )


def _host_and_shm(plans: Sequence[ModelPlan]) -> int:
    return _total(plans, "host") + _total(plans, "shm")


def totals(plans: Sequence[ModelPlan]) -> Dict[str, Any]:
    """The node's totals, each shared part once: ``host_bytes``, ``shm_bytes``,
    ``gpu_bytes`` per GPU."""
    ok = [p for p in plans if p.error is None]
    devices = sorted({d for p in ok for d in p.gpu_bytes})
    return {
        "host_bytes": _total(ok, "host"),
        "shm_bytes": _total(ok, "shm"),
        "gpu_bytes": {str(d): _total(ok, "gpu", d) for d in devices},
    }
