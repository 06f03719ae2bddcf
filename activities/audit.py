"""The audit line of a workflow decision, written by a local activity: its result is a marker in
the workflow's history, so a replay never writes the line again (workflows/audit_trail.py)."""

from __future__ import annotations

from temporalio import activity

from contracts.audit import AuditEvent, write_event


@activity.defn
async def write_audit(event: AuditEvent) -> None:
    write_event(event)


@activity.defn
async def write_audit_lines(events: list[AuditEvent]) -> None:
    """Several decisions' lines at once (a trail that holds them: workflows/audit_trail.py)."""
    for event in events:
        write_event(event)
