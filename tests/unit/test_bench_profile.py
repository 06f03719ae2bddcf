"""Where an incident's time goes and what it asks of the server, read from its history."""

import json
from datetime import datetime, timedelta, timezone

from temporalio.api.common.v1 import ActivityType, Payload
from temporalio.api.enums.v1 import EventType, TaskQueueKind, TimeoutType
from temporalio.api.history.v1 import (
    ActivityTaskCompletedEventAttributes,
    ActivityTaskScheduledEventAttributes,
    ActivityTaskStartedEventAttributes,
    HistoryEvent,
    MarkerRecordedEventAttributes,
    WorkflowTaskScheduledEventAttributes,
    WorkflowTaskStartedEventAttributes,
    WorkflowTaskTimedOutEventAttributes,
)
from temporalio.api.taskqueue.v1 import TaskQueue

from bench.profile import WorkflowTaskWaits, history_counts, timeline

SINCE = datetime(2026, 11, 30, tzinfo=timezone.utc)


class History:
    """A history written event by event, `ms` after SINCE."""

    def __init__(self) -> None:
        self.events: list[HistoryEvent] = []

    def add(self, ms: float, event_type: EventType.ValueType, **attributes) -> int:
        event = HistoryEvent(event_id=len(self.events) + 1, event_type=event_type, **attributes)
        event.event_time.FromDatetime(SINCE + timedelta(milliseconds=ms))
        self.events.append(event)
        return event.event_id

    def scheduled(self, ms: float, name: str) -> int:
        return self.add(
            ms,
            EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
            activity_task_scheduled_event_attributes=ActivityTaskScheduledEventAttributes(
                activity_type=ActivityType(name=name)
            ),
        )

    def local(self, recorded_ms: float, name: str, completed_ms: float) -> None:
        """A local activity's marker as core writes it, recorded with its workflow task."""
        done = SINCE + timedelta(milliseconds=completed_ms)
        data = {
            "seq": len(self.events),
            "attempt": 1,
            "activity_type": name,
            "complete_time": {"seconds": int(done.timestamp()), "nanos": done.microsecond * 1000},
        }
        marker = MarkerRecordedEventAttributes(marker_name="core_local_activity")
        marker.details["data"].payloads.append(Payload(data=json.dumps(data).encode()))
        self.add(recorded_ms, EventType.EVENT_TYPE_MARKER_RECORDED, marker_recorded_event_attributes=marker)

    def ran(self, started_ms: float, completed_ms: float, scheduled_id: int) -> None:
        self.add(
            started_ms,
            EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED,
            activity_task_started_event_attributes=ActivityTaskStartedEventAttributes(scheduled_event_id=scheduled_id),
        )
        self.add(
            completed_ms,
            EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
            activity_task_completed_event_attributes=ActivityTaskCompletedEventAttributes(
                scheduled_event_id=scheduled_id
            ),
        )


def test_steps_one_after_another():
    history = History()
    drain = history.scheduled(30, "drain_node")
    history.ran(31, 70, drain)
    signal = history.scheduled(95, "signal_job")
    history.ran(95, 120, signal)

    assert [(name, round(s * 1000)) for name, s in timeline(history.events, SINCE, "signal_job")] == [
        ("workflow task -> drain_node", 30),
        ("drain_node in the task queue", 1),
        ("drain_node at the worker", 39),
        ("workflow task -> signal_job", 25),
        ("signal_job in the task queue", 0),
        ("signal_job at the worker", 25),
    ]


def test_activities_scheduled_together_each_wait_from_the_same_end():
    """Two reads scheduled by one workflow task, the later-scheduled one ending first: each waited
    for that task from the drain's end, none a negative time."""
    history = History()
    drain = history.scheduled(30, "drain_node")
    history.ran(30, 70, drain)
    shares = history.scheduled(90, "partition_shares")
    jobs = history.scheduled(90, "find_jobs")
    history.ran(90, 110, jobs)
    history.ran(90, 130, shares)
    lease = history.scheduled(150, "request_lease")
    history.ran(150, 160, lease)

    segments = dict(timeline(history.events, SINCE, "request_lease"))
    assert round(segments["workflow task -> find_jobs"] * 1000) == 20
    assert round(segments["workflow task -> partition_shares"] * 1000) == 20
    assert round(segments["workflow task -> request_lease"] * 1000) == 20  # from the later of the two ends
    assert all(seconds >= 0 for seconds in segments.values())


def test_the_timeline_stops_at_the_last_awaited_occurrence():
    history = History()
    for ms in (10, 40):
        history.ran(ms, ms + 5, history.scheduled(ms, "signal_job"))
    history.ran(80, 90, history.scheduled(80, "requeue_job"))

    names = [name for name, _ in timeline(history.events, SINCE, "signal_job", occurrences=2)]
    assert names.count("signal_job at the worker") == 2 and "requeue_job at the worker" not in names


