"""The activities and client calls around FleetBudgetWorkflow, through the Temporal client.

Activities (registered on the worker): `request_lease` (an update, or signal-with-start when no
budget runs or Temporal refuses the update: the budget starts with the first request),
`check_quarantine` (before a node returns to service), `quarantined_among` (spares the incident
must not claim, when no lease answer told it) and `find_closed_holders` (for the budget's lease
expiry).

Client calls (for the worker and the CLI): ensure_fleet_budget() at worker start-up, so that the
running budget has the configured policy; release_quarantine() for
`recovery release-quarantine NODE`; reset_breaker() for `recovery reset-breaker`;
fleet_budget_status().
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf.field_mask_pb2 import FieldMask
from temporalio import activity
from temporalio.api.common.v1 import Priority as PriorityMessage, WorkflowExecution
from temporalio.api.workflow.v1 import WorkflowExecutionOptions
from temporalio.api.workflowservice.v1 import UpdateWorkflowExecutionOptionsRequest
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import Priority, WorkflowIDConflictPolicy
from temporalio.exceptions import FailureError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.workflow import UpdateMethodMultiParam

from contracts.budget import (
    BreakerReset,
    BudgetPolicy,
    BudgetStatus,
    FleetBudgetInput,
    HolderRef,
    LeaseRequest,
    LeaseState,
    QuarantineRelease,
    QuarantineStatus,
)
from contracts.operators import DecisionSigner
from workflows.fleet_budget import FIND_CLOSED_HOLDERS, FLEET_BUDGET_WORKFLOW_ID, FleetBudgetWorkflow

logger = logging.getLogger(__name__)

# Describe calls in flight at once while checking holders: a storm's hundred waiters, politely.
DESCRIBE_CONCURRENCY = 8
# Lease requests this worker sends as updates at once; the rest go as signals at once. Temporal
# admits 10 updates in flight per workflow, and its client retries a refused one for seconds
# before giving up: under a storm, a request must not wait for that. Half of the 10 leaves room
# for a second worker and for the operators' updates (set_policy, release_quarantine).
LEASE_UPDATES_IN_FLIGHT = 5
# How long a lease update may take before the request goes as a signal instead. The update runs in
# the incident's first workflow task, which it holds open: a busy budget must not hold that task
# towards its timeout (under load, incidents' first tasks timed out and ran again). An update the
# budget takes up later is harmless: the signal gets the answer. Idle, an update takes 15-60 ms.
LEASE_UPDATE_WITHIN = 2.0
BUDGET_SUMMARY = "Fleet disruption budget and lemon list"
# The budget's tasks go ahead of the incidents' on the task queue they share (the default key is 3;
# its runs after a continue-as-new keep it). Every incident waits for the budget's answer before its
# first signal: behind a storm's backlog of incidents' tasks, one of the budget's waited 110-126 s.
BUDGET_PRIORITY_KEY = 1
BUDGET_PRIORITY = Priority(priority_key=BUDGET_PRIORITY_KEY)


def _starting_budget(workflow_id: str, task_queue: str) -> dict[str, Any]:
    """The options of a call that starts the budget when none is running, and reaches it when one is."""
    return dict(
        id=workflow_id,
        task_queue=task_queue,
        static_summary=BUDGET_SUMMARY,
        priority=BUDGET_PRIORITY,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )


class BudgetActivities:
    def __init__(
        self, client: Client, policy: BudgetPolicy, task_queue: str, workflow_id: str = FLEET_BUDGET_WORKFLOW_ID
    ):
        self._client = client
        self._policy = policy
        self._task_queue = task_queue
        self._workflow_id = workflow_id
        self._lease_updates = asyncio.Semaphore(LEASE_UPDATES_IN_FLIGHT)

    @activity.defn
    async def request_lease(self, req: LeaseRequest) -> LeaseState | None:
        """Hand the request to the budget. Its answer: the update's reply; or None when the
        request went as a signal-with-start, answered by signal: with no budget running (the
        signal starts it), with LEASE_UPDATES_IN_FLIGHT updates of this worker's in flight
        already, or when the update was refused (too many in flight or in this run of the
        budget, updates disabled, the budget continuing as new or on older code) or not answered
        within LEASE_UPDATE_WITHIN. Every call is a request anew (no update id kept): the
        budget's ledger makes repeats idempotent, and answers each with the lease as it stands."""
        if not self._lease_updates.locked():  # checked and taken with no await between: one event loop
            async with self._lease_updates:
                try:
                    return await asyncio.wait_for(
                        self._budget().execute_update(FleetBudgetWorkflow.ask_lease, req), LEASE_UPDATE_WITHIN
                    )
                # WorkflowUpdateFailedError: the update was rejected, which ask_lease never does; a
                # budget on code from before it does (no such update): during a rolling upgrade.
                except (
                    RPCError,
                    WorkflowUpdateRPCTimeoutOrCancelledError,
                    WorkflowUpdateFailedError,
                    TimeoutError,
                ) as err:
                    activity.logger.info(
                        "lease request of %s sent by signal: the update was refused or late (%r)", req.incident_id, err
                    )
        try:
            await self._client.start_workflow(
                FleetBudgetWorkflow.run,
                FleetBudgetInput(policy=self._policy),
                **_starting_budget(self._workflow_id, self._task_queue),
                start_signal="request_lease",
                start_signal_args=[req],
            )
        except WorkflowAlreadyStartedError:
            # Another request started the budget at the same moment: Temporal's test server answers
            # the slower of two racing signal-with-starts so (the dev server never did, in 600).
            # The budget runs now: the request goes to it as a plain signal.
            await self._budget().signal(FleetBudgetWorkflow.request_lease, req)
        return None

    def _budget(self) -> WorkflowHandle:
        return self._client.get_workflow_handle_for(FleetBudgetWorkflow.run, self._workflow_id)

    @activity.defn
    async def check_quarantine(self, node: str) -> QuarantineStatus:
        """Whether the node is a lemon; no budget running means no incident was ever counted."""
        try:
            return await self._budget().query(FleetBudgetWorkflow.quarantine, node)
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            return QuarantineStatus(node=node, quarantined=False)

    @activity.defn
    async def quarantined_among(self, nodes: list[str]) -> list[str]:
        """Those of `nodes` that are quarantined lemons: spares the incident must not claim."""
        found = await asyncio.gather(*(self.check_quarantine(node) for node in nodes))
        return [status.node for status in found if status.quarantined]

    @activity.defn(name=FIND_CLOSED_HOLDERS)
    async def find_closed_holders(self, holders: list[HolderRef]) -> list[HolderRef]:
        """The runs among `holders` that are no longer running (or are gone from Temporal)."""
        limit = asyncio.Semaphore(DESCRIBE_CONCURRENCY)

        async def closed(ref: HolderRef) -> bool:
            async with limit:
                try:
                    description = await self._client.get_workflow_handle(ref.workflow_id, run_id=ref.run_id).describe()
                except RPCError as err:
                    if err.status != RPCStatusCode.NOT_FOUND:
                        raise
                    return True
            return description.status != WorkflowExecutionStatus.RUNNING

        found = await asyncio.gather(*(closed(ref) for ref in holders))
        return [ref for ref, is_closed in zip(holders, found) if is_closed]


