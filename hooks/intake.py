"""The intake: validated alerts in, exactly one incident per node out, answered fast.

For each alert, in order:

1. a resolved alert is dropped: it changes nothing in a running recovery and starts nothing;
2. an alert older than the maximum age, or further in the future than the clock skew, is dropped;
3. an alert identical to one already handed over is a duplicate: it is in Temporal already;
4. an alert observed before the node's last incident ended is dropped (a replay after a restart
   must never restart a recovery);
5. a secondary alert (XID 45, 74, an NCCL timeout: docs/alert-hooks.md) on a node with no incident
   of its own waits, at most the hold, for the incident it follows from (correlation.py): it joins
   the incident of a node that shared a job with it, or, once its own node has an incident or the
   hold is over, its own node's (an NCCL timeout is then dropped: it is no node fault by itself);
6. everything else goes to its own node's incident.

Hand-over: one lane per node. While a hand-over for a node is in flight, that node's new alerts
wait and go together in the next one, so a storm costs one Temporal call per node per round trip,
not one per alert. Each caller is answered once its own alerts are in Temporal.

Floods: past the first `full_alerts_per_incident` alerts handed to a running incident, the node's
alerts are counted here and answered at once ("counted"), and the incident hears of them in
digests (the latest alert of each source and the count of the rest) at most once per interval,
the interval doubling while the flood goes on; past `max_digests_per_incident` digests, the hook
only counts. So what a sender can add to an incident's history is bounded, however much or long it
sends (a flood once grew one to Temporal's limit, and the server terminated the incident). A hook
that stops loses the counts not yet sent: never an alert that could open an incident.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from contracts.models import MAX_DIGEST_SAMPLE, AlertDigest, NodeFailureAlert, utc_now
from hooks.correlation import (
    IncidentDirectory,
    Snapshot,
    correlation_reason,
    is_secondary,
    primary_for,
)
from hooks.sources import Incoming
from workflows.node_recovery import incident_workflow_id

log = logging.getLogger("training_recovery.hooks")
T = TypeVar("T")


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


COUNTED = "counted: the incident is flooded; it hears of this alert in its next digest"


class IncidentEnded(Exception):
    """The node's last incident has ended (its workflow is closed); nothing was handed over."""


