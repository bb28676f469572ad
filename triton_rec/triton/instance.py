"""What every model instance does at load (``pb_utils`` is passed in): its process set up
(:func:`prepare_process`), the engine's logs routed to Triton's (:func:`route_engine_logs`),
and the load line (:func:`log_load`)."""

from __future__ import annotations

import logging
import threading
from typing import Optional

#: Seconds an instance process may outlive its server before the native watchdog ends
#: it (the Python backend's own exit path normally takes well under a second).
ORPHAN_GRACE_S = 5.0


def prepare_process(pb_utils, model_name: str, config: dict):
    """What every instance does first, in ``initialize``: route the engine's logs to
    Triton's log, size this process's thread pools (``intra_op_threads``) and its
    allocator (:mod:`triton_rec.triton.process_setup`), start the parent watchdog, log it all.
    Returns the
    :class:`~triton_rec.config.model_config.InstanceSettings` (ConfigError if malformed)."""
    from triton_rec import _native
    from triton_rec.config.model_config import InstanceSettings
    from triton_rec.triton.process_setup import limit_thread_pools, tune_allocator

    route_engine_logs(pb_utils, model_name)
    settings = InstanceSettings.from_config(config)
    pools = limit_thread_pools(settings.intra_op_threads)
    if getattr(pb_utils, "IN_PROCESS", False):
        # hosted by the native backend inside the server: the server's allocator and its
        # parent are not this model's to change or watch
        malloc = "in-process (native backend)"
    else:
        malloc = tune_allocator()
        _native.start_parent_watchdog(ORPHAN_GRACE_S)
    line = f"model '{model_name}': {settings.describe(config)}; pools: {pools}; {malloc}"
    log = pb_utils.Logger.log_warn if settings.oversubscribes(config) else pb_utils.Logger.log_info
    log(line)
    return settings


class TritonLogHandler(logging.Handler):
    """Forwards the engine's ``logging`` records (``triton_rec``, ``ps_loader``: import
    progress, tiers skipped, update consumer errors) to Triton's log."""

    def __init__(self, pb_utils, model_name: Optional[str]):
        super().__init__(logging.INFO)
        self.pb_utils = pb_utils
        self.model_name = model_name

    def emit(self, record: logging.LogRecord) -> None:
        """Send ``record`` to Triton's log at the matching level."""
        try:
            # in-process, one handler serves every model: the one this thread works for
            model = getattr(CURRENT_MODEL, "name", None) or self.model_name
            prefix = f"model '{model}': " if model else ""
            msg = f"{prefix}{record.name}: {self.format(record)}"
            log = self.pb_utils.Logger
            if record.levelno >= logging.ERROR:
                log.log_error(msg)
            elif record.levelno >= logging.WARNING:
                log.log_warn(msg)
            else:
                log.log_info(msg)
        except Exception:  # logging must never fail a model
            self.handleError(record)


#: The model a thread is loading or answering for, when several models share a process
#: (the native backend hosts them all in the server): ``CURRENT_MODEL.name``.
CURRENT_MODEL = threading.local()


def route_engine_logs(pb_utils, model_name: str) -> None:
    """Send INFO and above of the engine's loggers to Triton's log (once per process).
    In-process (the native backend) lines name the model of :data:`CURRENT_MODEL`, or
    none (a background thread's line names its logger only)."""
    in_process = getattr(pb_utils, "IN_PROCESS", False)
    for name in ("triton_rec", "ps_loader"):
        logger = logging.getLogger(name)
        if not any(isinstance(h, TritonLogHandler) for h in logger.handlers):
            logger.addHandler(TritonLogHandler(pb_utils, None if in_process else model_name))
        logger.setLevel(logging.INFO)


def log_load(pb_utils, model_name: str, kind: str, ready: str, warnings=(), placement=None):
    """What every backend says once a model instance is loaded: the configuration
    warnings, where a KIND_GPU instance put its parts (``placement``, if any) and
    ``<kind> model '<name>' ready: <ready>``."""
    for line in warnings:
        pb_utils.Logger.log_warn(line)
    if placement is not None:
        pb_utils.Logger.log_info(f"model '{model_name}': {placement}")
    pb_utils.Logger.log_info(f"{kind} model '{model_name}' ready: {ready}")
