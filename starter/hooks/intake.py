"""The intake: validated alerts in, exactly one incident per node out, answered fast.

For each alert, in order:

1. a resolved alert is dropped: it changes nothing in a running recovery and starts nothing;
2. an alert older than the maximum age, or further in the future than the clock skew, is dropped;
3. an alert identical to one already handed over is a duplicate: it is in Temporal already;
4. an alert observed before the node's last incident ended is dropped (a replay after a restart
   must never restart a recovery);
5. a secondary alert (XID 45, 74, an NCCL timeout: docs/alert-hooks.md) on a node that shares a job
   with a node whose incident began within the correlation window joins that incident;
6. everything else goes to its own node's incident.

Hand-over: one lane per node. While a hand-over for a node is in flight, that node's new alerts
wait and go together in the next one, so a storm costs one Temporal call per node per round trip,
not one per alert. Each caller is answered once its own alerts are in Temporal.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from contracts.models import NodeFailureAlert, utc_now
from starter.hooks.sources import Incoming
from workflows.node_recovery import incident_workflow_id

log = logging.getLogger("training_recovery.hooks")


class Outcome(StrEnum):
    ACCEPTED = "accepted"  # handed over now: in the node's incident, in Temporal
    CORRELATED = "correlated"  # handed over to the incident of the node whose failure it follows from
    DUPLICATE = "duplicate"  # identical to an alert handed over before: in Temporal already
    DROPPED = "dropped"  # not handed over, and never will be; the reason says why


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    incident: str | None = None  # the incident's workflow id
    reason: str = ""


class IncidentEnded(Exception):
    """The node's last incident has ended (its workflow is closed); nothing was handed over."""


