"""NodeRecoveryWorkflow: one durable incident per failed node, deciding what happens and in what
order. Every side effect is an activity (activities/); this module does no I/O. Its parts are in
workflows/incident/ (the timeline, the steps, the gates, the work on the jobs, the replacement on
each platform); this module tells the story with them:

classify -> pass the fence circuit breaker (tripped: held, nothing drained, for a reset or an
operator) -> drain -> find jobs -> lease from the fleet disruption budget (over budget: wait,
fenced, for the budget or an operator) -> signal -> grace (durable timer, ends early on a new
checkpoint) -> requeue away from the node -> mark down -> request replacement -> wait for a
healthy spare -> verify each job resumed from its latest complete checkpoint -> report; the lease
is returned however the incident ends.
"""

from __future__ import annotations

from collections.abc import Awaitable
from datetime import datetime, timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import ActivityError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.fencing import FencingActivities
    from activities.jobs import JobActivities
    from activities.policy import PolicyActivities
    from activities.xid_policy import ClassifyActivities
    from contracts import search_attributes as sa
    from contracts.budget import FenceScope, LeaseState, Notification, NotificationKind, PartitionShare
    from contracts.models import (
        ActionContext,
        ActionRecord,
        AlertDigest,
        ApplicationXidCountRequest,
        DecisionRecord,
        FaultClass,
        FaultClassification,
        FindJobsRequest,
        IncidentAction,
        IncidentReport,
        IncidentStatus,
        JobRecovered,
        JobRecoveryFailure,
        JobRequeued,
        JobSnapshot,
        JobVerification,
        NodeFailureAlert,
        NodeFenceResult,
        NodeRequest,
        OperatorDecision,
        OutcomeKind,
        RecoveryPolicy,
        RecoveryRequest,
        ReturnToServiceRequest,
        SpareResult,
    )
    from contracts.search_attributes import outcome_label
    from workflows.alert_log import AlertLog
    from workflows.audit_trail import AuditTrail
    from workflows.budget_lease import LEASE_STATE_SIGNAL, BudgetLease
    from workflows.call_options import SLURM_CALL
    from workflows.incident.gates import Gates
    from workflows.incident.hot_spares import HotSpares
    from workflows.incident.identity import IncidentRef
    from workflows.incident.jobs import JobRecoveryFailed, JobWork
    from workflows.incident.kubernetes import KubernetesNode
    from workflows.incident.outcome import cause_of, notification_for, recovery_outcome
    from workflows.incident.platform import ONE_PLATFORM_SEAM, BoundPlatform, NodePlatform
    from workflows.incident.slurm_calls import fence_call, read_partitions
    from workflows.incident.steps import IncidentAborted, SearchIndex, Steps
    from workflows.incident.timeline import Timeline, last_action_at
    from workflows.job_recovery import JOB_RECOVERED, JOB_REQUEUE_FAILED, JOB_REQUEUED
    from workflows.notify import notify
    from workflows.report import build_report
    from workflows.return_to_service import ReturnToServiceWorkflow, return_to_service_workflow_id

T = TypeVar("T")

# Retired patches (docs/upgrades.md, step 2): every run takes their path, and the histories that
# carry their markers still replay. Issue #7's: fewer round trips through the server (classify as
# a local activity, search attributes upserted together, the jobs signalled and requeued at once,
# the partitions read alongside the jobs); the fence in the first workflow task. (The spare claim's
# two are in workflows/incident/hot_spares.py.)
FEWER_ROUND_TRIPS = "fewer-round-trips"
FENCE_IN_ONE_TASK = "fence-in-one-task"
# Runs that start on this code ask the fleet budget's fence circuit breaker before the drain.
FENCE_BREAKER = "fence-breaker"
# Runs that start on this code keep the hot spares on standby when no job was on the failed node
# (unless the policy's spare_for_idle_node): a spare brings a running job back at full size, and
# one spent on capacity for the queue is not there for the next job that loses a node.
IDLE_NODE_KEEPS_SPARE = "idle-node-keeps-spare"
# Runs that start on this code run on the worker's policy (activities/policy.py), which the
# starter's can only make safer; runs begun before keep the policy their starter sent.
POLICY_FROM_WORKER = "policy-from-worker"
# Runs that start on this code requeue and verify each job through its JobRecoveryWorkflow, which
# every incident on the job's nodes joins: nodes of one job fail together, and the job must be
# requeued once, kept off each of them, and verified once. Runs begun before requeue it themselves.
JOBS_RECOVERED_TOGETHER = "jobs-recovered-together"
# Runs that start on this code, when the replacement is the failed Slurm node itself on new
# hardware (a StatefulSet-mode slurmd pod recreated on another Node), take it out of the
# exclusions of the jobs still pending: kept off it, a job that needs every node never starts.
READMIT_MOVED_NODE = "readmit-moved-node"
# A job the lost GPU crashed ended just before its alert was observed (the alert comes after the
# symptom: a log scrape, a health check's period): how far back find_jobs looks for one.
DIED_BEFORE_THE_ALERT = timedelta(seconds=60)


