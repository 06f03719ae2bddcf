"""Correlation: which secondary alerts join another node's incident, and what happens while the
incident they follow from has not found its jobs yet. Against stand-ins for Temporal
(RecordingIncidents) and visibility (FixedDirectory); tests/integration/test_hooks_correlation.py
runs it on the real stack."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pytest
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from contracts import search_attributes as sa
from hooks.correlation import RunningIncident, RunningIncidents, Snapshot, primary_for
from hooks.intake import Intake, IntakeLimits, Outcome
from hooks.sources import Incoming
from tests.hook_support import FixedDirectory, RecordedRun, RecordingIncidents

NOW = datetime(2026, 11, 30, 0, 17, 36, tzinfo=timezone.utc)
WINDOW = timedelta(seconds=120)
SECONDARY = frozenset({45, 74})


def alert(node: str, xid: int | None, ago: float = 1.0, reason: str = "") -> Incoming:
    return Incoming(
        node=node,
        xid=xid,
        source="test",
        actor="correlation test",
        reason=reason or f"XID {xid}",
        observed_at=NOW - timedelta(seconds=ago),
    )


def incident(node: str, ago: float = 60, xid: int | None = 79, peers: set[str] | None = None) -> RunningIncident:
    return RunningIncident(
        node=node, started_at=NOW - timedelta(seconds=ago), xid=xid, peers=None if peers is None else frozenset(peers)
    )


def intake(incidents: RecordingIncidents, directory: FixedDirectory | None, hold: float = 10.0, **limits) -> Intake:
    return Intake(
        incidents,
        IntakeLimits(correlation_hold=timedelta(seconds=hold), **limits),
        directory=directory,
        clock=lambda: NOW,
    )


def running(incidents: RecordingIncidents, node: str) -> None:
    """The node has a running incident that this hook did not open (another hook, the CLI)."""
    incidents.runs[node] = [RecordedRun(run_id=f"{node}-elsewhere")]


async def settled(task: asyncio.Future) -> bool:
    """Whether the task finishes once everything ready to run has run (it waits on nothing else)."""
    for _ in range(20):
        await asyncio.sleep(0)
    return task.done()


# --- the decision --------------------------------------------------------------------------------


def test_the_primary_is_a_classified_incident_listing_the_node_as_a_job_peer_within_the_window():
    snapshot = Snapshot(
        {
            i.node: i
            for i in [
                incident("gpu-1", ago=100, peers={"gpu-3"}),
                incident("gpu-2", ago=20, peers={"gpu-3", "gpu-4"}),  # nearest in time: this one
                incident("gpu-5", ago=25, peers=None),  # jobs not found yet
                incident("gpu-6", ago=25, xid=None, peers={"gpu-3"}),  # not classified yet
                incident("gpu-7", ago=25, xid=74, peers={"gpu-3"}),  # itself opened by a secondary XID
                incident("gpu-8", ago=600, peers={"gpu-3"}),  # outside the window
            ]
        }
    )
    assert primary_for(alert("gpu-3", 74, ago=10), snapshot, WINDOW, SECONDARY).node == "gpu-2"
    assert primary_for(alert("gpu-4", 74, ago=10), snapshot, WINDOW, SECONDARY).node == "gpu-2"
    assert primary_for(alert("gpu-9", 74, ago=10), snapshot, WINDOW, SECONDARY) is None
    assert primary_for(alert("gpu-3", 74, ago=10), snapshot, timedelta(seconds=5), SECONDARY) is None


# --- the intake ----------------------------------------------------------------------------------


async def test_secondary_alerts_on_a_job_peer_join_the_primary_incident_observed_on_the_peer():
    incidents = RecordingIncidents()
    running(incidents, "gpu-2")
    directory = FixedDirectory(incident("gpu-2", ago=60, peers={"gpu-3"}))
    hook = intake(incidents, directory)
    results = await hook.submit(
        [alert("gpu-3", 74, ago=30), alert("gpu-3", 45, ago=50), alert("gpu-3", None, ago=40)]
    )  # an NCCL timeout
    assert [(r.outcome, r.incident) for r in results] == [(Outcome.CORRELATED, "node-recovery-gpu-2")] * 3
    joined = incidents.runs["gpu-2"][0].alerts
    assert [r.reason for r in results] == [a.reason for a in joined]  # the answer says why, too
    assert [(a.node, a.observed_on, a.xid) for a in joined] == [
        ("gpu-2", "gpu-3", 74),
        ("gpu-2", "gpu-3", 45),
        ("gpu-2", "gpu-3", 79),
    ]  # the timeout: its primary's
    assert joined[0].reason == (
        "correlated: XID 74 on gpu-3, which shares a job with gpu-2, +30 s from the start "
        "of its incident (XID 79): XID 74"
    )
    assert joined[2].reason.startswith("correlated: an NCCL timeout on gpu-3")
    # joined with plain signals: a correlated alert never opens the failed node's incident
    assert {c for c, _, _ in incidents.calls} == {"join"}
    assert "gpu-3" not in incidents.runs


async def test_a_secondary_alert_waits_for_the_primary_to_find_its_jobs():
    incidents = RecordingIncidents()
    running(incidents, "gpu-2")
    directory = FixedDirectory(incident("gpu-2", peers=None))  # still finding its jobs
    hook = intake(incidents, directory)
    held = asyncio.ensure_future(hook.submit([alert("gpu-3", 74)]))
    again = asyncio.ensure_future(hook.submit([alert("gpu-3", 74)]))  # a re-send waits with it
    assert not await settled(held) and incidents.calls == []
    directory.show(incident("gpu-2", peers={"gpu-3"}))
    [[first], [second]] = await asyncio.gather(held, again)
    assert (first.outcome, first.incident) == (Outcome.CORRELATED, "node-recovery-gpu-2")
    assert (second.outcome, second.incident) == (Outcome.DUPLICATE, "node-recovery-gpu-2")
    assert len(incidents.runs["gpu-2"][0].alerts) == 1


async def test_after_the_hold_a_secondary_xid_opens_its_own_incident_and_an_nccl_timeout_is_dropped():
    incidents = RecordingIncidents()
    directory = FixedDirectory(incident("gpu-2", peers=None), incident("gpu-7", peers={"gpu-8"}))
    hook = intake(incidents, directory, hold=0.05)
    own, nccl = await hook.submit([alert("gpu-3", 74), alert("gpu-4", None)])
    assert (own.outcome, own.incident) == (Outcome.ACCEPTED, "node-recovery-gpu-3")
    assert nccl.outcome is Outcome.DROPPED
    assert nccl.reason == "an NCCL timeout and no incident it follows from within the hold: not a node fault by itself"
    assert list(incidents.runs) == ["gpu-3"]


async def test_a_held_secondary_alert_follows_its_own_nodes_primary_into_its_own_incident():
    incidents = RecordingIncidents()
    hook = intake(incidents, FixedDirectory(incident("gpu-2", peers=None)))
    held = asyncio.ensure_future(hook.submit([alert("gpu-3", 74, reason="NVLink")]))
    assert not await settled(held)
    [primary] = await hook.submit([alert("gpu-3", 79, reason="fell off the bus")])
    [secondary] = await held
    assert primary.outcome is secondary.outcome is Outcome.ACCEPTED
    # the primary first: an incident's first alert decides its XID class
    assert [a.reason for a in incidents.runs["gpu-3"][0].alerts] == ["fell off the bus", "NVLink"]


async def test_a_node_with_an_incident_of_its_own_keeps_its_secondary_alerts_at_no_cost():
    incidents = RecordingIncidents()
    directory = FixedDirectory(incident("gpu-2", peers={"gpu-3"}))
    running(incidents, "gpu-2")
    hook = intake(incidents, directory)
    await hook.submit([alert("gpu-3", 48)])
    [secondary, nccl] = await hook.submit([alert("gpu-3", 74), alert("gpu-3", None)])
    assert (secondary.outcome, secondary.incident) == (Outcome.ACCEPTED, "node-recovery-gpu-3")
    assert nccl.outcome is Outcome.DROPPED and "has an incident of its own" in nccl.reason
    assert directory.snapshots == 0

    # an incident visibility shows, opened elsewhere, counts too
    other = intake(
        RecordingIncidents(), FixedDirectory(incident("gpu-2", peers={"gpu-3"}), incident("gpu-3", xid=94, peers=set()))
    )
    [own] = await other.submit([alert("gpu-3", 74)])
    assert (own.outcome, own.incident) == (Outcome.ACCEPTED, "node-recovery-gpu-3")


@pytest.mark.parametrize("xid", [79, 48, 94, 13])
async def test_a_primary_xid_is_never_joined_to_another_nodes_incident(xid):
    incidents = RecordingIncidents()
    running(incidents, "gpu-2")
    hook = intake(incidents, FixedDirectory(incident("gpu-2", peers={"gpu-3"})))
    [r] = await hook.submit([alert("gpu-3", xid)])
    assert (r.outcome, r.incident) == (Outcome.ACCEPTED, "node-recovery-gpu-3")
    assert incidents.runs["gpu-2"][0].alerts == []


async def test_outside_the_window_a_secondary_alert_is_its_nodes_own():
    incidents = RecordingIncidents()
    hook = intake(
        incidents, FixedDirectory(incident("gpu-2", ago=600, peers={"gpu-3"})), hold=0, correlation_window=WINDOW
    )
    [r] = await hook.submit([alert("gpu-3", 74, ago=100)])
    assert (r.outcome, r.incident) == (Outcome.ACCEPTED, "node-recovery-gpu-3")


async def test_when_the_primary_incident_has_ended_the_alert_goes_to_its_own_node():
    incidents = RecordingIncidents()
    running(incidents, "gpu-2")
    incidents.end("gpu-2", NOW - timedelta(seconds=5))  # visibility has not caught up
    hook = intake(incidents, FixedDirectory(incident("gpu-2", peers={"gpu-3"})))
    [r] = await hook.submit([alert("gpu-3", 74)])
    assert (r.outcome, r.incident) == (Outcome.ACCEPTED, "node-recovery-gpu-3")
    assert [run.run_id for run in incidents.runs["gpu-2"]] == ["gpu-2-elsewhere"]  # no new incident of gpu-2


async def test_a_node_whose_own_incident_ended_is_correlated_again():
    incidents = RecordingIncidents()
    directory = FixedDirectory()
    hook = intake(incidents, directory)
    await hook.submit([alert("gpu-3", 79, ago=300)])
    incidents.end("gpu-3", NOW - timedelta(seconds=120))
    # later gpu-3 is a job peer of gpu-2's failure; this hook still remembers gpu-3's incident
    running(incidents, "gpu-2")
    directory.show(incident("gpu-2", ago=20, peers={"gpu-3"}))
    [r] = await hook.submit([alert("gpu-3", 74, ago=10)])
    assert (r.outcome, r.incident) == (Outcome.CORRELATED, "node-recovery-gpu-2")
    assert len(incidents.runs["gpu-3"]) == 1


async def test_without_a_directory_nothing_is_correlated():
    incidents = RecordingIncidents()
    hook = intake(incidents, None)
    own, nccl = await hook.submit([alert("gpu-3", 74), alert("gpu-3", None)])
    assert (own.outcome, own.incident) == (Outcome.ACCEPTED, "node-recovery-gpu-3")
    assert nccl.outcome is Outcome.DROPPED and "NCCL timeout" in nccl.reason


# --- reading visibility ----------------------------------------------------------------------------


class ListingClient:
    """A Temporal client whose visibility lists one running incident, and counts the queries."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def list_workflows(self, query: str):
        self.queries.append(query)

        async def executions():
            await asyncio.sleep(0.01)
            attributes = TypedSearchAttributes(
                [SearchAttributePair(sa.XID, 79), SearchAttributePair(sa.PEER_NODES, ["gpu-3", "gpu-4"])]
            )
            yield _Execution("node-recovery-gpu-2", NOW, attributes)
            yield _Execution("something-else", NOW, TypedSearchAttributes([]))

        return executions()


class _Execution:
    def __init__(self, id: str, start_time: datetime, typed_search_attributes: TypedSearchAttributes) -> None:
        self.id, self.start_time, self.typed_search_attributes = id, start_time, typed_search_attributes


async def test_running_incidents_cost_one_query_per_refresh_interval_however_many_ask():
    client = ListingClient()
    directory = RunningIncidents(client, refresh=timedelta(seconds=0.2))
    snapshots = await asyncio.gather(*(directory.snapshot() for _ in range(100)))
    assert directory.calls == {"list_running": 1} and len(client.queries) == 1
    assert "ExecutionStatus = 'Running'" in client.queries[0]
    assert snapshots[0].incidents == {"gpu-2": RunningIncident("gpu-2", NOW, 79, frozenset({"gpu-3", "gpu-4"}))}
    await directory.snapshot()
    assert len(client.queries) == 1  # still fresh
    started = asyncio.get_running_loop().time()
    await asyncio.gather(*(directory.refreshed() for _ in range(10)))
    assert len(client.queries) == 2
    assert asyncio.get_running_loop().time() - started >= 0.15  # not before the interval was over
