"""FleetBudgetWorkflow: the fleet's disruption budget and lemon list, one per Temporal namespace
(workflow id `fleet-budget`; a namespace is one Slurm cluster). Decisions only: the arithmetic is
in workflows/budget_ledger.py, every side effect an activity. docs/safety.md has the design.

Protocol (the incident's side is workflows/budget_lease.py):

- update `ask_lease(LeaseRequest) -> LeaseState`, sent by the activity `request_lease`: the
  answer (granted, or waiting and why) is the update's reply, so an incident granted at once
  signals its jobs within the same workflow task.
- signal `request_lease(LeaseRequest)`: the same request, sent by that activity as
  signal-with-start when no budget runs (the worker starts one at start-up; else the first
  request does) or the update is refused (see below). Keyed by incident id: a repeated request
  changes nothing and is answered again.
- signal `fleet_budget_lease_state(LeaseState)` to the incident's run: the answer to every
  request by signal, and every later change (granted after waiting, expired).
- signal `release_lease(LeaseRelease)` from the incident (an external signal, no activity), at its
  end; withdraws a waiting request too. Idempotent.
- update `release_quarantine(QuarantineRelease) -> QuarantineStatus` (an operator; rejected when
  the node is not quarantined), update `reset_breaker(BreakerReset) -> BudgetStatus` (an operator;
  rejected when the fence circuit breaker is not tripped), update `set_policy(BudgetPolicy) -> BudgetStatus` (the worker
  at start-up), queries `status`, `timeline`, `quarantine(node)`, `lease(incident_id)`.

Why both: an update answers within one round trip (the reply), where a signal's answer needs a
signal back and a workflow task of the incident's to hear it (from the request to the jobs
signalled, 77 ms against 189 ms on the dev server: docs/safety.md). But Temporal admits at most
10 updates in flight per workflow and 2,000 per run (history.maxInFlightUpdates,
history.maxTotalUpdates), and aborts those in flight when the workflow continues as new: a storm
of failures would be refused most of its updates. Signals are queued durably whatever their
number, and none is lost to continue-as-new: so a worker sends at most 5 lease updates at once
(activities/budget.py), and a refused update is sent again as a signal at once, never retried as
an update.

Leases are reclaimed without their holder: every holder_check_seconds the activity
`find_closed_holders` describes the runs that hold or wait for a lease, and a closed run loses
both (a crashed, terminated or timed-out incident); a lease held longer than lease_max_seconds
expires (a stuck incident), and its incident is told. A signal to a closed run also reclaims its
lease at once. Both are deterministic: they act on activity results, signal outcomes and timers.

The budget continues as new when its history passes policy.history_limit events (or Temporal
suggests it), carrying its whole state, once nothing is in flight: no signal or notification
unsent, no audit line unwritten, no handler running. Waiting incidents are not affected: they
hear of their grant from whichever run makes it.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts.budget import (
        BreakerReset,
        BudgetInUse,
        BudgetPolicy,
        BudgetState,
        BudgetStatus,
        FleetBudgetInput,
        HolderRef,
        LeaseRelease,
        LeaseRequest,
        LeaseState,
        Notification,
        NotificationKind,
        QuarantineRelease,
        QuarantineStatus,
        TimelineEvent,
        TimelineKind,
    )
    from workflows.budget_ledger import BudgetLedger
    from workflows.call_options import CallOptions

from workflows.audit_trail import AuditTrail
from workflows.notify import notify
from workflows.operator_check import OperatorCheck

FLEET_BUDGET_WORKFLOW_ID = "fleet-budget"
# Runs that start on this code hold a workflow task's audit lines and write them with one local
# activity once its answers are out; runs begun before write each line with a local activity of
# its own as it is decided (docs/upgrades.md).
AUDIT_LINES_HELD = "audit-lines-held"
NOT_TRIPPED = "the fence circuit breaker is not tripped"


def fleet_budget_workflow_id(task_queue: str) -> str:
    """One budget per fleet, and a fleet is what the workers of one task queue recover."""
    return f"{FLEET_BUDGET_WORKFLOW_ID}-{task_queue}"


# The incident workflow's signal handler for the answers to its requests and its lease's later
# changes (workflows/budget_lease.py).
LEASE_STATE_SIGNAL = "fleet_budget_lease_state"
# Called by name: activities/budget.py imports this module for the budget's typed signals and updates.
FIND_CLOSED_HOLDERS = "find_closed_holders"
# activities/telemetry.py: the gauge of nodes in use, kept by the worker that runs the budget.
RECORD_BUDGET_IN_USE = "record_budget_in_use"

HOLDER_CHECK = CallOptions(
    start_to_close_timeout=timedelta(minutes=2),
    # A check that fails is skipped; the next one comes holder_check_seconds later.
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3),
)

AUDIT_ACTIONS = {
    TimelineKind.QUEUED: "lease_queued",
    TimelineKind.GRANTED: "lease_granted",
    TimelineKind.RELEASED: "lease_released",
    TimelineKind.WITHDRAWN: "lease_withdrawn",
    TimelineKind.EXPIRED: "lease_expired",
    TimelineKind.RECLAIMED: "lease_reclaimed",
    TimelineKind.QUARANTINED: "node_quarantined",
    TimelineKind.QUARANTINE_RELEASED: "quarantine_released",
    TimelineKind.POLICY_CHANGED: "budget_policy_changed",
    TimelineKind.FENCE_PERMITTED: "fence_permitted",
    TimelineKind.FENCE_HELD: "fence_held",
    TimelineKind.BREAKER_TRIPPED: "breaker_tripped",
    TimelineKind.BREAKER_RESET: "breaker_reset",
}
# Lease changes the incident hears of besides the answers to its requests (the others it caused
# itself, or it has closed).
TOLD_TO_INCIDENT = {TimelineKind.GRANTED, TimelineKind.EXPIRED, TimelineKind.FENCE_PERMITTED}


@workflow.defn
class FleetBudgetWorkflow:
    @workflow.init
    def __init__(self, inp: FleetBudgetInput) -> None:
        info = workflow.info()
        self._ledger = BudgetLedger(
            inp.state or BudgetState(policy=inp.policy), info.workflow_id, budget_epoch=info.first_execution_run_id
        )
        self._audit = AuditTrail(hold=workflow.patched(AUDIT_LINES_HELD))
        self._operators = OperatorCheck(self._audit)
        self._to_tell: list[str] = []
        self._to_notify: list[Notification] = []
        self._next_holder_check: datetime | None = None
        self._sleeping_until: datetime | None = None
        self._wake = False
        self._reported_in_use: int | None = None

    # --- the incidents' side ------------------------------------------------------------------

    @workflow.update
    def ask_lease(self, req: LeaseRequest) -> LeaseState:
        self._decided(self._ledger.request(req, workflow.now()), answered=req.incident_id)
        told = self._told(req.incident_id)
        assert told is not None, "a lease just requested is in the ledger"
        return told

    @workflow.signal
    def request_lease(self, req: LeaseRequest) -> None:
        self._to_tell.append(req.incident_id)  # the answer, whether or not anything changed
        self._decided(self._ledger.request(req, workflow.now()))

    @workflow.signal
    def release_lease(self, release: LeaseRelease) -> None:
        self._decided(self._ledger.release(release.incident_id, release.reason, workflow.now()))

    # --- operators and configuration ----------------------------------------------------------

    @workflow.update
    async def release_quarantine(self, release: QuarantineRelease) -> QuarantineStatus:
        await self._operators.verified(
            "release_quarantine", release.actor, release.reason, release.signature, release.node, node=release.node
        )
        if (why := self._why_not_quarantined(release)) is not None:  # released while it was verified
            raise ApplicationError(why, type="NotQuarantined", non_retryable=True)
        now = workflow.now()
        self._decided(self._ledger.release_quarantine(release, now))
        return self._ledger.quarantine_status(release.node, now)

    @release_quarantine.validator
    def _only_a_quarantined_node(self, release: QuarantineRelease) -> None:
        if (why := self._why_not_quarantined(release)) is not None:
            raise ValueError(why)
        self._operators.still_heard()

    def _why_not_quarantined(self, release: QuarantineRelease) -> str | None:
        return None if self._ledger.quarantined(release.node) else f"node {release.node} is not quarantined"

    @workflow.update
    async def reset_breaker(self, reset: BreakerReset) -> BudgetStatus:
        await self._operators.verified("reset_breaker", reset.actor, reset.reason, reset.signature)
        if self._ledger.state.breaker is None:  # reset while it was verified
            raise ApplicationError(NOT_TRIPPED, type="NotTripped", non_retryable=True)
        now = workflow.now()
        self._decided(self._ledger.reset_breaker(reset, now))
        return self._ledger.status(now)

    @reset_breaker.validator
    def _only_a_tripped_breaker(self, reset: BreakerReset) -> None:
        if self._ledger.state.breaker is None:
            raise ValueError(NOT_TRIPPED)
        self._operators.still_heard()

    @workflow.update
    def set_policy(self, policy: BudgetPolicy) -> BudgetStatus:
        now = workflow.now()
        self._decided(self._ledger.set_policy(policy, now))
        return self._ledger.status(now)

    @workflow.query
    def status(self) -> BudgetStatus:
        return self._ledger.status(workflow.now())

    @workflow.query
    def timeline(self) -> list[TimelineEvent]:
        return self._ledger.state.timeline

    @workflow.query
    def quarantine(self, node: str) -> QuarantineStatus:
        return self._ledger.quarantine_status(node, workflow.now())

    @workflow.query
    def lease(self, incident_id: str) -> LeaseState | None:
        return self._ledger.lease_state(incident_id)

    # --- the loop: timers, holder checks, telling incidents, continuing as new ----------------

    @workflow.run
    async def run(self, inp: FleetBudgetInput) -> None:
        workflow.set_current_details(
            f"Fleet disruption budget: at most {self._ledger.policy.max_nodes} nodes under remediation at once"
        )
        acting: asyncio.Future[None] | None = None
        try:
            while True:
                await self._sleep_until_needed()
                # Shielded: see below.
                acting = asyncio.ensure_future(self._act_on_decisions())
                await asyncio.shield(acting)
        except asyncio.CancelledError:
            # Cancelled (by an operator, or a test): end once what was decided is sent and written.
            # Cancelled midway, temporalio 1.35 would cancel the signals in flight too, and when a
            # signal's result came in the same workflow task as the cancellation, it asks Temporal's
            # core to cancel a finished signal: every workflow task of the budget then fails
            # ("Invalid transition in state machine"), and the budget neither ends nor answers
            # again. An audit line written after the cancellation fails the task too.
            if acting is not None:
                await acting
            await self._audit.flush()
            raise

    async def _act_on_decisions(self) -> None:
        self._decided(self._ledger.expire_overdue(workflow.now()))
        if self._next_holder_check is not None and workflow.now() >= self._next_holder_check:
            await self._check_holders()
        await self._tell_incidents()
        await self._send_notifications()
        self._audit.write_held()  # after the answers: their workflow task waited for no line
        await self._report_in_use()
        if self._history_is_long():
            await self._audit.flush()
            await workflow.wait_condition(workflow.all_handlers_finished)
            # Handlers may have run during those waits: continue as new only with nothing in flight.
            if not (self._to_tell or self._to_notify or self._audit.pending):
                state = self._ledger.compacted(workflow.now())
                workflow.continue_as_new(FleetBudgetInput(policy=state.policy, state=state))

    def _decided(self, events: list[TimelineEvent], answered: str | None = None) -> None:
        """Audit every decision, queue what incidents and the webhook must hear (but not the
        incident `answered` in an update's reply), and wake the loop when it has something to send
        or write, a deadline came closer than the one it sleeps until, or the history is long
        enough to continue as new."""
        for event in events:
            self._audit.decision(
                AUDIT_ACTIONS[event.kind],
                incident=event.incident_id,
                node=event.node,
                reason=event.detail,
                result=event.kind.value,
                actor=event.actor,
                actor_kind=event.actor_kind,
                parameters={"holders": event.holders, "seq": event.seq},
            )
            if event.kind in TOLD_TO_INCIDENT and event.incident_id is not None and event.incident_id != answered:
                self._to_tell.append(event.incident_id)
            if event.kind in NOTIFIED and self._ledger.policy.notifications:
                self._to_notify.append(NOTIFIED[event.kind](event))
        now = workflow.now()
        if not self._ledger.state.leases:
            self._next_holder_check = None
        elif self._next_holder_check is None:
            self._next_holder_check = now + timedelta(seconds=self._ledger.policy.holder_check_seconds)
        deadline = self._deadline(now)
        came_closer = deadline is not None and (self._sleeping_until is None or deadline < self._sleeping_until)
        self._wake = (
            self._wake
            or bool(self._to_tell or self._to_notify)
            or self._audit.holding
            or came_closer
            or self._history_is_long()
        )

    def _deadline(self, now: datetime) -> datetime | None:
        return min(filter(None, (self._ledger.next_deadline(now), self._next_holder_check)), default=None)

    async def _sleep_until_needed(self) -> None:
        now = workflow.now()
        self._sleeping_until = self._deadline(now)
        if not self._wake and (self._sleeping_until is None or self._sleeping_until > now):
            timeout = self._sleeping_until - now if self._sleeping_until else None
            try:
                await workflow.wait_condition(lambda: self._wake, timeout=timeout)
            except TimeoutError:
                pass
        self._wake = False

    async def _check_holders(self) -> None:
        try:
            closed = await workflow.execute_activity(
                FIND_CLOSED_HOLDERS,
                self._ledger.holder_refs(),
                result_type=list[HolderRef],
                summary="Which incidents holding or waiting for a lease have closed",
                **HOLDER_CHECK,
            )
        except ActivityError as err:
            workflow.logger.warning(
                "lease holder check failed, next one in %s s: %s", self._ledger.policy.holder_check_seconds, err.cause
            )
            closed = []
        self._next_holder_check = None
        self._decided(self._ledger.drop_closed(closed, workflow.now()))

    async def _tell_incidents(self) -> None:
        incidents, self._to_tell = list(dict.fromkeys(self._to_tell)), []
        await asyncio.gather(*(self._tell(incident) for incident in incidents))

    def _told(self, incident_id: str) -> LeaseState | None:
        """What an incident is told of its lease. The lemons go with it, so that no incident has
        to query the budget for them: a thousand queries at once overflow the budget's query
        buffer (BusyWorkflow)."""
        state = self._ledger.lease_state(incident_id)
        return state.model_copy(update={"lemons": self._ledger.lemons()}) if state is not None else None

    async def _tell(self, incident_id: str) -> None:
        told = self._told(incident_id)
        if told is None:
            # Its lease ended, and so many more ended since that the ledger forgot it (it keeps
            # the last FINISHED_KEPT): nothing is left to tell. An assertion here failed every
            # workflow task of the budget at N = 1,000.
            return
        try:
            await workflow.get_external_workflow_handle(told.workflow_id, run_id=told.run_id).signal(
                LEASE_STATE_SIGNAL, told
            )
        except ApplicationError as err:
            if err.type == "ExternalWorkflowExecutionNotFound":
                ref = HolderRef(incident_id=incident_id, workflow_id=told.workflow_id, run_id=told.run_id)
                self._decided(self._ledger.drop_closed([ref], workflow.now()))
            else:
                # Never fail the budget over one incident: an incident that does not hear of its
                # lease keeps waiting, and the lease expires after lease_max_seconds.
                workflow.logger.error("could not tell %s of its lease: %s", incident_id, err)

    async def _send_notifications(self) -> None:
        notifications, self._to_notify = self._to_notify, []
        for notification in notifications:
            await notify(notification)

    async def _report_in_use(self) -> None:
        in_use = len(self._ledger.holders())
        if in_use == self._reported_in_use:
            return
        self._reported_in_use = in_use
        try:
            await workflow.execute_local_activity(
                RECORD_BUDGET_IN_USE,
                BudgetInUse(budget=workflow.info().workflow_id, nodes=in_use),
                start_to_close_timeout=timedelta(seconds=5),
                retry_policy=RetryPolicy(maximum_attempts=2),
            )
        except ActivityError as err:
            # A metric never holds up the budget; the next change reports again.
            workflow.logger.warning("budget gauge not recorded: %s", err.cause)

    def _history_is_long(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested() or info.get_current_history_length() > self._ledger.policy.history_limit
        )


def _quarantine_notification(event: TimelineEvent) -> Notification:
    assert event.node is not None and event.incident_id is not None
    return Notification(
        kind=NotificationKind.QUARANTINED,
        incident_id=event.incident_id,
        node=event.node,
        at=event.at,
        summary=(
            f"{event.node} is quarantined as a lemon ({event.detail}); it is not returned to service "
            f"until an operator runs `recovery release-quarantine {event.node}`"
        ),
    )


def _breaker_notification(event: TimelineEvent) -> Notification:
    assert event.node is not None and event.incident_id is not None
    return Notification(
        kind=NotificationKind.BREAKER_TRIPPED,
        incident_id=event.incident_id,
        node=event.node,
        at=event.at,
        summary=(
            f"the fence circuit breaker tripped at {event.node}: {event.detail}. New incidents are held and "
            "nothing is drained until an operator runs `recovery reset-breaker --reason ...`"
        )[:1000],
    )


NOTIFIED = {TimelineKind.QUARANTINED: _quarantine_notification, TimelineKind.BREAKER_TRIPPED: _breaker_notification}
