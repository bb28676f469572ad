#!/usr/bin/env python3
"""Served overhead: every backend beside a Python floor with the same I/O, in ONE server.

One run, loopback only, one tritonserver, every model with the same scheduling (2 CPU
instances, the shipped dynamic-batching settings). Models, grouped by interface:

- ``KEYS``/``NUMKEYS`` (64 samples x 26 Zipf(1.05) keys per request, one 2M x 16 table):
  ``floor_hps`` (Python backend, reads both inputs, returns zeros of the answer's size),
  ``floor_native_hps`` (the same in C++: backend ``trec_floor``, the native floor),
  ``naive_hps`` (what a user writes in an afternoon: a private copy of the table per
  instance and a Python dict from key to row), ``hps`` (our backend, ps.json entry with
  only the required keys, i.e. every default: cache on), ``hps_nocache``
  (``gpucache: false``), ``hps_py`` (the same model.py in Triton's Python backend) and
  ``hps_fp16`` (the table stored in fp16, ``embedding_precision``);
- ``DES``/``CATCOLUMN``/``ROWINDEX`` (a Criteo-shaped DLRM: 13 dense features, 26 slots
  in two tables, vec 32, bottom MLP 64-48-32, top MLP 64-32-1, trained here for a few
  seconds; requests of 1, 64 and 1,024 held-out samples): ``floor_dlrm``,
  ``floor_native_dlrm`` (the native floor), ``dlrm``
  (HugeCTR dense file run by numpy), ``dlrm_onnx`` (the same network in onnxruntime),
  ``dlrm_py`` (Python backend) and ``dlrm_fp16`` (``dlrm`` with fp16 tables);
- the ensemble interface (``DES``/``KEYS``/``NUMKEYS``/``ROWINDEX``): ``floor_ensemble``,
  ``dlrm_ensemble`` (``dlrm_hps`` -> ``dlrm_dense``, the ONNX network, as shipped) and
  ``dlrm_ensemble_hugectr`` (``dlrm_hps`` -> ``dlrm_dense_hugectr``: the HugeCTR network,
  which the native backend runs natively);
- the workload named (issue 25): the groups above replay ``--requests-per-file`` requests,
  so after the warm-up every key is cached (**all-hit**). ``hps_misses`` and
  ``dlrm_misses`` feed ``hps_5pct`` / ``dlrm_5pct`` (ps.json defaults but ``gpucacheper``
  0.05: a cache smaller than the working set, HPS's hit-rate rules) a stream of
  ``--miss-requests`` distinct requests (Zipf keys for hps, held-out samples for DLRM),
  beside the C++ floor; the same two models are in the all-hit groups too, so
  misses / all-hit is the same table and cache on the two workloads.

Every group is measured in rounds; within a round the models of a group run back to
back for each protocol and concurrency, starting with a different model each round, so
a figure is always compared with a floor measured minutes apart in the same server.
Each perf_analyzer run uses time windows; its server CPU time (tritonserver and every
backend stub, from /proc) is divided by the inferences the server counted in that time.

Reported per (group, protocol, concurrency, model): median over rounds of infer/s,
p50/p99 latency, server compute time, server CPU us per inference, and the ratios to
the group's floor (and, for hps, to the naive model), computed per round.

    .venv/bin/python benchmarks/bench_overhead.py [--rounds 2] [--protocols grpc,http]
        [--concurrency 1,2,8] [--dlrm-batches 1,64,1024] [--groups hps,dlrm,ensemble]
        [--interval-ms 1500] [--out-dir DIR] [--png benchmarks/bench_overhead.png]
        [--profile hps,dlrm --profile-seconds 20]
    .venv/bin/python benchmarks/bench_overhead.py --quick      # one round, gRPC, c=1, batch 1

``--profile MODELS``: after the sweep (or instead of it with ``--rounds 0``), load each
model with perf_analyzer (gRPC, concurrency 1) while py-spy records one of its instance
processes; writes ``profile_<model>.svg`` (flame graph) and ``profile_<model>.txt``
(the hottest frames) into the output directory.
Raw outputs (CSVs, perf_analyzer logs, server log, results.json, tables.md) go to
``--out-dir`` (default: a new directory under /tmp, printed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_perf_analyzer  # noqa: E402
from machine import machine_info  # noqa: E402

from triton_rec.triton import perf_analyzer  # noqa: E402
from triton_rec.triton.runtime import TritonServer  # noqa: E402
from triton_rec.util.procfs import tree_cpu_seconds  # noqa: E402

SEED = 2026
HELD_OUT_SEED = 31337
HPS_ROWS, HPS_VEC, HPS_KEYS_PER_SAMPLE, HPS_SAMPLES, ZIPF = 2_000_000, 16, 26, 64, 1.05


def shipped_scheduling() -> str:
    """The scheduling every model here gets: the ``dynamic_batching`` and ``instance_group``
    lines of the shipped example ``model_repository/dlrm/config.pbtxt``."""
    text = (ROOT / "model_repository" / "dlrm" / "config.pbtxt").read_text()
    lines = [
        ln for ln in text.splitlines() if ln.startswith(("dynamic_batching", "instance_group"))
    ]
    assert len(lines) == 2, (
        "model_repository/dlrm/config.pbtxt: one-line dynamic_batching and instance_group"
    )
    return "\n".join(lines) + "\n"


SCHEDULING = shipped_scheduling()
RAGGED = "allow_ragged_batch: true"

HPS_IO = f"""\
max_batch_size: 1024
input [
  {{ name: "KEYS" data_type: TYPE_INT64 dims: [ -1 ] {RAGGED} }},
  {{ name: "NUMKEYS" data_type: TYPE_INT32 dims: [ -1 ] {RAGGED} }}
]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
"""
DLRM_IO = f"""\
max_batch_size: 1024
input [
  {{ name: "DES" data_type: TYPE_FP32 dims: [ -1 ] {RAGGED} }},
  {{ name: "CATCOLUMN" data_type: TYPE_INT64 dims: [ -1 ] {RAGGED} }},
  {{ name: "ROWINDEX" data_type: TYPE_INT32 dims: [ -1 ] {RAGGED} }}
]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
"""
ENSEMBLE_IO = """\
max_batch_size: 0
input [
  { name: "DES" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "KEYS" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "NUMKEYS" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "ROWINDEX" data_type: TYPE_INT32 dims: [ -1 ] }
]
output [ { name: "PREDICTION" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

FLOOR_MODEL = '''\
"""The floor: reads every input like a real model, returns zeros of the answer's size."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in (cfg.get("parameters") or {}).items()}
        self.inputs = [i["name"] for i in cfg["input"]]
        self.output = cfg["output"][0]["name"]
        self.kind = p["floor"]
        self.vec = np.array([int(v) for v in p.get("vec_sizes", "1").split(",")], np.int64)
        self.tables, self.slots = int(p.get("tables", "0")), int(p.get("slots", "1"))

    def execute(self, requests):
        responses = []
        for r in requests:
            t = {n: pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs}
            if self.kind == "hps":
                n = int(t["NUMKEYS"].reshape(-1).astype(np.int64) @ self.vec)
            else:
                n = (t["ROWINDEX"].size - self.tables) // self.slots
            out = pb_utils.Tensor(self.output, np.zeros(n, np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
'''

NAIVE_MODEL = '''\
"""The naive lookup model: a private copy of the table per instance, a Python dict."""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in (cfg.get("parameters") or {}).items()}
        d = os.path.join(args["model_repository"], "..", p["sparse"])  # model dir -> repository
        self.vec = int(p["vec_size"])
        keys = np.fromfile(os.path.join(d, "key"), np.int64)
        self.vectors = np.fromfile(os.path.join(d, "emb_vector"), np.float32).reshape(-1, self.vec)
        self.index = dict(zip(keys.tolist(), range(len(keys))))
        self.default = float(p["default"])

    def execute(self, requests):
        responses = []
        for r in requests:
            keys = pb_utils.get_input_tensor_by_name(r, "KEYS").as_numpy().reshape(-1)
            pb_utils.get_input_tensor_by_name(r, "NUMKEYS").as_numpy()
            rows = np.fromiter((self.index.get(k, -1) for k in keys.tolist()), np.int64, keys.size)
            out = self.vectors[rows]
            out[rows < 0] = self.default
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", out.reshape(-1))]))
        return responses
'''


# ----------------------------------------------------------------------------- repository


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _config(name: str, backend: str, io: str, params: dict = None, scheduling: str = None) -> str:
    scheduling = SCHEDULING if scheduling is None else scheduling
    lines = [f'name: "{name}"', f'backend: "{backend}"', io.rstrip(), scheduling.rstrip()]
    for k, v in (params or {}).items():
        lines.append(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}')
    return "\n".join(lines) + "\n"


def _shipped_config(repo: Path, shipped: str, name: str, *replacements) -> None:
    """The demo repository's model ``shipped`` as ``name`` in ``repo`` (its config.pbtxt
    renamed, then each (old, new) of ``replacements`` applied; an empty version folder)."""
    text = (ROOT / "model_repository" / shipped / "config.pbtxt").read_text()
    for old, new in ((f'name: "{shipped}"', f'name: "{name}"'),) + replacements:
        text = text.replace(old, new)
    _write(repo / name / "config.pbtxt", text)
    (repo / name / "1").mkdir(parents=True, exist_ok=True)


def bench_dlrm_config():
    """The Criteo-shaped DLRM of this benchmark (26 slots, vec 32)."""
    from examples.dlrm.torch_dlrm import DLRMConfig, TableSpec

    return DLRMConfig(
        dense_dim=13,
        tables=(
            TableSpec("onehot", rows=200_000, slot_num=20, vec_size=32, combiner="sum"),
            TableSpec(
                "multihot",
                rows=50_000,
                slot_num=6,
                max_keys_per_slot=3,
                vec_size=32,
                combiner="mean",
            ),
        ),
        bottom_mlp=(64, 48, 32),
        top_mlp=(64, 32),
    )


def build_repository(repo: Path, groups) -> dict:
    """Write every model of ``groups`` into ``repo``; returns what the inputs need."""
    from ps_loader.synthetic import SyntheticTable, table_keys, write_model

    ps_models, meta = [], {}
    if {"hps", "hps_misses"} & set(groups):
        t0 = time.monotonic()
        entry = write_model(
            str(repo),
            "hps",
            [SyntheticTable("t0", HPS_ROWS, HPS_VEC, HPS_KEYS_PER_SAMPLE)],
            seed=SEED,
        )
        # Only what ps.json requires: every other setting is the default (cache on).
        required = {
            k: entry[k]
            for k in (
                "model",
                "sparse_files",
                "embedding_table_names",
                "embedding_vecsize_per_table",
                "maxnum_catfeature_query_per_table_per_sample",
                "default_value_for_each_table",
                "max_batch_size",
            )
        }
        ps_models += [
            required,
            dict(required, model="hps_nocache", gpucache=False),
            dict(required, model="hps_py"),
            # the same table stored in fp16 (issue 15): the served cost of decoding
            dict(required, model="hps_fp16", embedding_precision=["fp16"]),
            dict(required, model="hps_5pct", gpucacheper=MISS_CACHE),
        ]
        _write(repo / "hps_5pct" / "config.pbtxt", _config("hps_5pct", "hps", HPS_IO))
        (repo / "hps_5pct" / "1").mkdir(parents=True, exist_ok=True)
        _write(repo / "hps" / "config.pbtxt", _config("hps", "hps", HPS_IO))
        # the same model.py in Triton's Python backend (the request path before issue 14)
        _write(repo / "hps_py" / "config.pbtxt", _config("hps_py", "hps_py", HPS_IO))
        (repo / "hps_py" / "1").mkdir(parents=True, exist_ok=True)
        _write(repo / "hps_fp16" / "config.pbtxt", _config("hps_fp16", "hps", HPS_IO))
        (repo / "hps_fp16" / "1").mkdir(parents=True, exist_ok=True)
        _write(repo / "hps_nocache" / "config.pbtxt", _config("hps_nocache", "hps", HPS_IO))
        (repo / "hps_nocache" / "1").mkdir(parents=True, exist_ok=True)
        _write(
            repo / "floor_hps" / "config.pbtxt",
            _config("floor_hps", "python", HPS_IO, {"floor": "hps", "vec_sizes": HPS_VEC}),
        )
        _write(repo / "floor_hps" / "1" / "model.py", FLOOR_MODEL)
        # the native floor (C++ backend trec_floor, issue 14): what Triton alone costs
        _write(
            repo / "floor_native_hps" / "config.pbtxt",
            _config("floor_native_hps", "trec_floor", HPS_IO, {"vec_sizes": HPS_VEC}),
        )
        (repo / "floor_native_hps" / "1").mkdir(parents=True, exist_ok=True)
        _write(
            repo / "naive_hps" / "config.pbtxt",
            _config(
                "naive_hps",
                "python",
                HPS_IO,
                {"sparse": entry["sparse_files"][0], "vec_size": HPS_VEC, "default": 0.0},
            ),
        )
        _write(repo / "naive_hps" / "1" / "model.py", NAIVE_MODEL)
        meta["hps_keys"] = table_keys(SEED, 0, HPS_ROWS)
        print(
            f"hps table written ({HPS_ROWS:,} x {HPS_VEC}) in {time.monotonic() - t0:.1f} s",
            flush=True,
        )
    if {"dlrm", "dlrm_misses", "ensemble"} & set(groups):
        from examples.dlrm import torch_dlrm as td

        t0 = time.monotonic()
        config = bench_dlrm_config()
        settings = td.TrainSettings(
            seed=SEED, epochs=1, train_rows=32768, eval_rows=4096, batch_size=512
        )
        result, entry = td.train_and_export(
            str(repo / "dlrm" / "1"), config, settings, ps_root=str(repo)
        )
        print(
            f"bench DLRM trained (held-out AUC {result.metrics['auc']:.3f}) and exported in "
            f"{time.monotonic() - t0:.1f} s",
            flush=True,
        )
        onnx = os.path.join(os.path.dirname(entry["dense_file"]), "dlrm_dense.onnx")
        ps_models += [
            entry,
            dict(entry, model="dlrm_onnx", dense_file=onnx),
            dict(entry, model="dlrm_hps", dense_file=onnx),
            dict(entry, model="dlrm_py"),
            dict(entry, model="dlrm_fp16", embedding_precision=["fp16"] * len(config.tables)),
            dict(entry, model="dlrm_5pct", gpucacheper=MISS_CACHE),
        ]
        _write(repo / "dlrm_5pct" / "config.pbtxt", _config("dlrm_5pct", "hugectr", DLRM_IO))
        (repo / "dlrm_5pct" / "1").mkdir(parents=True, exist_ok=True)
        tables, slots = len(config.tables), config.total_slots
        floor_p = {"floor": "samples", "tables": tables, "slots": slots}
        _write(repo / "dlrm" / "config.pbtxt", _config("dlrm", "hugectr", DLRM_IO))
        _write(repo / "dlrm_py" / "config.pbtxt", _config("dlrm_py", "hugectr_py", DLRM_IO))
        (repo / "dlrm_py" / "1").mkdir(parents=True, exist_ok=True)
        _write(repo / "dlrm_fp16" / "config.pbtxt", _config("dlrm_fp16", "hugectr", DLRM_IO))
        (repo / "dlrm_fp16" / "1").mkdir(parents=True, exist_ok=True)
        _write(repo / "dlrm_onnx" / "config.pbtxt", _config("dlrm_onnx", "hugectr", DLRM_IO))
        (repo / "dlrm_onnx" / "1").mkdir(parents=True, exist_ok=True)
        _write(
            repo / "floor_dlrm" / "config.pbtxt", _config("floor_dlrm", "python", DLRM_IO, floor_p)
        )
        _write(repo / "floor_dlrm" / "1" / "model.py", FLOOR_MODEL)
        native_p = {"tables": tables, "slots": slots}  # the native floor (trec_floor)
        _write(
            repo / "floor_native_dlrm" / "config.pbtxt",
            _config("floor_native_dlrm", "trec_floor", DLRM_IO, native_p),
        )
        (repo / "floor_native_dlrm" / "1").mkdir(parents=True, exist_ok=True)
        # The ensemble as model_repository/ ships it (its steps' configs are copied).
        for step in ("dlrm_hps", "dlrm_dense", "dlrm_ensemble"):
            _shipped_config(repo, step, step)
        # The same ensemble with the HugeCTR network as its dense step (ps.json entry
        # "dlrm": the dense file and network JSON), which the native backend runs natively.
        _shipped_config(
            repo,
            "dlrm_dense",
            "dlrm_dense_hugectr",
            ('string_value: "dlrm_hps"', 'string_value: "dlrm"'),
        )
        _shipped_config(
            repo,
            "dlrm_ensemble",
            "dlrm_ensemble_hugectr",
            ('model_name: "dlrm_dense"', 'model_name: "dlrm_dense_hugectr"'),
        )
        _write(
            repo / "floor_ensemble" / "config.pbtxt",
            _config("floor_ensemble", "python", ENSEMBLE_IO, floor_p, scheduling=""),
        )
        _write(repo / "floor_ensemble" / "1" / "model.py", FLOOR_MODEL)
        meta["dlrm"] = (config, SEED)
    _write(repo / "ps.json", json.dumps({"supportlonglong": True, "models": ps_models}, indent=1))
    return meta


# ----------------------------------------------------------------------------- inputs


def _entry(arr: np.ndarray) -> dict:
    return {"content": arr.reshape(-1).tolist(), "shape": [int(arr.size)]}


def write_inputs(
    meta: dict, groups, batches, requests: int, out: Path, miss_requests: int = 0
) -> dict:
    """perf_analyzer --input-data files: {(group, batch): path}. The ``*_misses`` groups get
    ``miss_requests`` distinct requests (the all-hit groups replay ``requests``)."""
    files = {}
    for group in ("hps", "hps_misses"):
        if group not in groups:
            continue
        from triton_rec.clients.hps_requests import perf_analyzer_data

        data = perf_analyzer_data(
            [meta["hps_keys"]],
            [HPS_KEYS_PER_SAMPLE],
            HPS_SAMPLES,
            miss_requests if group == "hps_misses" else requests,
            seed=SEED,
            zipf_alpha=ZIPF,
        )
        files[(group, HPS_SAMPLES)] = out / f"input_{group}.json"
        files[(group, HPS_SAMPLES)].write_text(json.dumps(data))
    if "dlrm" in meta:
        from examples.dlrm.torch_dlrm import HiddenModel

        config, seed = meta["dlrm"]
        streams = [("", requests)]
        if "dlrm_misses" in groups:
            streams.append(("_misses", miss_requests))
        for (suffix, count), n in ((st, n) for st in streams for n in batches):
            r = max(4, count // 2) if n >= 1024 else count
            data = HiddenModel(config, seed).sample(n * r, np.random.default_rng(HELD_OUT_SEED))
            fused, ens = [], []
            for i in range(r):
                req = data.hugectr_request(i * n, (i + 1) * n)
                fused.append({k: _entry(v) for k, v in req.items()})
                if suffix:  # the stream with misses: the dlrm interface only
                    continue
                keys = []
                for k, offsets in data.sparse:
                    s = (len(offsets) - 1) // len(data)
                    keys.append(k[offsets[i * n * s] : offsets[(i + 1) * n * s]])
                ens.append(
                    {
                        "DES": _entry(req["DES"]),
                        "KEYS": _entry(np.concatenate(keys).astype(np.int64)),
                        "NUMKEYS": _entry(np.array([len(k) for k in keys], np.int32)),
                        "ROWINDEX": _entry(req["ROWINDEX"]),
                    }
                )
            for group, rows in (("dlrm" + suffix, fused), ("ensemble" + suffix, ens)):
                if group in groups:
                    files[(group, n)] = out / f"input_{group}_{n}.json"
                    files[(group, n)].write_text(json.dumps({"data": rows}))
    return files


GROUP_MODELS = {
    "hps": [
        "floor_hps",
        "floor_native_hps",
        "naive_hps",
        "hps",
        "hps_nocache",
        "hps_py",
        "hps_fp16",
    ],
    "dlrm": ["floor_dlrm", "floor_native_dlrm", "dlrm", "dlrm_onnx", "dlrm_py", "dlrm_fp16"],
    "ensemble": ["floor_ensemble", "dlrm_ensemble", "dlrm_ensemble_hugectr"],
    # the stream with misses (its floor: the C++ one)
    "hps_misses": ["floor_native_hps", "hps_5pct"],
    "dlrm_misses": ["floor_native_dlrm", "dlrm_5pct"],
}
GROUP_MODELS["hps"].append("hps_5pct")  # the same model all-hit
GROUP_MODELS["dlrm"].append("dlrm_5pct")
#: gpucacheper of the models measured on the stream with misses (and all-hit)
MISS_CACHE = 0.05
FLOOR = {g: m[0] for g, m in GROUP_MODELS.items()}
NAIVE = {"hps": "naive_hps"}
NATIVE_FLOOR = {
    "hps": "floor_native_hps",
    "dlrm": "floor_native_dlrm",
    "hps_misses": "floor_native_hps",
    "dlrm_misses": "floor_native_dlrm",
}
#: Backends that run our model.py in Triton's Python backend beside the native ones, so
#: that both request paths are measured in one server: backend name -> backend/ folder.
PYTHON_PATH_BACKENDS = {"hps_py": "hps", "hugectr_py": "hugectr"}


def base_group(group: str) -> str:
    """``hps__d0`` -> ``hps``: the group a scheduling variant was made from."""
    return group.split("__", 1)[0]


def add_variants(repo: Path, groups, variants) -> list:
    """Copies of every model of ``groups`` (not the ensemble) with other scheduling, all in
    the same server: ``<model>__<variant>``. Returns the variant groups to measure."""
    ps = json.loads((repo / "ps.json").read_text())
    entries = {m["model"]: m for m in ps["models"]}
    out = []
    for group in groups:
        if group == "ensemble":
            raise SystemExit("--variant applies to the hps and dlrm groups only")
        for vname, sched in variants:
            vg = f"{group}__{vname}"
            GROUP_MODELS[vg] = [f"{m}__{vname}" for m in GROUP_MODELS[group]]
            FLOOR[vg] = f"{FLOOR[group]}__{vname}"
            if group in NATIVE_FLOOR:
                NATIVE_FLOOR[vg] = f"{NATIVE_FLOOR[group]}__{vname}"
            if group in NAIVE:
                NAIVE[vg] = f"{NAIVE[group]}__{vname}"
            for model in GROUP_MODELS[group]:
                name = f"{model}__{vname}"
                text = (
                    (repo / model / "config.pbtxt")
                    .read_text()
                    .replace(f'name: "{model}"', f'name: "{name}"')
                )
                text = text.replace(SCHEDULING.rstrip(), sched.rstrip())
                _write(repo / name / "config.pbtxt", text)
                (repo / name / "1").mkdir(parents=True, exist_ok=True)
                if (repo / model / "1" / "model.py").exists():
                    shutil.copy2(repo / model / "1" / "model.py", repo / name / "1" / "model.py")
                if model in entries:
                    ps["models"].append(dict(entries[model], model=name))
            out.append(vg)
    (repo / "ps.json").write_text(json.dumps(ps, indent=1))
    return out


def sanity_check(server: TritonServer, files: dict, groups) -> list:
    """One request of each file through each model; the models that should agree do."""
    import tritonclient.http as http

    types = {
        "DES": ("FP32", np.float32),
        "CATCOLUMN": ("INT64", np.int64),
        "ROWINDEX": ("INT32", np.int32),
        "KEYS": ("INT64", np.int64),
        "NUMKEYS": ("INT32", np.int32),
    }
    problems = []
    client = http.InferenceServerClient(server.http_url)
    try:
        for (group, n), path in files.items():
            if group not in groups:
                continue
            base, v = base_group(group), group[len(base_group(group)) :]
            row = json.loads(path.read_text())["data"][0]
            answers = {}
            for model in GROUP_MODELS[group]:
                ins = []
                for name, e in row.items():
                    arr = np.array(e["content"], dtype=types[name][1])
                    arr = arr if base == "ensemble" else arr[None, :]
                    i = http.InferInput(name, list(arr.shape), types[name][0])
                    i.set_data_from_numpy(arr)
                    ins.append(i)
                out = "PREDICTION" if base == "ensemble" else "OUTPUT0"
                try:
                    answers[model] = client.infer(model, ins).as_numpy(out).reshape(-1)
                except Exception as e:  # noqa: BLE001  (reported, not fatal)
                    problems.append(f"{model} n={n}: {e}")
            if base == "hps" and not np.array_equal(
                answers.get("naive_hps" + v), answers.get("hps_nocache" + v)
            ):
                problems.append(f"hps_nocache{v} and naive_hps{v} disagree")
            # the two request paths: the same lookups; the dense networks within fp32
            # rounding (the native executor sums in another order than numpy's BLAS calls)
            for x, y in (("hps", "hps_py"), ("dlrm", "dlrm_py")):
                a, b = answers.get(x + v), answers.get(y + v)
                if a is not None and b is not None and not np.allclose(a, b, rtol=1e-5, atol=1e-6):
                    problems.append(f"n={n}: {x}{v} (native) and {y}{v} (Python) disagree")
            # fp16 tables (issue 15): the hps answer is the fp32 answer rounded to fp16
            a, b = answers.get("hps" + v), answers.get("hps_fp16" + v)
            if (
                a is not None
                and b is not None
                and not np.array_equal(a.astype(np.float16).astype(np.float32), b)
            ):
                problems.append(f"n={n}: hps_fp16{v} is not hps{v} rounded to fp16")
            a, b = answers.get("dlrm" + v), answers.get("dlrm_fp16" + v)
            if a is not None and b is not None and not np.allclose(a, b, rtol=0, atol=1e-3):
                problems.append(f"n={n}: dlrm_fp16{v} differs from dlrm{v} by more than 1e-3")
            a, b = answers.get("dlrm_ensemble"), answers.get("dlrm_ensemble_hugectr")
            if a is not None and b is not None and not np.allclose(a, b, atol=1e-5):
                problems.append(f"n={n}: the ONNX and HugeCTR dense steps of the ensemble disagree")
            a, b = answers.get("dlrm" + v), answers.get("dlrm_onnx" + v)
            if (
                base == "dlrm"
                and a is not None
                and b is not None
                and not np.allclose(a, b, atol=1e-5)
            ):
                problems.append(f"n={n}: dlrm{v} and dlrm_onnx{v} disagree")
    finally:
        client.close()
    return problems


# ----------------------------------------------------------------------------- measuring


def inference_count(server: TritonServer, model: str) -> int:
    with urllib.request.urlopen(
        f"http://{server.http_url}/v2/models/{model}/stats", timeout=10
    ) as r:
        stats = json.loads(r.read())["model_stats"]
    return sum(int(s["inference_count"]) for s in stats)


def parse_csv(path: Path) -> dict:
    """What this benchmark reports of a perf_analyzer CSV (bench_perf_analyzer.parse_csv)."""
    r = bench_perf_analyzer.parse_csv(path)
    return {
        "infer_per_s": r["infer_per_s"],
        "p50_us": r["p50_us"],
        "p99_us": r["p99_us"],
        "server_queue_us": r["server_queue_us"],
        "server_compute_us": r["server_input_us"] + r["server_infer_us"] + r["server_output_us"],
    }


def run_perf(model, group, n, conc, protocol, server, files, out_dir, args, tag) -> dict:
    url = server.http_url if protocol == "http" else server.grpc_url
    rec = {
        "model": model,
        "group": group,
        "batch": n,
        "concurrency": conc,
        "protocol": protocol,
        "status": "ok",
    }
    for attempt, stability in enumerate((args.stability, 1000)):
        csv_path = out_dir / f"{tag}{'_retry' if attempt else ''}.csv"
        cmd = perf_analyzer.command(
            [
                "-m",
                model,
                "-u",
                url,
                "-i",
                protocol,
                "--input-data",
                str(files[(group, n)]),
                "--concurrency-range",
                str(conc),
                "--measurement-interval",
                str(args.interval_ms),
                "--stability-percentage",
                str(stability),
                "--max-trials",
                str(args.max_trials),
                "-f",
                str(csv_path),
            ]
        )
        rec["command"] = " ".join(cmd[1:])
        cpu0, inf0 = tree_cpu_seconds(server.process.pid), inference_count(server, model)
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=args.timeout,
                env=perf_analyzer.environment(),
            )
        except subprocess.TimeoutExpired:
            rec.update(status="failed", reason=f"timeout after {args.timeout} s")
            return rec
        cpu1, inf1 = tree_cpu_seconds(server.process.pid), inference_count(server, model)
        (out_dir / f"{tag}{'_retry' if attempt else ''}.log").write_text(done.stdout + done.stderr)
        if done.returncode == 0 and csv_path.exists():
            rec.update(parse_csv(csv_path))
            if inf1 > inf0:
                rec["cpu_us_per_infer"] = (cpu1 - cpu0) * 1e6 / (inf1 - inf0)
            m = re.search(r"Inference count: (\d+)\s+Execution count: (\d+)", done.stdout)
            if m and int(m.group(2)):
                rec["requests_per_exec"] = int(m.group(1)) / int(m.group(2))
            if attempt:
                rec["status"] = "unstable"
            return rec
        text = done.stdout + done.stderr
        rec.update(
            status="failed",
            reason=next(
                (ln.strip() for ln in text.splitlines() if "rror" in ln or "ailed" in ln),
                f"exit {done.returncode}",
            )[:200],
        )
        if "stable" not in text.lower():
            return rec
    return rec


def cache_hit_rate(server: TritonServer, model: str):
    try:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    hits = lookups = 0.0
    for line in text.splitlines():
        for name, acc in (("trec_cache_hits_total", "h"), ("trec_cache_lookups_total", "l")):
            if line.startswith(name + "{") and f'model="{model}"' in line:
                v = float(line.rsplit(" ", 1)[1])
                if acc == "h":
                    hits += v
                else:
                    lookups += v
    return hits / lookups if lookups else None


# ----------------------------------------------------------------------------- profiling


def _spy(spy: Path, pid: int, seconds: float, out: Path, fmt: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(spy),
            "record",
            "-p",
            str(pid),
            "-d",
            str(max(1, int(seconds))),
            "-r",
            "500",
            "-o",
            str(out),
            "-f",
            fmt,
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _samples(raw: Path) -> int:
    if not raw.exists():
        return 0
    return sum(int(line.rpartition(" ")[2]) for line in raw.read_text().splitlines() if " " in line)


def profile(server, files, models, seconds, out_dir) -> list:
    """py-spy flame graphs of the busiest instance process per model under perf_analyzer
    load (gRPC, concurrency 1): a short probe of every instance finds the one Triton
    sends the requests to, then a flame graph (SVG) and the raw stacks are recorded."""
    done = []
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        print(
            "py-spy is not installed (pip install py-spy, or the 'bench' extra): no profiles",
            flush=True,
        )
        return done
    for model in models:
        group = next(g for g, ms in GROUP_MODELS.items() if model in ms)
        n = min(b for g, b in files if g == group)
        pids = server.backend_pids(model)
        if not pids:
            print(f"profile {model}: no instance process found", flush=True)
            continue
        load = subprocess.Popen(
            perf_analyzer.command(
                [
                    "-m",
                    model,
                    "-u",
                    server.grpc_url,
                    "-i",
                    "grpc",
                    "--input-data",
                    str(files[(group, n)]),
                    "--concurrency-range",
                    "1",
                    "--measurement-interval",
                    str(int(2 * seconds * 1000) + 10000),
                    "--max-trials",
                    "1",
                    "-s",
                    "1000",
                ]
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env=perf_analyzer.environment(),
        )
        try:
            time.sleep(2.0)
            probes = [(pid, out_dir / f"probe_{model}_{pid}.txt") for pid in pids]
            for proc in [_spy(spy, pid, 3, path, "raw") for pid, path in probes]:
                proc.wait(60)
            pid = max(probes, key=lambda p: _samples(p[1]))[0]
            svg, raw = out_dir / f"profile_{model}.svg", out_dir / f"profile_{model}.txt"
            _spy(spy, pid, seconds, svg, "flamegraph").wait(seconds + 60)
            _spy(spy, pid, seconds, raw, "raw").wait(seconds + 60)
            done.append((model, svg, raw))
            print(f"profile {model} (pid {pid}): {svg}", flush=True)
        finally:
            load.terminate()
            load.wait(30)
    return done


def hottest(raw: Path, top: int = 25) -> str:
    """Self and total sample shares of the hottest frames of a py-spy raw (collapsed) file."""
    total, self_s, incl = 0, {}, {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        self_s[frames[-1]] = self_s.get(frames[-1], 0) + c
        for f in set(frames):
            incl[f] = incl.get(f, 0) + c
    if not total:
        return "(no samples)"
    lines = [f"{total} samples", "", "self %  total %  frame"]
    for f, c in sorted(self_s.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{100 * c / total:6.1f}  {100 * incl[f] / total:7.1f}  {f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- report


def fmt(x, digits=0):
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def summarize(results: list) -> list:
    """Median over rounds per (group, batch, protocol, concurrency, model), with ratios to
    the group's floor (and to naive_hps) computed within each round."""
    by_key = {}
    for r in results:
        by_key.setdefault(
            (r["group"], r["batch"], r["protocol"], r["concurrency"], r["model"]), []
        ).append(r)
    rows = []
    for (group, n, proto, conc, model), recs in by_key.items():
        ok = [r for r in recs if r["status"] != "failed"]
        row = {
            "group": group,
            "batch": n,
            "protocol": proto,
            "concurrency": conc,
            "model": model,
            "rounds": len(ok),
            "unstable": sum(r["status"] == "unstable" for r in ok),
        }
        for k in (
            "infer_per_s",
            "p50_us",
            "p99_us",
            "server_compute_us",
            "cpu_us_per_infer",
            "requests_per_exec",
        ):
            vals = [r[k] for r in ok if r.get(k) is not None and not np.isnan(r[k])]
            row[k] = statistics.median(vals) if vals else None
        for ref, key in (
            (FLOOR[group], "vs_floor"),
            (NATIVE_FLOOR.get(group), "vs_native_floor"),
            (NAIVE.get(group), "vs_naive"),
        ):
            if ref is None:
                continue
            ratios = []
            for r in ok:
                base = next(
                    (
                        b
                        for b in by_key.get((group, n, proto, conc, ref), [])
                        if b["round"] == r["round"] and b["status"] != "failed"
                    ),
                    None,
                )
                if base and base.get("infer_per_s"):
                    ratios.append(r["infer_per_s"] / base["infer_per_s"])
            row[key] = statistics.median(ratios) if ratios else None
            row[key + "_range"] = (min(ratios), max(ratios)) if ratios else None
        rows.append(row)
    order = {m: i for i, m in enumerate(sum(GROUP_MODELS.values(), []))}
    rows.sort(
        key=lambda r: (
            r["batch"],
            list(GROUP_MODELS).index(r["group"]),
            r["protocol"],
            r["concurrency"],
            order[r["model"]],
        )
    )
    return rows


def tables_md(rows: list) -> str:
    lines = []
    for group in GROUP_MODELS:
        grows = [r for r in rows if r["group"] == group]
        if not grows:
            continue
        naive = group in NAIVE
        native = group in NATIVE_FLOOR
        lines += [
            f"### {group}",
            "",
            "| batch | proto | conc | model | infer/s | x floor"
            + (" | x C++ floor" if native else "")
            + (" | x naive" if naive else "")
            + " | p50 us | p99 us | server compute us | server CPU us/infer | req/exec |",
            "|---:|---|---:|---|---:|---:|"
            + ("---:|" if native else "")
            + ("---:|" if naive else "")
            + "---:|---:|---:|---:|---:|",
        ]
        for r in grows:
            vs = fmt(r.get("vs_floor"), 2)
            if r.get("vs_floor_range") and r["rounds"] > 1:
                vs += f" ({r['vs_floor_range'][0]:.2f}-{r['vs_floor_range'][1]:.2f})"
            cells = [
                str(r["batch"]),
                r["protocol"],
                str(r["concurrency"]),
                f"`{r['model']}`",
                fmt(r.get("infer_per_s")),
                vs,
            ]
            if native:
                vn = fmt(r.get("vs_native_floor"), 2)
                if r.get("vs_native_floor_range") and r["rounds"] > 1:
                    lo, hi = r["vs_native_floor_range"]
                    vn += f" ({lo:.2f}-{hi:.2f})"
                cells.append(vn)
            if naive:
                cells.append(fmt(r.get("vs_naive"), 2))
            cells += [
                fmt(r.get("p50_us")),
                fmt(r.get("p99_us")),
                fmt(r.get("server_compute_us")),
                fmt(r.get("cpu_us_per_infer")),
                fmt(r.get("requests_per_exec"), 2),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list, path: Path, before: list = ()) -> bool:
    """Bars: each model's median ratio to its floor per concurrency; with ``before`` (the
    summary rows of an earlier run), black ticks mark that run's ratio."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (the 'bench' extra): no plot", flush=True)
        return False
    panels = sorted(
        {(r["group"], r["batch"], r["protocol"]) for r in rows},
        key=lambda k: (list(GROUP_MODELS).index(k[0]), k[1], k[2]),
    )
    cols = 2
    fig, axes = plt.subplots(
        (len(panels) + cols - 1) // cols,
        cols,
        figsize=(11, 3.1 * ((len(panels) + cols - 1) // cols)),
        squeeze=False,
    )
    for ax, (group, n, proto) in zip(axes.flat, panels):
        prow = [r for r in rows if (r["group"], r["batch"], r["protocol"]) == (group, n, proto)]
        concs = sorted({r["concurrency"] for r in prow})
        models = [m for m in GROUP_MODELS[group] if m != FLOOR[group]]
        width = 0.8 / max(1, len(models))
        for i, m in enumerate(models):
            ys = [
                next(
                    (r["vs_floor"] or 0 for r in prow if r["model"] == m and r["concurrency"] == c),
                    0,
                )
                for c in concs
            ]
            xs = np.arange(len(concs)) + i * width
            ax.bar(xs, ys, width, label=m)
            old = [
                next(
                    (
                        b.get("vs_floor")
                        for b in before
                        if (b["group"], b["batch"], b["protocol"], b["model"], b["concurrency"])
                        == (group, n, proto, m, c)
                    ),
                    None,
                )
                for c in concs
            ]
            if any(v is not None for v in old):
                ax.scatter(
                    [x for x, v in zip(xs, old) if v is not None],
                    [v for v in old if v is not None],
                    marker="_",
                    s=220,
                    color="k",
                    label="before" if i == 0 else None,
                    zorder=3,
                )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(
            np.arange(len(concs)) + width * (len(models) - 1) / 2, [f"c={c}" for c in concs]
        )
        ax.set_title(f"{group}, {n} samples/request, {proto}", fontsize=9)
        ax.set_ylabel("infer/s / floor's", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        "Served throughput / a Python-backend floor with the same I/O, in one server"
        + (" (black ticks: before)" if before else ""),
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=90)
    return True


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="one round, gRPC, c=1, DLRM batch 1")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--groups", default="hps,hps_misses,dlrm,dlrm_misses,ensemble")
    p.add_argument("--protocols", default="grpc,http")
    p.add_argument("--concurrency", default="1,2,8")
    p.add_argument("--dlrm-batches", default="1,64,1024")
    p.add_argument("--requests-per-file", type=int, default=16)
    p.add_argument(
        "--miss-requests",
        type=int,
        default=1000,
        help="distinct requests of the *_misses groups' stream (all-hit groups replay "
        "--requests-per-file)",
    )
    p.add_argument("--interval-ms", type=int, default=1500, help="perf_analyzer time window")
    p.add_argument("--stability", type=int, default=25, help="perf_analyzer --stability-percentage")
    p.add_argument("--max-trials", type=int, default=6)
    p.add_argument("--timeout", type=int, default=180, help="seconds per perf_analyzer run")
    p.add_argument("--out-dir", default=None)
    p.add_argument(
        "--png", default=None, help="also write the plot here (e.g. benchmarks/bench_overhead.png)"
    )
    p.add_argument(
        "--before",
        default=None,
        help="results.json of an earlier run: its ratios are marked on the plot",
    )
    p.add_argument(
        "--replot",
        default=None,
        metavar="RESULTS_JSON",
        help="only redraw the plot (and tables) of an earlier run's results.json",
    )
    p.add_argument("--profile", default="", help="models to profile with py-spy (comma-separated)")
    p.add_argument("--profile-seconds", type=float, default=20.0)
    p.add_argument(
        "--server-env", default="", help="extra KEY=VALUE,... for the server (A/B experiments)"
    )
    p.add_argument(
        "--models",
        default=None,
        help="measure only these models of each group (comma-separated), beside the group's floors",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=LINES",
        help="measure copies of the hps/dlrm groups' models with these config.pbtxt "
        "scheduling lines (\\n between lines) instead, side by side in the same "
        "server; repeat for several variants",
    )
    p.add_argument(
        "--scheduling",
        default=None,
        help="config.pbtxt lines replacing the shipped dynamic_batching/instance_group "
        "of every model but the ensemble's (A/B experiments)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary model repository")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.protocols, args.concurrency, args.dlrm_batches = 1, "grpc", "1", "1"
    global SCHEDULING
    if args.scheduling is not None:
        SCHEDULING = args.scheduling.replace("\\n", "\n") + "\n"
    groups = [g for g in args.groups.split(",") if g]
    if args.models:
        keep = set(args.models.split(","))
        for g in groups:
            floors = {FLOOR[g], NATIVE_FLOOR.get(g)}
            GROUP_MODELS[g] = [m for m in GROUP_MODELS[g] if m in keep or m in floors]
    protocols = args.protocols.split(",")
    concs = [int(c) for c in args.concurrency.split(",")]
    batches = [int(b) for b in args.dlrm_batches.split(",")]

    if args.replot:
        rows = json.loads(Path(args.replot).read_text())["summary"]
        before = json.loads(Path(args.before).read_text())["summary"] if args.before else []
        print(tables_md(rows))
        plot(rows, Path(args.png or "bench_overhead.png"), before)
        return 0
    t_start = time.monotonic()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="bench_overhead_", dir="/tmp")).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_overhead_repo_", dir="/tmp"))
    info = machine_info()
    print(f"machine: {info}", flush=True)
    repo = work / "repo"
    meta = build_repository(repo, groups)
    files = write_inputs(meta, groups, batches, args.requests_per_file, out_dir, args.miss_requests)
    if args.variant:
        variants = [v.split("=", 1) for v in args.variant]
        groups = add_variants(repo, groups, [(n, sc.replace("\\n", "\n")) for n, sc in variants])
        files.update(
            {(g, n): f for g in groups for (b, n), f in list(files.items()) if b == base_group(g)}
        )
    load = sorted(
        {m for g in groups for m in GROUP_MODELS[g]}
        | ({"dlrm_hps", "dlrm_dense", "dlrm_dense_hugectr"} if "ensemble" in groups else set())
    )
    env = {"TRITON_REC_STORE": str(work / "store")}
    env.update(kv.split("=", 1) for kv in args.server_env.split(",") if kv)
    backends = work / "backends"
    for name, src in PYTHON_PATH_BACKENDS.items():
        (backends / name).mkdir(parents=True, exist_ok=True)
        for f in (ROOT / "backend" / src).glob("*.py"):
            shutil.copy2(f, backends / name / f.name)
    server = TritonServer(
        repo,
        explicit=True,
        load_models=load,
        log_path=out_dir / "server.log",
        env=env,
        backend_dir=backends,
        request_path="native",
    )
    results, problems, profiles, hit_rates = [], [], [], {}
    try:
        t0 = time.monotonic()
        server.start(timeout=600)
        print(f"server ready in {time.monotonic() - t0:.1f} s", flush=True)
        problems = sanity_check(server, files, groups)
        print("sanity check:", "ok" if not problems else problems, flush=True)
        for rnd in range(args.rounds):
            for group in groups:
                for n in [HPS_SAMPLES] if base_group(group).startswith("hps") else batches:
                    for proto in protocols:
                        for conc in concs:
                            models = GROUP_MODELS[group]
                            k = rnd % len(models)
                            for model in models[k:] + models[:k]:
                                tag = f"r{rnd}_{model}_n{n}_c{conc}_{proto}"
                                rec = run_perf(
                                    model, group, n, conc, proto, server, files, out_dir, args, tag
                                )
                                rec["round"] = rnd
                                results.append(rec)
                                tail = (
                                    " " + rec.get("reason", "") if rec["status"] == "failed" else ""
                                )
                                print(
                                    f"r{rnd} {model:15s} n={n:<5d} {proto:4s} c={conc} "
                                    f"{rec['status']:8s} "
                                    f"{fmt(rec.get('infer_per_s')):>7s} infer/s "
                                    f"p50 {fmt(rec.get('p50_us')):>7s} us "
                                    f"cpu/inf {fmt(rec.get('cpu_us_per_infer')):>6s} us"
                                    f"{tail}",
                                    flush=True,
                                )
        for model in ("hps", "hps_5pct", "dlrm_5pct"):
            if model in load:
                hit_rates[model] = cache_hit_rate(server, model)
        if args.profile:
            profiles = profile(
                server, files, args.profile.split(","), args.profile_seconds, out_dir
            )
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = summarize(results)
    md = tables_md(rows)
    if hit_rates:
        md += (
            "\ncache hit rate over the run (all-hit and miss rounds together): "
            + ", ".join(
                f"{m} {fmt(100 * v, 1) if v is not None else '-'}%" for m, v in hit_rates.items()
            )
            + "\n"
        )
    for model, _svg, raw in profiles:
        if raw.exists():
            text = hottest(raw)
            (out_dir / f"profile_{model}_top.txt").write_text(text)
            md += f"\n#### py-spy, one `{model}` instance (gRPC, c=1)\n\n```\n{text}\n```\n"
    info["loadavg_end"] = os.getloadavg()
    total = time.monotonic() - t_start
    print("\n" + md)
    before = json.loads(Path(args.before).read_text())["summary"] if args.before else []
    png = out_dir / "bench_overhead.png"
    if rows and plot(rows, png, before) and args.png and Path(args.png).resolve() != png:
        shutil.copy2(png, args.png)
    print(f"total wall time {total:.0f} s; raw output in {out_dir}")
    (out_dir / "tables.md").write_text(md)
    (out_dir / "results.json").write_text(
        json.dumps(
            {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "argv": sys.argv[1:],
                "machine": info,
                "sanity_problems": problems,
                "wall_s": round(total, 1),
                "summary": rows,
                "results": results,
                "hit_rates": hit_rates,
            },
            indent=1,
            default=str,
        )
    )
    return 0 if not problems and all(r["status"] != "failed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