async def ensure_fleet_budget(
    client: Client, policy: BudgetPolicy, task_queue: str, workflow_id: str = FLEET_BUDGET_WORKFLOW_ID
) -> BudgetStatus:
    """Start the budget if it is not running, and give it this policy and BUDGET_PRIORITY
    (idempotent)."""
    start = WithStartWorkflowOperation(
        FleetBudgetWorkflow.run, FleetBudgetInput(policy=policy), **_starting_budget(workflow_id, task_queue)
    )
    status = await client.execute_update_with_start_workflow(
        FleetBudgetWorkflow.set_policy, policy, start_workflow_operation=start
    )
    await give_budget_priority(client, workflow_id)
    return status


async def give_budget_priority(client: Client, workflow_id: str) -> None:
    """A budget started by a version before BUDGET_PRIORITY has the default key, and would keep it
    across every continue-as-new. The key only makes the budget answer sooner under a storm: a
    server that will not change it (one without task-queue priority, Temporal's time-skipping test
    server, an authorizer that refuses the call) leaves the budget as it is, and the worker starts."""
    try:
        description = (await client.get_workflow_handle(workflow_id).describe()).raw_description
        priority = description.workflow_execution_info.priority
        if priority.priority_key == BUDGET_PRIORITY_KEY:
            return
        await client.workflow_service.update_workflow_execution_options(
            UpdateWorkflowExecutionOptionsRequest(
                namespace=client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=workflow_id),
                workflow_execution_options=WorkflowExecutionOptions(
                    priority=PriorityMessage(priority_key=BUDGET_PRIORITY_KEY)
                ),
                update_mask=FieldMask(paths=["priority"]),
            )
        )
    except RPCError as err:
        logger.warning(
            "the fleet budget %s keeps its task-queue priority: Temporal would not change it (%s: %s)",
            workflow_id,
            err.status.name,
            err.message,
        )


