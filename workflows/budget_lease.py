"""The incident's side of the fleet disruption budget (workflows/fleet_budget.py): deterministic
workflow code that asks for a lease, hears of it while it waits, returns it, and asks whether
the node is a quarantined lemon. One lease per incident id.

What NodeRecoveryWorkflow adds to use it (names from this module, workflows/notify.py and
contracts/budget.py):

1. The lease and the handler through which the budget tells the incident of later changes
   (granted after waiting, expired):

       # __init__
       self._lease = BudgetLease()

       @workflow.signal(name=LEASE_STATE_SIGNAL)
       def fleet_budget_lease_state(self, state: LeaseState) -> None:
           self._lease.on_state(state)

2. In _recover, after find_jobs (the jobs it will disrupt are known) and before the first
   destructive step (the SIGUSR1, requeue and mark-down that follow), with the node's partitions
   and their sizes from Slurm:

       lease = await self._step("budget", self._lease.request(
           self._incident_id, req.node, partitions, running_jobs=len(jobs)))
       if lease.waiting:
           self._note(f"over budget, waiting (drained, nothing killed): {lease.reason}")
           await notify(Notification(kind=NotificationKind.APPROVAL_NEEDED, incident_id=self._incident_id,
                                     node=req.node, at=workflow.now(), summary=lease.reason))
           await workflow.wait_condition(
               lambda: not self._lease.waiting or self._approval is not None or self._aborted)
           if self._lease.waiting and self._approval is not None:
               await self._lease.approve_over_budget(self._approval)   # OperatorDecision from `approve`
       # self._lease.granted is now true unless the incident was aborted while waiting

   The wait is an ordinary wait_condition: signals, updates and queries keep being handled, for
   hours if need be, and a worker restart loses nothing.

3. At the end, whatever the outcome, in run():

       finally:
           await self._lease.release(self._outcome or "incident ended")

   (a no-op when no lease was asked for; a terminated or crashed incident's lease is reclaimed by
   the budget, which checks that holders still run).

4. Before returning a node to service (never blocked by the budget; the same for a spare that is
   about to be claimed):

       if (await self._lease.check_quarantine(node)).quarantined:
           ... leave it out of service; `recovery release-quarantine NODE` is the operator's way back

5. Worker registrations: see docs/safety.md ("Wiring").
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.budget import BudgetActivities
    from contracts.budget import LeaseRelease, LeaseRequest, LeaseState, LeaseStatus, PartitionShare, QuarantineStatus
    from contracts.models import OperatorDecision
    from workflows.fleet_budget import LEASE_STATE_SIGNAL, FleetBudgetWorkflow

__all__ = ["BudgetLease", "LEASE_STATE_SIGNAL"]

# The budget is another workflow on the same cluster: keep asking (a lease is required before any
# destructive step, so there is no failing open), but never longer than 30 s between attempts.
BUDGET_CALL = dict(
    start_to_close_timeout=timedelta(seconds=30),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30)),
)


class BudgetLease:
    """One incident's lease. `state` is the newest LeaseState heard (answer or signal), or None."""

    def __init__(self) -> None:
        self.state: LeaseState | None = None
        self._request: LeaseRequest | None = None

    @property
    def granted(self) -> bool:
        return self.state is not None and self.state.granted

    @property
    def waiting(self) -> bool:
        return self.state is not None and self.state.waiting

    def on_state(self, state: LeaseState) -> None:
        """The body of the incident's LEASE_STATE_SIGNAL handler."""
        if self._request is not None and state.incident_id == self._request.incident_id:
            self._keep_newest(state)

    async def request(self, incident_id: str, node: str, partitions: list[PartitionShare],
                      running_jobs: int) -> LeaseState:
        """Ask for the lease; the answer comes at once: granted, or waiting and why."""
        info = workflow.info()
        self._request = LeaseRequest(incident_id=incident_id, node=node, workflow_id=info.workflow_id,
                                     run_id=info.run_id, partitions=partitions, running_jobs=running_jobs)
        return await self._ask(self._request)

    async def approve_over_budget(self, decision: OperatorDecision) -> LeaseState:
        """An operator approved going over budget: the lease is granted at once, as theirs."""
        assert self._request is not None, "request() first"
        return await self._ask(self._request.model_copy(update={"approval": decision}))

    async def release(self, reason: str) -> None:
        """Return the lease, or withdraw the waiting request; idempotent."""
        state = self.state
        if state is None or state.status not in (LeaseStatus.WAITING, LeaseStatus.GRANTED):
            return
        release = LeaseRelease(incident_id=state.incident_id, reason=reason[:500])
        try:
            await workflow.get_external_workflow_handle(state.budget_workflow_id).signal(
                FleetBudgetWorkflow.release_lease, release)
        except ApplicationError as err:
            # No budget running: it holds nothing of this incident any more.
            workflow.logger.warning("lease of %s not returned: %s", state.incident_id, err)
        self.state = state.model_copy(update={"status": LeaseStatus.RELEASED, "reason": release.reason,
                                              "ended_at": workflow.now()})

    async def check_quarantine(self, node: str) -> QuarantineStatus:
        """Ask the budget now (an operator may have released the node since the lease was granted)."""
        return await workflow.execute_activity_method(
            BudgetActivities.check_quarantine, node, summary=f"Is {node} a quarantined lemon?", **BUDGET_CALL)

    async def _ask(self, request: LeaseRequest) -> LeaseState:
        self._keep_newest(await workflow.execute_activity_method(
            BudgetActivities.request_lease, request,
            summary=f"Ask the fleet budget to put {request.node} under remediation", **BUDGET_CALL,
        ))
        assert self.state is not None
        return self.state

    def _keep_newest(self, state: LeaseState) -> None:
        # The answer to a request and a later signal can arrive in either order.
        if self.state is None or state.version > self.state.version:
            self.state = state
