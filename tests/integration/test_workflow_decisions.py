"""NodeRecoveryWorkflow's decisions and timers, on Temporal's time-skipping test server: the
activities are stand-ins registered under the real activity names (the SDK's way to test a
workflow's logic), so a 10-minute grace period takes no wall time."""

from __future__ import annotations

import asyncio
import functools
import json
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.worker import Worker

from activities.audit import write_audit
from activities.job_recovery import JobRecoveryActivities
from activities.operators import OperatorActivities, OperatorKeys
from activities.policy import PolicyActivities
from contracts.audit import configure_sink, remove_sink
from contracts.kubernetes import K8sNodeRequest, K8sUnfenceResult
from contracts.models import (
    ActionContext,
    ActionRecord,
    ApplicationXidCountRequest,
    CheckpointRef,
    CheckpointWaitRequest,
    CheckpointWaitResult,
    FaultClass,
    FaultClassification,
    FenceHandle,
    FenceRequest,
    FenceResult,
    FindJobsRequest,
    IncidentReport,
    JobSnapshot,
    JobVerification,
    NodeFailureAlert,
    NodeFenceResult,
    NodeHealth,
    NodeRequest,
    OperatorDecision,
    RecoveryPolicy,
    ReleaseRequest,
    ReleaseResult,
    RepairCheck,
    ReplacementRequest,
    ReplacementResult,
    RequeueRequest,
    RequeueResult,
    ReturnToServiceRequest,
    SignalRequest,
    SlurmJob,
    SlurmNode,
    SpareResult,
    SpareWaitRequest,
    VerifyRequest,
)
from drills.localstack import LocalStack
from starter.alerts import raise_alert
from starter.decisions import decide
from workflows.job_recovery import JobRecoveryWorkflow
from workflows.node_recovery import NodeRecoveryWorkflow
from workflows.operator_check import REFUSALS_HEARD
from workflows.return_to_service import ReturnToServiceWorkflow
from workflows.spare_claim import SpareClaimWorkflow

NOW = datetime(2026, 11, 30, tzinfo=timezone.utc)
JOB = SlurmJob(job_id=42, state="RUNNING", nodes=["gpu-1", "gpu-2"], comment="checkpoint_dir=/ckpt/42")
CHECKPOINT = CheckpointRef(checkpoint_id="step-000000020", step=20, train_seconds=4.0, created_at=NOW)


def action(name: str) -> ActionRecord:
    return ActionRecord(at=NOW, action=name, target="t", path="cli", actor="test", reason="test")


