"""Where the failed node lives, as the incident's story sees it: bare Slurm (hot_spares.py) or
Slurm on Kubernetes (kubernetes.py). The story fences, frees and replaces the node through this
seam without asking which; what a platform learned on the way (the slurmd pod, when its fence
began) stays inside it."""

from __future__ import annotations

from typing import Protocol

from contracts.models import ActionContext, RecoveryPolicy, SpareResult


class NodePlatform(Protocol):
    # Whether spares wait on standby (a hot-spare pool), which an idle node's incident leaves there.
    spares_on_standby: bool

    async def fence(self, node: str, ctx: ActionContext) -> None:
        """After the Slurm drain: the platform's own fence of the node."""
        ...

    async def release(self, ctx: ActionContext) -> None:
        """Once Slurm has let go of the node (jobs requeued, node down): what the platform frees."""
        ...

    async def replace(
        self, node: str, ctx: ActionContext, policy: RecoveryPolicy
    ) -> tuple[str | None, SpareResult | None]:
        """Replacement capacity: why there is none (or None), and the spare."""
        ...

    @property
    def unfence_node(self) -> str | None:
        """What the return to service unfences besides Slurm (a Kubernetes Node), if anything."""
        ...
