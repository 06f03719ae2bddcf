"""Time to resume and lost progress after XID 79 on a 2-node job with a hot spare, against Slurm's
own node-failure handling, same job, same checkpoint interval, in the same run.

  ours      the drill (drills/drill.py), as `recovery drill` runs it: the reference job on two
            nodes, a lost GPU (the job stalls, as a collective on a dead GPU would), the alert, the
            incident, the report's time to resume and lost progress.
  baseline  Slurm alone: the same job (submitted with --requeue), the hot spare put in service
            beforehand (the free node our recovery would bring), then the same lost GPU and the
            node's death: its slurmd and its job processes killed. Slurm notices after
            SlurmdTimeout (its default, 300 s, unless --quick), marks the node DOWN and requeues
            the job. This takes over five minutes: one run unless --runs says otherwise.

Both are measured the same way, by the report's own arithmetic (workflows/report.py) over the
job's resume record: time to resume = failure -> the restarted job loaded its checkpoint; lost
progress = the step it had reached - the step it resumed from. Our clock starts at the alert (sent
once the job stalled, within half a second of the fault), the baseline's at the fault itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime, timezone

from backends.checkpoints import CheckpointStore
from bench.stack import BenchStack, say
from bench.table import Row, goal, median, row
from contracts.models import JobReport, JobSnapshot, JobVerification, RecoveryPolicy, utc_now
from drills.drill import DrillOptions
from drills.localstack import StackError, wait_async
from trainer import checkpoint as ckpt
from workflows.report import job_report

XID = 79


@dataclass
class Recovery:
    time_to_resume: float
    lost_steps: int
    lost_seconds: float
    detail: str


@dataclass
class ResumeResult:
    ours: list[Recovery]
    baseline: list[Recovery]
    slurmd_timeout: int
    quick: bool

    def rows(self) -> list[Row]:
        where = "real Slurm" + (f"; smoke: baseline at SlurmdTimeout {self.slurmd_timeout} s" if self.quick else "")
        return [
            row(
                f"time to resume after XID 79, hot spare ({where})",
                median(r.time_to_resume for r in self.ours),
                "s",
                median(r.time_to_resume for r in self.baseline),
                goal("ratio <= 0.05", note="20x faster"),
                digits=1,
            ),
            row(
                f"lost progress after XID 79 ({where})",
                median(r.lost_steps for r in self.ours),
                "steps",
                median(r.lost_steps for r in self.baseline),
                goal("value <= baseline"),
                digits=1,
            ),
            # no goal of its own: the same steps lost differ by each step's wall-time jitter (0.2 s vs 0.201 s)
            row(
                f"lost training time after XID 79 ({where})",
                median(r.lost_seconds for r in self.ours),
                "s",
                median(r.lost_seconds for r in self.baseline),
                digits=2,
            ),
        ]

    def details(self) -> str:
        timeout = f"SlurmdTimeout {self.slurmd_timeout} s" + (
            " (the local stack's, not Slurm's default of 300 s: a smoke run only)" if self.quick else ""
        )
        return "\n".join(
            [
                f"  {len(self.ours)} run(s) each (the baseline takes SlurmdTimeout and more a run); "
                f"baseline: Slurm alone, the node's slurmd killed, {timeout}, job with --requeue, "
                "spare in service",
                *(f"  ours:     {r.detail}" for r in self.ours),
                *(f"  baseline: {r.detail}" for r in self.baseline),
            ]
        )


async def run(bench: BenchStack, runs: int, baseline_runs: int, quick: bool) -> ResumeResult:
    result = ResumeResult([], [], bench.slurmd_timeout, quick)
    for i in range(runs):
        result.ours.append(await drill_recovery(bench, DrillOptions(xid=XID)))
        say(f"resume run {i + 1} ours: {result.ours[-1].detail}")
    for i in range(baseline_runs):
        say(
            f"resume run {i + 1} baseline: Slurm alone, SlurmdTimeout {bench.slurmd_timeout} s: "
            f"expect {bench.slurmd_timeout} s or more"
        )
        result.baseline.append(await slurm_alone(bench, DrillOptions(xid=XID)))
        say(f"resume run {i + 1} baseline: {result.baseline[-1].detail}")
    return result


async def drill_recovery(bench: BenchStack, opts: DrillOptions, policy: RecoveryPolicy | None = None) -> Recovery:
    """One drill on the bench stack; its report's figures (the drill must pass its checks)."""
    result = await bench.drill(policy).run(opts)
    report = result.report
    if not result.passed or report.time_to_resume_seconds is None:
        failed = "; ".join(f"{c.name}: {c.detail}" for c in result.checks if not c.passed)
        raise StackError(f"the drill did not recover: {report.outcome}; {failed}")
    return Recovery(
        report.time_to_resume_seconds,
        report.lost_steps or 0,
        report.lost_seconds or 0.0,
        f"time to resume {report.time_to_resume_seconds:.1f} s, lost {report.lost_steps} steps "
        f"({report.lost_seconds} s of training), resumed at step {report.resumed_step}, "
        f"job {result.job_id}",
    )