async def release_quarantine(
    client: Client, node: str, signer: DecisionSigner, reason: str, workflow_id: str = FLEET_BUDGET_WORKFLOW_ID
) -> QuarantineStatus:
    """An operator returns a lemon to automatic handling. ValueError when it is not quarantined
    or the budget refuses the operator's signature."""
    return await _operator_update(
        client,
        workflow_id,
        FleetBudgetWorkflow.release_quarantine,
        lambda run_id: QuarantineRelease(
            node=node,
            actor=signer.actor,
            reason=reason,
            signature=signer.sign("release_quarantine", workflow_id, run_id, node, reason),
        ),
        f"node {node} is not quarantined (no fleet budget is running)",
    )


async def reset_breaker(
    client: Client, signer: DecisionSigner, reason: str, workflow_id: str = FLEET_BUDGET_WORKFLOW_ID
) -> BudgetStatus:
    """An operator resets the tripped fence circuit breaker. ValueError when it is not tripped
    or the budget refuses the operator's signature."""
    return await _operator_update(
        client,
        workflow_id,
        FleetBudgetWorkflow.reset_breaker,
        lambda run_id: BreakerReset(
            actor=signer.actor, reason=reason, signature=signer.sign("reset_breaker", workflow_id, run_id, "", reason)
        ),
        "the fence circuit breaker is not tripped (no fleet budget is running)",
    )


Signed = TypeVar("Signed")
Answer = TypeVar("Answer")


async def _operator_update(
    client: Client,
    workflow_id: str,
    update: UpdateMethodMultiParam[[FleetBudgetWorkflow, Signed], Answer],
    signed: Callable[[str], Signed],
    when_no_budget: str,
) -> Answer:
    """An operator's update of the budget's current run, signed for that run; the budget's refusal,
    or no budget running, as ValueError. A run that continued as new meanwhile is asked again once."""
    not_found = None
    for _attempt in (1, 2):
        try:
            run_id = (await client.get_workflow_handle(workflow_id).describe()).run_id
            handle = client.get_workflow_handle_for(FleetBudgetWorkflow.run, workflow_id, run_id=run_id)
            return await handle.execute_update(update, signed(run_id))
        except WorkflowUpdateFailedError as err:
            refusal = err.cause  # the budget's validator, or its check of the signature, said no
            raise ValueError(refusal.message if isinstance(refusal, FailureError) else str(err)) from err
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            not_found = err
    raise ValueError(when_no_budget) from not_found


async def fleet_budget_status(client: Client, workflow_id: str = FLEET_BUDGET_WORKFLOW_ID) -> BudgetStatus:
    return await client.get_workflow_handle_for(FleetBudgetWorkflow.run, workflow_id).query(FleetBudgetWorkflow.status)