class StandIns:
    """Activities that answer like a healthy cluster; each test changes what it needs."""

    def __init__(
        self,
        fault_class: FaultClass,
        checkpoint_arrives: bool = True,
        spare: str | None = "gpu-5",
        verified: bool = True,
        unknown_node: bool = False,
        earlier_application_incidents: int = 0,
        idle_node: bool = False,
        classify: Callable[[NodeFailureAlert], Awaitable[FaultClassification]] | None = None,
        count_application_incidents: Callable[[ApplicationXidCountRequest], Awaitable[int]] | None = None,
    ):
        self.fault_class, self.checkpoint_arrives, self.spare, self.verified = (
            fault_class,
            checkpoint_arrives,
            spare,
            verified,
        )
        self.unknown_node, self.idle_node = unknown_node, idle_node
        self.earlier_application_incidents = earlier_application_incidents
        self.real_classify, self.real_count = classify, count_application_incidents
        self.calls: list[str] = []
        self.recorded: list[str] = []  # outcomes handed to the metrics
        self.find_jobs_asked: list[FindJobsRequest] = []
        self.checkpoint_looks = 0

    def activities(self) -> list:
        @activity.defn(name="classify_fault")
        async def classify_fault(alert: NodeFailureAlert) -> FaultClassification:
            if self.real_classify is not None:
                return await self.real_classify(alert)
            return FaultClassification(xid=alert.xid, fault_class=self.fault_class, policy_source="test")

        @activity.defn(name="count_application_incidents")
        async def count_application_incidents(req: ApplicationXidCountRequest) -> int:
            if self.real_count is not None:
                return await self.real_count(req)
            return self.earlier_application_incidents

        async def fence(req: NodeRequest, name: str) -> NodeFenceResult:
            if self.unknown_node:
                raise ApplicationError(
                    f"node {req.node} is not in this cluster", type="SlurmNotFound", non_retryable=True
                )
            self.calls.append(name)
            node = SlurmNode(name=req.node, state="idle", flags=["DRAIN"])
            return NodeFenceResult(
                node=req.node, before=node, after=node, changed=True, owned_by_other=False, action=action(name)
            )

        @activity.defn(name="drain_node")
        async def drain_node(req: NodeRequest) -> NodeFenceResult:
            return await fence(req, "drain_node")

        @activity.defn(name="mark_node_down")
        async def mark_node_down(req: NodeRequest) -> NodeFenceResult:
            return await fence(req, "mark_node_down")

        @activity.defn(name="record_incident")
        async def record_incident(report: IncidentReport) -> None:
            self.recorded.append(report.outcome)

        @activity.defn(name="return_to_service")
        async def return_to_service(req: NodeRequest) -> RepairCheck:
            self.calls.append("return_to_service")
            return RepairCheck(node=req.node, returned=False, final=True, detail="left as found: test")

        @activity.defn(name="find_jobs")
        async def find_jobs(req: FindJobsRequest) -> list[JobSnapshot]:
            self.find_jobs_asked.append(req)
            return (
                []
                if self.idle_node
                else [JobSnapshot(job=JOB, checkpoint_dir="/ckpt/42", latest_complete=CHECKPOINT, progress=None)]
            )

        @activity.defn(name="signal_job")
        async def signal_job(req: SignalRequest) -> ActionRecord:
            self.calls.append(f"signal_job {req.signal}")
            return action("signal_job")

        @activity.defn(name="wait_for_checkpoint")
        async def wait_for_checkpoint(req: CheckpointWaitRequest) -> CheckpointWaitResult:
            if self.checkpoint_arrives:
                newer = CHECKPOINT.model_copy(update={"step": 23, "checkpoint_id": "step-000000023"})
                return CheckpointWaitResult(job_id=req.job_id, new_checkpoint=newer, waited_seconds=0.2)
            self.checkpoint_looks += 1
            raise ApplicationError(
                "no new checkpoint yet", type="NoNewCheckpointYet", category=ApplicationErrorCategory.BENIGN
            )

        @activity.defn(name="requeue_job")
        async def requeue_job(req: RequeueRequest) -> RequeueResult:
            self.calls.append("requeue_job")
            return RequeueResult(
                job_id=req.job.job_id,
                requeued_now=True,
                restart_count=1,
                latest_complete_at_stop=CHECKPOINT,
                actions=[action("requeue_hold")],
            )

        @activity.defn(name="fence_node")
        async def fence_node(req: FenceRequest) -> FenceResult:
            self.calls.append("fence_node")
            handle = FenceHandle(platform="test", slurm_node=req.node, fenced_at=NOW, spares_on_standby=True)
            return FenceResult(handle=handle, detail="Slurm's drain is the whole fence")

        @activity.defn(name="release_node")
        async def release_node(req: ReleaseRequest) -> ReleaseResult:
            return ReleaseResult(detail="Slurm's DOWN is the whole release")

        @activity.defn(name="request_replacement")
        async def request_replacement(req: ReplacementRequest) -> ReplacementResult:
            self.calls.append("request_replacement")
            return ReplacementResult(node=self.spare, provider="test", detail="none left" if not self.spare else "")

        @activity.defn(name="wait_for_spare")
        async def wait_for_spare(req: SpareWaitRequest) -> SpareResult:
            return SpareResult(node=req.node, healthy=True, in_service_at=NOW)

        @activity.defn(name="verify_restart")
        async def verify_restart(req: VerifyRequest) -> JobVerification:
            self.calls.append("verify_restart")
            return JobVerification(
                job_id=req.snapshot.job.job_id,
                verified=self.verified,
                why_not=[] if self.verified else ["job is PENDING (Resources), not RUNNING"],
                restart_count_before=0,
                restart_count_after=1,
                nodes_before=JOB.nodes,
                nodes_after=["gpu-1", "gpu-3"],
            )

        # write_audit and verify_decision are the real ones: the incident's decisions go to the audit
        # log, and an operator's is verified against an operator list, as in production.
        verify_decision = OperatorActivities(OperatorKeys(operators().operator_keys_file)).verify_decision
        # The incident's policy is the one each test starts it with (as on a drill's worker).
        incident_policy = PolicyActivities(RecoveryPolicy(), accept_starter_policy=True).incident_policy
        return [
            classify_fault,
            count_application_incidents,
            record_incident,
            return_to_service,
            drain_node,
            fence_node,
            mark_node_down,
            release_node,
            find_jobs,
            signal_job,
            wait_for_checkpoint,
            requeue_job,
            request_replacement,
            wait_for_spare,
            verify_restart,
            write_audit,
            verify_decision,
            incident_policy,
        ]


