"""Route each Slurm operation to the best backend that can do it, and say which one did."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import get_args

from backends.slurm.api import NodeUpdate, SlurmBackend, SlurmNotFound, SlurmOperation, Unsupported
from backends.slurm.listings import SharedListing
from contracts.models import DIED_OF_THE_FAULT, HOLDS_ITS_NODES, Invocation, SlurmJob, SlurmNode, SlurmPath


class SlurmClient:
    """Prefers slurmrestd (when configured and able) and falls back to the CLI per operation.
    Without a CLI (a worker with no Slurm commands), an operation slurmrestd cannot do is refused."""

    def __init__(self, cli: SlurmBackend | None, rest: SlurmBackend | None = None):
        self.cli, self.rest = cli, rest
        # Every node or job read is a full listing of the cluster: one at a time, shared by all
        # the worker's readers (backends/slurm/listings.py).
        self.nodes = SharedListing(lambda: self.backend_for("list_nodes").list_nodes())
        self.jobs = SharedListing(lambda: self.backend_for("list_jobs").list_jobs())

    def planning(self) -> SlurmClient:
        """The same client in dry-run: reads are real, each write returns the exact command or
        API call it would make, unexecuted. Shares this client's connections."""

        def planned(backend: SlurmBackend) -> SlurmBackend:
            twin = copy.copy(backend)
            twin.dry_run = True
            return twin

        twin = SlurmClient(
            planned(self.cli) if self.cli is not None else None, planned(self.rest) if self.rest is not None else None
        )
        twin.nodes, twin.jobs = self.nodes, self.jobs  # reads are the same
        return twin

    def acting(self, dry_run: bool) -> SlurmClient:
        """This client, or its planning twin for an incident in dry-run."""
        return self.planning() if dry_run else self

    def backend_for(self, operation: SlurmOperation) -> SlurmBackend:
        if self.rest is not None and self.rest.supports(operation):
            return self.rest
        if self.cli is None:
            raise Unsupported(f"{operation} needs the Slurm commands, and this client has none")
        return self.cli

    def without_a_path(self) -> list[SlurmOperation]:
        """The operations neither backend can do: none while there is a CLI."""
        if self.cli is not None:
            return []
        return [op for op in get_args(SlurmOperation) if not (self.rest and self.rest.supports(op))]

    def path_for(self, operation: SlurmOperation) -> SlurmPath:
        return self.backend_for(operation).path

    async def get_node(self, name: str) -> SlurmNode:
        """The node as a listing that began after this call shows it (a backend's own node read
        lists every node too: ENDPOINTS in rest.py says why)."""
        for node in await self.nodes.read():
            if node.name == name:
                return node
        raise SlurmNotFound(f"node {name} is not in this cluster")

    async def list_nodes(self) -> list[SlurmNode]:
        return await self.nodes.read()

    async def list_jobs(self) -> list[SlurmJob]:
        return await self.jobs.read()

    async def get_job(self, job_id: int) -> SlurmJob:
        return await self.backend_for("get_job").get_job(job_id)

    async def jobs_on_node(self, name: str, died_since: datetime | None = None) -> list[SlurmJob]:
        """Jobs that hold the node now (running, or completing their signal handling) and, from
        `died_since` on, those that died on it since then (FAILED or NODE_FAIL) and asked to be
        requeued."""
        return [
            j
            for j in await self.list_jobs()
            if name in j.nodes and (j.state in HOLDS_ITS_NODES or _died_since(j, died_since))
        ]

    async def update_node(self, name: str, state: NodeUpdate, reason: str | None) -> Invocation:
        return await self.backend_for("update_node").update_node(name, state, reason)

    async def set_node_comment(self, name: str, comment: str) -> Invocation:
        return await self.backend_for("set_node_comment").set_node_comment(name, comment)

    async def signal_job(self, job_id: int, signal: str) -> Invocation:
        return await self.backend_for("signal_job").signal_job(job_id, signal)

    async def requeue_hold(self, job_id: int) -> Invocation:
        return await self.backend_for("requeue_hold").requeue_hold(job_id)

    async def set_excluded_nodes(self, job_id: int, nodes: list[str]) -> Invocation:
        return await self.backend_for("set_excluded_nodes").set_excluded_nodes(job_id, nodes)

    async def set_required_nodes(self, job_id: int, nodes: list[str]) -> Invocation:
        """The job's pin (ReqNodeList); an empty list removes it."""
        return await self.backend_for("set_required_nodes").set_required_nodes(job_id, nodes)

    async def release_job(self, job_id: int) -> Invocation:
        return await self.backend_for("release_job").release_job(job_id)


def _died_since(job: SlurmJob, since: datetime | None) -> bool:
    """Ended FAILED or NODE_FAIL at `since` or later, and asked to be requeued."""
    return (
        since is not None
        and job.state in DIED_OF_THE_FAULT
        and job.requeue
        and job.end_time is not None
        and job.end_time >= since
    )
