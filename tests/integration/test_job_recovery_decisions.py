"""JobRecoveryWorkflow's decisions (workflows/job_recovery.py) on the real dev server, with
stand-ins for the two Slurm activities under their real names: the incidents on one job's nodes
share one requeue and one verification, a node that joins during the verification gets the job
requeued off it too and the verification redone, and a failed requeue fails every joined incident.
The real requeue and verification on real Slurm: test_failures_together.py."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import asynccontextmanager

import pytest
from temporalio import activity
from temporalio.client import WithStartWorkflowOperation, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from contracts.models import (
    ActionContext,
    JobJoin,
    JobRecovered,
    JobRequeued,
    JobSnapshot,
    JobVerification,
    RequeueRequest,
    RequeueResult,
    SlurmJob,
    VerifyRequest,
)
from starter.localstack import wait_async
from workflows.job_recovery import JobRecoveryWorkflow, job_recovery_workflow_id

JOB = SlurmJob(job_id=42, state="RUNNING", nodes=["gpu-1", "gpu-2", "gpu-3"], restart_count=0)


class SlurmStandIn:
    """requeue_job and verify_restart as the workflow calls them, recorded; a verification can be
    held until it is cancelled or let go."""

    def __init__(self, fail_requeue: bool = False):
        self.requeues: list[RequeueRequest] = []
        self.verifications: list[VerifyRequest] = []
        self.cancelled_verifications = 0
        self.hold_verification = asyncio.Event()
        self.fail_requeue = fail_requeue

    def activities(self) -> list:
        @activity.defn(name="requeue_job")
        async def requeue_job(req: RequeueRequest) -> RequeueResult:
            self.requeues.append(req)
            if self.fail_requeue:
                raise ApplicationError("scontrol requeuehold: Invalid job id", type="SlurmCommandError",
                                       non_retryable=True)
            return RequeueResult(job_id=req.job.job_id, requeued_now=True, restart_count=req.job.restart_count + 1,
                                 actions=[])

        @activity.defn(name="verify_restart")
        async def verify_restart(req: VerifyRequest) -> JobVerification:
            self.verifications.append(req)
            try:
                while self.hold_verification.is_set():
                    activity.heartbeat()
                    await asyncio.sleep(0.2)
            except asyncio.CancelledError:
                self.cancelled_verifications += 1
                raise
            return JobVerification(job_id=req.snapshot.job.job_id, verified=True,
                                   restart_count_before=req.snapshot.job.restart_count,
                                   restart_count_after=req.expected_restart_count,
                                   nodes_before=req.snapshot.job.nodes, nodes_after=["gpu-7", "gpu-8", "gpu-9"])

        return [requeue_job, verify_restart]


async def until(check, what: str) -> None:
    """Poll a check of the stand-in's record, with a deadline."""
    async def checked():
        return check()
    await wait_async(checked, 30, what, interval=0.05)


class JobRecovery:
    def __init__(self, client, task_queue: str):
        self.client, self.task_queue = client, task_queue
        self.workflow_id = job_recovery_workflow_id(task_queue, JOB.job_id)

    async def join(self, node: str, job: SlurmJob = JOB) -> JobRequeued:
        """An incident's join, as activities/job_recovery.py sends it."""
        incident = f"{node}-20261204T000000Z"
        ctx = ActionContext(incident_id=incident, owner="recovery", actor="pytest", reason=f"XID 79 on {node}", xid=79)
        start = WithStartWorkflowOperation(JobRecoveryWorkflow.run, id=self.workflow_id, task_queue=self.task_queue,
                                           id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING)
        return await self.client.execute_update_with_start_workflow(
            JobRecoveryWorkflow.requeue,
            JobJoin(incident_id=incident, node=node, ctx=ctx, verify_deadline_seconds=60,
                    snapshot=JobSnapshot(job=job, checkpoint_dir=None, latest_complete=None, progress=None)),
            start_workflow_operation=start, id=f"{incident}-job-{job.job_id}")

    async def verify(self, run_id: str) -> JobRecovered:
        handle = self.client.get_workflow_handle_for(JobRecoveryWorkflow.run, self.workflow_id, run_id=run_id)
        await handle.signal(JobRecoveryWorkflow.verify)
        return await handle.result()


@asynccontextmanager
async def job_recovery(env, slurm: SlurmStandIn):
    task_queue = f"job-recovery-{uuid.uuid4()}"
    async with Worker(env.client, task_queue=task_queue, workflows=[JobRecoveryWorkflow],
                      activities=slurm.activities()):
        yield JobRecovery(env.client, task_queue)


