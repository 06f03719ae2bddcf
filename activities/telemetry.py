"""Metrics from workflows, which do no I/O themselves: an incident's, recorded once its report is
final (the last step of NodeRecoveryWorkflow), and the fleet budget's nodes in use."""

from __future__ import annotations

from temporalio import activity

from contracts.budget import BudgetInUse
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

    @activity.defn
    async def record_budget_in_use(self, in_use: BudgetInUse) -> None:
        """A gauge: the fleet budget reports each change, so a repeated report is harmless."""
        self.metrics.set_budget_in_use(in_use.nodes, in_use.budget)
