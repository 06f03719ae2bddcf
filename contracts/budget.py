"""Contracts of the fleet-wide safety pieces (issue #5): the disruption budget and its leases, lemon
quarantine, and notifications. Every value that crosses the FleetBudgetWorkflow's boundary (its
input, signals, updates, queries) or a notification's is one of these; so is the webhook's
configuration (WebhookTarget).

docs/safety.md explains the design; workflows/budget_ledger.py holds the arithmetic.
"""

from __future__ import annotations

import math
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, model_validator

from contracts.audit import ActorKind
from contracts.models import Actor, Contract, NodeName, OperatorDecision, OperatorSignature
from contracts.redaction import fingerprinted_url

IncidentId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\n\r]+$")]
# A Temporal run id: a UUID, as the server writes it.
RUN_ID_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"
PartitionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
Fraction = Annotated[float, Field(gt=0, le=1)]


# --- the budget's policy ---------------------------------------------------------------------


class PartitionShare(Contract):
    """A Slurm partition the failed node belongs to, and its size when the incident asked."""

    name: PartitionName
    size: int = Field(ge=1, description="nodes in the partition")


class BudgetPolicy(Contract):
    """How much of the fleet may be under remediation at once; set from configuration.

    A partition's share is floor(fraction * size) nodes, and at least 1: flooring never lets
    more than the fraction go, and the minimum of 1 keeps a small partition (fewer nodes than
    1/fraction) from never being able to remediate a failed node without an operator.
    """

    max_nodes: int = Field(5, ge=1, description="K: nodes under remediation at once, fleet-wide")
    partition_fraction: Fraction = Field(0.1, description="of each partition's nodes, unless overridden")
    partition_fractions: dict[PartitionName, Fraction] = Field(
        default_factory=dict, description="per-partition overrides of partition_fraction"
    )
    max_disrupted_jobs: int = Field(20, ge=1, description="J: running jobs disrupted per window")
    disruption_window_seconds: float = Field(3600.0, gt=0)
    lemon_incidents: int = Field(3, ge=2, description="N: incidents in the lemon window make a node a lemon")
    lemon_window_seconds: float = Field(7 * 24 * 3600.0, gt=0)
    lease_max_seconds: float = Field(
        6 * 3600.0,
        gt=0,
        description="a lease held longer is reclaimed (a stuck incident); longer than the "
        "longest incident: degrading grace + spare wait + verify deadline per job",
    )
    holder_check_seconds: float = Field(
        60.0, gt=0, description="how often the budget asks Temporal whether holders and waiters still run"
    )
    timeline_limit: int = Field(1000, ge=10, description="timeline events kept (the oldest are dropped)")
    history_limit: int = Field(10_000, ge=50, description="history events after which the budget continues as new")
    notifications: bool = Field(
        False, description="send a notification when a node is quarantined or the fence circuit breaker trips"
    )
    # The fence circuit breaker (docs/safety.md): nodes fenced in a sliding window, before any drain.
    # NVSentinel's breaker trips at a fraction of the cluster cordoned in a window (50 % in 5 minutes
    # by default) and stays tripped until a person resets it; its users asked for an absolute cap too.
    breaker_max_fences: int = Field(10, ge=1, description="nodes fenced per breaker window, fleet-wide")
    breaker_fleet_fraction: Fraction = Field(0.5, description="of the cluster's nodes fenced per window")
    breaker_partition_fraction: Fraction = Field(0.5, description="of each partition's nodes fenced per window")
    breaker_window_seconds: float = Field(300.0, gt=0, description="the breaker's sliding window")

    def partition_share(self, partition: str, size: int) -> int:
        """Nodes of the partition that may be under remediation at once."""
        return _fraction_of(self.partition_fractions.get(partition, self.partition_fraction), size)

    def fence_limits(self, partitions: list[PartitionShare], fleet_nodes: int) -> dict[str | None, int]:
        """Nodes that may be fenced per breaker window, each at least 1: fleet-wide (key None: the
        absolute cap, and the fraction of the cluster when its size is known) and per partition."""
        fleet = self.breaker_max_fences
        if fleet_nodes:
            fleet = min(fleet, _fraction_of(self.breaker_fleet_fraction, fleet_nodes))
        return {None: fleet} | {p.name: _fraction_of(self.breaker_partition_fraction, p.size) for p in partitions}


