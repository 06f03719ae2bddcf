"""Slurm access behind one small interface, with a CLI backend and a slurmrestd backend.

`SlurmClient` routes each operation to slurmrestd where the server's API version can do it and to
the CLI where it cannot, and says which path it took so that the incident can record it.
"""

from backends.slurm.api import (
    NodeUpdate,
    SlurmBackend,
    SlurmCommandError,
    SlurmError,
    SlurmNotFound,
    SlurmUnavailable,
    Unsupported,
)
from backends.slurm.cli import SlurmCli
from backends.slurm.client import SlurmClient
from backends.slurm.rest import SlurmRest, TokenFile

__all__ = [
    "NodeUpdate",
    "SlurmBackend",
    "SlurmCli",
    "SlurmClient",
    "SlurmCommandError",
    "SlurmError",
    "SlurmNotFound",
    "SlurmRest",
    "SlurmUnavailable",
    "TokenFile",
    "Unsupported",
]
