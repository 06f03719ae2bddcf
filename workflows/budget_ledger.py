"""The fleet disruption budget's decisions as plain code over BudgetState: no Temporal, no I/O and
no clock (every call is given `now`), so it is deterministic inside FleetBudgetWorkflow and
testable on its own. Each deciding method returns the timeline events it appended.

Admission, in arrival order: a request is granted when the fleet has fewer than max_nodes leases,
the running jobs disrupted in the window leave room for its jobs, and each of its partitions has
fewer leases than its share. The fleet-wide limits are first come, first served: once a request
waits for the disrupted-jobs budget, no later request with jobs passes it (small requests would
otherwise starve a large one). A request waiting for its partition does not hold back requests
of other partitions.

Before that, at the fence stage, the fence circuit breaker: a request to fence (drain) a node is
permitted while the nodes fenced in the breaker's window stay within its limits (an absolute cap,
a fraction of the cluster, a fraction of each of the node's partitions). The request that would
pass one trips the breaker: it and every fence request after it are held, nothing is drained,
until an operator resets the breaker; the reset weighs the held requests again, in arrival order.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

from contracts.audit import ActorKind
from contracts.budget import (
    BlockedBy,
    BreakerReset,
    BreakerTrip,
    BudgetPolicy,
    BudgetState,
    BudgetStatus,
    Disruption,
    FenceMark,
    HolderRef,
    IncidentMark,
    Lease,
    LeaseRequest,
    LeaseStage,
    LeaseState,
    LeaseStatus,
    Quarantine,
    QuarantineRelease,
    QuarantineStatus,
    TimelineEvent,
    TimelineKind,
)
from contracts.models import OperatorDecision

# Ended leases remembered so that a late duplicate request is answered with how it ended.
FINISHED_KEPT = 500


def _grant_time(lease: Lease) -> datetime:
    """When a granted lease was granted (set with the grant)."""
    assert lease.state.granted_at is not None
    return lease.state.granted_at


class BudgetLedger:
    def __init__(self, state: BudgetState, budget_workflow_id: str, budget_epoch: str):
        self.state = state
        self._budget_workflow_id = budget_workflow_id
        self._budget_epoch = budget_epoch
        # Derived from state.leases and kept in step by every change (request, grant, end), so
        # that a request no longer scans every lease (1,000 requests: 0.42 s, not 1.73 s): the
        # scans made a workflow task of a storm's requests outlast Temporal's 2 s deadlock limit
        # at N = 1,000. Lookup by incident; waiting in arrival order; holders in
        # the order of their grant (time only grows, so the first holder's lease expires first);
        # holders per partition and per job.
        self._active_by_incident = {lease.state.incident_id: lease for lease in state.leases}
        self._waiting = {lease.state.incident_id: lease for lease in state.leases if lease.state.waiting}
        self._holding = {
            lease.state.incident_id: lease
            for lease in sorted((lease for lease in state.leases if lease.state.granted), key=_grant_time)
        }
        self._held_per_partition = Counter(p for lease in self._holding.values() for p in set(lease.state.partitions))
        self._held_jobs = Counter(job for lease in self._holding.values() for job in set(lease.request.job_ids))
        self._fence_held = {lease.state.incident_id: lease for lease in state.leases if lease.state.fence_held}

    @property
    def policy(self) -> BudgetPolicy:
        return self.state.policy

    # --- reading ------------------------------------------------------------------------------

    def holders(self) -> list[Lease]:
        return [lease for lease in self.state.leases if lease.state.granted]

    def waiting(self) -> list[Lease]:
        return [lease for lease in self.state.leases if lease.state.waiting]

    def lease_state(self, incident_id: str) -> LeaseState | None:
        lease = self._active(incident_id)
        if lease is not None:
            return lease.state
        return next((s for s in reversed(self.state.finished) if s.incident_id == incident_id), None)

    def holder_refs(self) -> list[HolderRef]:
        """Every incident with a lease granted or waiting: each should still be running."""
        return [
            HolderRef(
                incident_id=lease.state.incident_id, workflow_id=lease.state.workflow_id, run_id=lease.state.run_id
            )
            for lease in self.state.leases
        ]

    def disrupted_jobs(self, now: datetime) -> int:
        return sum(d.jobs for d in self._disruptions_in_window(now))

    def quarantined(self, node: str) -> bool:
        return node in self.state.quarantines

    def lemons(self) -> list[str]:
        return sorted(self.state.quarantines)

    def quarantine_status(self, node: str, now: datetime) -> QuarantineStatus:
        active = self.state.quarantines.get(node)
        return QuarantineStatus(
            node=node,
            quarantined=active is not None,
            since=active.since if active else None,
            incidents_in_window=self._incidents_in_window(node, now),
            last_release=self.state.released_quarantines.get(node),
        )

    def status(self, now: datetime) -> BudgetStatus:
        return BudgetStatus(
            policy=self.policy,
            holders=[lease.state for lease in self.holders()],
            waiting=[lease.state for lease in self.waiting()],
            quarantined=[self.quarantine_status(node, now) for node in self.state.quarantines],
            disrupted_jobs_in_window=self.disrupted_jobs(now),
            continued_as_new=self.state.continued_as_new,
            breaker=self.state.breaker,
            fenced_in_window=sorted({mark.node for mark in self._fences_in_window(now)}),
            fence_held=[lease.state for lease in self._fence_held.values()],
        )

    def next_deadline(self, now: datetime) -> datetime | None:
        """When time alone changes a decision: a lease reaches its maximum duration, or a
        disruption leaves the window that a waiting request needs room in."""
        first_granted = next((lease.state.granted_at for lease in self._holding.values()), None)
        deadlines = [first_granted + timedelta(seconds=self.policy.lease_max_seconds)] if first_granted else []
        if any(w.state.blocked_by == BlockedBy.DISRUPTED_JOBS for w in self._waiting.values()):
            in_window = self._disruptions_in_window(now)
            if in_window:
                deadlines.append(
                    min(d.at for d in in_window) + timedelta(seconds=self.policy.disruption_window_seconds)
                )
        return min(deadlines, default=None)

    # --- deciding -----------------------------------------------------------------------------

    def request(self, req: LeaseRequest, now: datetime) -> list[TimelineEvent]:
        """A new request to fence passes the breaker or is held; a new request to remediate counts
        toward its node's lemon history and waits or is granted. A repeated one changes nothing
        (its incident's run is updated: a reset incident keeps its lease); one whose lease already
        ended is answered with that end, never granted again."""
        lease = self._active(req.incident_id)
        if lease is None and self.lease_state(req.incident_id) is not None:
            return []
        if req.stage == LeaseStage.FENCE:
            return self._ask_to_fence(lease, req, now)
        events: list[TimelineEvent] = []
        if lease is None or lease.state.fencing:
            lease, events = self._queue(lease, req, now)
        elif lease.state.run_id != req.run_id:
            lease.request.run_id = lease.state.run_id = req.run_id
        if req.approval is not None and lease.state.waiting:
            events.append(self._grant(lease, now, approval=req.approval))
        return events

    def _queue(self, fenced: Lease | None, req: LeaseRequest, now: datetime) -> tuple[Lease, list[TimelineEvent]]:
        """A request to remediate joins the queue: anew, or as the next stage of its fence."""
        events = self._count_incident(req.node, req.incident_id, now)
        if fenced is not None:
            self._fence_held.pop(req.incident_id, None)
            self.state.leases = [held for held in self.state.leases if held is not fenced]
        lease = Lease(
            request=req,
            state=LeaseState(
                incident_id=req.incident_id,
                node=req.node,
                workflow_id=req.workflow_id,
                run_id=req.run_id,
                budget_workflow_id=self._budget_workflow_id,
                budget_epoch=self._budget_epoch,
                status=LeaseStatus.WAITING,
                version=fenced.state.version if fenced else 0,
                requested_at=now,
                running_jobs=req.running_jobs,
                partitions=[p.name for p in req.partitions],
                quarantined=self.quarantined(req.node),
            ),
        )
        self.state.leases.append(lease)
        self._active_by_incident[req.incident_id] = self._waiting[req.incident_id] = lease
        events += self.admit(now)
        if lease.state.waiting:
            events.append(self._event(TimelineKind.QUEUED, now, lease, detail=lease.state.reason))
        return lease, events

    def admit(self, now: datetime) -> list[TimelineEvent]:
        """Grant, in arrival order, every waiting request that the budget allows now."""
        events = []
        jobs_held_back = False
        for lease in list(self._waiting.values()):
            blocked = self._blocker(lease.request, now, jobs_held_back)
            if blocked is None:
                events.append(self._grant(lease, now))
                continue
            lease.state.blocked_by, lease.state.reason = blocked
            jobs_held_back = jobs_held_back or blocked[0] == BlockedBy.DISRUPTED_JOBS
        return events

    def release(self, incident_id: str, reason: str, now: datetime) -> list[TimelineEvent]:
        """The incident returns its lease, or withdraws its waiting request; idempotent."""
        lease = self._active(incident_id)
        if lease is None:
            return []
        kind = TimelineKind.RELEASED if lease.state.granted else TimelineKind.WITHDRAWN
        return self._end(lease, LeaseStatus.RELEASED, kind, reason, now) + self.admit(now)

    def drop_closed(self, closed: list[HolderRef], now: datetime) -> list[TimelineEvent]:
        """Incident runs found closed: their leases are reclaimed, their requests withdrawn."""
        events = []
        for ref in closed:
            lease = self._active(ref.incident_id)
            if lease is None or lease.state.run_id != ref.run_id:
                continue
            if lease.state.granted:
                events += self._end(
                    lease,
                    LeaseStatus.EXPIRED,
                    TimelineKind.RECLAIMED,
                    "its incident's workflow closed without returning it",
                    now,
                )
            else:
                events += self._end(
                    lease,
                    LeaseStatus.RELEASED,
                    TimelineKind.WITHDRAWN,
                    "its incident's workflow closed while waiting",
                    now,
                )
        return events + self.admit(now)

    def expire_overdue(self, now: datetime) -> list[TimelineEvent]:
        max_held = timedelta(seconds=self.policy.lease_max_seconds)
        events = []
        for lease in self.holders():
            if lease.state.granted_at and lease.state.granted_at + max_held <= now:
                events += self._end(
                    lease,
                    LeaseStatus.EXPIRED,
                    TimelineKind.EXPIRED,
                    f"held longer than {self.policy.lease_max_seconds:.0f} s",
                    now,
                )
        return events + self.admit(now)

    def set_policy(self, policy: BudgetPolicy, now: datetime) -> list[TimelineEvent]:
        if policy == self.policy:
            return []
        self.state.policy = policy
        changed = self._event(
            TimelineKind.POLICY_CHANGED,
            now,
            actor="configuration",
            actor_kind="operator",
            detail=policy.model_dump_json(),
        )
        return [changed] + self.admit(now)

    def release_quarantine(self, release: QuarantineRelease, now: datetime) -> list[TimelineEvent]:
        """An operator releases a lemon; its incident count starts again from here."""
        quarantine = self.state.quarantines.pop(release.node, None)
        if quarantine is None:
            raise ValueError(f"node {release.node} is not quarantined")
        quarantine.released_at, quarantine.released_by, quarantine.release_reason = now, release.actor, release.reason
        self.state.released_quarantines[release.node] = quarantine
        self.state.node_incidents.pop(release.node, None)
        self._flag_quarantine(release.node, False)
        return [
            self._event(
                TimelineKind.QUARANTINE_RELEASED,
                now,
                node=release.node,
                actor=release.actor,
                actor_kind="operator",
                detail=release.reason,
            )
        ]

    def reset_breaker(self, reset: BreakerReset, now: datetime) -> list[TimelineEvent]:
        """An operator resets the tripped breaker: its count starts again from here, and the held
        fences are weighed again in arrival order (past the limits, the breaker trips again)."""
        if self.state.breaker is None:
            raise ValueError("the fence circuit breaker is not tripped")
        self.state.breaker, self.state.fences = None, []
        events = [
            self._event(TimelineKind.BREAKER_RESET, now, actor=reset.actor, actor_kind="operator", detail=reset.reason)
        ]
        for lease in list(self._fence_held.values()):
            events += self._weigh_fence(lease, now)
        return events

    def compacted(self, now: datetime) -> BudgetState:
        """The state to continue as new with, without what has left its windows."""
        self.state.disruptions = self._disruptions_in_window(now)
        self.state.fences = self._fences_in_window(now)
        in_window = {node: self._incidents_in_window(node, now) for node in self.state.node_incidents}
        self.state.node_incidents = {node: marks for node, marks in in_window.items() if marks}
        self.state.continued_as_new += 1
        return self.state

    # --- inside -------------------------------------------------------------------------------

    def _active(self, incident_id: str) -> Lease | None:
        return self._active_by_incident.get(incident_id)

    def _blocker(self, req: LeaseRequest, now: datetime, jobs_held_back: bool) -> tuple[BlockedBy, str] | None:
        policy = self.policy
        held = len(self._holding)
        if held >= policy.max_nodes:
            return BlockedBy.MAX_NODES, f"{held} of {policy.max_nodes} nodes already under remediation"
        if self._disrupted_already(req):
            # Another node of the same jobs (nodes of one job fail together): holding this one back
            # spares no job and lets the requeued jobs start again on a failed node.
            return None
        if req.running_jobs:
            if jobs_held_back:
                return BlockedBy.DISRUPTED_JOBS, "behind an earlier request waiting for the disrupted-jobs budget"
            disrupted = self.disrupted_jobs(now)
            # An empty window lets any one request pass, or a node with more jobs than J could never be remediated.
            if disrupted and disrupted + req.running_jobs > policy.max_disrupted_jobs:
                return BlockedBy.DISRUPTED_JOBS, (
                    f"{disrupted} running jobs disrupted in the last {policy.disruption_window_seconds:.0f} s; "
                    f"{req.running_jobs} more would pass {policy.max_disrupted_jobs}"
                )
        for partition in req.partitions:
            share = policy.partition_share(partition.name, partition.size)
            busy = self._held_per_partition[partition.name]
            if busy >= share:
                return BlockedBy.PARTITION, (
                    f"partition {partition.name}: {busy} of its {share} node(s) "
                    f"under remediation (of {partition.size} nodes)"
                )
        return None

    def _ask_to_fence(self, lease: Lease | None, req: LeaseRequest, now: datetime) -> list[TimelineEvent]:
        if lease is not None:
            if lease.state.run_id != req.run_id:
                lease.request.run_id = lease.state.run_id = req.run_id
            return [self._permit_fence(lease, now, req.approval)] if req.approval and lease.state.fence_held else []
        lease = Lease(
            request=req,
            state=LeaseState(
                incident_id=req.incident_id,
                node=req.node,
                workflow_id=req.workflow_id,
                run_id=req.run_id,
                budget_workflow_id=self._budget_workflow_id,
                budget_epoch=self._budget_epoch,
                status=LeaseStatus.FENCE_HELD,
                version=0,
                requested_at=now,
                partitions=[p.name for p in req.partitions],
                quarantined=self.quarantined(req.node),
            ),
        )
        self.state.leases.append(lease)
        self._active_by_incident[req.incident_id] = self._fence_held[req.incident_id] = lease
        events = self._weigh_fence(lease, now)
        if req.approval is not None and lease.state.fence_held:
            events.append(self._permit_fence(lease, now, req.approval))
        return events

    def _weigh_fence(self, lease: Lease, now: datetime) -> list[TimelineEvent]:
        """Permit the held fence if the breaker allows it now; else hold it, tripping the breaker."""
        blocked = self._breaker_blocker(lease.request, now)
        if blocked is None:
            return [self._permit_fence(lease, now)]
        events = []
        if self.state.breaker is None:
            self.state.breaker = BreakerTrip(
                at=now, incident_id=lease.state.incident_id, node=lease.state.node, reason=blocked
            )
            events.append(self._event(TimelineKind.BREAKER_TRIPPED, now, lease, detail=blocked))
        lease.state.reason = (
            f"the fence circuit breaker is tripped ({self.state.breaker.reason}): nothing is "
            "drained until an operator runs `recovery reset-breaker`"
        )
        return events + [self._event(TimelineKind.FENCE_HELD, now, lease, detail=lease.state.reason)]

    def _breaker_blocker(self, req: LeaseRequest, now: datetime) -> str | None:
        """Why the breaker holds this fence, or None. A node fenced already in the window is not
        counted again (a second incident on it, or a retried drain)."""
        if self.state.breaker is not None:
            return self.state.breaker.reason
        marks = self._fences_in_window(now)
        if any(mark.node == req.node for mark in marks):
            return None
        window = f"{self.policy.breaker_window_seconds:.0f} s"
        for partition, limit in self.policy.fence_limits(req.partitions, req.fleet_nodes).items():
            fenced = len({m.node for m in marks if partition is None or partition in m.partitions})
            if fenced >= limit:
                scope = f"partition {partition}" if partition else "the fleet"
                return (
                    f"{fenced} nodes fenced in the last {window} reach {scope}'s limit of {limit}; "
                    f"{req.node} would pass it"
                )
        return None

    def _permit_fence(self, lease: Lease, now: datetime, approval: OperatorDecision | None = None) -> TimelineEvent:
        state = lease.state
        self._fence_held.pop(state.incident_id, None)
        state.status = LeaseStatus.FENCE_PERMITTED
        if approval is not None:
            state.granted_by = approval.actor
            state.reason = f"fence approved by {approval.actor} past the breaker: {approval.reason}"
        else:
            state.granted_by, state.reason = "policy", "within the fence circuit breaker's limits"
        if not any(mark.node == state.node for mark in self._fences_in_window(now)):
            self.state.fences = self._fences_in_window(now) + [
                FenceMark(node=state.node, incident_id=state.incident_id, at=now, partitions=state.partitions)
            ]
        return self._event(
            TimelineKind.FENCE_PERMITTED,
            now,
            lease,
            actor=state.granted_by,
            actor_kind="operator" if approval else "policy",
            detail=state.reason,
        )

    def _grant(self, lease: Lease, now: datetime, approval: OperatorDecision | None = None) -> TimelineEvent:
        state = lease.state
        shared = self._disrupted_already(lease.request)  # before it holds the lease itself
        if approval is not None:
            state.over_budget, state.granted_by = True, approval.actor
            state.reason = f"approved over budget by {approval.actor}: {approval.reason} (was waiting: {state.reason})"
        else:
            state.granted_by = "policy"
            state.reason = (
                "within budget: its jobs are under remediation already, on another of their nodes"
                if shared
                else "within budget"
            )
        state.status, state.granted_at, state.blocked_by = LeaseStatus.GRANTED, now, None
        del self._waiting[state.incident_id]
        self._holding[state.incident_id] = lease
        self._held_per_partition.update(set(state.partitions))
        self._held_jobs.update(set(lease.request.job_ids))
        if lease.request.running_jobs and not shared:
            self.state.disruptions = self._disruptions_in_window(now) + [
                Disruption(incident_id=state.incident_id, at=now, jobs=lease.request.running_jobs)
            ]
        return self._event(
            TimelineKind.GRANTED,
            now,
            lease,
            actor=state.granted_by,
            actor_kind="operator" if approval else "policy",
            detail=state.reason,
        )

    def _end(
        self, lease: Lease, status: LeaseStatus, kind: TimelineKind, reason: str, now: datetime
    ) -> list[TimelineEvent]:
        # By identity: list.remove() compares with ==, a deep comparison of pydantic models (with
        # the sandbox's isinstance on every field) against each lease before it. With 1,000 leases
        # a budget's workflow task of releases passed the SDK's 2 s deadlock limit, and its
        # replays after that outlasted the 10 s task timeout, over and over (python -m bench scale).
        self.state.leases = [held for held in self.state.leases if held is not lease]
        state = lease.state
        del self._active_by_incident[state.incident_id]
        self._waiting.pop(state.incident_id, None)
        self._fence_held.pop(state.incident_id, None)
        if self._holding.pop(state.incident_id, None) is not None:
            self._held_per_partition.subtract(set(state.partitions))
            self._held_jobs.subtract(set(lease.request.job_ids))
        state.status, state.ended_at, state.reason, state.blocked_by = status, now, reason, None
        self.state.finished.append(state)
        del self.state.finished[:-FINISHED_KEPT]
        return [self._event(kind, now, lease, detail=reason)]

    def _disrupted_already(self, req: LeaseRequest) -> bool:
        """Every job the request would disrupt is under the remediation of a lease held already."""
        if not req.job_ids or len(req.job_ids) < req.running_jobs:
            return False
        return all(self._held_jobs[job] for job in req.job_ids)

    # Readers never prune the state (queries call them); the deciding methods store what they keep.

    def _disruptions_in_window(self, now: datetime) -> list[Disruption]:
        window_start = now - timedelta(seconds=self.policy.disruption_window_seconds)
        return [d for d in self.state.disruptions if d.at > window_start]

    def _fences_in_window(self, now: datetime) -> list[FenceMark]:
        window_start = now - timedelta(seconds=self.policy.breaker_window_seconds)
        return [mark for mark in self.state.fences if mark.at > window_start]

    def _incidents_in_window(self, node: str, now: datetime) -> list[IncidentMark]:
        window_start = now - timedelta(seconds=self.policy.lemon_window_seconds)
        return [m for m in self.state.node_incidents.get(node, []) if m.at > window_start]

    def _count_incident(self, node: str, incident_id: str, now: datetime) -> list[TimelineEvent]:
        marks = self._incidents_in_window(node, now)
        if any(m.incident_id == incident_id for m in marks):
            return []
        marks.append(IncidentMark(incident_id=incident_id, at=now))
        self.state.node_incidents[node] = marks
        if len(marks) < self.policy.lemon_incidents or self.quarantined(node):
            return []
        self.state.quarantines[node] = Quarantine(node=node, since=now, incidents=list(marks))
        self._flag_quarantine(node, True)
        return [
            self._event(
                TimelineKind.QUARANTINED,
                now,
                node=node,
                incident_id=incident_id,
                detail=(
                    f"{len(marks)} incidents in {self.policy.lemon_window_seconds:.0f} s: "
                    + ", ".join(m.incident_id for m in marks)
                ),
            )
        ]

    def _flag_quarantine(self, node: str, quarantined: bool) -> None:
        for lease in self.state.leases:
            if lease.state.node == node:
                lease.state.quarantined = quarantined

    def _event(
        self,
        kind: TimelineKind,
        now: datetime,
        lease: Lease | None = None,
        *,
        node: str | None = None,
        incident_id: str | None = None,
        actor: str = "policy",
        actor_kind: ActorKind = "policy",
        detail: str = "",
    ) -> TimelineEvent:
        self.state.seq += 1
        if lease is not None:
            lease.state.version = self.state.seq
            node, incident_id = lease.state.node, lease.state.incident_id
        event = TimelineEvent(
            seq=self.state.seq,
            at=now,
            kind=kind,
            incident_id=incident_id,
            node=node,
            holders=len(self._holding),
            actor=actor,
            actor_kind=actor_kind,
            detail=detail,
        )
        self.state.timeline.append(event)
        del self.state.timeline[: -self.policy.timeline_limit]
        return event