def incident_workflow_id(node: str) -> str:
    """One incident per node: a second alert for the node reaches the running incident."""
    return f"node-recovery-{node}"


class FenceHeld(Exception):
    """The fence circuit breaker held the incident until it gave up, or an operator denied the
    fence past it: the node was not drained."""

    def __init__(self, kind: OutcomeKind, why: str) -> None:
        super().__init__(why)
        self.kind = kind


@workflow.defn
class NodeRecoveryWorkflow:
    @workflow.init
    def __init__(self, req: RecoveryRequest) -> None:
        # The node is known before the first signal: only this node's alerts are kept.
        self._incident = IncidentRef(node=req.node)
        self._alerts = AlertLog()
        self._actions: list[ActionRecord] = []
        self._classification: FaultClassification | None = None
        self._jobs: list[JobSnapshot] = []
        self._outcome: str | None = None
        self._return_to_service: str | None = None
        self._fence_scope: FenceScope | None = None
        self._notify_enabled = False
        self._index = SearchIndex()
        self._steps = Steps(Timeline(), self._index, aborted=lambda: self._gates.abort is not None)
        self._audit = AuditTrail()
        self._gates = Gates(self._incident, self._steps, self._audit, self._notify)
        self._lease = BudgetLease()
        self._job_work = JobWork(self._incident, self._steps, self._actions)
        self._hot_spares = HotSpares(self._steps, self._actions, self._lease)
        self._kubernetes = KubernetesNode(self._steps, self._actions)
        self._platform = BoundPlatform(self._steps, self._actions, self._hot_spares)
        self._one_platform_seam = False
        self._fence_breaker = False
        self._idle_node_keeps_spare = False
        self._policy_from_worker = False
        self._jobs_together = False
        self._readmits_moved_node = False

    # --- what reaches the incident: alerts, the jobs' recoveries, the budget, the operators ---

    @workflow.signal
    def alert(self, alert: NodeFailureAlert) -> None:
        """Every alert for this node joins the incident; the first one starts it."""
        self.alerts([alert])

    @workflow.signal
    def alerts(self, alerts: list[NodeFailureAlert]) -> None:
        """Several alerts at once, as a hook batches them during a storm."""
        self.alert_digest(AlertDigest.model_construct(alerts=alerts, omitted={}))

    @workflow.signal
    def alert_digest(self, digest: AlertDigest) -> None:
        """A flood's alerts, as the hook sends them past the first ones: a sample and counts."""
        node = self._incident.node
        ignored = {a.node for a in digest.alerts if a.node != node}
        if ignored:
            workflow.logger.warning("ignored alerts for %s sent to the incident of %s", sorted(ignored), node)
            digest = digest.model_copy(update={"alerts": [a for a in digest.alerts if a.node == node]})
        self._alerts.add_digest(digest)

    @workflow.signal(name=JOB_REQUEUED)
    def job_requeued(self, heard: JobRequeued) -> None:
        """The job's recovery took the job off this node (workflows/job_recovery.py)."""
        self._job_work.heard_requeued(heard)

    @workflow.signal(name=JOB_RECOVERED)
    def job_recovered(self, heard: JobRecovered) -> None:
        """The job's recovery verified (or failed to verify) the job's restart."""
        self._job_work.heard_recovered(heard)

    @workflow.signal(name=JOB_REQUEUE_FAILED)
    def job_requeue_failed(self, heard: JobRecoveryFailure) -> None:
        self._job_work.heard_failure(heard)

    @workflow.signal(name=LEASE_STATE_SIGNAL)
    def fleet_budget_lease_state(self, state: LeaseState) -> None:
        """The fleet budget's answer to this incident's lease request, and later changes."""
        self._lease.on_state(state)

    @workflow.update
    async def approve(self, decision: OperatorDecision) -> IncidentStatus:
        """An operator lets the step waiting at a gate go ahead."""
        await self._gates.answer_gate("approve", decision)
        return self.status()

    @workflow.update
    async def deny(self, decision: OperatorDecision) -> IncidentStatus:
        """An operator refuses the step waiting at a gate: the node stays fenced, nothing is killed."""
        await self._gates.answer_gate("deny", decision)
        return self.status()

    @approve.validator
    @deny.validator
    def _something_awaits_approval(self, decision: OperatorDecision) -> None:
        if (why := self._gates.why_no_approval()) is not None:
            raise ValueError(why)
        self._gates.operators.still_heard()

    @workflow.update
    async def abort(self, decision: OperatorDecision) -> IncidentStatus:
        """Stop the incident before its next step; the node is left as it is (fenced, if it was)."""
        await self._gates.abort_with(decision, ended=lambda: self._outcome is not None)
        return self.status()

    @abort.validator
    def _still_running(self, decision: OperatorDecision) -> None:
        if (why := self._gates.why_not_abortable(self._outcome is not None)) is not None:
            raise ValueError(why)
        self._gates.operators.still_heard()

    @workflow.query
    def status(self) -> IncidentStatus:
        timeline = self._steps.timeline
        return IncidentStatus(
            incident_id=self._incident.incident_id,
            node=self._incident.node,
            phase=timeline.current,
            xid=self._alerts.first.xid if self._alerts.first else None,
            fault_class=self._classification.fault_class if self._classification else None,
            alerts=self._alerts.kept(),
            alert_counts=self._alerts.counts(),
            phases=timeline.phases,
            actions=self._actions,
            outcome=self._outcome,
            peer_nodes=self._peer_nodes(),
            awaiting_approval=self._gates.awaiting,
            decisions=self._gates.decisions,
        )

    def _peer_nodes(self) -> list[str]:
        return sorted({n for j in self._jobs for n in j.job.nodes if n != self._incident.node})

    # --- the story ------------------------------------------------------------------------------

    @workflow.run
    async def run(self, req: RecoveryRequest) -> IncidentReport:
        self._ask_patches()
        if self._policy_from_worker:
            # A local activity, the run's first command: what follows it asks no patch.
            req = req.model_copy(
                update={
                    "policy": await workflow.execute_local_activity_method(
                        PolicyActivities.incident_policy,
                        req.policy,
                        summary="The worker's policy for this incident",
                        start_to_close_timeout=timedelta(seconds=10),
                        retry_policy=RetryPolicy(maximum_attempts=5),
                    )
                }
            )
        self._notify_enabled = req.policy.notify
        try:
            report = await self._handle(req)
        finally:
            # Whatever the outcome (an abort, a failure): the budget must not wait for the lease
            # to expire. A no-op when no lease was asked for.
            await self._lease.release(self._outcome or "incident ended")
        self._audit.decision(
            "incident_outcome",
            incident=self._incident.incident_id,
            node=self._incident.node,
            reason=report.action,
            result=report.outcome,
        )
        kind = notification_for(report.outcome_kind)
        if kind is not None:
            await self._notify(kind, f"{self._incident.node}: {report.outcome}")
        try:
            # By name: activities/telemetry.py imports this module.
            await workflow.execute_activity(
                "record_incident",
                report,
                summary="Record the incident's metrics (OpenTelemetry)",
                start_to_close_timeout=timedelta(seconds=10),
                retry_policy=RetryPolicy(maximum_attempts=3),
            )
        except ActivityError as err:
            # Metrics never change an incident's outcome.
            workflow.logger.warning("the incident's metrics were not recorded: %s", err.cause)
        await self._audit.flush()
        return report

    def _ask_patches(self) -> None:
        """Every patch is asked here, in the first activation, before the first command. One asked
        after a local activity can land in the next workflow task: a query that arrives as the
        activity ends makes the SDK (1.35) complete the task with the activity's marker, and the
        workflow sees the result in the task after. On replay it sees it in the first task, before
        that task's patches are known, and takes the old path (a nondeterminism error)."""
        workflow.deprecate_patch(FEWER_ROUND_TRIPS)
        workflow.deprecate_patch(FENCE_IN_ONE_TASK)
        self._fence_breaker = workflow.patched(FENCE_BREAKER)
        self._idle_node_keeps_spare = workflow.patched(IDLE_NODE_KEEPS_SPARE)
        self._policy_from_worker = workflow.patched(POLICY_FROM_WORKER)
        self._jobs_together = workflow.patched(JOBS_RECOVERED_TOGETHER)
        self._one_platform_seam = workflow.patched(ONE_PLATFORM_SEAM)
        self._readmits_moved_node = workflow.patched(READMIT_MOVED_NODE)

    async def _handle(self, req: RecoveryRequest) -> IncidentReport:
        # The fence's local activities carry the incident id to Slurm before the first workflow task
        # is recorded: a worker that dies in that task leaves the next to run it again, at a later
        # now(). The run's start time is the same in every attempt.
        incident_id = self._incident.incident_id = f"{req.node}-{workflow.info().workflow_start_time:%Y%m%dT%H%M%SZ}"
        await workflow.wait_condition(lambda: self._alerts.first is not None)
        first = self._alerts.first
        assert first is not None
        policy = req.policy
        self._index.enabled = policy.search_attributes
        first_updates: list[SearchAttributeUpdate] = [sa.NODE.value_set(req.node), sa.XID.value_set(first.xid)]
        if first.gpu:
            first_updates.append(sa.GPU.value_set(first.gpu))
        self._index.update(first_updates, now=False)
        workflow.set_current_details(
            f"Incident {incident_id}: XID {first.xid} on {req.node}, "
            f"reported by {first.actor} via {first.source}: {first.reason}"
        )

        # A local activity: a lookup in the policy table held in memory takes milliseconds, and
        # runs within the incident's first workflow task instead of a round trip through the server.
        cls = self._classification = await self._steps.run(
            "classify",
            workflow.execute_local_activity_method(
                ClassifyActivities.classify_fault,
                first,
                start_to_close_timeout=timedelta(seconds=30),
                summary=f"Classify XID {first.xid} by the fault policy table",
            ),
            abortable=False,
            index_now=False,
        )  # the report needs the classification
        self._steps.note(f"XID {cls.xid} {cls.mnemonic}: {cls.fault_class.value}")
        ctx = ActionContext(
            incident_id=incident_id,
            owner=policy.owner,
            actor=first.actor,
            reason=f"{first.source}: {first.reason}",
            xid=first.xid,
            mnemonic=cls.mnemonic,
            dry_run=policy.dry_run,
        )
        action = IncidentAction.NONE
        try:
            if cls.fault_class == FaultClass.APPLICATION:
                seen = await self._steps.run("count_application_xids", self._count_application_xids(first, policy))
                if seen < policy.application_xid_threshold:
                    return self._finish(first, action, OutcomeKind.NO_NODE_ACTION, "no_node_action", [], None)
                # Repeated on one GPU, an "application" XID points at the GPU: fence, let a person decide.
                action = IncidentAction.FENCE_AND_ESCALATE
                return await self._fence_and_escalate(
                    req,
                    ctx,
                    first,
                    action,
                    f"escalated: {seen} application XIDs on "
                    f"GPU {first.gpu or '(unnamed)'} within "
                    f"{policy.application_xid_window_seconds:.0f} s",
                )
            action = (
                IncidentAction.FENCE_AND_ESCALATE if cls.fault_class == FaultClass.UNKNOWN else IncidentAction.RECOVER
            )
            return await self._recover(req, first, cls, ctx, action)
        except ActivityError as err:
            # A final failure (a node or job Slurm does not know, a deadline passed): the incident
            # ends in an explicit failed state, with the report of what was done before it.
            kind, why = OutcomeKind.FAILED, f"failed in {self._steps.timeline.current}: {cause_of(err)}"
        except JobRecoveryFailed as failed:
            kind, why = OutcomeKind.FAILED, f"failed in {self._steps.timeline.current}: {failed}"
        except FenceHeld as held:
            kind, why = held.kind, str(held)
        except IncidentAborted:
            abort = self._gates.abort
            assert abort is not None
            kind = OutcomeKind.ABORTED
            why = f"aborted by {abort.actor} in {self._steps.timeline.current}: {abort.reason}; node left as it was"
        self._steps.note(why)
        return self._finish(first, action, kind, why, [], None)

    async def _recover(
        self,
        req: RecoveryRequest,
        first: NodeFailureAlert,
        cls: FaultClassification,
        ctx: ActionContext,
        action: IncidentAction,
    ) -> IncidentReport:
        policy, node = req.policy, req.node
        if cls.fault_class == FaultClass.UNKNOWN:
            return await self._fence_and_escalate(req, ctx, first, action, "escalated: unknown XID")
        platform: NodePlatform = (
            self._platform if self._one_platform_seam else self._kubernetes if policy.kubernetes else self._hot_spares
        )
        fence = await self._drain(req, ctx)
        await platform.fence(node, ctx)
        jobs, denied = await self._find_jobs_and_lease(node, policy, first.observed_at - DIED_BEFORE_THE_ALERT)
        if denied is not None:
            return self._finish(
                first,
                action,
                OutcomeKind.DENIED,
                f"denied: over budget ({denied.actor}: {denied.reason}); node stays drained, jobs left running",
                [],
                None,
            )
        await self._checkpoint_first(jobs, cls, policy, ctx)
        large = [s.job.job_id for s in jobs if len(s.job.nodes) >= policy.approval_min_job_nodes]
        if (
            large
            and await self._gates.approval(
                "requeue", policy, f"requeue job(s) {', '.join(map(str, large))} off {node}, stopping their processes"
            )
            == "deny"
        ):
            denied = self._gates.decisions[-1]
            return self._finish(
                first,
                action,
                OutcomeKind.DENIED,
                f"denied: requeue ({denied.actor}: {denied.reason}); node stays drained, jobs left running",
                [],
                None,
            )
        requeued = await self._steps.run(
            "requeue",
            self._job_work.requeue(jobs, node, ctx, policy, self._jobs_together),
            done_at=lambda results: last_action_at([a for r in results for a in r.actions]),
        )
        await self._mark_down(node, fence, ctx)
        await platform.release(ctx)
        no_replacement, spare = await self._replace(node, jobs, platform, ctx, policy)
        if self._readmits_moved_node and jobs and spare is not None and spare.healthy and spare.node == node:
            await self._steps.run("readmit_node", self._job_work.readmit(jobs, node, spare, ctx))
        if policy.dry_run:
            self._steps.skip("verify", "dry-run: no job was requeued")
            intended = sum(not a.executed for a in self._actions)
            return self._finish(
                first, action, OutcomeKind.DRY_RUN, f"dry_run: {intended} action(s) intended, none executed", [], None
            )
        verifications = await self._steps.run(
            "verify",
            self._job_work.verify(jobs, requeued, node, policy.verify_deadline_seconds),
            done_at=_all_verified_at,
        )
        self._steps.note(
            "; ".join(f"job {v.job_id}: {'ok' if v.verified else ', '.join(v.why_not)}" for v in verifications)
        )
        if not fence.owned_by_other:
            await self._steps.run(
                "return_to_service",
                self._start_return_to_service(node, ctx, policy, platform.unfence_node),
            )
        kind, outcome = recovery_outcome(no_replacement, spare, verifications)
        return self._finish(first, action, kind, outcome, verifications, spare)

    # --- the steps of the story -----------------------------------------------------------------

    async def _drain(self, req: RecoveryRequest, ctx: ActionContext) -> NodeFenceResult:
        if req.policy.fleet_budget and not req.policy.dry_run and self._fence_breaker:
            await self._steps.run("breaker", self._pass_breaker(req.node, req.policy), index_now=False)
        await self._notify(
            NotificationKind.INCIDENT_OPENED,
            f"XID {ctx.xid} {ctx.mnemonic} on {req.node} ({ctx.reason}): draining the node",
        )
        fence = await self._steps.run(
            "drain",
            fence_call(
                FencingActivities.drain_node,
                NodeRequest(node=req.node, ctx=ctx),
                f"Drain {req.node} in Slurm: no new work lands on it",
            ),
            index_now=False,
            done_at=lambda drained: drained.action.at,
        )
        self._actions.append(fence.action)
        self._steps.note(fence.action.detail)
        return fence

    async def _pass_breaker(self, node: str, policy: RecoveryPolicy) -> None:
        """The fence circuit breaker's word before the drain. Tripped, the incident is held here,
        nothing drained, until an operator resets the breaker or answers for this node, or until
        fence_hold_seconds pass; then FenceHeld says why the node stays undrained."""
        scope = self._fence_scope = await fence_call(
            FencingActivities.fence_scope, node, f"Read {node}'s Slurm partitions and the cluster's size"
        )
        state = await self._lease.ask_to_fence(self._incident.incident_id, node, scope, in_task=True)
        if state.fence_held:
            hold = timedelta(seconds=policy.fence_hold_seconds)
            self._steps.note(f"held, nothing drained: {state.reason}")
            self._index.update([])  # the phase shows in the Web UI and `recovery list` while it is held
            await self._gates.ask("breaker", f"fence {node} although the fence circuit breaker is tripped", hold)
            state = await self._lease.wait_fence_permitted(stop=lambda: self._gates.answer is not None, timeout=hold)
            answer = self._gates.close()
            if state.fence_held:
                if answer is None:
                    raise FenceHeld(
                        OutcomeKind.HELD,
                        f"held: the fence circuit breaker stayed tripped for {hold.total_seconds():.0f} s; "
                        "nothing was drained",
                    )
                if answer.kind == "deny":
                    raise FenceHeld(
                        OutcomeKind.DENIED,
                        f"denied: fence past the tripped breaker ({answer.actor}: {answer.reason}); "
                        "nothing was drained",
                    )
                state = await self._lease.approve_fence(OperatorDecision(actor=answer.actor, reason=answer.reason))
        self._steps.note(f"fence permitted by {state.granted_by or 'policy'}: {state.reason}")

    async def _fence_and_escalate(
        self, req: RecoveryRequest, ctx: ActionContext, first: NodeFailureAlert, action: IncidentAction, why: str
    ) -> IncidentReport:
        """Drain only: nothing lands on the node, running jobs go on, a person decides the rest."""
        await self._drain(req, ctx)
        return self._finish(first, action, OutcomeKind.ESCALATED, f"{why}: node drained, jobs left running", [], None)

    async def _find_jobs_and_lease(
        self, node: str, policy: RecoveryPolicy, died_since: datetime
    ) -> tuple[list[JobSnapshot], DecisionRecord | None]:
        """The node's jobs (those that died on it since `died_since` too), then the fleet budget's
        lease for them. Returns the jobs, and an operator's denial of the lease (or None)."""
        takes_lease = policy.fleet_budget and not policy.dry_run
        # The budget needs the node's partitions: read (a read only) with its jobs, not after them.
        partitions = (
            _known(self._fence_scope.partitions)
            if self._fence_scope is not None
            else read_partitions(node)
            if takes_lease
            else None
        )
        jobs = self._jobs = await self._steps.run(
            "find_jobs",
            fence_call(
                JobActivities.find_jobs,
                FindJobsRequest(node=node, died_since=died_since),
                f"Find the jobs running on {node}, and those that died on it since just before the alert",
            ),
            index_now=False,
        )
        self._steps.note(", ".join(str(j.job.job_id) for j in jobs) or "no jobs")
        self._index.update(
            [sa.JOB_IDS.value_set([str(j.job.job_id) for j in jobs]), sa.PEER_NODES.value_set(self._peer_nodes())],
            now=False,
        )
        if policy.dry_run:
            self._steps.skip("budget", "dry-run: no lease taken from the fleet disruption budget")
        elif takes_lease:
            return jobs, await self._steps.run("budget", self._take_lease(node, jobs, partitions))
        return jobs, None

    async def _take_lease(
        self, node: str, jobs: list[JobSnapshot], partitions: Awaitable[list[PartitionShare]] | None
    ) -> DecisionRecord | None:
        """The fleet budget's lease, before the first destructive step. Over budget, the incident
        waits here, fenced (drained, nothing killed), until the budget frees up or an operator
        answers (no deadline). Returns an operator's denial, or None once the lease is held.
        `partitions`: the node's partitions being read already, or None to read them now."""
        shares = await (partitions if partitions is not None else read_partitions(node))
        lease = await self._lease.request(
            self._incident.incident_id, node, shares, job_ids=[snap.job.job_id for snap in jobs], in_task=True
        )
        if lease.waiting:
            self._steps.note(f"over budget, waiting drained with nothing killed: {lease.reason}")
            await self._gates.ask(
                "budget",
                f"put {node} under remediation although the fleet disruption budget is spent ({lease.reason})",
                None,
            )
            await self._lease.wait_granted(stop=lambda: self._gates.answer is not None)
            answer = self._gates.close()
            if not self._lease.granted:
                assert answer is not None
                if answer.kind == "deny":
                    return answer
                lease = await self._lease.approve_over_budget(
                    OperatorDecision(actor=answer.actor, reason=answer.reason)
                )
        lease = self._lease.state or lease
        self._steps.note(
            f"lease granted by {lease.granted_by or 'policy'}: {lease.reason}"
            + (
                "; the node is a quarantined lemon: it will not return to service automatically"
                if lease.quarantined
                else ""
            )
        )
        return None

    async def _checkpoint_first(
        self, jobs: list[JobSnapshot], cls: FaultClassification, policy: RecoveryPolicy, ctx: ActionContext
    ) -> None:
        """SIGUSR1 to every job, then, for a degrading fault, the grace period for its checkpoint."""
        await self._steps.run("signal", self._job_work.signal(jobs, ctx), index_now=False)
        if policy.dry_run:
            self._steps.skip("grace", "dry-run: no job was signalled, no checkpoint to wait for")
        elif cls.fault_class == FaultClass.DEGRADING and policy.degrading_grace_seconds > 0:
            await self._steps.run(
                "grace", self._job_work.grace(jobs, policy.degrading_grace_seconds, policy.checkpoint_poll_seconds)
            )
        else:
            self._steps.skip("grace", f"{cls.fault_class.value} XID: the GPU is gone, no checkpoint to wait for")

    async def _mark_down(self, node: str, fence: NodeFenceResult, ctx: ActionContext) -> None:
        if fence.owned_by_other:
            self._steps.skip("mark_down", "left as found: drained by someone else")
            return
        down = await self._steps.run(
            "mark_down",
            workflow.execute_activity_method(
                FencingActivities.mark_node_down,
                NodeRequest(node=node, ctx=ctx),
                summary=f"Mark {node} DOWN in Slurm now that its jobs are off it",
                **SLURM_CALL,
            ),
            done_at=lambda marked: marked.action.at,
        )
        self._actions.append(down.action)
        self._steps.note(down.action.detail)

    async def _replace(
        self,
        node: str,
        jobs: list[JobSnapshot],
        platform: NodePlatform,
        ctx: ActionContext,
        policy: RecoveryPolicy,
    ) -> tuple[str | None, SpareResult | None]:
        """Replacement capacity, where it is wanted and allowed. Returns why there is none (or
        None), and the spare."""
        if (
            self._idle_node_keeps_spare
            and not jobs
            and platform.spares_on_standby
            and policy.spare_nodes
            and not policy.spare_for_idle_node
        ):
            self._steps.skip(
                "request_replacement",
                f"no job was on {node}: the hot spares stay on standby for a "
                "job to resume (spare_for_idle_node is off)",
            )
            return None, None
        if await self._gates.approval("replacement", policy, f"bring in replacement capacity for {node}") == "deny":
            denied = self._gates.decisions[-1]
            no_replacement = f"denied by {denied.actor}: {denied.reason}"
            self._steps.skip("request_replacement", no_replacement)
            return no_replacement, None
        return await platform.replace(node, ctx, policy)

    async def _count_application_xids(self, first: NodeFailureAlert, policy: RecoveryPolicy) -> int:
        """This incident plus the earlier ones for application XIDs on the same GPU in the window."""
        node = self._incident.node
        earlier = await workflow.execute_activity_method(
            ClassifyActivities.count_application_incidents,
            ApplicationXidCountRequest(
                node=node,
                gpu=first.gpu,
                this_run_id=workflow.info().run_id,
                window_seconds=policy.application_xid_window_seconds,
            ),
            summary=f"Count recent application XIDs on {node} GPU {first.gpu or '(unnamed)'}",
            **SLURM_CALL,
        )
        seen = earlier + 1
        self._steps.note(
            f"{seen} of {policy.application_xid_threshold} application XID(s) on GPU "
            f"{first.gpu or '(unnamed)'} within {policy.application_xid_window_seconds:.0f} s"
        )
        return seen

    async def _start_return_to_service(
        self, node: str, ctx: ActionContext, policy: RecoveryPolicy, kubernetes_node: str | None
    ) -> None:
        """Hands the fenced node to a workflow that outlives this incident and resumes the node
        once it is repaired and healthy."""
        workflow_id = return_to_service_workflow_id(ctx.incident_id)
        await workflow.start_child_workflow(
            ReturnToServiceWorkflow.run,
            ReturnToServiceRequest(
                node=node,
                poll_seconds=policy.repair_poll_seconds,
                kubernetes_node=kubernetes_node,
                fleet_budget=policy.fleet_budget,
                lemon=self._lease.state.quarantined if self._lease.state is not None else None,
                give_up_at=workflow.now() + timedelta(seconds=policy.repair_wait_seconds),
                ctx=ctx.model_copy(
                    update={
                        "actor": f"{policy.owner} policy",
                        "reason": f"return to service after repair (incident {ctx.incident_id})",
                    }
                ),
            ),
            id=workflow_id,
            parent_close_policy=ParentClosePolicy.ABANDON,
            static_summary=f"Return {node} to service once repaired",
        )
        self._return_to_service = workflow_id
        self._steps.note(f"{workflow_id} resumes {node} once repaired and healthy")

    async def _notify(self, kind: NotificationKind, summary: str) -> None:
        """Hands a notification to its own workflow and goes on (delivery never holds up a recovery)."""
        if self._notify_enabled:
            await notify(
                Notification(
                    kind=kind,
                    incident_id=self._incident.incident_id,
                    node=self._incident.node,
                    at=workflow.now(),
                    summary=summary[:1000],
                )
            )

    def _finish(
        self,
        first: NodeFailureAlert,
        action: IncidentAction,
        kind: OutcomeKind,
        outcome: str,
        verifications: list[JobVerification],
        spare: SpareResult | None,
    ) -> IncidentReport:
        assert self._classification is not None
        if any(not a.executed for a in self._actions) and kind != OutcomeKind.DRY_RUN:
            kind, outcome = OutcomeKind.DRY_RUN, f"dry_run: {outcome} (nothing executed)"
        self._outcome = outcome
        timeline = self._steps.timeline
        timeline.finish()
        self._index.update([sa.PHASE.value_set("done"), sa.OUTCOME.value_set(outcome_label(outcome))])
        workflow.set_current_details(f"Incident {self._incident.incident_id} on {self._incident.node}: {outcome}")
        return build_report(
            incident_id=self._incident.incident_id,
            node=self._incident.node,
            classification=self._classification,
            action=action,
            outcome=outcome,
            outcome_kind=kind,
            failure_at=first.observed_at,
            phases=timeline.phases,
            jobs=self._jobs,
            verifications=verifications,
            spare=spare,
            alerts=self._alerts.kept(),
            alert_counts=self._alerts.counts(),
            actions=self._actions,
            decisions=self._gates.decisions,
            return_to_service=self._return_to_service,
            failed_together=self._job_work.failed_together,
        )


async def _known(value: T) -> T:
    return value


def _all_verified_at(verifications: list[JobVerification]) -> datetime | None:
    """When the last job was back, if every verification says when."""
    times = [v.verified_at for v in verifications if v.verified_at is not None]
    return max(times) if verifications and len(times) == len(verifications) else None
