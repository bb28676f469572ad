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

import json

import triton_python_backend_utils as pb_utils

from triton_rec.config.model_config import (
    check_hps_model_config,
    model_flag,
    model_parameter,
    with_model_parameters,
)
from triton_rec.config.ps_json import (
    config_warnings,
    find_ps_config,
    load_ps_config,
    model_relative_path,
)
from triton_rec.errors import TritonRecError
from triton_rec.serving.deployment import InstanceSpec, gpu_placement, open_session
from triton_rec.triton.glue import Responder, log_load, prepare_process, run_requests
from triton_rec.triton.metrics import start_session_metrics


class TritonPythonModel:
    """One instance per Triton model instance (each its own process)."""

    def initialize(self, args):
        """Open the model's tables (store, cache, tiers) from ps.json; set up limits and metrics."""
        config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        self.device_id = int(args.get("model_instance_device_id") or 0)
        try:
            settings = prepare_process(pb_utils, self.model_name, config)
            output_name, info_outputs = check_hps_model_config(config)
            ps_path = find_ps_config(args["model_repository"], model_parameter(config, "ps"))
            params = with_model_parameters(config, load_ps_config(ps_path).model(self.model_name))
            spec = InstanceSpec(
                kind=args.get("model_instance_kind", "CPU"),
                device_id=self.device_id,
                store_dir=model_relative_path(
                    args["model_repository"], model_parameter(config, "store_dir")
                ),
                prefault=model_flag(config, "prefault", True),
                intra_op_threads=settings.intra_op_threads,
                model_version=str(args.get("model_version") or ""),
            )
            self.session = open_session(params, spec)
            placement = gpu_placement(params, spec)
        except TritonRecError as e:
            raise pb_utils.TritonModelException(f"model '{self.model_name}': {e}") from e
        self.respond = Responder(pb_utils, output_name, info_outputs, self.device_id)
        self.limits = self.session.input_limits()
        self.counters, self.metrics = start_session_metrics(
            pb_utils,
            self.model_name,
            args["model_instance_name"],
            self.session,
            settings.metrics_interval,
        )
        log_load(
            pb_utils,
            self.model_name,
            "hps",
            self.session.describe(),
            config_warnings(ps_path, params),
            placement,
        )

    def native_plan(self):
        """For the native backend (``triton_rec.triton.inprocess``): the addresses and
        limits its hot path answers this instance's requests with, or None."""
        plan = self.session.native_plan()
        if plan is not None:
            plan = plan.responding(**self.respond.native_fields())
        return plan

    def execute(self, requests):
        """Answer a batch of requests: one lookup per table for all valid requests."""
        # Every valid request of this call is looked up together, one pass per table.
        responses = run_requests(
            pb_utils,
            self.model_name,
            requests,
            ("KEYS", "NUMKEYS"),
            self.session.parse_request,
            self.session.lookup_many,
            self.respond,
            limits=self.limits,
            counters=self.counters,
            options=True,  # the request parameter "exact"
        )
        return responses

    def finalize(self):
        """Stop the metrics thread and close the session (tables, caches, threads)."""
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        if getattr(self, "session", None) is not None:
            self.session.close()
            self.session = None
