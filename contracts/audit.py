"""Every side effect leaves an ActionRecord: what, on what, how, who asked and why.

Each record is also logged as one JSON line on the `training_recovery.audit` logger, beside the
Temporal history that keeps it durably.
"""

from __future__ import annotations

import json
import logging

from contracts.models import ActionContext, ActionRecord, utc_now

audit_log = logging.getLogger("training_recovery.audit")


def record(action: str, target: str, path: str, ctx: ActionContext, detail: str = "") -> ActionRecord:
    entry = ActionRecord(
        at=utc_now(), action=action, target=target, path=path, detail=detail,
        actor=ctx.actor, reason=ctx.reason,
    )
    audit_log.info(json.dumps({"incident": ctx.incident_id, **entry.model_dump(mode="json")}))
    return entry
