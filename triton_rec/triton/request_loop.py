"""The request loop every backend shares (``pb_utils`` is passed in), and its response.

Every backend's ``execute`` is the same shape: read each request's input tensors,
validate them (a malformed request gets its own ``INVALID_ARG`` error and does not
disturb the others), run every valid request of the call together, build one response
per request. An unexpected failure of the batched run answers the valid requests of
that call with an error instead of taking the model instance down.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import mmap
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from triton_rec.config.model_config import DEFAULT_INFO, EXACT_PARAMETER
from triton_rec.errors import RequestError, RequestTooLarge  # noqa: F401  (re-exported)
from triton_rec.triton.drain import STOPPING_MESSAGE, process_drain_file

#: Per input name: (most elements a valid request of the model holds, bytes per element,
#: how that number follows from the model's configuration). Built once at ``initialize``
#: by the session (``input_limits()``), checked on tensor metadata only.
InputLimits = Mapping[str, Tuple[int, int, str]]

RESULT_REJECTED_INVALID = "invalid"
RESULT_REJECTED_TOO_LARGE = "too_large"
RESULT_FAILED = "internal"


class RequestCounters:
    """Requests an instance answered with an error, by reason (plain integers, bumped on
    the request path; published by the metrics thread as ``trec_requests_rejected_total``,
    see :mod:`triton_rec.triton.metrics`). Triton 2.51's Python backend counts every
    request answered with an error response as a success (docs/upstream-notes.md)."""

    REASONS = (RESULT_REJECTED_INVALID, RESULT_REJECTED_TOO_LARGE, RESULT_FAILED)

    def __init__(self):
        self.counts = dict.fromkeys(self.REASONS, 0)

    def snapshot(self) -> dict:
        """A copy of the counts, by reason."""
        return dict(self.counts)


_MADV_REMOVE = 9  # Linux: free the backing store (tmpfs pages) of a shared mapping
_libc = None


def release_input_pages(tensor, nbytes: int) -> bool:
    """Give back the shared-memory pages that hold a rejected input's data.

    The Python backend copies every input into its shared-memory pool before
    ``execute`` runs, and the pool never shrinks: a 400 MB request would stay resident
    (in /dev/shm, in the server and in this process) for the life of the instance.
    ``madvise(MADV_REMOVE)`` on the whole pages inside the tensor's data frees them in
    every process that maps the pool; the pool's allocator state lives outside the
    tensor's data, and the data of a rejected request is never read again. The address
    comes from the tensor's DLPack capsule (no copy). Returns whether pages were freed.
    """
    global _libc
    try:
        capsule = tensor.to_dlpack()
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        managed = get(capsule, b"dltensor")
        # DLManagedTensor starts with DLTensor, which starts with `void* data`;
        # device (int32 type, int32 id) follows: only kDLCPU (1) memory is released.
        data = ctypes.c_void_p.from_address(managed).value
        device_type = ctypes.c_int32.from_address(managed + ctypes.sizeof(ctypes.c_void_p)).value
        if not data or device_type != 1:
            return False
        page = mmap.PAGESIZE
        start, end = -(-data // page) * page, (data + nbytes) // page * page
        if end <= start:
            return False
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return _libc.madvise(start, end - start, _MADV_REMOVE) == 0
    except Exception:  # best effort: the request is refused either way
        return False


#: An input over its limit but at most this large is left to the model's own checks,
#: which name the precise problem (samples over max_batch_size, counts per table...);
#: a larger one is refused from its shape alone, its data never read.
PRECISE_CHECK_BYTES = 1 << 20


def check_input_size(model_name: str, name: str, tensor, limits: InputLimits) -> bool:
    """Whether ``tensor`` holds more elements than any valid request of the model (from
    its shape: no data is read). Above :data:`PRECISE_CHECK_BYTES` such a tensor is
    refused here (RequestTooLarge) and its shared-memory pages are released."""
    limit = limits.get(name)
    if limit is None:
        return False
    n = 1
    for d in tensor.shape():
        n *= int(d)
    max_elements, itemsize, why = limit
    if n <= max_elements:
        return False
    if n * itemsize <= PRECISE_CHECK_BYTES:
        return True
    release_input_pages(tensor, n * itemsize)
    raise too_large(model_name, name, n, limit)


def too_large(model_name: str, name: str, n: int, limit) -> RequestTooLarge:
    """The error for an input of ``n`` elements over ``limit`` (its bound, itemsize, reason)."""
    max_elements, itemsize, why = limit
    return RequestTooLarge(
        f"model '{model_name}': input {name} holds {n} elements ({n * itemsize} bytes), "
        f"more than the {max_elements} ({max_elements * itemsize} bytes) of the model's "
        f"largest valid request ({why})"
    )


def run_requests(
    pb_utils,
    model_name: str,
    requests: Sequence,
    input_names: Sequence[str],
    parse: Callable,
    run: Callable[[List], List],
    respond: Callable,
    limits: Optional[InputLimits] = None,
    counters: Optional[RequestCounters] = None,
    options: bool = False,
) -> List:
    """One ``execute`` call.

    Args:
        pb_utils: ``triton_python_backend_utils``.
        model_name: for messages.
        requests: the call's requests.
        input_names: tensors to read, passed to ``parse`` in this order.
        parse: ``parse(*tensors) -> parsed request``; raises RequestError.
        run: ``run(parsed requests) -> answers`` (one per request, same order).
        respond: ``respond(parsed, answer) -> pb_utils.InferenceResponse``.
        limits: per input, the most elements a valid request holds: a larger input is
            refused from its shape, before its data is read (:func:`check_input_size`).
        counters: counts the requests answered with an error, by reason.
        options: read the request parameters the engine takes (:func:`exact_requested`)
            into the parsed request (a dataclass with an ``exact`` field).

    The call is counted in flight for the drained stop (:mod:`triton_rec.triton.drain`):
    once the server is stopping, every request of the call is refused as retryable
    (``UNAVAILABLE``) before any work.
    """
    drain = process_drain_file()
    refuse = drain is not None and drain.enter()
    try:
        if refuse:  # one error object per response: the stub frees each with it
            return [
                pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(STOPPING_MESSAGE, pb_utils.TritonError.UNAVAILABLE)
                )
                for _ in requests
            ]
        responses = [None] * len(requests)
        parsed, slots = [], []
        for i, request in enumerate(requests):
            over = None
            try:
                tensors = []
                for name in input_names:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is None:
                        raise RequestError(
                            f"model '{model_name}': missing input {name} "
                            f"(needs {', '.join(input_names)})"
                        )
                    if limits is not None and check_input_size(model_name, name, t, limits):
                        over = name
                    tensors.append(t.as_numpy())
                request_parsed = parse(*tensors)
                if options and exact_requested(model_name, request):
                    request_parsed = dataclasses.replace(request_parsed, exact=True)
                if over is not None and limits is not None:  # consistent, but larger than allowed
                    n = tensors[list(input_names).index(over)].size
                    raise too_large(model_name, over, n, limits[over])
                parsed.append(request_parsed)
                slots.append(i)
            except RequestError as e:
                if counters is not None:
                    reason = (
                        RESULT_REJECTED_TOO_LARGE
                        if over is not None or isinstance(e, RequestTooLarge)
                        else RESULT_REJECTED_INVALID
                    )
                    counters.counts[reason] += 1
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                )
        try:
            answers = run(parsed)
        except Exception as e:  # a bug must not take the other requests' answers down
            pb_utils.Logger.log_error(f"model '{model_name}': inference failed: {e!r}")
            message = f"model '{model_name}': inference failed: {e}"
            for i in slots:  # one error object per response, as above
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
            if counters is not None:
                counters.counts[RESULT_FAILED] += len(slots)
            return responses
        for i, req, out in zip(slots, parsed, answers):
            responses[i] = respond(req, out)
        return responses
    finally:
        if drain is not None:
            drain.leave()


def exact_requested(model_name: str, request) -> bool:
    """The request parameter :data:`~triton_rec.config.model_config.EXACT_PARAMETER`
    (``exact``): fetch every cache miss now, whatever ``hit_rate_threshold`` says. A bool,
    or the string ``"true"``/``"false"``; absent: False. Raises RequestError otherwise."""
    read = getattr(request, "parameters", None)
    raw = read() if read is not None else None
    if not raw:
        return False
    params = json.loads(raw) if isinstance(raw, (str, bytes)) else dict(raw)
    value = params.get(EXACT_PARAMETER, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise RequestError(
        f"model '{model_name}': request parameter '{EXACT_PARAMETER}' must be a bool "
        f"(true/false), got {value!r}"
    )


def supports_response_parameters(pb_utils) -> bool:
    """Whether this Triton's Python backend attaches response parameters (newer ones take
    ``InferenceResponse(..., parameters=...)``; the PyPI runtime, Triton 2.51, does not)."""
    try:
        pb_utils.InferenceResponse(output_tensors=[], parameters={"probe": 1})
        return True
    except TypeError:
        return False


class Responder:
    """Builds the response of the ``hps`` and ``hugectr`` backends: the answer tensor and
    HPS's ``NumSample`` / ``DeviceID``, plus the keys answered with the default value by
    cause (:data:`~triton_rec.config.model_config.DEFAULT_INFO`), as response parameters
    where the runtime allows (as both NVIDIA backends send theirs) and as the INT32
    outputs config.pbtxt declares.

    Args:
        pb_utils: the Python backend's module.
        output_name: the answer's output.
        info_outputs: the declared info outputs (``NumSample``, ``DeviceID``).
        device_id: the instance's device id (``DeviceID``).
        parameters: send HPS's response parameters where the runtime allows (False: the
            ``dense`` backend, whose response is its predictions only).
    """

    def __init__(
        self, pb_utils, output_name: str, info_outputs, device_id: int, parameters: bool = True
    ):
        self.pb_utils = pb_utils
        self.output_name = output_name
        self.info_outputs = tuple(info_outputs)
        self.device_id = int(device_id)
        self.parameters = parameters and supports_response_parameters(pb_utils)

    def native_fields(self) -> dict:
        """The response's names and ``DeviceID`` as the native backend's plan takes them
        (the native path builds the same response in C++)."""
        return {
            "output": self.output_name,
            "info_outputs": list(self.info_outputs),
            "device_id": self.device_id,
        }

    def __call__(self, request, out):
        """The response to ``request`` (anything with ``num_samples``) answered by ``out``."""
        pb = self.pb_utils
        if not self.info_outputs and not self.parameters:  # the answer alone
            return pb.InferenceResponse(output_tensors=[pb.Tensor(self.output_name, out)])
        info = {"NumSample": int(request.num_samples), "DeviceID": self.device_id}
        defaults = getattr(request, "defaults", None)
        for i, name in enumerate(DEFAULT_INFO):
            info[name] = int(defaults[i]) if defaults is not None else 0
        tensors = [pb.Tensor(self.output_name, out)]
        tensors += [pb.Tensor(n, np.array([info[n]], np.int32)) for n in self.info_outputs]
        if self.parameters:
            return pb.InferenceResponse(output_tensors=tensors, parameters=info)
        return pb.InferenceResponse(output_tensors=tensors)
