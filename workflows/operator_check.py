"""An operator's decision counts only once the worker has verified its signature
(contracts/operators.py): the incident's approve, deny and abort, the fleet budget's breaker reset
and quarantine release. A refused decision is audited and the update fails with why; past
REFUSALS_HEARD of them a run refuses the next ones in its validators, unheard and unaudited, so
that no sender can grow its history or the audit log without bound."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.operators import OperatorActivities
    from contracts.models import OperatorSignature
    from contracts.operators import DecisionCheck, DecisionKind
    from workflows.audit_trail import AuditTrail
    from workflows.call_options import CallOptions

# Runs whose first decision reaches this code verify every decision; a run that took one before
# took it unverified and replays so (patched() keeps its first answer for the run).
VERIFIED_OPERATORS = "verified-operators"
VERIFY_CALL = CallOptions(
    start_to_close_timeout=timedelta(seconds=10),
    schedule_to_close_timeout=timedelta(seconds=60),
    retry_policy=RetryPolicy(maximum_attempts=3),
)
REFUSALS_HEARD = 20
DECISION_REFUSED = "DecisionRefused"


class OperatorCheck:
    def __init__(self, audit: AuditTrail) -> None:
        self._audit = audit
        self.refused = 0

    def still_heard(self) -> None:
        """For an update's validator: past REFUSALS_HEARD refused decisions, a run refuses the next
        ones unheard (a validator's refusal writes nothing to the history). Each heard decision adds
        events to the history, and anyone who can write to the namespace can send them."""
        if self.refused >= REFUSALS_HEARD:
            raise ValueError(f"{self.refused} operator decisions were refused in this run: it hears no more")

    async def verified(
        self,
        kind: DecisionKind,
        actor: str,
        reason: str,
        signature: OperatorSignature | None,
        subject: str = "",
        *,
        incident: str | None = None,
        node: str | None = None,
    ) -> str | None:
        """The verifying key's fingerprint, or None in a run that took this decision before
        VERIFIED_OPERATORS; refused: audited, and ApplicationError DecisionRefused."""
        if not workflow.patched(VERIFIED_OPERATORS):
            return None
        info = workflow.info()
        verdict = await workflow.execute_activity_method(
            OperatorActivities.verify_decision,
            DecisionCheck(
                kind=kind,
                workflow_id=info.workflow_id,
                run_id=info.run_id,
                subject=subject,
                actor=actor,
                reason=reason,
                signature=signature,
            ),
            summary=f"Verify {actor}'s signature on this {kind}",
            **VERIFY_CALL,
        )
        if verdict.verified:
            return verdict.detail
        self.refused += 1
        self._audit.decision(
            f"{kind}_refused",
            incident=incident,
            node=node,
            reason=verdict.detail,
            result="refused",
            actor=actor,
            actor_kind="unverified",
            parameters={"claimed_reason": reason, "subject": subject},
        )
        raise ApplicationError(f"{kind} refused: {verdict.detail}", type=DECISION_REFUSED, non_retryable=True)
