"""Where every millisecond went, for operators: metrics, traces and one log line per request.

`Telemetry` is built once per server. It reads what the serving path already keeps (each
request's Timeline when its call ends, worker step reports, scheduler actions, queue depths)
and turns it into OpenTelemetry metrics (a Prometheus endpoint and/or OTLP), one span per
request (continuing the caller's trace when the call carries `traceparent`), and one
key=value log line per request. It never changes what it reads, and a failure inside it is
logged, never raised into the serving path.

Metric names carry their unit; durations are seconds, with bucket boundaries sized to what
each one measures (milliseconds for waits and token gaps, seconds for whole requests).
Labels are bounded: model, class, outcome, refusal reason, worker; tenant only on
`tokenline_requests_total`, and only for the first `max_tenant_labels` tenants seen.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Link, Status, StatusCode

from tokenline.engine.scheduler.records import Abort, Retry, StepResult
from tokenline.engine.types import StepReport, TrafficClass
from tokenline.server.otel_bulk import Series, record_many

from tokenline.server.logs import logfmt, snake_case
from tokenline.server.telemetry_config import FIRST_TOKEN_BUCKETS, GAP_BUCKETS, OTLP_ENDPOINT_ENV, SPLITS, TelemetryConfig

if TYPE_CHECKING:
    from tokenline.server.runtime import RequestKey, RequestState, Runtime

log = logging.getLogger("tokenline.telemetry")

MAX_TRACKED = 4096  # requests with interruptions or admission links kept at once


@dataclass
class _Extra:
    """What a request's Timeline does not keep: interruptions, and the steps that admitted it."""

    links: list[Any] = field(default_factory=list)  # SpanContexts of admitting worker steps


@dataclass
class _Snapshot:
    """Gauge values, read on the event loop (the only thread that may touch the runtime)."""

    queues: dict[tuple[str, str], tuple[int, int, float]] = field(default_factory=dict)
    in_flight: dict[tuple[str, str], int] = field(default_factory=dict)
    workers: dict[int, tuple[str, int, int, float, int]] = field(default_factory=dict)
    worker_info: dict[int, dict[str, str]] = field(default_factory=dict)  # labels of tokenline_worker_info
    stale: int = 0
    restarts: int = 0
    workers_wanted: dict[str, int] = field(default_factory=dict)  # active workers aimed for, per model
    scale_decisions: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, add|remove) -> count
    taken_at: float = float("-inf")


