"""A job pinned to its nodes (`sbatch -w`) loses one (issue #29, item 2). Before: it was requeued
and kept off the failed node, which Slurm answers with PENDING (BadConstraints) for good, and the
incident said so only at its verify deadline. Now the policy decides before the requeue
(RECOVERY_PINNED_JOBS): `unpin` (the default) takes the failed node out of the pin and the job
resumes; `leave` leaves the job as found and says why at once. A verification never waits out
its deadline for a state Slurm calls impossible. Real Slurm, the real reference job, the host's generation
and the newest."""

from __future__ import annotations

import asyncio
import time

import pytest
from temporalio.testing import ActivityEnvironment

from activities.jobs import JobActivities
from backends.checkpoints import CheckpointStore
from contracts.models import JobSnapshot, NodeFailureAlert, RequeueResult, SlurmJob, VerifyRequest
from drills.drill import Drill, DrillOptions
from drills.localstack import wait_async
from starter.alerts import raise_alert
from tests.integration.conftest import Fleet, fleet

pytestmark = [pytest.mark.slurm, pytest.mark.host_and_newest_slurm_generation]


async def pinned_training(drill: Drill) -> SlurmJob:
    """The reference job, pinned to two compute nodes."""
    nodes = sorted(n.name for n in await drill.slurm.list_nodes() if n.name not in drill.spare_nodes)[:2]
    job, _ = await drill.start_training(DrillOptions(pinned_to=nodes))
    assert job.required_nodes == nodes and sorted(job.nodes) == nodes, job
    return job


async def fail(f: Fleet, node: str):
    f.drill.inject_fault(node, 79, gpu_lost=True)
    alert = NodeFailureAlert(node=node, xid=79, source="test", actor="pytest", reason=f"XID 79 on {node}")
    return await raise_alert(f.drill.client, alert, f.settings.task_queue, f.drill.policy)


def actions(report, name: str):
    return [a for a in report.actions if a.action == name]


async def test_a_job_pinned_to_the_failed_node_resumes_with_that_node_taken_out_of_its_pin(
    temporal_env, local_stack, slurm_cluster
):
    async with fleet(temporal_env, local_stack, slurm_cluster) as f:
        job = await pinned_training(f.drill)
        kept, failed = job.nodes
        report = await asyncio.wait_for((await fail(f, failed)).result(), 300)
        [job_report] = report.jobs
        assert report.outcome == "recovered" and job_report.verified, (report.outcome, job_report)
        [unpin] = actions(report, "unpin_job")
        # scontrol where slurmrestd cannot set a pin (before v0.0.43), REST where it can (26.05)
        assert unpin.command in (
            f"scontrol update JobId={job.job_id} ReqNodeList={kept}",
            f'POST /slurm/v0.0.45/job/{job.job_id} {{"required_nodes": ["{kept}"]}}',
        ), unpin
        assert unpin.actor == "pytest", unpin
        after = await f.drill.slurm.get_job(job.job_id)
        assert after.state == "RUNNING" and after.required_nodes == [kept] and failed in after.excluded_nodes, after
        assert kept in after.nodes and failed not in after.nodes, after
        await f.drill.slurm.run("scancel", str(job.job_id))


async def test_with_pinned_jobs_left_the_incident_says_so_at_once_and_touches_no_job(
    temporal_env, local_stack, slurm_cluster
):
    async with fleet(temporal_env, local_stack, slurm_cluster, pinned_jobs="leave") as f:
        job = await pinned_training(f.drill)
        failed = job.nodes[-1]
        report = await asyncio.wait_for((await fail(f, failed)).result(), 300)
        [job_report] = report.jobs
        assert not job_report.verified
        assert job_report.why_not == [f"not requeued: pinned to the failed node(s) {failed} (policy pinned_jobs=leave)"]
        [left] = actions(report, "requeue_job")
        assert "left as found (policy pinned_jobs=leave)" in left.detail, left
        assert (
            not actions(report, "requeue_hold")
            and not actions(report, "unpin_job")
            and not actions(report, "exclude_nodes")
        )
        verify = next(p for p in report.phases if p.name == "verify")
        deadline = f.settings.verify_deadline_seconds
        assert (verify.ended_at - verify.started_at).total_seconds() < deadline / 4, verify
        # Its pin and exclusions are as the user set them.
        after = await f.drill.slurm.get_job(job.job_id)
        assert after.required_nodes == job.required_nodes and failed not in after.excluded_nodes, after
        await f.drill.slurm.run("scancel", str(job.job_id))


async def test_a_verification_ends_at_once_when_slurm_says_the_job_can_never_start(drill):
    """The state the old requeue left a pinned job in, made with Slurm's own commands."""
    job = await pinned_training(drill)
    slurm, failed = drill.slurm, job.nodes[-1]
    await slurm.requeue_hold(job.job_id)
    await wait_async(lambda: pending(slurm, job.job_id), 60, "the job to be requeued")
    await slurm.set_excluded_nodes(job.job_id, [failed])
    await slurm.release_job(job.job_id)
    await wait_async(lambda: pending(slurm, job.job_id, "BadConstraints"), 60, "Slurm to call it BadConstraints")

    jobs = JobActivities(slurm, CheckpointStore())
    requeue = RequeueResult(job_id=job.job_id, requeued_now=True, restart_count=job.restart_count + 1, actions=[])
    started = time.monotonic()
    verification = await ActivityEnvironment().run(
        jobs.verify_restart,
        VerifyRequest(
            snapshot=JobSnapshot(job=job, checkpoint_dir=None, latest_complete=None, progress=None),
            failed_node=failed,
            requeue=requeue,
            deadline_seconds=600,
        ),
    )
    assert time.monotonic() - started < 60
    assert not verification.verified and "job is PENDING (BadConstraints), not RUNNING" in verification.why_not
    await slurm.run("scancel", str(job.job_id))


async def pending(slurm, job_id: int, reason: str | None = None) -> SlurmJob | None:
    job = await slurm.get_job(job_id)
    return job if job.state == "PENDING" and (reason is None or job.state_reason == reason) else None
