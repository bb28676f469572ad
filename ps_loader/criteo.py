"""A DLRM of MLPerf's Criteo 1TB shape, generated (``ps-loader criteo-dlrm``).

Writes a servable model repository: the 26 embedding tables of MLPerf DLRM on Criteo 1TB
(dimension 128, row counts capped at 40M as HugeCTR's DLRM sample has them, times
``scale``), the network (dense 13 -> bottom MLP 512-256-128, dot interaction of 27
vectors, top MLP 1024-1024-512-256-1, sigmoid) as a HugeCTR network JSON and dense file,
``ps.json``, ``config.pbtxt`` (backend ``hugectr``), and perf_analyzer inputs per batch
size whose keys follow a per-table power law. The weights are not trained: they are a
pure function of the seed, so a test can recompute every value independently.

- Keys: table ``t`` holds the keys ``offset[t] .. offset[t] + rows[t] - 1``, where
  ``offset[t]`` is the sum of the *full-size* row counts of the tables before it (so a
  table's keys at one scale are a prefix of its keys at a larger one, and every key of
  every table stays below 2^31). Unseen keys (in no table) are drawn from
  ``UNSEEN_BASE + t * UNSEEN_SPAN + [0, UNSEEN_SPAN)``, below 2^32.
- Vectors: :func:`table_vectors`, a function of (seed, table, key) alone: the demo
  tables' hash (:func:`ps_loader.synthetic.expected_vectors`, uniform in [-1, 1) in steps
  of 2^-23) times :data:`VECTOR_SCALE` (a power of two: exact).
- Dense weights: :func:`dense_parameters`, normal from ``numpy.random.default_rng``
  seeded with ``[seed, 0xDE45E]``, scaled so that predictions spread over (0, 1)
  instead of saturating.
- Tables are written chunk by chunk (:class:`~triton_rec.formats.hugectr_sparse
  .SparseDirWriter`, :class:`~triton_rec.formats.npz_table.NpzRowsWriter`): scale 1 is
  about 98 GB in fp32 and never in memory.
"""

from __future__ import annotations

import base64
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ps_loader.synthetic import expected_vectors
from triton_rec.formats.hugectr_sparse import SparseDirWriter
from triton_rec.formats.npz_table import NpzRowsWriter
from triton_rec.precision import RowCodec

#: Rows of the 26 categorical features of Criteo 1TB as MLPerf's DLRM trains them
#: (frequency-capped at 40M rows per feature): the ``slot_size_array`` of HugeCTR's DLRM
#: sample, NVIDIA-Merlin/HugeCTR ``samples/dlrm/dgx_a100.py`` (commit 128c4c23),
#: lines 55-82 (its DataReaderParams; repeated in its SparseEmbedding). The file reads
#: the 40M-limited preprocessed data set (``.../mlperf/40m.limit_preshuffled/``).
CRITEO_1TB_ROWS: Tuple[int, ...] = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951,
    2953546, 403346, 10, 2208, 11938, 155, 4, 976, 14, 39979771,
    25641295, 39664984, 585935, 12972, 108, 36,
)  # fmt: skip
NUM_TABLES = len(CRITEO_1TB_ROWS)
#: the network (HugeCTR samples/dlrm/dgx_a100.py: dense_dim 13, FusedInnerProduct 512,
#: 256, 128; Interaction; 1024, 1024, 512, 256, 1; BinaryCrossEntropyLoss)
DENSE_DIM = 13
EMBEDDING_DIM = 128
BOTTOM_MLP = (512, 256, 128)
TOP_MLP = (1024, 1024, 512, 256, 1)
#: the Interaction layer's output: the bottom MLP's 128, the 27*26/2 = 351 pairwise dot
#: products, one 0 pad (hugectr-layers.md, Interaction)
INTERACTION_DIM = EMBEDDING_DIM + (NUM_TABLES + 1) * NUM_TABLES // 2 + 1
#: a table of at most this many rows is kept whole; a larger one gets
#: ceil(rows * scale) rows, never fewer than this
DEFAULT_MIN_ROWS = 1000
MAX_BATCH_SIZE = 65536
DEFAULT_BATCH_SIZES = (256, 1024, 4096, 16384, 65536)
#: perf inputs of this many samples or more carry perf_analyzer's binary ``b64`` content
B64_FROM_BATCH = 4096
ZIPF_ALPHA = 1.05
UNSEEN_FRACTION = 0.01
UNSEEN_BASE = 1 << 31
UNSEEN_SPAN = 1 << 26
#: ps.json: the cache's share of each table (HPS reference runs used 0.1-0.2)
GPUCACHEPER = 0.2
#: ps.json ``whole_table_max_bytes`` of a KIND_GPU model: tables of at most 64 MiB on the
#: device (rows 3 to ~120,000 at dim 128 in fp32) are held whole, the large ones cached
#: (issue 35: caches of 10-20% of each large table). A small table's 20% cache holds fewer
#: rows than a request uses and misses a third of its keys on every request
#: (benchmarks/history/2026-11-27-criteo-dlrm-on-an-h200.md).
WHOLE_TABLE_MAX_BYTES = 64 << 20
#: HPS's default (HugeCTR v23.09.00 src/hps/inference_utils.cpp L529-533, read for
#: docs/upstream-notes.md)
HIT_RATE_THRESHOLD = 0.9
#: vectors: the hash's [-1, 1) times this (a power of two, so the product is exact)
VECTOR_SCALE = 0.25
#: rows per chunk written (32 MB of fp32 vectors at dim 128; the hash's uint64
#: temporaries are twice that)
CHUNK_ROWS = 1 << 16
DENSE_FILE_FLOATS = sum(
    i * o + o
    for i, o in zip(
        (DENSE_DIM, *BOTTOM_MLP[:-1], INTERACTION_DIM, *TOP_MLP[:-1]), BOTTOM_MLP + TOP_MLP
    )
)


