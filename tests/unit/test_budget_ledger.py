"""The fleet budget's arithmetic (workflows/budget_ledger.py), with an explicit clock: admission
by nodes, partition share and disrupted jobs, first come first served, idempotent requests,
expiry and reclaiming, lemon detection and its release, the bounded timeline."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from contracts.budget import (
    BlockedBy,
    BudgetPolicy,
    BudgetState,
    HolderRef,
    LeaseRequest,
    LeaseStatus,
    PartitionShare,
    QuarantineRelease,
    TimelineKind,
)
from contracts.models import OperatorDecision
from workflows.budget_ledger import BudgetLedger

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
DAY = timedelta(days=1)
# Two runs of one incident workflow (Temporal run ids are UUIDs).
RUN_1, RUN_2 = "01a235d6-a272-7148-8dcd-44cdcaff4c45", "01a235d6-a272-7148-8dcd-44cdcaff4c46"


def ledger(**policy) -> BudgetLedger:
    return BudgetLedger(BudgetState(policy=BudgetPolicy(**policy)), "fleet-budget-test", "first-run")


def request(
    n: int,
    node: str | None = None,
    jobs: int = 0,
    partitions: dict[str, int] | None = None,
    incident: str | None = None,
    run_id: str = RUN_1,
    job_ids: list[int] | None = None,
) -> LeaseRequest:
    """`jobs` of the node's own (ids 100 n, 100 n + 1, ...), or the jobs `job_ids`."""
    node = node or f"gpu-{n}"
    job_ids = job_ids if job_ids is not None else [100 * n + job for job in range(jobs)]
    return LeaseRequest(
        incident_id=incident or f"{node}-incident-{n}",
        node=node,
        workflow_id=f"node-recovery-{node}",
        run_id=run_id,
        partitions=[PartitionShare(name=p, size=s) for p, s in (partitions or {}).items()],
        running_jobs=len(job_ids),
        job_ids=job_ids,
    )


def ask(book: BudgetLedger, req: LeaseRequest, at: datetime = T0):
    book.request(req, at)
    return book.lease_state(req.incident_id)


def kinds(book: BudgetLedger) -> list[str]:
    return [e.kind.value for e in book.state.timeline]


def test_at_most_max_nodes_at_once_then_first_come_first_served():
    book = ledger(max_nodes=2)
    states = [ask(book, request(n)) for n in range(4)]
    assert [s.status for s in states] == ["granted", "granted", "waiting", "waiting"]
    assert states[2].blocked_by == BlockedBy.MAX_NODES
    assert states[2].reason == "2 of 2 nodes already under remediation"
    events = book.release(states[0].incident_id, "done", T0 + timedelta(minutes=5))
    assert [(e.kind, e.incident_id) for e in events] == [
        (TimelineKind.RELEASED, states[0].incident_id),
        (TimelineKind.GRANTED, states[2].incident_id),
    ]
    assert book.lease_state(states[3].incident_id).waiting


@pytest.mark.parametrize(
    "fraction, size, share",
    [
        (0.1, 10, 1),
        (0.1, 19, 1),
        (0.1, 20, 2),
        (0.29, 100, 29),
        (0.25, 8, 2),
        (0.1, 5, 1),  # 0.5 rounds down to 0: still one node, or the partition could never be remediated
        (1.0, 3, 3),
    ],
)
def test_partition_share_is_the_floor_of_the_fraction_and_at_least_one(fraction, size, share):
    assert BudgetPolicy(partition_fraction=fraction).partition_share("gpu", size) == share


def test_a_full_partition_holds_back_only_its_own_nodes():
    book = ledger(max_nodes=10, partition_fraction=0.25, partition_fractions={"debug": 0.5})
    first, second = ask(book, request(1, partitions={"gpu": 8})), ask(book, request(2, partitions={"gpu": 8}))
    third = ask(book, request(3, partitions={"gpu": 8, "all": 40}))
    other = ask(book, request(4, partitions={"debug": 4}))
    assert (first.granted, second.granted, third.waiting, other.granted) == (True, True, True, True)
    assert third.blocked_by == BlockedBy.PARTITION
    assert third.reason == "partition gpu: 2 of its 2 node(s) under remediation (of 8 nodes)"
    assert ask(book, request(5, partitions={"debug": 4})).granted  # 0.5 of 4: its own fraction
    assert ask(book, request(6, partitions={"debug": 4})).waiting
    book.release(first.incident_id, "done", T0)
    assert book.lease_state(third.incident_id).granted


