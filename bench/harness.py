"""The scale harness: the project's Slurm backend protocol (backends/slurm/api.py) answered from
memory, each call after the latency that call takes on the real local cluster.

Slurm cannot run 1,000 real nodes on this machine, so the scale benchmark runs the real workflow
and activities (a real worker, a real Temporal dev server) against this stand-in. What it models:
each call's latency (measured, median), a node per incident with one running job, a hot spare per
node, Slurm's requeue (held, restart count + 1) and the requeued job starting again on the spare
once released and the spare is in service. No health check is configured, so a failed node
counts as repaired at once: the incident's return-to-service watcher resumes it at its first
look. What it does not: slurmctld's own locking and CPU (the calls run concurrently, as many as
are issued), the CPU a real CLI call costs the worker (fork, exec, JSON), and a job listing slower
with 1,000 jobs than with the few measured.

Every call is appended to a call log (one line: epoch seconds, operation, target, detail), from
which the benchmark reads when each node was drained and each job signalled.
"""

from __future__ import annotations

import asyncio
import time
from typing import TextIO, get_args

from backends.replacement import SPARE_STANDBY_REASON
from backends.slurm.api import NodeUpdate, SlurmCommandError, SlurmNotFound, SlurmOperation
from contracts.models import Invocation, SlurmJob, SlurmNode

OPERATIONS: tuple[SlurmOperation, ...] = get_args(SlurmOperation)
_HOLDS = ("RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING")


def node_name(i: int) -> str:
    return f"node-{i:04d}"


def spare_name(i: int) -> str:
    return f"spare-{i:04d}"


PARTITION = "gpu"


