"""The incident's side of the fleet disruption budget (workflows/fleet_budget.py): deterministic
workflow code that asks for a lease, hears of it while it waits, returns it, and asks whether
the node is a quarantined lemon. One lease per incident id.

NodeRecoveryWorkflow holds a BudgetLease: in runs since its FENCE_BREAKER patch, `ask_to_fence`
(phase `breaker`) passes the fence circuit breaker before the drain, waiting while it is tripped;
then `_take_lease` (phase `budget`) requests it after the
drain and before the first destructive step, waits over budget as a gate that an operator may
answer, and `run()` releases it in `finally`. ReturnToServiceWorkflow calls check_quarantine()
before each look at the node. request() returns within moments (the budget answers in the
request's reply, or by signal when the request had to go as one);
wait_granted() is an ordinary wait_condition, so signals, updates and queries keep being handled
for hours if need be, an abort cancels it, and a worker restart loses nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.budget import BudgetActivities
    from contracts.budget import (
        FenceScope,
        LeaseRelease,
        LeaseRequest,
        LeaseStage,
        LeaseState,
        LeaseStatus,
        PartitionShare,
        QuarantineStatus,
    )
    from contracts.models import OperatorDecision
    from workflows.call_options import CallOptions, failing_as_activity
    from workflows.fleet_budget import LEASE_STATE_SIGNAL, FleetBudgetWorkflow

__all__ = ["BudgetLease", "LEASE_STATE_SIGNAL", "check_quarantine"]

# The budget is another workflow on the same cluster: keep asking (a lease is required before any
# destructive step, so there is no failing open), but never longer than 30 s between attempts.
BUDGET_CALL = CallOptions(
    start_to_close_timeout=timedelta(seconds=30),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30)),
)
# Requests are idempotent, so the incident asks again rather than trust that nothing was lost: a
# budget that was terminated or reset learns of the request anew. Each wait for an answer is twice
# the one before (up to ASK_AGAIN_WHILE_WAITING): a budget slow to answer is a busy one, and asking
# it again adds to its work (at 1,000 incidents at once, a fixed minute made most of them ask twice).
ANSWER_WITHIN = timedelta(minutes=1)
ASK_AGAIN_WHILE_WAITING = timedelta(minutes=10)


class BudgetLease:
    """One incident's lease. `state` is the newest LeaseState the budget signalled, or None."""

    def __init__(self) -> None:
        self.state: LeaseState | None = None
        self._request: LeaseRequest | None = None
        self._in_task = False

    @property
    def granted(self) -> bool:
        return self.state is not None and self.state.granted

    @property
    def waiting(self) -> bool:
        return self.state is not None and self.state.waiting

    def on_state(self, state: LeaseState) -> None:
        """The body of the incident's LEASE_STATE_SIGNAL handler: answers and later changes."""
        if self._request is not None and state.incident_id == self._request.incident_id:
            self._keep_newest(state)

    @property
    def fence_held(self) -> bool:
        return self.state is not None and self.state.fence_held

    async def ask_to_fence(self, incident_id: str, node: str, scope: FenceScope, in_task: bool = False) -> LeaseState:
        """Ask the fence circuit breaker before the drain; answered within moments: permitted, or
        held (the breaker is tripped) and why. `in_task` as for request()."""
        self._in_task = in_task
        info = workflow.info()
        self._request = LeaseRequest(
            incident_id=incident_id,
            node=node,
            workflow_id=info.workflow_id,
            run_id=info.run_id,
            partitions=scope.partitions,
            running_jobs=0,
            stage=LeaseStage.FENCE,
            fleet_nodes=scope.fleet_nodes,
        )
        await self._ask_until(lambda: self.state is not None, ANSWER_WITHIN)
        assert self.state is not None
        return self.state

    async def wait_fence_permitted(self, stop: Callable[[], bool], timeout: timedelta) -> LeaseState:
        """Wait, durably, until the held fence is permitted (an operator reset the breaker),
        `stop()` is true (an operator's answer or abort), or `timeout` has passed."""
        deadline = workflow.now() + timeout
        await self._ask_until(
            lambda: not self.fence_held or stop() or workflow.now() >= deadline,
            ASK_AGAIN_WHILE_WAITING,
            ask_first=False,
            until=deadline,
        )
        assert self.state is not None
        return self.state

    async def approve_fence(self, decision: OperatorDecision) -> LeaseState:
        """An operator approved fencing past the tripped breaker: permitted at once, as theirs."""
        return await self._ask_approved(decision, lambda: not self.fence_held)

    async def request(
        self, incident_id: str, node: str, partitions: list[PartitionShare], job_ids: list[int], in_task: bool = False
    ) -> LeaseState:
        """Ask for the lease; the budget's answer comes within moments: granted, or waiting and why.
        `in_task`: ask by local activities, within the workflow task (NodeRecoveryWorkflow's
        FENCE_IN_ONE_TASK), this time and every time after."""
        self._in_task = in_task
        info = workflow.info()
        self._request = LeaseRequest(
            incident_id=incident_id,
            node=node,
            workflow_id=info.workflow_id,
            run_id=info.run_id,
            partitions=partitions,
            running_jobs=len(job_ids),
            job_ids=job_ids,
        )
        await self._ask_until(lambda: self.state is not None and not self.state.fencing, ANSWER_WITHIN)
        assert self.state is not None
        return self.state

    async def wait_granted(self, stop: Callable[[], bool] = lambda: False) -> LeaseState:
        """Wait, durably and as long as it takes, until the lease is granted or `stop()` is true
        (an operator's approval or abort); the incident's handlers keep running meanwhile."""
        await self._ask_until(lambda: not self.waiting or stop(), ASK_AGAIN_WHILE_WAITING, ask_first=False)
        assert self.state is not None
        return self.state

    async def approve_over_budget(self, decision: OperatorDecision) -> LeaseState:
        """An operator approved going over budget: the lease is granted at once, as theirs."""
        return await self._ask_approved(decision, lambda: not self.waiting)

    async def release(self, reason: str) -> None:
        """Return the lease, or withdraw the waiting request; idempotent."""
        state = self.state
        if state is None or state.status in (LeaseStatus.RELEASED, LeaseStatus.EXPIRED):
            return
        if not workflow.in_workflow():
            # A `finally` run by the garbage collector of a run evicted from this worker's cache:
            # the incident is not ending, it goes on elsewhere.
            return
        release = LeaseRelease(incident_id=state.incident_id, reason=reason[:500])
        try:
            await workflow.get_external_workflow_handle(state.budget_workflow_id).signal(
                FleetBudgetWorkflow.release_lease, release
            )
        except ApplicationError as err:
            # No budget running: it holds nothing of this incident any more.
            workflow.logger.warning("lease of %s not returned: %s", state.incident_id, err)
        self.state = state.model_copy(
            update={"status": LeaseStatus.RELEASED, "reason": release.reason, "ended_at": workflow.now()}
        )

    async def _ask_approved(self, decision: OperatorDecision, done: Callable[[], bool]) -> LeaseState:
        """The request asked again with the operator's approval, until the budget has acted on it."""
        assert self._request is not None, "ask first"
        self._request = self._request.model_copy(update={"approval": decision})
        await self._ask_until(done, ANSWER_WITHIN)
        assert self.state is not None
        return self.state

    async def _ask_until(
        self, done: Callable[[], bool], every: timedelta, ask_first: bool = True, until: datetime | None = None
    ) -> None:
        """Ask, then ask again at a doubling interval until `done()`; a wait never passes `until`."""
        if ask_first:
            await self._send_request()
        while not done():
            wait = every if until is None else min(every, until - workflow.now())
            try:
                await workflow.wait_condition(done, timeout=wait)
            except TimeoutError:
                if until is not None and workflow.now() >= until:
                    return
                every = min(every * 2, ASK_AGAIN_WHILE_WAITING)
                await self._send_request()

    async def _send_request(self) -> None:
        """Ask; the answer is the reply (kept at once, so that a lease granted outright is acted
        on in this workflow task), or comes by signal when the request had to go as one."""
        assert self._request is not None
        summary = (
            f"Ask the fence circuit breaker to let {self._request.node} be drained"
            if self._request.stage == LeaseStage.FENCE
            else f"Ask the fleet budget to put {self._request.node} under remediation"
        )
        if self._in_task:
            answer = await failing_as_activity(
                "request_lease",
                workflow.execute_local_activity_method(
                    BudgetActivities.request_lease, self._request, summary=summary, **BUDGET_CALL
                ),
            )
        else:
            answer = await workflow.execute_activity_method(
                BudgetActivities.request_lease, self._request, summary=summary, **BUDGET_CALL
            )
        if answer is not None:
            self.on_state(answer)

    def _keep_newest(self, state: LeaseState) -> None:
        # Answers to repeated requests repeat the state they had: keep only a newer one, or the
        # first word of a budget started anew (which knows only what it was asked since).
        if self.state is None or state.budget_epoch != self.state.budget_epoch or state.version > self.state.version:
            self.state = state


async def check_quarantine(node: str) -> QuarantineStatus:
    """Whether the node is a quarantined lemon, asked of the budget now (an operator may have
    released it since). For any workflow about to return a node to service."""
    return await workflow.execute_activity_method(
        BudgetActivities.check_quarantine, node, summary=f"Is {node} a quarantined lemon?", **BUDGET_CALL
    )