def failed_nodes(req: RequeueRequest | VerifyRequest) -> list[str]:
    return req.failed_nodes


async def test_incidents_on_one_job_share_its_requeue_and_its_one_verification(temporal_env):
    slurm = SlurmStandIn()
    async with job_recovery(temporal_env, slurm) as jobs:
        first, second, third = await asyncio.gather(jobs.join("gpu-1"), jobs.join("gpu-2"), jobs.join("gpu-3"))
        assert first.run_id == second.run_id == third.run_id
        # One requeue, or more that add the nodes that joined while one ran.
        assert [failed_nodes(r) for r in slurm.requeues][-1] == ["gpu-1", "gpu-2", "gpu-3"], slurm.requeues
        assert slurm.requeues[0].job.restart_count == 0
        # A repeated join (the incident's activity retried after a crash) is the same request: nothing more.
        requeues = len(slurm.requeues)
        assert await jobs.join("gpu-1") == first and len(slurm.requeues) == requeues
        results = await asyncio.gather(*(jobs.verify(joined.run_id) for joined in (first, second, third)))
        assert results[0] == results[1] == results[2]
        assert len(slurm.verifications) == 1
        assert failed_nodes(slurm.verifications[0]) == ["gpu-1", "gpu-2", "gpu-3"]
        assert slurm.verifications[0].expected_restart_count == slurm.requeues[-1].job.restart_count + 1
        assert [(p.node, p.incident_id) for p in results[0].failed_together] == [
            (node, f"{node}-20261204T000000Z") for node in ("gpu-1", "gpu-2", "gpu-3")]


async def test_a_node_that_joins_during_the_verification_gets_a_requeue_and_the_verification_is_redone(temporal_env):
    slurm = SlurmStandIn()
    slurm.hold_verification.set()
    async with job_recovery(temporal_env, slurm) as jobs:
        first = await jobs.join("gpu-1")
        handle = temporal_env.client.get_workflow_handle(jobs.workflow_id, run_id=first.run_id)
        await handle.signal(JobRecoveryWorkflow.verify)
        await until(lambda: slurm.verifications, "the verification to start")
        late = await jobs.join("gpu-3")
        assert late.run_id == first.run_id
        await until(lambda: slurm.cancelled_verifications == 1, "the first verification to be cancelled")
        slurm.hold_verification.clear()
        recovered = await jobs.verify(late.run_id)
        assert [failed_nodes(r) for r in slurm.requeues] == [["gpu-1"], ["gpu-1", "gpu-3"]]
        # The second requeue counts from the restart the first one left.
        assert [r.job.restart_count for r in slurm.requeues] == [0, 1]
        assert [failed_nodes(v) for v in slurm.verifications] == [["gpu-1"], ["gpu-1", "gpu-3"]]
        assert recovered.verification.verified and recovered.verification.restart_count_after == 2
        assert recovered.requeue.restart_count == 2
        assert [p.node for p in recovered.failed_together] == ["gpu-1", "gpu-3"]


async def test_a_failed_requeue_fails_every_incident_that_joined(temporal_env):
    slurm = SlurmStandIn(fail_requeue=True)
    async with job_recovery(temporal_env, slurm) as jobs:
        outcomes = await asyncio.gather(jobs.join("gpu-1"), jobs.join("gpu-2"), return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, WorkflowUpdateFailedError), outcome
            # As the incident's own requeue would have failed: its cause's type and message.
            assert isinstance(outcome.cause, ApplicationError) and outcome.cause.type == "SlurmCommandError"
            assert outcome.cause.message == "scontrol requeuehold: Invalid job id"
        assert len(slurm.requeues) == 1


async def test_a_join_for_another_job_is_refused_and_changes_nothing(temporal_env):
    slurm = SlurmStandIn()
    async with job_recovery(temporal_env, slurm) as jobs:
        first = await jobs.join("gpu-1")
        handle = temporal_env.client.get_workflow_handle(jobs.workflow_id, run_id=first.run_id)
        events = len([e async for e in handle.fetch_history_events()])
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await jobs.join("gpu-2", job=JOB.model_copy(update={"job_id": 43}))
        assert "this is the recovery of job 42, not 43" in str(refused.value.cause)
        assert len([e async for e in handle.fetch_history_events()]) == events  # refused in the validator
        assert len(slurm.requeues) == 1
        await handle.terminate("test over")

