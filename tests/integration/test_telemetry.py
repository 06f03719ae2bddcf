"""Telemetry of real incidents: one trace per incident with a span for the workflow and each
activity, the incident's metrics equal to its report, OTLP export configured from OTEL_*
variables, and the Temporal SDK's metrics on a Prometheus endpoint."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import AsyncExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from contracts.models import NodeFailureAlert, RecoveryPolicy
from drills.drill import DrillOptions
from observability.metrics import RecoveryMetrics
from observability.telemetry import tracing_provider
from observability.tracing import IncidentTracingInterceptor
from starter.alerts import raise_alert
from worker import activities_for, build_slurm, build_worker
from workflows.job_recovery import job_recovery_workflow_id
from workflows.node_recovery import incident_workflow_id
from workflows.spare_claim import spare_claim_workflow_id

REPO = Path(__file__).resolve().parents[2]
# In the incident's trace: the worker's policy read at its start, its own activities, the fleet
# budget's lease and the audit line of its outcome (a local activity). The budget's own workflow
# has a trace of its own, and so has the job's recovery (the requeue and the verification), which
# the incidents on the job's nodes share. No quarantined_among: the lease's answer says which spares are lemons.
ACTIVITIES_OF_A_FATAL_XID = {
    "incident_policy",
    "classify_fault",
    "drain_node",
    "fence_node",
    "find_jobs",
    "fence_scope",
    "request_lease",
    "signal_job",
    "join_job_recovery",
    "mark_node_down",
    "release_node",
    "request_replacement",
    "wait_for_spare",
    "ask_job_verification",
    "record_incident",
    "write_audit",
}
ACTIVITIES_OF_A_JOB_RECOVERY = {"requeue_job", "verify_restart"}


@pytest.fixture(scope="session")
def spans() -> InMemorySpanExporter:
    """The process's tracer provider (there is one per process), exporting to memory. Session
    scope: the module's tests run once per Slurm generation, and the provider cannot be set twice."""
    exporter = InMemorySpanExporter()
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.fail("another test installed a tracer provider first")
    tracing_provider(SimpleSpanProcessor(exporter))
    return exporter


@pytest_asyncio.fixture
async def metric_reader():
    reader = InMemoryMetricReader()
    yield reader
    reader.shutdown()


@pytest_asyncio.fixture
async def traced_worker(temporal_env, settings, spans, metric_reader):
    """The worker as worker.py runs it with tracing on, metrics into memory."""
    metrics = RecoveryMetrics(MeterProvider(metric_readers=[metric_reader]).get_meter("test"))
    async with AsyncExitStack() as stack:
        slurm = await build_slurm(settings, stack)
        async with build_worker(
            temporal_env.client,
            settings.task_queue,
            activities_for(settings, slurm, temporal_env.client, metrics),
            interceptors=[IncidentTracingInterceptor()],
        ):
            yield


def points(reader: InMemoryMetricReader) -> dict[str, list]:
    """Every data point by metric name."""
    found: dict[str, list] = {}
    data = reader.get_metrics_data()  # None until something was recorded
    for resource in data.resource_metrics if data else []:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


@pytest.mark.slurm
async def test_a_drill_is_one_trace_and_its_metrics_match_its_report(drill, traced_worker, spans, metric_reader):
    spans.clear()
    result = await drill.run(DrillOptions(xid=79))
    report = result.report
    assert report.outcome == "recovered", result.checks

    workflow_id = incident_workflow_id(report.node)
    # the incident's last activity is recorded when its worker reports it; wait for its span
    deadline = time.monotonic() + 10
    while "RunActivity:record_incident" not in {s.name for s in spans.get_finished_spans()}:
        assert time.monotonic() < deadline, [s.name for s in spans.get_finished_spans()]
        await asyncio.sleep(0.1)
    # The incident's spans, and its claim of the spare (a child workflow: workflows/spare_claim.py).
    claim_id = spare_claim_workflow_id(drill.stack.task_queue, report.spare_node)
    finished = spans.get_finished_spans()
    incident = [s for s in finished if s.attributes.get("temporalWorkflowID") == workflow_id]
    claim = [s for s in finished if s.attributes.get("temporalWorkflowID") == claim_id]
    assert len({s.context.trace_id for s in incident + claim}) == 1, "one trace per incident, its claim in it"
    [root] = [s for s in incident if s.parent is None]
    assert root.name == "RunWorkflow:NodeRecoveryWorkflow"
    by_id = {s.context.span_id: s for s in incident}
    ran = {s.name.removeprefix("RunActivity:") for s in incident + claim if s.name.startswith("RunActivity:")}
    assert ran == ACTIVITIES_OF_A_FATAL_XID
    job_recovery = [
        s
        for s in finished
        if s.attributes.get("temporalWorkflowID") == job_recovery_workflow_id(drill.stack.task_queue, result.job_id)
    ]
    assert {
        s.name.removeprefix("RunActivity:") for s in job_recovery if s.name.startswith("RunActivity:")
    } == ACTIVITIES_OF_A_JOB_RECOVERY
    assert len({s.context.trace_id for s in job_recovery}) == 1
    assert not {s.context.trace_id for s in job_recovery} & {s.context.trace_id for s in incident}
    for span in incident:
        if span.name.startswith("RunActivity:"):  # below the workflow's StartActivity of the same activity
            parent = by_id[span.parent.span_id]
            assert parent.name == span.name.replace("Run", "Start", 1) and parent.parent.span_id == root.context.span_id
    # the workflow span lasts the incident: from before the first activity to after the last
    assert root.start_time <= min(s.start_time for s in incident) and root.end_time >= max(
        s.end_time for s in incident if s is not root
    )

    found = points(metric_reader)
    labels = {"xid": 79, "fault_class": "fatal", "outcome": "recovered"}
    [incidents] = found["recovery.incidents"]
    assert (dict(incidents.attributes), incidents.value) == (labels, 1)
    durations = {p.attributes["phase"]: p for p in found["recovery.phase.duration"]}
    ran_phases = [p for p in report.phases if not p.result.startswith("skipped")]
    assert set(durations) == {p.name for p in ran_phases}  # the skipped grace phase is no duration
    for phase in ran_phases:
        assert durations[phase.name].count == 1
        assert durations[phase.name].sum == pytest.approx((phase.ended_at - phase.started_at).total_seconds())
    for name, value in (
        ("recovery.time_to_resume", report.time_to_resume_seconds),
        ("recovery.replacement.duration", report.replacement_seconds),
        ("recovery.lost.steps", report.lost_steps),
        ("recovery.lost.training_time", report.lost_seconds),
    ):
        [point] = found[name]
        assert (dict(point.attributes), point.count, point.sum) == (labels, 1, pytest.approx(value)), name


