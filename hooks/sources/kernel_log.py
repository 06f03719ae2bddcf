"""Kernel log lines as the NVIDIA driver writes them, posted one or many at a time for one node.

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.

A line may carry a prefix: dmesg's seconds since boot ("[ 1234.5678] ", no wall clock, ignored) or
a syslog/journal prefix; when the line starts with an RFC 3339 time with a zone (journalctl -o
short-iso, rsyslog), that is when the alert was observed. Otherwise the post's ``observed_at`` is,
or failing that the time the hook received it. Other lines (the driver's follow-up "NVRM: GPU ...
has fallen off the bus.", anything a shipper batched with them) are ignored and named in the answer,
as long as the post has an Xid line: a post with none is refused (422), since it can only be a
misconfigured shipper.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from pydantic import Field

from contracts.models import canonical_pci_address
from hooks.problems import problem
from hooks.sources import (
    MESSAGE_MAX,
    REASON_MAX,
    IgnoredLine,
    Incoming,
    Parsed,
    Timestamp,
    WireModel,
    WireNodeName,
    clip,
    one_line,
)

SourceName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:/-]+$")]

_XID_LINE = re.compile(
    r"NVRM: Xid \((?P<pci>PCI:[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)\): "
    # A line cut short after its XID ("...): 154 (") is still one: the XID is what matters.
    r"(?P<xid>\d+)(?:[,\s](?P<rest>.*))?$"
)
_LEADING_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d))\s")
# "pid=1234, name=python, " (or pid='<unknown>') before the driver's description of the fault.
_PROCESS = re.compile(r"^(?:pid=[^,]*, *)?(?:name=[^,]*, *)?")


class KernelLogPost(WireModel):
    node: WireNodeName
    lines: Annotated[list[Annotated[str, Field(max_length=4096)]], Field(min_length=1)]
    observed_at: Timestamp | None = Field(None, description="when the lines were read (default: on receipt)")
    source: SourceName = "kernel-log"


def parse_line(line: str) -> tuple[int, str, str, datetime | None] | None:
    """(xid, PCI address, description, time) of an NVRM Xid line, or None if it is not one;
    ValueError if its leading time is not a real one (February 30th, hour 25, offset +99:99)."""
    match = _XID_LINE.search(line)
    if match is None:
        return None
    when = None
    stamp = _LEADING_TIME.match(line)
    if stamp is not None:
        try:
            when = datetime.fromisoformat(stamp.group(1).replace(",", "."))
        except ValueError as e:
            raise ValueError(f"the line's leading time is not a valid time: {e}") from None
    rest = (match.group("rest") or "").strip()
    return int(match.group("xid")), match.group("pci"), _PROCESS.sub("", rest) or rest, when


NOT_AN_XID_LINE = "not an NVRM Xid line ('NVRM: Xid (PCI:…): <xid>, …')"


def to_incoming(post: KernelLogPost, received_at: datetime) -> Parsed:
    """One alert per Xid line; the other lines ignored, or, when no line is an Xid line, each a problem."""
    alerts, problems, ignored = [], [], []
    for i, line in enumerate(post.lines):
        try:
            parsed = parse_line(line)
        except ValueError as e:
            problems.append(problem(f"lines[{i}]", str(e)))
            continue
        if parsed is None:
            ignored.append(IgnoredLine(index=i, reason=NOT_AN_XID_LINE))
            continue
        xid, pci, description, when = parsed
        if not 1 <= xid <= 999:
            problems.append(problem(f"lines[{i}]", f"XID {xid} is out of range 1-999"))
            continue
        alerts.append(
            Incoming(
                node=post.node,
                xid=xid,
                source=post.source,
                actor=f"kernel log of {post.node}",
                reason=one_line(f"XID {xid} on {pci}: {description}", REASON_MAX),
                observed_at=when or post.observed_at or received_at,
                message=clip(line.strip(), MESSAGE_MAX),
                pci_address=canonical_pci_address(pci),
            )
        )
    if not alerts and not problems:
        problems = [problem(f"lines[{line.index}]", line.reason) for line in ignored]
        ignored = []
    return Parsed(alerts, problems, tuple(ignored))