def test_disrupted_jobs_per_window_then_granted_once_the_window_passes():
    book = ledger(max_nodes=10, max_disrupted_jobs=5, disruption_window_seconds=3600)
    first = ask(book, request(1, jobs=3))
    second = ask(book, request(2, jobs=3), T0 + timedelta(minutes=1))
    no_jobs = ask(book, request(3, jobs=0), T0 + timedelta(minutes=2))
    assert (first.granted, second.waiting, no_jobs.granted) == (True, True, True)
    assert second.blocked_by == BlockedBy.DISRUPTED_JOBS
    assert second.reason == "3 running jobs disrupted in the last 3600 s; 3 more would pass 5"
    book.release(first.incident_id, "done", T0 + timedelta(minutes=10))
    assert book.lease_state(second.incident_id).waiting  # returning the lease does not undo the disruption
    assert book.next_deadline(T0 + timedelta(minutes=10)) == T0 + timedelta(hours=1)
    book.expire_overdue(T0 + timedelta(hours=1))
    assert book.lease_state(second.incident_id).granted
    assert book.disrupted_jobs(T0 + timedelta(hours=1)) == 3


def test_one_node_with_more_jobs_than_the_budget_passes_when_the_window_is_empty():
    book = ledger(max_disrupted_jobs=5)
    assert ask(book, request(1, jobs=12)).granted
    assert ask(book, request(2, jobs=1)).waiting


def test_a_request_waiting_for_jobs_budget_is_not_overtaken_by_smaller_ones():
    book = ledger(max_nodes=10, max_disrupted_jobs=5)
    ask(book, request(1, jobs=4))
    big = ask(book, request(2, jobs=3))
    small = ask(book, request(3, jobs=1))  # would fit (4 + 1 <= 5), but arrived after `big`
    assert big.waiting and small.waiting
    assert small.reason == "behind an earlier request waiting for the disrupted-jobs budget"
    assert ask(book, request(4, jobs=0)).granted  # needs none of the jobs budget


def test_another_node_of_jobs_under_remediation_passes_the_partition_and_jobs_budgets_not_max_nodes():
    """Nodes of one job fail together (issue #29): holding the second back spares no job, and the
    job requeued off the first would start again on it."""
    book = ledger(max_nodes=3, partition_fraction=0.1, max_disrupted_jobs=1)
    gpu = {"gpu": 4}  # a share of one node
    first = ask(book, request(1, partitions=gpu, job_ids=[7]))
    second = ask(book, request(2, partitions=gpu, job_ids=[7]))
    assert first.granted and second.granted, second
    assert second.reason == "within budget: its jobs are under remediation already, on another of their nodes"
    assert book.disrupted_jobs(T0) == 1  # job 7, once
    # A node with a job of its own besides is another disruption: held back as any other.
    mixed = ask(book, request(3, partitions=gpu, job_ids=[7, 8]))
    assert mixed.waiting and mixed.blocked_by == BlockedBy.DISRUPTED_JOBS, mixed
    assert ask(book, request(4, partitions=gpu, job_ids=[7])).granted  # not behind `mixed`: it adds nothing
    # The node cap holds for all.
    fifth = ask(book, request(5, partitions=gpu, job_ids=[7]))
    assert fifth.waiting and fifth.blocked_by == BlockedBy.MAX_NODES, fifth
    for done in (first, second):
        book.release(done.incident_id, "done", T0)
    assert book.lease_state(fifth.incident_id).granted  # the fourth still holds job 7
    assert book.lease_state(mixed.incident_id).waiting
    # Once no lease holds job 7, its next node is a disruption like any other.
    for done in ("gpu-4-incident-4", fifth.incident_id):
        book.release(done, "done", T0)
    later = ask(book, request(6, partitions=gpu, job_ids=[7]))
    assert later.waiting and later.blocked_by == BlockedBy.DISRUPTED_JOBS, later


def test_a_repeated_request_gets_the_same_lease_never_a_second():
    book = ledger(max_nodes=1)
    first = ask(book, request(1))
    again = ask(book, request(1))
    assert again == first
    assert kinds(book) == ["granted"]
    assert book.lease_state(ask(book, request(2)).incident_id).waiting
    book.release(first.incident_id, "done", T0)
    late_duplicate = ask(book, request(1))  # an attempt that arrives after the lease was returned
    assert late_duplicate.status == LeaseStatus.RELEASED
    assert [lease.state.incident_id for lease in book.holders()] == ["gpu-2-incident-2"]


