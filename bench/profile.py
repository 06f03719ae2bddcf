"""Where an incident's time goes, from its Temporal history: for each activity, the wait for the
workflow task that schedules it, its time in the server's task queue, and its time at the worker
(delivery to the worker, the run, the completion's way back). And what an incident asks of the
server, counted from its history: the same in every run, whatever else the machine is doing."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone

from temporalio.api.enums.v1 import EventType, TaskQueueKind, TimeoutType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHandle

from bench.table import median, percentile
from drills.faults import local_activity_marker


async def activity_timeline(
    handle: WorkflowHandle, since: datetime, until_activity: str, occurrences: int = 1
) -> list[tuple[str, float]]:
    """timeline() of the run's history."""
    return timeline(await history_of(handle), since, until_activity, occurrences)


async def history_of(handle: WorkflowHandle) -> list[HistoryEvent]:
    return [event async for event in handle.fetch_history_events()]


def timeline(
    events: Iterable[HistoryEvent], since: datetime, until_activity: str, occurrences: int = 1
) -> list[tuple[str, float]]:
    """(segment, seconds) from `since` until the `occurrences`-th completion of `until_activity`.

    Segments: "workflow task -> NAME" (from the end of the last activity completed before NAME
    was scheduled, or `since`, until NAME is scheduled: the workflow tasks in between; activities
    scheduled together each count from that same end), "NAME in the task queue" (scheduled to started, as
    the server saw it), "NAME at the worker" (started to completed: a busy worker shows here).
    A local activity has one: "NAME, local activity" (from the last end before it completed to its
    completion, as the worker recorded it: any workflow task in between, then its run)."""
    scheduled: dict[int, tuple[str, datetime, datetime]] = {}  # name, scheduled at, the previous end then
    started: dict[int, datetime] = {}
    segments: list[tuple[str, float]] = []
    ends, seen = [since], 0  # every activity's end so far
    for event in events:
        at = event.event_time.ToDatetime().replace(tzinfo=since.tzinfo)
        local = local_activity_marker(event)
        completed = None
        if local is not None:
            completed, done = local["activity_type"], _timestamp(local["complete_time"])
            # One done before the clock started (the first task can finish before the alert's
            # hand-over returns to its sender) counts nothing.
            start = max((end for end in ends if end <= done), default=done)
            segments.append((f"{completed}, local activity", (done - start).total_seconds()))
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            name = event.activity_task_scheduled_event_attributes.activity_type.name
            scheduled[event.event_id] = (name, at, max(ends))
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            started[event.activity_task_started_event_attributes.scheduled_event_id] = at
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            scheduled_id = event.activity_task_completed_event_attributes.scheduled_event_id
            completed, scheduled_at, end_before = scheduled[scheduled_id]
            started_at = started.get(scheduled_id, scheduled_at)
            segments += [
                (f"workflow task -> {completed}", (scheduled_at - end_before).total_seconds()),
                (f"{completed} in the task queue", (started_at - scheduled_at).total_seconds()),
                (f"{completed} at the worker", (at - started_at).total_seconds()),
            ]
            done = at
        if completed is None:
            continue
        ends.append(done)
        if completed == until_activity:
            seen += 1
            if seen == occurrences:
                break
    return segments


def _timestamp(value: dict) -> datetime:
    """A protobuf Timestamp as core's marker data writes it in JSON."""
    return datetime.fromtimestamp(value["seconds"] + value.get("nanos", 0) / 1e9, tz=timezone.utc)


# What the server does for an incident, by the history events that record it.
HISTORY_KINDS = {
    "workflow tasks": EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED,
    "activities": EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
    "local activities and patches (markers)": EventType.EVENT_TYPE_MARKER_RECORDED,
    "search attribute upserts": EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES,
    "signals received": EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
    "signals sent": EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED,
    "child workflows": EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED,
    "timers": EventType.EVENT_TYPE_TIMER_STARTED,
}


def history_counts(events: Iterable[HistoryEvent]) -> dict[str, int]:
    """The history's events in all, and those of each of HISTORY_KINDS."""
    kinds = {event_type: name for name, event_type in HISTORY_KINDS.items()}
    counts = dict.fromkeys(["events", *HISTORY_KINDS], 0)
    for event in events:
        counts["events"] += 1
        if event.event_type in kinds:
            counts[kinds[event.event_type]] += 1
    return counts


@dataclass
class WorkflowTaskWaits:
    """A workflow's tasks as the server recorded them: how long each waited in a task queue
    before a worker took it (scheduled to started), and where. A worker keeps a run it has in its
    cache on a sticky queue of its own; a task left there unstarted past the sticky queue's
    schedule-to-start timeout times out and is scheduled again on the workflow's task queue,
    behind every other task waiting there."""

    waits: list[float] = field(default_factory=list)  # seconds, one per started task
    on_sticky_queue: int = 0
    left_the_sticky_queue: int = 0  # timed out unstarted on the sticky queue
    timed_out_at_the_worker: int = 0  # started, not completed within the task's time-out

    def add(self, events: Iterable[HistoryEvent]) -> None:
        scheduled: dict[int, datetime] = {}
        for event in events:
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
                scheduled[event.event_id] = event.event_time.ToDatetime()
                if (
                    event.workflow_task_scheduled_event_attributes.task_queue.kind
                    == TaskQueueKind.TASK_QUEUE_KIND_STICKY
                ):
                    self.on_sticky_queue += 1
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                at = scheduled.get(event.workflow_task_started_event_attributes.scheduled_event_id)
                if at is not None:
                    self.waits.append((event.event_time.ToDatetime() - at).total_seconds())
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
                if (
                    event.workflow_task_timed_out_event_attributes.timeout_type
                    == TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START
                ):
                    self.left_the_sticky_queue += 1
                else:
                    self.timed_out_at_the_worker += 1

    def summary(self) -> str:
        if not self.waits:
            return "no workflow task started"
        return (
            f"{len(self.waits)} started ({self.on_sticky_queue} scheduled on the worker's sticky queue, "
            f"{self.left_the_sticky_queue} of them timed out there unstarted; {self.timed_out_at_the_worker} "
            f"timed out at the worker), waited in a task queue p50 {percentile(self.waits, 0.5) * 1000:.0f} ms, "
            f"p99 {percentile(self.waits, 0.99) * 1000:.0f} ms, max {max(self.waits) * 1000:.0f} ms"
        )


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
    # Activities run at once overlap: then the sum is more than the time they took.
    return "\n".join([*lines, f"    {'sum':<{width}}  {total * 1000:7.1f} ms"])