def test_the_budget_gauge_shows_the_last_value_set():
    reader = InMemoryMetricReader()
    metrics = RecoveryMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    metrics.set_budget_in_use(2, budget="rack-7")
    metrics.set_budget_in_use(1, budget="rack-7")
    metrics.set_budget_in_use(3, budget="rack-9")
    gauge = {p.attributes["budget"]: p.value for p in points(reader)["recovery.budget.in_use"]}
    assert gauge == {"rack-7": 1, "rack-9": 3}


# --- the worker process: OTLP export from OTEL_* and the SDK's Prometheus endpoint -------------


class OtlpReceiver(ThreadingHTTPServer):
    """A stand-in OpenTelemetry collector: keeps what each OTLP/HTTP request brought."""

    def __init__(self):
        self.requests: list[tuple[str, str, bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((self.path, self.headers["Content-Type"], body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *_):
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def received(self, path: str) -> list[bytes]:
        return [body for p, kind, body in self.requests if p == path and kind == "application/x-protobuf"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_for(check, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not (value := await asyncio.to_thread(check)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)
    return value


async def test_the_worker_exports_over_otlp_and_serves_sdk_metrics(temporal_env, tmp_path):
    """worker.py as deployed, its telemetry configured by the environment alone. An application
    XID makes an incident without touching Slurm (classify, then no node action)."""
    receiver = OtlpReceiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    prometheus = f"127.0.0.1:{free_port()}"
    task_queue = f"otlp-{uuid.uuid4()}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "RECOVERY_TASK_QUEUE": task_queue,
        "RECOVERY_PROMETHEUS_ADDRESS": prometheus,
        "RECOVERY_WORKFLOW_TASK_SLOTS": "12",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_port}",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_SERVICE_NAME": "recovery-under-test",
    }
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, str(REPO / "worker.py")], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
        )
    try:
        alert = NodeFailureAlert(node=f"otlp-{uuid.uuid4().hex[:8]}", xid=13, source="test", actor="pytest")
        handle = await raise_alert(temporal_env.client, alert, task_queue, RecoveryPolicy())
        report = await asyncio.wait_for(handle.result(), 60)
        assert report.outcome == "no_node_action"

        def span_names() -> set[str]:
            names = set()
            for body in receiver.received("/v1/traces"):
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
                    names |= {f"{service} {span.name}" for scope in resource.scope_spans for span in scope.spans}
            return names

        exported = await wait_for(
            lambda: "recovery-under-test RunWorkflow:NodeRecoveryWorkflow" in span_names() and span_names(),
            20,
            "the incident's trace",
        )
        assert {
            "recovery-under-test RunActivity:classify_fault",
            "recovery-under-test RunActivity:record_incident",
        } <= exported

        def incidents_counted() -> list:
            found = []
            for body in receiver.received("/v1/metrics"):
                request = ExportMetricsServiceRequest.FromString(body)
                found += [
                    point
                    for resource in request.resource_metrics
                    for scope in resource.scope_metrics
                    for metric in scope.metrics
                    if metric.name == "recovery.incidents"
                    for point in metric.sum.data_points
                ]
            return found

        [counted, *_] = await wait_for(incidents_counted, 20, "the incident metric")
        attributes = {a.key: a.value for a in counted.attributes}
        assert (attributes["xid"].int_value, attributes["outcome"].string_value, counted.as_int) == (
            13,
            "no_node_action",
            1,
        )

        def sdk_metrics() -> str:
            try:
                return httpx.get(f"http://{prometheus}/metrics", timeout=2).text
            except httpx.HTTPError:
                return ""

        text = await wait_for(
            lambda: "temporal_workflow_completed" in sdk_metrics() and sdk_metrics(),
            20,
            "the SDK's metrics on Prometheus",
        )
        assert f'task_queue="{task_queue}"' in text
        # The worker takes as many workflow tasks at once as configured (the SDK's default is 100).
        workflow_slots = [
            line
            for line in text.splitlines()
            if line.startswith("temporal_worker_task_slots_available{") and 'worker_type="WorkflowWorker"' in line
        ]
        assert [float(line.rsplit(" ", 1)[1]) for line in workflow_slots] == [12], text
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()
        receiver.shutdown()
