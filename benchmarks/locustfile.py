"""Locust load test of the demo DLRM over Triton's HTTP API: fused ``dlrm`` and ``dlrm_ensemble``.

Each simulated user (locust ``FastHttpUser``, closed loop) sends inference requests to
``/v2/models/<model>/infer`` in Triton's binary-tensor HTTP format (the body built and the
answer parsed by ``tritonclient.http``; ``LOCUST_TENSOR_FORMAT=json`` sends KServe v2
JSON instead), mixing

- the models: ``dlrm`` (fused, inputs DES/CATCOLUMN/ROWINDEX as one row ``[1, n]``) and
  ``dlrm_ensemble`` (hps -> dense, 1-D DES/KEYS/NUMKEYS/ROWINDEX), weights from
  ``LOCUST_MODEL_WEIGHTS`` (default ``dlrm:1,dlrm_ensemble:1``);
- batch sizes: ``LOCUST_BATCH_MIX`` ``samples:weight,...`` (default ``1:40,8:30,64:20,256:10``);
- keys drawn from the trained tables (``triton_rec.formats.tables.read_table`` on the model's sparse
  directories named in ps.json) with a Zipf popularity: each table's keys are put in a
  fixed random rank order and rank r is drawn with probability ~ r^-alpha
  (``LOCUST_ZIPF``, default 1.05). Slots and keys per slot follow the trained model
  (``dlrm_meta.json``: table0 4 one-hot slots, table1 2 slots of 1-3 keys); dense
  features are standard normal.

Requests are pre-built at start (``LOCUST_POOL`` distinct bodies per model x batch size,
default 32) so the load generator spends its CPU on sending, not on building tensors.
A response is a failure unless it is HTTP 200 with one finite probability in [0, 1] per
sample. Statistics are per ``<model> n=<samples>``; at the end the file prints samples/s
per model (locust counts requests only).

    .venv/bin/locust -f benchmarks/locustfile.py --headless -u 8 -r 4 -t 60s \\
        --host http://127.0.0.1:8000 --csv /tmp/locust_dlrm

Environment: ``TRITON_REC_PS_JSON`` (default ``model_repository/ps.json``),
``TRITON_REC_DLRM_DIR`` (default ``model_repository/dlrm/1``), ``LOCUST_SEED`` (default 7),
``LOCUST_WAIT_MS`` (think time per user between requests, default 0), and the ones above.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from locust import FastHttpUser, constant, events, task

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tritonclient.http as tc  # noqa: E402

from examples.dlrm.torch_dlrm import ClickData  # noqa: E402
from triton_rec.config.ps_json import load_ps_config  # noqa: E402
from triton_rec.formats.tables import read_table  # noqa: E402

PS_JSON = os.environ.get("TRITON_REC_PS_JSON", str(ROOT / "model_repository" / "ps.json"))
DLRM_DIR = Path(
    os.environ.get("TRITON_REC_DLRM_DIR", str(ROOT / "model_repository" / "dlrm" / "1"))
)
SEED = int(os.environ.get("LOCUST_SEED", "7"))
ZIPF = float(os.environ.get("LOCUST_ZIPF", "1.05"))
POOL = int(os.environ.get("LOCUST_POOL", "32"))
BINARY = os.environ.get("LOCUST_TENSOR_FORMAT", "binary").lower() != "json"
WAIT_S = float(os.environ.get("LOCUST_WAIT_MS", "0")) / 1000.0


def _pairs(text: str, conv):
    out = []
    for item in text.split(","):
        k, w = item.split(":")
        out.append((conv(k), float(w)))
    return out


BATCH_MIX = _pairs(os.environ.get("LOCUST_BATCH_MIX", "1:40,8:30,64:20,256:10"), int)
MODEL_WEIGHTS = _pairs(os.environ.get("LOCUST_MODEL_WEIGHTS", "dlrm:1,dlrm_ensemble:1"), str)


class ZipfKeys:
    """Keys of the trained tables with Zipf(alpha) popularity over a fixed random rank order."""

    def __init__(
        self, ps_json: str, model: str, meta: dict, alpha: float, rng: np.random.Generator
    ):
        params = load_ps_config(ps_json).model(model)
        self.tables = []
        for tp, spec in zip(params.tables, meta["tables"]):
            keys = np.asarray(read_table(tp.sparse_file, tp.vec_size)[0], np.int64)
            ranked = keys[rng.permutation(len(keys))]  # rank 1 = ranked[0]
            p = np.arange(1, len(keys) + 1, dtype=np.float64) ** -alpha
            self.tables.append(
                (ranked, p / p.sum(), spec["slot_num"], spec.get("max_keys_per_slot", 1))
            )

    def sample(self, n: int, rng: np.random.Generator) -> ClickData:
        sparse = []
        for ranked, p, slots, max_per_slot in self.tables:
            counts = rng.integers(1, max_per_slot + 1, size=n * slots)
            offsets = np.zeros(n * slots + 1, np.int64)
            np.cumsum(counts, out=offsets[1:])
            sparse.append((ranked[rng.choice(len(ranked), size=int(offsets[-1]), p=p)], offsets))
        dense = rng.standard_normal((n, META["dense_dim"])).astype(np.float32)
        return ClickData(dense, sparse, np.zeros(n, np.float32), np.zeros(n, np.float32))


def fused_inputs(data: ClickData) -> list:
    req = data.hugectr_request()
    return [
        ("DES", req["DES"][None, :], "FP32"),
        ("CATCOLUMN", req["CATCOLUMN"][None, :], "INT64"),
        ("ROWINDEX", req["ROWINDEX"][None, :], "INT32"),
    ]


def ensemble_inputs(data: ClickData) -> list:
    req = data.hugectr_request()
    keys = [k for k, _ in data.sparse]  # each table's keys in sample order = table-major KEYS
    return [
        ("DES", req["DES"], "FP32"),
        ("KEYS", np.concatenate(keys).astype(np.int64), "INT64"),
        ("NUMKEYS", np.array([len(k) for k in keys], np.int32), "INT32"),
        ("ROWINDEX", req["ROWINDEX"], "INT32"),
    ]


MODELS = {  # model -> (inputs builder, output name)
    "dlrm": (fused_inputs, "OUTPUT0"),
    "dlrm_ensemble": (ensemble_inputs, "PREDICTION"),
}


def build_body(model: str, data: ClickData):
    make, out_name = MODELS[model]
    inputs = []
    for name, arr, dtype in make(data):
        i = tc.InferInput(name, list(arr.shape), dtype)
        i.set_data_from_numpy(arr, binary_data=BINARY)
        inputs.append(i)
    outputs = [tc.InferRequestedOutput(out_name, binary_data=BINARY)]
    body, json_size = tc.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
    headers = {
        "Content-Type": "application/octet-stream" if json_size is not None else "application/json"
    }
    if json_size is not None:
        headers["Inference-Header-Content-Length"] = str(json_size)
    return body, headers


META = json.loads((DLRM_DIR / "dlrm_meta.json").read_text())
_rng = np.random.default_rng(SEED)
_keys = ZipfKeys(PS_JSON, "dlrm", META, ZIPF, _rng)
# (model, samples) -> list of (body, headers); same samples for both models.
REQUESTS = defaultdict(list)
for _n, _ in BATCH_MIX:
    for _ in range(POOL):
        _data = _keys.sample(_n, _rng)
        for _m, _w in MODEL_WEIGHTS:
            REQUESTS[(_m, _n)].append(build_body(_m, _data))

_samples_ok = defaultdict(int)
_t0 = [None, None]  # test start, test stop


@events.test_start.add_listener
def _start(environment, **kw):
    _t0[0] = time.monotonic()


@events.test_stop.add_listener
def _stop(environment, **kw):
    _t0[1] = time.monotonic()


@events.request.add_listener
def _count(request_type, name, response_time, response_length, exception=None, context=None, **kw):
    if exception is None and context and "samples" in context:
        _samples_ok[context["model"]] += context["samples"]


@events.quitting.add_listener
def _summary(environment, **kw):
    if _t0[0] is None:
        return
    wall = (_t0[1] or time.monotonic()) - _t0[0]
    total = sum(_samples_ok.values())
    lines = [f"samples answered (successful requests only) over {wall:.1f} s:"]
    for m, s in sorted(_samples_ok.items()):
        lines.append(f"  {m:14s} {s:10d} samples  {s / wall:10.1f} samples/s")
    lines.append(f"  {'total':14s} {total:10d} samples  {total / wall:10.1f} samples/s")
    print("\n".join(lines), flush=True)
    out = os.environ.get("LOCUST_SAMPLES_JSON")
    if out:
        Path(out).write_text(
            json.dumps(
                {
                    "wall_s": wall,
                    "samples": dict(_samples_ok),
                    "samples_per_s": {m: s / wall for m, s in _samples_ok.items()},
                }
            )
        )


class RecommenderUser(FastHttpUser):
    """One client: picks a model and a batch size by weight, sends a pre-built request."""

    wait_time = constant(WAIT_S)
    network_timeout = 30.0
    connection_timeout = 10.0

    def on_start(self):
        self.rng = np.random.default_rng([SEED, id(self) & 0xFFFFFFFF])
        self.models = [m for m, _ in MODEL_WEIGHTS]
        pm = np.array([w for _, w in MODEL_WEIGHTS], float)
        self.pm = pm / pm.sum()
        self.sizes = [n for n, _ in BATCH_MIX]
        pb = np.array([w for _, w in BATCH_MIX], float)
        self.pb = pb / pb.sum()

    @task
    def infer(self):
        model = self.models[self.rng.choice(len(self.models), p=self.pm)]
        n = self.sizes[self.rng.choice(len(self.sizes), p=self.pb)]
        pool = REQUESTS[(model, n)]
        body, headers = pool[self.rng.integers(len(pool))]
        out_name = MODELS[model][1]
        with self.client.post(
            f"/v2/models/{model}/infer",
            data=body,
            headers=headers,
            name=f"{model} n={n}",
            catch_response=True,
            context={"model": model, "samples": n},
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                return
            try:
                hl = resp.headers.get("Inference-Header-Content-Length")
                result = tc.InferenceServerClient.parse_response_body(
                    resp.content, header_length=int(hl) if hl else None
                )
                out = result.as_numpy(out_name).reshape(-1)
            except Exception as e:  # noqa: BLE001  (any parse problem is a failed request)
                resp.failure(f"unparsable response: {e}")
                return
            if out.size != n or not np.all(np.isfinite(out)) or out.min() < 0 or out.max() > 1:
                resp.failure(f"bad output: {out.size} values for {n} samples")
