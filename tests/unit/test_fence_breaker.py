"""The fence circuit breaker's arithmetic (workflows/budget_ledger.py), with an explicit clock: at most
N distinct nodes fenced per sliding window, as an absolute cap and as fractions of the fleet and of
each partition; past it every fence is held until an operator resets the breaker; a reset weighs the
held fences again; an operator may approve one node past it; held and permitted fences go on to the
remediation lease."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from contracts.budget import (
    BreakerReset,
    BudgetPolicy,
    BudgetState,
    LeaseRequest,
    LeaseStage,
    LeaseStatus,
    PartitionShare,
    TimelineKind,
)
from contracts.models import OperatorDecision
from workflows.budget_ledger import BudgetLedger

T0 = datetime(2026, 12, 3, tzinfo=timezone.utc)
RUN = "01a235d6-a272-7148-8dcd-44cdcaff4c45"
RESET = BreakerReset(actor="alice", reason="the health check was misconfigured; fixed")


def ledger(**policy) -> BudgetLedger:
    return BudgetLedger(BudgetState(policy=BudgetPolicy(**policy)), "fleet-budget-test", "first-run")


def fence(
    n: int,
    node: str | None = None,
    fleet: int = 1000,
    partitions: dict[str, int] | None = None,
    stage: LeaseStage = LeaseStage.FENCE,
    approval: OperatorDecision | None = None,
) -> LeaseRequest:
    node = node or f"gpu-{n}"
    return LeaseRequest(
        incident_id=f"{node}-incident-{n}",
        node=node,
        workflow_id=f"node-recovery-{node}",
        run_id=RUN,
        running_jobs=0,
        stage=stage,
        fleet_nodes=fleet,
        approval=approval,
        partitions=[PartitionShare(name=p, size=s) for p, s in (partitions or {}).items()],
    )


def statuses(book: BudgetLedger, requests: list[LeaseRequest], at: datetime = T0) -> list[str]:
    for req in requests:
        book.request(req, at)
    return [book.lease_state(req.incident_id).status.value for req in requests]


def test_a_storm_of_100_with_a_breaker_of_10_fences_exactly_10_and_trips_once():
    book = ledger(breaker_max_fences=10)
    got = statuses(book, [fence(n) for n in range(100)])
    assert got == ["fence_permitted"] * 10 + ["fence_held"] * 90
    tripped = [e for e in book.state.timeline if e.kind == TimelineKind.BREAKER_TRIPPED]
    assert len(tripped) == 1 and tripped[0].node == "gpu-10"
    assert "10 nodes fenced in the last 300 s reach the fleet's limit of 10" in tripped[0].detail
    status = book.status(T0)
    assert status.breaker is not None and len(status.fence_held) == 90 and len(status.fenced_in_window) == 10
    assert "recovery reset-breaker" in book.lease_state("gpu-50-incident-50").reason


@pytest.mark.parametrize(
    "policy, fleet, partitions, permitted",
    [
        (dict(breaker_max_fences=100, breaker_fleet_fraction=0.5), 6, {}, 3),  # half of a 6-node fleet
        (dict(breaker_max_fences=100, breaker_fleet_fraction=0.1), 5, {}, 1),  # floor 0.5 -> still 1
        (dict(breaker_max_fences=2, breaker_fleet_fraction=1.0), 6, {}, 2),  # the absolute cap is smaller
        (dict(breaker_max_fences=100, breaker_partition_fraction=0.25), 1000, {"gpu": 8}, 2),
        (dict(breaker_max_fences=100, breaker_fleet_fraction=0.5), 0, {}, 100),  # fleet size unknown: the cap
    ],
)
def test_the_smallest_limit_trips_it(policy, fleet, partitions, permitted):
    book = ledger(**policy)
    got = statuses(book, [fence(n, fleet=fleet, partitions=partitions) for n in range(permitted + 1)])
    assert got == ["fence_permitted"] * permitted + ["fence_held"]


def test_a_partition_limit_holds_every_fence_once_tripped_even_in_other_partitions():
    """Tripped means tripped: a breaker that let other partitions on would let a fleet-wide storm
    drain every partition up to its limit."""
    book = ledger(breaker_max_fences=100, breaker_partition_fraction=0.5)
    got = statuses(book, [fence(1, partitions={"a": 2}), fence(2, partitions={"a": 2}), fence(3, partitions={"b": 4})])
    assert got == ["fence_permitted", "fence_held", "fence_held"]


def test_a_node_fenced_in_the_window_is_not_counted_again():
    book = ledger(breaker_max_fences=2)
    assert statuses(book, [fence(1), fence(2), fence(3, node="gpu-1"), fence(4)]) == [
        "fence_permitted",
        "fence_permitted",
        "fence_permitted",
        "fence_held",
    ]


def test_fences_leave_the_window_but_a_tripped_breaker_stays_until_reset():
    book = ledger(breaker_max_fences=1, breaker_window_seconds=300)
    assert statuses(book, [fence(1), fence(2)]) == ["fence_permitted", "fence_held"]
    later = T0 + timedelta(hours=5)
    assert statuses(book, [fence(3)], at=later) == ["fence_held"]
    closed = ledger(breaker_max_fences=1, breaker_window_seconds=300)
    assert statuses(closed, [fence(1)]) + statuses(closed, [fence(2)], at=T0 + timedelta(seconds=301)) == [
        "fence_permitted",
        "fence_permitted",
    ]


def test_a_reset_starts_the_count_again_and_weighs_the_held_in_arrival_order():
    book = ledger(breaker_max_fences=2)
    statuses(book, [fence(n) for n in range(6)])
    events = book.reset_breaker(RESET, T0 + timedelta(minutes=1))
    assert [(e.kind.value, e.node) for e in events] == [
        ("breaker_reset", None),
        ("fence_permitted", "gpu-2"),
        ("fence_permitted", "gpu-3"),
        ("breaker_tripped", "gpu-4"),
        ("fence_held", "gpu-4"),
        ("fence_held", "gpu-5"),
    ]
    assert events[0].actor == "alice" and events[0].actor_kind == "operator"
    with pytest.raises(ValueError, match="not tripped"):
        ledger().reset_breaker(RESET, T0)


def test_an_operator_approves_one_node_past_the_tripped_breaker():
    book = ledger(breaker_max_fences=1)
    statuses(book, [fence(1), fence(2)])
    approval = OperatorDecision(actor="bob", reason="ticket 7: the GPU is really gone")
    events = book.request(fence(2, approval=approval), T0)
    state = book.lease_state("gpu-2-incident-2")
    assert state.status == LeaseStatus.FENCE_PERMITTED and state.granted_by == "bob"
    assert [e.kind for e in events] == [TimelineKind.FENCE_PERMITTED] and events[0].actor_kind == "operator"
    assert book.status(T0).breaker is not None  # approving one node does not close the breaker


def test_a_repeated_fence_request_changes_nothing():
    book = ledger(breaker_max_fences=1)
    statuses(book, [fence(1), fence(2)])
    assert book.request(fence(1), T0) == [] and book.request(fence(2), T0) == []


def test_a_permitted_fence_goes_on_to_the_remediation_lease_and_ends_with_it():
    book = ledger(breaker_max_fences=5, max_nodes=1)
    statuses(book, [fence(1), fence(2)])
    remediate = [fence(1, stage=LeaseStage.REMEDIATE), fence(2, stage=LeaseStage.REMEDIATE)]
    assert statuses(book, remediate) == ["granted", "waiting"]
    assert [lease.incident_id for lease in book.status(T0).holders] == ["gpu-1-incident-1"]
    book.release("gpu-1-incident-1", "done", T0)
    assert book.lease_state("gpu-1-incident-1").status == LeaseStatus.RELEASED
    assert book.lease_state("gpu-2-incident-2").granted


def test_a_held_incident_that_ends_withdraws_its_fence_and_a_reset_skips_it():
    book = ledger(breaker_max_fences=1)
    statuses(book, [fence(1), fence(2), fence(3)])
    book.release("gpu-2-incident-2", "held: gave up", T0)
    assert book.lease_state("gpu-2-incident-2").status == LeaseStatus.RELEASED
    events = book.reset_breaker(RESET, T0)
    assert [(e.kind.value, e.node) for e in events] == [("breaker_reset", None), ("fence_permitted", "gpu-3")]


def test_the_breaker_survives_continue_as_new():
    book = ledger(breaker_max_fences=2)
    statuses(book, [fence(n) for n in range(3)])
    carried = BudgetLedger(
        BudgetState.model_validate_json(book.compacted(T0).model_dump_json()), "fleet-budget-test", "first-run"
    )
    assert carried.status(T0).breaker is not None and len(carried.status(T0).fence_held) == 1
    assert statuses(carried, [fence(9)]) == ["fence_held"]
    assert [e.node for e in carried.reset_breaker(RESET, T0) if e.kind == TimelineKind.FENCE_PERMITTED] == [
        "gpu-2",
        "gpu-9",
    ]
