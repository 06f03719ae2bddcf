"""The audit trail: every action and decision as one structured JSON line, beside the Temporal
history that keeps it durably.

Lines go to the `training_recovery.audit` logger: side effects through record() (from the
activities that did them), workflow decisions through write_event() (from the local activity
that workflows/audit_trail.py schedules, so that a replay never writes them again).
configure_sink() appends them to a file as JSON lines, one flushed write per line
(RECOVERY_AUDIT_LOG).
"""

from __future__ import annotations

import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import Field, JsonValue

from contracts.models import ActionContext, ActionRecord, Contract, Invocation, utc_now

audit_log = logging.getLogger("training_recovery.audit")

_JOB_TARGET = re.compile(r"^job (\d+)$")

# policy: decided by the controller's rules; operator: a person's command.
ActorKind = Literal["policy", "operator"]


class AuditEvent(Contract):
    """One line of the audit log. The fields of ActionRecord, plus where and by whom."""

    incident: str | None
    at: datetime
    action: str
    target: str
    path: str = Field("none", description="how it was done: cli, rest, filesystem, workflow (a decision), none")
    detail: str = ""
    command: str = Field("", description="the exact command or API call")
    executed: bool = Field(True, description="false in dry-run: intended only")
    actor: str = Field(description="who: the person, hook or policy the action is attributed to")
    reason: str
    node: str | None = None
    job: int | None = None
    actor_kind: ActorKind
    parameters: dict[str, JsonValue] = Field(default_factory=dict)
    result: str
    event_id: str | None = Field(
        None, description="set for workflow decisions: the same on a retried write, so a reader can drop the copy")


def write_event(event: AuditEvent) -> None:
    audit_log.info(event.model_dump_json())


def record(action: str, target: str, via: str | Invocation, ctx: ActionContext, detail: str = "") -> ActionRecord:
    """A side effect done by an activity on the incident's behalf (or, in dry-run, intended): its
    record, and its audit line. `via` is the backend call that did it, or a path such as "none"."""
    call = via if isinstance(via, Invocation) else Invocation(path=via, command="")
    entry = ActionRecord(
        at=utc_now(), action=action, target=target, path=call.path, detail=detail,
        actor=ctx.actor, reason=ctx.reason, command=call.command, executed=call.executed,
    )
    job = _JOB_TARGET.match(target)
    write_event(AuditEvent(
        incident=ctx.incident_id, **entry.model_dump(), node=None if job else target,
        job=int(job.group(1)) if job else None, actor_kind="policy",
        result="done" if call.executed else "intended (dry-run)",
    ))
    return entry


class JsonLinesSink(logging.FileHandler):
    """Appends each audit line to a file and flushes it (StreamHandler flushes after every record)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, mode="a", encoding="utf-8")
        self.setFormatter(logging.Formatter("%(message)s"))


def configure_sink(path: Path) -> JsonLinesSink:
    """Send the audit lines to `path` too (idempotent per path); they still reach the other log handlers."""
    path = path.resolve()
    for handler in audit_log.handlers:
        if isinstance(handler, JsonLinesSink) and Path(handler.baseFilename) == path:
            return handler
    sink = JsonLinesSink(path)
    audit_log.addHandler(sink)
    # The audit lines are written whatever level the rest of the logging runs at.
    audit_log.setLevel(logging.INFO)
    return sink


def remove_sink(sink: JsonLinesSink) -> None:
    audit_log.removeHandler(sink)
    sink.close()
