"""A workflow's decisions into the audit log, replay-safe.

Each decision is written by the local activity `write_audit` (activities/audit.py) rather than
through workflow.logger: the local activity's completion is a marker in the history, so a replay
(a worker restart, a cache eviction) never writes the line again, and the line is written by the
worker's audit sink like every side effect's. A worker that dies between the write and the end of
its workflow task writes the line again on the next attempt: the line's event_id (workflow, run,
sequence number) is the same, so a reader can drop the copy. workflow.logger would be at least as
duplicate-prone (a failed workflow task logs again) and does I/O from workflow code.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from pydantic import JsonValue

    from activities.audit import write_audit
    from contracts.audit import ActorKind, AuditEvent

AUDIT_WRITE = dict(
    start_to_close_timeout=timedelta(seconds=10),
    schedule_to_close_timeout=timedelta(minutes=2),
    retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_interval=timedelta(seconds=10)),
)


class AuditTrail:
    """Write decisions without waiting for them; flush() before the workflow ends or continues as new."""

    def __init__(self) -> None:
        self._written = 0
        self._pending: list[asyncio.Task[None]] = []

    def decision(self, action: str, *, incident: str | None, node: str | None, reason: str, result: str,
                 actor: str = "policy", actor_kind: ActorKind = "policy", job: int | None = None,
                 parameters: dict[str, JsonValue] | None = None) -> None:
        info = workflow.info()
        self._written += 1
        event = AuditEvent(
            incident=incident, at=workflow.now(), action=action, target=node or incident or info.workflow_id,
            path="workflow", actor=actor, actor_kind=actor_kind, reason=reason, node=node, job=job,
            parameters=parameters or {}, result=result,
            event_id=f"{info.workflow_id}/{info.run_id}/{self._written}",
        )
        self._pending = [task for task in self._pending if not task.done()]
        self._pending.append(asyncio.create_task(self._write(event)))

    @property
    def pending(self) -> bool:
        return any(not task.done() for task in self._pending)

    async def flush(self) -> None:
        await asyncio.gather(*self._pending)
        self._pending = []

    @staticmethod
    async def _write(event: AuditEvent) -> None:
        try:
            await workflow.execute_local_activity(write_audit, event, **AUDIT_WRITE)
        except ActivityError as err:
            # The decision stands and the history keeps it; only its copy in the log is missing.
            workflow.logger.error("audit line %s not written: %s", event.event_id, err.cause)