class Incidents(Protocol):
    """The Temporal side of the intake (TemporalIncidents); unit tests pass a recording fake."""

    async def join_or_open(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        """Hand the alerts to the node's running incident, or open its first one; returns the run id.
        Raises IncidentEnded when the node's last incident has ended."""

    async def join(self, node: str, alerts: list[NodeFailureAlert], run_id: str | None) -> None:
        """Hand the alerts to the node's running incident (cheaper than join_or_open): the run
        run_id (the one this hook handed alerts to last), or with None whichever runs.
        Raises IncidentEnded when that run has ended, or none is running."""

    async def join_digest(self, node: str, digest: AlertDigest, run_id: str) -> None:
        """Tell the node's running incident run_id of the alerts counted for it, as join does."""

    async def ended_at(self, node: str) -> datetime | None:
        """When the node's last incident ended; None while one is running, or if it never had one."""

    async def open_after_end(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        """Open a new incident after an ended one (or join one opened meanwhile); returns the run id."""


@dataclass(slots=True)
class _Pending:
    key: Incoming  # the alert as its source reported it
    alert: NodeFailureAlert  # as it is handed over
    outcome: Outcome
    future: asyncio.Future[Result]
    # False for a secondary alert sent to its node's incident only because this hook remembers
    # one: if that has ended, the alert is decided again (correlated, held) rather than opening one.
    decided: bool = True


@dataclass(slots=True)
class _Digest:
    """The alerts counted for a flooded incident since its last digest."""

    run_id: str
    latest: dict[str, _Pending] = field(default_factory=dict)  # per source
    counted: Counter[str] = field(default_factory=Counter)  # per source, the latest included
    sent: int = 0
    interval: float = 0.0  # seconds; doubles with each digest sent
    next_at: float = 0.0  # the event loop's time
    flushing: bool = False

    def take(self) -> AlertDigest:
        sample = list(self.latest.values())[:MAX_DIGEST_SAMPLE]
        omitted = Counter(self.counted)
        omitted.subtract(p.alert.source for p in sample)
        self.latest, self.counted = {}, Counter()
        return AlertDigest(
            alerts=[p.alert for p in sample],
            omitted={source: n for source, n in omitted.most_common(MAX_DIGEST_SAMPLE) if n > 0},
        )


@dataclass(slots=True)
class _Node:
    pending: list[_Pending] = field(default_factory=list)
    draining: bool = False
    run_id: str | None = None  # the incident this hook last handed alerts to
    ended_at: datetime | None = None  # when the node's last incident ended, as last seen
    handed_in_full: int = 0  # alerts handed over to run_id in full
    digest: _Digest | None = None  # run_id is flooded: its alerts are counted

    @property
    def idle(self) -> bool:
        """Nothing to hand over or send: forgetting this node loses only what Temporal knows too."""
        return not (self.pending or self.draining or (self.digest is not None and self.digest.flushing))

    @property
    def has_incident(self) -> bool:
        """This hook is handing alerts to the node's incident, or handed some to one not known to
        have ended."""
        return self.run_id is not None or self.draining or bool(self.pending)


@dataclass(frozen=True)
class IntakeLimits:
    max_age: timedelta = timedelta(minutes=15)
    clock_skew: timedelta = timedelta(minutes=5)
    correlation_window: timedelta = timedelta(minutes=2)
    correlation_hold: timedelta = timedelta(seconds=10)
    secondary_xids: frozenset[int] = frozenset({45, 74})
    max_batch: int = 200
    max_inflight: int = 64
    dedupe_size: int = 100_000
    node_state_size: int = 100_000
    full_alerts_per_incident: int = 50
    digest_interval: timedelta = timedelta(seconds=1)  # the first; then twice the one before
    digest_interval_max: timedelta = timedelta(seconds=60)
    max_digests_per_incident: int = 1000


class Intake:
    def __init__(
        self,
        incidents: Incidents,
        limits: IntakeLimits = IntakeLimits(),
        *,
        directory: IncidentDirectory | None = None,
        clock: Callable[[], datetime] = utc_now,
        temporal_calls: Counter[str] | None = None,
    ) -> None:
        """Without a directory of running incidents nothing is correlated: secondary XIDs go to
        their own node at once, NCCL timeouts are dropped. temporal_calls: a counter shared with
        the directory, so that /metrics shows every call."""
        self._incidents = incidents
        self._limits = limits
        self._directory = directory
        self._clock = clock
        self._nodes: dict[str, _Node] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()  # nodes with nothing in flight, longest idle first
        self._seen: OrderedDict[Incoming, asyncio.Future[Result]] = OrderedDict()
        # Nodes whose secondary alerts are held, while any is: weak, so a node's entry goes with its
        # last held alert (an NCCL timeout that is dropped after the hold never pops it).
        self._own_incident_news: weakref.WeakValueDictionary[str, asyncio.Event] = weakref.WeakValueDictionary()
        self._slots = asyncio.Semaphore(limits.max_inflight)
        self._background: set[asyncio.Task] = set()
        self.outcomes: Counter[str] = Counter()  # alerts by outcome, for /metrics
        self.temporal_calls: Counter[str] = Counter() if temporal_calls is None else temporal_calls

    async def submit(self, incoming: list[Incoming]) -> list[Result]:
        """Route every alert; returns once each is in Temporal (or known not to go there)."""
        now = self._clock()
        routed = [self._route(item, now) for item in incoming]
        waits = [r for r in routed if not isinstance(r, Result)]
        if waits:
            # return_exceptions: every hand-over is awaited (none left unretrieved) before one failure is raised.
            outcomes = iter(await asyncio.gather(*waits, return_exceptions=True))
            routed = [r if isinstance(r, Result) else next(outcomes) for r in routed]
            for r in routed:
                if isinstance(r, BaseException):
                    raise r
        self.outcomes.update(r.outcome.value for r in routed)
        return routed

    def _route(self, item: Incoming, now: datetime) -> Result | asyncio.Future[Result]:
        limits = self._limits
        if item.resolved:
            return _dropped("resolved: a resolved alert changes nothing and starts nothing")
        if now - item.observed_at > limits.max_age:
            return _dropped(
                f"stale: observed {item.observed_at.isoformat()}, more than {limits.max_age.total_seconds():.0f} s ago"
            )
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
        secondary = is_secondary(item.xid, limits.secondary_xids)
        if secondary and not (node is not None and node.has_incident):
            if self._directory is not None:
                return self._remember(item, self._spawn(self._correlate(item)))
            if item.xid is None:
                return _dropped("an NCCL timeout, and this hook correlates nothing: not a node fault by itself")
        if item.xid is None:
            return _dropped(
                f"an NCCL timeout on {item.node}, which has an incident of its own: not a node fault by itself"
            )
        future = self._enqueue(item.node, item, item.to_alert(), Outcome.ACCEPTED, decided=not secondary)
        return self._remember(item, future)

    async def _correlate(self, item: Incoming, *, trust_memory: bool = True) -> Result:
        """A secondary alert on a node with no incident of its own: held until the incident it
        follows from is known (correlated), its node has an incident of its own, or the hold ends.
        trust_memory=False: the incident this hook remembered for the node has ended, so only a
        new alert of the node's own, or visibility, says it has one."""
        assert self._directory is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._limits.correlation_hold.total_seconds()
        news = self._own_incident_news.setdefault(item.node, asyncio.Event())
        snapshot = await self._directory.snapshot()
        while True:
            own = self._nodes.get(item.node) if trust_memory or news.is_set() else None
            if (own is not None and own.has_incident) or snapshot.running_on(item.node):
                return await self._as_own(item, f"{item.node} has an incident of its own")
            primary = primary_for(item, snapshot, self._limits.correlation_window, self._limits.secondary_xids)
            if primary is not None:
                why = correlation_reason(item, primary)
                log.info("%s -> %s", why, incident_workflow_id(primary.node))
                return await self._enqueue(
                    primary.node, item, item.joining(primary.node, primary.xid, why), Outcome.CORRELATED
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                return await self._as_own(item, "no incident it follows from within the hold")
            snapshot = await _next_news(news, self._directory, remaining) or snapshot

    async def _as_own(self, item: Incoming, why: str) -> Result:
        if item.xid is None:
            return _dropped(f"an NCCL timeout and {why}: not a node fault by itself")
        return await self._enqueue(item.node, item, item.to_alert(), Outcome.ACCEPTED)

    def _spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _enqueue(
        self, node: str, key: Incoming, alert: NodeFailureAlert, outcome: Outcome, decided: bool = True
    ) -> asyncio.Future[Result]:
        future = asyncio.get_running_loop().create_future()
        state = self._nodes.get(node)
        if state is None:
            self._forget_idle_nodes(room_for=1)
            state = self._nodes[node] = _Node()
        self._idle.pop(node, None)
        if state.digest is not None:
            self._count(node, state.digest, _Pending(key, alert, outcome, future, decided))
            return future
        state.pending.append(_Pending(key, alert, outcome, future, decided))
        if outcome is Outcome.ACCEPTED:
            news = self._own_incident_news.pop(node, None)
            if news is not None:  # the node's held secondary alerts now go to its own incident, after this one
                news.set()
        if not state.draining:
            state.draining = True
            self._spawn(self._drain(node, state))
        return future

    def _settled(self, node: str, state: _Node) -> None:
        """A hand-over or digest of the node has ended: if nothing else is in flight, it may be forgotten."""
        if state.idle:
            self._idle[node] = None
            self._idle.move_to_end(node)
            self._forget_idle_nodes()

    def _forget_idle_nodes(self, room_for: int = 0) -> None:
        """Keep at most node_state_size nodes (room_for fewer) by forgetting the longest idle ones; a
        node with alerts in flight or a digest to send is kept, and forgotten once idle. What is
        forgotten is cached, not decided: the next hand-over joins or opens the incident again and
        Temporal says when the last one ended; a flooded incident gets its next
        full_alerts_per_incident alerts in full again."""
        while len(self._nodes) + room_for > self._limits.node_state_size and self._idle:
            del self._nodes[self._idle.popitem(last=False)[0]]

    def _remember(self, key: Incoming, future: asyncio.Future[Result]) -> asyncio.Future[Result]:
        self._seen[key] = future
        if len(self._seen) > self._limits.dedupe_size:
            self._seen.popitem(last=False)
        return future

    async def _drain(self, node: str, state: _Node) -> None:
        try:
            while state.pending:
                async with self._slots:
                    # Taken only once a slot is free: alerts that arrived meanwhile ride along.
                    batch = state.pending[: self._limits.max_batch]
                    del state.pending[: len(batch)]
                    await self._deliver(node, state, batch)
                if state.digest is not None:  # flooded now: the rest are counted
                    waiting, state.pending = state.pending, []
                    for p in waiting:
                        self._count(node, state.digest, p)
        finally:
            state.draining = False
            self._settled(node, state)

    def _count(self, node: str, digest: _Digest, p: _Pending) -> None:
        """A flooded incident's alert: answered now, told in the next digest."""
        digest.latest[p.alert.source] = p
        digest.counted[p.alert.source] += 1
        p.future.set_result(
            Result(
                p.outcome, incident_workflow_id(node), p.alert.reason if p.outcome is Outcome.CORRELATED else COUNTED
            )
        )
        if not digest.flushing:
            digest.flushing = True
            self._spawn(self._send_digests(node, digest))

    async def _send_digests(self, node: str, digest: _Digest) -> None:
        loop = asyncio.get_running_loop()
        try:
            while digest.counted and self._nodes[node].digest is digest:
                await asyncio.sleep(max(0.0, digest.next_at - loop.time()))
                if digest.sent >= self._limits.max_digests_per_incident:
                    if digest.sent == self._limits.max_digests_per_incident:
                        log.warning(
                            "%s: %d digests sent to incident run %s; its further alerts are counted "
                            "on this hook only (alerts_counted_not_sent)",
                            node,
                            digest.sent,
                            digest.run_id,
                        )
                        digest.sent += 1
                    self.outcomes["counted_not_sent"] += digest.counted.total()
                    digest.latest, digest.counted = {}, Counter()
                    return
                await self._send_digest(node, digest)
        finally:
            digest.flushing = False
            state = self._nodes.get(node)  # gone if the incident ended and the node has been idle since
            if state is not None:
                self._settled(node, state)

    async def _send_digest(self, node: str, digest: _Digest) -> None:
        sample = list(digest.latest.values())
        told = digest.take()
        try:
            async with self._slots:
                self.temporal_calls["digest"] += 1
                await self._incidents.join_digest(node, told, digest.run_id)
        except IncidentEnded:
            # The counted alerts go the usual way: dropped if observed before the end, else a new incident.
            state = self._nodes[node]
            state.digest, state.run_id, state.handed_in_full = None, None, 0
            for p in sample + list(digest.latest.values()):
                # Answered already ("counted"): no caller awaits this hand-over.
                self._enqueue(node, p.key, p.alert, p.outcome, p.decided).add_done_callback(_unawaited)
            return
        except Exception as e:  # Temporal unreachable: the counts go in a later digest
            log.warning(
                "%s: a digest of %d alerts was not handed over (%s); trying again",
                node,
                sum(told.omitted.values()) + len(told.alerts),
                e,
            )
            for p in sample:
                digest.latest.setdefault(p.alert.source, p)
            digest.counted.update(p.alert.source for p in sample)
            digest.counted.update(told.omitted)
        else:
            digest.sent += 1
        limits = self._limits
        digest.interval = min(
            limits.digest_interval_max.total_seconds(), max(limits.digest_interval.total_seconds(), 2 * digest.interval)
        )
        digest.next_at = asyncio.get_running_loop().time() + digest.interval

    async def _deliver(self, node: str, state: _Node, batch: list[_Pending]) -> None:
        alerts = [p.alert for p in batch]
        try:
            try:
                # A batch of correlated alerts only joins: it must never open an incident of the
                # failed node (visibility showed that one running).
                own = any(p.outcome is Outcome.ACCEPTED for p in batch)
                if state.run_id is None and own:
                    self.temporal_calls["join_or_open"] += 1
                    run_id = await self._incidents.join_or_open(node, alerts)
                else:  # a running incident: a plain signal is cheaper
                    self.temporal_calls["join"] += 1
                    await self._incidents.join(node, alerts, state.run_id)
                    run_id = state.run_id
            except IncidentEnded:
                state.run_id = None
                batch = self._decide_again(node, batch)
                batch, run_id = await self._after_end(node, state, batch)
        except Exception as e:  # Temporal unreachable or refusing: nothing of this batch is accepted
            for p in batch:
                self._seen.pop(p.key, None)  # a retry of these alerts must hand them over again
                if not p.future.done():
                    p.future.set_exception(e)
            return
        if run_id != state.run_id:
            state.handed_in_full = 0
        state.run_id = run_id
        state.handed_in_full += len(batch)
        if run_id is not None and state.handed_in_full >= self._limits.full_alerts_per_incident:
            state.digest = _Digest(run_id)
        incident = incident_workflow_id(node)
        for p in batch:
            # a correlated alert's answer says whose incident it joined and why, as its reason does
            p.future.set_result(Result(p.outcome, incident, p.alert.reason if p.outcome is Outcome.CORRELATED else ""))

    def _decide_again(self, node: str, batch: list[_Pending]) -> list[_Pending]:
        """The node's incident has ended: correlated alerts that were joining it go to their own
        node instead (never opening an incident of this one), and secondary alerts sent to it only
        because this hook remembered it are correlated afresh. Returns the rest of the batch."""
        rest = []
        for p in batch:
            if p.outcome is Outcome.CORRELATED:
                again = self._as_own(p.key, f"the incident of {node} it follows from has ended")
            elif not p.decided and self._directory is not None:
                again = self._correlate(p.key, trust_memory=False)
            else:
                rest.append(p)
                continue
            self._spawn(again).add_done_callback(_pass_on(p.future))
        return rest

    async def _after_end(self, node: str, state: _Node, batch: list[_Pending]) -> tuple[list[_Pending], str | None]:
        """The node's last incident has ended: alerts observed before its end are dropped, and the
        rest open a new incident."""
        if not batch:
            return batch, None
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


async def _next_news(news: asyncio.Event, directory: IncidentDirectory, timeout: float) -> Snapshot | None:
    """Wait until the node has an incident of its own, the directory has a newer snapshot, or the
    timeout; returns the newer snapshot if that came."""
    waits = {asyncio.ensure_future(news.wait()), asyncio.ensure_future(directory.refreshed())}
    done, pending = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for w in pending:
        w.cancel()
    snapshots = [w.result() for w in done if isinstance(w.result(), Snapshot)]
    return snapshots[0] if snapshots else None


def _pass_on(target: asyncio.Future[Result]) -> Callable[[asyncio.Future[Result]], None]:
    def copy(source: asyncio.Future[Result]) -> None:
        if source.cancelled():
            target.cancel()
        elif source.exception() is not None:
            target.set_exception(source.exception())
        else:
            target.set_result(source.result())

    return copy


def _unawaited(future: asyncio.Future[Result]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failure was logged where it happened


def _dropped(reason: str) -> Result:
    return Result(Outcome.DROPPED, reason=reason)


def _ended(ended_at: datetime) -> Result:
    return _dropped(f"the node's last incident ended at {ended_at.isoformat()}, after this alert was observed")


def _as_duplicate(earlier: Result) -> Result:
    return earlier if earlier.outcome is Outcome.DROPPED else Result(Outcome.DUPLICATE, earlier.incident)


async def _duplicate_of(earlier: asyncio.Future[Result]) -> Result:
    """An alert identical to one whose hand-over is still in flight is answered with it."""
    return _as_duplicate(await asyncio.shield(earlier))