def test_history_counts_each_kind_of_event():
    history = History()
    history.add(0, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
    history.add(1, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
    history.add(2, EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)
    history.add(2, EventType.EVENT_TYPE_MARKER_RECORDED)
    history.add(2, EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES)
    history.ran(3, 4, history.scheduled(2, "drain_node"))
    history.add(5, EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)

    counts = history_counts(history.events)
    assert counts["events"] == 9
    assert counts["workflow tasks"] == 2 and counts["activities"] == 1 and counts["signals received"] == 1
    assert counts["local activities and patches (markers)"] == 1 and counts["search attribute upserts"] == 1
    assert counts["timers"] == 0 and counts["child workflows"] == 0


def test_local_activities_count_from_the_last_end_before_they_completed():
    """The fence's local activities, in the first workflow task: drain, then the jobs and the
    partitions read together (the later-recorded one ending first), then the lease asked; the
    signal in the next task. Each counts from the last end before its own completion, none a
    negative time, and the timeline stops at the signal."""
    history = History()
    for name, done_ms in (("drain_node", 35), ("partition_shares", 50), ("find_jobs", 49), ("request_lease", 60)):
        history.local(100, name, done_ms)
    history.local(160, "signal_job", 130)
    history.ran(170, 180, history.scheduled(165, "requeue_job"))

    assert [(name, round(s * 1000)) for name, s in timeline(history.events, SINCE, "signal_job")] == [
        ("drain_node, local activity", 35),
        ("partition_shares, local activity", 15),
        ("find_jobs, local activity", 14),
        ("request_lease, local activity", 10),
        ("signal_job, local activity", 70),
    ]


def test_a_local_activity_done_before_the_clock_started_counts_nothing():
    history = History()
    history.local(5, "classify_fault", -2)
    history.local(5, "drain_node", 30)

    assert [(name, round(s * 1000)) for name, s in timeline(history.events, SINCE, "drain_node")] == [
        ("classify_fault, local activity", 0),
        ("drain_node, local activity", 30),
    ]


def _workflow_task_scheduled(history: History, ms: float, kind: TaskQueueKind.ValueType) -> int:
    return history.add(
        ms,
        EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED,
        workflow_task_scheduled_event_attributes=WorkflowTaskScheduledEventAttributes(
            task_queue=TaskQueue(name="q", kind=kind)
        ),
    )


def _workflow_task_started(history: History, ms: float, scheduled_id: int) -> None:
    history.add(
        ms,
        EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
        workflow_task_started_event_attributes=WorkflowTaskStartedEventAttributes(scheduled_event_id=scheduled_id),
    )


def _workflow_task_timed_out(history: History, ms: float, scheduled_id: int, timeout: TimeoutType.ValueType) -> None:
    history.add(
        ms,
        EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT,
        workflow_task_timed_out_event_attributes=WorkflowTaskTimedOutEventAttributes(
            scheduled_event_id=scheduled_id, timeout_type=timeout
        ),
    )


def test_workflow_task_waits_count_the_queue_each_task_waited_in():
    history = History()
    _workflow_task_started(history, 5, _workflow_task_scheduled(history, 0, TaskQueueKind.TASK_QUEUE_KIND_NORMAL))
    history.add(10, EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)
    # Left on the sticky queue past its time-out, then taken from the normal queue 3 s later.
    left = _workflow_task_scheduled(history, 100, TaskQueueKind.TASK_QUEUE_KIND_STICKY)
    _workflow_task_timed_out(history, 2100, left, TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START)
    _workflow_task_started(history, 5100, _workflow_task_scheduled(history, 2100, TaskQueueKind.TASK_QUEUE_KIND_NORMAL))
    history.add(5120, EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)
    # Taken from the sticky queue at once, then timed out at the worker.
    slow = _workflow_task_scheduled(history, 6000, TaskQueueKind.TASK_QUEUE_KIND_STICKY)
    _workflow_task_started(history, 6001, slow)
    _workflow_task_timed_out(history, 16001, slow, TimeoutType.TIMEOUT_TYPE_START_TO_CLOSE)

    waits = WorkflowTaskWaits()
    waits.add(history.events)
    waits.add(history.events[:2])  # a second run of the workflow adds to the first

    assert waits.waits == [0.005, 3.0, 0.001, 0.005]
    assert (waits.on_sticky_queue, waits.left_the_sticky_queue, waits.timed_out_at_the_worker) == (2, 1, 1)
    assert (
        "4 started (2 scheduled on the worker's sticky queue, 1 of them timed out there unstarted; "
        "1 timed out at the worker), waited in a task queue p50 5 ms, p99 3000 ms, max 3000 ms" == waits.summary()
    )


def test_workflow_task_waits_without_a_task():
    assert WorkflowTaskWaits().summary() == "no workflow task started"
