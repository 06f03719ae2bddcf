"""The node's fence, its release and its replacement, on whichever platform the worker was bound
to (backends/platform.py: bare Slurm or Slurm on Kubernetes): steps 1 (the platform's part), 4
and 5 of the recovery.

Each activity is idempotent and every write leaves an ActionRecord with the exact call. Final
answers are non-retryable ApplicationErrors named after their cause (backends/kubernetes/errors.py:
NodeNotFound, SlurmdPodNotFound, NodeSetNotFound, JobsStillRunning, NodeNotDrained, EvictionBlocked;
SlurmNotFound); the rest is retried.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from temporalio import activity
from temporalio.exceptions import ApplicationError

from backends.health import HealthCheck
from backends.kubernetes import KubeRecoveryError
from backends.platform import NodePlatform
from backends.slurm import SlurmNotFound
from contracts.models import (
    FenceRequest,
    FenceResult,
    NodeHealth,
    ReleaseRequest,
    ReleaseResult,
    ReplacementRequest,
    ReplacementResult,
    SpareResult,
    SpareWaitRequest,
)


@contextmanager
def final_answers() -> Iterator[None]:
    """Backend answers become ApplicationErrors of the same name, non-retryable when final."""
    try:
        yield
    except KubeRecoveryError as e:
        raise ApplicationError(str(e), type=type(e).__name__, non_retryable=e.final) from e
    except SlurmNotFound as e:
        raise ApplicationError(str(e), type="SlurmNotFound", non_retryable=True) from e


def heartbeat(detail: str) -> None:
    activity.heartbeat(detail)


class PlatformActivities:
    def __init__(self, platform: NodePlatform, health: HealthCheck):
        self._platform = platform
        self._health = health

    def all(self) -> list:
        return [
            self.fence_node,
            self.release_node,
            self.request_replacement,
            self.wait_for_spare,
            self.check_node_health,
        ]

    @activity.defn
    async def fence_node(self, req: FenceRequest) -> FenceResult:
        """After Slurm's drain, the platform's own fence; its handle goes to the steps below."""
        with final_answers():
            return await self._platform.fence(req)

    @activity.defn
    async def release_node(self, req: ReleaseRequest) -> ReleaseResult:
        """Once Slurm has let go of the node: on Kubernetes, the slurmd pod evicted (Slurm read
        again before every attempt; unreadable Slurm fails closed)."""
        with final_answers():
            return await self._platform.release(req, heartbeat)

    @activity.defn
    async def request_replacement(self, req: ReplacementRequest) -> ReplacementResult:
        with final_answers():
            return await self._platform.request(req, heartbeat)

    @activity.defn
    async def wait_for_spare(self, req: SpareWaitRequest) -> SpareResult:
        """The replacement in service and passing the health check hook; at the deadline,
        healthy=False, saying what was missing."""
        with final_answers():
            return await self._platform.wait(req, heartbeat)

    @activity.defn
    async def check_node_health(self, node: str) -> NodeHealth:
        """The health check hook alone (RECOVERY_HEALTH_CHECK), for capacity that arrived another way."""
        healthy, detail = await self._health.check(node)
        return NodeHealth(node=node, healthy=healthy, detail=detail)