def _guarded(fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:  # telemetry must never break serving
            log.exception("telemetry: %s failed", fn.__name__)
            return None

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class Telemetry:
    def __init__(self, config: TelemetryConfig | None = None, *, metric_readers: Sequence[MetricReader] = (),
                 span_exporter: SpanExporter | None = None):
        """`metric_readers` and `span_exporter` are extra sinks (tests pass in-memory ones)."""
        self.config = config or TelemetryConfig()
        self.runtime: Runtime | None = None
        self.metrics_address: tuple[str, int] | None = None
        self._models: tuple[str, ...] = ()
        self._default_model = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wall_offset_ns = time.time_ns() - time.monotonic_ns()
        self._extra: dict[RequestKey, _Extra] = {}
        self._last_step: dict[int, StepReport] = {}
        self._step_series: dict[str, Series] = {}  # the step histogram's series by model (otel_bulk.Series)
        self._tenants: set[str] = set()
        self._snapshot = _Snapshot()
        self._snapshot_lock = threading.Lock()
        self._http: Any = None
        level = self.config.request_log_level.upper()
        self._log_level = None if level == "OFF" else logging.getLevelName(level)
        self.request_log = logging.getLogger("tokenline.requests")

        resource = Resource.create({} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "tokenline"})
        endpoint = self.config.otlp_endpoint or os.environ.get(OTLP_ENDPOINT_ENV) or None
        readers = list(metric_readers)
        self.registry = None
        if self.config.metrics_port is not None:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry

            self.registry = CollectorRegistry()  # ours alone: two servers in one process do not collide
            readers.append(PrometheusMetricReader(registry=self.registry, scope_info_enabled=False))
        if endpoint:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=endpoint)))
        self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        self.tracer_provider: TracerProvider | None = None
        if span_exporter is not None or endpoint:
            self.tracer_provider = TracerProvider(resource=resource)
            if span_exporter is not None:
                self.tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
            if endpoint:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

                self.tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.tracer_provider.get_tracer("tokenline") if self.tracer_provider else None
        self._instruments(self.meter_provider.get_meter("tokenline"))

    # ------------------------------------------------------------- wiring

    def _instruments(self, meter: Any) -> None:
        self._splits = {key: meter.create_histogram(name, unit="s", description=doc, explicit_bucket_boundaries_advisory=buckets)
                        for key, name, buckets, doc in SPLITS}
        self._gap = meter.create_histogram("tokenline_inter_token_latency_seconds", unit="s", explicit_bucket_boundaries_advisory=GAP_BUCKETS,
                                           description="Gap between consecutive tokens of a request (one sample per gap).")
        self._lost = meter.create_histogram("tokenline_request_lost_seconds", unit="s", explicit_bucket_boundaries_advisory=FIRST_TOKEN_BUCKETS,
                                            description="Time lost to one interruption (cause: preemption or retry), until the next token.")
        self._step = meter.create_histogram("tokenline_worker_step_seconds", unit="s", explicit_bucket_boundaries_advisory=GAP_BUCKETS,
                                            description="Wall time of one engine step.")
        self._requests = meter.create_counter("tokenline_requests_total", description="Requests by how they ended (outcome).")
        self._refusals = meter.create_counter("tokenline_refusals_total", description="Requests refused before running, by reason.")
        self._prompt_tokens = meter.create_counter("tokenline_prompt_tokens_total", description="Prompt tokens of accepted requests.")
        self._generated_tokens = meter.create_counter("tokenline_generated_tokens_total", description="Tokens generated and kept.")
        self._preemptions = meter.create_counter("tokenline_preemptions_total", description="Runs preempted to make room for interactive work.")
        self._retries = meter.create_counter("tokenline_retries_total", description="Attempts started again after a worker died.")
        gauges = (
            ("tokenline_queue_requests", "Requests queued.", self._observe_queue(0)),
            ("tokenline_queue_tokens", "Tokens (prompt + max new) queued.", self._observe_queue(1)),
            ("tokenline_queue_oldest_age_seconds", "Age of the oldest queued request.", self._observe_queue(2)),
            ("tokenline_requests_in_flight", "Requests queued or running.", self._observe_in_flight),
            ("tokenline_worker_running_sequences", "Sequences running in a worker (last step).", self._observe_worker(1)),
            ("tokenline_worker_waiting_sequences", "Sequences waiting inside a worker's engine (last step).", self._observe_worker(2)),
            ("tokenline_worker_kv_usage_ratio", "Share of a worker's KV-cache blocks in use (last step).", self._observe_worker(3)),
            ("tokenline_worker_batch_size", "Sequences in a worker's last step (0 once it has nothing to run).", self._observe_worker(4)),
        )
        for name, doc, callback in gauges:
            meter.create_observable_gauge(name, callbacks=[callback], description=doc)
        meter.create_observable_gauge("tokenline_worker_info", callbacks=[self._observe_worker_info],
                                      description="1 per live worker; labels say what it runs: dtype, attention kernel, "
                                                  "self-check verdict (passed, FAILED, off, skipped), execution "
                                                  "(compiled, eager).")
        meter.create_observable_counter("tokenline_stale_outputs_total", callbacks=[self._observe_stale],
                                        description="Outputs of runs no longer current (preempted, retried, cancelled), dropped.")
        meter.create_observable_counter("tokenline_worker_restarts_total", callbacks=[self._observe_restarts],
                                        description="Workers restarted after they died.")
        meter.create_observable_gauge("tokenline_workers_wanted", callbacks=[self._observe_wanted],
                                      description="Active workers the supervisor aims for per model (the autoscaler moves it).")
        meter.create_observable_counter("tokenline_autoscale_decisions_total", callbacks=[self._observe_scaling],
                                        description="Workers the autoscaler added (action=add) or removed (action=remove).")

    def watch(self, runtime: Runtime, default_model: str) -> None:
        """Follow `runtime`: its step reports, scheduler actions and queues. Call on its event loop."""
        self.runtime = runtime
        self._loop = asyncio.get_running_loop()
        self._models = tuple(runtime.worker_configs)
        self._default_model = default_model
        runtime.step_hooks.append(self.record_step)
        runtime.on_action.append(self.on_action)

    def start(self) -> None:
        """Open the Prometheus endpoint, if one is configured."""
        if self.registry is None or self._http is not None:
            return
        from prometheus_client import start_http_server

        self._http, _ = start_http_server(self.config.metrics_port, addr=self.config.metrics_host, registry=self.registry)
        self.metrics_address = (self.config.metrics_host, self._http.server_port)

    def server_interceptors(self) -> list[Any]:
        """gRPC interceptors: a server span per Tokenline call, continuing the caller's W3C trace."""
        if self.tracer_provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

        return [aio_server_interceptor(tracer_provider=self.tracer_provider, filter_=filters.service_name("tokenline.v1.Tokenline"))]

    def shutdown(self) -> None:
        """Flush exporters and close the endpoint. Blocks: call it off the event loop."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.meter_provider.shutdown()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()

    # -------------------------------------------------------- per request

    @_guarded
    def on_request_done(self, state: RequestState, outcome: str) -> None:
        """A call that reached the runtime ended: record its bill, its span and its log line."""
        outcome = snake_case(outcome)
        tl = state.timeline
        cls = state.cls.name.lower()
        extra = self._extra.pop(state.key, None) or _Extra()
        for cause, _, lost in tl.interruptions:
            self._lost.record(lost, {"model": state.served_as, "version": state.version, "class": cls, "cause": cause})
        labels = {"model": state.served_as, "version": state.version, "class": cls, "outcome": outcome}
        splits = {"intake_ms": _span_ms(tl.received, tl.enqueued), **tl.splits_ms()}
        reached = {
            "intake_ms": tl.enqueued is not None,
            "admission_wait_ms": tl.admitted is not None,
            "queueing_ms": tl.admitted is not None,
            "prefill_ms": tl.first_token is not None,
            "ttft_ms": tl.first_token is not None,
            "decode_ms": tl.first_token is not None,
            "itl_mean_ms": tl.gap_count > 0,
            "return_ms": tl.finished is not None and tl.last_byte is not None,
            "completion_ms": tl.last_byte is not None,
        }
        for key, histogram in self._splits.items():
            if reached[key]:
                histogram.record(splits[key] / 1000.0, labels)
        record_many(self._gap, tl.gaps, labels)  # one sample per gap, added in bulk (otel_bulk.py)
        self._requests.add(1, {**labels, "tenant": self._tenant_label(state.tenant)})
        reason = getattr(state.error, "reason", None)  # refused after it was queued (late interactive, when refused)
        if reason:
            self._refusals.add(1, {"model": state.served_as, "class": cls, "reason": reason})
        self._prompt_tokens.add(len(state.prompt_ids), {"model": state.served_as, "version": state.version, "class": cls})
        self._generated_tokens.add(len(state.token_ids), {"model": state.served_as, "version": state.version,
                                                           "class": cls})
        trace_id = self._request_span(state, outcome, extra, splits)
        self._log({"id": state.request_id, "model": state.served_as, "version": state.version or None, "class": cls, "tenant": state.tenant, "outcome": outcome,
                   "prompt_tokens": len(state.prompt_ids), "tokens": len(state.token_ids), "attempts": state.attempt,
                   "preemptions": state.preemptions, **splits, "trace_id": trace_id})

    @_guarded
    def on_shared(self, request: Any, outcome: str, tenant: str) -> None:
        """A call served by another call's run: a stored result replayed, or attached to a live run."""
        model = request.model or self._default_model
        labels = {"model": model if model in self._models else "unknown",
                  "class": {0: "interactive", TrafficClass.INTERACTIVE: "interactive", TrafficClass.BULK: "bulk"}.get(request.traffic_class, "unknown")}
        self._requests.add(1, {**labels, "outcome": outcome, "tenant": self._tenant_label(tenant)})

    @_guarded
    def on_refused(self, request: Any, err: Exception, tenant: str) -> None:
        """A call ended before it reached the runtime (invalid, or refused at once)."""
        model = request.model or self._default_model
        labels = {"model": model if model in self._models else "unknown",
                  "class": {0: "interactive", TrafficClass.INTERACTIVE: "interactive", TrafficClass.BULK: "bulk"}.get(request.traffic_class, "unknown")}
        reason = getattr(err, "reason", None) or snake_case(type(err).__name__)
        outcome = snake_case(type(err).__name__)
        self._refusals.add(1, {**labels, "reason": reason})
        self._requests.add(1, {**labels, "outcome": outcome, "tenant": self._tenant_label(tenant)})
        trace.get_current_span().set_attribute("tokenline.refusal", reason)
        self._log({"id": request.request_id or "-", "model": labels["model"], "class": labels["class"], "tenant": tenant,
                   "outcome": outcome, "reason": reason})

    def _request_span(self, state: RequestState, outcome: str, extra: _Extra, splits: dict[str, float]) -> str | None:
        """One span per request, timed by its Timeline, with its milestones as events."""
        if self.tracer is None:
            return None
        tl = state.timeline
        end = tl.last_byte or tl.finished or time.monotonic()
        attributes = {"tokenline.request_id": state.request_id, "tokenline.model": state.served_as,
                      "tokenline.model_version": state.version, "tokenline.class": state.cls.name.lower(), "tokenline.tenant": state.tenant,
                      "tokenline.outcome": outcome, "tokenline.attempts": state.attempt,
                      "tokenline.preemptions": state.preemptions, "tokenline.prompt_tokens": len(state.prompt_ids),
                      "tokenline.completion_tokens": len(state.token_ids),
                      **{f"tokenline.{k}": v for k, v in splits.items()}}
        span = self.tracer.start_span("tokenline.request", start_time=self._wall_ns(tl.received), attributes=attributes,
                                      links=[Link(ctx) for ctx in extra.links])
        milestones = [(name, getattr(tl, name), None) for name in ("validated", "enqueued", "admitted", "first_scheduled",
                                                                      "first_token", "finished", "last_byte")]
        interruptions = []
        for cause, since, lost in tl.interruptions:
            interruptions.append(("preempted" if cause == "preemption" else "retried", since, None))
            interruptions.append(("resumed", since + lost, {"tokenline.lost_ms": lost * 1000.0}))
        for name, at, attrs in sorted((m for m in milestones + interruptions if m[1] is not None), key=lambda m: m[1]):
            span.add_event(name, attributes=attrs, timestamp=self._wall_ns(at))
        if state.error is not None or outcome not in ("stop", "length", "stop_string", "cancelled", "ok"):
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end(end_time=self._wall_ns(end))
        return format(span.get_span_context().trace_id, "032x")

    def _log(self, fields: dict[str, Any]) -> None:
        if self._log_level is None or not self.request_log.isEnabledFor(self._log_level):
            return
        self.request_log.log(self._log_level, "request %s", " ".join(f"{k}={logfmt(v)}" for k, v in fields.items() if v is not None))

    # ------------------------------------------------------ engine events

    @_guarded
    def record_step(self, result: StepResult) -> None:
        """A worker step, as the scheduler read it: its time, its gauges, and the step span of admissions."""
        runtime = self.runtime
        report = result.report
        model = runtime.specs[report.worker_id].model if report.worker_id in runtime.specs else "unknown"
        self._last_step[report.worker_id] = report
        series = self._step_series.get(model)
        if series is None:
            series = self._step_series[model] = Series(self._step, {"model": model})
        series.record(report.step_s)
        now = time.monotonic()
        if self.tracer is not None and result.started:
            start = self._wall_ns(now - report.step_s)
            span = self.tracer.start_span("tokenline.worker_step", start_time=start, attributes={
                "tokenline.worker": report.worker_id, "tokenline.model": model, "tokenline.batch_size": report.batch_size,
                "tokenline.prefill_tokens": report.prefill_tokens, "tokenline.admitted": len(result.started),
                "tokenline.kv_blocks_free": report.kv_blocks_free, "tokenline.step_s": report.step_s})
            span.end(end_time=self._wall_ns(now))
            for key in result.started:
                self._extra.setdefault(key, _Extra()).links.append(span.get_span_context())
        if len(self._extra) > MAX_TRACKED:  # a request whose call ended without on_request_done (rare)
            for key in [k for k in self._extra if k not in runtime.requests]:
                del self._extra[key]

    @_guarded
    def on_action(self, action: object) -> None:
        """A scheduler action the runtime just carried out: count interruptions, start their clocks."""
        if not isinstance(action, (Abort, Retry)) or (isinstance(action, Abort) and not action.preempted):
            return
        st = self.runtime.requests.get(action.key)
        if st is None:
            return
        labels = {"model": st.served_as, "version": st.version, "class": st.cls.name.lower()}
        (self._preemptions if isinstance(action, Abort) else self._retries).add(1, labels)

    # ------------------------------------------------------------- gauges

    def _take_snapshot(self) -> _Snapshot:
        rt = self.runtime
        snap = _Snapshot(taken_at=time.monotonic())
        if rt is None:
            return snap
        for model in self._models:
            for cls in TrafficClass:
                requests, tokens = rt.scheduler.queue_depth(model, cls)
                snap.queues[(model, cls.name.lower())] = (requests, tokens, rt.scheduler.oldest_age(model, cls))
                snap.in_flight[(model, cls.name.lower())] = 0
        for st in rt.requests.values():
            key = (st.served_as, st.cls.name.lower())
            snap.in_flight[key] = snap.in_flight.get(key, 0) + 1
        for wid, spec in rt.specs.items():
            report = self._last_step.get(wid)
            free = report.kv_blocks_free if report else spec.kv_blocks_total
            usage = 1.0 - free / spec.kv_blocks_total if spec.kv_blocks_total else 0.0
            busy = report is not None and (report.running or report.waiting)
            snap.workers[wid] = (spec.model, report.running if report else 0, report.waiting if report else 0,
                                 usage, report.batch_size if busy else 0)  # an idle worker runs no batch
            snap.worker_info[wid] = {"model": spec.model, "worker": str(wid), "dtype": spec.dtype,
                                     "attention_kernel": spec.attention_kernel.split(" (")[0],
                                     "self_check": spec.self_check.split(":")[0],
                                     "execution": spec.execution}
        snap.stale = rt.scheduler.counters.stale_outputs
        snap.restarts = rt.workers.restarts
        snap.workers_wanted = dict(rt.workers.target)
        snap.scale_decisions = dict(rt.workers.scale_decisions)
        return snap

    def _read(self) -> _Snapshot:
        """The current gauge values, taken on the event loop (once per collection)."""
        with self._snapshot_lock:
            if time.monotonic() - self._snapshot.taken_at < 0.2:
                return self._snapshot
        loop = self._loop
        try:
            on_loop = loop is None or asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        try:
            if on_loop:
                snap = self._take_snapshot()
            else:
                fut: concurrent.futures.Future = concurrent.futures.Future()

                def fill() -> None:
                    try:
                        fut.set_result(self._take_snapshot())
                    except Exception as err:
                        fut.set_exception(err)

                loop.call_soon_threadsafe(fill)
                snap = fut.result(timeout=1.0)
        except Exception:  # the loop is busy or closed: the last values will do
            log.debug("telemetry: gauges not refreshed", exc_info=True)
            return self._snapshot
        with self._snapshot_lock:
            self._snapshot = snap
        return snap

    def _observe_queue(self, index: int) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v[index], {"model": m, "class": c}) for (m, c), v in self._read().queues.items()]

        return observe

    def _observe_in_flight(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"model": m, "class": c}) for (m, c), n in self._read().in_flight.items()]

    def _observe_worker(self, index: int) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v[index], {"model": v[0], "worker": str(wid)}) for wid, v in self._read().workers.items()]

        return observe

    def _observe_worker_info(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(1, labels) for labels in self._read().worker_info.values()]

    def _observe_stale(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._read().stale)]

    def _observe_restarts(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._read().restarts)]

    def _observe_wanted(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"model": m}) for m, n in self._read().workers_wanted.items()]

    def _observe_scaling(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"model": m, "action": a}) for (m, a), n in self._read().scale_decisions.items()]

    # ------------------------------------------------------------ helpers

    def _tenant_label(self, tenant: str) -> str:
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < self.config.max_tenant_labels:
            self._tenants.add(tenant)
            return tenant
        return "other"

    def _wall_ns(self, monotonic_s: float) -> int:
        """A stamp of this process's monotonic clock as epoch nanoseconds, for span times."""
        return int(monotonic_s * 1e9) + self._wall_offset_ns


def _span_ms(a: float | None, b: float | None) -> float:
    return max((b - a) * 1000.0, 0.0) if a is not None and b is not None else 0.0
