"""Triton custom metrics of the embedding cache, served on Triton's metrics port.

Counters are per instance deltas of :class:`~triton_rec.cache.cached_table.TableStats`; Triton
adds up the increments of every instance that uses the same labels, so the figures are
per model and table. Cache-wide values (size, inserts, evictions, which all instances
share) are gauges set from the shared cache's own counters.

``pb_utils`` (``triton_python_backend_utils``) is passed in, so this module imports
without Triton.

Exported (labels ``model``, ``table``; latencies also ``tier``):

====================================== ======= ==========================================
name                                   kind    meaning
====================================== ======= ==========================================
trec_cache_lookups_total               counter keys looked up
trec_cache_hits_total                  counter keys answered by the cache
trec_cache_misses_total                counter keys the cache did not hold
trec_cache_default_answered_total      counter misses answered with the default value at
                                               once (hit rate >= threshold; cause ``async``)
trec_cache_default_not_found_total     counter keys no tier holds, answered with the
                                               default value (cause ``not_found``)
trec_cache_sync_fetched_total          counter misses fetched from the store synchronously
trec_cache_dropped_total               counter background inserts dropped (queue full)
trec_cache_refreshed_total             counter cached rows refreshed from the store
trec_lookup_duration_us_total          counter time spent per tier (``cache``, ``store``)
trec_instance_lookups_total            counter keys looked up, label ``instance`` too
trec_cache_hit_rate                    gauge   hits / lookups of the shared cache
trec_cache_size                        gauge   rows in the shared cache
trec_cache_capacity                    gauge   rows the shared cache can hold
trec_cache_inserts                     gauge   inserts into the shared cache (all instances)
trec_cache_evictions                   gauge   evictions from the shared cache (all instances)
trec_cache_bytes                       gauge   bytes of a table's cache, label ``memory``:
                                               ``shm`` (the /dev/shm segment), ``gpu<N>``
                                               (device memory), ``pinned`` (a uvm table)
trec_table_bytes                       gauge   bytes of a table in the node store (its layout
                                               file: keys, rows, hash index; shared by every
                                               model that serves the same table)
trec_tier_keys_total                   counter keys a storage tier answered (label ``tier``:
                                               ``local``/``volatile``/``persistent``; ``none``:
                                               found nowhere, default value)
trec_tier_unavailable_total            counter lookups that found a tier unreachable
trec_tier_promoted_total               counter rows copied into the volatile tier
                                               (``cache_missed_embeddings``)
trec_updates_vectors_total             counter online-update vectors applied (label ``model``)
trec_updates_messages_total            counter online-update messages applied
trec_updates_malformed_total           counter malformed update messages dropped
trec_updates_errors_total              counter failed update batches (retried), Redis/Kafka errors
trec_requests_rejected_total           counter requests answered with an error (labels
                                               ``model``, ``reason``: ``invalid``,
                                               ``too_large``, ``internal``); Triton's own
                                               ``nv_inference_request_failure`` does not
                                               count them (Python backend, 2.51)
====================================== ======= ==========================================
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional, Tuple

from triton_rec.triton.request_loop import RequestCounters

_COUNTERS = {
    "lookups": ("trec_cache_lookups_total", "Keys looked up"),
    "hits": ("trec_cache_hits_total", "Keys answered by the embedding cache"),
    "misses": ("trec_cache_misses_total", "Keys the embedding cache did not hold"),
    "default_answered": (
        "trec_cache_default_answered_total",
        "Misses answered with the default value (hit rate >= threshold)",
    ),
    "not_found": (
        "trec_cache_default_not_found_total",
        "Keys no tier holds, answered with the default value",
    ),
    "sync_fetched": (
        "trec_cache_sync_fetched_total",
        "Misses fetched from the store synchronously",
    ),
    "dropped": (
        "trec_cache_dropped_total",
        "Background inserts dropped because the queue was full",
    ),
    "refreshed": ("trec_cache_refreshed_total", "Cached rows refreshed from the store"),
}
_UPDATE_COUNTERS = {
    "vectors": ("trec_updates_vectors_total", "Online-update vectors applied"),
    "messages": ("trec_updates_messages_total", "Online-update messages applied"),
    "malformed": ("trec_updates_malformed_total", "Malformed update messages dropped"),
    "errors": (
        "trec_updates_errors_total",
        "Update batches that failed (retried later) and Redis or Kafka errors of the consumer",
    ),
}
_GAUGES = {
    "size": ("trec_cache_size", "Rows in the shared embedding cache"),
    "capacity": ("trec_cache_capacity", "Rows the shared embedding cache can hold"),
    "inserts": ("trec_cache_inserts", "Inserts into the shared embedding cache, all instances"),
    "evictions": (
        "trec_cache_evictions",
        "Evictions from the shared embedding cache, all instances",
    ),
}


def cache_memory(cache: Any) -> Optional[Tuple[str, int]]:
    """``(where, bytes)`` of a table's cache (its ``memory_use()``), or None."""
    use = getattr(cache, "memory_use", None)
    return use() if use is not None else None


