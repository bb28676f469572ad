"""Triton Python-based backend ``hugectr``: whole recommendation models, HugeCTR-compatible.

Select it with ``backend: "hugectr"``. Interface of NVIDIA's HugeCTR backend: inputs
``DES`` (FP32, samples x dense_dim), ``CATCOLUMN`` (UINT32 or INT64, keys sample-major),
``ROWINDEX`` (INT32, per-table CSR row pointers); one FP32 output with one prediction
per sample (x label_dim).

The model's ps.json entry (found like the ``hps`` backend's: parameter ``ps`` or
``ps.json`` at the repository root) names the sparse files and the dense model: a
HugeCTR dense file + network JSON (``network_file``, else the config.pbtxt parameter
``config`` as in the upstream samples), or an ONNX file as ``dense_file``. Embeddings
come from the node-local store and the shared cache, exactly as for ``hps`` models.
"""

import json

import triton_python_backend_utils as pb_utils

from triton_rec.config.model_config import (
    check_hugectr_model_config,
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
from triton_rec.serving.deployment import (
    InstanceSpec,
    dense_placement,
    gpu_placement,
    open_ranking_session,
)
from triton_rec.triton.glue import prepare_process, run_requests
from triton_rec.triton.metrics import start_session_metrics


class TritonPythonModel:
    """One instance per Triton model instance (each its own process)."""

    def initialize(self, args):
        """Open the model's tables and dense network from ps.json; set up limits and metrics."""
        config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        try:
            settings = prepare_process(pb_utils, self.model_name, config)
            self.output_name = check_hugectr_model_config(config)
            ps_path = find_ps_config(args["model_repository"], model_parameter(config, "ps"))
            params = with_model_parameters(config, load_ps_config(ps_path).model(self.model_name))
            spec = InstanceSpec(
                kind=args.get("model_instance_kind", "CPU"),
                device_id=int(args.get("model_instance_device_id") or 0),
                store_dir=model_relative_path(
                    args["model_repository"], model_parameter(config, "store_dir")
                ),
                prefault=model_flag(config, "prefault", True),
                intra_op_threads=settings.intra_op_threads,
                model_version=str(args.get("model_version") or ""),
            )
            dense = dense_placement(params, spec)
            self.session = open_ranking_session(
                params, spec, args["model_repository"], model_parameter(config, "config"), dense
            )
            placement = gpu_placement(params, spec, dense)
        except TritonRecError as e:
            raise pb_utils.TritonModelException(f"model '{self.model_name}': {e}") from e
        cat = next(i for i in config["input"] if i["name"] == "CATCOLUMN")
        self.limits = self.session.input_limits(4 if cat.get("data_type") == "TYPE_UINT32" else 8)
        self.counters, self.metrics = start_session_metrics(
            pb_utils,
            self.model_name,
            args["model_instance_name"],
            self.session,
            settings.metrics_interval,
        )
        for line in config_warnings(ps_path, params):
            pb_utils.Logger.log_warn(line)
        if placement is not None:
            pb_utils.Logger.log_info(f"model '{self.model_name}': {placement}")
        pb_utils.Logger.log_info(f"hugectr model '{self.model_name}' ready: {self.session.dense!r}")

    def execute(self, requests):
        """Answer a batch of requests: one lookup per table, one dense forward pass."""
        # All valid requests of the call: one lookup per table, one dense forward pass.
        responses = run_requests(
            pb_utils,
            self.model_name,
            requests,
            ("DES", "CATCOLUMN", "ROWINDEX"),
            self.session.parse_request,
            self.session.predict_many,
            lambda req, out: pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(self.output_name, out)]
            ),
            limits=self.limits,
            counters=self.counters,
        )
        return responses

    def finalize(self):
        """Stop the metrics thread and close the session (tables, caches, threads)."""
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        if getattr(self, "session", None) is not None:
            self.session.close()
            self.session = None
