"""Where the incident waits for a person: an approval gate before a destructive step (and the
budget's and the breaker's holds, which an operator may answer), and an abort at any time. Each
answer is verified against the operators' keys (workflows/operator_check.py), audited, and kept in
`decisions`; a gate nobody answers is decided by the policy when its deadline passes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Literal

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts.audit import ActorKind
    from contracts.budget import NotificationKind
    from contracts.models import ApprovalGate, ApprovalRequest, DecisionRecord, Gate, OperatorDecision, RecoveryPolicy
    from workflows.audit_trail import AuditTrail
    from workflows.incident.identity import IncidentRef
    from workflows.incident.steps import Steps
    from workflows.operator_check import OperatorCheck


class Gates:
    def __init__(
        self,
        incident: IncidentRef,
        steps: Steps,
        audit: AuditTrail,
        notify: Callable[[NotificationKind, str], Awaitable[None]],
    ) -> None:
        self._incident = incident
        self._steps = steps
        self._audit = audit
        self._notify = notify
        self.operators = OperatorCheck(audit)
        self.awaiting: ApprovalRequest | None = None
        self.answer: DecisionRecord | None = None
        self.abort: DecisionRecord | None = None
        self.decisions: list[DecisionRecord] = []

    # --- the operators' answers (the workflow's updates and their validators) --------------------

    def why_no_approval(self) -> str | None:
        if self.awaiting is None or self.answer is not None:
            return f"incident {self._incident.name} awaits no approval (phase {self._steps.timeline.current})"
        return None

    async def answer_gate(self, kind: Literal["approve", "deny"], decision: OperatorDecision) -> None:
        assert self.awaiting is not None
        key = await self.operators.verified(
            kind,
            decision.actor,
            decision.reason,
            decision.signature,
            self.awaiting.gate,
            incident=self._incident.incident_id,
            node=self._incident.node,
        )
        if (why := self.why_no_approval()) is not None:  # answered while it was verified
            raise ApplicationError(why, type="NothingAwaitsApproval", non_retryable=True)
        self.answer = self._decide(kind, decision, key)

    def why_not_abortable(self, ended: bool) -> str | None:
        if ended or self.abort is not None:
            return f"incident {self._incident.name} has already ended or been aborted"
        return None

    async def abort_with(self, decision: OperatorDecision, ended: Callable[[], bool]) -> None:
        key = await self.operators.verified(
            "abort",
            decision.actor,
            decision.reason,
            decision.signature,
            incident=self._incident.incident_id,
            node=self._incident.node,
        )
        if (why := self.why_not_abortable(ended())) is not None:
            raise ApplicationError(why, type="NotAbortable", non_retryable=True)
        self.abort = self._decide("abort", decision, key)

    def _decide(
        self, kind: Literal["approve", "deny", "abort"], decision: OperatorDecision, key: str | None
    ) -> DecisionRecord:
        record = DecisionRecord(
            at=workflow.now(),
            kind=kind,
            gate=self.awaiting.gate if self.awaiting else None,
            actor=decision.actor,
            reason=decision.reason,
            verified_by=key,
        )
        self._record(record, "operator")
        return record

    def _record(self, record: DecisionRecord, actor_kind: ActorKind) -> None:
        self.decisions.append(record)
        self._audit.decision(
            record.kind + (f"_{record.gate}" if record.gate else ""),
            incident=self._incident.incident_id,
            node=self._incident.node,
            reason=record.reason,
            result=record.kind,
            actor=record.actor,
            actor_kind=actor_kind,
            parameters={"verified_by": record.verified_by} if record.verified_by else None,
        )

    # --- the incident's side -----------------------------------------------------------------

    async def approval(self, gate: ApprovalGate, policy: RecoveryPolicy, question: str) -> str:
        """ "approve" or "deny" for a destructive step; "approve" at once when the policy does not gate it."""
        if gate not in policy.approval_required:
            return "approve"
        if policy.dry_run:
            self._steps.skip(f"approval_{gate}", f"dry-run: would ask an operator to {question}")
            return "approve"
        return (await self._steps.run(f"approval_{gate}", self._wait_for_answer(gate, question, policy))).kind

    async def _wait_for_answer(self, gate: ApprovalGate, question: str, policy: RecoveryPolicy) -> DecisionRecord:
        """Waits for an operator's approve/deny; unanswered by the deadline, the policy decides."""
        await self.ask(gate, question, timedelta(seconds=policy.approval_timeout_seconds))
        try:
            await workflow.wait_condition(
                lambda: self.answer is not None, timeout=timedelta(seconds=policy.approval_timeout_seconds)
            )
        except asyncio.TimeoutError:
            self.answer = DecisionRecord(
                at=workflow.now(),
                kind=policy.approval_timeout_action,
                gate=gate,
                actor="policy",
                reason=f"no answer within {policy.approval_timeout_seconds:.0f} s: "
                f"{policy.approval_timeout_action} by default",
            )
            self._record(self.answer, "policy")
        answer = self.close()
        assert answer is not None
        self._steps.note(f"{answer.kind} by {answer.actor}: {answer.reason}")
        return answer

    async def ask(self, gate: Gate, question: str, deadline: timedelta | None) -> None:
        """Opens a gate: approve/deny are accepted from now on, and the operators hear of it."""
        now = workflow.now()
        self.answer = None
        self.awaiting = ApprovalRequest(
            gate=gate, question=question, asked_at=now, deadline_at=now + deadline if deadline is not None else None
        )
        workflow.set_current_details(
            f"Awaiting approval ({gate}): {question}. Answer with `recovery approve|deny {self._incident.node}`."
        )
        await self._notify(NotificationKind.APPROVAL_NEEDED, f"{gate}: {question}")

    def close(self) -> DecisionRecord | None:
        """Closes the open gate: its answer, or None if nobody answered."""
        answer, self.awaiting = self.answer, None
        return answer
