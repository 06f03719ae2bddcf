"""NodeRecoveryWorkflow: one durable incident per failed node, deciding what happens and in what
order. Every side effect is an activity (activities/); this module does no I/O.

classify -> pass the fence circuit breaker (tripped: held, nothing drained, for a reset or an
operator) -> drain -> find jobs -> lease from the fleet disruption budget (over budget: wait,
fenced, for the budget or an operator) -> signal -> grace (durable timer, ends early on a new
checkpoint) -> requeue away from the node -> mark down -> request replacement -> wait for a
healthy spare -> verify each job resumed from its latest complete checkpoint -> report; the lease
is returned however the incident ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Literal, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError, WorkflowAlreadyStartedError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.budget import BudgetActivities
    from activities.fencing import FencingActivities
    from activities.job_recovery import JobRecoveryActivities
    from activities.jobs import JobActivities
    from activities.kubernetes import KubernetesActivities
    from activities.policy import PolicyActivities
    from activities.replacement import ReplacementActivities
    from activities.xid_policy import ClassifyActivities
    from backends.replacement import HotSparePool
    from contracts import search_attributes as sa
    from contracts.audit import ActorKind
    from contracts.budget import FenceScope, LeaseState, Notification, NotificationKind, PartitionShare
    from contracts.kubernetes import (
        EvictRequest,
        K8sNodeRequest,
        K8sReplacementRequest,
        K8sSpareWaitRequest,
        SlurmdPod,
        SlurmdPodRequest,
    )
    from contracts.models import (
        ActionContext,
        ActionRecord,
        AlertDigest,
        ApplicationXidCountRequest,
        ApprovalGate,
        ApprovalRequest,
        CheckpointWaitRequest,
        DecisionRecord,
        FaultClass,
        FaultClassification,
        Gate,
        IncidentReport,
        IncidentStatus,
        JobJoin,
        JobRecovered,
        JobRecoveryFailure,
        JobRequeued,
        JobSnapshot,
        JobVerification,
        NodeFailureAlert,
        NodeFenceResult,
        NodeRequest,
        OperatorDecision,
        PeerIncident,
        Phase,
        RecoveryPolicy,
        RecoveryRequest,
        ReplacementRequest,
        ReplacementResult,
        RequeueRequest,
        RequeueResult,
        ReturnToServiceRequest,
        SignalRequest,
        SpareResult,
        SpareWaitRequest,
        VerifyRequest,
    )
    from contracts.search_attributes import outcome_label
    from workflows.alert_log import AlertLog
    from workflows.audit_trail import AuditTrail
    from workflows.budget_lease import BUDGET_CALL, LEASE_STATE_SIGNAL, BudgetLease
    from workflows.call_options import (
        HEARTBEAT,
        JOB_REQUEUE_WAIT,
        K8S_CALL,
        K8S_EVICTION,
        K8S_HEARTBEAT,
        K8S_REPLACEMENT,
        K8S_RETRY,
        SLURM_CALL,
        SLURM_QUICK_TRY,
        SLURM_RETRY,
        failed_for_good,
        failing_as_activity,
    )
    from workflows.job_recovery import JOB_RECOVERED, JOB_REQUEUE_FAILED, JOB_REQUEUED
    from workflows.notify import notify
    from workflows.operator_check import OperatorCheck
    from workflows.report import build_report
    from workflows.return_to_service import ReturnToServiceWorkflow, return_to_service_workflow_id
    from workflows.spare_claim import SpareClaimWorkflow, spare_claim_workflow_id

T = TypeVar("T")

# Runs that start on this code take fewer round trips through the server: classify as a local
# activity, search attributes upserted together, the jobs signalled and requeued at once, the
# node's partitions read alongside its jobs. Runs begun before keep their path (docs/upgrades.md).
FEWER_ROUND_TRIPS = "fewer-round-trips"
# Runs that start on this code claim each hot spare through SpareClaimWorkflow (one claim per
# spare at a time, across workers); runs begun before keep the single request_replacement call.
SPARE_CLAIM_LOCK = "spare-claim-lock"
# Runs that start on this code take the quarantined spares from the lease's answer, not a query.
LEMONS_FROM_LEASE = "lemons-from-lease"
# Runs that start on this code fence the node in their first workflow task: the drain, the read of
# its jobs and partitions and the lease request are local activities, as are the signals (in the
# same task when the budget grants the lease in its update's reply, else in the task that hears the
# grant by signal). Each was a round trip through the server (a workflow task, a task-queue
# dispatch, three history events) before the first signal; runs begun before keep them.
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
# A spare another incident is claiming is tried again after its claim ends: every so often, a few times.
CLAIM_BUSY_WAIT = timedelta(seconds=1)
CLAIM_BUSY_PASSES = 10


def incident_workflow_id(node: str) -> str:
    """One incident per node: a second alert for the node reaches the running incident."""
    return f"node-recovery-{node}"


@workflow.defn
class NodeRecoveryWorkflow:
    @workflow.init
    def __init__(self, req: RecoveryRequest) -> None:
        self._incident_id = ""
        self._node = req.node  # known before the first signal: only this node's alerts are kept
        self._phase = "starting"
        self._alerts = AlertLog()
        self._phases: list[Phase] = []
        self._actions: list[ActionRecord] = []
        self._classification: FaultClassification | None = None
        self._jobs: list[JobSnapshot] = []
        self._outcome: str | None = None
        self._indexed = True
        self._unindexed: dict[str, SearchAttributeUpdate] = {}
        self._awaiting: ApprovalRequest | None = None
        self._answer: DecisionRecord | None = None
        self._abort: DecisionRecord | None = None
        self._decisions: list[DecisionRecord] = []
        self._return_to_service: str | None = None
        self._lease = BudgetLease()
        self._audit = AuditTrail()
        self._operators = OperatorCheck(self._audit)
        self._notify_enabled = False
        self._fewer_round_trips = False
        self._fence_in_one_task = False
        self._fence_breaker = False
        self._idle_node_keeps_spare = False
        self._policy_from_worker = False
        self._jobs_together = False
        # The jobs' recoveries (JOBS_RECOVERED_TOGETHER), by job id: joined, and what they told.
        self._joining: set[int] = set()
        self._job_recoveries: dict[int, JobRequeued] = {}
        self._job_recovered: dict[int, JobRecovered] = {}
        self._job_failures: dict[int, JobRecoveryFailure] = {}
        self._failed_together: dict[int, list[PeerIncident]] = {}
        self._fence_scope: FenceScope | None = None

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
        ignored = {a.node for a in digest.alerts if a.node != self._node}
        if ignored:
            workflow.logger.warning("ignored alerts for %s sent to the incident of %s", sorted(ignored), self._node)
            digest = digest.model_copy(update={"alerts": [a for a in digest.alerts if a.node == self._node]})
        self._alerts.add_digest(digest)

    @workflow.signal(name=JOB_REQUEUED)
    def job_requeued(self, heard: JobRequeued) -> None:
        """The job's recovery took the job off this node (workflows/job_recovery.py)."""
        if heard.requeue.job_id in self._joining:  # one answer kept per job, whoever signals
            self._job_recoveries[heard.requeue.job_id] = heard

    @workflow.signal(name=JOB_RECOVERED)
    def job_recovered(self, heard: JobRecovered) -> None:
        """The job's recovery verified (or failed to verify) the job's restart."""
        if heard.requeue.job_id in self._joining:
            self._job_recovered[heard.requeue.job_id] = heard

    @workflow.signal(name=JOB_REQUEUE_FAILED)
    def job_requeue_failed(self, heard: JobRecoveryFailure) -> None:
        if heard.job_id in self._joining:
            self._job_failures[heard.job_id] = heard

    @workflow.signal(name=LEASE_STATE_SIGNAL)
    def fleet_budget_lease_state(self, state: LeaseState) -> None:
        """The fleet budget's answer to this incident's lease request, and later changes."""
        self._lease.on_state(state)

    @workflow.update
    async def approve(self, decision: OperatorDecision) -> IncidentStatus:
        """An operator lets the step waiting at a gate go ahead."""
        return await self._answer_gate("approve", decision)

    @workflow.update
    async def deny(self, decision: OperatorDecision) -> IncidentStatus:
        """An operator refuses the step waiting at a gate: the node stays fenced, nothing is killed."""
        return await self._answer_gate("deny", decision)

    @approve.validator
    @deny.validator
    def _something_awaits_approval(self, decision: OperatorDecision) -> None:
        if (why := self._why_no_approval()) is not None:
            raise ValueError(why)
        self._operators.still_heard()

    def _why_no_approval(self) -> str | None:
        if self._awaiting is None or self._answer is not None:
            return f"incident {self._incident_id or self._node} awaits no approval (phase {self._phase})"
        return None

    async def _answer_gate(self, kind: Literal["approve", "deny"], decision: OperatorDecision) -> IncidentStatus:
        assert self._awaiting is not None
        key = await self._operators.verified(
            kind,
            decision.actor,
            decision.reason,
            decision.signature,
            self._awaiting.gate,
            incident=self._incident_id,
            node=self._node,
        )
        if (why := self._why_no_approval()) is not None:  # answered while it was verified
            raise ApplicationError(why, type="NothingAwaitsApproval", non_retryable=True)
        self._answer = self._decide(kind, decision, key)
        return self.status()

    @workflow.update
    async def abort(self, decision: OperatorDecision) -> IncidentStatus:
        """Stop the incident before its next step; the node is left as it is (fenced, if it was)."""
        key = await self._operators.verified(
            "abort", decision.actor, decision.reason, decision.signature, incident=self._incident_id, node=self._node
        )
        if (why := self._why_not_abortable()) is not None:
            raise ApplicationError(why, type="NotAbortable", non_retryable=True)
        self._abort = self._decide("abort", decision, key)
        return self.status()

    @abort.validator
    def _still_running(self, decision: OperatorDecision) -> None:
        if (why := self._why_not_abortable()) is not None:
            raise ValueError(why)
        self._operators.still_heard()

    def _why_not_abortable(self) -> str | None:
        if self._outcome is not None or self._abort is not None:
            return f"incident {self._incident_id or self._node} has already ended or been aborted"
        return None

    def _decide(
        self, kind: Literal["approve", "deny", "abort"], decision: OperatorDecision, key: str | None
    ) -> DecisionRecord:
        record = DecisionRecord(
            at=workflow.now(),
            kind=kind,
            gate=self._awaiting.gate if self._awaiting else None,
            actor=decision.actor,
            reason=decision.reason,
            verified_by=key,
        )
        self._record_decision(record, "operator")
        return record

    def _record_decision(self, record: DecisionRecord, actor_kind: ActorKind) -> None:
        self._decisions.append(record)
        self._audit.decision(
            record.kind + (f"_{record.gate}" if record.gate else ""),
            incident=self._incident_id,
            node=self._node,
            reason=record.reason,
            result=record.kind,
            actor=record.actor,
            actor_kind=actor_kind,
            parameters={"verified_by": record.verified_by} if record.verified_by else None,
        )

    @workflow.query
    def status(self) -> IncidentStatus:
        return IncidentStatus(
            incident_id=self._incident_id,
            node=self._node,
            phase=self._phase,
            xid=self._alerts.first.xid if self._alerts.first else None,
            fault_class=self._classification.fault_class if self._classification else None,
            alerts=self._alerts.kept(),
            alert_counts=self._alerts.counts(),
            phases=self._phases,
            actions=self._actions,
            outcome=self._outcome,
            peer_nodes=self._peer_nodes(),
            awaiting_approval=self._awaiting,
            decisions=self._decisions,
        )

    def _peer_nodes(self) -> list[str]:
        return sorted({n for j in self._jobs for n in j.job.nodes if n != self._node})

    async def _step(self, name: str, work: Awaitable[T], abortable: bool = True, index_now: bool = True) -> T:
        """One phase of the incident. `index_now=False` for a step that ends within the workflow
        task it starts in (a local activity): its phase goes with the next step's upsert."""
        phase = Phase(name=name, started_at=workflow.now())
        self._phases.append(phase)
        self._phase = name
        self._index([sa.PHASE.value_set(name)], now=index_now)
        try:
            return await (self._unless_aborted(work) if abortable else work)
        finally:
            phase.ended_at = workflow.now()

    async def _unless_aborted(self, work: Awaitable[T]) -> T:
        """The step's result, or IncidentAborted as soon as an operator aborts (the step's
        activity is cancelled; a call already sent to Slurm may still complete)."""
        if self._abort is not None:
            raise IncidentAborted()
        task = asyncio.ensure_future(work)
        await workflow.wait_condition(lambda: task.done() or self._abort is not None)
        if not task.done():
            task.cancel()
            raise IncidentAborted()
        return task.result()

    async def _gate(self, gate: ApprovalGate, question: str, policy: RecoveryPolicy) -> DecisionRecord:
        """Waits for an operator's approve/deny; unanswered by the deadline, the policy decides."""
        await self._ask(gate, question, timedelta(seconds=policy.approval_timeout_seconds))
        try:
            await workflow.wait_condition(
                lambda: self._answer is not None, timeout=timedelta(seconds=policy.approval_timeout_seconds)
            )
        except asyncio.TimeoutError:
            self._answer = DecisionRecord(
                at=workflow.now(),
                kind=policy.approval_timeout_action,
                gate=gate,
                actor="policy",
                reason=f"no answer within {policy.approval_timeout_seconds:.0f} s: "
                f"{policy.approval_timeout_action} by default",
            )
            self._record_decision(self._answer, "policy")
        answer, self._awaiting = self._answer, None
        assert answer is not None
        self._note(f"{answer.kind} by {answer.actor}: {answer.reason}")
        return answer

    async def _ask(self, gate: Gate, question: str, deadline: timedelta | None) -> None:
        """Opens a gate: approve/deny are accepted from now on, and the operators hear of it."""
        now = workflow.now()
        self._answer = None
        self._awaiting = ApprovalRequest(
            gate=gate, question=question, asked_at=now, deadline_at=now + deadline if deadline is not None else None
        )
        workflow.set_current_details(
            f"Awaiting approval ({gate}): {question}. Answer with `recovery approve|deny {self._node}`."
        )
        await self._notify(NotificationKind.APPROVAL_NEEDED, f"{gate}: {question}")

    async def _take_lease(
        self, node: str, jobs: list[JobSnapshot], partitions: Awaitable[list[PartitionShare]] | None
    ) -> DecisionRecord | None:
        """The fleet budget's lease, before the first destructive step. Over budget, the incident
        waits here, fenced (drained, nothing killed), until the budget frees up or an operator
        answers (no deadline). Returns an operator's denial, or None once the lease is held.
        `partitions`: the node's partitions being read already, or None to read them now."""
        shares = await (partitions if partitions is not None else self._read_partitions(node))
        lease = await self._lease.request(
            self._incident_id, node, shares, job_ids=[snap.job.job_id for snap in jobs], in_task=self._fence_in_one_task
        )
        if lease.waiting:
            self._note(f"over budget, waiting drained with nothing killed: {lease.reason}")
            await self._ask(
                "budget",
                f"put {node} under remediation although the fleet disruption budget is spent ({lease.reason})",
                None,
            )
            await self._lease.wait_granted(stop=lambda: self._answer is not None)
            answer, self._awaiting = self._answer, None
            if not self._lease.granted:
                assert answer is not None
                if answer.kind == "deny":
                    return answer
                lease = await self._lease.approve_over_budget(
                    OperatorDecision(actor=answer.actor, reason=answer.reason)
                )
        lease = self._lease.state or lease
        self._note(
            f"lease granted by {lease.granted_by or 'policy'}: {lease.reason}"
            + (
                "; the node is a quarantined lemon: it will not return to service automatically"
                if lease.quarantined
                else ""
            )
        )
        return None

    async def _pass_breaker(self, node: str, policy: RecoveryPolicy) -> str | None:
        """The fence circuit breaker's word before the drain. Tripped, the incident is held here,
        nothing drained, until an operator resets the breaker or answers for this node, or until
        fence_hold_seconds pass. Returns why the node stays undrained, or None: fence it."""
        scope = self._fence_scope = await self._fence_call(
            FencingActivities.fence_scope, node, f"Read {node}'s Slurm partitions and the cluster's size"
        )
        state = await self._lease.ask_to_fence(self._incident_id, node, scope, in_task=self._fence_in_one_task)
        if state.fence_held:
            hold = timedelta(seconds=policy.fence_hold_seconds)
            self._note(f"held, nothing drained: {state.reason}")
            self._index([])  # the phase shows in the Web UI and `recovery list` while it is held
            await self._ask("breaker", f"fence {node} although the fence circuit breaker is tripped", hold)
            state = await self._lease.wait_fence_permitted(stop=lambda: self._answer is not None, timeout=hold)
            answer, self._awaiting = self._answer, None
            if state.fence_held:
                if answer is None:
                    return (
                        f"held: the fence circuit breaker stayed tripped for {hold.total_seconds():.0f} s; "
                        "nothing was drained"
                    )
                if answer.kind == "deny":
                    return (
                        f"denied: fence past the tripped breaker ({answer.actor}: {answer.reason}); nothing was drained"
                    )
                state = await self._lease.approve_fence(OperatorDecision(actor=answer.actor, reason=answer.reason))
        self._note(f"fence permitted by {state.granted_by or 'policy'}: {state.reason}")
        return None

    def _read_partitions(self, node: str) -> Awaitable[list[PartitionShare]]:
        return self._fence_call(
            FencingActivities.partition_shares, node, f"Read {node}'s Slurm partitions and their sizes", at_once=True
        )

    def _fence_call(
        self, activity: Callable[..., Awaitable[T]], arg: object, summary: str, at_once: bool = False
    ) -> Awaitable[T]:
        """A Slurm call of the fence, up to the first signal: tried first as a local activity in
        runs since FENCE_IN_ONE_TASK (see _locally_first), an activity in runs before. Scheduled
        when awaited, or `at_once` (to run alongside what follows)."""
        if not self._fence_in_one_task:
            call = workflow.start_activity_method if at_once else workflow.execute_activity_method
            return call(activity, arg, summary=summary, **SLURM_CALL)
        tried = (
            workflow.start_local_activity_method(activity, arg, summary=summary, **SLURM_QUICK_TRY) if at_once else None
        )
        work = self._locally_first(activity, arg, summary, tried)
        return asyncio.ensure_future(work) if at_once else work

    async def _locally_first(
        self, activity: Callable[..., Awaitable[T]], arg: object, summary: str, tried: Awaitable[T] | None
    ) -> T:
        """The call as a local activity, within the workflow task (a worker that dies mid-task
        leaves the next one to run it again: each is idempotent), as often as SLURM_QUICK_TRY
        allows. Still failing then (Slurm down or refusing), the call is made again as an
        activity, with SLURM_CALL's ten minutes of retries timed by the server; a failure for good
        (a node Slurm does not know) is not tried again."""
        try:
            return await failing_as_activity(
                activity.__name__,
                tried or workflow.execute_local_activity_method(activity, arg, summary=summary, **SLURM_QUICK_TRY),
            )
        except ActivityError as err:
            if failed_for_good(err, SLURM_RETRY):
                raise
        return await workflow.execute_activity_method(activity, arg, summary=summary, **SLURM_CALL)

    async def _notify(self, kind: NotificationKind, summary: str) -> None:
        """Hands a notification to its own workflow and goes on (delivery never holds up a recovery)."""
        if self._notify_enabled:
            await notify(
                Notification(
                    kind=kind, incident_id=self._incident_id, node=self._node, at=workflow.now(), summary=summary[:1000]
                )
            )

    def _index(self, updates: list[SearchAttributeUpdate], now: bool = True) -> None:
        """Upserts the search attributes with those kept since the last upsert; now=False keeps
        them for the next one (runs begun before FEWER_ROUND_TRIPS upsert at once). Every upsert
        is a command, a history event and a visibility write."""
        if not self._indexed:
            return
        self._unindexed.update((update.key.name, update) for update in updates)
        if now or not self._fewer_round_trips:
            workflow.upsert_search_attributes(list(self._unindexed.values()))
            self._unindexed = {}

    def _note(self, result: str) -> None:
        self._phases[-1].result = result

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
            "incident_outcome", incident=self._incident_id, node=self._node, reason=report.action, result=report.outcome
        )
        kind = _notification_for(report.outcome)
        if kind is not None:
            await self._notify(kind, f"{self._node}: {report.outcome}")
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
        self._fewer_round_trips = workflow.patched(FEWER_ROUND_TRIPS)
        self._fence_in_one_task = workflow.patched(FENCE_IN_ONE_TASK)
        self._fence_breaker = workflow.patched(FENCE_BREAKER)
        self._idle_node_keeps_spare = workflow.patched(IDLE_NODE_KEEPS_SPARE)
        self._policy_from_worker = workflow.patched(POLICY_FROM_WORKER)
        self._jobs_together = workflow.patched(JOBS_RECOVERED_TOGETHER)

    async def _handle(self, req: RecoveryRequest) -> IncidentReport:
        # The fence's local activities carry the incident id to Slurm before the first workflow task
        # is recorded: a worker that dies in that task leaves the next to run it again, at a later
        # now(). The run's start time is the same in every attempt; runs begun before keep now().
        opened = workflow.info().workflow_start_time if self._fence_in_one_task else workflow.now()
        self._incident_id = f"{req.node}-{opened:%Y%m%dT%H%M%SZ}"
        await workflow.wait_condition(lambda: self._alerts.first is not None)
        first = self._alerts.first
        assert first is not None
        policy = req.policy
        self._indexed = policy.search_attributes
        first_updates: list[SearchAttributeUpdate] = [sa.NODE.value_set(req.node), sa.XID.value_set(first.xid)]
        self._index(first_updates + ([sa.GPU.value_set(first.gpu)] if first.gpu else []), now=False)
        workflow.set_current_details(
            f"Incident {self._incident_id}: XID {first.xid} on {req.node}, "
            f"reported by {first.actor} via {first.source}: {first.reason}"
        )

        # A local activity: a lookup in the policy table held in memory takes milliseconds, and
        # runs within the incident's first workflow task instead of a round trip through the server.
        classify = (
            workflow.execute_local_activity_method if self._fewer_round_trips else workflow.execute_activity_method
        )
        cls = self._classification = await self._step(
            "classify",
            classify(
                ClassifyActivities.classify_fault,
                first,
                start_to_close_timeout=timedelta(seconds=30),
                summary=f"Classify XID {first.xid} by the fault policy table",
            ),
            abortable=False,
            index_now=False,
        )  # the report needs the classification
        self._note(f"XID {cls.xid} {cls.mnemonic}: {cls.fault_class.value}")
        ctx = ActionContext(
            incident_id=self._incident_id,
            owner=policy.owner,
            actor=first.actor,
            reason=f"{first.source}: {first.reason}",
            xid=first.xid,
            mnemonic=cls.mnemonic,
            dry_run=policy.dry_run,
        )
        action = "none"
        try:
            if cls.fault_class == FaultClass.APPLICATION:
                seen = await self._step("count_application_xids", self._count_application_xids(first, policy))
                if seen < policy.application_xid_threshold:
                    return self._finish(first, action, "no_node_action", [], None)
                # Repeated on one GPU, an "application" XID points at the GPU: fence, let a person decide.
                action = "fence_and_escalate"
                return await self._fence_and_escalate(
                    req,
                    ctx,
                    first,
                    action,
                    f"escalated: {seen} application XIDs on "
                    f"GPU {first.gpu or '(unnamed)'} within "
                    f"{policy.application_xid_window_seconds:.0f} s",
                )
            action = "fence_and_escalate" if cls.fault_class == FaultClass.UNKNOWN else "recover"
            return await self._recover(req, first, cls, ctx, action)
        except ActivityError as err:
            # A final failure (a node or job Slurm does not know, a deadline passed): the incident
            # ends in an explicit failed state, with the report of what was done before it.
            why = f"failed in {self._phase}: {_cause(err)}"
        except JobRecoveryFailed as failed:
            why = f"failed in {self._phase}: {failed}"
        except FenceHeld as held:
            why = str(held)
        except IncidentAborted:
            assert self._abort is not None
            why = f"aborted by {self._abort.actor} in {self._phase}: {self._abort.reason}; node left as it was"
        self._note(why)
        return self._finish(first, action, why, [], None)

    async def _recover(
        self, req: RecoveryRequest, first: NodeFailureAlert, cls: FaultClassification, ctx: ActionContext, action: str
    ) -> IncidentReport:
        policy = req.policy
        if cls.fault_class == FaultClass.UNKNOWN:
            return await self._fence_and_escalate(req, ctx, first, action, "escalated: unknown XID")
        fence = await self._drain(req, ctx)
        pod, fenced_at = (await self._fence_on_kubernetes(req.node, ctx)) if policy.kubernetes else (None, None)

        takes_lease = policy.fleet_budget and not policy.dry_run
        # The budget needs the node's partitions: read (a read only) with its jobs, not after them.
        partitions = (
            _known(self._fence_scope.partitions)
            if self._fence_scope is not None
            else self._read_partitions(req.node)
            if takes_lease and self._fewer_round_trips
            else None
        )
        jobs = self._jobs = await self._step(
            "find_jobs",
            self._fence_call(
                JobActivities.find_jobs,
                req.node,
                f"Find the jobs running on {req.node}",
            ),
            index_now=not self._fence_in_one_task,
        )
        self._note(", ".join(str(j.job.job_id) for j in jobs) or "no jobs")
        self._index(
            [sa.JOB_IDS.value_set([str(j.job.job_id) for j in jobs]), sa.PEER_NODES.value_set(self._peer_nodes())],
            now=False,
        )
        if policy.dry_run:
            self._skip("budget", "dry-run: no lease taken from the fleet disruption budget")
        elif takes_lease:
            denied = await self._step("budget", self._take_lease(req.node, jobs, partitions))
            if denied is not None:
                return self._finish(
                    first,
                    action,
                    f"denied: over budget ({denied.actor}: {denied.reason}); node stays drained, jobs left running",
                    [],
                    None,
                )

        await self._step("signal", self._signal_jobs(jobs, ctx), index_now=not self._fence_in_one_task)
        if policy.dry_run:
            self._skip("grace", "dry-run: no job was signalled, no checkpoint to wait for")
        elif cls.fault_class == FaultClass.DEGRADING and policy.degrading_grace_seconds > 0:
            await self._step("grace", self._grace(jobs, policy.degrading_grace_seconds, policy.checkpoint_poll_seconds))
        else:
            self._skip("grace", f"{cls.fault_class.value} XID: the GPU is gone, no checkpoint to wait for")

        large = [s.job.job_id for s in jobs if len(s.job.nodes) >= policy.approval_min_job_nodes]
        if (
            large
            and await self._approval(
                "requeue",
                policy,
                f"requeue job(s) {', '.join(map(str, large))} off {req.node}, stopping their processes",
            )
            == "deny"
        ):
            return self._finish(
                first,
                action,
                f"denied: requeue ({self._decisions[-1].actor}: "
                f"{self._decisions[-1].reason}); node stays drained, jobs left running",
                [],
                None,
            )
        requeued = await self._step("requeue", self._requeue(jobs, req.node, ctx, policy))
        if fence.owned_by_other:
            self._skip("mark_down", "left as found: drained by someone else")
        else:
            down = await self._step(
                "mark_down",
                workflow.execute_activity_method(
                    FencingActivities.mark_node_down,
                    NodeRequest(node=req.node, ctx=ctx),
                    summary=f"Mark {req.node} DOWN in Slurm now that its jobs are off it",
                    **SLURM_CALL,
                ),
            )
            self._actions.append(down.action)
            self._note(down.action.detail)

        if pod is not None:
            await self._step("evict_slurmd_pod", self._evict(pod, ctx))

        if (
            self._idle_node_keeps_spare
            and not jobs
            and pod is None
            and policy.spare_nodes
            and not policy.spare_for_idle_node
        ):
            no_replacement, spare = None, None
            self._skip(
                "request_replacement",
                f"no job was on {req.node}: the hot spares stay on standby for a "
                "job to resume (spare_for_idle_node is off)",
            )
        elif await self._approval("replacement", policy, f"bring in replacement capacity for {req.node}") == "deny":
            denied = self._decisions[-1]
            no_replacement, spare = f"denied by {denied.actor}: {denied.reason}", None
            self._skip("request_replacement", no_replacement)
        elif pod is not None:
            assert fenced_at is not None  # found with the pod
            no_replacement, spare = await self._replace_on_kubernetes(pod, fenced_at, ctx, policy)
        else:
            no_replacement, spare = await self._replace_with_hot_spare(req.node, ctx, policy)
        if policy.dry_run:
            self._skip("verify", "dry-run: no job was requeued")
            intended = sum(not a.executed for a in self._actions)
            return self._finish(first, action, f"dry_run: {intended} action(s) intended, none executed", [], None)

        verifications = await self._step(
            "verify", self._verify(jobs, requeued, req.node, policy.verify_deadline_seconds)
        )
        self._note("; ".join(f"job {v.job_id}: {'ok' if v.verified else ', '.join(v.why_not)}" for v in verifications))
        outcome = _outcome(no_replacement, spare, verifications)
        if not fence.owned_by_other:
            await self._step(
                "return_to_service",
                self._start_return_to_service(req.node, ctx, policy, pod.node if pod is not None else None),
            )
        return self._finish(first, action, outcome, verifications, spare)

    async def _replace_with_hot_spare(
        self, node: str, ctx: ActionContext, policy: RecoveryPolicy
    ) -> tuple[str | None, SpareResult | None]:
        """Bare Slurm: claim and resume a hot spare, then wait until it is healthy. Returns why
        there is no replacement (or None), and the spare. A quarantined lemon is never claimed."""
        lemons = await self._quarantined_spares(policy) if policy.fleet_budget and policy.spare_nodes else []
        request = ReplacementRequest(
            failed_node=node, spare_nodes=[s for s in policy.spare_nodes if s not in lemons], ctx=ctx
        )
        replacement = await self._step(
            "request_replacement",
            self._claim_spare(request)
            if workflow.patched(SPARE_CLAIM_LOCK)
            else workflow.execute_activity_method(
                ReplacementActivities.request_replacement,
                request,
                summary=f"Request replacement capacity for {node}",
                **SLURM_CALL,
            ),
        )
        self._actions.extend(replacement.actions)
        self._note(
            f"{replacement.provider}: {replacement.node or 'none'} ({replacement.detail})"
            + (f"; quarantined spares passed over: {', '.join(lemons)}" if lemons else "")
        )
        if replacement.node is None:
            return replacement.detail, None
        if policy.dry_run:
            self._skip("wait_for_spare", "dry-run: no spare was brought in")
            return None, None
        spare = await self._step(
            "wait_for_spare",
            workflow.execute_activity_method(
                ReplacementActivities.wait_for_spare,
                SpareWaitRequest(node=replacement.node, deadline_seconds=policy.spare_wait_seconds),
                summary=f"Wait for {replacement.node} to be healthy and in service",
                start_to_close_timeout=timedelta(seconds=policy.spare_wait_seconds + 60),
                heartbeat_timeout=HEARTBEAT,
                retry_policy=SLURM_RETRY,
            ),
        )
        self._note(spare.detail)
        return None, spare

    async def _quarantined_spares(self, policy: RecoveryPolicy) -> list[str]:
        """The spares that are quarantined lemons. Runs that start on this code take them from the
        lease's answer (the lemons when the budget last told it), not from a query per incident:
        a spare quarantined since has had an incident of its own, which took it off standby; one
        released since is passed over this once. Without a lease (dry-run), or from a budget that
        does not say, the budget is asked."""
        told = self._lease.state.lemons if self._lease.state is not None else None
        if told is not None and workflow.patched(LEMONS_FROM_LEASE):
            return [spare for spare in policy.spare_nodes if spare in told]
        return await workflow.execute_activity_method(
            BudgetActivities.quarantined_among,
            policy.spare_nodes,
            summary="Which hot spares are quarantined lemons",
            **BUDGET_CALL,
        )

    async def _claim_spare(self, request: ReplacementRequest) -> ReplacementResult:
        """Try the spares in order, each through its own SpareClaimWorkflow (workflows/spare_claim.py);
        one another incident is claiming at the moment is tried again once that claim has ended."""
        actions: list[ActionRecord] = []
        detail = f"no hot spare on standby among {', '.join(request.spare_nodes) or 'none configured'}"
        to_try, busy = list(request.spare_nodes), list[str]()
        for _ in range(CLAIM_BUSY_PASSES):
            busy = []
            for spare in to_try:
                try:
                    tried = await workflow.execute_child_workflow(
                        SpareClaimWorkflow.run,
                        request.model_copy(update={"spare_nodes": [spare]}),
                        id=spare_claim_workflow_id(workflow.info().task_queue, spare),
                        static_summary=f"Claim hot spare {spare} for {request.failed_node}",
                    )
                except WorkflowAlreadyStartedError:
                    busy.append(spare)
                    continue
                except ChildWorkflowError as err:  # the claim's final failure is the step's
                    raise (err.cause if isinstance(err.cause, ActivityError) else err) from None
                actions.extend(tried.actions)
                if tried.node is not None:
                    return tried.model_copy(update={"actions": actions})
                detail = tried.detail
            if not busy:
                break
            to_try = busy
            await workflow.sleep(CLAIM_BUSY_WAIT)
        if busy:
            detail = f"{detail}; still being claimed by other incidents: {', '.join(busy)}"
        return ReplacementResult(node=None, provider=HotSparePool.name, actions=actions, detail=detail)

    async def _fence_on_kubernetes(self, node: str, ctx: ActionContext) -> tuple[SlurmdPod, datetime]:
        """Slurm on Kubernetes: find the slurmd pod that is this Slurm node, then cordon, taint and
        mark the Node under it. Returns the pod and when the fence began (replacements are newer)."""
        pod = await self._step(
            "locate_slurmd_pod",
            workflow.execute_activity_method(
                KubernetesActivities.locate_slurmd_pod,
                SlurmdPodRequest(slurm_node=node),
                summary=f"Find the slurmd pod of {node} and its Kubernetes Node",
                **K8S_CALL,
            ),
        )
        self._note(f"{pod.namespace}/{pod.name} on Node {pod.node or '(unscheduled)'}")
        if pod.node is None:
            self._skip("fence_k8s_node", "the slurmd pod is not on any Node")
            return pod, workflow.now()
        fence = await self._step(
            "fence_k8s_node",
            workflow.execute_activity_method(
                KubernetesActivities.fence_k8s_node,
                K8sNodeRequest(node=pod.node, ctx=ctx),
                summary=f"Cordon and taint Node {pod.node}, set its condition",
                **K8S_CALL,
            ),
        )
        self._actions.extend(fence.actions)
        self._note("; ".join(a.detail for a in fence.actions) or "already fenced by this incident")
        return pod, fence.prior.fenced_at if fence.prior else workflow.now()

    async def _evict(self, pod: SlurmdPod, ctx: ActionContext) -> None:
        """Only now that Slurm shows the node drained and its jobs requeued (the activity reads
        Slurm again before evicting and refuses otherwise; unreadable Slurm fails closed)."""
        evicted = await workflow.execute_activity_method(
            KubernetesActivities.evict_slurmd_pod,
            EvictRequest(pod=pod, ctx=ctx),
            summary=f"Evict slurmd pod {pod.namespace}/{pod.name} from Node {pod.node}",
            **K8S_EVICTION,
        )
        self._actions.extend(evicted.actions)
        self._note(evicted.detail)

    async def _replace_on_kubernetes(
        self, pod: SlurmdPod, since: datetime, ctx: ActionContext, policy: RecoveryPolicy
    ) -> tuple[str | None, SpareResult | None]:
        """Ask the configured provider (NodeSet, node lifecycle or HTTP) for capacity, then wait
        for a new slurmd pod on a healthy Node, registered and idle in Slurm."""
        replacement = await self._step(
            "request_replacement",
            workflow.execute_activity_method(
                KubernetesActivities.request_k8s_replacement,
                K8sReplacementRequest(failed_node=pod.node or "", slurm_node=pod.slurm_node, ctx=ctx),
                summary=f"Request replacement capacity for Node {pod.node}",
                **K8S_REPLACEMENT,
            ),
        )
        self._actions.extend(replacement.actions)
        self._note(f"{replacement.provider}: {replacement.detail}")
        if not replacement.accepted:
            return replacement.detail, None
        if policy.dry_run:
            self._skip("wait_for_spare", "dry-run: no replacement was requested")
            return None, None
        found = await self._step(
            "wait_for_spare",
            workflow.execute_activity_method(
                KubernetesActivities.wait_for_k8s_node,
                K8sSpareWaitRequest(
                    failed_node=pod.node or "",
                    since=since,
                    node=replacement.node,
                    deadline_seconds=policy.spare_wait_seconds,
                ),
                summary="Wait for a new slurmd pod on a healthy Node, idle in Slurm",
                start_to_close_timeout=timedelta(seconds=policy.spare_wait_seconds + 60),
                heartbeat_timeout=K8S_HEARTBEAT,
                retry_policy=K8S_RETRY,
            ),
        )
        self._note(f"{found.slurm_node or '-'} on Node {found.node or '-'}: {found.detail}")
        spare = SpareResult(
            node=found.slurm_node or pod.slurm_node,
            healthy=found.healthy,
            in_service_at=found.in_service_at,
            detail=f"Node {found.node}: {found.detail}",
        )
        if found.healthy:
            # Ready, GPUs allocatable and idle in Slurm; the operator's health check has the last word.
            health = await self._step(
                "check_spare_health",
                workflow.execute_activity_method(
                    ReplacementActivities.check_node_health,
                    spare.node,
                    summary=f"Run the health check hook on {spare.node}",
                    start_to_close_timeout=timedelta(seconds=120),
                    retry_policy=SLURM_RETRY,
                ),
            )
            self._note(health.detail)
            spare.healthy, spare.detail = health.healthy, f"{spare.detail}; {health.detail}"
        return None, spare

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
        self._note(f"{workflow_id} resumes {node} once repaired and healthy")

    async def _drain(self, req: RecoveryRequest, ctx: ActionContext) -> NodeFenceResult:
        if req.policy.fleet_budget and not req.policy.dry_run and self._fence_breaker:
            held = await self._step(
                "breaker", self._pass_breaker(req.node, req.policy), index_now=not self._fence_in_one_task
            )
            if held is not None:
                raise FenceHeld(held)
        await self._notify(
            NotificationKind.INCIDENT_OPENED,
            f"XID {ctx.xid} {ctx.mnemonic} on {req.node} ({ctx.reason}): draining the node",
        )
        fence = await self._step(
            "drain",
            self._fence_call(
                FencingActivities.drain_node,
                NodeRequest(node=req.node, ctx=ctx),
                f"Drain {req.node} in Slurm: no new work lands on it",
            ),
            index_now=not self._fence_in_one_task,
        )
        self._actions.append(fence.action)
        self._note(fence.action.detail)
        return fence

    async def _fence_and_escalate(
        self, req: RecoveryRequest, ctx: ActionContext, first: NodeFailureAlert, action: str, why: str
    ) -> IncidentReport:
        """Drain only: nothing lands on the node, running jobs go on, a person decides the rest."""
        await self._drain(req, ctx)
        return self._finish(first, action, f"{why}: node drained, jobs left running", [], None)

    async def _count_application_xids(self, first: NodeFailureAlert, policy: RecoveryPolicy) -> int:
        """This incident plus the earlier ones for application XIDs on the same GPU in the window."""
        earlier = await workflow.execute_activity_method(
            ClassifyActivities.count_application_incidents,
            ApplicationXidCountRequest(
                node=self._node,
                gpu=first.gpu,
                this_run_id=workflow.info().run_id,
                window_seconds=policy.application_xid_window_seconds,
            ),
            summary=f"Count recent application XIDs on {self._node} GPU {first.gpu or '(unnamed)'}",
            **SLURM_CALL,
        )
        seen = earlier + 1
        self._note(
            f"{seen} of {policy.application_xid_threshold} application XID(s) on GPU "
            f"{first.gpu or '(unnamed)'} within {policy.application_xid_window_seconds:.0f} s"
        )
        return seen

    async def _approval(self, gate: ApprovalGate, policy: RecoveryPolicy, question: str) -> str:
        """ "approve" or "deny" for a destructive step; "approve" at once when the policy does not gate it."""
        if gate not in policy.approval_required:
            return "approve"
        if policy.dry_run:
            self._skip(f"approval_{gate}", f"dry-run: would ask an operator to {question}")
            return "approve"
        return (await self._step(f"approval_{gate}", self._gate(gate, question, policy))).kind

    def _skip(self, name: str, why: str) -> None:
        now = workflow.now()
        self._phases.append(Phase(name=name, started_at=now, ended_at=now, result=f"skipped: {why}"))

    async def _signal_jobs(self, jobs: list[JobSnapshot], ctx: ActionContext) -> None:
        signalled = await self._for_each_job(jobs, lambda snap: self._signal_job(snap, ctx))
        self._actions.extend(action for action in signalled if isinstance(action, ActionRecord))
        self._note(f"SIGUSR1 to {len(jobs)} job(s)")

    async def _signal_job(self, snap: JobSnapshot, ctx: ActionContext) -> ActionRecord | None:
        try:
            return await self._fence_call(
                JobActivities.signal_job,
                SignalRequest(job_id=snap.job.job_id, signal="USR1", ctx=ctx),
                f"SIGUSR1 to job {snap.job.job_id}: checkpoint now if you can",
            )
        except ActivityError as e:
            # A job that ended meanwhile cannot be signalled; requeue and verify will say so.
            workflow.logger.warning("could not signal job %s: %s", snap.job.job_id, e.cause)
            return None

    async def _for_each_job(
        self, jobs: list[JobSnapshot], work: Callable[[JobSnapshot], Awaitable[T]]
    ) -> list[T | BaseException]:
        """work(job) for every job, all at once: each touches only its own job, and the last job
        is reached no later than the first. Outcomes in the jobs' order, a failure as its
        exception. Runs begun before FEWER_ROUND_TRIPS went one job after another and stopped at
        the first failure: so they replay."""
        if self._fewer_round_trips:
            return list(await asyncio.gather(*(work(snap) for snap in jobs), return_exceptions=True))
        outcomes: list[T | BaseException] = []
        for snap in jobs:
            try:
                outcomes.append(await work(snap))
            except ActivityError as err:
                outcomes.append(err)
                break
        return outcomes

    async def _grace(self, jobs: list[JobSnapshot], grace_seconds: float, poll_seconds: float) -> None:
        """Durable grace timer; ends early once every job has written a new complete checkpoint."""
        waits = [
            workflow.start_activity_method(
                JobActivities.wait_for_checkpoint,
                CheckpointWaitRequest(
                    job_id=s.job.job_id,
                    checkpoint_dir=s.checkpoint_dir,
                    after_step=s.latest_complete.step if s.latest_complete else None,
                    poll_seconds=poll_seconds,
                ),
                summary=f"Wait for job {s.job.job_id} to write a checkpoint newer than the one it had",
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=poll_seconds), backoff_coefficient=1.0),
            )
            for s in jobs
            if s.checkpoint_dir
        ]
        try:
            await workflow.wait_condition(
                lambda: all(w.done() for w in waits), timeout=timedelta(seconds=grace_seconds)
            )
            self._note(f"{len(waits)} job(s) checkpointed within the grace period")
        except TimeoutError:
            late = sum(not w.done() for w in waits)
            self._note(f"grace period of {grace_seconds:.0f} s ended; {late} job(s) without a new checkpoint")
        finally:
            # Also when the incident is aborted mid-grace: no look for a checkpoint outlives it.
            for w in waits:
                if not w.done():
                    w.cancel()

    async def _requeue(
        self, jobs: list[JobSnapshot], node: str, ctx: ActionContext, policy: RecoveryPolicy
    ) -> list[RequeueResult]:
        """A final failure of one requeue ends the incident, with the actions of the others."""
        if self._jobs_together and not ctx.dry_run:
            outcomes = await self._for_each_job(jobs, lambda snap: self._join_job_recovery(snap, node, ctx, policy))
        else:
            outcomes = await self._for_each_job(
                jobs,
                lambda snap: workflow.execute_activity_method(
                    JobActivities.requeue_job,
                    RequeueRequest(job=snap.job, failed_node=node, ctx=ctx, pinned_jobs=policy.pinned_jobs),
                    summary=f"Requeue job {snap.job.job_id} away from {node}",
                    heartbeat_timeout=HEARTBEAT,
                    **SLURM_CALL,
                ),
            )
        results = [outcome for outcome in outcomes if isinstance(outcome, RequeueResult)]
        for result in results:
            self._actions.extend(result.actions)
        failed = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        if failed is not None:
            raise failed
        self._note(f"{len(jobs)} job(s) requeued off {node}")
        return results

    async def _join_job_recovery(
        self, snap: JobSnapshot, node: str, ctx: ActionContext, policy: RecoveryPolicy
    ) -> RequeueResult:
        """The job's requeue off this node, by the job's recovery that the incidents on its nodes share."""
        job_id = snap.job.job_id
        self._joining.add(job_id)
        await workflow.execute_activity_method(
            JobRecoveryActivities.join_job_recovery,
            JobJoin(
                incident_id=self._incident_id,
                workflow_id=workflow.info().workflow_id,
                node=node,
                snapshot=snap,
                ctx=ctx,
                verify_deadline_seconds=policy.verify_deadline_seconds,
                pinned_jobs=policy.pinned_jobs,
            ),
            summary=f"Join the recovery of job {job_id}: its requeue away from {node} and its other failed nodes",
            **SLURM_CALL,
        )
        joined = await self._hear(
            job_id, lambda: self._job_recoveries.get(job_id), JOB_REQUEUE_WAIT, f"the requeue of job {job_id}"
        )
        self._failed_together[job_id] = joined.failed_together
        return joined.requeue

    async def _verify_together(self, job_id: int, deadline: float) -> JobVerification:
        await workflow.execute_activity_method(
            JobRecoveryActivities.ask_job_verification,
            args=[job_id, self._job_recoveries[job_id].run_id],
            summary=f"Ask job {job_id}'s recovery for its verification",
            **SLURM_CALL,
        )
        recovered = await self._hear(
            job_id,
            lambda: self._job_recovered.get(job_id),
            timedelta(seconds=2 * deadline + 600),
            f"job {job_id}'s verification",
        )
        self._failed_together[job_id] = recovered.failed_together
        return recovered.verification

    async def _hear(self, job_id: int, told: Callable[[], T | None], within: timedelta, what: str) -> T:
        """What the job's recovery tells, by its signal; its failure, or none in time, is this step's."""
        try:
            await workflow.wait_condition(lambda: told() is not None or job_id in self._job_failures, timeout=within)
        except asyncio.TimeoutError:
            raise JobRecoveryFailed(
                f"JobRecoveryTimeout: no word of {what} from the job's recovery within {within.total_seconds():.0f} s"
            ) from None
        if (failure := self._job_failures.get(job_id)) is not None:
            raise JobRecoveryFailed(f"{failure.error_type}: {failure.message}")
        answer = told()
        assert answer is not None
        return answer

    async def _verify(
        self, jobs: list[JobSnapshot], requeued: list[RequeueResult], node: str, deadline: float
    ) -> list[JobVerification]:
        if self._job_recoveries:
            return list(await asyncio.gather(*(self._verify_together(snap.job.job_id, deadline) for snap in jobs)))
        results = []
        for snap, requeue in zip(jobs, requeued):
            results.append(
                await workflow.execute_activity_method(
                    JobActivities.verify_restart,
                    VerifyRequest(snapshot=snap, failed_node=node, requeue=requeue, deadline_seconds=deadline),
                    summary=f"Verify job {snap.job.job_id} resumed off {node} from its latest complete checkpoint",
                    start_to_close_timeout=timedelta(seconds=deadline + 60),
                    heartbeat_timeout=HEARTBEAT,
                    retry_policy=SLURM_RETRY,
                )
            )
        return results

    def _finish(
        self,
        first: NodeFailureAlert,
        action: str,
        outcome: str,
        verifications: list[JobVerification],
        spare: SpareResult | None,
    ) -> IncidentReport:
        assert self._classification is not None
        if any(not a.executed for a in self._actions) and not outcome.startswith("dry_run"):
            outcome = f"dry_run: {outcome} (nothing executed)"
        self._outcome = outcome
        self._phase = "done"
        self._index([sa.PHASE.value_set("done"), sa.OUTCOME.value_set(outcome_label(outcome))])
        workflow.set_current_details(f"Incident {self._incident_id} on {self._node}: {outcome}")
        return build_report(
            incident_id=self._incident_id,
            node=self._node,
            classification=self._classification,
            action=action,
            outcome=outcome,
            failure_at=first.observed_at,
            phases=self._phases,
            jobs=self._jobs,
            verifications=verifications,
            spare=spare,
            alerts=self._alerts.kept(),
            alert_counts=self._alerts.counts(),
            actions=self._actions,
            decisions=self._decisions,
            return_to_service=self._return_to_service,
            failed_together=self._failed_together,
        )


