"""What telemetry exports and where (server/telemetry.py does it): the configuration, and the metrics' bucket
boundaries and the per-request splits they are measured in.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.engine.flagspec import flag

OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"

# Bucket boundaries (seconds). 0 is a bucket of its own: "no wait at all" is the common,
# healthy case for the waits, and an operator wants to see how often it holds.
WAIT_BUCKETS = (0.0, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GAP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

# One histogram per split: (key in Timeline.splits_ms or "intake", metric name, buckets, help).
SPLITS = (
    ("intake_ms", "tokenline_request_intake_seconds", WAIT_BUCKETS,
     "Received to enqueued: validation and tokenization."),
    ("admission_wait_ms", "tokenline_request_admission_wait_seconds", WAIT_BUCKETS,
     "Waiting to be batched: queued while some worker had room, until the dispatch rule fired."),
    ("queueing_ms", "tokenline_request_queueing_seconds", WAIT_BUCKETS,
     "Waiting for capacity: queued while no worker had room."),
    ("prefill_ms", "tokenline_request_prefill_seconds", FIRST_TOKEN_BUCKETS,
     "Admitted to a worker until the first token."),
    ("decode_ms", "tokenline_request_decode_seconds", REQUEST_BUCKETS, "First token to last token."),
    ("return_ms", "tokenline_request_return_seconds", WAIT_BUCKETS,
     "Finished in the engine until the last byte was written to the stream."),
    ("ttft_ms", "tokenline_request_ttft_seconds", FIRST_TOKEN_BUCKETS, "Time to first token, from receipt."),
    ("itl_mean_ms", "tokenline_request_itl_mean_seconds", GAP_BUCKETS, "Mean inter-token gap of one request."),
    ("completion_ms", "tokenline_request_completion_seconds", REQUEST_BUCKETS,
     "Received until the last byte was written (requests that got their final message)."),
)

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "OFF")


@dataclass(frozen=True)
class TelemetryConfig:
    """Where telemetry goes. Nothing is exported unless asked for; the request log is on."""

    metrics_port: int | None = flag(None, "--metrics-port", "serve Prometheus metrics on this port (on --host, path "
                                    "/metrics; 0 picks a free one; default off; 9464 is customary)", type=int)
    metrics_host: str = "127.0.0.1"
    otlp_endpoint: str | None = flag(None, "--otlp-endpoint", "send metrics and traces by OTLP/gRPC to this "
                                     "collector, e.g. http://localhost:4317 (default: $OTEL_EXPORTER_OTLP_ENDPOINT "
                                     "if set, else off)")
    request_log_level: str = flag("INFO", "--request-log-level",
                                  "level of the one key=value line per finished request, or OFF")
    max_tenant_labels: int = 16  # tenants beyond these are labelled "other"

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {self.metrics_port}")
        if self.request_log_level.upper() not in _LOG_LEVELS:
            raise ValueError(f"request log level {self.request_log_level!r} is not one of {', '.join(_LOG_LEVELS)}")
        if self.max_tenant_labels < 0:
            raise ValueError(f"max_tenant_labels must be >= 0, got {self.max_tenant_labels}")


__all__ = ["TelemetryConfig", "SPLITS", "OTLP_ENDPOINT_ENV"]