@functools.cache
def operators() -> LocalStack:
    """The operators' keys and the worker's list of them (nothing else of a stack): alice is listed."""
    keys = LocalStack(state_dir=Path(tempfile.mkdtemp(prefix="decisions-operators-")))
    keys.ensure_operator_key("alice")
    return keys


@asynccontextmanager
async def incident(
    env,
    stand_ins: StandIns,
    xid: int,
    grace: float = 600.0,
    *,
    node: str = "gpu-2",
    gpu: str | None = None,
    message: str = "",
    alert: NodeFailureAlert | None = None,
    **policy,
):
    """A started incident on a worker of its own (of alert, or one made of xid, node, gpu and
    message); yields its workflow handle."""
    task_queue = f"decisions-{uuid.uuid4()}"
    async with Worker(
        env.client,
        task_queue=task_queue,
        workflows=[NodeRecoveryWorkflow, ReturnToServiceWorkflow, SpareClaimWorkflow, JobRecoveryWorkflow],
        activities=[*stand_ins.activities(), *JobRecoveryActivities(env.client, task_queue).all()],
    ):
        alert = alert or NodeFailureAlert(node=node, xid=xid, gpu=gpu, message=message, source="test", actor="pytest")
        # The time-skipping test server cannot register search attributes; the fleet budget's
        # part in an incident is tested on the real stack (test_incident_safety.py).
        policy = RecoveryPolicy(
            degrading_grace_seconds=grace,
            spare_nodes=["gpu-5"],
            **{"search_attributes": False, "fleet_budget": False, **policy},
        )
        handle = await raise_alert(env.client, alert, task_queue, policy)
        yield handle
        if (await handle.describe()).status == WorkflowExecutionStatus.TERMINATED:
            return  # the test ended it: there is nothing left to finish
        # Let the return-to-service child finish on this worker: an activity left without a
        # worker would stop the test server from skipping time for the next test.
        report = await handle.result()
        if report.return_to_service:
            await env.client.get_workflow_handle(report.return_to_service).result()


async def run_incident(env, stand_ins: StandIns, xid: int, grace: float = 600.0, **options):
    async with incident(env, stand_ins, xid, grace, **options) as handle:
        return await handle.result()


def phase(report, name: str):
    return next(p for p in report.phases if p.name == name)


async def test_ten_minute_grace_period_ends_on_its_durable_timer(time_skipping_env):
    stand_ins = StandIns(FaultClass.DEGRADING, checkpoint_arrives=False)
    started = time.monotonic()
    report = await run_incident(time_skipping_env, stand_ins, xid=94, grace=600)
    assert time.monotonic() - started < 30
    grace = phase(report, "grace")
    assert grace.result == "grace period of 600 s ended; 1 job(s) without a new checkpoint"
    assert (grace.ended_at - grace.started_at).total_seconds() >= 600
    assert stand_ins.checkpoint_looks > 100  # looked again every poll interval for ten minutes
    assert report.outcome == "recovered"
    # Checkpoint first, then move the job: the signal precedes the requeue.
    assert stand_ins.calls.index("signal_job USR1") < stand_ins.calls.index("requeue_job")


