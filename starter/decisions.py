"""An operator's decision on an incident, signed where it applies (contracts/operators.py): for
`recovery approve|deny|abort`, the drills and the benchmarks alike."""

from __future__ import annotations

from typing import Literal

from temporalio.client import WorkflowHandle

from contracts.models import IncidentStatus, OperatorDecision
from contracts.operators import DecisionSigner

IncidentDecision = Literal["approve", "deny", "abort"]


class NothingAwaitsApproval(ValueError):
    pass


async def signed_decision(
    handle: WorkflowHandle, kind: IncidentDecision, signer: DecisionSigner, reason: str
) -> OperatorDecision:
    """The decision signed for the incident's current run and, for approve and deny, the gate it answers."""
    run_id = handle.run_id or (await handle.describe()).run_id
    gate = ""
    if kind != "abort":
        status = await handle.query("status", result_type=IncidentStatus)
        if status.awaiting_approval is None:
            raise NothingAwaitsApproval(f"it awaits no approval (phase {status.phase})")
        gate = status.awaiting_approval.gate
    return OperatorDecision(
        actor=signer.actor, reason=reason, signature=signer.sign(kind, handle.id, run_id, gate, reason)
    )


async def decide(handle: WorkflowHandle, kind: IncidentDecision, signer: DecisionSigner, reason: str) -> IncidentStatus:
    """Sends the signed decision; WorkflowUpdateFailedError when the incident refuses it."""
    decision = await signed_decision(handle, kind, signer, reason)
    return await handle.execute_update(kind, decision, result_type=IncidentStatus)