def table_rows(scale: float, min_rows: int = DEFAULT_MIN_ROWS) -> List[int]:
    """Rows of each table at ``scale`` (0 < scale <= 1): a table of at most ``min_rows``
    rows whole, a larger one ``max(min_rows, ceil(rows * scale))``."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    return [r if r <= min_rows else max(min_rows, math.ceil(r * scale)) for r in CRITEO_1TB_ROWS]


def key_offsets() -> List[int]:
    """The first key of each table: the full-size row counts of the tables before it."""
    return [int(x) for x in np.concatenate([[0], np.cumsum(CRITEO_1TB_ROWS)[:-1]])]


def table_keys(table: int, start: int, stop: int) -> np.ndarray:
    """The keys of rows ``start..stop-1`` of ``table`` (int64)."""
    return np.arange(start, stop, dtype=np.int64) + key_offsets()[table]


def table_vectors(seed: int, table: int, keys: np.ndarray) -> np.ndarray:
    """The float32 ``[n, 128]`` vectors of ``keys`` in ``table``: a function of (seed,
    table, key) alone, uniform in [-VECTOR_SCALE, VECTOR_SCALE)."""
    return expected_vectors(seed, table, keys, EMBEDDING_DIM) * np.float32(VECTOR_SCALE)


def dense_parameters(seed: int) -> List[Tuple[np.ndarray, np.ndarray]]:
    """``(W [in, out], b [out])`` float32 of every InnerProduct in network order (bottom
    MLP, then top MLP): normal weights of standard deviation ``sqrt(2 / in)`` (He: ReLU
    follows) and ``sqrt(1 / in)`` for the last layer (LeCun: the logit), zero biases.
    With the vectors' :data:`VECTOR_SCALE` this spreads the predictions over the perf
    inputs from about 0.2 to 0.93 (1st to 99th percentile), the keys and DES each moving
    them (tests/unit/test_criteo_dlrm.py)."""
    rng = np.random.default_rng([seed, 0xDE45E])
    dims = (DENSE_DIM, *BOTTOM_MLP, INTERACTION_DIM, *TOP_MLP)
    out = []
    pairs = list(zip(dims[:-1], dims[1:]))
    del pairs[len(BOTTOM_MLP)]  # bottom MLP's output -> interaction: no layer
    for k, (i, o) in enumerate(pairs):
        std = math.sqrt(1.0 / i) if k == len(pairs) - 1 else math.sqrt(2.0 / i)
        w = (rng.standard_normal((i, o)) * std).astype(np.float32)
        out.append((w, np.zeros(o, np.float32)))
    return out


def network_json() -> Dict:
    """The HugeCTR network JSON (the layers this project's parser takes, as the demo DLRM
    writes them: examples/dlrm/torch_dlrm.py ``hugectr_layers``)."""
    layers: List[Dict] = [
        {
            "name": "data",
            "type": "Data",
            "label": {"top": "label", "label_dim": 1},
            "dense": {"top": "dense", "dense_dim": DENSE_DIM},
            "sparse": [
                {
                    "top": f"data{t}",
                    "type": "DistributedSlot",
                    "max_feature_num_per_sample": 1,
                    "slot_num": 1,
                }
                for t in range(NUM_TABLES)
            ],
        }
    ]
    for t in range(NUM_TABLES):
        layers.append(
            {
                "name": f"sparse_embedding{t}",
                "type": "DistributedSlotSparseEmbeddingHash",
                "bottom": f"data{t}",
                "top": f"sparse_embedding{t}",
                "sparse_embedding_hparam": {
                    "max_vocabulary_size_per_gpu": CRITEO_1TB_ROWS[t],
                    "embedding_vec_size": EMBEDDING_DIM,
                    "combiner": "sum",
                },
            }
        )
    fc = 0

    def mlp(widths: Sequence[int], bottom: str, last_relu: bool) -> str:
        nonlocal fc
        for k, width in enumerate(widths):
            fc += 1
            layers.append(
                {
                    "name": f"fc{fc}",
                    "type": "InnerProduct",
                    "bottom": bottom,
                    "top": f"fc{fc}",
                    "fc_param": {"num_output": width},
                }
            )
            bottom = f"fc{fc}"
            if last_relu or k < len(widths) - 1:
                layers.append(
                    {"name": f"relu{fc}", "type": "ReLU", "bottom": bottom, "top": f"relu{fc}"}
                )
                bottom = f"relu{fc}"
        return bottom

    bottom = mlp(BOTTOM_MLP, "dense", last_relu=True)
    layers.append(
        {
            "name": "concat_embedding",
            "type": "Concat",
            "axis": 1,
            "bottom": [f"sparse_embedding{t}" for t in range(NUM_TABLES)],
            "top": "concat_embedding",
        }
    )
    layers.append(
        {
            "name": "interaction1",
            "type": "Interaction",
            "bottom": [bottom, "concat_embedding"],
            "top": "interaction1",
        }
    )
    last = mlp(TOP_MLP, "interaction1", last_relu=False)
    layers.append(
        {
            "name": "loss",
            "type": "BinaryCrossEntropyLoss",
            "bottom": [last, "label"],
            "top": "loss",
        }
    )
    return {"layers": layers}


# -- perf_analyzer inputs ------------------------------------------------------------------


def zipf_rows(rng: np.random.Generator, rows: int, n: int, alpha: float = ZIPF_ALPHA):
    """``n`` row indices of a table of ``rows`` rows drawn with a power-law popularity:
    the rank ``r`` (1 = most popular) has a probability proportional to ``r^-alpha``
    (inverse transform of the continuous law on [1, rows + 1), floored). Ranks are
    scattered over the rows by a fixed bijection (``rank * 2^31-1 mod rows``), so the
    popular rows are not the first ones."""
    u = rng.random(n)
    if alpha == 1.0:
        x = np.exp(u * np.log(rows + 1.0))
    else:
        e = 1.0 - alpha
        x = ((np.power(rows + 1.0, e) - 1.0) * u + 1.0) ** (1.0 / e)
    rank = np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)
    return (rank * np.int64(2**31 - 1)) % np.int64(rows)


def perf_request(
    rng: np.random.Generator,
    rows: Sequence[int],
    batch: int,
    unseen_fraction: float = UNSEEN_FRACTION,
    alpha: float = ZIPF_ALPHA,
) -> Dict[str, np.ndarray]:
    """One request of ``batch`` samples: ``DES`` float32 ``[batch * 13]`` (``log(1 + x)``
    of x ~ Exponential(mean 10), standing in for Criteo's log-transformed counts),
    ``CATCOLUMN`` int64 ``[batch * 26]`` sample-major (per table a power-law key; a
    share ``unseen_fraction`` of them in no table), ``ROWINDEX`` int32 (per table
    ``0..batch``: one key per slot)."""
    des = np.log1p(rng.exponential(10.0, (batch, DENSE_DIM))).astype(np.float32)
    cat = np.empty((batch, len(rows)), np.int64)
    offsets = key_offsets()
    for t, n in enumerate(rows):
        keys = zipf_rows(rng, n, batch, alpha) + offsets[t]
        unseen = rng.random(batch) < unseen_fraction
        k = int(unseen.sum())
        keys[unseen] = UNSEEN_BASE + t * UNSEEN_SPAN + rng.integers(0, UNSEEN_SPAN, k)
        cat[:, t] = keys
    rowindex = np.tile(np.arange(batch + 1, dtype=np.int32), len(rows))
    return {"DES": des.reshape(-1), "CATCOLUMN": cat.reshape(-1), "ROWINDEX": rowindex}


PERF_TYPES = {"DES": np.dtype("<f4"), "CATCOLUMN": np.dtype("<i8"), "ROWINDEX": np.dtype("<i4")}


def perf_tensor(a: np.ndarray, b64: bool) -> Dict:
    """One input of perf_analyzer's ``--input-data`` JSON: ``{"content": [...]}`` or
    ``{"b64": ...}`` (the raw little-endian bytes), with its ``shape``."""
    if b64:
        return {"b64": base64.b64encode(a.tobytes()).decode("ascii"), "shape": [int(a.size)]}
    return {"content": a.tolist(), "shape": [int(a.size)]}


def decode_perf_tensor(name: str, value: Dict) -> np.ndarray:
    """The array of one input of a perf input file (``content`` or ``b64``)."""
    if "b64" in value:
        return np.frombuffer(base64.b64decode(value["b64"]), dtype=PERF_TYPES[name])
    return np.asarray(value["content"], dtype=PERF_TYPES[name])


def perf_shapes(batch: int) -> Dict[str, int]:
    """Elements of each input of a request of ``batch`` samples (perf_analyzer ``--shape``)."""
    return {
        "DES": batch * DENSE_DIM,
        "CATCOLUMN": batch * NUM_TABLES,
        "ROWINDEX": NUM_TABLES * (batch + 1),
    }


def perf_file_name(name: str, batch: int) -> str:
    """The perf input file of model ``name`` for ``batch`` samples, in the repository's
    directory: a file, not a folder (Triton takes every folder there for a model)."""
    return f"perf_{name}_{batch}.json"


def perf_command(name: str, batch: int) -> str:
    """The perf_analyzer command line for the file of ``batch`` samples."""
    shapes = " ".join(f"--shape {k}:{v}" for k, v in perf_shapes(batch).items())
    return f"triton-rec-perf -m {name} -b 1 --input-data {perf_file_name(name, batch)} {shapes}"


def write_perf_inputs(
    out: str,
    name: str,
    rows: Sequence[int],
    seed: int,
    batch_sizes: Sequence[int],
    requests: int,
    b64_from_batch: int = B64_FROM_BATCH,
) -> List[str]:
    """One perf_analyzer input file per batch size (``requests`` distinct requests each,
    perf_analyzer cycles through them; ``b64`` content from ``b64_from_batch`` samples on)
    and ``perf_<name>.sh`` (the commands); returns the paths."""
    paths = []
    for batch in batch_sizes:
        rng = np.random.default_rng([seed, 0x9E7F, batch])
        b64 = batch >= b64_from_batch
        data = [
            {k: perf_tensor(v, b64) for k, v in perf_request(rng, rows, batch).items()}
            for _ in range(requests)
        ]
        path = os.path.join(out, perf_file_name(name, batch))
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"data": data}, f)
        paths.append(path)
    if not batch_sizes:
        return paths
    cmds = os.path.join(out, f"perf_{name}.sh")
    with open(cmds, "w", encoding="utf-8") as f:
        f.write(f"# perf_analyzer runs of {name}, from the model repository's directory\n")
        f.write("# (add -i grpc, --concurrency-range 1:4, ...); -b 1: a request is one row\n")
        f.write('cd "$(dirname "$0")"\n')
        for batch in batch_sizes:
            f.write(perf_command(name, batch) + "\n")
    return paths + [cmds]


# -- the repository ------------------------------------------------------------------------


def config_pbtxt(name: str, kind: str, instances: int = 1, dense_math: str = "fp32") -> str:
    """The model's config.pbtxt (backend hugectr, the inputs of model_repository/dlrm);
    ``dense_math`` other than fp32: the parameter that sets a GPU instance's GEMMs
    (docs/precision.md, "Reduced-precision dense layers")."""
    gpus = " gpus: [ 0 ]" if kind == "KIND_GPU" else ""
    math = (
        f'parameters {{ key: "dense_math" value: {{ string_value: "{dense_math}" }} }}\n'
        if dense_math != "fp32"
        else ""
    )
    return (
        "# Generated by `python -m ps_loader criteo-dlrm`: MLPerf DLRM's Criteo 1TB shape\n"
        "# (26 tables of dim 128, bottom MLP 512-256-128, dot interaction, top MLP\n"
        "# 1024-1024-512-256-1), untrained weights. Inputs as NVIDIA's HugeCTR backend, one\n"
        "# row per request ([1, n]); perf_analyzer inputs: ../perf_<name>_<batch>.json.\n"
        f'name: "{name}"\n'
        'backend: "hugectr"\n'
        f"max_batch_size: {MAX_BATCH_SIZE}\n"
        "input [\n"
        '  { name: "DES" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true },\n'
        '  { name: "CATCOLUMN" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },\n'
        '  { name: "ROWINDEX" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true }\n'
        "]\n"
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        "dynamic_batching { max_queue_delay_microseconds: 0 }\n"
        f"instance_group [ {{ count: {instances} kind: {kind}{gpus} }} ]\n" + math
    )


def sparse_file_name(name: str, table: int, precision: str) -> str:
    """Table ``table``'s file in the version directory: a HugeCTR sparse directory in
    fp32, an encoded ``.npz`` otherwise."""
    if precision == "fp32":
        return f"{name}{table}_sparse_0.model"
    return f"{name}{table}_sparse_0.{precision}.npz"


def ps_entry(name: str, precision: str, kind: str = "KIND_CPU") -> Dict:
    """The model's ps.json ``models[]`` entry (paths relative to the repository). A
    ``KIND_GPU`` model caches :data:`GPUCACHEPER` of each large table on its GPU, as the HPS
    reference runs did, and holds the tables of at most :data:`WHOLE_TABLE_MAX_BYTES` whole
    there; a ``KIND_CPU`` one reads the memory-mapped tables themselves
    (``gpucache`` false: a CPU cache would hold a second copy of rows already mapped)."""
    rel = os.path.join(name, "1")
    entry = {
        "model": name,
        "sparse_files": [
            os.path.join(rel, sparse_file_name(name, t, precision)) for t in range(NUM_TABLES)
        ],
        "dense_file": os.path.join(rel, f"{name}_dense_0.model"),
        "network_file": os.path.join(rel, f"{name}.json"),
        "embedding_table_names": [f"C{t + 1}" for t in range(NUM_TABLES)],
        "embedding_vecsize_per_table": [EMBEDDING_DIM] * NUM_TABLES,
        "maxnum_catfeature_query_per_table_per_sample": [1] * NUM_TABLES,
        "default_value_for_each_table": [0.0] * NUM_TABLES,
        "label_dim": 1,
        "slot_num": NUM_TABLES,
        "deployed_device_list": [0],
        "max_batch_size": MAX_BATCH_SIZE,
        "gpucache": kind == "KIND_GPU",
        "gpucacheper": GPUCACHEPER,
        "hit_rate_threshold": HIT_RATE_THRESHOLD,
    }
    if kind == "KIND_GPU":
        entry["whole_table_max_bytes"] = WHOLE_TABLE_MAX_BYTES
    if precision != "fp32":
        entry["embedding_precision"] = [precision] * NUM_TABLES
    return entry


def merge_ps_json(path: str, entry: Dict) -> None:
    """Write ``entry`` into the ps.json at ``path``: replacing the model's entry, keeping
    the others (a new file when there is none)."""
    doc: Dict = {"supportlonglong": True, "models": []}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    models = [m for m in doc.get("models", []) if m.get("model") != entry["model"]]
    doc["models"] = models + [entry]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def table_bytes(rows: int, precision: str) -> int:
    """Bytes of one table's rows and keys on disk (without the .npz's few hundred bytes
    of headers)."""
    return rows * (8 + RowCodec(precision, EMBEDDING_DIM).row_bytes)


def model_bytes(rows: Sequence[int], precision: str) -> int:
    """Bytes of the tables and the dense file (the network JSON and configs: ~10 KB more)."""
    return sum(table_bytes(r, precision) for r in rows) + 4 * DENSE_FILE_FLOATS


@dataclass
class Written:
    """What :func:`write_criteo_dlrm` wrote.

    Args:
        out: the repository directory; name: the model; precision: its tables'.
        rows: rows per table; table_bytes: bytes of the tables written.
        seconds_tables: time spent writing tables; seconds: the whole run.
        files: the perf input files and the other files written.
    """

    out: str
    name: str
    precision: str
    rows: List[int]
    table_bytes: int = 0
    seconds_tables: float = 0.0
    seconds: float = 0.0
    files: List[str] = field(default_factory=list)


def argument_problem(
    scale: float, min_rows: int, batch_sizes: Sequence[int], kind: str
) -> Optional[str]:
    """What is wrong with these arguments of :func:`write_criteo_dlrm`, or None."""
    if not 0 < scale <= 1:
        return f"--scale must be in (0, 1], got {scale}"
    if min_rows < 1:
        return f"--min-rows must be >= 1, got {min_rows}"
    bad = [b for b in batch_sizes if not 1 <= b <= MAX_BATCH_SIZE]
    if bad:
        return f"batch sizes must be in 1..{MAX_BATCH_SIZE} (max_batch_size), got {bad}"
    if kind not in ("KIND_CPU", "KIND_GPU"):
        return f"kind must be KIND_CPU or KIND_GPU, got {kind!r}"
    return None


def write_table(
    path: str, seed: int, table: int, rows: int, precision: str, chunk_rows: int = CHUNK_ROWS
) -> None:
    """Write one table chunk by chunk: a HugeCTR sparse directory (fp32) or an encoded
    ``.npz`` (fp16, int8)."""
    codec = RowCodec(precision, EMBEDDING_DIM)
    if precision == "fp32":
        writer = SparseDirWriter(path, EMBEDDING_DIM, rows)
    else:
        writer = NpzRowsWriter(path, rows, codec)
    with writer as w:
        for a in range(0, rows, chunk_rows):
            keys = table_keys(table, a, min(rows, a + chunk_rows))
            w.append(keys, codec.encode(table_vectors(seed, table, keys)))


def write_criteo_dlrm(
    out: str,
    scale: float,
    name: str = "dlrm_criteo",
    precision: str = "fp32",
    kind: str = "KIND_CPU",
    seed: int = 0,
    min_rows: int = DEFAULT_MIN_ROWS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    perf_requests: int = 4,
    instances: int = 1,
    progress: Optional[Callable[[str], None]] = None,
    b64_from_batch: int = B64_FROM_BATCH,
) -> Written:
    """Write the model repository into ``out`` (see the module docstring); ps.json gets
    the model's entry (other models in it are kept). Returns what was written."""
    t0 = time.perf_counter()
    RowCodec(precision, EMBEDDING_DIM)  # a bad precision fails before anything is written
    problem = argument_problem(scale, min_rows, batch_sizes, kind)
    if problem:
        raise ValueError(problem)
    rows = table_rows(scale, min_rows)
    done = Written(out, name, precision, rows)
    version = os.path.join(out, name, "1")
    os.makedirs(version, exist_ok=True)
    for t, n in enumerate(rows):
        t1 = time.perf_counter()
        path = os.path.join(version, sparse_file_name(name, t, precision))
        write_table(path, seed, t, n, precision)
        dt = time.perf_counter() - t1
        done.seconds_tables += dt
        done.table_bytes += table_bytes(n, precision)
        if progress is not None:
            mb = table_bytes(n, precision) / 1e6
            progress(
                f"table {t + 1}/{NUM_TABLES} C{t + 1}: {n:,} rows, {mb:,.1f} MB in {dt:.1f} s "
                f"({mb / max(dt, 1e-9):,.0f} MB/s)"
            )
    params = np.concatenate([a.reshape(-1) for wb in dense_parameters(seed) for a in wb])
    params.astype("<f4").tofile(os.path.join(version, f"{name}_dense_0.model"))
    with open(os.path.join(version, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump(network_json(), f, indent=1)
        f.write("\n")
    with open(os.path.join(out, name, "config.pbtxt"), "w", encoding="utf-8") as f:
        f.write(config_pbtxt(name, kind, instances))
    merge_ps_json(os.path.join(out, "ps.json"), ps_entry(name, precision, kind))
    done.files = write_perf_inputs(
        out, name, rows, seed, batch_sizes, perf_requests, b64_from_batch
    )
    done.seconds = time.perf_counter() - t0
    return done


# -- --help --------------------------------------------------------------------------------

HELP_DESCRIPTION = """\
Write a servable model repository: a DLRM of MLPerf's Criteo 1TB shape, untrained, every
value a function of --seed. OUT/ps.json (the model's entry added or replaced),
OUT/NAME/config.pbtxt (backend "hugectr", inputs DES/CATCOLUMN/ROWINDEX,
max_batch_size 65536), OUT/NAME/1/: 26 embedding tables of dim 128 (HugeCTR sparse
directories in fp32, encoded .npz tables in fp16/int8), the HugeCTR network JSON
(dense 13 -> 512-256-128 ReLU, dot interaction of 27 vectors -> 480, 1024-1024-512-256-1,
sigmoid) and its dense file; OUT/perf_NAME_<batch>.json: perf_analyzer inputs (power-law
keys, Zipf 1.05 per table, 1% keys in no table) and OUT/perf_NAME.sh, their commands.

Rows per table: MLPerf's 40M-capped Criteo 1TB counts (HugeCTR samples/dlrm) times
--scale; a table of at most --min-rows rows is kept whole, a larger one gets
max(min_rows, ceil(rows * scale)) rows."""

#: generation times measured on a 2-core x86-64 machine shared with other work (so +-30%),
#: files in the page cache (a disk slower than the MB/s below sets the pace instead):
#: scale -> (seconds of the whole command with the default batch sizes, of which ~2.3 s
#: write the 170 MB of perf inputs; MB/s of the tables as written), fp32
MEASURED_FP32: Dict[float, Tuple[float, float]] = {
    0.0001: (2.7, 171.0),
    0.001: (3.6, 164.0),
    0.01: (9.0, 147.0),
}
#: the same, int8 (MB of int8 rows: the vectors are hashed, then encoded)
MEASURED_INT8: Dict[float, Tuple[float, float]] = {
    0.0001: (2.8, 33.0),
    0.001: (3.8, 38.0),
    0.01: (9.3, 41.0),
}
HELP_SCALES = (0.0001, 0.001, 0.01, 0.05, 1.0)
#: bytes of the perf input files with the default batch sizes and 4 requests each
#: (measured: ``du -sb`` of the files; the b64 files' size does not depend on the scale)
PERF_BYTES_DEFAULT = 170_000_000


def help_epilog() -> str:
    """The size table of ``--help``: rows and disk computed from the row counts, times
    measured (or extrapolated from the measured MB/s)."""
    perf_bytes = PERF_BYTES_DEFAULT
    lines = [
        "size and time by scale (disk: tables + dense file, exact; perf inputs extra;",
        "time: measured here, 2 shared cores, or ~ extrapolated from the MB/s at 0.01):",
        "",
        f"{'scale':>7} {'rows':>12} {'fp32 GB':>8} {'fp16 GB':>8} {'int8 GB':>8} "
        f"{'fp32 time':>10} {'int8 time':>10}",
    ]
    for s in HELP_SCALES:
        rows = table_rows(s)
        gb = {p: model_bytes(rows, p) / 1e9 for p in ("fp32", "fp16", "int8")}
        times = []
        for p, measured in (("fp32", MEASURED_FP32), ("int8", MEASURED_INT8)):
            if s in measured:
                times.append(_duration(measured[s][0]))
            elif measured:
                rate = measured[max(measured)][1]
                times.append("~" + _duration(sum(table_bytes(r, p) for r in rows) / 1e6 / rate))
            else:
                times.append("-")
        lines.append(
            f"{s:>7g} {sum(rows):>12,} {gb['fp32']:>8.3f} {gb['fp16']:>8.3f} {gb['int8']:>8.3f} "
            f"{times[0]:>10} {times[1]:>10}"
        )
    lines += [
        "",
        f"Perf inputs: ~{perf_bytes / 1e6:.0f} MB more (default batch sizes, 4 requests each).",
        "KIND_CPU reads the memory-mapped tables (gpucache false); KIND_GPU caches",
        f"gpucacheper {GPUCACHEPER} of each table's rows on the GPU, and holds the tables",
        f"of at most {WHOLE_TABLE_MAX_BYTES >> 20} MiB whole there (whole_table_max_bytes).",
        "",
        "example: ps-loader criteo-dlrm --out repo --scale 0.001 --precision int8",
        "         triton-rec-server serve --model-repository repo; sh repo/perf_dlrm_criteo.sh",
    ]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