async def test_grace_period_ends_early_when_the_job_checkpoints(time_skipping_env):
    report = await run_incident(time_skipping_env, StandIns(FaultClass.DEGRADING, checkpoint_arrives=True), xid=94)
    grace = phase(report, "grace")
    assert grace.result == "1 job(s) checkpointed within the grace period"
    assert (grace.ended_at - grace.started_at).total_seconds() < 600


async def test_fatal_xid_skips_the_grace_period(time_skipping_env):
    report = await run_incident(time_skipping_env, StandIns(FaultClass.FATAL), xid=79)
    assert phase(report, "grace").result.startswith("skipped: fatal XID")
    assert report.outcome == "recovered"


async def test_the_jobs_that_died_on_the_node_are_looked_for_from_just_before_the_alert(time_skipping_env):
    """A lost GPU's crashed rank can end its job before the alert (srun --kill-on-bad-exit): the
    incident asks for the jobs that died on the node from 60 s before the alert was observed, no
    earlier (a job that failed there minutes before, of something else, is not this fault's)."""
    stand_ins = StandIns(FaultClass.FATAL)
    observed = datetime(2026, 12, 5, 8, 0, tzinfo=timezone.utc)
    alert = NodeFailureAlert(node="gpu-2", xid=79, source="test", actor="pytest", observed_at=observed)
    await run_incident(time_skipping_env, stand_ins, xid=79, alert=alert)
    assert [(r.node, r.died_since) for r in stand_ins.find_jobs_asked] == [("gpu-2", observed - timedelta(seconds=60))]


async def test_no_spare_left_is_reported_not_hidden(time_skipping_env):
    stand_ins = StandIns(FaultClass.FATAL, spare=None)
    report = await run_incident(time_skipping_env, stand_ins, xid=79)
    assert report.outcome == "no_replacement: none left"
    assert "verify_restart" in stand_ins.calls  # the jobs are still checked
    assert all(p.name != "wait_for_spare" for p in report.phases)


async def test_an_idle_node_keeps_the_hot_spare_on_standby(time_skipping_env):
    stand_ins = StandIns(FaultClass.FATAL, idle_node=True)
    report = await run_incident(time_skipping_env, stand_ins, xid=79)
    assert report.outcome == "recovered" and report.spare_node is None
    assert phase(report, "request_replacement").result == (
        "skipped: no job was on gpu-2: the hot spares stay on standby for a job to resume (spare_for_idle_node is off)"
    )
    assert "request_replacement" not in stand_ins.calls and "mark_node_down" in stand_ins.calls


async def test_an_idle_node_takes_a_spare_when_the_policy_says_so(time_skipping_env):
    stand_ins = StandIns(FaultClass.FATAL, idle_node=True)
    report = await run_incident(time_skipping_env, stand_ins, xid=79, spare_for_idle_node=True)
    assert report.outcome == "recovered" and report.spare_node == "gpu-5"
    assert "request_replacement" in stand_ins.calls


async def test_failed_verification_says_why(time_skipping_env):
    report = await run_incident(time_skipping_env, StandIns(FaultClass.FATAL, verified=False), xid=79)
    assert report.outcome == "failed_verification: job 42: job is PENDING (Resources), not RUNNING"


async def test_application_xid_touches_nothing(time_skipping_env):
    stand_ins = StandIns(FaultClass.APPLICATION)
    report = await run_incident(time_skipping_env, stand_ins, xid=13)
    assert (report.action, report.outcome, stand_ins.calls) == ("none", "no_node_action", [])


async def test_a_final_activity_failure_ends_in_an_explicit_failed_state(time_skipping_env):
    stand_ins = StandIns(FaultClass.FATAL, unknown_node=True)
    report = await run_incident(time_skipping_env, stand_ins, xid=79)
    assert report.outcome == "failed in drain: SlurmNotFound: node gpu-2 is not in this cluster"
    assert phase(report, "drain").result == report.outcome
    assert stand_ins.calls == []  # nothing after the failed step


# --- approval gates and abort (operator updates) ------------------------------------------------

REASON = "checked the job owner's runbook"


async def decided(handle, kind: str, signer=None) -> object:
    """alice's decision (or `signer`'s), signed for the incident's run and gate."""
    return await decide(handle, kind, signer or operators().operator_signer("alice"), REASON)


