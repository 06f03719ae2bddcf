"""One trace per incident: Temporal's OpenTelemetry interceptor (temporalio.contrib.opentelemetry)
with its own spans on, so that the workflow's RunWorkflow span is the root and every activity
(StartActivity in the workflow, RunActivity in the worker that ran it) hangs below it.

The span ids come from the workflow's deterministic random (ReplaySafeTracerProvider), so a
worker that replays the incident after a crash continues the same trace instead of starting one.
"""

from __future__ import annotations

from typing import Any

from temporalio.contrib.opentelemetry import OpenTelemetryInterceptor
from temporalio.worker import HandleQueryInput, HandleSignalInput, HandleUpdateInput, WorkflowInterceptorClassInput


class IncidentTracingInterceptor(OpenTelemetryInterceptor):
    """Queries, signals and updates are not traced: arriving without a trace context, each would
    start a trace of its own (a drill alone queries twice a second). The incident's alerts and
    operator decisions are in its history and its report."""

    def __init__(self) -> None:
        super().__init__(add_temporal_spans=True)

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type:
        traced = super().workflow_interceptor_class(input)

        class RunAndActivitiesOnly(traced):
            async def handle_query(self, input: HandleQueryInput) -> Any:
                return await self.next.handle_query(input)

            async def handle_signal(self, input: HandleSignalInput) -> None:
                await self.next.handle_signal(input)

            def handle_update_validator(self, input: HandleUpdateInput) -> None:
                self.next.handle_update_validator(input)

            async def handle_update_handler(self, input: HandleUpdateInput) -> Any:
                return await self.next.handle_update_handler(input)

        return RunAndActivitiesOnly
