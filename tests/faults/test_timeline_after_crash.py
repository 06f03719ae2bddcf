"""The incident's timeline after a worker crash (issue #29, item 7): a step ends when its work was
done, as Slurm and the job record it, not when a worker that took over from a dead one heard of it.

The worker is SIGKILLed at a point of the incident and stays dead until the job is back by
Slurm's doing alone (a requeued job restarts without the controller); then a new worker finishes
the incident. Its phases are compared with slurmctld's log and with the trainer's own resume
record. Before the fix, the requeue ran on to the new worker's start (18 s for a 0.3 s requeue)
and the verification ended when the new worker looked, long after the job was back."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import pytest

from contracts.models import IncidentReport, Phase
from drills.faults import job_recovery_started, kill_worker, wait_for_history_point
from drills.localstack import DEBIAN_RELEASE_OF_GENERATION, wait_async
from tests.faults.crash_support import Case, check_recovered_once
from trainer import checkpoint as ckpt

pytestmark = [pytest.mark.slurm, pytest.mark.every_slurm_generation]

GENERATIONS = sorted(DEBIAN_RELEASE_OF_GENERATION)
INCIDENT_SECONDS = 300
# slurmctld's log and the worker stamp times on the same machine: allow for the log's rounding and
# for the moment between a write's stamp and slurmctld's line.
SAME_MOMENT = timedelta(seconds=1)


def slurmctld_time(case: Case, line: str) -> datetime:
    """When slurmctld logged `line` (the first time since the case began), in UTC."""
    found = re.search(rf"^\[([0-9T:.-]+)\] (?:\w+: )?{re.escape(line)}", case.ctld_log_since_start(), re.MULTILINE)
    assert found, f"slurmctld did not log {line!r}:\n{case.ctld_log_since_start()}"
    return datetime.fromisoformat(found.group(1)).replace(tzinfo=timezone.utc)


def phases(report: IncidentReport) -> dict[str, Phase]:
    return {phase.name: phase for phase in report.phases}


async def kill_the_worker_until_the_job_is_back(case: Case, step: str, point: str) -> datetime:
    """SIGKILL the worker at the step's point (in the job's recovery), wait until the job trains
    again off the failed node with no worker alive, then start a new worker: when it started."""
    assert case.run is not None
    run = case.run
    recovery = await job_recovery_started(case.drill.client, case.stack.task_queue, run.job_id, 120)
    await wait_for_history_point(recovery, step, point, 120)
    kill_worker(case.stack)

    async def training_again() -> bool:
        job = await case.drill.slurm.get_job(run.job_id)
        progress = ckpt.read_progress(run.run_dir)
        return (
            job.state == "RUNNING"
            and run.node not in job.nodes
            and progress is not None
            and progress.get("restart_count") == 1
            and any(r["restart_count"] == 1 for r in ckpt.read_resume_records(run.run_dir))
        )

    await wait_async(training_again, 120, f"job {run.job_id} training again with no worker alive")
    new_worker_at = datetime.now(timezone.utc)
    case.stack.start_worker(case.cluster)
    return new_worker_at


@pytest.mark.parametrize("local_stack", GENERATIONS, indirect=True)
async def test_a_worker_dead_after_the_requeue_leaves_the_requeue_its_own_time(case):
    run = await case.start()
    new_worker_at = await kill_the_worker_until_the_job_is_back(case, "requeue_job", "completed")
    result = await case.drill.finish(run, INCIDENT_SECONDS)
    await check_recovered_once(case, run, result, "worker killed after the requeue")
    steps = phases(result.report)

    requeued = slurmctld_time(case, f"Requeuing JobId={run.job_id}")
    requeue = steps["requeue"]
    assert requeue.ended_at is not None and abs(requeue.ended_at - requeued) <= SAME_MOMENT, (requeue, requeued)
    # The worker's absence is a gap between two steps, no step's duration.
    mark_down = steps["mark_down"]
    assert mark_down.started_at >= new_worker_at, (mark_down, new_worker_at)
    marked_down = slurmctld_time(case, f"node {run.node} state set to DOWN")
    assert mark_down.ended_at is not None and abs(mark_down.ended_at - marked_down) <= SAME_MOMENT, (
        mark_down,
        marked_down,
    )


@pytest.mark.parametrize("local_stack", GENERATIONS, indirect=True)
async def test_a_worker_dead_during_the_verification_ends_it_when_the_job_was_back(case):
    run = await case.start()
    new_worker_at = await kill_the_worker_until_the_job_is_back(case, "verify_restart", "started")
    result = await case.drill.finish(run, INCIDENT_SECONDS)
    await check_recovered_once(case, run, result, "worker killed during the verification")
    steps = phases(result.report)

    resumed = next(
        datetime.fromisoformat(r["started_at"])
        for r in ckpt.read_resume_records(run.run_dir)
        if r["restart_count"] == 1
    )
    verify = steps["verify"]
    assert verify.ended_at == resumed, (verify, resumed)  # the job's own record of its restart
    assert verify.ended_at < new_worker_at
    assert steps["return_to_service"].started_at >= new_worker_at, steps["return_to_service"]
    # The headline figure came from the job's record before, and still does.
    assert result.report.time_to_resume_seconds == round((resumed - result.report.failure_at).total_seconds(), 3)