class ScaleSlurm:
    """SlurmBackend in memory: `nodes` nodes, each running one job (job id i+1 on node i), and
    one hot spare per node, drained on standby."""

    path = "cli"  # the path the incident records for each action; the harness stands in for Slurm
    dry_run = False

    def __init__(
        self, nodes: int, latency: dict[str, float], call_log: TextIO | None = None, restart_delay: float = 2.0
    ) -> None:
        self.latency = latency
        self.call_log = call_log
        self.restart_delay = restart_delay
        self.nodes: dict[str, SlurmNode] = {}
        self.jobs: dict[int, SlurmJob] = {}
        self._spare_of: dict[int, str] = {}
        self._starts_at: dict[int, float] = {}  # a released job starts at (monotonic)
        for i in range(nodes):
            self.nodes[node_name(i)] = SlurmNode(name=node_name(i), state="allocated", partitions=[PARTITION])
            self.nodes[spare_name(i)] = SlurmNode(
                name=spare_name(i),
                state="idle",
                flags=["DRAIN"],
                reason=f"recovery: {SPARE_STANDBY_REASON}",
                partitions=[PARTITION],
            )
            self.jobs[i + 1] = SlurmJob(
                job_id=i + 1, name=f"train-{i}", state="RUNNING", nodes=[node_name(i)], priority=1
            )
            self._spare_of[i + 1] = spare_name(i)

    def supports(self, operation: SlurmOperation) -> bool:
        return True

    async def _call(self, operation: str, target: str, detail: str = "") -> None:
        await asyncio.sleep(self.latency.get(operation, 0.0))
        if self.call_log is not None:
            self.call_log.write(f"{time.time():.6f} {operation} {target} {detail}\n")
            self.call_log.flush()

    def _node(self, name: str) -> SlurmNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise SlurmNotFound(f"Invalid node name specified: {name}") from None

    def _job(self, job_id: int) -> SlurmJob:
        self._start_released(job_id)
        try:
            return self.jobs[job_id]
        except KeyError:
            raise SlurmNotFound(f"Invalid job id specified: {job_id}") from None

    def _start_released(self, job_id: int) -> None:
        """A released job starts on its node's spare once its start time came and the spare is in
        service, as Slurm would schedule it there."""
        starts_at = self._starts_at.get(job_id)
        spare = self.nodes[self._spare_of[job_id]] if job_id in self._spare_of else None
        if starts_at is None or time.monotonic() < starts_at or spare is None or not spare.in_service:
            return
        del self._starts_at[job_id]
        job = self.jobs[job_id]
        self.jobs[job_id] = job.model_copy(update={"state": "RUNNING", "state_reason": "None", "nodes": [spare.name]})
        self.nodes[spare.name] = spare.model_copy(update={"state": "allocated"})

    def _write(self, command: str) -> Invocation:
        return Invocation(path=self.path, command=f"scale harness: {command}", executed=not self.dry_run)

    # --- reads ---------------------------------------------------------------------------------

    async def get_node(self, name: str) -> SlurmNode:
        await self._call("get_node", name)
        return self._node(name).model_copy()

    async def list_nodes(self) -> list[SlurmNode]:
        await self._call("list_nodes", "*")
        return [node.model_copy() for node in self.nodes.values()]

    async def list_jobs(self) -> list[SlurmJob]:
        await self._call("list_jobs", "*")
        return [self._job(job_id).model_copy() for job_id in list(self.jobs)]

    async def jobs_on(self, node: str) -> list[SlurmJob]:
        """Not in the protocol: `squeue -w NODE` for the bare baseline script, which lets Slurm
        filter (a listing's latency, none of its copying)."""
        await self._call("list_jobs", node)
        return [job.model_copy() for job in self.jobs.values() if node in job.nodes]

    async def get_job(self, job_id: int) -> SlurmJob:
        await self._call("get_job", str(job_id))
        return self._job(job_id).model_copy()

    # --- writes --------------------------------------------------------------------------------

    async def update_node(self, name: str, state: NodeUpdate, reason: str | None) -> Invocation:
        await self._call("update_node", name, state)
        node = self._node(name)
        if state in ("DRAIN", "DOWN") and not reason:
            raise SlurmCommandError(
                ["scontrol", "update", f"NodeName={name}", f"State={state}"],
                1,
                "You must specify a reason when DOWNING or DRAINING a node. Request denied",
            )
        if self.dry_run:
            return self._write(f"update_node {name} {state}")
        if state == "DRAIN":
            update = {"flags": sorted({*node.flags, "DRAIN"}), "reason": reason}
        elif state == "DOWN":
            update = {"state": "down", "reason": reason}
        else:
            update = {
                "state": "idle" if node.state == "down" else node.state,
                "flags": [f for f in node.flags if f != "DRAIN"],
                "reason": "",
            }
        self.nodes[name] = node.model_copy(update=update)
        return self._write(f"update_node {name} {state}")

    async def set_node_comment(self, name: str, comment: str) -> Invocation:
        await self._call("set_node_comment", name)
        node = self._node(name)
        if not self.dry_run:
            self.nodes[name] = node.model_copy(update={"comment": comment})
        return self._write(f"set_node_comment {name}")

    async def signal_job(self, job_id: int, signal: str) -> Invocation:
        await self._call("signal_job", str(job_id), signal)
        if self._job(job_id).state not in _HOLDS:
            raise SlurmCommandError(["scancel", f"--signal={signal}", str(job_id)], 1, "Job is pending execution")
        return self._write(f"signal_job {job_id} {signal}")

    async def requeue_hold(self, job_id: int) -> Invocation:
        await self._call("requeue_hold", str(job_id))
        job = self._job(job_id)
        if job.state not in _HOLDS:
            raise SlurmCommandError(["scontrol", "requeuehold", str(job_id)], 1, "Job is pending execution")
        if not self.dry_run:
            for name in job.nodes:
                self.nodes[name] = self.nodes[name].model_copy(update={"state": "idle"})
            self.jobs[job_id] = job.model_copy(
                update={
                    "state": "PENDING",
                    "state_reason": "job_requeued_in_held_state",
                    "priority": 0,
                    "nodes": [],
                    "restart_count": job.restart_count + 1,
                }
            )
        return self._write(f"requeue_hold {job_id}")

    async def set_excluded_nodes(self, job_id: int, nodes: list[str]) -> Invocation:
        await self._call("set_excluded_nodes", str(job_id), ",".join(nodes))
        job = self._job(job_id)
        if not self.dry_run:
            self.jobs[job_id] = job.model_copy(update={"excluded_nodes": list(nodes)})
        return self._write(f"set_excluded_nodes {job_id}")

    async def set_required_nodes(self, job_id: int, nodes: list[str]) -> Invocation:
        await self._call("set_required_nodes", str(job_id), ",".join(nodes))
        job = self._job(job_id)
        if not self.dry_run:
            self.jobs[job_id] = job.model_copy(update={"required_nodes": list(nodes)})
        return self._write(f"set_required_nodes {job_id}")

    async def release_job(self, job_id: int) -> Invocation:
        await self._call("release_job", str(job_id))
        job = self._job(job_id)
        if not self.dry_run and job.held:
            self.jobs[job_id] = job.model_copy(update={"priority": 1, "state_reason": "BeginTime"})
            self._starts_at[job_id] = time.monotonic() + self.restart_delay
        return self._write(f"release_job {job_id}")
