"""Fault injection on the local stack: crash the worker, the Temporal dev server, slurmctld or a
node's slurmd at a chosen point of an incident. Tests and game-day scenarios use it; nothing here
changes the system under test, it only breaks the real processes it runs on.

    await wait_for_history_point(handle, "mark_node_down", "started", timeout=60)
    pid = kill_worker(stack)         # SIGKILL the stack's worker process, return its pid
    restart_temporal(stack)          # kill -9 the dev server, start it again on the same sqlite file
    restart_slurmctld(stack, cluster)  # stop slurmctld, start it again on its saved state
    kill_slurmd(stack, "gpu-5")      # a node's death: its slurmd and jobs (start_slurm revives it)
    await worker_identities(handle)  # who did the incident's work: "<pid>@<host>" of each worker

Points of an activity, as `wait_for_history_point` reads them:
- "scheduled": the workflow task that schedules the activity is done (the boundary before the step);
- "started": an attempt runs on a worker now. Temporal writes ActivityTaskStarted into the history
  only when that attempt ends, so a running attempt is read from the workflow's pending
  activities (DescribeWorkflowExecution, polled every 10 ms); an attempt that already ended
  counts too;
- "completed": the activity completed.
"scheduled" and "completed" are read from a long poll of the history, within milliseconds of the
event. Still, the caller acts after the point is seen: an activity of a few milliseconds may have
gone further by then, which is why tests check Slurm's and Temporal's records, not the moment.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Literal

from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from drills.localstack import LocalStack, StackError, _wait_for, running_pid, wait_async
from workflows.job_recovery import job_recovery_workflow_id

HistoryPoint = Literal["scheduled", "started", "completed"]
_POLL_SECONDS = 0.01
# The incident's steps that its job's recovery runs (workflows/job_recovery.py): their points are
# in that workflow's history.
JOB_RECOVERY_ACTIVITIES = frozenset({"requeue_job", "verify_restart"})


async def job_recovery_started(client: Client, task_queue: str, job_id: int, timeout: float) -> WorkflowHandle:
    """The recovery of the job (where its requeue and verification run), once it has started."""
    handle = client.get_workflow_handle(job_recovery_workflow_id(task_queue, job_id))

    async def started() -> bool:
        try:
            return bool((await handle.describe()).run_id)
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return False
            raise

    await wait_async(started, timeout, f"{handle.id} to start")
    return handle


async def wait_for_history_point(
    handle: WorkflowHandle, activity_type: str, point: HistoryPoint, timeout: float
) -> None:
    """Returns once the incident reached `point` of an activity of `activity_type` (see above)."""
    if point not in ("scheduled", "started", "completed"):
        raise ValueError(f"unknown point {point!r}: scheduled, started or completed")
    what = f"{activity_type} {point} in {handle.id}"
    if point == "started":

        async def started() -> bool:
            return await _attempt_running(handle, activity_type) or "started" in await _points_in_history(
                handle, activity_type
            )

        await wait_async(started, timeout, what, interval=_POLL_SECONDS)
        return
    try:
        # A long poll: the server sends each event as it is written, so the caller acts within
        # milliseconds of the point.
        await asyncio.wait_for(_history_reaches(handle, activity_type, point, what), timeout)
    except asyncio.TimeoutError:
        raise StackError(f"timed out after {timeout:.0f} s waiting for {what}") from None


async def _history_reaches(handle: WorkflowHandle, activity_type: str, point: str, what: str) -> None:
    # The long poll may also end while the workflow runs on: then read again, from the start.
    while True:
        scheduled: set[int] = set()
        async for event in handle.fetch_history_events(wait_new_event=True):
            if _event_point(event, activity_type, scheduled) == point:
                return
        status = (await handle.describe()).status
        if status != WorkflowExecutionStatus.RUNNING:
            raise StackError(f"{handle.id} ended ({status.name if status else 'unknown'}) before {what}")


async def _attempt_running(handle: WorkflowHandle, activity_type: str) -> bool:
    pending = (await handle.describe()).raw_description.pending_activities
    return any(
        p.activity_type.name == activity_type and p.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
        for p in pending
    )


async def _points_in_history(handle: WorkflowHandle, activity_type: str) -> set[str]:
    scheduled: set[int] = set()
    return {_event_point(event, activity_type, scheduled) async for event in handle.fetch_history_events()} - {None}


def _event_point(event: HistoryEvent, activity_type: str, scheduled: set[int]) -> str | None:
    """The point of an activity of `activity_type` this event is, if any; `scheduled` collects
    the ids of their ActivityTaskScheduled events, read in order."""
    if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
        if event.activity_task_scheduled_event_attributes.activity_type.name == activity_type:
            scheduled.add(event.event_id)
            return "scheduled"
    elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
        if event.activity_task_started_event_attributes.scheduled_event_id in scheduled:
            return "started"
    elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
        if event.activity_task_completed_event_attributes.scheduled_event_id in scheduled:
            return "completed"
    else:
        # A local activity (the fence's, since fence-in-one-task) has no other events: its marker,
        # written with its workflow task, says it completed.
        marker = local_activity_marker(event)
        if marker is not None and marker.get("activity_type") == activity_type:
            return "completed"
    return None


def local_activity_marker(event: HistoryEvent) -> dict | None:
    """What Temporal's core records of a local activity in its marker (activity_type,
    complete_time, attempt, ...), if the event is one."""
    if event.event_type != EventType.EVENT_TYPE_MARKER_RECORDED:
        return None
    marker = event.marker_recorded_event_attributes
    data = marker.details["data"].payloads if marker.marker_name == "core_local_activity" else []
    return json.loads(data[0].data) if data else None


async def activity_starts(handle: WorkflowHandle, activity_type: str) -> list:
    """The started events (ActivityTaskStartedEventAttributes) of the activity's attempts, in
    history order; an attempt's event is written when it ends, so a running one is not there."""
    scheduled, started = set(), []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            if event.activity_task_scheduled_event_attributes.activity_type.name == activity_type:
                scheduled.add(event.event_id)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            if event.activity_task_started_event_attributes.scheduled_event_id in scheduled:
                started.append(event.activity_task_started_event_attributes)
    return started


