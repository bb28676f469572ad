"""The Python side of the native backends: ``triton_python_backend_utils`` in-process.

The native backend (``src/triton_backend/trec/``, installed as
``hps/libtriton_hps.so``, ``hugectr/libtriton_hugectr.so`` and ``dense/libtriton_dense.so``)
runs inside tritonserver.
It embeds this interpreter once per server and hosts the same ``model.py`` the Python
backend would run, so the engine stays the single place where the semantics live
(ps.json, stores, caches, tiers, refresh, updates, metrics, every error message):

- **control plane** (here, in Python): ``initialize``/``finalize`` of each model instance,
  the load log, background threads, metrics, and every request the native hot path does
  not answer itself (malformed requests, models whose features are not native) or the
  misses it hands back (a cache in front of a tier store or on a GPU), each call counted
  (:data:`PYTHON_CALLS_METRIC`);
- **data plane** (C++, GIL released): for a model whose tables are node-local (mapped
  store, CPU shared cache or none) the backend validates the request, queries the shared
  cache or the table index, answers the misses (:class:`~triton_rec._native.LocalMisses`)
  and writes the answer straight into Triton's response buffer
  (:meth:`HostedModel.native_plan` hands it the addresses).

This module *is* ``triton_python_backend_utils`` for the hosted ``model.py``
(:func:`load_model` registers it under that name): the same classes and calls, served
by Triton's C API in this process (ctypes), so a log line or a metric update costs a
function call instead of a round trip to another process.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from triton_rec.serving.native_plan import NativePlan
from triton_rec.triton.instance import CURRENT_MODEL

#: Read by :func:`triton_rec.triton.instance.prepare_process`: the model runs inside the
#: server process (no parent watchdog: the server's parent is not ours to watch).
IN_PROCESS = True

# Triton's C API, from the process itself (libtritonserver is loaded by the server
# binary; its symbols are global). Values are the documented enums of tritonserver.h.
_LOG_LEVELS = {"info": 0, "warn": 1, "error": 2, "verbose": 3}
_METRIC_KINDS = {"counter": 0, "gauge": 1}
_PARAMETER_STRING = 0

# Triton data type names (the native backend hands over TRITONSERVER_DataTypeString's)
# -> numpy dtypes (BYTES is passed as raw uint8).
_DTYPES = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.uint8,
}

_api = None
_api_lock = threading.Lock()


def _triton():
    """The process's libtritonserver functions (ctypes; argument types set once)."""
    global _api
    with _api_lock:
        if _api is None:
            lib = ctypes.CDLL(None)
            vp, cp, u64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64
            for name, res, args in (
                ("TRITONSERVER_LogMessage", vp, [ctypes.c_int, cp, ctypes.c_int, cp]),
                ("TRITONSERVER_ErrorMessage", cp, [vp]),
                ("TRITONSERVER_ErrorDelete", None, [vp]),
                ("TRITONSERVER_MetricFamilyNew", vp, [ctypes.POINTER(vp), ctypes.c_int, cp, cp]),
                ("TRITONSERVER_MetricNew", vp, [ctypes.POINTER(vp), vp, ctypes.POINTER(vp), u64]),
                ("TRITONSERVER_MetricDelete", vp, [vp]),
                ("TRITONSERVER_MetricIncrement", vp, [vp, ctypes.c_double]),
                ("TRITONSERVER_MetricSet", vp, [vp, ctypes.c_double]),
                ("TRITONSERVER_MetricValue", vp, [vp, ctypes.POINTER(ctypes.c_double)]),
                ("TRITONSERVER_ParameterNew", vp, [cp, ctypes.c_int, vp]),
                ("TRITONSERVER_ParameterDelete", None, [vp]),
            ):
                f = getattr(lib, name)
                f.restype, f.argtypes = res, args
            _api = lib
    return _api


def _check(err) -> None:
    """Raise a TritonModelException for a non-null TRITONSERVER_Error* (and free it)."""
    if err:
        api = _triton()
        msg = api.TRITONSERVER_ErrorMessage(err).decode(errors="replace")
        api.TRITONSERVER_ErrorDelete(err)
        raise TritonModelException(msg)


# -- the pb_utils surface the backends use ---------------------------------------------


class TritonError:
    """An error response (codes are TRITONSERVER_Error_Code values)."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED = range(6)
    ALREADY_EXISTS, CANCELLED = 6, 7

    def __init__(self, message: str, code: int = INTERNAL):
        self._message, self._code = str(message), int(code)

    def message(self) -> str:
        """The error's text."""
        return self._message

    def code(self) -> int:
        """The error's TRITONSERVER_Error_Code."""
        return self._code


class TritonModelException(Exception):
    """Raised by ``initialize`` to fail a model load (its text is the load error)."""


