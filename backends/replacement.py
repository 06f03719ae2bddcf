"""Replacement capacity behind one interface. Bare Slurm: a pool of hot spares.

A hot spare is a node that is up but drained with the standby reason. To bring one in, the pool
claims it (the node's Slurm comment names the incident, so a retried request finds its own claim
instead of taking a second spare) and resumes it. A worker takes its claims one at a time, so its
incidents never share a spare. Across worker processes nothing serialises them yet: Slurm's node
comment is last-writer-wins, so two workers' incidents racing for the last spare may, rarely,
both take it (the fleet budget, a singleton, is where such claims should go). Kubernetes and
cloud providers implement the same `ReplacementProvider` protocol.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from backends.slurm import SlurmClient, SlurmError
from contracts.audit import record
from contracts.models import ActionContext, ActionRecord, ReplacementResult, SlurmNode

SPARE_STANDBY_REASON = "hot spare standby"


class ReplacementProvider(Protocol):
    name: str

    async def request(self, failed_node: str, candidates: list[str], ctx: ActionContext) -> ReplacementResult: ...


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
        return ReplacementResult(node=spare.name, provider=self.name, detail="hot spare in service", actions=actions)