def _fraction_of(fraction: float, size: int) -> int:
    return max(1, math.floor(Decimal(str(fraction)) * size))


def partition_fractions_from(text: str) -> dict[str, float]:
    """`gpu=0.2,debug=0.5` (the form of RECOVERY_BUDGET_PARTITION_FRACTIONS) as a dict; an empty
    text gives none. BudgetPolicy validates the names and fractions."""
    fractions = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            fractions[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"partition fraction {item!r}: use NAME=FRACTION, e.g. gpu=0.2") from None
    return fractions


# --- leases -----------------------------------------------------------------------------------


class FenceScope(Contract):
    """What the fence circuit breaker weighs a node against: its partitions and the cluster's size."""

    partitions: list[PartitionShare]
    fleet_nodes: int = Field(ge=1, description="nodes in the cluster")


class LeaseStage(StrEnum):
    FENCE = "fence"  # before the drain: the fence circuit breaker
    REMEDIATE = "remediate"  # before the first destructive step: the disruption budget


class LeaseRequest(Contract):
    """An incident asks to fence its node (stage fence, before the drain) and then to put it
    under remediation (stage remediate, before its first destructive step).

    Keyed by incident_id: a repeated request (an activity retried after a crash) gets the same
    lease back, never a second one.
    """

    incident_id: IncidentId
    node: NodeName
    workflow_id: str = Field(min_length=1, description="the incident's workflow: where grants are signalled")
    # Checked here: the budget signals this run, and Temporal refuses a malformed run id in a way
    # that fails every workflow task of the budget after (BadSignalWorkflowExecutionAttributes).
    run_id: str = Field(pattern=RUN_ID_PATTERN, description="its run (a UUID): a closed run loses its lease")
    partitions: list[PartitionShare] = Field(default_factory=list)
    running_jobs: int = Field(ge=0, description="jobs the remediation will disrupt")
    job_ids: list[int] = Field(
        default_factory=list,
        max_length=1000,
        description="those jobs' ids: a node whose jobs a held lease disrupts already disrupts nothing more",
    )
    approval: OperatorDecision | None = Field(
        None,
        description="an operator's approval to go over budget, or past a tripped breaker "
        "(granted at once, recorded as theirs)",
    )
    stage: LeaseStage = LeaseStage.REMEDIATE
    fleet_nodes: int = Field(0, ge=0, description="nodes in the cluster, for the breaker (0: not known)")


class LeaseStatus(StrEnum):
    FENCE_HELD = "fence_held"  # the fence circuit breaker is tripped: recorded, nothing drained
    FENCE_PERMITTED = "fence_permitted"  # may drain; asks for the remediation lease next
    WAITING = "waiting"  # over budget: fenced, nothing killed, until the budget frees or an operator approves
    GRANTED = "granted"
    RELEASED = "released"  # returned by its incident (or withdrawn while waiting)
    EXPIRED = "expired"  # reclaimed by the budget: held too long, or its incident closed without returning it


class BlockedBy(StrEnum):
    MAX_NODES = "max_nodes"
    PARTITION = "partition"
    DISRUPTED_JOBS = "disrupted_jobs"


