"""A stand-in for Triton's ``triton_python_backend_utils`` (only Triton's stub has the
real one), so the backends' ``model.py`` files run in-process in unit tests.

It mirrors the Python backend of Triton 2.51 (no response parameters) and records every
custom-metric call with the thread that made it: in the real stub each of those calls
is a round trip to the server process.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from pathlib import Path

import numpy as np

BACKENDS = Path(__file__).resolve().parents[1] / "backend"


class TritonError:
    INVALID_ARG = 3
    UNAVAILABLE = 4
    INTERNAL = 6

    def __init__(self, message, code=INTERNAL):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def shape(self):
        return list(self._array.shape)


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):  # 2.51: no `parameters`
        self.output_tensors, self.error = list(output_tensors), error

    def has_error(self):
        return self.error is not None

    def output(self, name):
        return next(t.as_numpy() for t in self.output_tensors if t.name() == name)


class Request:
    def __init__(self, **arrays):
        self.tensors = [Tensor(k, v) for k, v in arrays.items()]

    def inputs(self):
        return self.tensors


def make_module():
    """A fresh fake module; ``module.metric_calls`` lists (thread ident, kind, labels, value)."""
    m = types.ModuleType("triton_python_backend_utils")
    m.metric_calls = []
    m.log_lines = []
    lock = threading.Lock()

    class Metric:
        def __init__(self, family, labels):
            self.family, self.labels = family, dict(labels)

        def _record(self, kind, value):
            with lock:
                m.metric_calls.append(
                    (threading.get_ident(), kind, self.family.name, self.labels, value)
                )

        def increment(self, value):
            self._record("increment", value)

        def set(self, value):
            self._record("set", value)

    class MetricFamily:
        COUNTER, GAUGE = 0, 1

        def __init__(self, name, description, kind):
            self.name, self.description, self.kind = name, description, kind

        def Metric(self, labels=None):  # noqa: N802 (Triton's spelling)
            return Metric(self, labels or {})

    class Logger:
        @staticmethod
        def log_info(msg):
            m.log_lines.append(("info", msg))

        @staticmethod
        def log_warn(msg):
            m.log_lines.append(("warn", msg))

        @staticmethod
        def log_error(msg):
            m.log_lines.append(("error", msg))

    def get_input_tensor_by_name(request, name):
        return next((t for t in request.inputs() if t.name() == name), None)

    m.Tensor, m.InferenceResponse, m.TritonError = Tensor, InferenceResponse, TritonError
    m.TritonModelException, m.MetricFamily, m.Logger = TritonModelException, MetricFamily, Logger
    m.get_input_tensor_by_name = get_input_tensor_by_name
    return m


def load_backend(name: str, module):
    """Import ``backend/<name>/model.py`` against the fake ``module``."""
    sys.modules["triton_python_backend_utils"] = module
    try:
        spec = importlib.util.spec_from_file_location(
            f"_backend_{name}", BACKENDS / name / "model.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["triton_python_backend_utils"]
    return mod


HPS_INPUTS = (("KEYS", "TYPE_INT64"), ("NUMKEYS", "TYPE_INT32"))
HUGECTR_INPUTS = (("DES", "TYPE_FP32"), ("CATCOLUMN", "TYPE_INT64"), ("ROWINDEX", "TYPE_INT32"))


def triton_config(name: str, backend: str, inputs, instances: int = 1, **parameters) -> dict:
    """A model's config.pbtxt as the JSON Triton hands to ``initialize`` (what the
    backends read): ragged 1-D inputs, one FP32 output ``OUTPUT0``, string parameters."""
    return {
        "name": name,
        "backend": backend,
        "max_batch_size": 1024,
        "input": [{"name": n, "data_type": t, "dims": [-1]} for n, t in inputs],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "instance_group": [{"count": instances, "kind": "KIND_CPU"}],
        "parameters": {k: {"string_value": str(v)} for k, v in parameters.items()},
    }


def start_instance(repo, config: dict):
    """One instance of ``config`` (model directory ``repo/<name>``), initialized in-process
    against a fresh fake module; returns ``(module, model)``. Call ``model.finalize()``."""
    import json

    pb = make_module()
    model = load_backend(config["backend"], pb).TritonPythonModel()
    name = config["name"]
    model.initialize(
        {
            "model_config": json.dumps(config),
            "model_name": name,
            "model_repository": str(Path(repo) / name),
            "model_version": "1",
            "model_instance_name": f"{name}_0",
            "model_instance_kind": "CPU",
            "model_instance_device_id": "0",
        }
    )
    return pb, model
