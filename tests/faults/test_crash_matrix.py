"""The crash matrix on the real local stack: the worker SIGKILLed at every step boundary and in
the middle of the long steps, the Temporal dev server killed -9 and restarted on its sqlite file,
slurmctld restarted mid-step, the spare's slurmd killed while the incident waits for it, the
worker killed while it delivers a notification, and (Slurm on Kubernetes) while it evicts the slurmd pod.

A crash of the worker, the dev server or slurmctld must cost time, never the recovery: the
incident ends recovered, each side effect done once as Slurm records it: one requeue (the job's
own restart count, slurmctld's log), one drain (slurmctld's log), one spare claimed and resumed
(its claim comment, slurmctld's log). A worker killed inside a step that does not heartbeat
costs that step's start-to-close timeout (30 s) before another worker retries it. A spare that
died is never reported as a recovery: the incident ends spare_unhealthy (or no_replacement).

The incidents run against a dev server of this module (tests/faults/conftest.py), so that it
can be killed without touching the session's. The worker-kill cases run on the host's Slurm
generation only, the dev-server, slurmctld and slurmd cases on the other one: every case on both
would take twice the ~8 minutes this module may take.
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from drills.drill import SimulatedKubernetes
from drills.faults import (
    JOB_RECOVERY_ACTIVITIES,
    activity_starts,
    job_recovery_started,
    kill_slurmd,
    restart_slurmctld,
    restart_temporal,
    wait_for_history_point,
    worker_identities,
)
from drills.localstack import wait_async
from tests.conftest import NEWEST_GENERATION
from tests.faults.crash_support import Case, check_recovered_once
from tests.integration.conftest import stack_settings
from tests.integration.test_incident_safety import WebhookReceiver
from workflows.spare_claim import spare_claim_workflow_id

# Every case on the newest generation (each older one keeps the worker's crash in
# test_timeline_after_crash.py): the local_stack parameter says so, as the case fixture needs it.
pytestmark = pytest.mark.slurm

INCIDENT_SECONDS = 300
# Where the worker dies. "scheduled": as soon as the step's activity is scheduled, which in
# practice lands inside the step (the attempt just handed to the worker, its Slurm calls under
# way); "completed": as soon as the step's activity completed, between two steps (for a local
# activity, once its workflow task is done: its marker is written then); "started": inside a step
# that takes long enough to be caught running; DRAINED: as soon as Slurm shows the node drained
# by the incident, inside its first workflow task (the fence's local activities under way, none
# recorded yet). The test prints where each kill landed (the activity pending then, and its state).
# (The fence up to the first signal is local activities since the fence-in-one-task patch: classify,
# drain, the jobs and partitions read and the lease asked in the first workflow task, the jobs
# signalled in that task too when the budget grants the lease in its update's reply, else in the
# one that hears the grant by signal. request_replacement runs in the spare's claim,
# a child workflow: its points are read in that child's history.)
DRAINED = "drained in Slurm"
# Started, its alert signalled, its first workflow task scheduled and started: nothing recorded yet.
FIRST_TASK_OPEN = 4
POINTS = [
    ("drain_node", DRAINED),
    ("request_lease", "completed"),
    ("signal_job", "completed"),
    ("requeue_job", "scheduled"),
    ("mark_node_down", "scheduled"),
    ("request_replacement", "scheduled"),
    ("wait_for_spare", "scheduled"),
    ("verify_restart", "scheduled"),
    ("verify_restart", "started"),
    ("record_incident", "scheduled"),
]


async def history_of(case: Case, activity: str) -> WorkflowHandle:
    """The workflow that runs the activity: the incident, but for request_replacement, which runs
    in the incident's claim of the first spare (a child workflow: workflows/spare_claim.py), and
    the requeue and the verification, which run in its job's recovery (workflows/job_recovery.py)."""
    assert case.run is not None
    if activity in JOB_RECOVERY_ACTIVITIES:
        return await job_recovery_started(case.drill.client, case.stack.task_queue, case.run.job_id, 120)
    if activity != "request_replacement":
        return case.run.handle
    claim = case.drill.client.get_workflow_handle(
        spare_claim_workflow_id(case.stack.task_queue, case.drill.spare_nodes[0])
    )

    async def started() -> bool:
        try:
            return (await claim.describe()).run_id is not None
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return False
            raise

    await wait_async(started, 120, f"{claim.id} to start")
    return claim


async def drained_by_an_incident(case: Case, node: str) -> bool:
    found = await case.drill.slurm.get_node(node)
    return found.drained and "incident " in found.reason


