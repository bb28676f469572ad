"""The life cycle every backend's ``TritonPythonModel`` shares (``hps``, ``hugectr``,
``dense``), written once: a backend's ``model.py`` says only what is its own (how it opens
its session, which inputs it reads, how it answers) in :meth:`BackendModel.open`.

- ``initialize``: the config JSON, the process set-up (:func:`~triton_rec.triton.instance.
  prepare_process`), the backend's :meth:`~BackendModel.open` (which finds its ps.json
  entry with :meth:`~BackendModel.model_params`, places its instance with
  :meth:`~BackendModel.instance_spec` and, its session open, starts serving it with
  :meth:`~BackendModel.start_serving`: the response, the input limits, the counters and
  the metrics); any
  :class:`~triton_rec.errors.TritonRecError` becomes the load's error, naming the model;
  then the load log line (:func:`~triton_rec.triton.instance.log_load`) and the model's
  sizing, once per model (:func:`~triton_rec.triton.plan_cli.log_sizing`);
- ``native_plan``: the session's plan named with the model's response (the native
  backend, :mod:`triton_rec.triton.inprocess`);
- ``execute``: :func:`~triton_rec.triton.request_loop.run_requests` over the backend's inputs;
- ``finalize``: the metrics thread stopped, the session closed.

``pb_utils`` (``triton_python_backend_utils``) is the backend's: each ``model.py`` sets
it as a class attribute, so this module imports without Triton.
"""

from __future__ import annotations

import abc
import json
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from triton_rec.config.model_config import (
    InstanceSettings,
    model_flag,
    model_parameter,
    with_model_parameters,
)
from triton_rec.config.ps_json import (
    ModelParams,
    find_ps_config,
    load_ps_config,
    model_relative_path,
)
from triton_rec.errors import TritonRecError
from triton_rec.serving.deployment import InstanceSpec
from triton_rec.triton.instance import log_load, prepare_process
from triton_rec.triton.metrics import MetricsPusher, RequestMetrics, start_session_metrics
from triton_rec.triton.plan_cli import forget_sizing, log_sizing
from triton_rec.triton.request_loop import RequestCounters, Responder, run_requests