def test_a_reset_incident_keeps_its_lease_under_its_new_run():
    book = ledger()
    ask(book, request(1, run_id=RUN_1))
    assert ask(book, request(1, run_id=RUN_2)).run_id == RUN_2
    book.drop_closed([HolderRef(incident_id="gpu-1-incident-1", workflow_id="node-recovery-gpu-1", run_id=RUN_1)], T0)
    assert book.lease_state("gpu-1-incident-1").granted  # the old run's closing does not take it


def test_release_is_idempotent_and_withdraws_a_waiting_request():
    book = ledger(max_nodes=1)
    holder, waiter = ask(book, request(1)), ask(book, request(2))
    book.release(waiter.incident_id, "aborted by operator", T0)
    assert book.release(waiter.incident_id, "again", T0) == []
    book.release(holder.incident_id, "done", T0)
    assert book.holders() == [] and book.waiting() == []
    assert kinds(book) == ["granted", "queued", "withdrawn", "released"]


def test_operator_approval_grants_over_budget_and_says_whose_it_is():
    book = ledger(max_nodes=1)
    ask(book, request(1))
    waiting_reason = ask(book, request(2)).reason
    approved = request(2).model_copy(update={"approval": OperatorDecision(actor="alice", reason="training deadline")})
    state = ask(book, approved)
    assert (state.granted, state.over_budget, state.granted_by) == (True, True, "alice")
    assert state.reason == f"approved over budget by alice: training deadline (was waiting: {waiting_reason})"
    granted = book.state.timeline[-1]
    assert (granted.kind, granted.actor, granted.actor_kind, granted.holders) == (
        TimelineKind.GRANTED,
        "alice",
        "operator",
        2,
    )


def test_a_lease_held_too_long_expires_and_the_next_is_granted():
    book = ledger(max_nodes=1, lease_max_seconds=600)
    stuck, next_one = ask(book, request(1)), ask(book, request(2))
    assert book.next_deadline(T0) == T0 + timedelta(seconds=600)
    assert book.expire_overdue(T0 + timedelta(seconds=599)) == []
    events = book.expire_overdue(T0 + timedelta(seconds=600))
    assert [e.kind for e in events] == [TimelineKind.EXPIRED, TimelineKind.GRANTED]
    assert book.lease_state(stuck.incident_id).status == LeaseStatus.EXPIRED
    assert book.lease_state(next_one.incident_id).granted


def test_closed_holders_lose_their_lease_and_closed_waiters_their_place():
    book = ledger(max_nodes=1)
    holder, waiter, other = ask(book, request(1)), ask(book, request(2)), ask(book, request(3))
    refs = {r.incident_id: r for r in book.holder_refs()}
    book.drop_closed([refs[holder.incident_id], refs[waiter.incident_id]], T0)
    assert book.lease_state(holder.incident_id).status == LeaseStatus.EXPIRED
    assert book.lease_state(waiter.incident_id).status == LeaseStatus.RELEASED
    assert book.lease_state(other.incident_id).granted
    assert kinds(book)[-3:] == ["reclaimed", "withdrawn", "granted"]


def test_three_incidents_in_the_window_make_a_lemon_until_an_operator_releases_it():
    book = ledger(lemon_incidents=3, lemon_window_seconds=7 * 86400)
    for n, day in enumerate((0, 2, 5)):
        state = ask(book, request(n, node="gpu-7"), T0 + day * DAY)
        book.release(state.incident_id, "recovered", T0 + day * DAY)
    assert state.quarantined
    status = book.quarantine_status("gpu-7", T0 + 30 * DAY)
    assert status.quarantined and status.since == T0 + 5 * DAY  # a month later: still, until released
    release = QuarantineRelease(node="gpu-7", actor="bob", reason="GPU board replaced")
    [event] = book.release_quarantine(release, T0 + 31 * DAY)
    assert (event.kind, event.actor, event.actor_kind, event.detail) == (
        TimelineKind.QUARANTINE_RELEASED,
        "bob",
        "operator",
        "GPU board replaced",
    )
    status = book.quarantine_status("gpu-7", T0 + 31 * DAY)
    assert not status.quarantined and status.incidents_in_window == []
    assert (status.last_release.released_by, status.last_release.release_reason) == ("bob", "GPU board replaced")
    assert not ask(book, request(9, node="gpu-7"), T0 + 32 * DAY).quarantined  # counting starts again
    with pytest.raises(ValueError, match="not quarantined"):
        book.release_quarantine(release, T0 + 32 * DAY)


