"""What the Kubernetes side asks of Slurm: is this node drained with no job left (may its slurmd
pod go), and is this node registered and idle (is the replacement in service).

Both go through `SlurmNodeView`, the two reads of the project's SlurmClient that they need; a test
passes a stand-in. Anything but a clear answer fails closed: the pod is not evicted.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from backends.kubernetes.errors import (
    JobsStillRunning,
    NodeNotDrained,
    NodeStillBusy,
    SlurmStateUnknown,
)
from backends.slurm import SlurmNotFound
from contracts.models import SlurmJob, SlurmNode

BUSY = frozenset({"allocated", "mixed", "completing"})


@runtime_checkable
class SlurmNodeView(Protocol):
    async def get_node(self, name: str) -> SlurmNode: ...

    async def jobs_on_node(self, name: str) -> list[SlurmJob]: ...


def describe(node: SlurmNode) -> str:
    flags = "+" + "+".join(node.flags) if node.flags else ""
    return f"{node.name} {node.state}{flags}" + (f" ({node.reason})" if node.reason else "")


async def confirm_evictable(slurm: SlurmNodeView, name: str) -> str:
    """The node's state, if its slurmd may go: drained, no job on it. Raises JobsStillRunning or
    NodeNotDrained (final), SlurmNotFound (final: Slurm does not know the node), NodeStillBusy
    (retryable: no job listed, but Slurm still shows work completing) or SlurmStateUnknown
    (retryable) when Slurm cannot be read at all."""
    try:
        node = await slurm.get_node(name)
        jobs = await slurm.jobs_on_node(name)
    except SlurmNotFound:
        raise
    except Exception as e:  # any failure to read is "unknown": the pod stays (fail closed)
        raise SlurmStateUnknown(f"cannot read Slurm's view of {name}: {type(e).__name__}: {e}") from e
    if jobs:
        listed = ", ".join(f"{j.job_id} ({j.state})" for j in jobs)
        raise JobsStillRunning(f"{describe(node)}: job(s) {listed} still on it; requeue them first")
    if node.state in BUSY or "COMPLETING" in node.flags:
        raise NodeStillBusy(f"{describe(node)}: Slurm still shows work on it")
    if not node.drained:
        raise NodeNotDrained(f"{describe(node)}: not drained; drain it first")
    return describe(node)


async def idle_because(slurm: SlurmNodeView, name: str) -> str | None:
    """None when slurmd is registered and the node idle and in service, else why not (including
    "not registered yet", which a new node is for a while)."""
    try:
        node = await slurm.get_node(name)
    except SlurmNotFound:
        return f"{name}: not registered in Slurm yet"
    except Exception as e:  # a replacement counts only once Slurm says so
        return f"{name}: Slurm not readable ({type(e).__name__}: {e})"
    if node.state == "idle" and node.in_service:
        return None
    return f"{describe(node)}: not idle in Slurm"