class Tensor:
    """A named array: an input (a read-only view of Triton's buffer) or an output."""

    def __init__(self, name: str, array):
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def as_numpy(self) -> np.ndarray:
        """The data (no copy)."""
        return self._array

    def shape(self) -> List[int]:
        """The tensor's shape."""
        return list(self._array.shape)

    def to_dlpack(self):
        """Not available in-process (``request_loop.release_input_pages`` then does nothing)."""
        # the input's memory belongs to the server; nothing to release (request_loop handles this)
        raise NotImplementedError("in-process tensors have no DLPack export")


class InferenceResponse:
    """Output tensors, or an error; response parameters are supported."""

    def __init__(self, output_tensors=(), error: Optional[TritonError] = None, parameters=None):
        self.output_tensors = list(output_tensors)
        self.error = error
        self.parameters = dict(parameters or {})

    def has_error(self) -> bool:
        """Whether this response is an error."""
        return self.error is not None


class InferenceRequest:
    """The tensors and parameters of one request, as the hosted model sees them."""

    def __init__(self, tensors: Dict[str, Tensor], parameters: Optional[Dict[str, object]] = None):
        self._tensors = tensors
        self._parameters = parameters or {}

    def parameters(self) -> str:
        """The request's parameters as a JSON object string (as the Python backend's)."""
        return json.dumps(self._parameters)

    def inputs(self) -> List[Tensor]:
        """Every input tensor of the request."""
        return list(self._tensors.values())


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Optional[Tensor]:
    """The request's input ``name``, or None."""
    return request._tensors.get(name)


class Logger:
    """Lines in Triton's own log (TRITONSERVER_LogMessage)."""

    @staticmethod
    def log(message: str, level: str = "info") -> None:
        """One line at ``level`` (info, warn, error, verbose), attributed to the caller."""
        frame = sys._getframe(2)
        err = _triton().TRITONSERVER_LogMessage(
            _LOG_LEVELS[level],
            os.path.basename(frame.f_code.co_filename).encode(),
            frame.f_lineno,
            str(message).encode(errors="replace"),
        )
        if err:  # logging must never fail a model
            _triton().TRITONSERVER_ErrorDelete(err)

    @staticmethod
    def log_info(message: str) -> None:
        """An INFO line."""
        Logger.log(message, "info")

    @staticmethod
    def log_warn(message: str) -> None:
        """A WARNING line."""
        Logger.log(message, "warn")

    @staticmethod
    def log_error(message: str) -> None:
        """An ERROR line."""
        Logger.log(message, "error")

    @staticmethod
    def log_verbose(message: str) -> None:
        """A VERBOSE line."""
        Logger.log(message, "verbose")


class Metric:
    """One labelled series of a :class:`MetricFamily` (TRITONSERVER_Metric)."""

    def __init__(self, family: MetricFamily, labels: Dict[str, str]):
        api = _triton()
        params = [
            api.TRITONSERVER_ParameterNew(k.encode(), _PARAMETER_STRING, str(v).encode())
            for k, v in labels.items()
        ]
        arr = (ctypes.c_void_p * max(1, len(params)))(*params)
        handle = ctypes.c_void_p()
        try:
            _check(
                api.TRITONSERVER_MetricNew(ctypes.byref(handle), family._handle, arr, len(params))
            )
        finally:
            for p in params:
                api.TRITONSERVER_ParameterDelete(p)
        self._handle = handle

    def __del__(self):
        # Released with the model that made it (an unload): Triton drops the series once
        # no Metric refers to its labels (core src/metric_family.h, prom_metric_ref_cnt_).
        # Kept, each reload leaked one wrapper per series (issue 24).
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            with contextlib.suppress(Exception):  # at interpreter exit the API may be gone
                _triton().TRITONSERVER_MetricDelete(handle)

    def increment(self, value: float) -> None:
        """Add ``value``."""
        _check(_triton().TRITONSERVER_MetricIncrement(self._handle, float(value)))

    def set(self, value: float) -> None:
        """Set to ``value`` (gauges)."""
        _check(_triton().TRITONSERVER_MetricSet(self._handle, float(value)))

    def value(self) -> float:
        """The current value."""
        out = ctypes.c_double()
        _check(_triton().TRITONSERVER_MetricValue(self._handle, ctypes.byref(out)))
        return out.value


class MetricFamily:
    """A metric family in the server's registry (one name: one family, kept for the life
    of the server, as the families of the Python backend's stubs are): made once per name
    and kind, and handed out again to every model that asks (each load used to add a
    family wrapper that was never freed, issue 24)."""

    COUNTER, GAUGE = "counter", "gauge"
    _made: Dict[Tuple[str, str], MetricFamily] = {}
    _made_lock = threading.Lock()

    def __new__(cls, name: str, description: str, kind: str):
        """The family of this name and kind: made on first use, the same one after."""
        with cls._made_lock:
            family = cls._made.get((name, kind))
            if family is None:
                family = super().__new__(cls)
                family._make(name, description, kind)
                cls._made[(name, kind)] = family
            return family

    def __init__(self, name: str, description: str, kind: str):
        pass  # made once, in __new__

    def _make(self, name: str, description: str, kind: str) -> None:
        handle = ctypes.c_void_p()
        _check(
            _triton().TRITONSERVER_MetricFamilyNew(
                ctypes.byref(handle), _METRIC_KINDS[kind], name.encode(), description.encode()
            )
        )
        self._handle = handle

    def Metric(self, labels: Optional[Dict[str, str]] = None) -> Metric:  # noqa: N802 (pb_utils)
        """The series of this family with ``labels``."""
        return Metric(self, labels or {})


