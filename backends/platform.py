"""Where the failed node lives, behind one seam bound when the worker starts: bare Slurm
(backends/replacement.py: Slurm's drain is the fence, a hot spare the replacement) or Slurm on
Kubernetes (backends/kubernetes/platform.py: the Node under the slurmd pod fenced, the pod evicted,
capacity from a NodeSet, the node lifecycle or an HTTP provider). activities/platform.py runs it;
the workflow only hands the fence's handle back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from contracts.models import (
    FenceRequest,
    FenceResult,
    ReleaseRequest,
    ReleaseResult,
    ReplacementRequest,
    ReplacementResult,
    SpareResult,
    SpareWaitRequest,
)

T = TypeVar("T")
# Called with what a long call is waiting for (an activity heartbeats it).
Progress = Callable[[str], None]
PROGRESS_SECONDS = 5.0


async def telling_progress(work: Awaitable[T], progress: Progress, what: str) -> T:
    """`work`'s result, saying `what` every few seconds until then: a health check hook may take
    longer than an activity's heartbeat time-out."""
    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=PROGRESS_SECONDS))[0]:
        progress(what)
    return task.result()


class NodePlatform(Protocol):
    name: str

    async def fence(self, req: FenceRequest) -> FenceResult:
        """After Slurm's drain: the platform's own fence of the node, and the handle to it."""
        ...

    async def release(self, req: ReleaseRequest, progress: Progress) -> ReleaseResult:
        """Once Slurm has let go of the node (jobs requeued, node down): what the platform frees."""
        ...

    async def request(self, req: ReplacementRequest, progress: Progress) -> ReplacementResult:
        """Replacement capacity: a spare brought in, or a request the provider accepted."""
        ...

    async def wait(self, req: SpareWaitRequest, progress: Progress) -> SpareResult:
        """The replacement healthy and in service (the health check hook passing), or why not by the deadline."""
        ...
