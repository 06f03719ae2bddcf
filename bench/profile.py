"""Where an incident's time goes, from its Temporal history: for each activity, the wait for the
workflow task that schedules it, its time in the server's task queue, and its time at the worker
(delivery to the worker, the run, the completion's way back)."""

from __future__ import annotations

from datetime import datetime

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle

from bench.table import median


async def activity_timeline(handle: WorkflowHandle, since: datetime, until_activity: str,
                            occurrences: int = 1) -> list[tuple[str, float]]:
    """(segment, seconds) from `since` until the `occurrences`-th completion of `until_activity`.

    Segments: "workflow task -> NAME" (from the previous step's end, or `since`, until NAME is
    scheduled: the workflow tasks in between), "NAME in the task queue" (scheduled to started, as
    the server saw it), "NAME at the worker" (started to completed: a busy worker shows here)."""
    scheduled: dict[int, tuple[str, datetime]] = {}
    started: dict[int, datetime] = {}
    segments: list[tuple[str, float]] = []
    previous_end, seen = since, 0
    async for event in handle.fetch_history_events():
        at = event.event_time.ToDatetime().replace(tzinfo=since.tzinfo)
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            scheduled[event.event_id] = (name, at)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            started[event.activity_task_started_event_attributes.scheduled_event_id] = at
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            scheduled_id = event.activity_task_completed_event_attributes.scheduled_event_id
            name, scheduled_at = scheduled[scheduled_id]
            started_at = started.get(scheduled_id, scheduled_at)
            segments += [(f"workflow task -> {name}", (scheduled_at - previous_end).total_seconds()),
                         (f"{name} in the task queue", (started_at - scheduled_at).total_seconds()),
                         (f"{name} at the worker", (at - started_at).total_seconds())]
            previous_end = max(previous_end, at)
            if name == until_activity:
                seen += 1
                if seen == occurrences:
                    break
    return segments


def median_timeline(runs: list[list[tuple[str, float]]]) -> list[tuple[str, float]]:
    """The median of each segment over the runs, in the order of the first run (a segment that
    repeats within a run, such as one signal per job, is summed first)."""
    order: list[str] = []
    per_run: list[dict[str, float]] = []
    for segments in runs:
        totals: dict[str, float] = {}
        for name, seconds in segments:
            totals[name] = totals.get(name, 0.0) + seconds
            if name not in order:
                order.append(name)
        per_run.append(totals)
    return [(name, median(r.get(name, 0.0) for r in per_run) or 0.0) for name in order]


def render_timeline(segments: list[tuple[str, float]]) -> str:
    total = sum(s for _, s in segments)
    width = max((len(n) for n, _ in segments), default=0)
    lines = [f"    {name:<{width}}  {seconds * 1000:7.1f} ms" for name, seconds in segments]
    return "\n".join([*lines, f"    {'total':<{width}}  {total * 1000:7.1f} ms"])
