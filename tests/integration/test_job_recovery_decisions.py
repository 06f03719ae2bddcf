"""JobRecoveryWorkflow's decisions (workflows/job_recovery.py) on the real dev server, with
stand-ins for the two Slurm activities under their real names and for the incidents (a workflow
that keeps what the job's recovery signals it): the incidents on one job's nodes share one
requeue and one verification, a node that joins during the verification gets the job requeued
off it too and the verification redone, and a failed requeue fails every joined incident; a node
that joins while the run tells its end (held there by an interceptor) is not left unheard.
The real requeue and verification on real Slurm: test_failures_together.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager

import pytest
from pydantic import BaseModel, Field
from temporalio import activity, workflow
from temporalio.client import WithStartWorkflowOperation, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.worker import (
    HandleUpdateInput,
    Interceptor,
    Replayer,
    SignalExternalWorkflowInput,
    Worker,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from contracts.models import (
    ActionContext,
    JobJoin,
    JobRecovered,
    JobRecoveryFailure,
    JobRequeued,
    JobSnapshot,
    JobVerification,
    RequeueRequest,
    RequeueResult,
    SlurmJob,
    VerifyRequest,
)
from drills.localstack import wait_async
from workflows.job_recovery import (
    JOB_RECOVERED,
    JOB_REQUEUE_FAILED,
    JOB_REQUEUED,
    LATE_JOINERS_TOLD,
    JobRecoveryWorkflow,
    job_recovery_workflow_id,
)

JOB = SlurmJob(job_id=42, state="RUNNING", nodes=["gpu-1", "gpu-2", "gpu-3"], restart_count=0)


class Heard(BaseModel):
    requeued: list[JobRequeued] = Field(default_factory=list)
    recovered: list[JobRecovered] = Field(default_factory=list)
    failed: list[JobRecoveryFailure] = Field(default_factory=list)


@workflow.defn(sandboxed=False)
class StandInIncident:
    """What an incident hears from its job's recovery, under NodeRecoveryWorkflow's signal names."""

    def __init__(self) -> None:
        self.heard = Heard()

    @workflow.signal(name=JOB_REQUEUED)
    def job_requeued(self, news: JobRequeued) -> None:
        self.heard.requeued.append(news)

    @workflow.signal(name=JOB_RECOVERED)
    def job_recovered(self, news: JobRecovered) -> None:
        self.heard.recovered.append(news)

    @workflow.signal(name=JOB_REQUEUE_FAILED)
    def job_requeue_failed(self, news: JobRecoveryFailure) -> None:
        self.heard.failed.append(news)

    @workflow.query
    def news(self) -> Heard:
        return self.heard

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)


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
                raise ApplicationError(
                    "scontrol requeuehold: Invalid job id", type="SlurmCommandError", non_retryable=True
                )
            return RequeueResult(
                job_id=req.job.job_id, requeued_now=True, restart_count=req.job.restart_count + 1, actions=[]
            )

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
            return JobVerification(
                job_id=req.snapshot.job.job_id,
                verified=True,
                restart_count_before=req.snapshot.job.restart_count,
                restart_count_after=req.expected_restart_count,
                nodes_before=req.snapshot.job.nodes,
                nodes_after=["gpu-7", "gpu-8", "gpu-9"],
            )

        return [requeue_job, verify_restart]


async def until(check, what: str):
    """Poll a check (plain or async), with a deadline."""

    async def checked():
        value = check()
        return await value if asyncio.iscoroutine(value) else value

    return await wait_async(checked, 30, what, interval=0.05)


class JobRecovery:
    def __init__(self, client, task_queue: str):
        self.client, self.task_queue = client, task_queue
        self.workflow_id = job_recovery_workflow_id(task_queue, JOB.job_id)

    async def join(self, node: str, job: SlurmJob = JOB) -> str:
        """An incident's join, as activities/job_recovery.py sends it; its run id."""
        incident = f"{node}-20261204T000000Z"
        await self.client.start_workflow(
            StandInIncident.run,
            id=self.incident_id(node),
            task_queue=self.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        ctx = ActionContext(incident_id=incident, owner="recovery", actor="pytest", reason=f"XID 79 on {node}", xid=79)
        start = WithStartWorkflowOperation(
            JobRecoveryWorkflow.run,
            id=self.workflow_id,
            task_queue=self.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        return await self.client.execute_update_with_start_workflow(
            JobRecoveryWorkflow.requeue,
            JobJoin(
                incident_id=incident,
                workflow_id=self.incident_id(node),
                node=node,
                ctx=ctx,
                verify_deadline_seconds=60,
                snapshot=JobSnapshot(job=job, checkpoint_dir=None, latest_complete=None, progress=None),
            ),
            start_workflow_operation=start,
            id=f"{incident}-job-{job.job_id}",
        )

    def incident_id(self, node: str) -> str:
        return f"incident-{self.task_queue}-{node}"

    async def heard(self, node: str) -> Heard:
        return await self.client.get_workflow_handle(self.incident_id(node)).query(StandInIncident.news)

    async def verify(self, run_id: str) -> None:
        await self.client.get_workflow_handle(self.workflow_id, run_id=run_id).signal(JobRecoveryWorkflow.verify)


class HoldTheEnd(Interceptor):
    """Holds the job's recovery as it begins to tell its end (the signal named) until one more node
    joins: the window in which a join meets a run that is ending, made certain. Holds once."""

    def __init__(self, signal: str):
        self.signal = signal
        self.holding = False  # seen by the test: the run waits for a join

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        hold = self

        class CountJoins(WorkflowInboundInterceptor):
            joins = 0
            held = False

            def init(self, outbound: WorkflowOutboundInterceptor) -> None:
                super().init(HoldSignal(outbound, self))

            async def handle_update_handler(self, input: HandleUpdateInput):
                result = await super().handle_update_handler(input)
                self.joins += 1
                return result

        class HoldSignal(WorkflowOutboundInterceptor):
            def __init__(self, next: WorkflowOutboundInterceptor, inbound: CountJoins):
                super().__init__(next)
                self.inbound = inbound

            async def signal_external_workflow(self, input: SignalExternalWorkflowInput) -> None:
                if input.signal == hold.signal and not self.inbound.held:
                    self.inbound.held = hold.holding = True
                    joins = self.inbound.joins
                    await workflow.wait_condition(lambda: self.inbound.joins > joins)
                await super().signal_external_workflow(input)

        return CountJoins


@asynccontextmanager
async def job_recovery(env, slurm: SlurmStandIn, interceptors: Sequence[Interceptor] = ()):
    task_queue = f"job-recovery-{uuid.uuid4()}"
    async with Worker(
        env.client,
        task_queue=task_queue,
        workflows=[JobRecoveryWorkflow, StandInIncident],
        activities=slurm.activities(),
        interceptors=interceptors,
    ):
        recovery = JobRecovery(env.client, task_queue)
        yield recovery
        async for incident in env.client.list_workflows(f'TaskQueue = "{task_queue}" AND ExecutionStatus = "Running"'):
            await env.client.get_workflow_handle(incident.id).terminate("test over")


async def test_incidents_on_one_job_share_its_requeue_and_its_one_verification(temporal_env):
    slurm = SlurmStandIn()
    nodes = ["gpu-1", "gpu-2", "gpu-3"]
    async with job_recovery(temporal_env, slurm) as jobs:
        runs = await asyncio.gather(*(jobs.join(node) for node in nodes))
        assert len(set(runs)) == 1
        requeued = [
            (await until(lambda node=node: told(jobs, node, "requeued"), f"{node} to hear of its requeue"))
            for node in nodes
        ]
        # One requeue, or more that add the nodes that joined while one ran; each incident hears once.
        assert [r.failed_nodes for r in slurm.requeues][-1] == nodes, slurm.requeues
        assert slurm.requeues[0].job.restart_count == 0
        assert all(len(heard) == 1 for heard in requeued)
        # A repeated join (the incident's activity retried after a crash) is the same request: nothing more.
        count = len(slurm.requeues)
        assert await jobs.join("gpu-1") == runs[0] and len(slurm.requeues) == count
        await asyncio.gather(*(jobs.verify(run) for run in runs))
        recovered = [
            (await until(lambda node=node: told(jobs, node, "recovered"), f"{node} to hear of the verification"))
            for node in nodes
        ]
        assert recovered[0] == recovered[1] == recovered[2] and len(recovered[0]) == 1
        assert len(slurm.verifications) == 1 and slurm.verifications[0].failed_nodes == nodes
        assert slurm.verifications[0].expected_restart_count == slurm.requeues[-1].job.restart_count + 1
        assert [(p.node, p.incident_id) for p in recovered[0][0].failed_together] == [
            (node, f"{node}-20261204T000000Z") for node in nodes
        ]


async def told(jobs: JobRecovery, node: str, what: str) -> list | None:
    return getattr(await jobs.heard(node), what) or None


async def test_a_node_that_joins_during_the_verification_gets_a_requeue_and_the_verification_is_redone(temporal_env):
    slurm = SlurmStandIn()
    slurm.hold_verification.set()
    async with job_recovery(temporal_env, slurm) as jobs:
        run = await jobs.join("gpu-1")
        await until(lambda: told(jobs, "gpu-1", "requeued"), "gpu-1 to hear of its requeue")
        await jobs.verify(run)
        await until(lambda: slurm.verifications, "the verification to start")
        assert await jobs.join("gpu-3") == run
        await until(lambda: slurm.cancelled_verifications == 1, "the first verification to be cancelled")
        [late] = await until(lambda: told(jobs, "gpu-3", "requeued"), "gpu-3 to hear of its requeue")
        slurm.hold_verification.clear()
        [recovered] = await until(lambda: told(jobs, "gpu-1", "recovered"), "gpu-1 to hear of the verification")
        assert await told(jobs, "gpu-3", "recovered") == [recovered]
        assert [r.failed_nodes for r in slurm.requeues] == [["gpu-1"], ["gpu-1", "gpu-3"]]
        # The second requeue counts from the restart the first one left.
        assert [r.job.restart_count for r in slurm.requeues] == [0, 1]
        assert [v.failed_nodes for v in slurm.verifications] == [["gpu-1"], ["gpu-1", "gpu-3"]]
        assert late.requeue.restart_count == recovered.requeue.restart_count == 2
        assert recovered.verification.verified and recovered.verification.restart_count_after == 2
        assert [p.node for p in recovered.failed_together] == ["gpu-1", "gpu-3"]
        assert len((await jobs.heard("gpu-1")).requeued) == 1  # told of its own requeue once


async def test_a_failed_requeue_fails_every_incident_that_joined(temporal_env):
    slurm = SlurmStandIn(fail_requeue=True)
    async with job_recovery(temporal_env, slurm) as jobs:
        await asyncio.gather(jobs.join("gpu-1"), jobs.join("gpu-2"))
        for node in ("gpu-1", "gpu-2"):
            # As the incident's own requeue would have failed: its cause's type and message.
            [failure] = await until(lambda node=node: told(jobs, node, "failed"), f"{node} to hear of the failure")
            assert (failure.error_type, failure.message) == (
                "SlurmCommandError",
                "scontrol requeuehold: Invalid job id",
            )
            assert not (await jobs.heard(node)).requeued


async def test_a_node_that_joins_while_a_failed_requeue_is_told_hears_of_the_failure_too(temporal_env):
    slurm, hold = SlurmStandIn(fail_requeue=True), HoldTheEnd(JOB_REQUEUE_FAILED)
    async with job_recovery(temporal_env, slurm, [hold]) as jobs:
        run = await jobs.join("gpu-1")
        await until(lambda: hold.holding, "the run to begin telling the failure")
        assert await jobs.join("gpu-2") == run  # the ending run took it
        for node in ("gpu-1", "gpu-2"):
            [failure] = await until(lambda node=node: told(jobs, node, "failed"), f"{node} to hear of the failure")
            assert failure.error_type == "SlurmCommandError"
        assert len(slurm.requeues) == 1
        await replays_behind_the_patch(temporal_env, jobs, run, hold)


async def test_a_node_that_joins_while_the_recovery_is_told_gets_its_requeue_and_verification(temporal_env):
    slurm, hold = SlurmStandIn(), HoldTheEnd(JOB_RECOVERED)
    async with job_recovery(temporal_env, slurm, [hold]) as jobs:
        run = await jobs.join("gpu-1")
        await until(lambda: told(jobs, "gpu-1", "requeued"), "gpu-1 to hear of its requeue")
        await jobs.verify(run)
        await until(lambda: hold.holding, "the run to begin telling the recovery")
        assert await jobs.join("gpu-3") == run
        await until(lambda: told(jobs, "gpu-3", "requeued"), "gpu-3 to hear of its requeue")
        [recovered] = await until(lambda: told(jobs, "gpu-3", "recovered"), "gpu-3 to hear of the verification")
        # The job may run on gpu-3 again: requeued off it as well and verified anew.
        assert [r.failed_nodes for r in slurm.requeues] == [["gpu-1"], ["gpu-1", "gpu-3"]]
        assert [v.failed_nodes for v in slurm.verifications] == [["gpu-1"], ["gpu-1", "gpu-3"]]
        assert recovered.verification.restart_count_after == 2
        assert [p.node for p in recovered.failed_together] == ["gpu-1", "gpu-3"]
        # gpu-1 heard the first verification, then the one that covers both.
        assert [r.verification.restart_count_after for r in (await jobs.heard("gpu-1")).recovered] == [1, 2]
        await replays_behind_the_patch(temporal_env, jobs, run, hold)


async def replays_behind_the_patch(env, jobs: JobRecovery, run_id: str, hold: HoldTheEnd) -> None:
    """The run took the late joiner behind LATE_JOINERS_TOLD, and its history replays on this code
    (held the same way: the hold is in the history's order of events)."""
    handle = env.client.get_workflow_handle(jobs.workflow_id, run_id=run_id)

    async def ended() -> bool:
        return (await handle.describe()).status != WorkflowExecutionStatus.RUNNING

    await until(ended, "the run to end")
    history = await handle.fetch_history()
    markers = [
        e.marker_recorded_event_attributes for e in history.events if e.HasField("marker_recorded_event_attributes")
    ]
    assert any(
        LATE_JOINERS_TOLD.encode() in p.data for m in markers for ps in m.details.values() for p in ps.payloads
    ), markers
    replayer = Replayer(
        workflows=[JobRecoveryWorkflow], interceptors=[HoldTheEnd(hold.signal)], data_converter=pydantic_data_converter
    )
    await replayer.replay_workflow(history)


async def test_a_join_for_another_job_is_refused_and_changes_nothing(temporal_env):
    slurm = SlurmStandIn()
    async with job_recovery(temporal_env, slurm) as jobs:
        run = await jobs.join("gpu-1")
        handle = temporal_env.client.get_workflow_handle(jobs.workflow_id, run_id=run)
        await until(lambda: told(jobs, "gpu-1", "requeued"), "gpu-1 to hear of its requeue")
        events = len([e async for e in handle.fetch_history_events()])
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await jobs.join("gpu-2", job=JOB.model_copy(update={"job_id": 43}))
        assert "this is the recovery of job 42, not 43" in str(refused.value.cause)
        assert len([e async for e in handle.fetch_history_events()]) == events  # refused in the validator
        assert len(slurm.requeues) == 1