class FenceHeld(Exception):
    """The fence circuit breaker held the incident until it gave up: the node was not drained."""


class JobRecoveryFailed(Exception):
    """The job's recovery failed to requeue the job, or said nothing in time (workflows/job_recovery.py)."""


class IncidentAborted(Exception):
    """An operator aborted the incident (update `abort`): it stops before its next step."""


async def _known(value: T) -> T:
    return value


def _cause(err: ActivityError) -> str:
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return f"{cause.type}: {cause.message}" if cause.type else cause.message
    return str(cause or err)


def _notification_for(outcome: str) -> NotificationKind | None:
    """Operators hear of a recovery, and of every end that leaves them something to do."""
    label = outcome_label(outcome)
    if label == "recovered":
        return NotificationKind.RECOVERED
    if label.startswith(("failed", "escalated")) or label in ("spare_unhealthy", "no_replacement"):
        return NotificationKind.FAILED
    return None


def _outcome(no_replacement: str | None, spare: SpareResult | None, verifications: list[JobVerification]) -> str:
    failed = [v for v in verifications if not v.verified]
    if failed:
        return "failed_verification: " + "; ".join(f"job {v.job_id}: {', '.join(v.why_not)}" for v in failed)
    if no_replacement is not None:
        return f"no_replacement: {no_replacement}"
    if spare is not None and not spare.healthy:
        return f"spare_unhealthy: {spare.node}: {spare.detail}"
    return "recovered"
