"""The request loop the Python backends share (``pb_utils`` is passed in).

Every backend's ``execute`` is the same shape: read each request's input tensors,
validate them (a malformed request gets its own ``INVALID_ARG`` error and does not
disturb the others), run every valid request of the call together, build one response
per request. An unexpected failure of the batched run answers the valid requests of
that call with an error instead of taking the model instance down.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, List, Sequence

from triton_rec.errors import RequestError


def run_requests(
    pb_utils,
    model_name: str,
    requests: Sequence,
    input_names: Sequence[str],
    parse: Callable,
    run: Callable[[List], List],
    respond: Callable,
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
    """
    responses = [None] * len(requests)
    parsed, slots = [], []
    for i, request in enumerate(requests):
        try:
            tensors = []
            for name in input_names:
                t = pb_utils.get_input_tensor_by_name(request, name)
                if t is None:
                    raise RequestError(
                        f"model '{model_name}': missing input {name} (needs {', '.join(input_names)})"
                    )
                tensors.append(t.as_numpy())
            parsed.append(parse(*tensors))
            slots.append(i)
        except RequestError as e:
            responses[i] = pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
            )
    try:
        answers = run(parsed)
    except Exception as e:  # a bug must not take the other requests' answers down
        pb_utils.Logger.log_error(f"model '{model_name}': inference failed: {e!r}")
        err = pb_utils.TritonError(f"model '{model_name}': inference failed: {e}")
        for i in slots:
            responses[i] = pb_utils.InferenceResponse(error=err)
        return responses
    for i, req, out in zip(slots, parsed, answers):
        responses[i] = respond(req, out)
    return responses


def update_metrics(pb_utils, model_name: str, metrics) -> None:
    """Publish metrics; a metrics failure is logged, never raised."""
    try:
        metrics.update()
    except Exception as e:
        pb_utils.Logger.log_warn(f"model '{model_name}': metrics update failed: {e!r}")


class MetricsPusher:
    """Publishes an instance's metrics every ``interval`` seconds from a daemon thread.

    ``execute`` never publishes: every ``Metric.set``/``increment`` of the Python backend
    is a round trip to the server process (about 0.1 ms each, a dozen per model and
    table), and ``Metric.set`` holds the GIL while it waits. The engine's counters
    accumulate in-process (plain integers, :class:`~triton_rec.cached_table.TableStats`);
    this thread reads them and publishes what changed since its last pass, so an idle
    model costs no round trip at all.

    Exit safety: a publication blocks for good if the server dies while it is in flight
    (the server never answers). :meth:`close` therefore waits a bounded time for the
    thread, and an instance orphaned that way is ended by the process-wide native
    watchdog (:func:`prepare_process`).

    Args:
        pb_utils: ``triton_python_backend_utils``.
        model_name: for messages.
        metrics: has ``update()`` (a :class:`~triton_rec.triton_metrics.CacheMetrics`).
        interval: seconds between publications; 0 starts no thread (nothing is published
            unless :meth:`push` is called).
    """

    def __init__(self, pb_utils, model_name: str, metrics, interval: float):
        self._pb = pb_utils
        self._model = model_name
        self.metrics = metrics
        self.interval = float(interval)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"trec-metrics-{model_name}")
            self._thread.start()

    def push(self) -> None:
        """Publish what changed since the last publication (never raises; serialized)."""
        with self._lock:
            if not self._stop.is_set():
                update_metrics(self._pb, self._model, self.metrics)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.push()

    def close(self, timeout: float = 2.0) -> None:
        """Stop publishing (idempotent). Waits at most ``timeout`` s for a publication in
        flight; none starts after this returns."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


#: Seconds an instance process may outlive its server before the native watchdog ends
#: it (the Python backend's own exit path normally takes well under a second).
ORPHAN_GRACE_S = 5.0


def prepare_process(pb_utils, model_name: str, config: dict):
    """What every instance does first, in ``initialize``: route the engine's logs to
    Triton's log, size this process's thread pools (``intra_op_threads``) and its
    allocator (:mod:`triton_rec.process_setup`), start the parent watchdog, log it all. Returns the
    :class:`~triton_rec.model_config.InstanceSettings` (ConfigError if malformed)."""
    from triton_rec import _native
    from triton_rec.model_config import InstanceSettings
    from triton_rec.process_setup import limit_thread_pools, tune_allocator

    route_engine_logs(pb_utils, model_name)
    settings = InstanceSettings.from_config(config)
    pools = limit_thread_pools(settings.intra_op_threads)
    malloc = tune_allocator()
    _native.start_parent_watchdog(ORPHAN_GRACE_S)
    line = f"model '{model_name}': {settings.describe(config)}; pools: {pools}; {malloc}"
    log = pb_utils.Logger.log_warn if settings.oversubscribes(config) else pb_utils.Logger.log_info
    log(line)
    return settings


class TritonLogHandler(logging.Handler):
    """Forwards the engine's ``logging`` records (``triton_rec``, ``ps_loader``: import
    progress, tiers skipped, update consumer errors) to Triton's log."""

    def __init__(self, pb_utils, model_name: str):
        super().__init__(logging.INFO)
        self.pb_utils = pb_utils
        self.model_name = model_name

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = f"model '{self.model_name}': {record.name}: {self.format(record)}"
            log = self.pb_utils.Logger
            if record.levelno >= logging.ERROR:
                log.log_error(msg)
            elif record.levelno >= logging.WARNING:
                log.log_warn(msg)
            else:
                log.log_info(msg)
        except Exception:  # logging must never fail a model
            self.handleError(record)


def route_engine_logs(pb_utils, model_name: str) -> None:
    """Send INFO and above of the engine's loggers to Triton's log (once per process)."""
    for name in ("triton_rec", "ps_loader"):
        logger = logging.getLogger(name)
        if not any(isinstance(h, TritonLogHandler) for h in logger.handlers):
            logger.addHandler(TritonLogHandler(pb_utils, model_name))
        logger.setLevel(logging.INFO)
