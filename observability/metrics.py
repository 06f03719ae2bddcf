"""The incident metrics, recorded from each finished incident's report (activities/telemetry.py),
and the disruption budget's gauge.

Attributes stay low in cardinality: XID, fault class, the outcome's kind and the phase; never a
node name or a job id (those are search attributes, in the Temporal Web UI).
"""

from __future__ import annotations

from opentelemetry import metrics
from opentelemetry.metrics import Meter

from contracts.models import IncidentReport
from contracts.search_attributes import outcome_label

METER_NAME = "training_recovery"


class RecoveryMetrics:
    def __init__(self, meter: Meter):
        self.incidents = meter.create_counter(
            "recovery.incidents", unit="{incident}", description="finished incidents, by XID and outcome"
        )
        self.phase_duration = meter.create_histogram(
            "recovery.phase.duration", unit="s", description="how long each phase of an incident took"
        )
        self.time_to_resume = meter.create_histogram(
            "recovery.time_to_resume", unit="s", description="from the failure to the last job training again"
        )
        self.replacement_time = meter.create_histogram(
            "recovery.replacement.duration", unit="s", description="from the failure to the spare in service"
        )
        self.lost_steps = meter.create_histogram(
            "recovery.lost.steps", unit="{step}", description="training steps lost per incident, all jobs"
        )
        self.lost_seconds = meter.create_histogram(
            "recovery.lost.training_time", unit="s", description="training time lost per incident, all jobs"
        )
        self.budget_in_use = meter.create_gauge(
            "recovery.budget.in_use", unit="{node}", description="nodes the disruption budget has out of service"
        )

    def record_incident(self, report: IncidentReport) -> None:
        attributes = {
            "xid": report.xid,
            "fault_class": report.fault_class.value,
            "outcome": outcome_label(report.outcome),
        }
        self.incidents.add(1, attributes)
        for phase in report.phases:
            if phase.ended_at is not None and not phase.result.startswith("skipped"):
                self.phase_duration.record(
                    (phase.ended_at - phase.started_at).total_seconds(), {"phase": phase.name, "xid": report.xid}
                )
        measured = (
            (self.time_to_resume, report.time_to_resume_seconds),
            (self.replacement_time, report.replacement_seconds),
            (self.lost_steps, report.lost_steps),
            (self.lost_seconds, report.lost_seconds),
        )
        for instrument, value in measured:
            if value is not None:
                instrument.record(value, attributes)

    def set_budget_in_use(self, nodes: int, budget: str = "default") -> None:
        self.budget_in_use.set(nodes, {"budget": budget})


# The process's own instance, on the global meter provider (a no-op until observability.telemetry
# installs one; instruments created before that follow it).
DEFAULT = RecoveryMetrics(metrics.get_meter(METER_NAME))
