"""The audit trail: every action and decision as one structured JSON line, beside the Temporal
history that keeps it durably.

Lines are written by write_events(): side effects through record() (from the activities that did
them), workflow decisions from the local activities that workflows/audit_trail.py schedules (so
that a replay never writes them again). configure_sink() appends them to a file
(RECOVERY_AUDIT_LOG), and every line also goes to the `training_recovery.audit` logger.

The file is durable before the write returns: each batch of lines is one write, then one fsync,
through a file opened for that batch alone, so that logrotate's move-and-create needs no signal.
A line that cannot be written (disk full, no permission) raises, so that the activity fails and
Temporal retries it. A crash in the middle of a write leaves a torn last line: the next batch
starts on a new line, and a reader drops the line that is not JSON.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import Field, JsonValue

from contracts.models import ActionContext, ActionRecord, Contract, Invocation, utc_now

audit_log = logging.getLogger("training_recovery.audit")

_JOB_TARGET = re.compile(r"^job (\d+)$")

# policy: decided by the controller's rules; operator: a person's command, its signature verified;
# unverified: a command whose signature did not verify (refused, recorded with the name it claimed).
ActorKind = Literal["policy", "operator", "unverified"]


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
        None, description="set for workflow decisions: the same on a retried write, so a reader can drop the copy"
    )


def write_event(event: AuditEvent) -> None:
    write_events([event])


def write_events(events: list[AuditEvent]) -> None:
    """Append the lines to every configured file (raising OSError if one cannot), then log them."""
    lines = [event.model_dump_json() for event in events]
    for sink in list(_sinks):
        sink.append(lines)
    for line in lines:
        audit_log.info(line)


def record(action: str, target: str, via: str | Invocation, ctx: ActionContext, detail: str = "") -> ActionRecord:
    """A side effect done by an activity on the incident's behalf (or, in dry-run, intended): its
    record, and its audit line. `via` is the backend call that did it, or a path such as "none"."""
    call = via if isinstance(via, Invocation) else Invocation(path=via, command="")
    entry = ActionRecord(
        at=utc_now(),
        action=action,
        target=target,
        path=call.path,
        detail=detail,
        actor=ctx.actor,
        reason=ctx.reason,
        command=call.command,
        executed=call.executed,
    )
    job = _JOB_TARGET.match(target)
    write_event(
        AuditEvent(
            incident=ctx.incident_id,
            **entry.model_dump(),
            node=None if job else target,
            job=int(job.group(1)) if job else None,
            actor_kind="policy",
            result="done" if call.executed else "intended (dry-run)",
        )
    )
    return entry


class AuditFile:
    """A JSON-lines file, appended to a batch at a time (see the module's docstring)."""

    MODE = 0o640  # a new file: readable by the log readers' group, not by everyone

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()  # the local activities write from threads

    def append(self, lines: list[str]) -> None:
        data = "".join(line + "\n" for line in lines).encode()
        with self._lock:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, self.MODE)
            try:
                if self._ends_in_a_torn_line(fd):
                    data = b"\n" + data
                unwritten = memoryview(data)
                while unwritten:
                    unwritten = unwritten[os.write(fd, unwritten) :]
                os.fsync(fd)
            finally:
                os.close(fd)

    @staticmethod
    def _ends_in_a_torn_line(fd: int) -> bool:
        size = os.fstat(fd).st_size
        return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


_sinks: list[AuditFile] = []


def configure_sink(path: Path) -> AuditFile:
    """Append the audit lines to `path` too (idempotent per path); they still reach the logger's handlers."""
    path = path.resolve()
    for sink in _sinks:
        if sink.path == path:
            return sink
    path.parent.mkdir(parents=True, exist_ok=True)
    sink = AuditFile(path)
    _sinks.append(sink)
    # The audit lines are logged whatever level the rest of the logging runs at.
    audit_log.setLevel(logging.INFO)
    return sink


def remove_sink(sink: AuditFile) -> None:
    _sinks.remove(sink)
