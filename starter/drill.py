"""The recovery drill: a real training job loses a (fake) GPU on the local Slurm cluster, and the
incident must bring it back from its latest complete checkpoint.

Nothing breaks hardware: the failure is a fault marker that the reference job reads as a lost
GPU, plus an alert sent exactly as the alert hooks send it.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, Field
from temporalio.client import Client, WorkflowHandle

from activities.xid_policy import XidPolicyTable
from backends.slurm import SlurmCli
from backends.replacement import SPARE_STANDBY_REASON
from contracts.models import FaultClass, IncidentReport, NodeFailureAlert, RecoveryPolicy, SlurmJob
from starter.alerts import raise_alert
from starter.localstack import LocalStack, StackError, wait_async
from workflows.node_recovery import NodeRecoveryWorkflow
from trainer import checkpoint as ckpt

DRILL_JOB_NAME = "recovery-drill"


class DrillOptions(BaseModel):
    xid: int = 79
    node: str | None = None
    corrupt_latest_checkpoint: bool = False
    dry_run: bool = False  # observe mode: the incident describes what it would do and does nothing
    step_seconds: float = 0.2
    checkpoint_every: int = 10
    checkpoints_before_failure: int = 2
    timeout_seconds: float = 300.0


class DrillCheck(BaseModel):
    name: str
    passed: bool
    detail: str = ""


class DrillResult(BaseModel):
    report: IncidentReport
    job_id: int
    run_dir: str
    corrupted_checkpoint: str | None = None
    checks: list[DrillCheck] = Field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def as_json(self) -> dict:
        return {
            **self.report.model_dump(mode="json"),
            "drill": {
                "passed": self.passed, "job_id": self.job_id, "run_dir": self.run_dir,
                "corrupted_checkpoint": self.corrupted_checkpoint,
                "checks": [c.model_dump() for c in self.checks],
            },
        }


@dataclass
class DrillRun:
    job_id: int
    run_dir: Path
    node: str
    fault_class: FaultClass
    corrupted: str | None
    handle: WorkflowHandle
    slurm_before: str | None = None  # dry-run: Slurm's state when the alert was sent


class Drill:
    def __init__(self, client: Client, stack: LocalStack, cluster: dict[str, str], policy: RecoveryPolicy,
                 xid_table: XidPolicyTable, say: Callable[[str], None] = lambda _: None):
        self.client, self.stack, self.cluster, self.policy = client, stack, cluster, policy
        self.xid_table = xid_table
        self.say = say
        self.slurm = SlurmCli(slurm_conf=cluster["SLURM_CONF"], bin_dir=cluster.get("SLURM_BIN_DIR", ""))
        self._t0 = time.monotonic()

    def _log(self, text: str) -> None:
        self.say(f"[{time.monotonic() - self._t0:6.1f}s] {text}")

    async def run(self, opts: DrillOptions) -> DrillResult:
        return await self.finish(await self.start(opts), opts.timeout_seconds)

    async def start(self, opts: DrillOptions,
                    before_fault: Callable[[SlurmJob, str], Awaitable[None]] | None = None) -> DrillRun:
        """Everything up to the alert: a training job with checkpoints, a failed GPU, the alert.
        `before_fault(job, node)` lets a test set a scene (say, an operator's drain) first."""
        fault_class = self.xid_table.classify(opts.xid).fault_class
        await self.reset_cluster()
        run_dir = self.stack.drills_dir / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        job_id = await self.submit_reference_job(run_dir, opts)
        self._log(f"reference job {job_id} submitted across 2 nodes; checkpoints in {run_dir}")
        job = await wait_async(lambda: self._running(job_id), 60, f"job {job_id} to run")
        await wait_async(lambda: self._complete_checkpoints(run_dir, opts.checkpoints_before_failure), 120,
                         f"{opts.checkpoints_before_failure} complete checkpoints")
        node = opts.node or job.nodes[-1]
        self._log(f"job {job_id} runs on {','.join(job.nodes)}; failing {node} with XID {opts.xid} ({fault_class})")
        if before_fault is not None:
            await before_fault(job, node)

        corrupted = slurm_before = None
        if opts.dry_run:
            # Nothing is broken in observe mode: the alert alone, and Slurm must not change.
            slurm_before = await self.slurm_state()
        else:
            self.inject_fault(node, opts.xid, gpu_lost=fault_class == FaultClass.FATAL)
        if fault_class == FaultClass.FATAL and node in job.nodes and not opts.dry_run:
            await wait_async(lambda: self._stalled(run_dir), 30, "the job to stall on the lost GPU")
            self._log("training stalled on the lost GPU")
        if opts.corrupt_latest_checkpoint:
            corrupted = corrupt_latest_checkpoint(run_dir)
            self._log(f"made the newest checkpoint {corrupted} incomplete")

        alert = NodeFailureAlert(
            node=node, xid=opts.xid, source="drill", actor=f"drill by {getpass.getuser()}",
            reason=f"injected XID {opts.xid} on {node}", message="NVRM: Xid (drill)",
        )
        policy = self.policy.model_copy(update={"dry_run": opts.dry_run})
        handle = await raise_alert(self.client, alert, self.stack.task_queue, policy)
        self._log(f"alert sent: incident workflow {handle.id}")
        return DrillRun(job_id=job_id, run_dir=run_dir, node=node, fault_class=fault_class,
                        corrupted=corrupted, handle=handle, slurm_before=slurm_before)

    async def finish(self, run: DrillRun, timeout: float) -> DrillResult:
        """Follow the incident to its end, check what the drill promises, stop the job."""
        report = await self.follow(run.handle, timeout)
        if run.slurm_before is not None:
            checks = await self.check_dry_run(report, run, run.slurm_before)
        else:
            checks = await self.check(report, run.job_id, run.node, run.fault_class, run.corrupted)
        await self.slurm.run("scancel", str(run.job_id))
        return DrillResult(report=report, job_id=run.job_id, run_dir=str(run.run_dir),
                           corrupted_checkpoint=run.corrupted, checks=checks)

    # --- set-up --------------------------------------------------------------------------------

    async def reset_cluster(self) -> None:
        """Back to the drill's starting point: no drill jobs, no faults, every compute node in
        service and every spare on standby."""
        await self.slurm.run("scancel", f"--name={DRILL_JOB_NAME}")
        for marker in self.stack.fault_dir.glob("*"):
            marker.unlink()
        spares = [n for n in self.cluster.get("SLURM_SPARE_NODES", "").split(",") if n]
        for node in await self.slurm.list_nodes():
            if node.name in spares:
                if node.comment:
                    await self.slurm.set_node_comment(node.name, "")
                if not (node.drained and node.reason.endswith(SPARE_STANDBY_REASON)):
                    await self.slurm.update_node(node.name, "DRAIN", f"{self.policy.owner}: {SPARE_STANDBY_REASON}")
            elif node.drained or node.state == "down":
                await self.slurm.update_node(node.name, "RESUME", None)

        async def compute_nodes_idle() -> bool:
            compute = [node for node in await self.slurm.list_nodes() if node.name not in spares]
            return bool(compute) and all(node.in_service and node.state == "idle" for node in compute)

        await wait_async(compute_nodes_idle, 60, "every compute node to be idle")

    async def submit_reference_job(self, run_dir: Path, opts: DrillOptions) -> int:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.stack.fault_dir.mkdir(parents=True, exist_ok=True)
        out = await self.slurm.run(
            "sbatch", "--parsable", f"--job-name={DRILL_JOB_NAME}", "--nodes=2", "--ntasks-per-node=1",
            "--requeue", f"--comment=checkpoint_dir={run_dir}", f"--chdir={run_dir}",
            f"--output={run_dir}/slurm-%j.out",
            f"--export=ALL,PYTHONPATH={self.stack.trainer_pythonpath},TRAINER_PYTHON={self.stack.trainer_python}",
            str(self.stack.trainer_script),
            "--run-dir", str(run_dir), "--step-seconds", str(opts.step_seconds),
            "--checkpoint-every", str(opts.checkpoint_every), "--fault-dir", str(self.stack.fault_dir),
        )
        return int(out.strip().split(";")[0])

    def inject_fault(self, node: str, xid: int, gpu_lost: bool) -> None:
        self.stack.fault_dir.mkdir(parents=True, exist_ok=True)
        (self.stack.fault_dir / node).write_text(json.dumps({"xid": xid, "gpu_lost": gpu_lost}))

    async def _running(self, job_id: int):
        job = await self.slurm.get_job(job_id)
        return job if job.state == "RUNNING" else None

    async def _complete_checkpoints(self, run_dir: Path, count: int) -> bool:
        statuses = await asyncio.to_thread(ckpt.list_checkpoints, run_dir)
        return sum(s.complete for s in statuses) >= count

    async def _stalled(self, run_dir: Path) -> bool:
        progress = await asyncio.to_thread(ckpt.read_progress, run_dir)
        return bool(progress and progress.get("state") == "stalled")

    # --- follow and check ----------------------------------------------------------------------

    async def follow(self, handle, timeout: float) -> IncidentReport:
        result = asyncio.ensure_future(handle.result())
        seen = ""
        deadline = time.monotonic() + timeout
        while not result.done():
            if time.monotonic() > deadline:
                result.cancel()
                raise StackError(f"the incident did not finish within {timeout:.0f} s (see `recovery status`)")
            try:
                phase = (await handle.query(NodeRecoveryWorkflow.status)).phase
            except Exception:  # the query can race the run's start; the next poll will answer
                phase = seen
            if phase != seen:
                self._log(f"phase: {phase}")
                seen = phase
            await asyncio.wait([result], timeout=0.5)
        return await result

    async def slurm_state(self) -> str:
        """Every node's state, flags, reason and comment and every job's state, nodes, restart
        count and exclusions, as text: two equal snapshots mean Slurm saw no write."""
        nodes = [n.model_dump(include={"name", "state", "flags", "reason", "comment"})
                 for n in await self.slurm.list_nodes()]
        jobs = [j.model_dump(include={"job_id", "state", "nodes", "restart_count", "excluded_nodes", "priority"})
                for j in await self.slurm.list_jobs()]
        return json.dumps({"nodes": nodes, "jobs": jobs}, sort_keys=True)

    async def check_dry_run(self, report: IncidentReport, run: DrillRun, before: str) -> list[DrillCheck]:
        after = await self.slurm_state()
        signalled = [p.name for p in run.run_dir.glob("slurm-*.out") if "SIGUSR1" in p.read_text()]
        live = await self.slurm.get_node(run.node)
        uncommanded = [a.action for a in report.intended_actions if not a.command]
        executed = [a.action for a in report.actions if a.path != "none"]  # "none": a decision, no call
        return [
            DrillCheck(name="dry-run outcome", passed=report.dry_run and report.outcome.startswith("dry_run"),
                       detail=report.outcome),
            DrillCheck(name="actions intended, each with its command",
                       passed=bool(report.intended_actions) and not uncommanded and not executed,
                       detail=f"{len(report.intended_actions)} intended; without a command: {uncommanded}; "
                       f"executed: {executed}"),
            DrillCheck(name="Slurm saw no write", passed=after == before,
                       detail="nodes and jobs unchanged" if after == before else f"before {before}\nafter {after}"),
            DrillCheck(name="node still in service", passed=live.in_service, detail=f"{run.node}: {live.state} {live.flags}"),
            DrillCheck(name="job not signalled", passed=not signalled, detail=f"SIGUSR1 in {signalled or 'no log'}"),
        ]

    async def check(self, report: IncidentReport, job_id: int, node: str, fault_class: FaultClass,
                    corrupted: str | None) -> list[DrillCheck]:
        checks = []
        if fault_class in (FaultClass.FATAL, FaultClass.DEGRADING):
            checks.append(DrillCheck(name="recovered", passed=report.outcome == "recovered", detail=report.outcome))
            job = next((j for j in report.jobs if j.job_id == job_id), None)
            checks.append(DrillCheck(
                name="job moved off the failed node",
                passed=job is not None and bool(job.nodes_after) and node not in job.nodes_after,
                detail=f"before {job.nodes_before if job else '?'}, after {job.nodes_after if job else '?'}",
            ))
            if corrupted:
                skipped = [s.checkpoint_id for s in report.skipped_checkpoints]
                checks.append(DrillCheck(
                    name="incomplete checkpoint skipped",
                    passed=corrupted in skipped and report.resumed_step is not None
                    and f"step-{report.resumed_step:09d}" < corrupted,
                    detail=f"corrupted {corrupted}; resumed at step {report.resumed_step}; skipped {skipped}",
                ))
        elif fault_class == FaultClass.APPLICATION:
            live = await self.slurm.get_node(node)
            job = await self.slurm.get_job(job_id)
            checks.append(DrillCheck(name="no node action", passed=report.outcome == "no_node_action"
                                     and live.in_service, detail=f"{node}: {live.state} {live.flags}"))
            checks.append(DrillCheck(name="job kept running", passed=job.state == "RUNNING"
                                     and job.restart_count == 0, detail=f"{job.state}, restarts {job.restart_count}"))
        else:
            live = await self.slurm.get_node(node)
            checks.append(DrillCheck(name="drained and escalated", passed=report.outcome.startswith("escalated")
                                     and live.drained, detail=report.outcome))
        return checks


def corrupt_latest_checkpoint(run_dir: Path) -> str:
    """Truncate a payload file of the newest complete checkpoint, making it incomplete."""
    latest, _ = ckpt.find_latest_complete(run_dir)
    if latest is None:
        raise StackError(f"no complete checkpoint to corrupt in {run_dir}")
    payload = next(p for p in sorted(latest.path.iterdir()) if p.name != "manifest.json")
    data = payload.read_bytes()
    with open(payload, "wb") as f:
        f.write(data[: len(data) // 2])
        os.fsync(f.fileno())
    return latest.checkpoint_id
