"""Every side effect leaves an ActionRecord: what, on what, how, who asked and why.

Each record is also logged as one JSON line on the `training_recovery.audit` logger, beside the
Temporal history that keeps it durably.
"""

from __future__ import annotations

import json
import logging

from contracts.models import ActionContext, ActionRecord, Invocation, utc_now

audit_log = logging.getLogger("training_recovery.audit")


def record(action: str, target: str, via: str | Invocation, ctx: ActionContext, detail: str = "") -> ActionRecord:
    """`via` is the backend call that did it (or would, in dry-run), or a path such as "none"."""
    call = via if isinstance(via, Invocation) else Invocation(path=via, command="")
    entry = ActionRecord(
        at=utc_now(), action=action, target=target, path=call.path, detail=detail,
        actor=ctx.actor, reason=ctx.reason, command=call.command, executed=call.executed,
    )
    audit_log.info(json.dumps({"incident": ctx.incident_id, **entry.model_dump(mode="json")}))
    return entry
