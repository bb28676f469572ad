"""Triton Python-based backend ``hps``: HPS-compatible embedding lookup.

Select it with ``backend: "hps"`` in config.pbtxt. The interface is the one of
NVIDIA's HPS backend: inputs ``KEYS`` (INT64, table-major) and ``NUMKEYS`` (INT32,
``[1, T]`` or ``[T]``), one FP32 output (named in config.pbtxt, ``OUTPUT0`` in the
samples) of length ``sum_t NUMKEYS[t] * vec_size[t]``.

The model finds its ps.json through the config.pbtxt parameter ``ps`` (relative to
the model directory), else ``ps.json`` at the repository root. All the work is in the
``triton_rec`` package; this file reads tensors, reports errors, builds responses.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_rec.config import find_ps_config, load_ps_config
from triton_rec.errors import RequestError, TritonRecError
from triton_rec.model_config import check_hps_model_config, model_parameter
from triton_rec.session import LookupSession


def _supports_response_parameters():
    # The Python backend of Triton 2.51 (the PyPI runtime) has no response parameters;
    # newer ones take InferenceResponse(..., parameters=...).
    try:
        pb_utils.InferenceResponse(output_tensors=[], parameters={"probe": 1})
        return True
    except TypeError:
        return False


def _tensor(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    """One instance per Triton model instance (each its own process)."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        self.device_id = int(args.get("model_instance_device_id") or 0)
        try:
            self.output_name, self.extra_outputs = check_hps_model_config(config)
            ps_path = find_ps_config(args["model_repository"], model_parameter(config, "ps"))
            params = load_ps_config(ps_path).model(self.model_name)
            self.session = LookupSession.from_params(params)
        except TritonRecError as e:
            raise pb_utils.TritonModelException(f"model '{self.model_name}': {e}") from e
        self.response_parameters = _supports_response_parameters()
        for key in params.unknown_keys:
            pb_utils.Logger.log_warn(f"{ps_path}: model '{self.model_name}': unknown key '{key}' ignored")
        pb_utils.Logger.log_info(
            f"hps model '{self.model_name}' ready: "
            + ", ".join(repr(t) for t in self.session.tables)
        )

    def execute(self, requests):
        responses = [None] * len(requests)
        parsed, slots = [], []
        for i, request in enumerate(requests):
            try:
                keys = _tensor(request, "KEYS")
                numkeys = _tensor(request, "NUMKEYS")
                if keys is None or numkeys is None:
                    raise RequestError(f"model '{self.model_name}': KEYS and NUMKEYS are both required")
                parsed.append(self.session.parse_request(keys, numkeys))
                slots.append(i)
            except RequestError as e:
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                )
        # Every valid request of this call is looked up together, one pass per table.
        try:
            answers = self.session.lookup_many(parsed)
        except Exception as e:  # a bug must not take the other requests' answers down
            pb_utils.Logger.log_error(f"model '{self.model_name}': lookup failed: {e!r}")
            err = pb_utils.TritonError(f"model '{self.model_name}': lookup failed: {e}")
            for i in slots:
                responses[i] = pb_utils.InferenceResponse(error=err)
            return responses
        for i, req, out in zip(slots, parsed, answers):
            responses[i] = self._response(out, req.num_samples)
        return responses

    def _response(self, out, num_samples):
        info = {"NumSample": num_samples, "DeviceID": self.device_id}
        tensors = [pb_utils.Tensor(self.output_name, out)]
        tensors += [pb_utils.Tensor(n, np.array([info[n]], np.int32)) for n in self.extra_outputs]
        if self.response_parameters:
            return pb_utils.InferenceResponse(output_tensors=tensors, parameters=info)
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        self.session = None

