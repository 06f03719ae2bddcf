"""The audit line of a workflow decision, written by a local activity: its result is a marker in
the workflow's history, so a replay never writes the line again (workflows/audit_trail.py).
A line that cannot be written fails the activity, and Temporal retries it."""

from __future__ import annotations

import asyncio

from temporalio import activity

from contracts.audit import AuditEvent, write_events


@activity.defn
async def write_audit(event: AuditEvent) -> None:
    await write_audit_lines([event])


@activity.defn
async def write_audit_lines(events: list[AuditEvent]) -> None:
    """Several decisions' lines at once, one fsync (a trail that holds them: workflows/audit_trail.py)."""
    # In a thread: the fsync must not hold up the worker's event loop.
    await asyncio.to_thread(write_events, events)
