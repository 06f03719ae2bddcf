"""Scale-out: two worker processes on one task queue share the incidents; SIGKILL the one running
an incident's activity mid-incident and the other finishes it, every side effect once."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from temporalio.api.enums.v1 import EventType, PendingActivityState, TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowHandle

from starter.faults import activity_starts, kill_worker, wait_for_history_point, worker_identities
from starter.localstack import wait_async
from tests.faults.crash_support import Case, check_recovered_once
from tests.integration.conftest import stack_settings

pytestmark = pytest.mark.slurm


async def activity_pollers(client: Client, task_queue: str) -> set[str]:
    """The identities of the workers polling the task queue for activities."""
    described = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace=client.namespace, task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY))
    return {p.identity for p in described.pollers}


async def worker_running_activity(handle: WorkflowHandle, activity_type: str) -> str:
    """The identity of the worker running an attempt of the activity now, or (the attempt already
    over) of the one that started it, as the incident's history records it."""
    for pending in (await handle.describe()).raw_description.pending_activities:
        if pending.activity_type.name == activity_type and pending.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED:
            return pending.last_worker_identity
    return (await activity_starts(handle, activity_type))[-1].identity


@pytest.mark.skip(reason="KNOWN FAILURE, to fix first (issue #8 note): passes alone on both generations, but in "
                         "the full suite (22.05) the history showed no task by the surviving worker after the kill")
async def test_two_workers_one_killed_mid_incident_the_other_finishes(temporal_env, local_stack, slurm_cluster):
    client = temporal_env.client
    port = int(client.service_client.config.target_host.rsplit(":", 1)[1])
    settings = stack_settings(local_stack, slurm_cluster, f"two-workers-{uuid.uuid4()}")
    case = Case.on(client, dataclasses.replace(local_stack, temporal_port=port), slurm_cluster, settings)
    workers = [dataclasses.replace(case.stack, worker_instance=name) for name in ("a", "b")]
    try:
        run = await case.start(workers)
        pids = {int(w.worker_pidfile.read_text()): w for w in workers}

        async def both_polling() -> bool:
            polling = await activity_pollers(client, settings.task_queue)
            return {p for p in pids if any(i.startswith(f"{p}@") for i in polling)} == set(pids)

        await wait_async(both_polling, 60, "both workers to poll the task queue")
        await wait_for_history_point(run.handle, "requeue_job", "started", 120)
        running = await worker_running_activity(run.handle, "requeue_job")
        victim = int(running.split("@", 1)[0])
        assert victim in pids, (running, pids)
        kill_worker(pids[victim])
        events_at_kill = len([e async for e in run.handle.fetch_history_events()])
        (survivor,) = set(pids) - {victim}
        print(f"workers {sorted(pids)}: {victim} killed while running requeue_job, {survivor} goes on")
        result = await case.drill.finish(run, 300)
    finally:
        await case.end(workers)
    await check_recovered_once(case, run, result, f"worker {victim} of {sorted(pids)} killed during requeue_job")
    after_kill, last_task = set(), ""
    async for event in run.handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            last_task = event.workflow_task_completed_event_attributes.identity
            if event.event_id > events_at_kill:
                after_kill.add(last_task)
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED and event.event_id > events_at_kill:
            after_kill.add(event.activity_task_started_event_attributes.identity)
    assert any(i.startswith(f"{survivor}@") for i in after_kill), (victim, survivor, after_kill)
    assert last_task.startswith(f"{survivor}@"), (victim, survivor, last_task)
    assert any(i.startswith(f"{victim}@") for i in await worker_identities(run.handle))

