"""Scale-out: two worker processes on one task queue share the incidents; SIGKILL the one running
an incident's activity mid-incident and the other finishes it, every side effect once."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from temporalio.api.enums.v1 import EventType, PendingActivityState, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle

from drills.faults import activity_starts, job_recovery_started, kill_worker, wait_for_history_point, worker_identities
from drills.localstack import wait_async
from tests.faults.crash_support import Case, check_recovered_once
from tests.integration.conftest import stack_settings

pytestmark = pytest.mark.slurm


async def activity_pollers(client: Client, task_queue: str) -> set[str]:
    """The identities of the workers polling the task queue for activities."""
    described = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
        )
    )
    return {p.identity for p in described.pollers}


async def worker_running_activity(handle: WorkflowHandle, activity_type: str) -> str:
    """The identity of the worker running an attempt of the activity now, or (the attempt already
    over) of the one that started it, as the history records it."""
    for pending in (await handle.describe()).raw_description.pending_activities:
        if (
            pending.activity_type.name == activity_type
            and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
        ):
            return pending.last_worker_identity
    return (await activity_starts(handle, activity_type))[-1].identity


async def test_two_workers_one_killed_mid_incident_the_other_finishes(temporal_env, local_stack, slurm_cluster):
    client = temporal_env.client
    port = int(client.service_client.config.target_host.rsplit(":", 1)[1])
    settings = stack_settings(local_stack, slurm_cluster, f"two-workers-{uuid.uuid4()}")
    case = Case.on(client, dataclasses.replace(local_stack, temporal_port=port), slurm_cluster, settings)
    workers = [dataclasses.replace(case.stack, worker_instance=name) for name in ("a", "b")]
    try:
        # Both workers poll before the incident starts: a worker slow to start would otherwise
        # leave the whole incident to the other, and the kill would find it over.
        for worker in workers:
            worker.start_worker(slurm_cluster)
        pids = {int(w.worker_pidfile.read_text()): w for w in workers}

        async def both_polling() -> bool:
            polling = await activity_pollers(client, settings.task_queue)
            return {p for p in pids if any(i.startswith(f"{p}@") for i in polling)} == set(pids)

        await wait_async(both_polling, 60, "both workers to poll the task queue")
        run = await case.start(workers)
        # The requeue runs in the job's recovery (workflows/job_recovery.py), which the incident joined.
        job_recovery = await job_recovery_started(client, settings.task_queue, run.job_id, 120)
        await wait_for_history_point(job_recovery, "requeue_job", "started", 120)
        running = await worker_running_activity(job_recovery, "requeue_job")
        victim = int(running.split("@", 1)[0])
        assert victim in pids, (running, pids)
        # Counted before the kill: what the survivor does while the kill is confirmed is "after".
        events_at_kill = len([e async for e in run.handle.fetch_history_events()])
        at_kill = (await run.handle.describe()).raw_description
        kill_worker(pids[victim])
        pending = [(p.activity_type.name, PendingActivityState.Name(p.state)) for p in at_kill.pending_activities]
        state_at_kill = f"{WorkflowExecutionStatus(at_kill.workflow_execution_info.status).name}, pending {pending}"
        (survivor,) = set(pids) - {victim}
        print(f"workers {sorted(pids)}: {victim} killed while running requeue_job, {survivor} goes on")
        result = await case.drill.finish(run, 300)
    finally:
        await case.end(workers)
    await check_recovered_once(case, run, result, f"worker {victim} of {sorted(pids)} killed during requeue_job")
    after_kill, last_task = [], ""
    async for event in run.handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            last_task = event.workflow_task_completed_event_attributes.identity
            if event.event_id > events_at_kill:
                after_kill.append((event.event_id, "workflow task", last_task))
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED and event.event_id > events_at_kill:
            after_kill.append((event.event_id, "activity", event.activity_task_started_event_attributes.identity))
    why = (
        f"victim {victim}, survivor {survivor}, incident {state_at_kill} and {events_at_kill} events at the "
        f"kill; after it: {after_kill}"
    )
    assert state_at_kill.startswith("RUNNING"), why
    assert any(i.startswith(f"{survivor}@") for _, _, i in after_kill), why
    assert last_task.startswith(f"{survivor}@"), why
    assert any(i.startswith(f"{victim}@") for i in await worker_identities(job_recovery))