async def worker_identities(handle: WorkflowHandle) -> set[str]:
    """The identities ("<pid>@<host>") of the workers that completed a workflow task of the
    incident or started one of its activities."""
    identities = set()
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            identities.add(event.workflow_task_completed_event_attributes.identity)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            identities.add(event.activity_task_started_event_attributes.identity)
    return identities


def kill_worker(stack: LocalStack) -> int:
    """SIGKILL the stack's worker process (its pid file); returns its pid once it is gone."""
    pid = _running(stack.worker_pidfile, "worker")
    os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: not stack.worker_running(), 10, f"the end of worker {pid}")
    return pid


def restart_temporal(stack: LocalStack) -> None:
    """kill -9 the stack's dev server, then start it again on the same sqlite file; returns once
    its frontend answers."""
    pid = _running(stack.temporal_pidfile, "Temporal dev server")
    os.kill(pid, signal.SIGKILL)
    _wait_for(lambda: not stack.temporal_running(), 15, f"the end of the Temporal dev server {pid}")
    stack.start_temporal()
    _wait_for(lambda: _temporal_serving(stack), 60, "the restarted Temporal dev server")


def _running(pidfile: Path, what: str) -> int:
    """The pid of the stack's process that the pid file names; never another's that took its pid."""
    pid = running_pid(pidfile)
    if pid is None:
        raise StackError(f"no {what} of this stack is running ({pidfile})")
    return pid


def _temporal_serving(stack: LocalStack) -> bool:
    result = subprocess.run(
        [stack.temporal_binary, "operator", "cluster", "health", "--address", stack.temporal_address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return result.returncode == 0 and "SERVING" in result.stdout


def restart_slurmctld(stack: LocalStack, cluster: dict[str, str]) -> None:
    """Stop slurmctld (as a controller restart does: SIGTERM, SIGKILL after 10 s) and start it
    again on the same configuration and saved state; returns once the cluster's own clients
    reach it."""
    stack.restart_slurmctld()

    def answers() -> bool:
        ping = subprocess.run(
            ["scontrol", "ping"], env=stack.slurm_cli_env(cluster), capture_output=True, text=True, timeout=30
        )
        return "is UP" in ping.stdout

    _wait_for(answers, 30, "the restarted slurmctld")


def kill_slurmd(stack: LocalStack, node: str) -> None:
    """A node's death: its slurmd and its jobs are SIGKILLed. stack.start_slurm() brings it back."""
    stack.kill_node(node)
