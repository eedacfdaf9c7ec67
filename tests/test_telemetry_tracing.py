"""Traces: a caller's trace continues into tokenline, and OTLP export reaches a collector.

Most tests run the server in this process (simulated engine) with in-memory span and metric
sinks, so the spans it ends can be read back directly; the OTLP test runs `tokenline serve`
against a stand-in collector.
"""

from __future__ import annotations

import asyncio
import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.support import ServerProcess, wait_until
from tokenline.engine.config import WorkerConfig
from tokenline.engine.models import resolve_model
from tokenline.server.app import ServeConfig, serve
from tokenline.server.logs import logfmt as _logfmt, snake_case as _snake
from tokenline.server.telemetry import Telemetry, TelemetryConfig
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_server(telemetry: Telemetry, scenario) -> None:
    """Serve the tiny model on the simulated engine in this process while `scenario(stub)` runs."""
    worker = WorkerConfig(model_path=str(resolve_model("tiny")), model_name="tiny", backend="sim", max_seqs=8)
    config = ServeConfig(port=free_port(), models=((worker, 1),), grace_s=5.0)

    async def main() -> None:
        stop = asyncio.Event()
        server = asyncio.create_task(serve(config, telemetry=telemetry, stop=stop))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{config.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                while True:
                    assert not server.done(), "the server stopped before it was ready"
                    try:
                        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            break
                    except grpc.aio.AioRpcError:
                        pass
                    await asyncio.sleep(0.1)
                await scenario(pb_grpc.TokenlineStub(channel))
        finally:
            stop.set()
            assert await server == 0

    asyncio.run(main())


@pytest.fixture(scope="module")
def traced():
    """One in-process server run: a traced stream, an untraced call and a refused one."""
    spans, metrics = InMemorySpanExporter(), InMemoryMetricReader()
    telemetry = Telemetry(TelemetryConfig(), metric_readers=[metrics], span_exporter=spans)
    results = {}

    async def scenario(stub) -> None:
        request = pb.GenerateRequest(text="trace me", request_id="traced-1",
                                     sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
        chunks = [c async for c in stub.Generate(request, metadata=(("traceparent", TRACEPARENT),))]
        results["final"] = chunks[-1]
        results["untraced"] = await stub.Complete(pb.GenerateRequest(text="no trace", request_id="untraced-1",
                                                                     sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)))
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Complete(pb.GenerateRequest(text="hi", model="no-such-model"), metadata=(("traceparent", TRACEPARENT),))

    run_server(telemetry, scenario)
    return spans.get_finished_spans(), metrics.get_metrics_data(), results


def request_span(spans, request_id: str):
    return next(s for s in spans if s.name == "tokenline.request" and s.attributes["tokenline.request_id"] == request_id)


def test_a_request_carrying_traceparent_continues_the_callers_trace(traced):
    spans, _, _ = traced
    span = request_span(spans, "traced-1")
    assert format(span.context.trace_id, "032x") == CALLER_TRACE_ID
    rpc = next(s for s in spans if s.context.span_id == span.parent.span_id)
    assert rpc.name == "/tokenline.v1.Tokenline/Generate"
    assert format(rpc.parent.span_id, "016x") == CALLER_SPAN_ID


def test_a_request_without_traceparent_starts_its_own_trace(traced):
    spans, _, _ = traced
    assert format(request_span(spans, "untraced-1").context.trace_id, "032x") != CALLER_TRACE_ID


def test_the_request_span_has_its_milestones_as_events_in_order(traced):
    spans, _, results = traced
    span = request_span(spans, "traced-1")
    names = [e.name for e in span.events]
    assert names == ["validated", "enqueued", "admitted", "first_scheduled", "first_token", "finished", "last_byte"]
    times = [e.timestamp for e in span.events]
    assert span.start_time <= times[0] and times == sorted(times) and times[-1] <= span.end_time
    assert span.attributes["tokenline.outcome"] == "length"
    assert span.attributes["tokenline.completion_tokens"] == 6 == results["final"].usage.completion_tokens
    assert span.attributes["tokenline.ttft_ms"] >= span.attributes["tokenline.prefill_ms"]


def test_the_request_span_links_to_the_worker_step_that_admitted_it(traced):
    spans, _, _ = traced
    span = request_span(spans, "traced-1")
    steps = {s.context.span_id: s for s in spans if s.name == "tokenline.worker_step"}
    linked = [steps[link.context.span_id] for link in span.links if link.context.span_id in steps]
    assert len(linked) == 1
    assert linked[0].attributes["tokenline.admitted"] >= 1


def test_a_refused_call_is_traced_and_counted_with_its_reason(traced):
    spans, metrics, _ = traced
    rpc = [s for s in spans if s.name == "/tokenline.v1.Tokenline/Complete" and format(s.context.trace_id, "032x") == CALLER_TRACE_ID]
    assert len(rpc) == 1 and rpc[0].attributes["tokenline.refusal"] == "model_not_found"
    assert rpc[0].attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    points = {m.name: m.data.data_points for rm in metrics.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    refusals = {p.attributes["reason"]: p.value for p in points["tokenline_refusals_total"]}
    assert refusals == {"model_not_found": 1}
    outcomes = {p.attributes["outcome"]: p.value for p in points["tokenline_requests_total"]}
    assert outcomes == {"length": 2, "model_not_found": 1}


def test_outcome_labels_and_log_values_are_plain():
    assert _snake("DeadlineUnmeetable") == "deadline_unmeetable"
    assert _snake("stop_string") == "stop_string"
    assert _logfmt("a b") == '"a b"' and _logfmt('say "x"') == '"say \\"x\\""' and _logfmt("plain") == "plain"
    assert _logfmt(1.23456) == "1.235"


def test_tenant_labels_are_bounded():
    telemetry = Telemetry(TelemetryConfig(max_tenant_labels=2))
    assert [telemetry._tenant_label(t) for t in ("a", "b", "c", "a")] == ["a", "b", "other", "a"]


def test_a_bad_telemetry_setting_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="metrics port"):
        TelemetryConfig(metrics_port=70000)
    with pytest.raises(ValueError, match="request log level"):
        TelemetryConfig(request_log_level="loud")


class Collector(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    """A stand-in OpenTelemetry collector: keeps what it is sent."""

    def __init__(self):
        self.spans, self.metric_names = [], set()

    def Export(self, request, context):  # noqa: N802 - one method name serves both services
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            self.spans += [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
            return trace_service_pb2.ExportTraceServiceResponse()
        self.metric_names |= {m.name for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        return metrics_service_pb2.ExportMetricsServiceResponse()


def test_with_the_standard_otlp_endpoint_set_spans_and_metrics_reach_the_collector():
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_METRIC_EXPORT_INTERVAL": "200"}
    proc = ServerProcess("--engine", "sim", "--model", "tiny", env=env).start()
    try:
        with grpc.insecure_channel(proc.address) as channel:
            stub = pb_grpc.TokenlineStub(channel)
            stub.Complete(pb.GenerateRequest(text="export me", sampling=pb.SamplingParams(max_tokens=3)),
                          metadata=(("traceparent", TRACEPARENT),), timeout=30)
        assert wait_until(lambda: any(s.name == "tokenline.request" for s in collector.spans))
        assert wait_until(lambda: "tokenline_request_completion_seconds" in collector.metric_names)
    finally:
        proc.stop()
        server.stop(None)
    request = next(s for s in collector.spans if s.name == "tokenline.request")
    assert request.trace_id.hex() == CALLER_TRACE_ID
