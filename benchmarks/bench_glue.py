#!/usr/bin/env python3
"""Where the microseconds of one request go inside an instance, in-process.

The same models as ``bench_overhead.py`` (the 2M x 16 ``hps`` table with and without
cache, the Criteo-shaped DLRM with HugeCTR and ONNX dense parts), loaded through the
real ``backend/<name>/model.py`` against the stand-in for Triton's
``triton_python_backend_utils`` (``tests/fake_pb_utils.py``: plain Python objects, so
its own cost is close to nothing). For one request of the benchmark's inputs it times,
median of ``--repeat`` runs after a warm-up:

- ``execute``: the backend's whole ``execute`` for that request, back to back, and
  after 1 ms of sleep each (as served: the instance waits between requests, and its
  caches and branch predictors go cold; this is the figure that adds to the floor);
- the stages inside it: reading the tensors, ``parse_request`` (validation),
  the engine's run (``lookup_many`` / ``predict_many``), building the response;
- for the DLRM, the engine's parts: the lookups, slot combination, the dense network.

What Triton and the Python-backend stub add on top of ``execute`` is the floor model's
time in ``bench_overhead.py``: together they account for a served request.

    .venv/bin/python benchmarks/bench_glue.py [--repeat 2000] [--batches 1,64,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_overhead as bo  # noqa: E402
from machine import machine_info  # noqa: E402

from tests.fake_pb_utils import (  # noqa: E402
    HPS_INPUTS,
    HUGECTR_INPUTS,
    Request,
    start_instance,
    triton_config,
)


def timed(fn, repeat: int, idle_s: float = 0.0) -> float:
    """Median microseconds of ``fn()`` over ``repeat`` calls (after 10% warm-up); with
    ``idle_s``, each call follows that long a sleep, as a served request follows the
    instance's wait for the next one (caches and predictors have gone cold)."""
    for _ in range(max(10, repeat // 10)):
        fn()
    samples = []
    for _ in range(repeat):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000.0


def load(repo: Path, name: str):
    """One instance of a model of the benchmark repository, as Triton would start it."""
    text = (repo / name / "config.pbtxt").read_text()
    backend = text.split('backend: "')[1].split('"')[0]
    config = triton_config(
        name,
        backend,
        HPS_INPUTS if backend == "hps" else HUGECTR_INPUTS,
        instances=2,
        store_dir=repo.parent / "store",
        metrics_interval=1,
    )
    return start_instance(repo, config)


def request_of(path: Path, types: dict) -> Request:
    row = json.loads(path.read_text())["data"][0]
    return Request(**{k: np.asarray(v["content"], types[k])[None, :] for k, v in row.items()})


TYPES = {
    "KEYS": np.int64,
    "NUMKEYS": np.int32,
    "DES": np.float32,
    "CATCOLUMN": np.int64,
    "ROWINDEX": np.int32,
}


def stages(pb, model, req: Request, names, run, repeat: int) -> dict:
    session = model.session
    tensors = [pb.get_input_tensor_by_name(req, n).as_numpy() for n in names]
    parsed = session.parse_request(*tensors)
    answer = run([parsed])[0]
    respond = getattr(model, "_response", None) or (
        lambda r, out: pb.InferenceResponse(output_tensors=[pb.Tensor(model.output_name, out)])
    )
    return {
        "execute": timed(lambda: model.execute([req]), repeat),
        "execute after 1 ms idle": timed(lambda: model.execute([req]), max(50, repeat // 4), 0.001),
        "read tensors": timed(
            lambda: [pb.get_input_tensor_by_name(req, n).as_numpy() for n in names], repeat
        ),
        "parse_request": timed(lambda: session.parse_request(*tensors), repeat),
        "engine run": timed(lambda: run([parsed]), repeat),
        "response": timed(lambda: respond(parsed, answer), repeat),
    }


def dlrm_parts(model, req: Request, repeat: int) -> dict:
    """The engine's run of one parsed DLRM request, by part."""
    from triton_rec.dense import combine_slots

    s = model.session
    parsed = s.parse_request(*[t.as_numpy() for t in req.inputs()])
    out, vectors = {}, []
    for t, table in enumerate(s.cached_tables):
        keys = parsed.keys[t]
        buf = np.empty((keys.shape[0], table.vec_size), np.float32)
        out[f"lookup table {t} ({keys.shape[0]} keys)"] = timed(
            lambda table=table, keys=keys, buf=buf: table.lookup(keys, buf), repeat
        )
        vectors.append(buf)
    combined = []
    for t, table in enumerate(s.cached_tables):
        rp = parsed.row_ptrs[t]
        out[f"combine table {t}"] = timed(
            lambda t=t, rp=rp: combine_slots(vectors[t], rp, s.combiners[t]), repeat
        )
        combined.append(
            combine_slots(vectors[t], rp, s.combiners[t]).reshape(
                parsed.num_samples, s.slots[t], table.vec_size
            )
        )
    out["dense network"] = timed(lambda: s.dense.predict(parsed.dense, combined), repeat)
    return out


def main(argv=None) -> int:
    from triton_rec.triton.process_setup import server_blas_environment

    fix = server_blas_environment()
    if fix:  # load OpenBLAS with the kernels a served instance gets (triton_rec.triton.runtime)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **fix})
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeat", type=int, default=2000)
    p.add_argument("--batches", default="1,64,1024")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"machine: {machine_info()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_glue_") as tmp:
        repo = Path(tmp) / "repo"
        meta = bo.build_repository(repo, ["hps", "dlrm"])
        files = bo.write_inputs(meta, ["hps", "dlrm"], batches, 4, Path(tmp))
        rows = []
        for name in ("hps", "hps_nocache", "dlrm", "dlrm_onnx"):
            pb, model = load(repo, name)
            try:
                if name.startswith("hps"):
                    req = request_of(files[("hps", bo.HPS_SAMPLES)], TYPES)
                    for _ in range(200):  # warm the cache as the served benchmark does
                        model.execute([req])
                    rows.append(
                        (
                            name,
                            bo.HPS_SAMPLES,
                            stages(
                                pb,
                                model,
                                req,
                                ("KEYS", "NUMKEYS"),
                                model.session.lookup_many,
                                args.repeat,
                            ),
                            {},
                        )
                    )
                else:
                    for n in batches:
                        req = request_of(files[("dlrm", n)], TYPES)
                        rep = max(50, args.repeat // max(1, n // 16))
                        rows.append(
                            (
                                name,
                                n,
                                stages(
                                    pb,
                                    model,
                                    req,
                                    ("DES", "CATCOLUMN", "ROWINDEX"),
                                    model.session.predict_many,
                                    rep,
                                ),
                                dlrm_parts(model, req, rep),
                            )
                        )
            finally:
                model.finalize()
    lines = [
        "| model | samples/request | execute us | execute after 1 ms idle | read tensors "
        "| parse_request | engine run | response | engine parts (us) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, n, st, parts in rows:
        lines.append(
            f"| `{name}` | {n} | {st['execute']:.1f} | {st['execute after 1 ms idle']:.1f} | "
            f"{st['read tensors']:.1f} | "
            f"{st['parse_request']:.1f} | {st['engine run']:.1f} | {st['response']:.1f} | "
            + "; ".join(f"{k} {v:.1f}" for k, v in parts.items())
            + " |"
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
