"""The intake's state per node stays bounded however many node names senders use (issue #22),
and what it forgets changes no decision."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from hooks.intake import Intake, IntakeLimits
from hooks.sources import Incoming
from tests.hook_support import FixedDirectory, RecordingIncidents


async def test_held_alerts_leave_no_per_node_state_once_decided():
    """NCCL timeouts from 10,000 nodes with no incident they follow from: each is held, then
    dropped; the hook keeps nothing of those nodes."""
    now = datetime.now(timezone.utc)
    hook = Intake(RecordingIncidents(), IntakeLimits(correlation_hold=timedelta(0)), directory=FixedDirectory())
    timeouts = [
        Incoming(node=f"peer-{n}", xid=None, source="nccl", actor="test", reason="NCCL timeout", observed_at=now)
        for n in range(10_000)
    ]
    results = await hook.submit(timeouts)
    assert {r.outcome.value for r in results} == {"dropped"}
    assert (len(hook._nodes), len(hook._own_incident_news)) == (0, 0)


async def test_nodes_busy_beyond_the_bound_are_forgotten_once_their_hand_overs_end():
    now = datetime.now(timezone.utc)
    hook = Intake(RecordingIncidents(), IntakeLimits(node_state_size=1000))
    await hook.submit(
        [
            Incoming(node=f"node-{n}", xid=79, source="test", actor="test", reason="XID 79", observed_at=now)
            for n in range(20_000)
        ]
    )  # all in flight at once
    assert len(hook._nodes) == 1000


async def test_a_forgotten_node_is_decided_as_before_from_what_temporal_says():
    now = datetime.now(timezone.utc)
    incidents = RecordingIncidents()
    hook = Intake(incidents, IntakeLimits(node_state_size=1))

    def xid_79(node: str, ago: float) -> Incoming:
        return Incoming(
            node=node,
            xid=79,
            source="test",
            actor="test",
            reason=f"XID 79, {ago} s ago",
            observed_at=now - timedelta(seconds=ago),
        )

    await hook.submit([xid_79("gpu-1", 30)])
    await hook.submit([xid_79("gpu-2", 30)])
    assert list(hook._nodes) == ["gpu-2"]  # gpu-1 forgotten
    incidents.end("gpu-1", now - timedelta(seconds=10))
    late, new = await hook.submit([xid_79("gpu-1", 20), xid_79("gpu-1", 5)])
    assert late.outcome.value == "dropped" and "ended at" in late.reason
    assert new.outcome.value == "accepted" and len(incidents.runs["gpu-1"]) == 2