@pytest.mark.parametrize("local_stack", [NEWEST_GENERATION], indirect=True)
@pytest.mark.parametrize(("activity", "point"), POINTS, ids=lambda v: v)
async def test_worker_killed_at_each_point_the_next_worker_finishes(case, activity, point):
    run = await case.start()
    if point == DRAINED:
        await wait_async(lambda: drained_by_an_incident(case, run.node), 120, f"{run.node} drained", interval=0.01)
    else:
        await wait_for_history_point(await history_of(case, activity), activity, point, 120)
    killed, second = case.restart_worker()
    at_kill = (await run.handle.describe()).raw_description
    open_at_kill = at_kill.workflow_execution_info.status == WorkflowExecutionStatus.RUNNING
    pending = [f"{p.activity_type.name} {PendingActivityState.Name(p.state)}" for p in at_kill.pending_activities]
    where = (
        f"worker {killed} killed at {activity} {point} (pending then: {pending or 'none'}; "
        f"{at_kill.workflow_execution_info.history_length} events in the history)"
    )
    print(where)
    result = await case.drill.finish(run, INCIDENT_SECONDS)
    await check_recovered_once(case, run, result, where)
    identities = await worker_identities(run.handle)
    if point == DRAINED and at_kill.workflow_execution_info.history_length <= FIRST_TASK_OPEN:
        # Killed inside the incident's first workflow task: nothing of the killed worker is in
        # the history, its drain is in Slurm. The next worker ran the task again, with the same
        # incident id, and found the node fenced by this incident (drained once: checked above).
        drain = next(a for a in result.report.actions if a.action == "drain_node")
        assert "already done by this incident" in drain.detail, (where, drain)
    else:
        assert any(i.startswith(f"{killed}@") for i in identities), (where, identities)
    # The incident ends with its metrics recorded: only a kill there can come too late for the second worker.
    if activity != "record_incident":
        assert open_at_kill, f"{where}: the incident had ended before the kill"
    if open_at_kill:
        assert any(i.startswith(f"{second}@") for i in identities), (where, identities)


@pytest.mark.parametrize("local_stack", [NEWEST_GENERATION], indirect=True)
async def test_dev_server_killed_and_restarted_mid_incident(case, crash_temporal):
    """kill -9 of the dev server while a job is being requeued; restarted on the same sqlite
    file, it still has the incident, and the same worker finishes it."""
    server, _ = crash_temporal
    run = await case.start()
    await wait_for_history_point(await history_of(case, "requeue_job"), "requeue_job", "started", 120)
    worker = int(case.stack.worker_pidfile.read_text())
    restart_temporal(server)
    result = await case.drill.finish(run, INCIDENT_SECONDS)
    where = "dev server restarted during requeue_job"
    await check_recovered_once(case, run, result, where)
    assert case.stack.worker_running() and int(case.stack.worker_pidfile.read_text()) == worker


@pytest.mark.parametrize("local_stack", [NEWEST_GENERATION], indirect=True)
async def test_slurmctld_restarted_mid_requeue(case):
    """slurmctld stops and starts again on its saved state while a job is being requeued: the
    step's Slurm calls fail meanwhile and are retried; the job is requeued once."""
    run = await case.start()
    await wait_for_history_point(await history_of(case, "requeue_job"), "requeue_job", "started", 120)
    restart_slurmctld(case.stack, case.cluster)
    result = await case.drill.finish(run, INCIDENT_SECONDS)
    where = "slurmctld restarted during requeue_job"
    await check_recovered_once(case, run, result, where)


@pytest.mark.parametrize("local_stack", [NEWEST_GENERATION], indirect=True)
async def test_spare_slurmd_killed_before_the_incident_takes_it(case):
    """The hot spare's slurmd dies just before the incident brings the spare in and waits for it:
    the incident must end saying so (spare unhealthy, no replacement), never "recovered" with a
    dead spare; the jobs were moved all the same, once. The slurmd is started again after."""
    spare = case.drill.spare_nodes[0]
    case.drill.policy = case.drill.policy.model_copy(update={"spare_wait_seconds": 20})
    run = await case.start()
    try:
        await wait_for_history_point(await history_of(case, "requeue_job"), "requeue_job", "scheduled", 120)
        kill_slurmd(case.stack, spare)
        result = await case.drill.finish(run, INCIDENT_SECONDS)
    finally:
        case.stack.start_slurm()  # the spare's slurmd again, on standby
    r = result.report
    print(f"spare {spare} killed: {r.outcome}")
    assert r.outcome.startswith(("spare_unhealthy: ", "no_replacement: ")), r.model_dump_json(indent=1)
    job = await case.drill.slurm.get_job(result.job_id)
    assert job.restart_count == 1 and run.node not in job.nodes, job


