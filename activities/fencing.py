"""Steps 2 and 4b: take the failed node out of service in Slurm (drain, later down); and, after
repair, return it to service.

All are idempotent: a node already fenced by this incident is left as it is, a node that someone
else drained is never overwritten, and only this incident's own fence is ever undone.
"""

from __future__ import annotations

from collections.abc import Callable

from temporalio import activity

from backends.health import HealthCheck
from backends.slurm import NodeUpdate, SlurmClient, SlurmNotFound
from contracts.audit import record
from contracts.budget import FenceScope, PartitionShare
from contracts.kubernetes import SLURMD_PRE_STOP_REASON
from contracts.models import ActionContext, NodeFenceResult, NodeRequest, RepairCheck, SlurmNode


def fenced_by(node: SlurmNode, ctx: ActionContext) -> bool:
    return node.reason.startswith(f"{ctx.owner}:") and f"incident {ctx.incident_id} " in node.reason + " "


class FencingActivities:
    def __init__(self, slurm: SlurmClient, health: HealthCheck):
        self._slurm = slurm
        self._health = health

    async def _fence(self, req: NodeRequest, state: NodeUpdate, done: Callable[[SlurmNode], bool]) -> NodeFenceResult:
        slurm = self._slurm.acting(req.ctx.dry_run)
        before = await slurm.get_node(req.node)
        ours = fenced_by(before, req.ctx)
        if done(before) and ours:
            action = record(f"{state.lower()}_node", req.node, "none", req.ctx, "already done by this incident")
            return NodeFenceResult(
                node=req.node, before=before, after=before, changed=False, owned_by_other=False, action=action
            )
        if before.drained and not ours:
            action = record(
                f"{state.lower()}_node",
                req.node,
                "none",
                req.ctx,
                f"left as found: drained by someone else ({before.reason!r})",
            )
            return NodeFenceResult(
                node=req.node, before=before, after=before, changed=False, owned_by_other=True, action=action
            )
        call = await slurm.update_node(req.node, state, req.ctx.slurm_reason())
        after = await slurm.get_node(req.node)
        now = f"{after.state}{'+' + '+'.join(after.flags) if after.flags else ''}"
        action = record(
            f"{state.lower()}_node",
            req.node,
            call,
            req.ctx,
            f"{before.state}{'+' + '+'.join(before.flags) if before.flags else ''} -> "
            f"{now if call.executed else state + ' (dry-run: not done)'}; reason {req.ctx.slurm_reason()!r}",
        )
        return NodeFenceResult(
            node=req.node, before=before, after=after, changed=call.executed, owned_by_other=False, action=action
        )

    @activity.defn
    async def partition_shares(self, node: str) -> list[PartitionShare]:
        """The node's Slurm partitions and their sizes now, for the fleet disruption budget."""
        return _partitions_of(node, await self._slurm.list_nodes())

    @activity.defn
    async def fence_scope(self, node: str) -> FenceScope:
        """The node's partitions and the cluster's size now, for the fence circuit breaker."""
        nodes = await self._slurm.list_nodes()
        return FenceScope(partitions=_partitions_of(node, nodes), fleet_nodes=len(nodes))

    @activity.defn
    async def drain_node(self, req: NodeRequest) -> NodeFenceResult:
        return await self._fence(req, "DRAIN", done=lambda node: node.drained)

    @activity.defn
    async def mark_node_down(self, req: NodeRequest) -> NodeFenceResult:
        return await self._fence(req, "DOWN", done=lambda node: node.state == "down")

    @staticmethod
    def _left_as_found(req: NodeRequest, node: SlurmNode) -> RepairCheck:
        action = record(
            "return_to_service",
            req.node,
            "none",
            req.ctx,
            f"left as found: fenced by someone else now ({node.reason!r})",
        )
        return RepairCheck(node=req.node, returned=False, final=True, detail=action.detail, action=action)

    @activity.defn
    async def return_to_service(self, req: NodeRequest) -> RepairCheck:
        """After repair: resume the node if its fence is still this incident's, slurmd answers
        and the health check hook passes. Safe to retry: a resumed node is found in service."""
        node = await self._slurm.get_node(req.node)
        if node.in_service:
            return RepairCheck(node=req.node, returned=True, final=True, detail="in service, repaired and healthy")
        if not node.drained and node.state != "down":
            # Nobody fences it: resumed (say by this watcher's previous look), and slurmctld has
            # not seen its slurmd answer yet. Look again rather than call it someone else's.
            return RepairCheck(
                node=req.node, returned=False, final=False, detail="resumed; waiting for slurmctld to see it answer"
            )
        if node.reason == SLURMD_PRE_STOP_REASON:
            # Slinky's preStop hook rewrote the fence when the slurmd pod went (this incident's
            # eviction): the operator brings the node back itself (a slurmd pod again, then the node
            # IDLE). Resuming it here would fight the operator; watch it come back instead.
            return RepairCheck(
                node=req.node,
                returned=False,
                final=False,
                detail="its slurmd pod is gone (reason set by Slinky's preStop): Slinky brings it back",
            )
        if not fenced_by(node, req.ctx):
            return self._left_as_found(req, node)
        if not node.responding:
            return RepairCheck(node=req.node, returned=False, final=False, detail="slurmd does not answer yet")
        healthy, detail = await self._health.check(req.node)
        if not healthy:
            return RepairCheck(node=req.node, returned=False, final=False, detail=detail)
        # The health check takes a while: someone may have fenced the node meanwhile (an operator's
        # DRAIN). Look again right before the RESUME, which would undo their fence.
        node = await self._slurm.get_node(req.node)
        if not fenced_by(node, req.ctx):
            return self._left_as_found(req, node)
        call = await self._slurm.update_node(req.node, "RESUME", None)
        action = record("return_to_service", req.node, call, req.ctx, f"repaired and healthy: {detail}")
        # A resumed DOWN node is NOT_RESPONDING until slurmctld's next ping: the next look confirms it.
        returned = (await self._slurm.get_node(req.node)).in_service
        return RepairCheck(
            node=req.node,
            returned=returned,
            final=returned,
            action=action,
            detail=action.detail if returned else "resumed; waiting for slurmctld to see it answer",
        )


def _partitions_of(node: str, nodes: list[SlurmNode]) -> list[PartitionShare]:
    failed = next((n for n in nodes if n.name == node), None)
    if failed is None:
        raise SlurmNotFound(f"node {node} is not in this cluster")
    return [PartitionShare(name=p, size=sum(p in n.partitions for n in nodes)) for p in failed.partitions]