async def until_awaiting(handle, gate: str):
    """Polls the incident until it waits at `gate` (the test server skips no time meanwhile)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = await handle.query(NodeRecoveryWorkflow.status)
        if status.awaiting_approval is not None and status.awaiting_approval.gate == gate:
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"the incident never asked for approval of {gate}")


async def test_an_unanswered_gate_takes_the_safe_default(time_skipping_env):
    """Nobody answers within the policy's deadline: stay drained, kill nothing, and say so. (A
    short deadline in real time: the test server's time skipping hung here now and then.)"""
    stand_ins = StandIns(FaultClass.FATAL)
    report = await run_incident(
        time_skipping_env, stand_ins, xid=79, approval_required=["requeue"], approval_timeout_seconds=2
    )
    assert report.outcome.startswith("denied: requeue (policy: no answer within 2 s: deny by default)")
    assert "requeue_job" not in stand_ins.calls and "mark_node_down" not in stand_ins.calls
    assert stand_ins.calls == ["drain_node", "fence_node", "signal_job USR1"]
    [decision] = report.decisions
    assert (decision.kind, decision.gate, decision.actor) == ("deny", "requeue", "policy")
    gate = phase(report, "approval_requeue")
    assert (gate.ended_at - gate.started_at).total_seconds() >= 2


async def test_an_approved_requeue_goes_ahead_and_records_who_and_why(time_skipping_env):
    stand_ins = StandIns(FaultClass.FATAL)
    async with incident(time_skipping_env, stand_ins, xid=79, approval_required=["requeue"]) as handle:
        status = await until_awaiting(handle, "requeue")
        assert "job(s) 42" in status.awaiting_approval.question
        assert "requeue_job" not in stand_ins.calls  # nothing destructive before the answer
        after = await decided(handle, "approve")
        assert after.decisions[-1].model_dump(include={"kind", "gate", "actor", "reason"}) == {
            "kind": "approve",
            "gate": "requeue",
            "actor": "alice",
            "reason": REASON,
        }
        assert after.decisions[-1].verified_by.startswith("SHA256:")
        report = await handle.result()
    assert report.outcome == "recovered"
    assert phase(report, "approval_requeue").result == f"approve by alice: {REASON}"


async def test_a_denied_replacement_is_skipped_and_reported(time_skipping_env):
    stand_ins = StandIns(FaultClass.FATAL)
    async with incident(time_skipping_env, stand_ins, xid=79, approval_required=["replacement"]) as handle:
        await until_awaiting(handle, "replacement")
        await decided(handle, "deny")
        report = await handle.result()
    assert "request_replacement" not in stand_ins.calls and "requeue_job" in stand_ins.calls
    assert report.outcome == f"no_replacement: denied by alice: {REASON}"


async def test_small_jobs_pass_the_requeue_gate_without_asking(time_skipping_env):
    """The gate is for jobs above a size: the 2-node job is below a 4-node threshold."""
    report = await run_incident(
        time_skipping_env, StandIns(FaultClass.FATAL), xid=79, approval_required=["requeue"], approval_min_job_nodes=4
    )
    assert report.outcome == "recovered" and report.decisions == []


async def test_approval_is_refused_when_nothing_awaits_it(time_skipping_env):
    stand_ins = StandIns(FaultClass.DEGRADING, checkpoint_arrives=False)
    async with incident(time_skipping_env, stand_ins, xid=94, approval_required=["replacement"]) as handle:
        await until_status(handle, lambda s: s.phase == "grace")
        # Signed for a gate the incident has not reached: refused by the validator, before any check.
        alice = operators().operator_signer("alice")
        run_id = (await handle.describe()).run_id
        early = OperatorDecision(
            actor="alice", reason=REASON, signature=alice.sign("approve", handle.id, run_id, "replacement", REASON)
        )
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(NodeRecoveryWorkflow.approve, early)
        assert "awaits no approval" in str(refused.value.cause)
        status = await handle.query(NodeRecoveryWorkflow.status)
        assert status.decisions == []  # a refused update changes nothing
        await decided(handle, "abort")
        await handle.result()


