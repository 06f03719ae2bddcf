"""The incident's timeline (workflows/incident/timeline.py): a phase ends when its work was done, as the
work recorded it, within the phase's bounds (issue #29, item 7)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from workflows.incident.timeline import DONE, NOT_STARTED, Timeline

T0 = datetime(2026, 12, 4, 22, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_phase_heard_late_ends_when_its_work_was_done():
    timeline = Timeline()
    requeue = timeline.begin("requeue", at(1))
    timeline.end(requeue, heard_at=at(19), done_at=at(1.3))  # a new worker heard it 18 s later
    assert requeue.ended_at == at(1.3)


def test_without_a_record_of_its_work_a_phase_ends_when_it_was_heard():
    timeline = Timeline()
    phase = timeline.begin("find_jobs", at(0))
    timeline.end(phase, heard_at=at(0.2))
    assert phase.ended_at == at(0.2)


def test_work_done_before_the_phase_began_ends_it_where_it_began():
    """A job found back before its verification began (its recovery was shared): 0 s, never negative."""
    timeline = Timeline()
    verify = timeline.begin("verify", at(10))
    timeline.end(verify, heard_at=at(10.5), done_at=at(7))
    assert verify.ended_at == at(10)


def test_a_stamp_later_than_the_workflow_heard_never_extends_the_phase():
    """Another host's clock ahead of the server's: the phase still ends when it was heard."""
    timeline = Timeline()
    phase = timeline.begin("mark_down", at(2))
    timeline.end(phase, heard_at=at(2.1), done_at=at(5))
    assert phase.ended_at == at(2.1)


def test_the_current_phase_notes_and_skips():
    timeline = Timeline()
    assert timeline.current == NOT_STARTED
    timeline.begin("drain", at(0))
    timeline.note("idle -> idle+DRAIN")
    timeline.skip("grace", "fatal XID", at(1))
    assert timeline.current == "drain"  # a skipped phase is never under way
    assert [(p.name, p.result) for p in timeline.phases] == [
        ("drain", "idle -> idle+DRAIN"),
        ("grace", "skipped: fatal XID"),
    ]
    assert timeline.phases[1].started_at == timeline.phases[1].ended_at == at(1)
    timeline.finish()
    assert timeline.current == DONE