class LeaseState(Contract):
    """Where an incident's lease stands; the budget's answer to a request, and what it signals
    to the incident when the lease changes later (granted after waiting, expired)."""

    incident_id: IncidentId
    node: NodeName
    workflow_id: str
    run_id: str
    budget_workflow_id: str = Field(description="the budget that holds the lease: where to return it")
    budget_epoch: str = Field(
        description="the budget's first run: a budget started anew (the previous one "
        "was terminated) counts versions from the start again"
    )
    status: LeaseStatus
    version: int = Field(description="grows with every change within an epoch: the newest state wins")
    requested_at: datetime
    granted_at: datetime | None = None
    ended_at: datetime | None = None
    blocked_by: BlockedBy | None = None
    reason: str = Field("", description="why it waits, or how it was granted or ended")
    granted_by: str = Field("", description="'policy', or the operator who approved going over budget")
    over_budget: bool = False
    running_jobs: int = 0
    partitions: list[str] = Field(default_factory=list)
    quarantined: bool = Field(False, description="the node is a lemon: never return it to service automatically")
    lemons: list[NodeName] | None = Field(
        None,
        description="every node quarantined when the budget sent this state: spares the incident must "
        "not claim; None from a budget that does not say (the incident then asks)",
    )

    @property
    def granted(self) -> bool:
        return self.status == LeaseStatus.GRANTED

    @property
    def waiting(self) -> bool:
        return self.status == LeaseStatus.WAITING

    @property
    def fence_held(self) -> bool:
        return self.status == LeaseStatus.FENCE_HELD

    @property
    def fencing(self) -> bool:
        """Still at the fence stage: held by the breaker, or permitted and not yet asked to remediate."""
        return self.status in (LeaseStatus.FENCE_HELD, LeaseStatus.FENCE_PERMITTED)


class LeaseRelease(Contract):
    """An incident returns its lease (signal `release_lease`); idempotent."""

    incident_id: IncidentId
    reason: str = Field("incident ended", max_length=500)


class HolderRef(Contract):
    """A lease's incident run, as the budget checks that it still runs."""

    incident_id: IncidentId
    workflow_id: str
    run_id: str


# --- lemon quarantine -------------------------------------------------------------------------


class IncidentMark(Contract):
    incident_id: IncidentId
    at: datetime


class Quarantine(Contract):
    """A node found to be a lemon; stays until an operator releases it."""

    node: NodeName
    since: datetime
    incidents: list[IncidentMark]
    released_at: datetime | None = None
    released_by: str | None = None
    release_reason: str | None = None


class QuarantineRelease(Contract):
    """An operator returns a quarantined node to automatic handling (`recovery release-quarantine`)."""

    node: NodeName
    actor: Actor
    reason: Annotated[str, Field(min_length=1, max_length=500)]
    signature: OperatorSignature | None = None


class QuarantineStatus(Contract):
    node: NodeName
    quarantined: bool
    since: datetime | None = None
    incidents_in_window: list[IncidentMark] = Field(default_factory=list)
    last_release: Quarantine | None = Field(None, description="the last quarantine an operator released")


# --- the fence circuit breaker ----------------------------------------------------------------


class FenceMark(Contract):
    """A node fenced (permitted to drain), counted by the breaker while in its window."""

    node: NodeName
    incident_id: IncidentId
    at: datetime
    partitions: list[str] = Field(default_factory=list)


class BreakerTrip(Contract):
    """The breaker tripped: every fence is held until an operator resets it."""

    at: datetime
    incident_id: IncidentId = Field(description="the incident whose fence would have passed the limit")
    node: NodeName
    reason: str


class BreakerReset(Contract):
    """An operator resets a tripped breaker (`recovery reset-breaker`)."""

    actor: Actor
    reason: Annotated[str, Field(min_length=1, max_length=500)]
    signature: OperatorSignature | None = None


# --- the budget's own state, timeline and status ----------------------------------------------


class TimelineKind(StrEnum):
    QUEUED = "queued"  # over budget: the incident waits
    GRANTED = "granted"
    RELEASED = "released"  # returned by its incident
    WITHDRAWN = "withdrawn"  # a waiting request whose incident ended or closed
    EXPIRED = "expired"  # held longer than lease_max_seconds
    RECLAIMED = "reclaimed"  # its incident closed without returning it
    QUARANTINED = "quarantined"
    QUARANTINE_RELEASED = "quarantine_released"
    POLICY_CHANGED = "policy_changed"
    FENCE_PERMITTED = "fence_permitted"
    FENCE_HELD = "fence_held"  # the breaker is tripped: the incident waits, nothing drained
    BREAKER_TRIPPED = "breaker_tripped"
    BREAKER_RESET = "breaker_reset"


class TimelineEvent(Contract):
    seq: int
    at: datetime
    kind: TimelineKind
    incident_id: str | None = None
    node: str | None = None
    holders: int = Field(description="leases granted and not yet returned, after this event")
    actor: str = "policy"
    actor_kind: ActorKind = "policy"
    detail: str = ""