async def test_an_unverified_decision_is_refused_audited_and_changes_nothing(time_skipping_env, tmp_path):
    """Unsigned, signed by a key the worker does not list, or signed for another gate or run: each
    is refused with why, audited with the name it claimed, and the gate still waits; then alice's
    own signature counts."""
    audit = tmp_path / "audit.jsonl"
    sink = configure_sink(audit)
    stranger = LocalStack(state_dir=tmp_path / "stranger").operator_signer("alice")  # alice's name, not her key
    alice = operators().operator_signer("alice")
    try:
        async with incident(
            time_skipping_env, StandIns(FaultClass.FATAL), xid=79, approval_required=["requeue"]
        ) as handle:
            await until_awaiting(handle, "requeue")
            run_id = (await handle.describe()).run_id
            attempts = {
                "not signed": OperatorDecision(actor="alice", reason=REASON),
                "does not verify": OperatorDecision(
                    actor="alice",
                    reason=REASON,
                    signature=stranger.sign("approve", handle.id, run_id, "requeue", REASON),
                ),
                "at requeue": OperatorDecision(
                    actor="alice",
                    reason=REASON,
                    signature=alice.sign("approve", handle.id, run_id, "replacement", REASON),
                ),  # another gate's
                "(run": OperatorDecision(
                    actor="alice",
                    reason=REASON,
                    signature=alice.sign("approve", handle.id, "another-run", "requeue", REASON),
                ),
                "is not among": OperatorDecision(
                    actor="mallory",
                    reason=REASON,
                    signature=alice.sign("approve", handle.id, run_id, "requeue", REASON),
                ),
            }
            for why, decision in attempts.items():
                with pytest.raises(WorkflowUpdateFailedError) as refused:
                    await handle.execute_update(NodeRecoveryWorkflow.approve, decision)
                assert "approve refused: " in str(refused.value.cause) and why in str(refused.value.cause), why
            status = await handle.query(NodeRecoveryWorkflow.status)
            assert status.decisions == [] and status.awaiting_approval.gate == "requeue"
            await decided(handle, "approve")
            report = await handle.result()
    finally:
        remove_sink(sink)
    assert report.outcome == "recovered" and [d.actor for d in report.decisions] == ["alice"]
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    refusals = [
        (line["actor"], line["actor_kind"], line["result"]) for line in lines if line["action"] == "approve_refused"
    ]
    assert refusals == [("alice", "unverified", "refused")] * 4 + [("mallory", "unverified", "refused")]
    [approved] = [line for line in lines if line["action"] == "approve_requeue"]
    assert approved["actor_kind"] == "operator" and approved["parameters"]["verified_by"].startswith("SHA256:")


async def test_abort_stops_the_incident_before_its_next_step(time_skipping_env):
    """Aborted during the grace period: no requeue, no DOWN; the node stays drained."""
    stand_ins = StandIns(FaultClass.DEGRADING, checkpoint_arrives=False)
    async with incident(time_skipping_env, stand_ins, xid=94) as handle:
        await until_status(handle, lambda s: s.phase == "grace")
        await decided(handle, "abort")
        report = await handle.result()
    assert report.outcome == f"aborted by alice in grace: {REASON}; node left as it was"
    assert stand_ins.calls == ["drain_node", "fence_node", "signal_job USR1"]
    assert [d.kind for d in report.decisions] == ["abort"]


