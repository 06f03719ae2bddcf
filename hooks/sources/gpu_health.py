"""GPU health events: one event per post, from a node agent (DCGM health watches, a site script).

An event reports an XID on one GPU, or an NCCL timeout (``kind: nccl_timeout``, no XID): a job's
collective timed out on this node, which follows from a failure elsewhere. An NCCL timeout never
opens an incident on its own; it joins a peer's incident or is dropped (docs/alert-hooks.md).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from contracts.models import GpuIndex, GpuUuid, Xid
from hooks.sources import MESSAGE_MAX, Incoming, Timestamp, WireModel, WireNodeName, one_line
from hooks.sources.kernel_log import SourceName


class GpuHealthEvent(WireModel):
    node: WireNodeName
    gpu_index: GpuIndex | None = None
    gpu_uuid: GpuUuid | None = None
    kind: Literal["xid", "nccl_timeout"] = "xid"
    xid: Xid | None = None
    message: Annotated[str, Field(max_length=MESSAGE_MAX)] = ""
    observed_at: Timestamp
    source: SourceName

    @model_validator(mode="after")
    def _xid_events_name_the_xid_and_gpu(self) -> GpuHealthEvent:
        if self.kind == "xid":
            if self.xid is None:
                raise ValueError("an xid event needs xid")
            if self.gpu_index is None and self.gpu_uuid is None:
                raise ValueError("an xid event needs gpu_index or gpu_uuid")
        elif self.xid is not None:
            raise ValueError("an nccl_timeout event has no xid")
        return self

    @property
    def gpu(self) -> str:
        return " ".join(filter(None, [None if self.gpu_index is None else f"GPU {self.gpu_index}", self.gpu_uuid]))


def to_incoming(event: GpuHealthEvent) -> Incoming:
    what = f"XID {event.xid}" if event.kind == "xid" else "NCCL timeout"
    on = f" on {event.gpu}" if event.gpu else ""
    detail = one_line(event.message, 300)
    return Incoming(
        node=event.node,
        xid=event.xid,
        source=event.source,
        actor=f"GPU health of {event.node}",
        reason=f"{what}{on}" + (f": {detail}" if detail else ""),
        observed_at=event.observed_at,
        message=event.message,
        gpu_index=event.gpu_index,
        gpu_uuid=event.gpu_uuid,
    )