class Incidents(Protocol):
    """The Temporal side of the intake (TemporalIncidents); unit tests pass a recording fake."""

    async def join_or_open(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        """Hand the alerts to the node's running incident, or open its first one; returns the run id.
        Raises IncidentEnded when the node's last incident has ended."""

    async def join(self, node: str, alerts: list[NodeFailureAlert]) -> None:
        """Hand the alerts to the node's running incident (cheaper than join_or_open).
        Raises IncidentEnded when none is running."""

    async def ended_at(self, node: str) -> datetime | None:
        """When the node's last incident ended; None while one is running, or if it never had one."""

    async def open_after_end(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        """Open a new incident after an ended one (or join one opened meanwhile); returns the run id."""


# Nodes that share a running job with the given node (a Slurm lookup, injected: the hook itself
# never calls Slurm). Without it, nothing is correlated.
JobPeers = Callable[[str], Awaitable[Collection[str]]]


@dataclass(slots=True)
class _Pending:
    key: Incoming
    alert: NodeFailureAlert
    outcome: Outcome
    future: asyncio.Future[Result]


@dataclass(slots=True)
class _Node:
    pending: list[_Pending] = field(default_factory=list)
    draining: bool = False
    run_id: str | None = None  # the incident this hook last handed alerts to
    ended_at: datetime | None = None  # when the node's last incident ended, as last seen
    primary_at: datetime | None = None  # first primary alert of the current incident
    primary_xid: int | None = None


@dataclass(frozen=True)
class IntakeLimits:
    max_age: timedelta = timedelta(minutes=15)
    clock_skew: timedelta = timedelta(minutes=5)
    correlation_window: timedelta = timedelta(minutes=2)
    secondary_xids: frozenset[int] = frozenset({45, 74})
    max_batch: int = 200
    max_inflight: int = 64
    dedupe_size: int = 100_000


class Intake:
    def __init__(self, incidents: Incidents, limits: IntakeLimits = IntakeLimits(), *,
                 job_peers: JobPeers | None = None, clock: Callable[[], datetime] = utc_now) -> None:
        self._incidents = incidents
        self._limits = limits
        self._job_peers = job_peers
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._seen: OrderedDict[Incoming, asyncio.Future[Result]] = OrderedDict()
        self._slots = asyncio.Semaphore(limits.max_inflight)
        self._drains: set[asyncio.Task] = set()
        self.outcomes: Counter[str] = Counter()  # alerts by outcome, for /metrics
        self.temporal_calls: Counter[str] = Counter()

    async def submit(self, incoming: list[Incoming]) -> list[Result]:
        """Route every alert; returns once each is in Temporal (or known not to go there)."""
        now = self._clock()
        routed = [await self._route(item, now) for item in incoming]
        waits = [r for r in routed if not isinstance(r, Result)]
        # return_exceptions: every hand-over is awaited (none left unretrieved) before one failure is raised.
        outcomes = iter(await asyncio.gather(*waits, return_exceptions=True))
        results = [r if isinstance(r, Result) else next(outcomes) for r in routed]
        for r in results:
            if isinstance(r, BaseException):
                raise r
        self.outcomes.update(r.outcome.value for r in results)
        return results

    async def _route(self, item: Incoming, now: datetime) -> Result | asyncio.Future[Result]:
        limits = self._limits
        if item.resolved:
            return _dropped("resolved: a resolved alert changes nothing and starts nothing")
        if now - item.observed_at > limits.max_age:
            return _dropped(f"stale: observed {item.observed_at.isoformat()}, more than "
                            f"{limits.max_age.total_seconds():.0f} s ago")
        if item.observed_at - now > limits.clock_skew:
            return _dropped(f"observed {item.observed_at.isoformat()}, in the future beyond the allowed clock skew")
        earlier = self._seen.get(item)
        if earlier is not None:
            self._seen.move_to_end(item)
            if earlier.done() and earlier.exception() is None:
                return _as_duplicate(earlier.result())
            return asyncio.ensure_future(_duplicate_of(earlier))
        node = self._nodes.get(item.node)
        if node is not None and node.ended_at is not None and item.observed_at <= node.ended_at:
            return _ended(node.ended_at)

        if item.xid is None or item.xid in limits.secondary_xids:
            primary = await self._primary_for(item)
            if primary is not None:
                name, state = primary
                offset = (item.observed_at - state.primary_at).total_seconds()
                what = f"XID {item.xid}" if item.xid else "NCCL timeout"
                why = (f"correlated: {what} on {item.node}, "
                       f"which shares a job with {name}, {offset:+.0f} s from its XID {state.primary_xid}")
                return self._enqueue(name, item, item.joining(name, state.primary_xid, why), Outcome.CORRELATED)
            if item.xid is None:
                return _dropped("an NCCL timeout with no incident on a node of the same job: "
                                "not a node fault by itself")
        return self._enqueue(item.node, item, item.to_alert(), Outcome.ACCEPTED)

    async def _primary_for(self, item: Incoming) -> tuple[str, _Node] | None:
        """The node, sharing a job with this one, whose incident began closest to this alert."""
        own = self._nodes.get(item.node)
        if self._job_peers is None or (own is not None and own.primary_at is not None):
            return None  # no job knowledge, or the node has an incident of its own: it goes there
        try:
            peers = await self._job_peers(item.node)
        except Exception as e:  # without job knowledge the alert is the node's own, as if uncorrelated
            log.warning("job peers of %s unknown (%s: %s): not correlated", item.node, type(e).__name__, e)
            return None
        window = self._limits.correlation_window
        best = None
        for peer in peers:
            state = self._nodes.get(peer)
            if peer == item.node or state is None or state.primary_at is None:
                continue
            distance = abs(item.observed_at - state.primary_at)
            if distance <= window and (best is None or distance < best[0]):
                best = (distance, peer, state)
        return None if best is None else (best[1], best[2])

    def _enqueue(self, node: str, key: Incoming, alert: NodeFailureAlert, outcome: Outcome) -> asyncio.Future[Result]:
        future = asyncio.get_running_loop().create_future()
        self._remember(key, future)
        state = self._nodes.setdefault(node, _Node())
        state.pending.append(_Pending(key, alert, outcome, future))
        if not state.draining:
            state.draining = True
            task = asyncio.create_task(self._drain(node, state))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        return future

    def _remember(self, key: Incoming, future: asyncio.Future[Result]) -> None:
        self._seen[key] = future
        if len(self._seen) > self._limits.dedupe_size:
            self._seen.popitem(last=False)

    async def _drain(self, node: str, state: _Node) -> None:
        try:
            while state.pending:
                async with self._slots:
                    # Taken only once a slot is free: alerts that arrived meanwhile ride along.
                    batch = state.pending[: self._limits.max_batch]
                    del state.pending[: len(batch)]
                    await self._deliver(node, state, batch)
        finally:
            state.draining = False

    async def _deliver(self, node: str, state: _Node, batch: list[_Pending]) -> None:
        alerts = [p.alert for p in batch]
        try:
            try:
                if state.run_id is None:
                    self.temporal_calls["join_or_open"] += 1
                    run_id = await self._incidents.join_or_open(node, alerts)
                else:  # an incident this hook handed alerts to: a plain signal is cheaper
                    self.temporal_calls["join"] += 1
                    await self._incidents.join(node, alerts)
                    run_id = state.run_id
            except IncidentEnded:
                batch, run_id = await self._after_end(node, state, batch)
        except Exception as e:  # Temporal unreachable or refusing: nothing of this batch is accepted
            for p in batch:
                self._seen.pop(p.key, None)  # a retry of these alerts must hand them over again
                if not p.future.done():
                    p.future.set_exception(e)
            return
        if run_id is None:  # nothing fresh: the node has no running incident
            state.run_id = None
            return
        if run_id != state.run_id:
            state.run_id, state.primary_at, state.primary_xid = run_id, None, None
        incident = incident_workflow_id(node)
        for p in batch:
            if p.outcome is Outcome.ACCEPTED and p.alert.xid not in self._limits.secondary_xids:
                if state.primary_at is None or p.alert.observed_at < state.primary_at:
                    state.primary_at, state.primary_xid = p.alert.observed_at, p.alert.xid
            p.future.set_result(Result(p.outcome, incident))

    async def _after_end(self, node: str, state: _Node, batch: list[_Pending]) -> tuple[list[_Pending], str | None]:
        """The node's last incident has ended: alerts observed before its end are dropped, and the
        rest open a new incident."""
        self.temporal_calls["ended_at"] += 1
        ended = await self._incidents.ended_at(node)
        if ended is not None:
            state.ended_at = max(ended, state.ended_at or ended)
            for p in batch:
                if p.alert.observed_at <= ended:
                    p.future.set_result(_ended(ended))
            batch = [p for p in batch if p.alert.observed_at > ended]
        if not batch:
            return batch, None
        self.temporal_calls["open_after_end"] += 1
        return batch, await self._incidents.open_after_end(node, [p.alert for p in batch])


def _dropped(reason: str) -> Result:
    return Result(Outcome.DROPPED, reason=reason)


def _ended(ended_at: datetime) -> Result:
    return _dropped(f"the node's last incident ended at {ended_at.isoformat()}, after this alert was observed")


def _as_duplicate(earlier: Result) -> Result:
    return earlier if earlier.outcome is Outcome.DROPPED else Result(Outcome.DUPLICATE, earlier.incident)


async def _duplicate_of(earlier: asyncio.Future[Result]) -> Result:
    """An alert identical to one whose hand-over is still in flight is answered with it."""
    return _as_duplicate(await asyncio.shield(earlier))
