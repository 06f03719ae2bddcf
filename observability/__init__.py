"""The worker's telemetry: OpenTelemetry traces (one per incident) and incident metrics, exported
over OTLP as the standard OTEL_* variables say; the Temporal SDK's own metrics on a Prometheus
endpoint (RECOVERY_PROMETHEUS_ADDRESS)."""
