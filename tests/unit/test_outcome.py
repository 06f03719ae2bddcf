"""An incident's outcome (workflows/incident/outcome.py): its kind, its text and who hears of it."""

from __future__ import annotations

import pytest

from contracts.budget import NotificationKind
from contracts.models import JobVerification, OutcomeKind, SpareResult
from contracts.search_attributes import outcome_label
from workflows.incident.outcome import notification_for, recovery_outcome


def verification(verified: bool, why: str = "") -> JobVerification:
    return JobVerification(
        job_id=7,
        verified=verified,
        why_not=[why] if why else [],
        restart_count_before=0,
        restart_count_after=1,
        nodes_before=["gpu-1"],
        nodes_after=["gpu-3"],
    )


def test_a_recovery_is_told_by_its_kind_and_its_text():
    spare = SpareResult(node="gpu-5", healthy=True)
    assert recovery_outcome(None, spare, [verification(True)]) == (OutcomeKind.RECOVERED, "recovered")
    assert recovery_outcome("no hot spare on standby", None, [verification(True)]) == (
        OutcomeKind.NO_REPLACEMENT,
        "no_replacement: no hot spare on standby",
    )
    sick = SpareResult(node="gpu-5", healthy=False, detail="2 GPUs missing")
    assert recovery_outcome(None, sick, [verification(True)]) == (
        OutcomeKind.SPARE_UNHEALTHY,
        "spare_unhealthy: gpu-5: 2 GPUs missing",
    )
    # A job that did not come back outweighs the spare: the training is what the incident is for.
    assert recovery_outcome(None, spare, [verification(False, "job is PENDING")]) == (
        OutcomeKind.FAILED_VERIFICATION,
        "failed_verification: job 7: job is PENDING",
    )


@pytest.mark.parametrize(
    ("kind", "heard"),
    [
        (OutcomeKind.RECOVERED, NotificationKind.RECOVERED),
        (OutcomeKind.FAILED, NotificationKind.FAILED),
        (OutcomeKind.FAILED_VERIFICATION, NotificationKind.FAILED),
        (OutcomeKind.ESCALATED, NotificationKind.FAILED),
        (OutcomeKind.NO_REPLACEMENT, NotificationKind.FAILED),
        (OutcomeKind.SPARE_UNHEALTHY, NotificationKind.FAILED),
        # An operator's own decision, a hold they were told of, a rehearsal, or nothing to do: no message.
        (OutcomeKind.DENIED, None),
        (OutcomeKind.HELD, None),
        (OutcomeKind.ABORTED, None),
        (OutcomeKind.DRY_RUN, None),
        (OutcomeKind.NO_NODE_ACTION, None),
        (None, None),
    ],
)
def test_operators_hear_of_a_recovery_and_of_every_end_that_leaves_them_work(kind, heard):
    assert notification_for(kind) == heard


def test_each_outcome_text_begins_with_its_kind():
    """Users filter on the text's first word (RecoveryOutcome, the metrics' outcome label): the
    kind must be that word, so that the two never tell different stories."""
    spare = SpareResult(node="gpu-5", healthy=True)
    for outcome in (
        recovery_outcome(None, spare, [verification(True)]),
        recovery_outcome("none on standby", None, [verification(True)]),
        recovery_outcome(None, SpareResult(node="gpu-5", healthy=False), [verification(True)]),
        recovery_outcome(None, spare, [verification(False, "job is PENDING")]),
    ):
        kind, text = outcome
        assert outcome_label(text) == kind.value, outcome
