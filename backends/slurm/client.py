"""Route each Slurm operation to the best backend that can do it, and say which one did."""

from __future__ import annotations

from typing import Any

from backends.slurm.api import NodeUpdate, SlurmBackend
from contracts.models import SlurmJob, SlurmNode, SlurmPath


class SlurmClient:
    """Prefers slurmrestd (when configured and able) and falls back to the CLI per operation."""

    def __init__(self, cli: SlurmBackend, rest: SlurmBackend | None = None):
        self.cli, self.rest = cli, rest

    def backend_for(self, operation: str) -> SlurmBackend:
        if self.rest is not None and self.rest.supports(operation):
            return self.rest
        return self.cli

    def path_for(self, operation: str) -> SlurmPath:
        return self.backend_for(operation).path

    async def _call(self, operation: str, *args: Any) -> Any:
        return await getattr(self.backend_for(operation), operation)(*args)

    async def get_node(self, name: str) -> SlurmNode:
        return await self._call("get_node", name)

    async def list_jobs(self) -> list[SlurmJob]:
        return await self._call("list_jobs")

    async def get_job(self, job_id: int) -> SlurmJob:
        return await self._call("get_job", job_id)

    async def jobs_on_node(self, name: str) -> list[SlurmJob]:
        """Jobs that hold the node now (running, or completing their signal handling)."""
        return [
            j for j in await self.list_jobs()
            if name in j.nodes and j.state in ("RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING")
        ]

    async def update_node(self, name: str, state: NodeUpdate, reason: str | None) -> SlurmPath:
        await self._call("update_node", name, state, reason)
        return self.path_for("update_node")

    async def set_node_comment(self, name: str, comment: str) -> SlurmPath:
        await self._call("set_node_comment", name, comment)
        return self.path_for("set_node_comment")

    async def signal_job(self, job_id: int, signal: str) -> SlurmPath:
        await self._call("signal_job", job_id, signal)
        return self.path_for("signal_job")

    async def requeue_hold(self, job_id: int) -> SlurmPath:
        await self._call("requeue_hold", job_id)
        return self.path_for("requeue_hold")

    async def set_excluded_nodes(self, job_id: int, nodes: list[str]) -> SlurmPath:
        await self._call("set_excluded_nodes", job_id, nodes)
        return self.path_for("set_excluded_nodes")

    async def release_job(self, job_id: int) -> SlurmPath:
        await self._call("release_job", job_id)
        return self.path_for("release_job")
