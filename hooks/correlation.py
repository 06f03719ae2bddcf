"""Correlation: which alerts follow from another node's failure, and whose incident they join.

When a GPU fails, the job's other nodes report errors too (NVLink errors from the other end of a
link, the driver's cleanup of the killed processes, NCCL collectives timing out). On their own
those would drain healthy nodes, so a *secondary* alert (docs/alert-hooks.md, "Correlation") joins
the incident of a *primary* failure when its node shared a job with the failed node and it was
observed within the window of that incident's start.

Which nodes shared a job is the incident's knowledge, not the hook's (of Slurm the hook reads only
the node list): once an incident has found its jobs, it keeps the search attribute
RecoveryPeerNodes. The hook reads every running incident in one visibility query, at most once per
refresh interval however many alerts wait for it (RunningIncidents); the decision itself is the
pure function primary_for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from temporalio.client import Client

from contracts import search_attributes as sa
from hooks.sources import Incoming
from workflows.node_recovery import NodeRecoveryWorkflow, incident_workflow_id

log = logging.getLogger("training_recovery.hooks")

_WORKFLOW_ID_PREFIX = incident_workflow_id("")


@dataclass(frozen=True, slots=True)
class RunningIncident:
    """A node's running incident, as visibility shows it."""

    node: str
    started_at: datetime
    xid: int | None  # the incident's XID, once a worker has classified it
    peers: frozenset[str] | None  # nodes that shared a job with it, once it has found its jobs


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every running incident at one moment."""

    incidents: dict[str, RunningIncident]  # by failed node

    def running_on(self, node: str) -> bool:
        return node in self.incidents


NOTHING_RUNNING = Snapshot({})


def is_secondary(xid: int | None, secondary_xids: Collection[int]) -> bool:
    """An alert that may follow from a failure elsewhere: a secondary XID, or an NCCL timeout (no XID)."""
    return xid is None or xid in secondary_xids


def primary_for(
    alert: Incoming, snapshot: Snapshot, window: timedelta, secondary_xids: Collection[int]
) -> RunningIncident | None:
    """The incident this secondary alert follows from: a running incident of another node, opened
    by a primary XID, that lists the alert's node among its job peers and started within the
    window of the alert; the nearest in time if several do. None: the alert is its node's own."""
    best: tuple[timedelta, RunningIncident] | None = None
    for incident in snapshot.incidents.values():
        if (
            incident.node == alert.node
            or incident.peers is None
            or alert.node not in incident.peers
            or incident.xid is None
            or is_secondary(incident.xid, secondary_xids)
        ):
            continue
        distance = abs(alert.observed_at - incident.started_at)
        if distance <= window and (best is None or distance < best[0]):
            best = (distance, incident)
    return None if best is None else best[1]


def correlation_reason(alert: Incoming, primary: RunningIncident) -> str:
    """Why the alert joined another node's incident, as its reason and the hook's log say."""
    assert primary.xid is not None, "primary_for only returns classified incidents"
    what = "an NCCL timeout" if alert.xid is None else f"XID {alert.xid}"
    offset = (alert.observed_at - primary.started_at).total_seconds()
    return (
        f"correlated: {what} on {alert.node}, which shares a job with {primary.node}, "
        f"{offset:+.0f} s from the start of its incident (XID {primary.xid})"
    )


class IncidentDirectory(Protocol):
    """Where the intake learns of running incidents (RunningIncidents; unit tests pass a fake)."""

    async def snapshot(self) -> Snapshot:
        """Every running incident, as recent as the refresh interval allows."""

    async def refreshed(self) -> Snapshot:
        """The result of the next query: the one in flight, or one made as soon as the refresh
        interval allows (waits for it)."""


class RunningIncidents:
    """Every running NodeRecoveryWorkflow, from one visibility query, kept for `refresh` seconds.

    Concurrent callers share one query in flight, so a storm of secondary alerts costs one query
    per refresh interval, not one per alert. A failing query keeps the last snapshot (logged): the
    alerts waiting for it then go to their own nodes once their hold ends."""

    QUERY = f"WorkflowType = '{NodeRecoveryWorkflow.__name__}' AND ExecutionStatus = 'Running'"

    def __init__(self, client: Client, refresh: timedelta, calls: Counter[str] | None = None) -> None:
        self._client = client
        self._refresh = refresh.total_seconds()
        self._last = NOTHING_RUNNING
        self._taken_at = float("-inf")  # time.monotonic() of the query behind _last
        self._query: asyncio.Task[Snapshot] | None = None
        self.calls = Counter() if calls is None else calls  # Temporal calls by kind, for /metrics

    async def snapshot(self) -> Snapshot:
        if time.monotonic() - self._taken_at < self._refresh:
            return self._last
        return await self.refreshed()

    async def refreshed(self) -> Snapshot:
        if self._query is None:
            wait = self._taken_at + self._refresh - time.monotonic()
            self._query = asyncio.create_task(self._take(max(0.0, wait)))
        return await asyncio.shield(self._query)

    async def _take(self, wait: float) -> Snapshot:
        try:
            await asyncio.sleep(wait)  # never more than one query per refresh interval
            started = time.monotonic()
            self.calls["list_running"] += 1
            try:
                self._last = Snapshot({i.node: i async for i in self._list()})
            except Exception as e:
                log.warning(
                    "running incidents unknown (%s: %s): correlation uses the last known ones", type(e).__name__, e
                )
            self._taken_at = started
            return self._last
        finally:
            self._query = None

    async def _list(self):
        async for execution in self._client.list_workflows(self.QUERY):
            if not execution.id.startswith(_WORKFLOW_ID_PREFIX):
                continue
            attributes = execution.typed_search_attributes
            peers = attributes.get(sa.PEER_NODES)
            yield RunningIncident(
                node=execution.id[len(_WORKFLOW_ID_PREFIX) :],
                started_at=execution.start_time,
                xid=attributes.get(sa.XID),
                peers=None if peers is None else frozenset(peers),
            )
