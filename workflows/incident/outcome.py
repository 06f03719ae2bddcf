"""An incident's outcome: its kind (contracts.models.OutcomeKind), its text (what users read in the
report, `recovery describe` and the Web UI) and who hears of it. Pure."""

from __future__ import annotations

from temporalio.exceptions import ActivityError, ApplicationError

from contracts.budget import NotificationKind
from contracts.models import JobVerification, OutcomeKind, SpareResult


def cause_of(err: ActivityError) -> str:
    """An activity's final failure as the outcome says it: its type and message."""
    cause = err.cause
    if isinstance(cause, ApplicationError):
        return f"{cause.type}: {cause.message}" if cause.type else cause.message
    return str(cause or err)


def notification_for(kind: OutcomeKind | None) -> NotificationKind | None:
    """Operators hear of a recovery, and of every end that leaves them something to do."""
    if kind == OutcomeKind.RECOVERED:
        return NotificationKind.RECOVERED
    if kind in (
        OutcomeKind.FAILED,
        OutcomeKind.FAILED_VERIFICATION,
        OutcomeKind.ESCALATED,
        OutcomeKind.SPARE_UNHEALTHY,
        OutcomeKind.NO_REPLACEMENT,
    ):
        return NotificationKind.FAILED
    return None


def recovery_outcome(
    no_replacement: str | None, spare: SpareResult | None, verifications: list[JobVerification]
) -> tuple[OutcomeKind, str]:
    """The outcome of an incident that went through its verification: its kind and its text."""
    failed = [v for v in verifications if not v.verified]
    if failed:
        why = "; ".join(f"job {v.job_id}: {', '.join(v.why_not)}" for v in failed)
        return OutcomeKind.FAILED_VERIFICATION, f"failed_verification: {why}"
    if no_replacement is not None:
        return OutcomeKind.NO_REPLACEMENT, f"no_replacement: {no_replacement}"
    if spare is not None and not spare.healthy:
        return OutcomeKind.SPARE_UNHEALTHY, f"spare_unhealthy: {spare.node}: {spare.detail}"
    return OutcomeKind.RECOVERED, "recovered"