async def slurm_alone(bench: BenchStack, opts: DrillOptions) -> Recovery:
    drill = bench.drill()
    slurm, store = bench.slurm, CheckpointStore()
    await drill.reset_cluster()
    run_dir = bench.stack.drills_dir / f"slurm-alone-{datetime.now(timezone.utc):%Y%m%dT%H%M%S%fZ}"
    job_id = await drill.submit_training_job(run_dir, opts)

    async def running():
        job = await slurm.get_job(job_id)
        return job if job.state == "RUNNING" else None

    async def checkpointed() -> bool:
        statuses = await asyncio.to_thread(ckpt.list_checkpoints, run_dir)
        return sum(s.complete for s in statuses) >= opts.checkpoints_before_failure

    job = await wait_async(running, 60, f"job {job_id} to run")
    await wait_async(checkpointed, 120, f"{opts.checkpoints_before_failure} complete checkpoints")
    for spare in filter(None, bench.cluster.get("SLURM_SPARE_NODES", "").split(",")):
        await slurm.update_node(spare, "RESUME", None)
    node = job.nodes[-1]
    latest, _ = await store.latest_complete(str(run_dir))
    snapshot = JobSnapshot(
        job=job, checkpoint_dir=str(run_dir), latest_complete=latest, progress=await store.progress(str(run_dir))
    )
    failure_at = utc_now()
    drill.inject_fault(node, opts.xid, gpu_lost=True)
    await asyncio.to_thread(bench.stack.kill_node, node)
    say(f"  killed {node} (slurmd and job processes) at {failure_at:%H:%M:%S}; job {job_id} on {','.join(job.nodes)}")

    async def resumed():
        records = [r for r in await store.resume_records(str(run_dir)) if r.restart_count > job.restart_count]
        progress = await store.progress(str(run_dir))
        if (
            records
            and progress
            and progress.restart_count == records[-1].restart_count
            and progress.step > (records[-1].resumed_step or 0)
        ):
            return records[-1]
        return None

    try:
        record = await wait_async(
            resumed, bench.slurmd_timeout * 2 + 300, "Slurm to requeue and restart the job", interval=1.0
        )
        after = await slurm.get_job(job_id)
    finally:
        await slurm.run("scancel", str(job_id))
        await bench.bring_nodes_back()
    verification = JobVerification(
        job_id=job_id,
        verified=True,
        restart_count_before=job.restart_count,
        restart_count_after=after.restart_count,
        nodes_before=job.nodes,
        nodes_after=after.nodes,
        resume=record,
        resumed_at=record.started_at,
    )
    report: JobReport = job_report(snapshot, verification, failure_at)
    assert report.time_to_resume_seconds is not None
    return Recovery(
        report.time_to_resume_seconds,
        report.lost_steps or 0,
        report.lost_seconds or 0.0,
        f"time to resume {report.time_to_resume_seconds:.1f} s, lost {report.lost_steps} steps "
        f"({report.lost_seconds} s of training), resumed at step {report.resumed_step}, job {job_id} "
        f"{','.join(job.nodes)} -> {','.join(after.nodes)}, restarts {after.restart_count}",
    )
