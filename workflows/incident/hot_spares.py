"""Replacement capacity in bare Slurm: a hot spare kept drained on standby, claimed through its
own SpareClaimWorkflow (one claim per spare at a time, across workers), resumed, then waited for
until it is healthy and in service. A quarantined lemon is never claimed."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ChildWorkflowError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from activities.budget import BudgetActivities
    from activities.platform import PlatformActivities
    from backends.replacement import HotSparePool
    from contracts.models import (
        ActionContext,
        ActionRecord,
        RecoveryPolicy,
        ReplacementRequest,
        ReplacementResult,
        SpareResult,
        SpareWaitRequest,
    )
    from workflows.budget_lease import BUDGET_CALL, BudgetLease
    from workflows.call_options import HEARTBEAT, SLURM_RETRY
    from workflows.incident.steps import Steps
    from workflows.incident.timeline import last_action_at
    from workflows.spare_claim import SpareClaimWorkflow, spare_claim_workflow_id

# Retired (docs/upgrades.md): every run claims through SpareClaimWorkflow, and takes the lemons
# from the lease's answer; histories with these markers still replay.
SPARE_CLAIM_LOCK = "spare-claim-lock"
LEMONS_FROM_LEASE = "lemons-from-lease"
# A spare another incident is claiming is tried again after its claim ends: every so often, a few times.
CLAIM_BUSY_WAIT = timedelta(seconds=1)
CLAIM_BUSY_PASSES = 10


class HotSpares:
    """Hot spares on standby, claimed for the incident. Before the `one-platform-seam` patch it was
    also bare Slurm's NodePlatform (workflows/incident/platform.py), which runs it since."""

    spares_on_standby = True
    unfence_node = None

    def __init__(self, steps: Steps, actions: list[ActionRecord], lease: BudgetLease) -> None:
        self._steps = steps
        self._actions = actions
        self._lease = lease

    async def fence(self, node: str, ctx: ActionContext) -> None:
        """Nothing beyond Slurm's drain."""

    async def release(self, ctx: ActionContext) -> None:
        """Nothing beyond Slurm's down."""

    async def replace(
        self, node: str, ctx: ActionContext, policy: RecoveryPolicy
    ) -> tuple[str | None, SpareResult | None]:
        """Claim and resume a hot spare, then wait until it is healthy. Returns why there is no
        replacement (or None), and the spare. Runs begun before the `one-platform-seam` patch
        only (workflows/incident/platform.py is the path since)."""
        replacement = await self.claim(node, ctx, policy)
        if replacement.node is None:
            return replacement.detail, None
        if policy.dry_run:
            self._steps.skip("wait_for_spare", "dry-run: no spare was brought in")
            return None, None
        spare = await self._steps.run(
            "wait_for_spare",
            workflow.execute_activity_method(
                PlatformActivities.wait_for_spare,
                SpareWaitRequest(node=replacement.node, deadline_seconds=policy.spare_wait_seconds),
                summary=f"Wait for {replacement.node} to be healthy and in service",
                start_to_close_timeout=timedelta(seconds=policy.spare_wait_seconds + 60),
                heartbeat_timeout=HEARTBEAT,
                retry_policy=SLURM_RETRY,
            ),
            done_at=lambda waited: waited.in_service_at,
        )
        self._steps.note(spare.detail)
        return None, spare

    async def claim(self, node: str, ctx: ActionContext, policy: RecoveryPolicy) -> ReplacementResult:
        """The step that claims and resumes a hot spare, passing over quarantined lemons."""
        lemons = await self._quarantined_spares(policy) if policy.fleet_budget and policy.spare_nodes else []
        request = ReplacementRequest(
            failed_node=node, spare_nodes=[s for s in policy.spare_nodes if s not in lemons], ctx=ctx
        )
        workflow.deprecate_patch(SPARE_CLAIM_LOCK)
        replacement = await self._steps.run(
            "request_replacement", self._claim_spare(request), done_at=lambda replaced: last_action_at(replaced.actions)
        )
        self._actions.extend(replacement.actions)
        self._steps.note(
            f"{replacement.provider}: {replacement.node or 'none'} ({replacement.detail})"
            + (f"; quarantined spares passed over: {', '.join(lemons)}" if lemons else "")
        )
        return replacement

    async def _quarantined_spares(self, policy: RecoveryPolicy) -> list[str]:
        """The spares that are quarantined lemons, taken from the lease's answer (the lemons when
        the budget last told it), not from a query per incident: a spare quarantined since has had
        an incident of its own, which took it off standby; one released since is passed over this
        once. Without a lease (dry-run), or from a budget that does not say, the budget is asked."""
        told = self._lease.state.lemons if self._lease.state is not None else None
        if told is not None:
            workflow.deprecate_patch(LEMONS_FROM_LEASE)
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
