"""A workflow's decisions into the audit log, replay-safe.

Each decision is written by the local activity `write_audit` (activities/audit.py) rather than
through workflow.logger: the local activity's completion is a marker in the history, so a replay
(a worker restart, a cache eviction) never writes the line again, and the line is written by the
worker's audit sink like every side effect's. A worker that dies between the write and the end of
its workflow task writes the line again on the next attempt: the line's event_id (workflow, run,
sequence number) is the same, so a reader can drop the copy. workflow.logger would be at least as
duplicate-prone (a failed workflow task logs again) and does I/O from workflow code.

A trail that holds its lines (the fleet budget's) writes them together, one local activity
`write_audit_lines` per write_held(): a workflow task is completed only once its local activities
are, so hundreds of decisions in one task, each with a local activity of its own, held up the
commands of that task (the budget's answers to its incidents) for 5 to 13 s at N = 1,000 (issue #7).
A held line not yet written is made again by the replay of the decision that made it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from pydantic import JsonValue

    from activities.audit import write_audit, write_audit_lines
    from contracts.audit import ActorKind, AuditEvent
    from workflows.call_options import CallOptions

AUDIT_WRITE = CallOptions(
    start_to_close_timeout=timedelta(seconds=10),
    schedule_to_close_timeout=timedelta(minutes=2),
    retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_interval=timedelta(seconds=10)),
)


class AuditTrail:
    """Write decisions without waiting for them; flush() before the workflow ends or continues as new.
    With `hold`, decisions wait in memory for write_held()."""

    def __init__(self, *, hold: bool = False) -> None:
        self._written = 0
        self._pending: list[asyncio.Task[None]] = []
        self._hold = hold
        self._held: list[AuditEvent] = []

    def decision(
        self,
        action: str,
        *,
        incident: str | None,
        node: str | None,
        reason: str,
        result: str,
        actor: str = "policy",
        actor_kind: ActorKind = "policy",
        job: int | None = None,
        parameters: dict[str, JsonValue] | None = None,
    ) -> None:
        info = workflow.info()
        self._written += 1
        event = AuditEvent(
            incident=incident,
            at=workflow.now(),
            action=action,
            target=node or incident or info.workflow_id,
            path="workflow",
            actor=actor,
            actor_kind=actor_kind,
            reason=reason,
            node=node,
            job=job,
            parameters=parameters or {},
            result=result,
            event_id=f"{info.workflow_id}/{info.run_id}/{self._written}",
        )
        if self._hold:
            self._held.append(event)
        else:
            self._start(workflow.execute_local_activity(write_audit, event, **AUDIT_WRITE), [event])

    @property
    def holding(self) -> bool:
        return bool(self._held)

    @property
    def pending(self) -> bool:
        return self.holding or any(not task.done() for task in self._pending)

    def write_held(self) -> None:
        """Start writing every held line, with one local activity."""
        if self._held:
            events, self._held = self._held, []
            self._start(workflow.execute_local_activity(write_audit_lines, events, **AUDIT_WRITE), events)

    async def flush(self) -> None:
        self.write_held()
        await asyncio.gather(*self._pending)
        self._pending = []

    def _start(self, write: Awaitable[None], events: list[AuditEvent]) -> None:
        self._pending = [task for task in self._pending if not task.done()]
        self._pending.append(asyncio.create_task(self._written_or_logged(write, events)))

    @staticmethod
    async def _written_or_logged(write: Awaitable[None], events: list[AuditEvent]) -> None:
        try:
            await write
        except ActivityError as err:
            # The decisions stand and the history keeps them; only their copy in the log is missing.
            workflow.logger.error(
                "audit line(s) %s not written: %s", ", ".join(e.event_id or "" for e in events), err.cause
            )
