"""The recovery drill: a real training job loses a (fake) GPU on the local Slurm cluster, and the
incident must bring it back from its latest complete checkpoint.

Nothing breaks hardware: the failure is a fault marker that the reference job reads as a lost
GPU, plus an alert sent exactly as the alert hooks send it.

With `k8s`, the same cluster runs as Slurm on Kubernetes: the in-repo API server holds a simulated
Slinky cluster mirroring it (kubesim/slinky.py), and the incident also fences the Node, evicts the
slurmd pod once Slurm has let go of the node, and waits for the replacement Node.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from kubernetes import client as kube, config as kube_config
from pydantic import BaseModel, Field, model_validator
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from activities.xid_policy import XidPolicyTable
from backends.checkpoints import ADAPTERS, dcp
from backends.checkpoints.formats import step_in_name
from backends.replacement import SPARE_STANDBY_REASON
from backends.slurm import SlurmCli, SlurmCommandError, SlurmError, SlurmRest, TokenFile
from contracts.k8s_settings import KubernetesSettings
from contracts.kubernetes import ScalingMode
from contracts.models import (
    CheckpointFormat,
    FaultClass,
    IncidentReport,
    NodeFailureAlert,
    OutcomeKind,
    RecoveryPolicy,
    SlurmJob,
    SlurmNode,
)
from contracts.settings import Settings, load_settings
from drills.localstack import LocalStack, StackError, wait_async
from kubesim.server import KubeApiServer
from kubesim.slinky import GPU_RESOURCE, SLURMD_SELECTOR, SlinkyCluster, can_take_slurmd, is_ready
from starter.alerts import raise_alert
from trainer import checkpoint as ckpt
from worker import activities_for, build_slurm, serving
from workflows.node_recovery import NodeRecoveryWorkflow

DRILL_JOB_NAME = "recovery-drill"
# How the newest checkpoint is made incomplete: the reference trainer's (a payload file truncated or
# changed, no manifest, a listed file missing, a newer one caught mid-write, every one truncated),
# or a DCP checkpoint's (a save cut off before .metadata, a shard truncated after it)
CheckpointCorruption = Literal[
    "truncated", "checksum", "no_manifest", "missing_file", "being_written", "all", "no_metadata", "truncated_shard"
]
DCP_CORRUPTIONS = ("no_metadata", "truncated_shard")
Trainer = Literal["reference", "torch"]
# The job each trainer runs (trainer/), and the checkpoint format it writes
TRAINER_MODULES = {"reference": "trainer.job", "torch": "trainer.torch_job"}
TRAINER_FORMATS = {"reference": CheckpointFormat.REFERENCE, "torch": CheckpointFormat.DCP}


class DrillOptions(BaseModel):
    xid: int = 79
    node: str | None = None
    # the reference trainer, or a real distributed PyTorch job with DCP checkpoints (PyTorch installed)
    trainer: Trainer = "reference"
    corrupt_latest_checkpoint: bool = False
    corruption: CheckpointCorruption | None = None  # how: "truncated", or "no_metadata" for the torch trainer
    dry_run: bool = False  # observe mode: the incident describes what it would do and does nothing
    k8s: bool = False  # Slurm on Kubernetes: a simulated Slinky cluster, and the incident's Kubernetes steps
    # how its NodeSet scales: StatefulSet (Slinky's default) recreates the lost slurmd pod, Slurm node
    # and all, on another Node; DaemonSet runs one per Node, so the replacement is a new Node (asked
    # of the node lifecycle)
    k8s_scaling_mode: ScalingMode = "StatefulSet"
    step_seconds: float = 0.2
    checkpoint_every: int = 10
    checkpoints_before_failure: int = 2
    timeout_seconds: float = 300.0
    pinned_to: list[str] = Field(default_factory=list, description="the reference job's nodes, pinned (sbatch -w)")
    job_nodes: int = Field(2, ge=1, description="the nodes the reference job trains across")
    expedited_requeue: bool = Field(
        False, description="submit the reference job --requeue=expedite (Slurm 25.11+) instead of --requeue"
    )
    rank_crashes: bool = Field(
        False,
        description="the lost GPU's rank crashes (as a CUDA error ends it) in a job run with srun "
        "--kill-on-bad-exit=1, as torchrun jobs often are: the job ends FAILED before the alert is sent",
    )

    @model_validator(mode="after")
    def _corruption_fits_the_trainer(self) -> DrillOptions:
        if self.corruption is None:
            self.corruption = "no_metadata" if self.trainer == "torch" else "truncated"
        elif (self.corruption in DCP_CORRUPTIONS) != (self.trainer == "torch"):
            raise ValueError(f"corruption {self.corruption} does not apply to the {self.trainer} trainer's checkpoints")
        return self


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
    # the exact Slurm the drill ran on (sid's moves on from day to day) and the slurmrestd API
    # version a worker picks on it; each action's path is in the report's actions
    slurm_version: str = ""
    slurmrestd_version: str | None = None

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def as_json(self) -> dict:
        return {
            **self.report.model_dump(mode="json"),
            "drill": {
                "passed": self.passed,
                "job_id": self.job_id,
                "run_dir": self.run_dir,
                "corrupted_checkpoint": self.corrupted_checkpoint,
                "checks": [c.model_dump() for c in self.checks],
                "slurm_version": self.slurm_version,
                "slurmrestd_version": self.slurmrestd_version,
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
    kubernetes: SimulatedKubernetes | None = None  # a k8s drill's Kubernetes side
    corruption: CheckpointCorruption | None = None


class Drill:
    def __init__(
        self,
        client: Client,
        stack: LocalStack,
        cluster: dict[str, str],
        policy: RecoveryPolicy,
        xid_table: XidPolicyTable,
        say: Callable[[str], None] = lambda _: None,
    ):
        self.client, self.stack, self.cluster, self.policy = client, stack, cluster, policy
        self.xid_table = xid_table
        self.say = say
        self.slurm = SlurmCli(slurm_conf=cluster["SLURM_CONF"], bin_dir=cluster.get("SLURM_BIN_DIR", ""))
        self._t0 = time.monotonic()

    def _log(self, text: str) -> None:
        self.say(f"[{time.monotonic() - self._t0:6.1f}s] {text}")

    @property
    def spare_nodes(self) -> list[str]:
        return [n for n in self.cluster.get("SLURM_SPARE_NODES", "").split(",") if n]

    async def run(self, opts: DrillOptions) -> DrillResult:
        if not opts.k8s:
            return await self.finish(await self.start(opts), opts.timeout_seconds)
        async with SimulatedKubernetes(self, scaling_mode=opts.k8s_scaling_mode) as kubernetes:
            return await self.finish(await self.start(opts, kubernetes=kubernetes), opts.timeout_seconds)

    async def start(
        self,
        opts: DrillOptions,
        before_fault: Callable[[SlurmJob, str], Awaitable[None]] | None = None,
        kubernetes: SimulatedKubernetes | None = None,
    ) -> DrillRun:
        """Everything up to the alert: a training job with checkpoints, a failed GPU, the alert.
        `before_fault(job, node)` lets a test set a scene (say, an operator's drain) first; with
        `kubernetes`, the incident runs on Slurm on Kubernetes."""
        fault_class = self.xid_table.classify(opts.xid).fault_class
        job, run_dir = await self.start_training(opts)
        job_id = job.job_id
        node = opts.node or job.nodes[-1]
        self._log(f"job {job_id} runs on {','.join(job.nodes)}; failing {node} with XID {opts.xid} ({fault_class})")
        if before_fault is not None:
            await before_fault(job, node)

        corrupted = slurm_before = None
        if opts.dry_run:
            # Nothing is broken in observe mode: the alert alone, and Slurm must not change.
            slurm_before = await self.slurm_state(node)
        else:
            self.inject_fault(node, opts.xid, gpu_lost=fault_class == FaultClass.FATAL, crash=opts.rank_crashes)
        if opts.rank_crashes and not opts.dry_run:
            await wait_async(lambda: self._failed(job_id), 60, f"job {job_id} to end of the crash")
            self._log(f"job {job_id} ended FAILED: its rank on {node} crashed, and srun ended the rest")
        elif fault_class == FaultClass.FATAL and node in job.nodes and not opts.dry_run:
            await wait_async(lambda: self._stalled(run_dir), 30, "the job to stall on the lost GPU")
            self._log("training stalled on the lost GPU")
        if opts.corrupt_latest_checkpoint:
            assert opts.corruption is not None  # set by DrillOptions
            corrupted = corrupt_latest_checkpoint(run_dir, opts.corruption)
            self._log(f"made the newest checkpoint {corrupted} incomplete")

        alert = NodeFailureAlert(
            node=node,
            xid=opts.xid,
            source="drill",
            actor=f"drill by {getpass.getuser()}",
            reason=f"injected XID {opts.xid} on {node}",
            message="NVRM: Xid (drill)",
        )
        policy = self.policy.model_copy(update={"dry_run": opts.dry_run})
        task_queue = self.stack.task_queue
        if kubernetes is not None:
            policy, task_queue = policy.model_copy(update={"kubernetes": True}), kubernetes.task_queue
        handle = await raise_alert(self.client, alert, task_queue, policy)
        self._log(f"alert sent: incident workflow {handle.id}")
        return DrillRun(
            job_id=job_id,
            run_dir=run_dir,
            node=node,
            fault_class=fault_class,
            corrupted=corrupted,
            handle=handle,
            slurm_before=slurm_before,
            kubernetes=kubernetes,
            corruption=opts.corruption if corrupted else None,
        )

    async def finish(self, run: DrillRun, timeout: float) -> DrillResult:
        """Follow the incident to its end, check what the drill promises, stop the job."""
        report = await self.follow(run.handle, timeout)
        if run.slurm_before is not None:
            checks = await self.check_dry_run(report, run, run.slurm_before)
        else:
            checks = await self.check(report, run.job_id, run.node, run.fault_class, run.corrupted, run.corruption)
        if run.kubernetes is not None:
            checks += await run.kubernetes.check(report, run)
            await run.kubernetes.end_return_to_service(report)
        await self.slurm.run("scancel", str(run.job_id))
        return DrillResult(
            report=report,
            job_id=run.job_id,
            run_dir=str(run.run_dir),
            corrupted_checkpoint=run.corrupted,
            checks=checks,
            slurm_version=self.cluster.get("SLURM_VERSION", ""),
            slurmrestd_version=await self.slurmrestd_version(),
        )

    async def slurmrestd_version(self) -> str | None:
        """The API version a worker picks on this cluster's slurmrestd (None: it has none that works)."""
        url, token_file = self.cluster.get("SLURMRESTD_URL"), self.cluster.get("SLURMRESTD_TOKEN_FILE")
        if not (url and token_file):
            return None
        rest = SlurmRest(url, self.cluster.get("SLURMRESTD_USER", "root"), TokenFile(Path(token_file)))
        try:
            return await rest.discover()
        except SlurmError:
            return None
        finally:
            await rest.aclose()

    # --- set-up --------------------------------------------------------------------------------

    async def start_training(self, opts: DrillOptions) -> tuple[SlurmJob, Path]:
        """A clean cluster and the reference job training across its nodes, with its first checkpoints."""
        await self.reset_cluster()
        run_dir = self.stack.drills_dir / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        job_id = await self.submit_training_job(run_dir, opts)
        self._log(f"{opts.trainer} job {job_id} submitted across {opts.job_nodes} nodes; checkpoints in {run_dir}")
        job = await wait_async(lambda: self._running(job_id), 60, f"job {job_id} to run")
        await wait_async(
            lambda: self._complete_checkpoints(run_dir, opts.checkpoints_before_failure, opts.trainer),
            120,
            f"{opts.checkpoints_before_failure} complete checkpoints",
        )
        return job, run_dir

    async def reset_cluster(self) -> None:
        """Back to the drill's starting point: no drill jobs, no faults, every compute node in
        service and every spare on standby."""
        await self.slurm.run("scancel", f"--name={DRILL_JOB_NAME}")
        for marker in self.stack.fault_dir.glob("*"):
            marker.unlink()
        spares = self.spare_nodes
        for node in await self.slurm.list_nodes():
            if node.name in spares:
                if node.comment:
                    await self.slurm.set_node_comment(node.name, "")
                if not (node.drained and node.reason.endswith(SPARE_STANDBY_REASON)):
                    await self.slurm.update_node(node.name, "DRAIN", f"{self.policy.owner}: {SPARE_STANDBY_REASON}")
            elif node.drained or node.state == "down":
                try:
                    await self.slurm.update_node(node.name, "RESUME", None)
                except SlurmCommandError:
                    # A return-to-service watcher of an earlier incident may have resumed it meanwhile.
                    now = await self.slurm.get_node(node.name)
                    if now.drained or now.state == "down":
                        raise

        async def compute_nodes_idle() -> bool:
            compute = [node for node in await self.slurm.list_nodes() if node.name not in spares]
            return bool(compute) and all(node.in_service and node.state == "idle" for node in compute)

        await wait_async(compute_nodes_idle, 60, "every compute node to be idle")

    async def submit_training_job(self, run_dir: Path, opts: DrillOptions) -> int:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.stack.fault_dir.mkdir(parents=True, exist_ok=True)
        out = await self.slurm.run(
            "sbatch",
            "--parsable",
            f"--job-name={DRILL_JOB_NAME}",
            f"--nodes={opts.job_nodes}",
            "--ntasks-per-node=1",
            "--requeue=expedite" if opts.expedited_requeue else "--requeue",
            f"--comment=checkpoint_dir={run_dir};checkpoint_format={TRAINER_FORMATS[opts.trainer].value}",
            f"--chdir={run_dir}",
            *([f"--nodelist={','.join(opts.pinned_to)}"] if opts.pinned_to else []),
            f"--output={run_dir}/slurm-%j.out",
            f"--export=ALL,PYTHONPATH={self.stack.trainer_pythonpath},TRAINER_PYTHON={self.stack.trainer_python},"
            f"TRAINER_MODULE={TRAINER_MODULES[opts.trainer]}"
            + (",TRAINER_KILL_ON_BAD_EXIT=1" if opts.rank_crashes else ""),
            str(self.stack.trainer_script),
            "--run-dir",
            str(run_dir),
            "--step-seconds",
            str(opts.step_seconds),
            "--checkpoint-every",
            str(opts.checkpoint_every),
            "--fault-dir",
            str(self.stack.fault_dir),
        )
        return int(out.strip().split(";")[0])

    def inject_fault(self, node: str, xid: int, gpu_lost: bool, crash: bool = False) -> None:
        self.stack.fault_dir.mkdir(parents=True, exist_ok=True)
        fault = {"xid": xid, "gpu_lost": gpu_lost, **({"crash": True} if crash else {})}
        (self.stack.fault_dir / node).write_text(json.dumps(fault))

    async def _running(self, job_id: int):
        job = await self.slurm.get_job(job_id)
        return job if job.state == "RUNNING" else None

    async def _failed(self, job_id: int):
        return (await self.slurm.get_job(job_id)).state == "FAILED"

    async def _complete_checkpoints(self, run_dir: Path, count: int, trainer: Trainer = "reference") -> bool:
        adapter = ADAPTERS[TRAINER_FORMATS[trainer]]

        def complete() -> int:
            return sum(adapter.verify(c).complete for c in adapter.candidates(run_dir) if not c.being_written)

        return await asyncio.to_thread(complete) >= count

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

    async def slurm_state(self, node: str) -> dict[str, dict]:
        """What an incident on `node` could write, by item: every node's flags, reason, comment and
        state (idle, mixed and allocated all "up"), and the state, nodes, restart count, exclusions
        and priority of each job on `node`. Two equal snapshots mean Slurm saw no write. The rest
        changes by itself on a shared cluster (other jobs end, Slurm forgets them after MinJobAge,
        their nodes go idle), so it is left out."""
        snapshot: dict[str, dict] = {}
        for n in await self.slurm.list_nodes():
            state = "up" if n.state in ("idle", "mixed", "allocated") else n.state
            flags = sorted(set(n.flags) - {"COMPLETING"})
            snapshot[f"node {n.name}"] = {"state": state, "flags": flags, "reason": n.reason, "comment": n.comment}
        for j in await self.slurm.list_jobs():
            if node in j.nodes:
                fields = {"state", "nodes", "restart_count", "excluded_nodes", "priority"}
                snapshot[f"job {j.job_id}"] = j.model_dump(include=fields)
        return snapshot

    async def check_dry_run(self, report: IncidentReport, run: DrillRun, before: dict[str, dict]) -> list[DrillCheck]:
        after = await self.slurm_state(run.node)
        changed = {key: (before.get(key), after.get(key)) for key in before.keys() | after.keys()}
        changed = {key: change for key, change in changed.items() if change[0] != change[1]}
        signalled = [p.name for p in run.run_dir.glob("slurm-*.out") if "SIGUSR1" in p.read_text()]
        live = await self.slurm.get_node(run.node)
        uncommanded = [a.action for a in report.intended_actions if not a.command]
        executed = [a.action for a in report.actions if a.path != "none"]  # "none": a decision, no call
        return [
            DrillCheck(
                name="dry-run outcome",
                passed=report.dry_run and report.outcome_kind == OutcomeKind.DRY_RUN,
                detail=report.outcome,
            ),
            DrillCheck(
                name="actions intended, each with its command",
                passed=bool(report.intended_actions) and not uncommanded and not executed,
                detail=f"{len(report.intended_actions)} intended; without a command: {uncommanded}; "
                f"executed: {executed}",
            ),
            DrillCheck(
                name="Slurm saw no write",
                passed=not changed,
                detail="; ".join(f"{key}: {was} -> {now}" for key, (was, now) in sorted(changed.items()))
                or "nodes and jobs unchanged",
            ),
            DrillCheck(
                name="node still in service", passed=live.in_service, detail=f"{run.node}: {live.state} {live.flags}"
            ),
            DrillCheck(name="job not signalled", passed=not signalled, detail=f"SIGUSR1 in {signalled or 'no log'}"),
        ]

    async def check(
        self,
        report: IncidentReport,
        job_id: int,
        node: str,
        fault_class: FaultClass,
        corrupted: str | None,
        corruption: CheckpointCorruption | None = None,
    ) -> list[DrillCheck]:
        checks = []
        if fault_class in (FaultClass.FATAL, FaultClass.DEGRADING):
            checks.append(
                DrillCheck(name="recovered", passed=report.outcome_kind == OutcomeKind.RECOVERED, detail=report.outcome)
            )
            job = next((j for j in report.jobs if j.job_id == job_id), None)
            # The replacement may be the failed Slurm node itself on new hardware (Slinky's
            # StatefulSet mode, its slurmd pod now on another Node): the job may run there again.
            moved = report.spare_node == node
            checks.append(
                DrillCheck(
                    name="job moved off the failed node",
                    passed=job is not None and bool(job.nodes_after) and (moved or node not in job.nodes_after),
                    detail=f"before {job.nodes_before if job else '?'}, after {job.nodes_after if job else '?'}"
                    + (f" ({node} runs on new hardware)" if moved else ""),
                )
            )
            if corrupted:
                skipped = [s.checkpoint_id for s in report.skipped_checkpoints]
                checks.append(
                    DrillCheck(
                        name="incomplete checkpoint skipped",
                        # every checkpoint broken: from scratch; else from one older than the broken one
                        passed=corrupted in skipped
                        and (
                            report.resumed_step is None
                            if corruption == "all"
                            else report.resumed_step is not None and report.resumed_step < _step_of(corrupted)
                        ),
                        detail=f"corrupted {corrupted}; resumed at step {report.resumed_step}; skipped {skipped}",
                    )
                )
        elif fault_class == FaultClass.APPLICATION:
            live = await self.slurm.get_node(node)
            job = await self.slurm.get_job(job_id)
            checks.append(
                DrillCheck(
                    name="no node action",
                    passed=report.outcome_kind == OutcomeKind.NO_NODE_ACTION and live.in_service,
                    detail=f"{node}: {live.state} {live.flags}",
                )
            )
            checks.append(
                DrillCheck(
                    name="job kept running",
                    passed=job.state == "RUNNING" and job.restart_count == 0,
                    detail=f"{job.state}, restarts {job.restart_count}",
                )
            )
        else:
            live = await self.slurm.get_node(node)
            checks.append(
                DrillCheck(
                    name="drained and escalated",
                    passed=report.outcome_kind == OutcomeKind.ESCALATED and live.drained,
                    detail=report.outcome,
                )
            )
        return checks


class SimulatedKubernetes:
    """A k8s drill's Kubernetes side: the in-repo API server (HTTPS, a bearer token), a simulated
    Slinky cluster mirroring the local Slurm cluster, and a worker with the Kubernetes activities on
    a task queue of its own. The worker runs in this process because the local stack's worker
    process has no Kubernetes configuration; with `in_process_worker=False` none is started, and
    `worker_environment()` configures a worker process for it instead. Everything started is
    stopped on leaving."""

    def __init__(self, drill: Drill, in_process_worker: bool = True, scaling_mode: ScalingMode = "StatefulSet"):
        self._drill = drill
        self._in_process_worker = in_process_worker
        self.scaling_mode = scaling_mode
        self.task_queue = f"{drill.stack.task_queue}-k8s"
        self._resources = AsyncExitStack()
        self.server = KubeApiServer(tls=True, token=secrets.token_urlsafe(24))
        self.slinky: SlinkyCluster | None = None
        self.settings: KubernetesSettings | None = None
        self._seed_writes = 0

    async def __aenter__(self) -> SimulatedKubernetes:
        try:
            await self._start()
        except BaseException:
            await self._resources.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._resources.aclose()

    async def _start(self) -> None:
        drill = self._drill
        spares = drill.spare_nodes
        compute = [n.name for n in await drill.slurm.list_nodes() if n.name not in spares]
        self.server.start()
        self._resources.callback(self.server.stop)
        # A DaemonSet-mode NodeSet brings no slurmd pod for a fenced Node: the replacement is a new
        # Node, which the node lifecycle (the Provisioner here) brings for the labelled failed one.
        lifecycle = self.scaling_mode == "DaemonSet"
        replace_label = KubernetesSettings.model_fields["replace_label"].default
        slinky = SlinkyCluster(
            self.server,
            drill.slurm,
            compute_nodes=compute,
            spare_nodes=spares,
            scaling_mode=self.scaling_mode,
            replace_label=replace_label.partition("=")[0] if lifecycle else None,
            on_moved=self._new_hardware,
        )
        self.slinky = await asyncio.to_thread(slinky.start)
        self._resources.push_async_callback(asyncio.to_thread, slinky.stop)
        self._seed_writes = len(self.server.writes())
        self.settings = KubernetesSettings(
            enabled=True,
            kubeconfig=slinky.kubeconfig,
            context=None,
            namespace=slinky.namespace,
            slurmd_selector=SLURMD_SELECTOR,
            node_selector="",
            gpu_resource=GPU_RESOURCE,
            replacement="node-lifecycle" if lifecycle else "nodeset",
            nodeset_name=slinky.nodeset,  # its version found by discovery, as a user's default configuration does
            nodeset_scale_up=False,
            watch_seconds=1,  # a drill measures the replacement, not a watch window
        )
        if not self._in_process_worker:
            return
        settings = self._worker_settings()
        slurm = await build_slurm(settings, self._resources)
        activities = activities_for(settings, slurm, drill.client, kubernetes=self.settings, resources=self._resources)
        await self._resources.enter_async_context(serving(drill.client, settings, activities))
        drill._log(
            f"Slurm on Kubernetes: API server {self.server.url}, NodeSet {slinky.namespace}/{slinky.nodeset}, "
            f"a slurmd pod for each of {', '.join(compute)}; worker on task queue {self.task_queue}"
        )

    def _new_hardware(self, slurm_node: str) -> None:
        """A StatefulSet-mode slurmd pod came up on another Node: its Slurm node is that machine
        now, and the drill's GPU fault stayed with the old one."""
        (self._drill.stack.fault_dir / slurm_node).unlink(missing_ok=True)

    def worker_environment(self) -> dict[str, str]:
        """RECOVERY_K8S_* and the task queue, for a worker process serving this cluster."""
        assert self.settings is not None, "enter the context first"
        values = self.settings.model_dump(mode="json", exclude_none=True)
        return {
            "RECOVERY_K8S_ENABLED": "true",
            "RECOVERY_TASK_QUEUE": self.task_queue,
            **{
                f"RECOVERY_K8S_{name.upper()}": str(value).lower() if isinstance(value, bool) else str(value)
                for name, value in values.items()
                if name != "enabled"
            },
        }

    def _worker_settings(self) -> Settings:
        """As the local stack's worker process is configured (LocalStack.worker_env)."""
        cluster, stack = self._drill.cluster, self._drill.stack
        stack.ensure_operator_key()
        return load_settings(
            SLURM_CONF=cluster["SLURM_CONF"],
            SLURM_BIN_DIR=cluster.get("SLURM_BIN_DIR", ""),
            SLURMRESTD_URL=cluster["SLURMRESTD_URL"],
            SLURMRESTD_USER=cluster["SLURMRESTD_USER"],
            SLURMRESTD_TOKEN_FILE=cluster["SLURMRESTD_TOKEN_FILE"],
            health_check=stack.health_check,
            task_queue=self.task_queue,  # the fleet budget runs where its incidents do
            operator_keys_file=stack.operator_keys_file,
            accept_starter_policy=True,
        )

    async def check(self, report: IncidentReport, run: DrillRun) -> list[DrillCheck]:
        if report.dry_run or run.fault_class not in (FaultClass.FATAL, FaultClass.DEGRADING):
            # the simulated slurm-operator's own writes (pod labels and conditions) are not the recovery's
            operator = re.compile(rf"^/api/v1/namespaces/{re.escape(self.settings.namespace)}/pods/[^/]+(/status)?$")
            writes = [
                (m, p) for m, p in self.server.writes()[self._seed_writes :] if not (m == "PATCH" and operator.match(p))
            ]
            return [
                DrillCheck(
                    name="Kubernetes saw no write",
                    passed=not writes,
                    detail=f"since the cluster was seeded: {writes or 'none'}",
                )
            ]
        spare = await self._drill.slurm.get_node(report.spare_node) if report.spare_node else None
        return [
            self._evicted_after_slurm_let_go(report, run.node),
            *await asyncio.to_thread(self._cluster_checks, report, run.node, spare),
        ]

    def _evicted_after_slurm_let_go(self, report: IncidentReport, failed: str) -> DrillCheck:
        """By the incident's records and by the API server's own log of the eviction requests."""

        def since_failure(action: str) -> str:
            found = [a.at for a in report.actions if a.action == action]
            return f"{(found[-1] - report.failure_at).total_seconds():.1f}s" if found else "-"

        slurm_side = [a for a in report.actions if a.action in ("drain_node", "requeue_hold", "release_job")]
        evictions = [a for a in report.actions if a.action == "evict_slurmd_pod" and a.path == "kubernetes"]
        requested = [path for method, path in self.server.requests if method == "POST" and path.endswith("/eviction")]
        pod = evictions[0].target.rpartition("/")[2] if evictions else failed  # named "pod <namespace>/<name>"
        expected = f"/api/v1/namespaces/{self.settings.namespace}/pods/{pod}/eviction"
        # one eviction (asked again while the pod-protect PodDisruptionBudget refused it: never forced)
        passed = (
            len(evictions) == 1
            and {"drain_node", "requeue_hold"} <= {a.action for a in slurm_side}
            and all(a.at <= evictions[0].at for a in slurm_side)
            and bool(requested)
            and set(requested) == {expected}
        )
        return DrillCheck(
            name="slurmd pod evicted after the drain and the requeue",
            passed=passed,
            detail=f"drain {since_failure('drain_node')}, requeue {since_failure('requeue_hold')}, release "
            f"{since_failure('release_job')}, eviction {since_failure('evict_slurmd_pod')} "
            f"({evictions[0].detail if evictions else 'none'}); eviction requests to the API server: {requested}",
        )

    def _cluster_checks(self, report: IncidentReport, failed: str, spare: SlurmNode | None) -> list[DrillCheck]:
        """What the API server shows now: the failed Node fenced, the replacement serving."""
        with kube_config.new_client_from_config(config_file=str(self.settings.kubeconfig)) as api:
            core = kube.CoreV1Api(api)
            nodes = {n.metadata.name: n for n in core.list_node().items}
            pods = {
                p.spec.hostname: p
                for p in core.list_namespaced_pod(self.settings.namespace, label_selector=SLURMD_SELECTOR).items
            }
        failed_node = self.slinky.node_of(failed)
        fenced = nodes.get(failed_node)
        cordoned = bool(fenced and fenced.spec.unschedulable)
        fence_taints = [
            f"{t.key}={t.value}:{t.effect}"
            for t in (fenced.spec.taints or [] if fenced else [])
            if t.key == self.settings.taint_key
        ]
        pod = pods.get(report.spare_node or "")
        node = nodes.get(pod.spec.node_name) if pod else None
        usable = node is not None and node.metadata.name != failed_node and can_take_slurmd(node)
        pod_ready = pod is not None and is_ready(pod)
        in_service = spare is not None and spare.in_service
        return [
            DrillCheck(
                name="failed Node cordoned and tainted",
                passed=cordoned and bool(fence_taints),
                detail=f"{failed_node}: unschedulable {cordoned}, taints {fence_taints}",
            ),
            DrillCheck(
                name="replacement Node in service",
                passed=usable and pod_ready and in_service,
                detail=f"Node {node.metadata.name if node else '-'}: "
                f"{'Ready, schedulable, GPUs' if usable else 'not usable'}; slurmd pod "
                f"{pod.metadata.name if pod else '-'}: {'Ready' if pod_ready else 'not Ready'}; "
                f"Slurm node {spare.name if spare else '-'}: "
                f"{'in service' if in_service else spare.state if spare else 'none'}",
            ),
        ]

    async def end_return_to_service(self, report: IncidentReport) -> None:
        """The incident handed the failed node to a return-to-service workflow on this side's task
        queue; its worker stops with the drill and no other worker polls that queue, so it ends here."""
        if report.return_to_service is None:
            return
        handle = self._drill.client.get_workflow_handle(report.return_to_service)
        description = await handle.describe()
        if description.task_queue == self.task_queue and description.status == WorkflowExecutionStatus.RUNNING:
            try:
                await handle.terminate(reason="recovery drill --k8s ended: its worker has stopped")
            except RPCError as e:
                if e.status != RPCStatusCode.NOT_FOUND:  # it ended meanwhile, by itself
                    raise


def corrupt_latest_checkpoint(run_dir: Path, kind: CheckpointCorruption = "truncated") -> str:
    """Make the newest complete checkpoint incomplete as `kind` says: a payload file truncated, a
    byte of it changed, no manifest, the manifest naming a missing file; or leave it and add a newer
    one caught mid-write ("being_written": a temporary directory with data, no manifest yet); or
    break every complete one ("all", truncated). For a DCP checkpoint: as a crash mid-save leaves it
    (shards written, no .metadata), or a shard truncated after .metadata. Returns the newest
    incomplete checkpoint's id."""
    if kind in DCP_CORRUPTIONS:
        return _corrupt_latest_dcp_checkpoint(run_dir, kind)
    latest, _ = ckpt.find_latest_complete(run_dir)
    if latest is None:
        raise StackError(f"no complete checkpoint to corrupt in {run_dir}")
    if kind == "being_written":
        writing = run_dir / f"{ckpt.TMP_PREFIX}{ckpt.checkpoint_id(latest.step + 1)}-{os.getpid()}-drill"
        writing.mkdir()
        payload = _a_payload_file(latest.path)
        _write_durably(writing / payload.name, payload.read_bytes())
        return writing.name
    broken = [s.path for s in ckpt.list_checkpoints(run_dir) if s.complete] if kind == "all" else [latest.path]
    for path in broken:
        payload = _a_payload_file(path)
        data = payload.read_bytes()
        if kind in ("truncated", "all"):
            _write_durably(payload, data[: len(data) // 2])
        elif kind == "checksum":
            _write_durably(payload, bytes([data[0] ^ 0xFF]) + data[1:])
        else:
            (path / ckpt.MANIFEST_NAME if kind == "no_manifest" else payload).unlink()
    return latest.checkpoint_id


def _corrupt_latest_dcp_checkpoint(run_dir: Path, kind: CheckpointCorruption) -> str:
    adapter = ADAPTERS[CheckpointFormat.DCP]
    complete = [c for c in adapter.candidates(run_dir) if adapter.verify(c).complete]
    if not complete:
        raise StackError(f"no complete DCP checkpoint to corrupt in {run_dir}")
    latest = max(complete, key=lambda c: c.step or 0).path
    if kind == "no_metadata":
        (latest / dcp.METADATA).unlink()
    else:
        shard = max(latest.glob(f"*{dcp.SHARD_SUFFIX}"), key=lambda p: p.stat().st_size)
        _write_durably(shard, shard.read_bytes()[: shard.stat().st_size // 2])
    return latest.name


def _a_payload_file(checkpoint: Path) -> Path:
    return next(p for p in sorted(checkpoint.iterdir()) if p.name != ckpt.MANIFEST_NAME)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())


def _step_of(checkpoint_id: str) -> int:
    """The step in a checkpoint's name: the reference trainer's (step-…, .tmp-step-…-…) or DCP's (step_N)."""
    named = ckpt.name_step(checkpoint_id)
    step = named[0] if named else step_in_name(checkpoint_id)
    return step if step is not None else 0