def table_bytes(store: Any) -> Optional[int]:
    """Bytes of the node store's layout file behind a table's store (the store itself, or
    the local tier of a tiered one), or None (no node-local table)."""
    stores = [store] + [t.store for t in getattr(store, "tiers", ())]
    for s in stores:
        layout = getattr(getattr(s, "table", None), "layout_path", None)
        if layout:
            try:
                return os.path.getsize(layout)
            except OSError:
                return None
    return None


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
    accumulate in-process (plain integers, :class:`~triton_rec.cache.cached_table.TableStats`);
    this thread reads them and publishes what changed since its last pass, so an idle
    model costs no round trip at all.

    Exit safety: a publication blocks for good if the server dies while it is in flight
    (the server never answers). :meth:`close` therefore waits a bounded time for the
    thread, and an instance orphaned that way is ended by the process-wide native
    watchdog (:func:`prepare_process`).

    Args:
        pb_utils: ``triton_python_backend_utils``.
        model_name: for messages.
        metrics: has ``update()`` (a :class:`~triton_rec.triton.metrics.CacheMetrics`).
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
            self._thread = threading.Thread(
                target=self._run, daemon=True, name=f"trec-metrics-{model_name}"
            )
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


class RequestMetrics:
    """Publishes a :class:`~triton_rec.triton.request_loop.RequestCounters` as
    ``trec_requests_rejected_total{model, reason}`` (deltas, only on a change)."""

    def __init__(self, pb_utils, model: str, counters):
        self.counters = counters
        self._family = pb_utils.MetricFamily(
            name="trec_requests_rejected_total",
            description="Requests answered with an error, by reason (invalid, too_large, internal)",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self._metrics = {
            r: self._family.Metric(labels={"model": model, "reason": r}) for r in counters.REASONS
        }
        self._last = dict.fromkeys(counters.REASONS, 0)

    def update(self) -> None:
        """Add what each reason's counter grew by since the last call."""
        now = self.counters.snapshot()
        for reason, metric in self._metrics.items():
            delta = now[reason] - self._last[reason]
            if delta:
                metric.increment(delta)
        self._last = now


class CacheMetrics:
    """Publishes the statistics of a :class:`~triton_rec.serving.session.LookupSession`.

    Args:
        pb_utils: the ``triton_python_backend_utils`` module.
        model: model name (label).
        instance: model instance name (label of ``trec_instance_lookups_total``).
        session: the session whose tables are reported.
        requests: the instance's :class:`~triton_rec.triton.request_loop.RequestCounters`, if
            they are to be published too (:class:`RequestMetrics`).
    """

    def __init__(self, pb_utils, model: str, instance: str, session, requests=None):
        self.session = session
        self._requests = RequestMetrics(pb_utils, model, requests) if requests is not None else None
        self._pb = pb_utils
        self._model = model
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        fam = {}
        for name, desc in list(_COUNTERS.values()):
            fam[name] = pb_utils.MetricFamily(name=name, description=desc, kind=counter)
        for name, desc in _GAUGES.values():
            fam[name] = pb_utils.MetricFamily(name=name, description=desc, kind=gauge)
        duration = pb_utils.MetricFamily(
            name="trec_lookup_duration_us_total",
            description="Time spent looking up embeddings, by tier",
            kind=counter,
        )
        per_instance = pb_utils.MetricFamily(
            name="trec_instance_lookups_total",
            description="Keys looked up by one model instance",
            kind=counter,
        )
        hit_rate = pb_utils.MetricFamily(
            name="trec_cache_hit_rate", description="Cache hits / lookups since load", kind=gauge
        )
        cache_bytes = pb_utils.MetricFamily(
            name="trec_cache_bytes",
            description="Bytes of a table's embedding cache (memory: shm, gpu<N>, pinned)",
            kind=gauge,
        )
        layout_bytes = pb_utils.MetricFamily(
            name="trec_table_bytes",
            description="Bytes of a table in the node store (keys, rows, hash index)",
            kind=gauge,
        )
        tier_keys = pb_utils.MetricFamily(
            name="trec_tier_keys_total",
            description="Keys answered by each storage tier",
            kind=counter,
        )
        tier_down = pb_utils.MetricFamily(
            name="trec_tier_unavailable_total",
            description="Lookups that found a storage tier unreachable",
            kind=counter,
        )
        promoted = pb_utils.MetricFamily(
            name="trec_tier_promoted_total",
            description="Rows copied into the volatile tier (cache_missed_embeddings)",
            kind=counter,
        )
        # TieredStore.counters() key -> (family, extra labels)
        self._tier_map = {"not_found": (tier_keys, {"tier": "none"}), "promoted": (promoted, {})}
        for role in ("local", "volatile", "persistent"):
            self._tier_map[f"{role}_found"] = (tier_keys, {"tier": role})
            self._tier_map[f"{role}_unavailable"] = (tier_down, {"tier": role})
        self._update_families = {
            key: pb_utils.MetricFamily(name=name, description=desc, kind=counter)
            for key, (name, desc) in _UPDATE_COUNTERS.items()
        }
        services = getattr(session, "services", None)
        if services is None:
            services = getattr(getattr(session, "table_set", None), "services", [])
        # the online-update consumer (:class:`~triton_rec.updates.online.SharedUpdateConsumer`,
        # shared by the model's instances in the process: each change is taken once)
        self._consumers = [s for s in services if hasattr(s, "counts_since_taken")]
        self._update_metrics = (
            {k: f.Metric(labels={"model": model}) for k, f in self._update_families.items()}
            if self._consumers
            else {}
        )
        # Triton deletes a family's metrics when the family object goes away: keep them.
        self._families = [
            *fam.values(),
            duration,
            per_instance,
            hit_rate,
            cache_bytes,
            layout_bytes,
            tier_keys,
            tier_down,
            promoted,
            *self._update_families.values(),
        ]
        self._tables: List[Dict] = []
        for t in session.cached_tables:
            labels = {"model": model, "table": t.name}
            sizes: Dict[str, Tuple[Any, float]] = {}
            memory = cache_memory(t.cache) if t.cache is not None else None
            if memory is not None:
                metric = cache_bytes.Metric(labels={**labels, "memory": memory[0]})
                sizes["cache_bytes"] = (metric, float(memory[1]))
            layout = table_bytes(t.store)
            if layout is not None:
                sizes["table_bytes"] = (layout_bytes.Metric(labels=labels), float(layout))
            self._tables.append(
                {
                    "table": t,
                    "last": {k: 0 for k in list(_COUNTERS) + ["cache_ns", "store_ns"]},
                    "counters": {
                        k: fam[n].Metric(labels=labels) for k, (n, _) in _COUNTERS.items()
                    },
                    "gauges": {k: fam[n].Metric(labels=labels) for k, (n, _) in _GAUGES.items()},
                    "cache_us": duration.Metric(labels={**labels, "tier": "cache"}),
                    "store_us": duration.Metric(labels={**labels, "tier": t.store.tier}),
                    "instance": per_instance.Metric(labels={**labels, "instance": instance}),
                    "hit_rate": hit_rate.Metric(labels=labels),
                    "labels": labels,
                    "sizes": sizes,
                    "tier_metrics": {},
                    "tier_last": {},
                    "gauge_last": {},
                }
            )

    def _set(self, entry: Dict, key: str, metric, value: float) -> None:
        # Metric.set is a round trip to the server (holding the GIL): only on a change.
        if entry["gauge_last"].get(key) != value:
            metric.set(value)
            entry["gauge_last"][key] = value

    # Flat: one on-change test per metric family (table counters, cache gauges, tiers, update
    # consumers), in the order they are exported.
    def update(self) -> None:  # noqa: C901
        """Publish what changed since the last call (by MetricsPusher's thread, never
        from ``execute``): counter deltas, and the gauges whose value moved."""
        if self._requests is not None:
            self._requests.update()
        for entry in self._tables:
            t, last = entry["table"], entry["last"]
            now = t.stats.snapshot()
            for key, metric in entry["counters"].items():
                delta = now[key] - last[key]
                if delta:
                    metric.increment(delta)
            lookups = now["lookups"] - last["lookups"]
            if lookups:
                entry["instance"].increment(lookups)
            for key, metric_key in (("cache_ns", "cache_us"), ("store_ns", "store_us")):
                delta = now[key] - last[key]
                if delta:
                    entry[metric_key].increment(delta / 1000.0)
            if t.cache is not None:
                # Cache-wide figures: the same whichever instance sets them.
                stats = dict(t.cache.stats(), size=t.cache.size(), capacity=t.cache.capacity)
                for key, metric in entry["gauges"].items():
                    if key in stats:
                        self._set(entry, key, metric, float(stats[key]))
                if stats.get("lookups"):
                    self._set(
                        entry, "hit_rate", entry["hit_rate"], stats["hits"] / stats["lookups"]
                    )
            for key, (metric, value) in entry["sizes"].items():
                self._set(entry, key, metric, value)
            entry["last"] = now
            counters = getattr(t.store, "counters", None)
            if counters is not None:
                self._update_tiers(entry, counters())
        if self._consumers:
            grown = {k: 0 for k in _UPDATE_COUNTERS}
            for c in self._consumers:
                st = c.counts_since_taken()
                grown["vectors"] += st["vectors"]
                grown["messages"] += st["messages"]
                grown["malformed"] += st["malformed"]
                # the transport's own errors: redis_errors (Redis Streams), kafka_errors
                grown["errors"] += (
                    st["apply_errors"] + st.get("redis_errors", 0) + st.get("kafka_errors", 0)
                )
            for key, metric in self._update_metrics.items():
                if grown[key]:
                    metric.increment(grown[key])

    def _update_tiers(self, entry: Dict, now: Dict[str, int]) -> None:
        for key, value in now.items():
            if key not in self._tier_map:
                continue
            metric = entry["tier_metrics"].get(key)
            if metric is None:
                family, extra = self._tier_map[key]
                metric = entry["tier_metrics"][key] = family.Metric(
                    labels={**entry["labels"], **extra}
                )
            delta = value - entry["tier_last"].get(key, 0)
            if delta:
                metric.increment(delta)
            entry["tier_last"][key] = value


def start_session_metrics(pb_utils, model: str, instance: str, session, interval: float):
    """``(counters, pusher)`` of an ``hps`` or ``hugectr`` instance: fresh
    :class:`~triton_rec.triton.request_loop.RequestCounters` for its ``execute``, and a started
    :class:`~triton_rec.triton.metrics.MetricsPusher` publishing them with ``session``'s
    statistics (:class:`CacheMetrics`) every ``interval`` seconds."""
    counters = RequestCounters()
    metrics = CacheMetrics(pb_utils, model, instance, session, requests=counters)
    return counters, MetricsPusher(pb_utils, model, metrics, interval)
