"""The interface every Slurm backend implements, and the errors they raise."""

from __future__ import annotations

from typing import Literal, Protocol

from contracts.models import Invocation, SlurmJob, SlurmNode, SlurmPath

NodeUpdate = Literal["DRAIN", "DOWN", "RESUME"]
# The operations of SlurmBackend, by name: a backend says which it supports, the client routes each.
SlurmOperation = Literal[
    "get_node",
    "list_nodes",
    "list_jobs",
    "get_job",
    "update_node",
    "set_node_comment",
    "signal_job",
    "requeue_hold",
    "set_excluded_nodes",
    "set_required_nodes",
    "release_job",
]


class SlurmError(Exception):
    """Slurm refused or failed an operation."""


class SlurmUnavailable(SlurmError):
    """Slurm's state could not be read at all (controller or slurmrestd down, time-out)."""


class SlurmNotFound(SlurmError):
    """The node or job does not exist: retrying cannot help."""


class Unsupported(SlurmError):
    """This backend (or its API version) cannot do the operation."""


class SlurmCommandError(SlurmError):
    def __init__(self, argv: list[str], returncode: int, stderr: str):
        self.argv, self.returncode, self.stderr = argv, returncode, stderr.strip()
        super().__init__(f"{' '.join(argv)} exited {returncode}: {self.stderr}")


class SlurmBackend(Protocol):
    """What the recovery needs from Slurm. Every call is for one node or one job. Each write
    returns the Invocation it made; with `dry_run` set it only describes it."""

    path: SlurmPath
    dry_run: bool

    def supports(self, operation: SlurmOperation) -> bool: ...

    async def get_node(self, name: str) -> SlurmNode: ...

    async def list_nodes(self) -> list[SlurmNode]: ...

    async def list_jobs(self) -> list[SlurmJob]: ...

    async def get_job(self, job_id: int) -> SlurmJob: ...

    async def update_node(self, name: str, state: NodeUpdate, reason: str | None) -> Invocation: ...

    async def set_node_comment(self, name: str, comment: str) -> Invocation: ...

    async def signal_job(self, job_id: int, signal: str) -> Invocation:
        """Signal the whole job: the batch shell and every step, so each can checkpoint."""
        ...

    async def requeue_hold(self, job_id: int) -> Invocation: ...

    async def set_excluded_nodes(self, job_id: int, nodes: list[str]) -> Invocation: ...

    async def set_required_nodes(self, job_id: int, nodes: list[str]) -> Invocation: ...

    async def release_job(self, job_id: int) -> Invocation: ...
