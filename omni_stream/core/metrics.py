"""Prometheus metrics of one server, in a registry of its own (names start ``omni_stream_``).

A registry per :class:`ServerMetrics` (not prometheus-client's global one)
so that several servers in one process, and every test, count separately.
Every request metric carries a ``model`` label: the served model's name (a
server of one: its model's name; a refusal naming a model not served:
``unknown``, so a client cannot make series by inventing names).
Engine gauges (queue depth, host buffers, up) are read from
``engine.statistics()`` / ``engine.health()`` at scrape time by a collector,
never copied on a timer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..frame import StepTimings

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

#: The text exposition format prometheus-client writes.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Step phases span sub-millisecond (copies, tiny models) to minutes (video
# models on one GPU): log-spaced buckets cover both ends.
# A restart's time to its first frame: a hand-over from a checkpoint in tenths of a second, a
# resume behind a loading model or a replacement replica in seconds to minutes.
_RESTART_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
#: A request's waits and lengths: a queue of seconds to a video's tens of minutes.
_WAIT_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
_ENCODE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Weight of the newest frame in the recent step averages (``busy``'s
#: ``retry_after_s``): about the last 20 frames, so a change of load shows
#: within a few steps but one odd step does not swing the estimate.
_RECENT_WEIGHT = 0.05


class _EngineCollector(Collector):
    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily]:
        health = self._engine.health()
        s = health.statistics
        rows: list[tuple[str, str, float]] = [
            ("omni_stream_engine_up", "1 when engine.health() is ok, else 0", 1.0 if health.ok else 0.0),
            ("omni_stream_engine_active", "requests started and not ended", s.active),
            ("omni_stream_engine_queued", "requests submitted, not started (queue depth)", s.queued),
            ("omni_stream_engine_buffers_in_use", "host buffers leased", s.buffers_in_use),
            (
                "omni_stream_engine_buffers_in_flight",
                "host buffers with a copy in flight",
                s.buffers_in_flight,
            ),
            ("omni_stream_engine_buffers_total", "host buffers allocated", s.buffers_total),
            ("omni_stream_engine_buffers_lent", "host buffers readers hold as their frames", s.buffers_lent),
        ]
        for name, doc, value in rows:
            yield GaugeMetricFamily(name, doc, value=float(value))


class _StepCacheCollector(Collector):
    """Each served model's steps with step caching, computed and reused (its
    ``step_cache_totals``: models/diffusers/step_cache.py), read at scrape time."""

    def __init__(self, models: Mapping[str, Any]) -> None:
        self._models = {name: m for name, m in models.items() if hasattr(m, "step_cache_totals")}

    def collect(self) -> Iterator[CounterMetricFamily]:
        if not self._models:
            return
        family = CounterMetricFamily(
            "omni_stream_step_cache_steps",
            "steps of requests that use step caching (the cache param), by model and outcome: "
            "computed in full, or reused (cached: the transformer's blocks after the first skipped)",
            labels=["model", "outcome"],
        )
        for name, model in self._models.items():
            totals = model.step_cache_totals
            for outcome in ("computed", "cached"):
                family.add_metric([name, outcome], float(totals.get(outcome, 0)))
        yield family


class ServerMetrics:
    """Every metric one server exports; ``render()`` is the ``/metrics`` body.

    ``models``: the served models' names, the default first (the ``model`` label's values).
    """

    def __init__(
        self, engine: Any, *, running: Callable[[], int], models: Sequence[str] = ("model",)
    ) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._models = tuple(models) or ("model",)
        # The step histograms' children by the model a frame names (observe_timings).
        self._step_children: dict[str | None, tuple[Any, Any, Any]] = {}
        self.requests = Counter(
            "omni_stream_requests",
            "requests by outcome (done, cancelled, error, rejected) and model",
            ["outcome", "model"],
            registry=r,
        )
        self.rejections = Counter(
            "omni_stream_rejections",
            "generate messages rejected after parsing, by error code and model",
            ["code", "model"],
            registry=r,
        )
        self.deadlines = Counter(
            "omni_stream_deadlines",
            "requests ended by their deadline_s (Cancel-After): expired (before they started) or "
            "deadline (while they ran), by model",
            ["reason", "model"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "omni_stream_queue_wait_seconds",
            "from a request's admission to its going into the engine (the server's queue), by model",
            ["model"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.first_preview = Histogram(
            "omni_stream_first_preview_seconds",
            "from a request's admission to its first preview published, by model",
            ["model"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.time_to_result = Histogram(
            "omni_stream_request_seconds",
            "from a request's admission to its end, for requests that finished (done), by model",
            ["model"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        #: Recent mean model-call time and batch size (None before the first frame).
        self.recent_step_s: float | None = None
        self.recent_batch_size: float | None = None
        self.step_compute = Histogram(
            "omni_stream_step_compute_seconds",
            "step compute time (frames the server observed), by model",
            ["model"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.step_queued = Histogram(
            "omni_stream_step_queued_seconds",
            "time a step waited before it ran, by model",
            ["model"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.step_copy = Histogram(
            "omni_stream_step_copy_seconds",
            "device-to-host copy time of a step's frame, by model",
            ["model"],
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.preview_encode = Histogram(
            "omni_stream_preview_encode_seconds",
            "decode + encode time of one preview",
            buckets=_ENCODE_BUCKETS,
            registry=r,
        )
        self.restarts = Counter(
            "omni_stream_requests_restarted",
            "restarted messages said: requests run again after their process or replica was lost, "
            "by reason: checkpoint, no_checkpoint, checkpoint_unusable, cannot_resume (a restart with "
            "--state-dir; a checkpoint refused as the request goes in is said, and counted, as checkpoint "
            "then checkpoint_unusable), replica_lost (each Ray hand-over)",
            ["reason"],
            registry=r,
        )
        self.restart_first_frame = Histogram(
            "omni_stream_restart_first_frame_seconds",
            "from a restarted message said (a request readmitted after a restart with --state-dir, or a "
            "Ray hand-over beginning) to the request's first frame after it, by reason",
            ["reason"],
            buckets=_RESTART_BUCKETS,
            registry=r,
        )
        self.reads_paced = Counter(
            "omni_stream_reads_paced",
            "websocket messages read later because their connection went over max_messages_per_s",
            registry=r,
        )
        self.previews_skipped = Counter(
            "omni_stream_previews_skipped",
            "intermediate previews not rendered: every watcher still held the previous one unsent",
            registry=r,
        )
        self.messages_sent = Counter(
            "omni_stream_messages_sent",
            "messages written to clients, by kind",
            ["kind"],
            registry=r,
        )
        self.messages_dropped = Counter(
            "omni_stream_messages_dropped",
            "progress and previews removed unsent: replaced by a newer one, or shed "
            "for max_pending_bytes or max_memory_bytes",
            ["kind"],
            registry=r,
        )
        self.connections = Gauge(
            "omni_stream_connections", "open clients: websockets, HTTP calls and event streams", registry=r
        )
        self.connections_opened = Counter(
            "omni_stream_connections_opened",
            "clients accepted: websockets, HTTP calls, event streams",
            registry=r,
        )
        self.handshakes_refused = Counter(
            "omni_stream_handshakes_refused",
            "websocket handshakes refused, by reason",
            ["reason"],
            registry=r,
        )
        self.http_refused = Counter(
            "omni_stream_http_refused",
            "HTTP calls refused at the door, by reason (unauthorized, forbidden_origin, "
            "forbidden_host, too_many_connections, shutting_down)",
            ["reason"],
            registry=r,
        )
        self.slow_client_disconnects = Counter(
            "omni_stream_slow_client_disconnects",
            "clients closed with 1008 for not reading",
            registry=r,
        )
        self.requests_running = Gauge(
            "omni_stream_requests_running",
            "requests the server is streaming",
            registry=r,
        )
        self.requests_running.set_function(lambda: float(running()))
        self.memory_bytes = Gauge(
            "omni_stream_memory_bytes",
            "bytes held for clients: queued messages plus results retained for attach "
            "(bounded by max_memory_bytes)",
            registry=r,
        )
        self.memory_reserved_bytes = Gauge(
            "omni_stream_memory_reserved_bytes",
            "host memory reserved by running requests at admission (frames in flight, previews "
            "rendering; bounded with memory_bytes by max_memory_bytes)",
            registry=r,
        )
        r.register(_EngineCollector(engine))

    def watch_models(self, models: Mapping[str, Any]) -> None:
        """Report the served models' own counts at scrape time (step caching's)."""
        self.registry.register(_StepCacheCollector(models))

    def watch_memory(self, budget: Any) -> None:
        """Report a MemoryBudget's ``used`` and ``reserved`` at scrape time."""
        self.memory_bytes.set_function(lambda: float(budget.used))
        self.memory_reserved_bytes.set_function(lambda: float(budget.reserved))

    def model(self, name: str | None) -> str:
        """The ``model`` label of a request naming ``name``: the default's for None, ``unknown``
        for a name not served (a refusal: the label's values stay the served models)."""
        if name is None:
            return self._models[0]
        return name if name in self._models else "unknown"

    def refused(self, code: str, model: str | None) -> None:
        """A ``generate`` refused with ``code``, for ``model`` (its name as asked, None: the default)."""
        label = self.model(model)
        self.rejections.labels(code, label).inc()
        self.requests.labels("rejected", label).inc()

    def observe_timings(self, timings: StepTimings, model: str | None = None) -> None:
        # Every frame the server takes comes here: the labelled children are looked up once a
        # model, not three labels() calls (a lock and a dict each) a frame.
        children = self._step_children.get(model)
        if children is None:
            label = self.model(model)
            children = (
                self.step_compute.labels(label),
                self.step_queued.labels(label),
                self.step_copy.labels(label),
            )
            self._step_children[model] = children
        compute, queued, copy = children
        compute.observe(timings.compute_s)
        queued.observe(timings.queued_s)
        copy.observe(timings.copy_s)
        self.recent_step_s = _mix(self.recent_step_s, timings.compute_s)
        self.recent_batch_size = _mix(self.recent_batch_size, float(max(1, timings.batch_size)))

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)


def _mix(mean: float | None, value: float) -> float:
    return value if mean is None else mean + _RECENT_WEIGHT * (value - mean)