class Lease(Contract):
    request: LeaseRequest
    state: LeaseState


class Disruption(Contract):
    incident_id: IncidentId
    at: datetime
    jobs: int


class BudgetState(Contract):
    """Everything the budget knows; carried across continue-as-new."""

    policy: BudgetPolicy
    leases: list[Lease] = Field(default_factory=list, description="granted and waiting, in arrival order")
    finished: list[LeaseState] = Field(
        default_factory=list,
        description="recently ended leases, so that a late duplicate request is answered, not granted again",
    )
    node_incidents: dict[str, list[IncidentMark]] = Field(default_factory=dict)
    quarantines: dict[str, Quarantine] = Field(default_factory=dict, description="active, by node")
    released_quarantines: dict[str, Quarantine] = Field(
        default_factory=dict, description="the last quarantine an operator released, by node"
    )
    disruptions: list[Disruption] = Field(default_factory=list)
    fences: list[FenceMark] = Field(
        default_factory=list, description="nodes fenced since the breaker's window began or it was last reset"
    )
    breaker: BreakerTrip | None = Field(None, description="set while the breaker is tripped")
    timeline: list[TimelineEvent] = Field(default_factory=list)
    seq: int = 0
    continued_as_new: int = Field(0, description="runs before this one")


class BudgetInUse(Contract):
    """The gauge recovery.budget.in_use: nodes under remediation now, by budget."""

    budget: str
    nodes: int = Field(ge=0)


class FleetBudgetInput(Contract):
    policy: BudgetPolicy
    state: BudgetState | None = Field(None, description="set when the budget continues as new")


class BudgetStatus(Contract):
    policy: BudgetPolicy
    holders: list[LeaseState]
    waiting: list[LeaseState]
    quarantined: list[QuarantineStatus]
    disrupted_jobs_in_window: int
    continued_as_new: int = Field(0, description="runs before this one")
    breaker: BreakerTrip | None = Field(None, description="set while the fence circuit breaker is tripped")
    fenced_in_window: list[NodeName] = Field(default_factory=list, description="nodes the breaker counts now")
    fence_held: list[LeaseState] = Field(default_factory=list, description="incidents the breaker holds")


# --- notifications ----------------------------------------------------------------------------


class NotificationKind(StrEnum):
    INCIDENT_OPENED = "incident_opened"
    APPROVAL_NEEDED = "approval_needed"
    FAILED = "failed"
    RECOVERED = "recovered"
    QUARANTINED = "quarantined"
    BREAKER_TRIPPED = "breaker_tripped"


class Notification(Contract):
    """One event for the webhook (a JSON body); delivered by its own workflow, retried by Temporal."""

    kind: NotificationKind
    incident_id: IncidentId
    node: NodeName
    at: datetime
    summary: Annotated[str, Field(min_length=1, max_length=1000)]
    details: dict[str, str] = Field(default_factory=dict)

    @property
    def delivery_id(self) -> str:
        """The same for every attempt: receivers drop a retried delivery by it (Idempotency-Key)."""
        return f"{self.incident_id}/{self.kind}"


class DeliveryResult(Contract):
    delivered: bool
    status_code: int | None = None
    attempt: int = 1
    detail: str = ""


class WebhookTarget(Contract):
    """Where notifications go (RECOVERY_NOTIFY_*): the worker's configuration, never sent to Temporal."""

    url: str = Field(pattern=r"^https?://", description="where notifications are POSTed")
    bearer_token: SecretStr | None = None
    hmac_secret: SecretStr | None = None
    timeout_seconds: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _one_way_to_authenticate(self) -> "WebhookTarget":
        # httpx turns user info in the URL into a Basic Authorization header that replaces the bearer's.
        if self.bearer_token is not None and urlsplit(self.url).username is not None:
            raise ValueError("give the webhook a bearer token or user info in its URL, not both")
        return self

    @property
    def redacted_url(self) -> str:
        """For errors, logs and histories: the URL itself may be the secret (contracts/redaction.py)."""
        return fingerprinted_url(self.url)