async def until_status(handle, ready):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ready(await handle.query(NodeRecoveryWorkflow.status)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the incident never reached the expected state")


# --- application XIDs: counted over a window per GPU -------------------------------------------


async def test_repeated_application_xids_on_one_gpu_drain_and_escalate(time_skipping_env):
    stand_ins = StandIns(FaultClass.APPLICATION, earlier_application_incidents=2)
    report = await run_incident(time_skipping_env, stand_ins, xid=13, gpu="0")
    assert report.outcome == ("escalated: 3 application XIDs on GPU 0 within 86400 s: node drained, jobs left running")
    assert report.action == "fence_and_escalate" and stand_ins.calls == ["drain_node"]


async def test_application_xids_counted_from_earlier_incidents_on_the_real_server(temporal_env):
    """The count comes from Temporal's visibility: two XID 13 incidents on GPU 0 change nothing,
    the third drains the node; another GPU's count is its own."""
    from activities.xid_policy import ClassifyActivities, XidPolicyTable
    from contracts.settings import DEFAULT_XID_POLICY

    real = ClassifyActivities(XidPolicyTable(DEFAULT_XID_POLICY), temporal_env.client)
    node = f"gpu-{uuid.uuid4().hex[:8]}"

    async def one(xid: int, gpu: str):
        stand_ins = StandIns(
            FaultClass.APPLICATION,
            classify=real.classify_fault,
            count_application_incidents=real.count_application_incidents,
        )
        report = await run_incident(temporal_env, stand_ins, xid=xid, node=node, gpu=gpu, search_attributes=True)
        return report, stand_ins.calls

    async def visible(count: int):
        query = f"RecoveryNode = '{node}'"
        deadline = time.monotonic() + 30
        while (await temporal_env.client.count_workflows(query)).count < count:
            assert time.monotonic() < deadline, "incidents never became visible"
            await asyncio.sleep(0.1)

    for seen, xid in enumerate((13, 31), start=1):
        report, calls = await one(xid, gpu="0")
        assert (report.outcome, calls) == ("no_node_action", [])
        assert phase(report, "count_application_xids").result.startswith(f"{seen} of 3 application XID(s) on GPU 0")
        await visible(seen)
    report, calls = await one(13, gpu="1")
    assert (report.outcome, calls) == ("no_node_action", [])  # GPU 1 had none before
    await visible(3)
    report, calls = await one(43, gpu="0")
    assert report.outcome.startswith("escalated: 3 application XIDs on GPU 0") and calls == ["drain_node"]


async def test_application_xids_from_alertmanager_are_counted_per_gpu_on_the_real_server(temporal_env):
    """Alertmanager's alerts as the hook reads them (dcgm-exporter's gpu and UUID labels): a second
    application XID on a GPU counts the first, another GPU's does not (it used to count per node)."""
    from activities.xid_policy import ClassifyActivities, XidPolicyTable
    from contracts.settings import DEFAULT_XID_POLICY
    from hooks.sources import alertmanager
    from tests.hook_support import alertmanager_payload, dcgm_alert

    real = ClassifyActivities(XidPolicyTable(DEFAULT_XID_POLICY), temporal_env.client)
    node = f"gpu-{uuid.uuid4().hex[:8]}"

    async def one(xid: int, gpu: int, earlier: int) -> str:
        webhook = alertmanager.AlertmanagerWebhook.model_validate(
            alertmanager_payload([dcgm_alert(node, xid, datetime.now(timezone.utc), gpu=gpu)])
        )
        (incoming,), problems = alertmanager.to_incoming(webhook, ["Hostname"])
        assert problems == []
        stand_ins = StandIns(
            FaultClass.APPLICATION,
            classify=real.classify_fault,
            count_application_incidents=real.count_application_incidents,
        )
        report = await run_incident(temporal_env, stand_ins, xid=xid, alert=incoming.to_alert(), search_attributes=True)
        deadline = time.monotonic() + 30
        while (await temporal_env.client.count_workflows(f"RecoveryNode = '{node}'")).count < earlier + 1:
            assert time.monotonic() < deadline, "the incident never became visible"
            await asyncio.sleep(0.1)
        return phase(report, "count_application_xids").result

    gpu_3 = (await one(13, gpu=3, earlier=0)).split(" within")[0]
    assert gpu_3.startswith("1 of 3 application XID(s) on GPU GPU-")
    assert (await one(31, gpu=3, earlier=1)).startswith(gpu_3.replace("1 of 3", "2 of 3"))
    assert (await one(13, gpu=4, earlier=2)).startswith("1 of 3 application XID(s) on GPU GPU-")


async def test_xid_154_follows_the_drivers_recommended_action(time_skipping_env):
    """XID 154 classified with the real policy table: "Node Reboot Required" is fatal."""
    from activities.xid_policy import ClassifyActivities, XidPolicyTable
    from contracts.settings import DEFAULT_XID_POLICY

    real = ClassifyActivities(XidPolicyTable(DEFAULT_XID_POLICY), time_skipping_env.client)
    stand_ins = StandIns(FaultClass.UNKNOWN, classify=real.classify_fault)
    report = await run_incident(
        time_skipping_env,
        stand_ins,
        xid=154,
        message=(
            "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
        ),
    )
    assert (report.fault_class.value, report.outcome) == ("fatal", "recovered")
    assert "requeue_job" in stand_ins.calls


# --- return to service on Kubernetes ---------------------------------------------------------


async def test_return_to_service_unfences_the_kubernetes_node_once_healthy(time_skipping_env):
    """The Node stays fenced while the health check fails (looked at again on a durable timer),
    is unfenced once, when it passes, and the Slurm node is then resumed."""
    looks: list[str] = []

    @activity.defn(name="check_node_health")
    async def check_node_health(node: str) -> NodeHealth:
        looks.append("health")
        healthy = looks.count("health") >= 3  # repaired before the third look
        return NodeHealth(node=node, healthy=healthy, detail="healthy" if healthy else "GPU 3 missing")

    @activity.defn(name="unfence_k8s_node")
    async def unfence_k8s_node(req: K8sNodeRequest) -> K8sUnfenceResult:
        looks.append(f"unfence {req.node}")
        return K8sUnfenceResult(
            node=req.node, changed=True, restored=None, detail="restored", actions=[action("unfence_k8s_node")]
        )

    @activity.defn(name="return_to_service")
    async def return_to_service(req: NodeRequest) -> RepairCheck:
        looks.append("slurm")
        done = "unfence k8s-gpu-2" in looks
        return RepairCheck(node=req.node, returned=done, final=done, detail="resumed" if done else "slurmd down")

    ctx = ActionContext(incident_id="gpu-2-1", owner="recovery", actor="recovery policy", reason="test", xid=79)
    task_queue = f"rts-{uuid.uuid4()}"
    async with Worker(
        time_skipping_env.client,
        task_queue=task_queue,
        workflows=[ReturnToServiceWorkflow],
        activities=[check_node_health, unfence_k8s_node, return_to_service],
    ):
        result = await time_skipping_env.client.execute_workflow(
            ReturnToServiceWorkflow.run,
            ReturnToServiceRequest(
                node="gpu-2", ctx=ctx, poll_seconds=0.2, kubernetes_node="k8s-gpu-2", give_up_at=NOW.replace(year=2100)
            ),
            id=f"return-to-service-{uuid.uuid4()}",
            task_queue=task_queue,
        )
    assert looks == ["health", "slurm", "health", "slurm", "health", "unfence k8s-gpu-2", "slurm"], (looks, result)
    assert result.returned and [a.action for a in result.actions] == ["unfence_k8s_node"]


async def test_a_flood_of_forged_decisions_stops_being_heard_and_the_history_stays_small(temporal_env):
    """Each heard decision adds to the run's history; after REFUSALS_HEARD refusals the validator
    refuses the rest unheard, and the history no longer grows. On the real dev server: the
    time-skipping server writes a workflow task for an update its validator refuses."""
    # The gate's deadline is far off: its timer firing would add to the history being measured.
    async with incident(
        temporal_env, StandIns(FaultClass.FATAL), xid=79, approval_required=["requeue"], approval_timeout_seconds=3600
    ) as handle:
        await until_awaiting(handle, "requeue")
        forged = OperatorDecision(actor="alice", reason=REASON)
        for _ in range(REFUSALS_HEARD):
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update(NodeRecoveryWorkflow.approve, forged)
            assert "approve refused: not signed" in str(refused.value.cause)
        length = (await handle.describe()).raw_description.workflow_execution_info.history_length
        for _ in range(50):
            with pytest.raises(WorkflowUpdateFailedError) as unheard:
                await handle.execute_update(NodeRecoveryWorkflow.approve, forged)
            assert "were refused in this run: it hears no more" in str(unheard.value.cause)
        assert (await handle.describe()).raw_description.workflow_execution_info.history_length == length
        status = await handle.query(NodeRecoveryWorkflow.status)
        assert status.awaiting_approval is not None and status.awaiting_approval.gate == "requeue"  # nobody was heard
        await handle.terminate("the test is over")
