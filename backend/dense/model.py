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

from triton_rec.config.model_config import check_dense_model_config, model_parameter
from triton_rec.serving.deployment import dense_placement, gpu_placement, load_dense_model
from triton_rec.serving.ranking import DenseSession
from triton_rec.triton.model_scaffold import BackendModel
from triton_rec.triton.request_loop import Responder


class TritonPythonModel(BackendModel):
    """One instance per Triton model instance (the life cycle: BackendModel)."""

    pb_utils = pb_utils
    kind = "dense"
    inputs = ("DES", "EMBEDDINGS", "ROWINDEX")
    table_metrics = False  # no tables: the request counters only

    def open(self, args, config, settings):
        """Load the model's dense network named by ps.json; limits, counters and metrics."""
        output_name = check_dense_model_config(config)
        # the ps.json entry that names the network: another model's, as it is written
        _, params = self.model_params(
            args, config, model_parameter(config, "ps_model"), apply_parameters=False
        )
        spec = self.instance_spec(args, config, settings)
        placement = dense_placement(params, spec)
        dense = load_dense_model(
            params,
            args["model_repository"],
            model_parameter(config, "config"),
            settings.intra_op_threads,
            placement.xp,
            placement.device,
            placement.math,
        )
        self.session = DenseSession(self.model_name, dense, params.max_batch_size, params)
        # the response: the predictions only (no HPS response parameters)
        respond = Responder(pb_utils, output_name, (), self.device_id, parameters=False)
        self.start_serving(args, settings, respond, self.session.input_limits())
        return repr(dense), (), gpu_placement(None, spec, placement)

    def answer(self, parsed):
        """One dense forward pass over every valid request of the call."""
        return self.session.predict_many(parsed)
