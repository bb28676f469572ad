"""Triton Python-based backend ``hps``: HPS-compatible embedding lookup.

Select it with ``backend: "hps"`` in config.pbtxt. The interface is the one of
NVIDIA's HPS backend: inputs ``KEYS`` (INT64, table-major) and ``NUMKEYS`` (INT32,
``[1, T]`` or ``[T]``), one FP32 output (named in config.pbtxt, ``OUTPUT0`` in the
samples) of length ``sum_t NUMKEYS[t] * vec_size[t]``.

The model finds its ps.json through the config.pbtxt parameter ``ps`` (relative to
the model directory), else ``ps.json`` at the repository root. Other parameters:
``store_dir`` (node-local table store; default ``$TRITON_REC_STORE`` or
``~/.cache/triton-rec/store``) and ``prefault`` (``true``/``false``, default true).

All the work is in the ``triton_rec`` package (tables shared through the node-local
store, one embedding cache per model/device/table shared by every instance); this
file reads tensors, reports errors, builds responses and publishes metrics.
"""

import triton_python_backend_utils as pb_utils

from triton_rec.config.model_config import check_hps_model_config
from triton_rec.config.ps_json import config_warnings
from triton_rec.serving.deployment import gpu_placement, open_session
from triton_rec.triton.model_scaffold import BackendModel
from triton_rec.triton.request_loop import Responder


class TritonPythonModel(BackendModel):
    """One instance per Triton model instance (the life cycle: BackendModel)."""

    pb_utils = pb_utils
    kind = "hps"
    inputs = ("KEYS", "NUMKEYS")
    options = True  # the request parameter "exact"

    def open(self, args, config, settings):
        """Open the model's tables (store, cache, tiers) from ps.json; limits and metrics."""
        output_name, info_outputs = check_hps_model_config(config)
        ps_path, params = self.model_params(args, config)
        spec = self.instance_spec(args, config, settings)
        self.session = open_session(params, spec)
        placement = gpu_placement(params, spec)
        respond = Responder(pb_utils, output_name, info_outputs, self.device_id)
        self.start_serving(args, settings, respond, self.session.input_limits())
        return self.session.describe(), config_warnings(ps_path, params), placement

    def answer(self, parsed):
        """Every valid request of the call looked up together, one pass per table."""
        return self.session.lookup_many(parsed)
