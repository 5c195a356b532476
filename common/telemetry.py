"""OpenTelemetry for every service: traces and metrics, set up once per service.

Traces are on when there is somewhere to send them: an OTLP collector named by the standard
`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT` variables, a JSON-lines file (`trace_file`), or exporters a
test passes. Sampling is parent-based on a trace-id ratio, so a request sampled at the gateway is
traced through routers and expert services and an unsampled one nowhere. With tracing off no
tracer provider exists and services skip span code entirely: off costs nothing.

Metrics go to a Prometheus scrape endpoint per service (`metrics_port`; 0 picks a free port) from
the OpenTelemetry metrics SDK, each service with its own registry so several can share a process.

Each service keeps its own providers (never the global ones): tests run gateway, router and expert
services in one process, each with its own `service.name`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import filters
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from pydantic import Field
from pydantic_settings import BaseSettings

DEFAULT_SAMPLE_RATIO = 0.01
SCOPE = "moe_mesh"
# Histogram buckets: the SDK's defaults suit milliseconds; ours record seconds and token counts.
SECONDS_BUCKETS = (
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
)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# Metric names. OpenTelemetry's GenAI conventions where they exist, `moe.*` otherwise; Prometheus
# shows them with dots as underscores, the unit appended (`_seconds`) and `_total` on counters.
REQUEST_DURATION = "gen_ai.server.request.duration"  # gateway, s, by rpc.grpc.status_code
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"  # gateway, s
TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"  # gateway, s
GATEWAY_QUEUE_DEPTH = "moe.gateway.queue.depth"  # gateway, requests admitted and waiting
GATEWAY_QUEUE_WAIT = "moe.gateway.queue.wait"  # gateway, s
GATEWAY_IN_FLIGHT = "moe.gateway.in_flight"  # gateway, requests streaming from routers
GATEWAY_FAILOVERS = "moe.gateway.failovers"  # gateway, router calls continued on another router
GATEWAY_EJECTIONS = "moe.gateway.router_ejections"  # gateway, routers ejected after a failure
ROUTER_BATCH_SIZE = "moe.router.batch.size"  # router, sequences per engine step
ROUTER_QUEUE_DEPTH = "moe.router.queue.depth"  # router, sequences waiting for a batch slot
ROUTER_KV_BLOCKS = (
    "moe.router.kv.blocks"  # router, KV-cache blocks by moe.state (used, cached, free)
)
PREFIX_CACHE_QUERY_TOKENS = "moe.router.prefix_cache.query_tokens"  # router, tokens admitted
PREFIX_CACHE_HIT_TOKENS = "moe.router.prefix_cache.hit_tokens"  # router, ... found cached
PREEMPTIONS = "moe.router.preemptions"  # router, sequences preempted for KV blocks
TOKENS_ROUTED = (
    "moe.router.tokens_routed"  # router, (token, expert) assignments by moe.layer, moe.expert
)
DISPATCH_DURATION = "moe.router.dispatch.duration"  # router, s, one backend call, by moe.transport
FAILOVERS = "moe.router.failovers"  # router, calls retried on another replica
HEDGES = (
    "moe.router.hedges"  # router, calls also sent to a second replica, by moe.outcome (won / lost)
)
FAST_PATH_FALLBACKS = "moe.router.fast_path_fallbacks"  # router, calls re-sent over gRPC after UCX failed, by moe.cause
EJECTIONS = (
    "moe.router.ejections"  # router, expert replicas ejected after a failure or a lost hedge race
)
# router, health checks of ejected expert replicas, by moe.outcome (readmitted, passed, failed)
EJECTION_CHECKS = "moe.router.ejection_checks"
EXPERT_QUEUE_DURATION = (
    "moe.expert.queue.duration"  # expert service, s a group waited for its batch
)
EXPERT_COMPUTE_DURATION = "moe.expert.compute.duration"  # expert service, s of one batched FFN
EXPERT_BATCH_TOKENS = "moe.expert.batch.tokens"  # expert service, token rows per FFN execution
EXPERT_WEIGHT_BYTES = "moe.expert.weight_bytes"  # expert service, experts' bytes, by moe.precision
# expert service, fast-path hellos dropped for a missing or bad proof of a mesh certificate
FAST_PATH_REFUSED = "moe.expert.fast_path.hellos_refused"
ERRORS = "moe.errors"  # every service, failed RPCs by rpc.grpc.status_code
# `moe-mesh autoscale`, by moe.group: replicas set, replicas the load asks for, load per replica and
# its target (in the group's metric's unit), decisions by moe.action (up, down, hold, failed)
AUTOSCALER_REPLICAS = "moe.autoscaler.replicas"
AUTOSCALER_RAW = "moe.autoscaler.recommended_replicas"
AUTOSCALER_LOAD = "moe.autoscaler.load"
AUTOSCALER_TARGET = "moe.autoscaler.target"
AUTOSCALER_DECISIONS = "moe.autoscaler.decisions"


class TelemetrySettings(BaseSettings):
    """The telemetry fields every service's settings model inherits."""

    trace_file: Path | None = Field(
        None,
        description="append finished spans to this JSON-lines file (`moe-mesh "
        "trace show` reads it); OTLP export follows the OTEL_EXPORTER_OTLP_* variables",
    )
    trace_sample: float | None = Field(
        None,
        ge=0,
        le=1,
        description="share of new traces recorded; default "
        "OTEL_TRACES_SAMPLER_ARG, else 0.01 (children follow their parent)",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="serve Prometheus metrics on this port "
        "(0 picks a free one); unset: no metrics endpoint",
    )


