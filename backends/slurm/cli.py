"""Slurm through its command-line tools: argv lists, never a shell."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from typing import Any

from backends.slurm.api import (
    NodeUpdate,
    SlurmCommandError,
    SlurmNotFound,
    SlurmOperation,
    SlurmUnavailable,
)
from backends.slurm.parse import job_from_json, node_from_json
from contracts.models import Invocation, SlurmJob, SlurmNode

# Messages with which scontrol says a node or job does not exist: no retry can fix those.
_NOT_FOUND = ("Invalid node name specified", "Invalid job id specified")
# Messages that mean slurmctld could not be reached: the state is unknown.
# "Unexpected message received": what `scontrol requeuehold` says when slurmctld cannot be
# reached (measured on 22.05 and 24.11): an unknown state, retried like the others.
_UNREACHABLE = (
    "Unable to contact slurm controller",
    "Socket timed out",
    "Connection refused",
    "Unexpected message received",
)


class SlurmCli:
    path = "cli"
    # In dry-run every write is described, not run (SlurmClient.planning()); reads still run.
    dry_run = False

    def __init__(self, slurm_conf: str | None = None, timeout: float = 20.0, bin_dir: str = ""):
        self._env = dict(os.environ)
        if slurm_conf:
            self._env["SLURM_CONF"] = slurm_conf
        # A SLURM_JWT in the environment would switch the tools to JWT auth; they use munge here.
        self._env.pop("SLURM_JWT", None)
        self._timeout = timeout
        self._bin_dir = bin_dir
        self._version: tuple[int, int] | None = None

    def supports(self, operation: SlurmOperation) -> bool:
        return True

    async def run(self, *argv: str) -> str:
        cmd = [os.path.join(self._bin_dir, argv[0]) if self._bin_dir else argv[0], *argv[1:]]
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env,
            )
        except FileNotFoundError as e:
            raise SlurmUnavailable(f"{argv[0]} is not installed: {e}") from e
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self._timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            proc.kill()
            await proc.wait()
            raise
        stderr = err.decode(errors="replace")
        if proc.returncode != 0:
            if any(m in stderr for m in _NOT_FOUND):
                raise SlurmNotFound(stderr.strip())
            if any(m in stderr for m in _UNREACHABLE):
                raise SlurmUnavailable(stderr.strip())
            raise SlurmCommandError(list(argv), proc.returncode or -1, stderr)
        return out.decode(errors="replace")

    async def _json(self, *argv: str) -> dict[str, Any]:
        out = await self.run(*argv)
        try:
            data = json.loads(out)
        except json.JSONDecodeError as e:
            raise SlurmUnavailable(f"{argv[0]} printed no JSON: {out[:200]!r}") from e
        # 22.05's sinfo and squeue --json exit 0 when slurmctld cannot be reached: the lists are
        # empty and the failure is in `errors`. That is an unknown state, not an empty cluster.
        if not isinstance(data, dict):
            raise SlurmUnavailable(f"{argv[0]} printed JSON that is not an object: {out[:200]!r}")
        if data.get("errors"):
            raise SlurmUnavailable(f"{argv[0]} could not read slurmctld: {data['errors']}")
        return data

    async def version(self) -> tuple[int, int]:
        """The Slurm generation of these tools, e.g. (22, 5); asked once."""
        if self._version is None:
            out = await self.run("scontrol", "--version")  # "slurm-wlm 24.11.5" or "slurm 22.05.8"
            major, minor = out.split()[-1].split(".")[:2]
            self._version = (int(major), int(minor))
        return self._version

    async def list_nodes(self) -> list[SlurmNode]:
        # 23.02+ has `scontrol show node --json` (its sinfo --json groups nodes by state);
        # 22.05 has no scontrol --json, and its sinfo --json lists nodes one by one.
        if await self.version() >= (23, 2):
            data = await self._json("scontrol", "show", "node", "--json")
        else:
            data = await self._json("sinfo", "--json")
        return [node_from_json(raw) for raw in data.get("nodes", [])]

    async def get_node(self, name: str) -> SlurmNode:
        # 22.05's sinfo --json ignores -n, so every node comes back: pick ours.
        for node in await self.list_nodes():
            if node.name == name:
                return node
        raise SlurmNotFound(f"node {name} is not in this cluster")

    async def list_jobs(self) -> list[SlurmJob]:
        # Every job slurmctld still knows, finished ones included (MinJobAge): 22.05's
        # squeue --json lists them all; from 23.02 on, squeue leaves finished jobs out and
        # `scontrol show job --json` has them.
        if await self.version() >= (23, 2):
            data = await self._json("scontrol", "show", "job", "--json")
        else:
            data = await self._json("squeue", "--json")
        return [job_from_json(raw) for raw in data.get("jobs", [])]

    async def get_job(self, job_id: int) -> SlurmJob:
        # 22.05's squeue --json ignores -j as well.
        for job in await self.list_jobs():
            if job.job_id == job_id:
                return job
        raise SlurmNotFound(f"job {job_id} is not known to slurmctld")

    async def _write(self, *argv: str) -> Invocation:
        call = Invocation(path=self.path, command=shlex.join(argv), executed=not self.dry_run)
        if not self.dry_run:
            await self.run(*argv)
        return call

    async def update_node(self, name: str, state: NodeUpdate, reason: str | None) -> Invocation:
        argv = ["scontrol", "update", f"NodeName={name}", f"State={state}"]
        if reason is not None:
            argv.append(f"Reason={reason}")
        return await self._write(*argv)

    async def set_node_comment(self, name: str, comment: str) -> Invocation:
        return await self._write("scontrol", "update", f"NodeName={name}", f"Comment={comment}")

    async def signal_job(self, job_id: int, signal: str) -> Invocation:
        return await self._write("scancel", f"--signal={signal}", "--full", str(job_id))

    async def requeue_hold(self, job_id: int) -> Invocation:
        return await self._write("scontrol", "requeuehold", str(job_id))

    async def set_excluded_nodes(self, job_id: int, nodes: list[str]) -> Invocation:
        return await self._write("scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}")

    async def set_required_nodes(self, job_id: int, nodes: list[str]) -> Invocation:
        return await self._write("scontrol", "update", f"JobId={job_id}", f"ReqNodeList={','.join(nodes)}")

    async def release_job(self, job_id: int) -> Invocation:
        return await self._write("scontrol", "release", str(job_id))
