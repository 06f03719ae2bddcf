"""Bare Slurm behind the platform seam (backends/platform.py): Slurm's drain and DOWN are the
whole fence and release, and the replacement is a hot spare from a pool.

A hot spare is a node that is up but drained with the standby reason. To bring one in, the pool
claims it (the node's Slurm comment names the incident, so a retried request finds its own claim
instead of taking a second spare) and resumes it. A worker takes its claims one at a time, so its
incidents never share a spare. Across worker processes nothing serialises them yet: Slurm's node
comment is last-writer-wins, so two workers' incidents racing for the last spare may, rarely,
both take it (the fleet budget, a singleton, is where such claims should go): incidents claim
each spare through its own SpareClaimWorkflow (workflows/spare_claim.py).
"""

from __future__ import annotations

import asyncio
import time

from backends.health import HealthCheck
from backends.platform import Progress, telling_progress
from backends.slurm import SlurmClient, SlurmError
from contracts.audit import record
from contracts.models import (
    ActionContext,
    ActionRecord,
    FenceHandle,
    FenceRequest,
    FenceResult,
    ReleaseRequest,
    ReleaseResult,
    ReplacementRequest,
    ReplacementResult,
    SlurmNode,
    SpareResult,
    SpareWaitRequest,
    utc_now,
)

SPARE_STANDBY_REASON = "hot spare standby"
POLL_SECONDS = 0.5


class BareSlurm:
    """The NodePlatform of a cluster without Kubernetes."""

    name = "slurm"

    def __init__(self, slurm: SlurmClient, health: HealthCheck):
        self._slurm = slurm
        self._spares = HotSparePool(slurm)
        self._health = health

    async def fence(self, req: FenceRequest) -> FenceResult:
        handle = FenceHandle(platform=self.name, slurm_node=req.node, fenced_at=utc_now(), spares_on_standby=True)
        return FenceResult(handle=handle, detail="Slurm's drain is the whole fence")

    async def release(self, req: ReleaseRequest, progress: Progress) -> ReleaseResult:
        return ReleaseResult(detail="Slurm's DOWN is the whole release")

    async def request(self, req: ReplacementRequest, progress: Progress) -> ReplacementResult:
        return await self._spares.request(req.failed_node, req.spare_nodes, req.ctx)

    async def wait(self, req: SpareWaitRequest, progress: Progress) -> SpareResult:
        """Healthy = in service in Slurm (idle or running work, responding, not drained) and the
        health check hook passes."""
        if req.node is None:
            raise ValueError("a hot spare is waited for by name")
        deadline = time.monotonic() + req.deadline_seconds
        detail = ""
        while time.monotonic() < deadline:
            node = await self._slurm.get_node(req.node)
            if node.in_service:
                healthy, detail = await telling_progress(
                    self._health.check(req.node), progress, f"health check of {req.node}"
                )
                if healthy:
                    return SpareResult(node=req.node, healthy=True, in_service_at=utc_now(), detail=detail)
            else:
                detail = f"{node.state}{'+' + '+'.join(node.flags) if node.flags else ''} {node.reason}".strip()
            progress(detail)
            await asyncio.sleep(POLL_SECONDS)
        return SpareResult(
            node=req.node, healthy=False, detail=f"not healthy within {req.deadline_seconds:.0f} s: {detail}"
        )


class HotSparePool:
    name = "slurm-hot-spare"

    def __init__(self, slurm: SlurmClient):
        self._slurm = slurm
        # Slurm has no compare-and-set for a node's comment: a worker takes its claims one at a
        # time, so that two of its incidents never read the same spare as free. Across workers,
        # incidents claim each spare through its own SpareClaimWorkflow (workflows/spare_claim.py).
        self._claiming = asyncio.Lock()

    @staticmethod
    def claim_comment(ctx: ActionContext) -> str:
        return f"{ctx.owner}: spare for incident {ctx.incident_id}"

    async def request(self, failed_node: str, candidates: list[str], ctx: ActionContext) -> ReplacementResult:
        async with self._claiming:
            return await self._request(failed_node, candidates, ctx)

    async def _request(self, failed_node: str, candidates: list[str], ctx: ActionContext) -> ReplacementResult:
        claim = self.claim_comment(ctx)
        slurm = self._slurm.acting(ctx.dry_run)
        nodes = [await slurm.get_node(name) for name in candidates if name != failed_node]
        actions: list[ActionRecord] = []
        mine = next((n for n in nodes if n.comment == claim), None)
        if mine is not None and not mine.drained:
            # A retry: an earlier attempt claimed it and it is in service.
            actions.append(
                record(
                    "resume_spare",
                    mine.name,
                    "none",
                    ctx,
                    "found in service with this incident's claim: an earlier attempt brought it in",
                )
            )
            return self._brought_in(mine, actions)
        standby = [
            n for n in nodes if n.drained and n.reason.endswith(SPARE_STANDBY_REASON) and n.comment in ("", claim)
        ]
        for spare in sorted(standby, key=lambda n: n.comment != claim):  # our own claim first
            if await self._claim(slurm, spare, claim, ctx, actions):
                return self._brought_in(spare, actions)
        return ReplacementResult(
            node=None,
            provider=self.name,
            actions=actions,
            detail=f"no hot spare on standby among {', '.join(candidates) or 'none configured'}",
            accepted=False,
        )

    async def _claim(
        self, slurm: SlurmClient, spare: SlurmNode, claim: str, ctx: ActionContext, actions: list[ActionRecord]
    ) -> bool:
        """Claim the spare, then resume it. A refused RESUME is looked into: the spare still
        drained is an error (retried); taken by another claim (another worker's incident), it is
        lost; undrained with this incident's claim, it is ours (a slurmctld that restarts refuses
        a RESUME before the spare registers again, and applies it all the same)."""
        if spare.comment != claim:
            call = await slurm.set_node_comment(spare.name, claim)
            actions.append(record("claim_spare", spare.name, call, ctx, f"Comment={claim!r}"))
        try:
            call = await slurm.update_node(spare.name, "RESUME", None)
        except SlurmError as refused:
            now = await slurm.get_node(spare.name)
            if now.drained:
                raise
            if now.comment != claim:
                actions.append(
                    record(
                        "spare_taken",
                        spare.name,
                        "none",
                        ctx,
                        f"another claim resumed this spare first ({now.comment!r}): trying the next",
                    )
                )
                return False
            actions.append(
                record(
                    "resume_spare",
                    spare.name,
                    "none",
                    ctx,
                    f"Slurm refused the RESUME ({refused}) yet the spare is undrained with this incident's claim",
                )
            )
            return True
        actions.append(record("resume_spare", spare.name, call, ctx, "hot spare brought into service"))
        return True

    def _brought_in(self, spare: SlurmNode, actions: list[ActionRecord]) -> ReplacementResult:
        return ReplacementResult(
            node=spare.name, provider=self.name, detail="hot spare in service", actions=actions, accepted=True
        )