class BackendModel(abc.ABC):
    """The shared ``TritonPythonModel`` (see the module docstring). A backend sets the
    class attributes and implements :meth:`open`, which sets ``session``, ``respond``,
    ``limits``, ``counters`` and ``metrics`` and returns what the load log says."""

    #: the backend's triton_python_backend_utils
    pb_utils: Any = None
    #: the backend's name, as the load log says it ("hps", "hugectr", "dense")
    kind: str = ""
    #: the inputs ``execute`` reads, in the order the session's ``parse_request`` takes them
    inputs: Tuple[str, ...] = ()
    #: whether requests carry the engine's parameters (``exact``)
    options: bool = False
    #: whether the metrics publish the session's tables (cache and store statistics) beside
    #: the request counters (the ``dense`` backend has no tables)
    table_metrics: bool = True

    model_name: str
    device_id: int
    session: Any = None
    metrics: Any = None
    counters: Any = None
    limits: Optional[Dict[str, Tuple[int, int, str]]] = None
    respond: Optional[Callable] = None
    _sized: bool = False  # its load logged the model's sizing (plan_cli.log_sizing)

    def initialize(self, args: Dict[str, str]) -> None:
        """Load the model instance (Triton's ``initialize``)."""
        config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        self.device_id = int(args.get("model_instance_device_id") or 0)
        try:
            settings = prepare_process(self.pb_utils, self.model_name, config)
            ready, warnings, placement = self.open(args, config, settings)
        except TritonRecError as e:
            self.finalize()  # what open() had opened before it failed
            raise self.pb_utils.TritonModelException(f"model '{self.model_name}': {e}") from e
        log_load(self.pb_utils, self.model_name, self.kind, ready, warnings, placement)
        log_sizing(self.pb_utils, self.model_name, config, args)
        self._sized = True

    @abc.abstractmethod
    def open(
        self, args: Dict[str, str], config: Dict[str, Any], settings: InstanceSettings
    ) -> Tuple[str, Sequence[str], Optional[str]]:
        """Open the backend's session and what serves it; returns the load log's
        ``(ready description, configuration warnings, placement or None)``."""

    def model_params(
        self,
        args: Dict[str, str],
        config: Dict[str, Any],
        name: Optional[str] = None,
        apply_parameters: bool = True,
    ) -> Tuple[str, ModelParams]:
        """``(ps.json path, entry)``: the model's ps.json (the config.pbtxt parameter
        ``ps``, relative to the model directory, else the repository's ``ps.json``) and its
        entry for ``name`` (default: this model), with the config.pbtxt parameters that
        override ps.json applied unless ``apply_parameters`` is false."""
        ps_path = find_ps_config(args["model_repository"], model_parameter(config, "ps"))
        params = load_ps_config(ps_path).model(name or self.model_name)
        return ps_path, with_model_parameters(config, params) if apply_parameters else params

    def start_serving(
        self,
        args: Dict[str, str],
        settings: InstanceSettings,
        respond: Responder,
        limits: Dict[str, Tuple[int, int, str]],
    ) -> None:
        """Once :meth:`open` has opened ``session``: the response builder, the input
        limits ``execute`` checks, fresh request counters and the metrics thread publishing
        them (with the session's table statistics where :attr:`table_metrics`) every
        ``metrics_interval`` seconds."""
        self.respond = respond
        self.limits = limits
        interval = settings.metrics_interval
        if self.table_metrics:
            self.counters, self.metrics = start_session_metrics(
                self.pb_utils, self.model_name, args["model_instance_name"], self.session, interval
            )
            return
        self.counters = RequestCounters()
        metrics = RequestMetrics(self.pb_utils, self.model_name, self.counters)
        self.metrics = MetricsPusher(self.pb_utils, self.model_name, metrics, interval)

    def instance_spec(
        self, args: Dict[str, str], config: Dict[str, Any], settings: InstanceSettings
    ) -> InstanceSpec:
        """Where this instance runs and finds its tables: its kind and device, the
        config.pbtxt parameters ``store_dir`` (relative to the repository) and
        ``prefault``, its thread pool, the model's version."""
        return InstanceSpec(
            kind=args.get("model_instance_kind", "CPU"),
            device_id=self.device_id,
            store_dir=model_relative_path(
                args["model_repository"], model_parameter(config, "store_dir")
            ),
            prefault=model_flag(config, "prefault", True),
            intra_op_threads=settings.intra_op_threads,
            model_version=str(args.get("model_version") or ""),
            dense_math=settings.dense_math,
        )

    @abc.abstractmethod
    def answer(self, parsed: Sequence) -> list:
        """The answers to the parsed requests of one ``execute`` (one per request)."""

    def plan_options(self) -> Dict[str, Any]:
        """Keyword arguments of the session's ``native_plan`` (none by default)."""
        return {}

    def native_plan(self):
        """For the native backend (:mod:`triton_rec.triton.inprocess`): what its hot path
        answers this instance's requests with, or None."""
        plan = self.session.native_plan(**self.plan_options())
        if plan is not None and self.respond is not None:
            plan = plan.responding(**self.respond.native_fields())
        return plan

    def execute(self, requests):
        """Answer a batch of requests (Triton's ``execute``): every valid one in one
        :meth:`answer`, each malformed one with the error that names what is wrong."""
        return run_requests(
            self.pb_utils,
            self.model_name,
            requests,
            self.inputs,
            self.session.parse_request,
            self.answer,
            self.respond,
            limits=self.limits,
            counters=self.counters,
            options=self.options,
        )

    def finalize(self) -> None:
        """Stop the metrics thread and close the session (Triton's ``finalize``)."""
        if self._sized:
            forget_sizing(self.model_name)
            self._sized = False
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.session is not None:
            self.session.close()
            self.session = None