def test_incidents_spread_beyond_the_window_do_not_make_a_lemon():
    book = ledger(lemon_incidents=3, lemon_window_seconds=7 * 86400)
    for n, day in enumerate((0, 4, 8)):
        state = ask(book, request(n, node="gpu-7"), T0 + day * DAY)
        book.release(state.incident_id, "recovered", T0 + day * DAY)
    assert not state.quarantined
    assert [m.incident_id for m in book.quarantine_status("gpu-7", T0 + 8 * DAY).incidents_in_window] == [
        "gpu-7-incident-1",
        "gpu-7-incident-2",
    ]


def test_timeline_is_bounded_and_counts_holders_after_each_event():
    book = ledger(max_nodes=3, timeline_limit=10)
    for n in range(8):
        state = ask(book, request(n))
        book.release(state.incident_id, "done", T0)
    assert len(book.state.timeline) == 10
    assert book.state.timeline[-1].seq == 16
    assert [e.holders for e in book.state.timeline[-2:]] == [1, 0]


def test_compacting_for_continue_as_new_drops_what_left_its_windows():
    book = ledger(max_disrupted_jobs=50, disruption_window_seconds=3600, lemon_window_seconds=86400)
    ask(book, request(1, jobs=2))
    ask(book, request(2, jobs=2), T0 + 2 * DAY)
    state = book.compacted(T0 + 2 * DAY)
    assert [d.incident_id for d in state.disruptions] == ["gpu-2-incident-2"]
    assert list(state.node_incidents) == ["gpu-2"]
    assert state.continued_as_new == 1


def test_policy_change_is_recorded_and_may_admit_waiters():
    book = ledger(max_nodes=1)
    ask(book, request(1))
    waiter = ask(book, request(2))
    events = book.set_policy(BudgetPolicy(max_nodes=2), T0)
    assert [e.kind for e in events] == [TimelineKind.POLICY_CHANGED, TimelineKind.GRANTED]
    assert events[0].actor_kind == "operator"
    assert book.lease_state(waiter.incident_id).granted
    assert book.set_policy(BudgetPolicy(max_nodes=2), T0) == []


@pytest.mark.parametrize("seed", range(5))
def test_a_ledger_continued_from_its_state_decides_as_the_live_one(seed):
    """The ledger counts its leases (by incident, waiting, holding, per partition) instead of
    scanning them for each request; a ledger built from the same state, as the budget is after
    continue-as-new, must decide every next step exactly as the live one."""
    rng = random.Random(seed)
    policy = dict(
        max_nodes=6,
        max_disrupted_jobs=8,
        partition_fractions={"a": 0.5},
        lease_max_seconds=3600,
        disruption_window_seconds=1800,
    )
    live = ledger(**policy)
    now, asked = T0, []
    for step in range(300):
        now += timedelta(seconds=rng.choice([1, 30, 300]))
        continued = BudgetLedger(live.state.model_copy(deep=True), "fleet-budget-test", "first-run")
        choice = rng.random()
        if choice < 0.5 or not asked:
            req = request(
                step,
                node=f"gpu-{rng.randrange(12)}",
                job_ids=rng.choice([[], [1], [2], [1, 2], [step]]),
                partitions=rng.choice([{}, {"a": 4}, {"b": 8}, {"a": 4, "b": 8}]),
            )
            asked.append(req)
            act = lambda book: book.request(req, now)  # noqa: E731, B023 (called in this iteration)
        elif choice < 0.65:
            again = rng.choice(asked)  # a repeated request, or one with an operator's approval
            if rng.random() < 0.3:
                again = again.model_copy(update={"approval": OperatorDecision(actor="dana", reason="urgent")})
            act = lambda book: book.request(again, now)  # noqa: E731, B023 (called in this iteration)
        elif choice < 0.9:
            gone = rng.choice(asked).incident_id
            act = lambda book: book.release(gone, "done", now)  # noqa: E731, B023 (called in this iteration)
        else:
            act = lambda book: book.expire_overdue(now)  # noqa: E731, B023 (called in this iteration)
        assert act(continued) == act(live), step
        assert continued.state == live.state, step
        assert continued.next_deadline(now) == live.next_deadline(now), step
        assert continued.status(now) == live.status(now), step
    assert live.holders() and live.state.finished  # the sequence reached both
