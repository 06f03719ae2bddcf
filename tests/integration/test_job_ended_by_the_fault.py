"""A job found running on the failed node that dies before its requeue: the lost GPU crashes it,
as XID 79 crashes real training (an NCCL error, a CUDA error), and Slurm marks it FAILED. Before:
the incident left it, "not requeued: job is FAILED", and the job was lost although it had asked
to be requeued. Now it is requeued as a running one would be, kept off the node, and verified.
Real Slurm (Slurm requeues a finished batch job), the real reference job, both generations."""

from __future__ import annotations

import subprocess

import pytest

from drills.drill import DrillOptions
from drills.localstack import wait_async
from starter.decisions import decide
from tests.integration.conftest import fleet, status_if_answered

pytestmark = pytest.mark.slurm


async def test_a_job_that_died_on_the_failed_node_before_its_requeue_is_requeued_and_verified(
    temporal_env, local_stack, slurm_cluster
):
    # The requeue gate holds the incident after it found and signalled the job: the job dies meanwhile.
    async with fleet(temporal_env, local_stack, slurm_cluster, approval_required=["requeue"]) as f:
        run = await f.drill.start(DrillOptions())

        async def at_the_requeue_gate() -> bool:
            status = await status_if_answered(run.handle)
            return (
                status is not None
                and status.awaiting_approval is not None
                and status.awaiting_approval.gate == "requeue"
            )

        await wait_async(at_the_requeue_gate, 120, "the incident to wait at the requeue gate")
        # The training processes die (SIGKILL, as a crash): the batch script ends non-zero.
        subprocess.run(["pkill", "-KILL", "-f", f"trainer.job --run-dir {run.run_dir}"], check=True)

        async def failed():
            job = await f.drill.slurm.get_job(run.job_id)
            return job if job.state == "FAILED" else None

        ended = await wait_async(failed, 60, f"job {run.job_id} to end FAILED")
        assert run.node in ended.nodes and ended.restart_count == 0, ended
        await decide(run.handle, "approve", local_stack.operator_signer("alice"), "go on")
        result = await f.drill.finish(run, 300)

    report = result.report
    assert report.outcome == "recovered" and result.passed, (report.outcome, result.checks)
    [requeue] = [a for a in report.actions if a.action == "requeue_hold"]
    assert requeue.detail.startswith("it ended FAILED (") and requeue.command, requeue
    [job] = report.jobs
    assert job.verified and job.restart_count == 1, job


@pytest.mark.every_slurm_generation
async def test_a_job_the_fault_ended_before_the_incident_is_requeued_and_verified(drill, recovery_worker):
    """The lost GPU's rank crashes and srun --kill-on-bad-exit=1 ends the job FAILED before the
    alert arrives (as a torchrun job launched by srun ends). Before: the incident found no job on
    the node and the job was lost. Now it is found, not signalled (it cannot checkpoint), requeued
    off the node and verified."""
    result = await drill.run(DrillOptions(rank_crashes=True))
    report = result.report
    assert report.outcome == "recovered" and result.passed, (report.outcome, result.checks)
    [job] = report.jobs
    assert job.job_id == result.job_id and job.verified and job.restart_count == 1, job
    assert report.node in job.nodes_before and report.node not in job.nodes_after
    assert not [a for a in report.actions if a.action == "signal_job"]
    signal = next(p for p in report.phases if p.name == "signal")
    assert signal.result == f"SIGUSR1 to 0 job(s); already ended: {result.job_id} (FAILED)", signal.result
    [requeue] = [a for a in report.actions if a.action == "requeue_hold"]
    assert requeue.detail.startswith("it had ended FAILED (") and requeue.executed, requeue
    # It resumed from its latest complete checkpoint (the drill's checks), whichever that was:
    # the surviving rank got TERM first and may have written one more before it ended.
    assert report.resumed_step == report.latest_complete_step
