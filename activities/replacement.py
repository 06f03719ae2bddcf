"""Steps 5 and 6: request replacement capacity, then wait until it is healthy and in service."""

from __future__ import annotations

import asyncio
import time

from temporalio import activity

from backends.health import HealthCheck
from backends.replacement import ReplacementProvider
from backends.slurm import SlurmClient
from contracts.models import NodeHealth, ReplacementRequest, ReplacementResult, SpareResult, SpareWaitRequest, utc_now

POLL_SECONDS = 0.5


class ReplacementActivities:
    def __init__(self, slurm: SlurmClient, provider: ReplacementProvider, health: HealthCheck):
        self._slurm = slurm
        self._provider = provider
        self._health = health

    @activity.defn
    async def request_replacement(self, req: ReplacementRequest) -> ReplacementResult:
        return await self._provider.request(req.failed_node, req.spare_nodes, req.ctx)

    @activity.defn
    async def wait_for_spare(self, req: SpareWaitRequest) -> SpareResult:
        """Healthy = in service in Slurm (idle or running work, responding, not drained) and the
        health check hook passes."""
        deadline = time.monotonic() + req.deadline_seconds
        detail = ""
        while time.monotonic() < deadline:
            node = await self._slurm.get_node(req.node)
            if node.in_service:
                healthy, detail = await self._health.check(req.node)
                if healthy:
                    return SpareResult(node=req.node, healthy=True, in_service_at=utc_now(), detail=detail)
            else:
                detail = f"{node.state}{'+' + '+'.join(node.flags) if node.flags else ''} {node.reason}".strip()
            activity.heartbeat(detail)
            await asyncio.sleep(POLL_SECONDS)
        return SpareResult(
            node=req.node, healthy=False, detail=f"not healthy within {req.deadline_seconds:.0f} s: {detail}"
        )

    @activity.defn
    async def check_node_health(self, node: str) -> NodeHealth:
        """The health check hook alone (RECOVERY_HEALTH_CHECK), for capacity that arrived another way."""
        healthy, detail = await self._health.check(node)
        return NodeHealth(node=node, healthy=healthy, detail=detail)
