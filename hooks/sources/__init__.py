"""One module per alert source: its wire schema (pydantic, strict) and how it becomes alerts.

Every source yields Incoming records; the intake (hooks/intake.py) decides where each goes.
Free text from a source (summaries, log messages) is clipped to the alert contract's limits rather
than refused: it is description, not a decision input. Node names and XIDs are validated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, NamedTuple

from pydantic import AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from contracts.models import _NODE_NAME, NodeFailureAlert, NodeName

# The limits of NodeFailureAlert's free-text fields (contracts/models.py).
REASON_MAX, MESSAGE_MAX, ACTOR_MAX = 500, 2000, 200


_RFC3339_START = re.compile(r"^\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d")


def _rfc3339(value: object) -> object:
    # Lax parsing (below) would also take 1700000000 or "1700000000" as a Unix time; the sources'
    # schemas say RFC 3339, so only such strings reach it.
    if isinstance(value, datetime) or (isinstance(value, str) and _RFC3339_START.match(value)):
        return value
    raise ValueError("expected an RFC 3339 time with a zone, like 2026-11-30T00:17:36Z")


# Not strict: a strict datetime takes no string once a validator runs first; _rfc3339 is the strictness.
Timestamp = Annotated[AwareDatetime, Field(strict=False), BeforeValidator(_rfc3339)]


# The contract's node name, with its rule in the OpenAPI document too (a validator function alone
# shows there as any string).
WireNodeName = Annotated[
    NodeName,
    WithJsonSchema(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": 63,
            "pattern": _NODE_NAME.pattern,
            "description": "one host name: letters, digits, '.', '_' or '-', starting with a letter or digit",
        }
    ),
]


class WireModel(BaseModel):
    """A request body: unknown fields and type coercions ("79" for 79) are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


@dataclass(frozen=True, slots=True)
class Incoming:
    """One alert as a source reported it, before the intake routes it."""

    node: str
    xid: int | None  # None only for an NCCL timeout, which has no XID of its own
    source: str
    actor: str
    reason: str
    observed_at: datetime
    message: str = ""
    resolved: bool = False
    # The GPU, validated by the source (the contract's shapes), as far as the source names it.
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    pci_address: str | None = None

    def to_alert(self) -> NodeFailureAlert:
        assert self.xid is not None, "an event without an XID only joins another node's incident"
        return NodeFailureAlert(
            node=self.node,
            xid=self.xid,
            source=self.source,
            actor=self.actor,
            reason=self.reason,
            observed_at=self.observed_at,
            message=self.message,
            gpu_index=self.gpu_index,
            gpu_uuid=self.gpu_uuid,
            pci_address=self.pci_address,
        )

    def joining(self, primary_node: str, primary_xid: int, why: str) -> NodeFailureAlert:
        """This alert as it joins the incident of the node whose failure it follows from: that
        node's, observed on this one; an NCCL timeout, which has no XID, carries the primary's. It
        names no GPU: its GPU is one of this node's, and the incident's GPU is the failed node's."""
        return NodeFailureAlert(
            node=primary_node,
            observed_on=self.node,
            xid=self.xid or primary_xid,
            source=self.source,
            actor=self.actor,
            reason=clip(f"{why}: {self.reason}", REASON_MAX),
            observed_at=self.observed_at,
            message=self.message,
        )


@dataclass(frozen=True, slots=True)
class IgnoredLine:
    """A part of a request that is no alert and was left out, not refused (a kernel log's non-Xid line)."""

    index: int
    reason: str


class Parsed(NamedTuple):
    """A validated request, as a source reads it: its alerts, its problems (any refuses it whole)
    and what it ignored."""

    alerts: list[Incoming]
    problems: list[dict[str, str]]
    ignored: tuple[IgnoredLine, ...] = ()


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def one_line(text: str, limit: int) -> str:
    return clip(" ".join(text.split()), limit)
