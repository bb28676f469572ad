"""Triton Python-based backend ``hugectr``: whole recommendation models, HugeCTR-compatible.

Select it with ``backend: "hugectr"``. Interface of NVIDIA's HugeCTR backend: inputs
``DES`` (FP32, samples x dense_dim), ``CATCOLUMN`` (UINT32 or INT64, keys sample-major),
``ROWINDEX`` (INT32, per-table CSR row pointers); one FP32 output, shape
``[num_samples]`` as upstream (``[num_samples, label_dim]`` for label_dim > 1), and
``NumSample`` / ``DeviceID`` as response parameters where the runtime allows, else as
optional INT32 outputs (as for ``hps``). The config.pbtxt parameters NVIDIA's backend
read are honoured or checked against ps.json and the network (``hugectr_cache_parameters``
and ``check_hugectr_parameters`` in triton_rec.config.model_config).

The model's ps.json entry (found like the ``hps`` backend's: parameter ``ps`` or
``ps.json`` at the repository root) names the sparse files and the dense model: a
HugeCTR dense file + network JSON (``network_file``, else the config.pbtxt parameter
``config`` as in the upstream samples), or an ONNX file as ``dense_file``. Embeddings
come from the node-local store and the shared cache, exactly as for ``hps`` models.
"""

import triton_python_backend_utils as pb_utils

from triton_rec.config.model_config import (
    check_hugectr_model_config,
    check_hugectr_parameters,
    hugectr_cache_parameters,
    model_parameter,
)
from triton_rec.config.ps_json import config_warnings
from triton_rec.serving.deployment import (
    dense_placement,
    gpu_placement,
    open_ranking_session,
)
from triton_rec.triton.model_scaffold import BackendModel
from triton_rec.triton.request_loop import Responder


class TritonPythonModel(BackendModel):
    """One instance per Triton model instance (the life cycle: BackendModel)."""

    pb_utils = pb_utils
    kind = "hugectr"
    inputs = ("DES", "CATCOLUMN", "ROWINDEX")
    options = True  # the request parameter "exact"

    def open(self, args, config, settings):
        """Open the model's tables and dense network from ps.json; limits and metrics."""
        output_name, info_outputs = check_hugectr_model_config(config)
        ps_path, params = self.model_params(args, config)
        params = hugectr_cache_parameters(config, params)
        spec = self.instance_spec(args, config, settings)
        notes: tuple = ()

        def check(network):  # needs the network; runs before any table is opened
            nonlocal notes
            notes = check_hugectr_parameters(
                config,
                self.model_name,
                dense_dim=network.dense_dim,
                slots=sum(int(t.slot_num) for t in network.tables),
                label_dim=network.label_dim,
                keys_per_sample=params.keys_per_sample,
                paths={
                    "sparse_files": tuple(t.sparse_file for t in params.tables),
                    **({"dense_file": (params.dense_file,)} if params.dense_file else {}),
                },
                model_dir=args["model_repository"],
            )

        dense = dense_placement(params, spec)
        self.session = open_ranking_session(
            params,
            spec,
            args["model_repository"],
            model_parameter(config, "config"),
            dense,
            check_dense=check,
        )
        placement = gpu_placement(params, spec, dense)
        cat = next(i for i in config["input"] if i["name"] == "CATCOLUMN")
        self.key_itemsize = 4 if cat.get("data_type") == "TYPE_UINT32" else 8
        respond = Responder(pb_utils, output_name, info_outputs, self.device_id)
        self.start_serving(args, settings, respond, self.session.input_limits(self.key_itemsize))
        warnings = (*config_warnings(ps_path, params), *notes)
        return repr(self.session.dense), warnings, placement

    def plan_options(self):
        """CATCOLUMN's key width (the native path's key type and limits)."""
        return {"key_itemsize": self.key_itemsize}

    def answer(self, parsed):
        """All valid requests of the call: one lookup per table, one dense forward pass."""
        return self.session.predict_many(parsed)
