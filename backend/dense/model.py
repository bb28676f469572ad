"""Triton Python-based backend ``dense``: the dense half of an hps -> dense ensemble.

Inputs ``DES`` (FP32), ``EMBEDDINGS`` (FP32: the output of an ``hps`` model for the
request's keys, table-major) and ``ROWINDEX`` (INT32, the ``hugectr`` layout counted
within each table's keys, so multi-hot slots work); one FP32 output of predictions.

The dense network (ONNX via onnxruntime, or a HugeCTR dense file + network JSON) is
named by the ps.json entry of the config.pbtxt parameter ``ps_model`` (default: this
model's own name): typically the ``hps`` model of the same ensemble, whose entry holds
``dense_file`` / ``network_file`` next to its ``sparse_files``.
"""

import triton_python_backend_utils as pb_utils

from triton_rec.config.model_config import check_max_batch_size, model_parameter
from triton_rec.config.ps_json import find_ps_config, load_ps_config
from triton_rec.errors import ConfigError
from triton_rec.serving.deployment import (
    InstanceSpec,
    dense_placement,
    gpu_placement,
    load_dense_model,
)
from triton_rec.serving.ranking import DenseSession
from triton_rec.triton.metrics import MetricsPusher, RequestMetrics
from triton_rec.triton.model_scaffold import BackendModel
from triton_rec.triton.request_loop import RequestCounters


class TritonPythonModel(BackendModel):
    """One instance per Triton model instance (the life cycle: BackendModel)."""

    pb_utils = pb_utils
    kind = "dense"
    inputs = ("DES", "EMBEDDINGS", "ROWINDEX")

    def open(self, args, config, settings):
        """Load the model's dense network named by ps.json; limits, counters and metrics."""
        check_max_batch_size(config)
        outputs = config.get("output") or []
        if len(outputs) != 1 or outputs[0].get("data_type") != "TYPE_FP32":
            raise ConfigError(
                f"model '{self.model_name}' config.pbtxt: expected one TYPE_FP32 output"
            )
        self.output_name = outputs[0]["name"]
        ps_path = find_ps_config(args["model_repository"], model_parameter(config, "ps"))
        params = load_ps_config(ps_path).model(
            model_parameter(config, "ps_model") or self.model_name
        )
        spec = InstanceSpec(kind=args.get("model_instance_kind", "CPU"), device_id=self.device_id)
        placement = dense_placement(params, spec)
        dense = load_dense_model(
            params,
            args["model_repository"],
            model_parameter(config, "config"),
            settings.intra_op_threads,
            placement.xp,
            placement.device,
        )
        self.session = DenseSession(self.model_name, dense, params.max_batch_size, params)
        self.limits = self.session.input_limits()
        self.counters = RequestCounters()
        self.metrics = MetricsPusher(
            pb_utils,
            self.model_name,
            RequestMetrics(pb_utils, self.model_name, self.counters),
            settings.metrics_interval,
        )
        return repr(dense), (), gpu_placement(None, spec, placement)

    def respond(self, parsed, out):
        """The response: the predictions only (no HPS response parameters)."""
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(self.output_name, out)])

    def native_plan(self):
        """For the native backend (``triton_rec.triton.inprocess``): what its hot path
        answers this instance's requests with (a HugeCTR network on the host), or None."""
        plan = self.session.native_plan()
        return plan.responding(self.output_name, (), 0) if plan is not None else None

    def answer(self, parsed):
        """One dense forward pass over every valid request of the call."""
        return self.session.predict_many(parsed)