# Health checks and reflection are not requests: no spans for them.
_TRACED = filters.negate(
    filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"))
)


def traces_to_otlp() -> bool:
    """Whether the standard OTEL_* variables name an OTLP collector for traces."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def sample_ratio(explicit: float | None) -> float:
    """The flag, else OTEL_TRACES_SAMPLER_ARG, else 1%."""
    if explicit is not None:
        return explicit
    try:
        return float(os.environ.get("OTEL_TRACES_SAMPLER_ARG", DEFAULT_SAMPLE_RATIO))
    except ValueError:
        return DEFAULT_SAMPLE_RATIO


class JsonLinesSpanExporter(SpanExporter):
    """One finished span per line, as the SDK's own JSON form of a span (what `moe-mesh trace show` reads)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(
            s.to_json(indent=None) + "\n" for s in spans
        )  # indent=None: one line per span
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


@dataclass
class Telemetry:
    """A service's tracer and meter providers; `tracer` is None while tracing is off."""

    service: str
    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    metrics_address: str | None = None
    # Where the metrics are collected; a service may also serve it on a port of its own (/metrics).
    registry: Any = field(default=None, repr=False)
    _http: Any = field(default=None, repr=False)

    @classmethod
    def from_settings(
        cls,
        service: str,
        settings: TelemetrySettings,
        host: str = "127.0.0.1",
        collect_metrics: bool = False,
    ) -> Telemetry:
        return cls.create(
            service,
            trace_file=settings.trace_file,
            sample=settings.trace_sample,
            metrics_port=settings.metrics_port,
            host=host,
            collect_metrics=collect_metrics,
        )

    @classmethod
    def create(
        cls,
        service: str,
        *,
        trace_file: Path | None = None,
        sample: float | None = None,
        metrics_port: int | None = None,
        host: str = "127.0.0.1",
        exporters: Sequence[SpanExporter] = (),
        collect_metrics: bool = False,
    ) -> Telemetry:
        """`collect_metrics`: keep metrics in `registry` even without a metrics port."""
        resource = Resource.create({"service.name": service})
        t = cls(service)
        ratio = sample_ratio(sample)
        if ratio > 0 and (trace_file or exporters or traces_to_otlp()):
            provider = TracerProvider(
                resource=resource, sampler=ParentBased(TraceIdRatioBased(ratio))
            )
            for exporter in exporters:  # tests: spans visible the moment they end
                provider.add_span_processor(SimpleSpanProcessor(exporter))
            if trace_file:
                provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file)))
            if traces_to_otlp():
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            t.tracer_provider = provider
        if metrics_port is not None or collect_metrics:
            from opentelemetry.exporter.prometheus import PrometheusMetricReader
            from prometheus_client import CollectorRegistry

            t.registry = CollectorRegistry()
            t.meter_provider = MeterProvider(
                metric_readers=[PrometheusMetricReader(registry=t.registry)], resource=resource
            )
        if metrics_port is not None:
            from prometheus_client import start_http_server

            server, thread = start_http_server(metrics_port, addr=host, registry=t.registry)
            t._http = (server, thread)
            t.metrics_address = f"{host}:{server.server_port}"
        return t

    @property
    def tracer(self) -> trace.Tracer | None:
        return self.tracer_provider.get_tracer(SCOPE) if self.tracer_provider else None

    @property
    def meter(self) -> metrics.Meter:
        """Instruments of a service without a metrics endpoint record nothing."""
        return (self.meter_provider or metrics.NoOpMeterProvider()).get_meter(SCOPE)

    def server_interceptors(self) -> list:
        if self.tracer_provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [aio_server_interceptor(tracer_provider=self.tracer_provider, filter_=_TRACED)]

    def client_interceptors(self) -> list:
        if self.tracer_provider is None:
            return []
        from opentelemetry.instrumentation.grpc import aio_client_interceptors

        return aio_client_interceptors(tracer_provider=self.tracer_provider, filter_=_TRACED)

    def latency(self, name: str, description: str):
        return self.meter.create_histogram(
            name,
            unit="s",
            description=description,
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )

    def sizes(self, name: str, description: str):
        return self.meter.create_histogram(
            name, description=description, explicit_bucket_boundaries_advisory=COUNT_BUCKETS
        )

    def errors(self):
        return self.meter.create_counter(ERRORS, description="failed RPCs by gRPC status code")

    def shutdown(self) -> None:
        """Flush and close exporters and the scrape endpoint."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(5)
            self._http = None


OFF = Telemetry("off")  # the default of every component: no spans, no-op instruments
