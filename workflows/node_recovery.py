"""NodeRecoveryWorkflow: one durable incident per failed node, deciding what happens and in what
order. Every side effect is an activity (activities/); this module does no I/O.

classify -> drain -> find jobs -> signal -> grace (durable timer, ends early on a new checkpoint)
-> requeue away from the node -> mark down -> request replacement -> wait for a healthy spare
-> verify each job resumed from its latest complete checkpoint -> report
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import datetime, timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities.fencing import FencingActivities
    from activities.jobs import JobActivities
    from activities.replacement import ReplacementActivities
    from activities.xid_policy import ClassifyActivities
    from contracts.models import (
        ActionContext,
        ActionRecord,
        ApplicationXidCountRequest,
        ApprovalGate,
        ApprovalRequest,
        CheckpointWaitRequest,
        DecisionRecord,
        FaultClass,
        FaultClassification,
        IncidentReport,
        IncidentStatus,
        JobSnapshot,
        JobVerification,
        NodeFailureAlert,
        NodeFenceResult,
        NodeRequest,
        OperatorDecision,
        Phase,
        RecoveryPolicy,
        RecoveryRequest,
        ReplacementRequest,
        RequeueRequest,
        RequeueResult,
        ReturnToServiceRequest,
        SignalRequest,
        SpareResult,
        SpareWaitRequest,
        VerifyRequest,
    )
    from contracts import search_attributes as sa
    from activities.kubernetes import KubernetesActivities
    from contracts.kubernetes import (
        EvictRequest,
        K8sNodeRequest,
        K8sReplacementRequest,
        K8sSpareWaitRequest,
        SlurmdPod,
        SlurmdPodRequest,
    )
    from workflows.call_options import (
        HEARTBEAT,
        K8S_CALL,
        K8S_EVICTION,
        K8S_HEARTBEAT,
        K8S_REPLACEMENT,
        K8S_RETRY,
        SLURM_CALL,
        SLURM_RETRY,
    )
    from workflows.report import build_report
    from workflows.return_to_service import ReturnToServiceWorkflow, return_to_service_workflow_id

T = TypeVar("T")



def incident_workflow_id(node: str) -> str:
    """One incident per node: a second alert for the node reaches the running incident."""
    return f"node-recovery-{node}"


@workflow.defn
class NodeRecoveryWorkflow:
    def __init__(self) -> None:
        self._incident_id = ""
        self._node = ""
        self._phase = "starting"
        self._alerts: list[NodeFailureAlert] = []
        self._phases: list[Phase] = []
        self._actions: list[ActionRecord] = []
        self._classification: FaultClassification | None = None
        self._jobs: list[JobSnapshot] = []
        self._outcome: str | None = None
        self._indexed = True
        self._awaiting: ApprovalRequest | None = None
        self._answer: DecisionRecord | None = None
        self._abort: DecisionRecord | None = None
        self._decisions: list[DecisionRecord] = []
        self._return_to_service: str | None = None

    @workflow.signal
    def alert(self, alert: NodeFailureAlert) -> None:
        """Every alert for this node joins the incident; the first one starts it."""
        self.alerts([alert])

    @workflow.signal
    def alerts(self, alerts: list[NodeFailureAlert]) -> None:
        """Several alerts at once, as a hook batches them during a storm."""
        for alert in alerts:
            if alert.node == self._node or not self._node:
                self._alerts.append(alert)
            else:
                workflow.logger.warning("ignored an alert for %s sent to the incident of %s", alert.node, self._node)

    @workflow.update
    def approve(self, decision: OperatorDecision) -> IncidentStatus:
        """An operator lets the step waiting at a gate go ahead."""
        self._answer = self._decide("approve", decision)
        return self.status()

    @workflow.update
    def deny(self, decision: OperatorDecision) -> IncidentStatus:
        """An operator refuses the step waiting at a gate: the node stays fenced, nothing is killed."""
        self._answer = self._decide("deny", decision)
        return self.status()

    @approve.validator
    @deny.validator
    def _something_awaits_approval(self, decision: OperatorDecision) -> None:
        if self._awaiting is None or self._answer is not None:
            raise ValueError(f"incident {self._incident_id or self._node} awaits no approval (phase {self._phase})")

    @workflow.update
    def abort(self, decision: OperatorDecision) -> IncidentStatus:
        """Stop the incident before its next step; the node is left as it is (fenced, if it was)."""
        self._abort = self._decide("abort", decision)
        return self.status()

    @abort.validator
    def _still_running(self, decision: OperatorDecision) -> None:
        if self._outcome is not None or self._abort is not None:
            raise ValueError(f"incident {self._incident_id or self._node} has already ended or been aborted")

    def _decide(self, kind: str, decision: OperatorDecision) -> DecisionRecord:
        record = DecisionRecord(at=workflow.now(), kind=kind, gate=self._awaiting.gate if self._awaiting else None,
                                actor=decision.actor, reason=decision.reason)
        self._decisions.append(record)
        workflow.logger.info("%s by %s on incident %s: %s", kind, decision.actor, self._incident_id, decision.reason)
        return record

    @workflow.query
    def status(self) -> IncidentStatus:
        return IncidentStatus(
            incident_id=self._incident_id,
            node=self._node,
            phase=self._phase,
            xid=self._alerts[0].xid if self._alerts else None,
            fault_class=self._classification.fault_class if self._classification else None,
            alerts=self._alerts,
            phases=self._phases,
            actions=self._actions,
            outcome=self._outcome,
            peer_nodes=self._peer_nodes(),
            awaiting_approval=self._awaiting,
            decisions=self._decisions,
        )

    def _peer_nodes(self) -> list[str]:
        return sorted({n for j in self._jobs for n in j.job.nodes if n != self._node})

    async def _step(self, name: str, work: Awaitable[T], abortable: bool = True) -> T:
        phase = Phase(name=name, started_at=workflow.now())
        self._phases.append(phase)
        self._phase = name
        self._index([sa.PHASE.value_set(name)])
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
        now = workflow.now()
        self._answer = None
        self._awaiting = ApprovalRequest(gate=gate, question=question, asked_at=now,
                                         deadline_at=now + timedelta(seconds=policy.approval_timeout_seconds))
        workflow.set_current_details(f"Awaiting approval ({gate}): {question}. "
                                     f"Answer with `recovery approve|deny {self._node}`.")
        try:
            await workflow.wait_condition(lambda: self._answer is not None,
                                          timeout=timedelta(seconds=policy.approval_timeout_seconds))
        except asyncio.TimeoutError:
            self._answer = DecisionRecord(
                at=workflow.now(), kind=policy.approval_timeout_action, gate=gate, actor="policy",
                reason=f"no answer within {policy.approval_timeout_seconds:.0f} s: {policy.approval_timeout_action} by default")
            self._decisions.append(self._answer)
        answer, self._awaiting = self._answer, None
        self._note(f"{answer.kind} by {answer.actor}: {answer.reason}")
        return answer

    def _index(self, updates: list) -> None:
        if self._indexed:
            workflow.upsert_search_attributes(updates)

    def _note(self, result: str) -> None:
        self._phases[-1].result = result

    @workflow.run
    async def run(self, req: RecoveryRequest) -> IncidentReport:
        report = await self._handle(req)
        try:
            # By name: activities/telemetry.py imports this module.
            await workflow.execute_activity(
                "record_incident", report, summary="Record the incident's metrics (OpenTelemetry)",
                start_to_close_timeout=timedelta(seconds=10), retry_policy=RetryPolicy(maximum_attempts=3),
            )
        except ActivityError as err:
            # Metrics never change an incident's outcome.
            workflow.logger.warning("the incident's metrics were not recorded: %s", err.cause)
        return report

    async def _handle(self, req: RecoveryRequest) -> IncidentReport:
        self._node = req.node
        self._alerts = [a for a in self._alerts if a.node == req.node]
        self._incident_id = f"{req.node}-{workflow.now():%Y%m%dT%H%M%SZ}"
        await workflow.wait_condition(lambda: bool(self._alerts))
        first = self._alerts[0]
        policy = req.policy
        self._indexed = policy.search_attributes
        self._index([sa.NODE.value_set(req.node), sa.XID.value_set(first.xid)]
                    + ([sa.GPU.value_set(first.gpu)] if first.gpu else []))
        workflow.set_current_details(f"Incident {self._incident_id}: XID {first.xid} on {req.node}, "
                                     f"reported by {first.actor} via {first.source}: {first.reason}")

        cls = self._classification = await self._step("classify", workflow.execute_activity_method(
            ClassifyActivities.classify_fault, first, start_to_close_timeout=timedelta(seconds=30),
            summary=f"Classify XID {first.xid} by the fault policy table",
        ), abortable=False)  # the report needs the classification; it takes milliseconds
        self._note(f"XID {cls.xid} {cls.mnemonic}: {cls.fault_class.value}")
        ctx = ActionContext(
            incident_id=self._incident_id, owner=policy.owner, actor=first.actor,
            reason=f"{first.source}: {first.reason}", xid=first.xid, mnemonic=cls.mnemonic,
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
                return await self._fence_and_escalate(req, ctx, first, action, f"escalated: {seen} application XIDs on "
                                                      f"GPU {first.gpu or '(unnamed)'} within "
                                                      f"{policy.application_xid_window_seconds:.0f} s")
            action = "fence_and_escalate" if cls.fault_class == FaultClass.UNKNOWN else "recover"
            return await self._recover(req, first, cls, ctx, action)
        except ActivityError as err:
            # A final failure (a node or job Slurm does not know, a deadline passed): the incident
            # ends in an explicit failed state, with the report of what was done before it.
            why = f"failed in {self._phase}: {_cause(err)}"
        except IncidentAborted:
            assert self._abort is not None
            why = f"aborted by {self._abort.actor} in {self._phase}: {self._abort.reason}; node left as it was"
        self._note(why)
        return self._finish(first, action, why, [], None)

    async def _recover(self, req: RecoveryRequest, first: NodeFailureAlert, cls: FaultClassification,
                       ctx: ActionContext, action: str) -> IncidentReport:
        policy = req.policy
        if cls.fault_class == FaultClass.UNKNOWN:
            return await self._fence_and_escalate(req, ctx, first, action, "escalated: unknown XID")
        fence = await self._drain(req, ctx)
        pod, fenced_at = (await self._fence_on_kubernetes(req.node, ctx)) if policy.kubernetes else (None, None)

        jobs = self._jobs = await self._step("find_jobs", workflow.execute_activity_method(
            JobActivities.find_jobs, req.node, summary=f"Find the jobs running on {req.node}", **SLURM_CALL,
        ))
        self._note(", ".join(str(j.job.job_id) for j in jobs) or "no jobs")
        self._index([sa.JOB_IDS.value_set([str(j.job.job_id) for j in jobs]),
                                           sa.PEER_NODES.value_set(self._peer_nodes())])

        await self._step("signal", self._signal_jobs(jobs, ctx))
        if policy.dry_run:
            self._skip("grace", "dry-run: no job was signalled, no checkpoint to wait for")
        elif cls.fault_class == FaultClass.DEGRADING and policy.degrading_grace_seconds > 0:
            await self._step("grace", self._grace(jobs, policy.degrading_grace_seconds, policy.checkpoint_poll_seconds))
        else:
            self._skip("grace", f"{cls.fault_class.value} XID: the GPU is gone, no checkpoint to wait for")

        large = [s.job.job_id for s in jobs if len(s.job.nodes) >= policy.approval_min_job_nodes]
        if large and await self._approval("requeue", policy,
                                          f"requeue job(s) {', '.join(map(str, large))} off {req.node}, "
                                          "stopping their processes") == "deny":
            return self._finish(first, action, f"denied: requeue ({self._decisions[-1].actor}: "
                                f"{self._decisions[-1].reason}); node stays drained, jobs left running", [], None)
        requeued = await self._step("requeue", self._requeue(jobs, req.node, ctx))
        if fence.owned_by_other:
            self._skip("mark_down", "left as found: drained by someone else")
        else:
            down = await self._step("mark_down", workflow.execute_activity_method(
                FencingActivities.mark_node_down, NodeRequest(node=req.node, ctx=ctx),
                summary=f"Mark {req.node} DOWN in Slurm now that its jobs are off it", **SLURM_CALL,
            ))
            self._actions.append(down.action)
            self._note(down.action.detail)

        if pod is not None:
            await self._step("evict_slurmd_pod", self._evict(pod, ctx))

        if await self._approval("replacement", policy, f"bring in replacement capacity for {req.node}") == "deny":
            denied = self._decisions[-1]
            no_replacement, spare = f"denied by {denied.actor}: {denied.reason}", None
            self._skip("request_replacement", no_replacement)
        elif pod is not None:
            no_replacement, spare = await self._replace_on_kubernetes(pod, fenced_at, ctx, policy)
        else:
            no_replacement, spare = await self._replace_with_hot_spare(req.node, ctx, policy)
        if policy.dry_run:
            self._skip("verify", "dry-run: no job was requeued")
            intended = sum(not a.executed for a in self._actions)
            return self._finish(first, action, f"dry_run: {intended} action(s) intended, none executed", [], None)

        verifications = await self._step("verify", self._verify(jobs, requeued, req.node,
                                                                 policy.verify_deadline_seconds))
        self._note("; ".join(f"job {v.job_id}: {'ok' if v.verified else ', '.join(v.why_not)}" for v in verifications))
        outcome = _outcome(no_replacement, spare, verifications)
        if not fence.owned_by_other:
            await self._step("return_to_service", self._start_return_to_service(
                req.node, ctx, policy, pod.node if pod is not None else None))
        return self._finish(first, action, outcome, verifications, spare)

    async def _replace_with_hot_spare(self, node: str, ctx: ActionContext,
                                      policy: RecoveryPolicy) -> tuple[str | None, SpareResult | None]:
        """Bare Slurm: claim and resume a hot spare, then wait until it is healthy. Returns why
        there is no replacement (or None), and the spare."""
        replacement = await self._step("request_replacement", workflow.execute_activity_method(
            ReplacementActivities.request_replacement,
            ReplacementRequest(failed_node=node, spare_nodes=policy.spare_nodes, ctx=ctx),
            summary=f"Request replacement capacity for {node}", **SLURM_CALL,
        ))
        self._actions.extend(replacement.actions)
        self._note(f"{replacement.provider}: {replacement.node or 'none'} ({replacement.detail})")
        if replacement.node is None:
            return replacement.detail, None
        if policy.dry_run:
            self._skip("wait_for_spare", "dry-run: no spare was brought in")
            return None, None
        spare = await self._step("wait_for_spare", workflow.execute_activity_method(
            ReplacementActivities.wait_for_spare,
            SpareWaitRequest(node=replacement.node, deadline_seconds=policy.spare_wait_seconds),
            summary=f"Wait for {replacement.node} to be healthy and in service",
            start_to_close_timeout=timedelta(seconds=policy.spare_wait_seconds + 60),
            heartbeat_timeout=HEARTBEAT, retry_policy=SLURM_RETRY,
        ))
        self._note(spare.detail)
        return None, spare

    async def _fence_on_kubernetes(self, node: str, ctx: ActionContext) -> tuple[SlurmdPod, datetime]:
        """Slurm on Kubernetes: find the slurmd pod that is this Slurm node, then cordon, taint and
        mark the Node under it. Returns the pod and when the fence began (replacements are newer)."""
        pod = await self._step("locate_slurmd_pod", workflow.execute_activity_method(
            KubernetesActivities.locate_slurmd_pod, SlurmdPodRequest(slurm_node=node),
            summary=f"Find the slurmd pod of {node} and its Kubernetes Node", **K8S_CALL,
        ))
        self._note(f"{pod.namespace}/{pod.name} on Node {pod.node or '(unscheduled)'}")
        if pod.node is None:
            self._skip("fence_k8s_node", "the slurmd pod is not on any Node")
            return pod, workflow.now()
        fence = await self._step("fence_k8s_node", workflow.execute_activity_method(
            KubernetesActivities.fence_k8s_node, K8sNodeRequest(node=pod.node, ctx=ctx),
            summary=f"Cordon and taint Node {pod.node}, set its condition", **K8S_CALL,
        ))
        self._actions.extend(fence.actions)
        self._note("; ".join(a.detail for a in fence.actions) or "already fenced by this incident")
        return pod, fence.prior.fenced_at if fence.prior else workflow.now()

    async def _evict(self, pod: SlurmdPod, ctx: ActionContext) -> None:
        """Only now that Slurm shows the node drained and its jobs requeued (the activity reads
        Slurm again before evicting and refuses otherwise; unreadable Slurm fails closed)."""
        evicted = await workflow.execute_activity_method(
            KubernetesActivities.evict_slurmd_pod, EvictRequest(pod=pod, ctx=ctx),
            summary=f"Evict slurmd pod {pod.namespace}/{pod.name} from Node {pod.node}", **K8S_EVICTION,
        )
        self._actions.extend(evicted.actions)
        self._note(evicted.detail)

    async def _replace_on_kubernetes(self, pod: SlurmdPod, since: datetime, ctx: ActionContext,
                                     policy: RecoveryPolicy) -> tuple[str | None, SpareResult | None]:
        """Ask the configured provider (NodeSet, node lifecycle or HTTP) for capacity, then wait
        for a new slurmd pod on a healthy Node, registered and idle in Slurm."""
        replacement = await self._step("request_replacement", workflow.execute_activity_method(
            KubernetesActivities.request_k8s_replacement,
            K8sReplacementRequest(failed_node=pod.node or "", slurm_node=pod.slurm_node, ctx=ctx),
            summary=f"Request replacement capacity for Node {pod.node}", **K8S_REPLACEMENT,
        ))
        self._actions.extend(replacement.actions)
        self._note(f"{replacement.provider}: {replacement.detail}")
        if not replacement.accepted:
            return replacement.detail, None
        if policy.dry_run:
            self._skip("wait_for_spare", "dry-run: no replacement was requested")
            return None, None
        found = await self._step("wait_for_spare", workflow.execute_activity_method(
            KubernetesActivities.wait_for_k8s_node,
            K8sSpareWaitRequest(failed_node=pod.node or "", since=since, node=replacement.node,
                                deadline_seconds=policy.spare_wait_seconds),
            summary="Wait for a new slurmd pod on a healthy Node, idle in Slurm",
            start_to_close_timeout=timedelta(seconds=policy.spare_wait_seconds + 60),
            heartbeat_timeout=K8S_HEARTBEAT, retry_policy=K8S_RETRY,
        ))
        self._note(f"{found.slurm_node or '-'} on Node {found.node or '-'}: {found.detail}")
        spare = SpareResult(node=found.slurm_node or pod.slurm_node, healthy=found.healthy,
                            in_service_at=found.in_service_at, detail=f"Node {found.node}: {found.detail}")
        if found.healthy:
            # Ready, GPUs allocatable and idle in Slurm; the operator's health check has the last word.
            health = await self._step("check_spare_health", workflow.execute_activity_method(
                ReplacementActivities.check_node_health, spare.node,
                summary=f"Run the health check hook on {spare.node}", start_to_close_timeout=timedelta(seconds=120),
                retry_policy=SLURM_RETRY,
            ))
            self._note(health.detail)
            spare.healthy, spare.detail = health.healthy, f"{spare.detail}; {health.detail}"
        return None, spare

    async def _start_return_to_service(self, node: str, ctx: ActionContext, policy: RecoveryPolicy,
                                       kubernetes_node: str | None) -> None:
        """Hands the fenced node to a workflow that outlives this incident and resumes the node
        once it is repaired and healthy."""
        workflow_id = return_to_service_workflow_id(ctx.incident_id)
        await workflow.start_child_workflow(
            ReturnToServiceWorkflow.run,
            ReturnToServiceRequest(
                node=node, poll_seconds=policy.repair_poll_seconds, kubernetes_node=kubernetes_node,
                give_up_at=workflow.now() + timedelta(seconds=policy.repair_wait_seconds),
                ctx=ctx.model_copy(update={"actor": f"{policy.owner} policy",
                                           "reason": f"return to service after repair (incident {ctx.incident_id})"}),
            ),
            id=workflow_id, parent_close_policy=ParentClosePolicy.ABANDON,
            static_summary=f"Return {node} to service once repaired",
        )
        self._return_to_service = workflow_id
        self._note(f"{workflow_id} resumes {node} once repaired and healthy")

    async def _drain(self, req: RecoveryRequest, ctx: ActionContext) -> NodeFenceResult:
        fence = await self._step("drain", workflow.execute_activity_method(
            FencingActivities.drain_node, NodeRequest(node=req.node, ctx=ctx),
            summary=f"Drain {req.node} in Slurm: no new work lands on it", **SLURM_CALL,
        ))
        self._actions.append(fence.action)
        self._note(fence.action.detail)
        return fence

    async def _fence_and_escalate(self, req: RecoveryRequest, ctx: ActionContext, first: NodeFailureAlert,
                                  action: str, why: str) -> IncidentReport:
        """Drain only: nothing lands on the node, running jobs go on, a person decides the rest."""
        await self._drain(req, ctx)
        return self._finish(first, action, f"{why}: node drained, jobs left running", [], None)

    async def _count_application_xids(self, first: NodeFailureAlert, policy: RecoveryPolicy) -> int:
        """This incident plus the earlier ones for application XIDs on the same GPU in the window."""
        earlier = await workflow.execute_activity_method(
            ClassifyActivities.count_application_incidents,
            ApplicationXidCountRequest(node=self._node, gpu=first.gpu, this_run_id=workflow.info().run_id,
                                       window_seconds=policy.application_xid_window_seconds),
            summary=f"Count recent application XIDs on {self._node} GPU {first.gpu or '(unnamed)'}",
            **SLURM_CALL,
        )
        seen = earlier + 1
        self._note(f"{seen} of {policy.application_xid_threshold} application XID(s) on GPU "
                   f"{first.gpu or '(unnamed)'} within {policy.application_xid_window_seconds:.0f} s")
        return seen

    async def _approval(self, gate: ApprovalGate, policy: RecoveryPolicy, question: str) -> str:
        """"approve" or "deny" for a destructive step; "approve" at once when the policy does not gate it."""
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
        for snap in jobs:
            try:
                action = await workflow.execute_activity_method(
                    JobActivities.signal_job, SignalRequest(job_id=snap.job.job_id, signal="USR1", ctx=ctx),
                    summary=f"SIGUSR1 to job {snap.job.job_id}: checkpoint now if you can", **SLURM_CALL,
                )
            except ActivityError as e:
                # A job that ended meanwhile cannot be signalled; requeue and verify will say so.
                workflow.logger.warning("could not signal job %s: %s", snap.job.job_id, e.cause)
                continue
            self._actions.append(action)
        self._note(f"SIGUSR1 to {len(jobs)} job(s)")

    async def _grace(self, jobs: list[JobSnapshot], grace_seconds: float, poll_seconds: float) -> None:
        """Durable grace timer; ends early once every job has written a new complete checkpoint."""
        waits = [
            workflow.start_activity_method(
                JobActivities.wait_for_checkpoint,
                CheckpointWaitRequest(
                    job_id=s.job.job_id, checkpoint_dir=s.checkpoint_dir,
                    after_step=s.latest_complete.step if s.latest_complete else None, poll_seconds=poll_seconds,
                ),
                summary=f"Wait for job {s.job.job_id} to write a checkpoint newer than the one it had",
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=poll_seconds), backoff_coefficient=1.0),
            )
            for s in jobs if s.checkpoint_dir
        ]
        try:
            await workflow.wait_condition(lambda: all(w.done() for w in waits),
                                          timeout=timedelta(seconds=grace_seconds))
            self._note(f"{len(waits)} job(s) checkpointed within the grace period")
        except TimeoutError:
            late = sum(not w.done() for w in waits)
            self._note(f"grace period of {grace_seconds:.0f} s ended; {late} job(s) without a new checkpoint")
        finally:
            # Also when the incident is aborted mid-grace: no look for a checkpoint outlives it.
            for w in waits:
                if not w.done():
                    w.cancel()

    async def _requeue(self, jobs: list[JobSnapshot], node: str, ctx: ActionContext) -> list[RequeueResult]:
        results = []
        for snap in jobs:
            result = await workflow.execute_activity_method(
                JobActivities.requeue_job, RequeueRequest(job=snap.job, failed_node=node, ctx=ctx),
                summary=f"Requeue job {snap.job.job_id} away from {node}",
                heartbeat_timeout=HEARTBEAT, **SLURM_CALL,
            )
            self._actions.extend(result.actions)
            results.append(result)
        self._note(f"{len(jobs)} job(s) requeued off {node}")
        return results

    async def _verify(self, jobs: list[JobSnapshot], requeued: list[RequeueResult], node: str,
                      deadline: float) -> list[JobVerification]:
        results = []
        for snap, requeue in zip(jobs, requeued):
            results.append(await workflow.execute_activity_method(
                JobActivities.verify_restart,
                VerifyRequest(snapshot=snap, failed_node=node, requeue=requeue, deadline_seconds=deadline),
                summary=f"Verify job {snap.job.job_id} resumed off {node} from its latest complete checkpoint",
                start_to_close_timeout=timedelta(seconds=deadline + 60),
                heartbeat_timeout=HEARTBEAT, retry_policy=SLURM_RETRY,
            ))
        return results

    def _finish(
        self, first: NodeFailureAlert, action: str, outcome: str,
        verifications: list[JobVerification], spare: SpareResult | None,
    ) -> IncidentReport:
        assert self._classification is not None
        if any(not a.executed for a in self._actions) and not outcome.startswith("dry_run"):
            outcome = f"dry_run: {outcome} (nothing executed)"
        self._outcome = outcome
        self._phase = "done"
        self._index([sa.PHASE.value_set("done"),
                                           sa.OUTCOME.value_set(outcome_label(outcome))])
        workflow.set_current_details(f"Incident {self._incident_id} on {self._node}: {outcome}")
        return build_report(
            incident_id=self._incident_id, node=self._node, classification=self._classification,
            action=action, outcome=outcome, failure_at=first.observed_at, phases=self._phases,
            jobs=self._jobs, verifications=verifications, spare=spare, alerts=self._alerts, actions=self._actions,
            decisions=self._decisions, return_to_service=self._return_to_service,
        )


class IncidentAborted(Exception):
    """An operator aborted the incident (update `abort`): it stops before its next step."""


def outcome_label(outcome: str) -> str:
    """The outcome's kind, short enough to filter on ("recovered", "failed in drain", ...)."""
    return outcome.split(":", 1)[0]


def _cause(err: ActivityError) -> str:
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return f"{cause.type}: {cause.message}" if cause.type else cause.message
    return str(cause or err)


def _outcome(no_replacement: str | None, spare: SpareResult | None, verifications: list[JobVerification]) -> str:
    failed = [v for v in verifications if not v.verified]
    if failed:
        return "failed_verification: " + "; ".join(f"job {v.job_id}: {', '.join(v.why_not)}" for v in failed)
    if no_replacement is not None:
        return f"no_replacement: {no_replacement}"
    if spare is not None and not spare.healthy:
        return f"spare_unhealthy: {spare.node}: {spare.detail}"
    return "recovered"
