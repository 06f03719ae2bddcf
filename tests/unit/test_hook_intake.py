"""The intake's decisions, against a recording stand-in for Temporal (RecordingIncidents);
correlation's are in test_hook_correlation.py."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from hooks.intake import Intake, IntakeLimits, Outcome
from hooks.sources import Incoming
from tests.hook_support import RecordingIncidents

NOW = datetime(2026, 11, 30, 0, 17, 36, tzinfo=timezone.utc)


def alert(node: str = "gpu-2", xid: int | None = 79, ago: float = 1.0, **kw) -> Incoming:
    return Incoming(
        node=node,
        xid=xid,
        source=kw.pop("source", "test"),
        actor="intake test",
        reason=kw.pop("reason", f"XID {xid}"),
        observed_at=NOW - timedelta(seconds=ago),
        **kw,
    )


def intake(incidents: RecordingIncidents, **limits) -> Intake:
    return Intake(incidents, IntakeLimits(**limits), clock=lambda: NOW)


async def test_alerts_for_a_node_arriving_during_a_hand_over_go_in_the_next_one():
    incidents = RecordingIncidents(delay=0.05)
    hook = intake(incidents)
    first = asyncio.ensure_future(hook.submit([alert(reason="alert 0")]))
    await asyncio.sleep(0.01)  # its hand-over is in flight
    results = await asyncio.gather(first, *(hook.submit([alert(reason=f"alert {i}")]) for i in range(1, 40)))
    assert {r.outcome for [r] in results} == {Outcome.ACCEPTED}
    assert {r.incident for [r] in results} == {"node-recovery-gpu-2"}
    # the first request's hand-over, then everything that queued behind it, in one call
    assert [len(alerts) for _, _, alerts in incidents.calls] == [1, 39]
    assert [a.reason for a in incidents.handed_over] == [f"alert {i}" for i in range(40)]
    assert [len(runs) for runs in incidents.runs.values()] == [1]


async def test_nodes_are_handed_over_independently_and_each_gets_one_incident():
    incidents = RecordingIncidents(delay=0.01)
    hook = intake(incidents)
    batch = [alert(f"gpu-{i % 5}", reason=f"r{i}") for i in range(50)]
    results = await hook.submit(batch)
    assert [r.incident for r in results] == [f"node-recovery-gpu-{i % 5}" for i in range(50)]
    assert sorted(incidents.runs) == [f"gpu-{i}" for i in range(5)]
    assert all(len(runs) == 1 for runs in incidents.runs.values())
    assert len(incidents.handed_over) == 50


async def test_batches_are_capped_and_concurrent_calls_limited():
    incidents = RecordingIncidents(delay=0.02)
    hook = intake(incidents, max_batch=10, max_inflight=3)
    in_flight = peak = 0
    original = incidents.join_or_open

    async def counting(node, alerts):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await original(node, alerts)
        finally:
            in_flight -= 1

    incidents.join_or_open = counting
    await hook.submit([alert(f"gpu-{i % 6}", reason=f"r{i}") for i in range(120)])
    assert max(len(a) for _, _, a in incidents.calls) == 10
    assert peak == 3
    assert len(incidents.handed_over) == 120


async def test_an_identical_alert_is_a_duplicate_and_costs_no_call():
    incidents = RecordingIncidents()
    hook = intake(incidents)
    [first] = await hook.submit([alert()])
    [again] = await hook.submit([alert()])
    assert (first.outcome, again.outcome) == (Outcome.ACCEPTED, Outcome.DUPLICATE)
    assert again.incident == first.incident
    assert len(incidents.calls) == 1


async def test_a_duplicate_of_an_alert_in_flight_is_answered_once_that_is_in_temporal():
    incidents = RecordingIncidents(delay=0.05)
    hook = intake(incidents)
    first, again = await asyncio.gather(hook.submit([alert()]), hook.submit([alert()]))
    assert (first[0].outcome, again[0].outcome) == (Outcome.ACCEPTED, Outcome.DUPLICATE)
    assert len(incidents.calls) == 1


async def test_resolved_stale_and_future_alerts_are_dropped_with_a_reason_and_no_call():
    incidents = RecordingIncidents()
    hook = intake(incidents, max_age=timedelta(minutes=15), clock_skew=timedelta(minutes=5))
    results = await hook.submit(
        [
            alert(resolved=True),
            alert(ago=16 * 60),
            alert(ago=-6 * 60),
            alert(ago=14 * 60),
            alert(ago=-4 * 60),
        ]
    )
    assert [r.outcome for r in results] == [Outcome.DROPPED] * 3 + [Outcome.ACCEPTED] * 2
    assert results[0].reason.startswith("resolved")
    assert results[1].reason.startswith("stale") and "900 s" in results[1].reason
    assert "future" in results[2].reason
    assert len(incidents.handed_over) == 2


async def test_alerts_observed_before_the_last_incident_ended_never_start_another():
    incidents = RecordingIncidents()
    hook = intake(incidents)
    await hook.submit([alert(ago=300)])
    incidents.end("gpu-2", NOW - timedelta(seconds=60))

    # a replay, and an alert from before the end: dropped, after asking Temporal once when it ended
    results = await hook.submit([alert(ago=300, reason="replayed"), alert(ago=120)])
    assert [r.outcome for r in results] == [Outcome.DROPPED, Outcome.DROPPED]
    assert "ended at 2026-11-30T00:16:36+00:00" in results[0].reason
    assert [c for c, _, _ in incidents.calls] == ["join_or_open", "join", "ended_at"]

    # known now: the next stale one costs no call at all
    [late] = await hook.submit([alert(ago=90)])
    assert late.outcome is Outcome.DROPPED and len(incidents.calls) == 3

    # a failure after the end opens a new incident, and the next alert joins it with a signal
    [fresh] = await hook.submit([alert(ago=30, reason="new failure")])
    assert fresh.outcome is Outcome.ACCEPTED
    await hook.submit([alert(ago=20, reason="and another")])
    assert [c for c, _, _ in incidents.calls[3:]] == ["join_or_open", "ended_at", "open_after_end", "join"]
    assert [run.run_id for run in incidents.runs["gpu-2"]] == ["gpu-2-run-1", "gpu-2-run-2"]
    assert [a.reason for a in incidents.runs["gpu-2"][1].alerts] == ["new failure", "and another"]


async def test_joins_go_to_the_run_handed_over_to_and_find_one_opened_since_by_someone_else():
    incidents = RecordingIncidents()
    hook = intake(incidents)
    await hook.submit([alert(ago=300)])
    incidents.end("gpu-2", NOW - timedelta(seconds=60))
    await incidents.open_after_end("gpu-2", [alert(ago=30, reason="another hook's").to_alert()])
    del incidents.calls[:]

    # the run this hook knows has ended: after one describe, the alert joins the one running now
    [joined] = await hook.submit([alert(ago=10, reason="after the end")])
    assert joined.outcome is Outcome.ACCEPTED
    await hook.submit([alert(ago=5, reason="and the next")])
    assert [c for c, _, _ in incidents.calls] == ["join", "ended_at", "open_after_end", "join"]
    assert [run.run_id for run in incidents.runs["gpu-2"]] == ["gpu-2-run-1", "gpu-2-run-2"]
    assert [a.reason for a in incidents.runs["gpu-2"][1].alerts] == ["another hook's", "after the end", "and the next"]


async def test_a_batch_spanning_the_end_splits_into_dropped_and_a_new_incident():
    incidents = RecordingIncidents()
    hook = intake(incidents)
    await hook.submit([alert(ago=300)])
    incidents.end("gpu-2", NOW - timedelta(seconds=60))
    results = await hook.submit([alert(ago=100, reason="old"), alert(ago=10, reason="new")])
    assert [r.outcome for r in results] == [Outcome.DROPPED, Outcome.ACCEPTED]
    assert [a.reason for a in incidents.runs["gpu-2"][1].alerts] == ["new"]


async def test_when_temporal_fails_nothing_is_accepted_and_a_retry_hands_over_again():
    incidents = RecordingIncidents()
    incidents.fail_with = RuntimeError("Temporal unavailable")
    hook = intake(incidents)
    with pytest.raises(RuntimeError):
        await hook.submit([alert("gpu-2"), alert("gpu-3")])
    assert incidents.handed_over == []
    incidents.fail_with = None
    results = await hook.submit([alert("gpu-2"), alert("gpu-3")])
    assert [r.outcome for r in results] == [Outcome.ACCEPTED, Outcome.ACCEPTED]
    assert len(incidents.handed_over) == 2


async def test_outcomes_and_calls_are_counted():
    incidents = RecordingIncidents()
    hook = intake(incidents)
    await hook.submit([alert(), alert(), alert(resolved=True)])
    await hook.submit([alert(reason="second")])
    assert hook.outcomes == {"accepted": 2, "duplicate": 1, "dropped": 1}
    assert hook.temporal_calls == {"join_or_open": 1, "join": 1}


def test_alerts_that_differ_in_any_field_are_not_duplicates():
    a = alert()
    assert a == replace(a) and hash(a) == hash(replace(a))
    assert a != replace(a, message="other text")


# --- floods: past the first alerts of a running incident, counts in digests ---------------------

FLOOD = dict(
    full_alerts_per_incident=5,
    digest_interval=timedelta(milliseconds=20),
    digest_interval_max=timedelta(milliseconds=80),
)


async def until(check, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not reached within the deadline"
        await asyncio.sleep(0.005)


async def test_a_flood_is_answered_at_once_and_told_to_the_incident_in_few_small_digests():
    incidents = RecordingIncidents()
    hook = intake(incidents, **FLOOD)
    await hook.submit([alert(reason=f"line {i}") for i in range(5)])  # handed over in full
    calls_before = len(incidents.calls)
    for burst in range(20):
        results = await hook.submit(
            [alert(reason=f"flood {burst}.{i}", source=("kernel-log", "dcgm")[i % 2]) for i in range(500)]
        )
        assert {(r.outcome, r.incident) for r in results} == {(Outcome.ACCEPTED, "node-recovery-gpu-2")}
        assert results[0].reason.startswith("counted")
    run = incidents.runs["gpu-2"][0]
    await until(lambda: sum(len(d.alerts) + sum(d.omitted.values()) for d in run.digests) == 10_000)
    assert len(run.alerts) == 5  # in full: only the first ones
    assert all(len(d.alerts) <= 2 for d in run.digests)  # the latest of each source
    # 10,000 alerts cost a handful of calls, not one per alert or per request
    assert len(incidents.calls) - calls_before == len(run.digests) <= 20
    assert [c for c, _, _ in incidents.calls[calls_before:]] == ["join_digest"] * len(run.digests)


async def test_digests_stop_at_the_cap_and_the_rest_is_counted_on_the_hook():
    incidents = RecordingIncidents()
    hook = intake(incidents, **FLOOD, max_digests_per_incident=2)
    await hook.submit([alert(reason=f"line {i}") for i in range(5)])
    for burst in range(6):
        await hook.submit([alert(reason=f"flood {burst}.{i}") for i in range(10)])
        await until(lambda: not hook._nodes["gpu-2"].digest.counted)  # sent, or counted only
    assert len(incidents.runs["gpu-2"][0].digests) == 2
    told = sum(len(d.alerts) + sum(d.omitted.values()) for d in incidents.runs["gpu-2"][0].digests)
    assert told + hook.outcomes["counted_not_sent"] == 60


async def test_counted_alerts_after_the_incident_ended_open_a_new_one():
    incidents = RecordingIncidents()
    hook = intake(incidents, **FLOOD)
    await hook.submit([alert(reason=f"line {i}", ago=300) for i in range(5)])
    incidents.end("gpu-2", NOW - timedelta(seconds=60))
    await hook.submit([alert(reason="old", ago=100), alert(reason="after the end", ago=10)])
    # the digest finds the run ended: the latest counted alert is decided again, and is newer
    await until(lambda: len(incidents.runs["gpu-2"]) == 2)
    assert [a.reason for a in incidents.runs["gpu-2"][1].alerts] == ["after the end"]
    # the new incident's alerts go in full again
    [fresh] = await hook.submit([alert(reason="next", ago=5)])
    assert fresh.reason == "" and incidents.runs["gpu-2"][1].alerts[-1].reason == "next"
