"""The incident's metrics, recorded once its report is final (the last step of NodeRecoveryWorkflow)."""

from __future__ import annotations

from temporalio import activity

from contracts.models import IncidentReport
from observability.metrics import RecoveryMetrics


class TelemetryActivities:
    def __init__(self, metrics: RecoveryMetrics):
        self.metrics = metrics

    @activity.defn
    async def record_incident(self, report: IncidentReport) -> None:
        """Retries: recording is in memory and cannot fail half-way, so an attempt is retried only
        when its worker died before reporting it done. The retry records the incident again: at
        least once, and twice only if the dead worker had exported its points before dying."""
        self.metrics.record_incident(report)