# -- hosting ---------------------------------------------------------------------------

#: A request as the native backend passes it: ({input name -> (Triton data type, shape,
#: read-only memoryview of the data)}, {request parameter -> bool|int|float|str}).
RawRequest = Tuple[Dict[str, Tuple[str, Tuple[int, ...], memoryview]], Dict[str, object]]
#: A response as the native backend takes it: (error message or None, error code,
#: [(output name, C-contiguous array)], {parameter: int|bool|str}).
RawResponse = Tuple[Optional[str], int, List[Tuple[str, np.ndarray]], Dict[str, object]]


def _as_tensor(name: str, dtype: str, shape: Sequence[int], data: memoryview) -> Tensor:
    arr = np.frombuffer(data, dtype=_DTYPES.get(dtype, np.uint8))
    if dtype != "BYTES":
        arr = arr.reshape(tuple(shape))
    return Tensor(name, arr)


def _raw_response(resp) -> RawResponse:
    if resp is None:
        return ("model returned no response", TritonError.INTERNAL, [], {})
    if resp.error is not None:
        return (resp.error.message(), resp.error.code(), [], {})
    outputs = [(t.name(), np.ascontiguousarray(t.as_numpy())) for t in resp.output_tensors]
    return (None, 0, outputs, resp.parameters)


#: The counter of the calls from the native backend's request path into Python, by what
#: was called (label ``what``): ``request``, a whole request answered by the hosted model
#: (malformed, or a model without a native plan); ``misses``, a table's cache misses
#: answered by the engine in Python (a tier store, a device cache). A node-local model's
#: well-formed requests never enter Python, misses included (issue 25).
PYTHON_CALLS_METRIC = "trec_python_calls_total"
PYTHON_CALLS_HELP = "Calls from the native request path into Python (request, misses)"
PYTHON_CALLS = ("request", "misses")


class HostedModel:
    """One model instance's ``TritonPythonModel``, hosted in the server process.

    Args:
        model_file: the backend's ``model.py``.
        args: what the Python backend passes to ``initialize`` (``model_config`` JSON,
            ``model_name``, ``model_repository``, ``model_version``, ``model_instance_*``).
    """

    def __init__(self, model_file: str, args: Dict[str, str]):
        sys.modules.setdefault("triton_python_backend_utils", sys.modules[__name__])
        name = f"triton_rec_hosted_{Path(model_file).parent.name}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, model_file)
            if spec is None or spec.loader is None:
                raise TritonModelException(f"cannot load the backend's {model_file}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
        self.name = args.get("model_name", "")
        self.model = module.TritonPythonModel()
        with self._working():
            self.model.initialize(dict(args))
        family = MetricFamily(PYTHON_CALLS_METRIC, PYTHON_CALLS_HELP, MetricFamily.COUNTER)
        self._calls = {w: family.Metric({"model": self.name, "what": w}) for w in PYTHON_CALLS}

    @contextlib.contextmanager
    def _working(self):
        # engine log lines of this thread name this model (instance.CURRENT_MODEL)
        CURRENT_MODEL.name = self.name
        try:
            yield
        finally:
            CURRENT_MODEL.name = None

    def execute(self, requests: Sequence[RawRequest]) -> List[RawResponse]:
        """Answer ``requests`` with the hosted model's ``execute``."""
        reqs = [
            InferenceRequest({n: _as_tensor(n, *v) for n, v in r[0].items()}, r[1])
            for r in requests
        ]
        self._calls["request"].increment(len(reqs))
        with self._working():
            responses = self.model.execute(reqs)
        return [_raw_response(r) for r in responses]

    def native_plan(self) -> Optional[NativePlan]:
        """What the native hot path needs to answer this model's requests itself (a
        :class:`~triton_rec.serving.native_plan.NativePlan`), or None when the model has
        none (it then answers everything here)."""
        make = getattr(self.model, "native_plan", None)
        plan = make() if make is not None else None
        for table in plan.tables if plan is not None else ():
            if table.finish is not None:  # misses answered in Python: counted
                table.finish = self._counted(table.finish)
        return plan

    def _counted(self, finish: Callable) -> Callable:
        """``finish`` (a table's miss handler in Python), each call counted."""
        metric = self._calls["misses"]

        def counted(*args):
            metric.increment(1)
            with self._working():
                return finish(*args)

        return counted

    def finalize(self) -> None:
        """The hosted model's ``finalize`` (threads stopped, caches detached)."""
        fin = getattr(self.model, "finalize", None)
        if fin is not None:
            with self._working():
                fin()