@pytest.mark.parametrize("local_stack", [NEWEST_GENERATION], indirect=True)
async def test_worker_killed_while_it_delivers_a_notification_it_is_delivered_once(
    crash_temporal, local_stack, slurm_cluster, monkeypatch
):
    """The worker dies in the middle of POSTing "incident opened" to a slow webhook: the next
    worker delivers it again (after the delivery's 30 s timeout) with the same Idempotency-Key, so
    a receiver that drops repeats has each notification once; the incident recovers meanwhile."""
    server, client = crash_temporal
    receiver = WebhookReceiver(hold="incident_opened")
    monkeypatch.setenv("RECOVERY_NOTIFY_WEBHOOK_URL", receiver.url)  # the worker process's configuration
    settings = stack_settings(local_stack, slurm_cluster, f"crash-{uuid.uuid4()}", notify_webhook_url=receiver.url)
    case = Case.on(
        client, dataclasses.replace(local_stack, temporal_port=server.temporal_port), slurm_cluster, settings
    )
    try:
        run = await case.start()

        async def held() -> bool:
            return receiver.holding.is_set()

        await wait_async(held, 60, "the first notification at the webhook")
        killed, second = case.restart_worker()
        receiver.held.set()
        result = await case.drill.finish(run, INCIDENT_SECONDS)
        await check_recovered_once(case, run, result, f"worker {killed} killed while delivering a notification")

        def posts() -> dict[str, list[str]]:
            keys: dict[str, list[str]] = {}
            for headers, body in receiver.received:
                keys.setdefault(body["kind"], []).append(headers["Idempotency-Key"])
            return keys

        async def delivered_again() -> bool:
            return len(posts().get("incident_opened", [])) == 2 and "recovered" in posts()

        await wait_async(delivered_again, 90, "the notification delivered again by the next worker")
    finally:
        receiver.held.set()
        receiver.shutdown()
        await case.end()
    incident = result.report.incident_id
    assert posts() == {
        "incident_opened": [f"{incident}/incident_opened"] * 2,
        "recovered": [f"{incident}/recovered"],
    }, receiver.received


@pytest.mark.parametrize("local_stack", [NEWEST_GENERATION], indirect=True)
async def test_worker_killed_while_it_evicts_the_slurmd_pod_the_next_one_evicts_it_once(
    crash_temporal, local_stack, slurm_cluster, monkeypatch
):
    """Slurm on Kubernetes: the worker dies while a PodDisruptionBudget keeps refusing (429) the
    slurmd pod's eviction; the next worker takes the step over once the budget allows, and the
    API server sees the pod evicted once; the job is requeued once."""
    server, client = crash_temporal
    settings = stack_settings(local_stack, slurm_cluster, f"crash-{uuid.uuid4()}")
    case = Case.on(
        client, dataclasses.replace(local_stack, temporal_port=server.temporal_port), slurm_cluster, settings
    )
    async with SimulatedKubernetes(case.drill, in_process_worker=False) as kubernetes:
        for name, value in kubernetes.worker_environment().items():  # the worker process's configuration
            monkeypatch.setenv(name, value)
        case.stack = dataclasses.replace(case.stack, task_queue=kubernetes.task_queue, worker_instance="k8s")
        refusals = kubernetes.server.faults.inject("POST", r"/eviction$", status=429, times=None)
        try:
            run = await case.start(kubernetes=kubernetes)
            await wait_for_history_point(run.handle, "release_node", "started", 120)  # the eviction

            async def refused_twice() -> bool:
                return refusals.hits >= 2

            await wait_async(refused_twice, 60, "two refused evictions")
            killed, second = case.restart_worker()
            kubernetes.server.faults.clear()  # the budget allows it now
            result = await case.drill.finish(run, INCIDENT_SECONDS)
            posts = [
                path for method, path in kubernetes.server.requests if method == "POST" and path.endswith("/eviction")
            ]
        finally:
            await case.end()
    r = result.report
    where = f"worker {killed} killed during release_node (the eviction) after {refusals.hits} refusals"
    assert r.outcome == "recovered", f"{where}: {r.model_dump_json(indent=1)}"
    # Refused each time but the last (by the injected 429s, and by Slinky's pod-protect budget while
    # the operator still saw the node busy): every request for this pod, the last one by the second worker.
    assert set(posts) == {f"/api/v1/namespaces/slurm/pods/{r.node}/eviction"}, (where, posts)
    assert len(posts) >= refusals.hits + 1, (where, posts)
    assert [a.path for a in r.actions if a.action == "evict_slurmd_pod"] == ["kubernetes"], where
    evicted_by = (await activity_starts(run.handle, "release_node"))[-1].identity
    assert evicted_by.startswith(f"{second}@"), (where, evicted_by)
    assert any(i.startswith(f"{killed}@") for i in await worker_identities(run.handle)), where
    job = await case.drill.slurm.get_job(result.job_id)
    assert job.restart_count == 1 and r.node not in job.nodes, (where, job)
    assert case.ctld_log_since_start().count(f"Requeuing JobId={result.job_id}\n") == 1, where
    assert result.passed, [c for c in result.checks if not c.passed]
