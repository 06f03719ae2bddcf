"""Starting the worker's telemetry from configuration: the OpenTelemetry tracer and meter
providers (process-wide, once) and the Temporal runtime whose SDK metrics Prometheus scrapes."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanProcessor
from temporalio.contrib.opentelemetry import ReplaySafeTracerProvider, create_tracer_provider
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from contracts.settings import ConfigError, TelemetrySettings
from observability.tracing import IncidentTracingInterceptor


@dataclass
class Telemetry:
    tracer_provider: ReplaySafeTracerProvider | None
    meter_provider: MeterProvider | None
    # None: the SDK's default runtime, no Prometheus endpoint
    runtime: Runtime | None

    @classmethod
    def start(cls, otel: TelemetrySettings, prometheus_address: str) -> Telemetry:
        """Installs the global providers: call once per process, before the worker starts.
        Raises ConfigError when the Prometheus endpoint cannot listen."""
        resource = Resource.create({"service.name": otel.service_name})
        tracer_provider = meter_provider = None
        span_processor = _span_processor(otel)
        if span_processor is not None:
            tracer_provider = tracing_provider(span_processor, resource)
        metric_reader = _metric_reader(otel)
        if metric_reader is not None:
            meter_provider = MeterProvider(metric_readers=[metric_reader], resource=resource)
            metrics.set_meter_provider(meter_provider)
        runtime = None
        if prometheus_address:
            try:
                runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=prometheus_address)))
            except ValueError as e:  # the address is taken or not this host's
                raise ConfigError(f"RECOVERY_PROMETHEUS_ADDRESS={prometheus_address}: {e}") from None
        return cls(tracer_provider, meter_provider, runtime)

    def worker_options(self) -> dict:
        """Worker options that trace each incident (none while tracing is off)."""
        return {"interceptors": [IncidentTracingInterceptor()]} if self.tracer_provider is not None else {}

    def shutdown(self) -> None:
        """Exports what is still buffered."""
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                provider.shutdown()


def tracing_provider(processor: SpanProcessor, resource: Resource | None = None) -> ReplaySafeTracerProvider:
    """The process's tracer provider: replay-safe, as Temporal's interceptor requires."""
    provider = create_tracer_provider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return provider


def _span_processor(otel: TelemetrySettings) -> SpanProcessor | None:
    exporter = {"otlp": OTLPSpanExporter, "console": ConsoleSpanExporter}.get(otel.traces())
    return None if exporter is None else BatchSpanProcessor(exporter())


def _metric_reader(otel: TelemetrySettings) -> MetricReader | None:
    exporter = {"otlp": OTLPMetricExporter, "console": ConsoleMetricExporter}.get(otel.metrics())
    if exporter is None:
        return None
    return PeriodicExportingMetricReader(exporter(), export_interval_millis=otel.metric_export_interval)
