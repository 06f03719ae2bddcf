"""Replacement capacity behind one interface. Bare Slurm: a pool of hot spares.

A hot spare is a node that is up but drained with the standby reason. To bring one in, the pool
claims it (the node's Slurm comment names the incident, so a retried request finds its own claim
instead of taking a second spare) and resumes it; when incidents race for one spare, Slurm's
RESUME (which succeeds once) decides. Kubernetes and cloud providers implement the
same `ReplacementProvider` protocol.
"""

from __future__ import annotations

from typing import Protocol

from contracts.audit import record
from backends.slurm import SlurmClient, SlurmError
from contracts.models import ActionContext, ActionRecord, ReplacementResult, SlurmNode

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
        actions: list[ActionRecord] = []
        mine = next((n for n in nodes if n.comment == claim), None)
        if mine is not None and not mine.drained:
            # A retry: an earlier attempt claimed it and it is in service (that attempt's RESUME
            # may even have been refused by a restarting slurmctld and still taken effect).
            actions.append(record("resume_spare", mine.name, "none", ctx,
                                  "found in service with this incident's claim: an earlier attempt brought it in"))
            return self._brought_in(mine, actions)
        standby = [n for n in nodes if n.drained and n.reason.endswith(SPARE_STANDBY_REASON)
                   and n.comment in ("", claim)]
        for spare in sorted(standby, key=lambda n: n.comment != claim):  # our own claim first
            if await self._claim(slurm, spare, claim, ctx, actions):
                return self._brought_in(spare, actions)
        return ReplacementResult(
            node=None, provider=self.name, actions=actions,
            detail=f"no hot spare on standby among {', '.join(candidates) or 'none configured'}",
        )

    async def _claim(self, slurm: SlurmClient, spare: SlurmNode, claim: str, ctx: ActionContext,
                     actions: list[ActionRecord]) -> bool:
        """Claim the spare and resume it. Two incidents may read the same spare as free at once,
        and the comment is last-writer-wins; RESUME is not: Slurm resumes a drained node once and
        refuses a node no longer drained. So the RESUME decides who has the spare, the winner
        writes its claim again in case the loser's overwrote it, and the loser clears its own.
        When those last two writes cross, the spare is left with no claim: never the loser's
        (no retry of the loser takes it), but a retry of the winner after a crash at that moment
        would not recognise it and would look for another spare."""
        if spare.comment != claim:
            call = await slurm.set_node_comment(spare.name, claim)
            actions.append(record("claim_spare", spare.name, call, ctx, f"Comment={claim!r}"))
        try:
            call = await slurm.update_node(spare.name, "RESUME", None)
        except SlurmError:
            now = await slurm.get_node(spare.name)
            if now.drained or not now.in_service:
                # Not a lost race (another incident would have it in service): Slurm refused for
                # another reason, say the spare has not registered again after a controller restart.
                raise
            if now.comment == claim:
                await slurm.set_node_comment(spare.name, "")  # the winner's claim was ours to overwrite
            actions.append(record("spare_taken", spare.name, "none", ctx,
                                  "another incident resumed this spare first: trying the next"))
            return False
        actions.append(record("resume_spare", spare.name, call, ctx, "hot spare brought into service"))
        if call.executed and (await slurm.get_node(spare.name)).comment != claim:
            call = await slurm.set_node_comment(spare.name, claim)
            actions.append(record("claim_spare", spare.name, call, ctx, f"Comment={claim!r} (written again)"))
        return True

    def _brought_in(self, spare: SlurmNode, actions: list[ActionRecord]) -> ReplacementResult:
        return ReplacementResult(node=spare.name, provider=self.name, detail="hot spare in service", actions=actions)
