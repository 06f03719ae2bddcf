"""An incident's outcome: its text (what users read in the report, `recovery describe` and the
Web UI), its kind (contracts/search_attributes.py: the text up to its first colon, "recovered",
"failed in drain", ...) and who hears of it. Pure."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError

from contracts.budget import NotificationKind
from contracts.models import JobVerification, SpareResult
from contracts.search_attributes import outcome_label


def cause_of(err: ActivityError) -> str:
    """An activity's final failure as the outcome says it: its type and message."""
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return f"{cause.type}: {cause.message}" if cause.type else cause.message
    return str(cause or err)


def notification_for(outcome: str) -> NotificationKind | None:
    """Operators hear of a recovery, and of every end that leaves them something to do."""
    label = outcome_label(outcome)
    if label == "recovered":
        return NotificationKind.RECOVERED
    if label.startswith(("failed", "escalated")) or label in ("spare_unhealthy", "no_replacement"):
        return NotificationKind.FAILED
    return None


def recovery_outcome(
    no_replacement: str | None, spare: SpareResult | None, verifications: list[JobVerification]
) -> str:
    """The outcome of an incident that went through its verification."""
    failed = [v for v in verifications if not v.verified]
    if failed:
        return "failed_verification: " + "; ".join(f"job {v.job_id}: {', '.join(v.why_not)}" for v in failed)
    if no_replacement is not None:
        return f"no_replacement: {no_replacement}"
    if spare is not None and not spare.healthy:
        return f"spare_unhealthy: {spare.node}: {spare.detail}"
    return "recovered"
