"""Replacement capacity behind one interface. Bare Slurm: a pool of hot spares.

A hot spare is a node that is up but drained with the standby reason. To bring one in, the pool
claims it (the node's Slurm comment names the incident, so a retried request finds its own claim
instead of taking a second spare) and resumes it. Kubernetes and cloud providers implement the
same `ReplacementProvider` protocol.
"""

from __future__ import annotations

from typing import Protocol

from contracts.audit import record
from backends.slurm import SlurmClient
from contracts.models import ActionContext, ReplacementResult

SPARE_STANDBY_REASON = "hot spare standby"


class ReplacementProvider(Protocol):
    name: str

    async def request(self, failed_node: str, candidates: list[str], ctx: ActionContext) -> ReplacementResult: ...


class HotSparePool:
    name = "slurm-hot-spare"

    def __init__(self, slurm: SlurmClient):
        self._slurm = slurm

    @staticmethod
    def claim_comment(ctx: ActionContext) -> str:
        return f"{ctx.owner}: spare for incident {ctx.incident_id}"

    async def request(self, failed_node: str, candidates: list[str], ctx: ActionContext) -> ReplacementResult:
        claim = self.claim_comment(ctx)
        slurm = self._slurm.acting(ctx.dry_run)
        nodes = [await slurm.get_node(name) for name in candidates if name != failed_node]
        mine = next((n for n in nodes if n.comment == claim), None)
        actions = []
        if mine is None:
            mine = next(
                (n for n in nodes if n.drained and n.reason.endswith(SPARE_STANDBY_REASON) and not n.comment),
                None,
            )
            if mine is None:
                return ReplacementResult(
                    node=None, provider=self.name,
                    detail=f"no hot spare on standby among {', '.join(candidates) or 'none configured'}",
                )
            call = await slurm.set_node_comment(mine.name, claim)
            actions.append(record("claim_spare", mine.name, call, ctx, f"Comment={claim!r}"))
        if mine.drained:
            call = await slurm.update_node(mine.name, "RESUME", None)
            actions.append(record("resume_spare", mine.name, call, ctx, "hot spare brought into service"))
        return ReplacementResult(node=mine.name, provider=self.name, detail="hot spare in service", actions=actions)
