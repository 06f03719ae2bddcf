"""The XID 79 drill on a real distributed PyTorch job (trainer/torch_job.py: 2 ranks under srun,
gloo, DDP, DCP checkpoints with save and async_save): the incident requeues it off the failed
node, and every rank resumes with DCP's own load from the newest checkpoint that loads, which is
the one the controller expected. The job knows nothing of the controller: the controller reads its
DCP directories and the resume record any job can write. On the host's Slurm generation (a Debian
root's python has no PyTorch)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from drills.drill import DrillOptions

pytestmark = [pytest.mark.slurm, pytest.mark.host_slurm_generation]


def resumes_of_restart(run_dir: Path, restart: int) -> list[str]:
    """What each rank says it resumed from after restart `restart` (its log lines)."""
    text = "".join(p.read_text() for p in run_dir.glob("slurm-*.out"))
    return re.findall(rf"\[torch rank \d restart {restart}\] (resumed from \S+|starting from scratch)", text)


def resume_record(run_dir: Path, restart: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "resume-log.jsonl").read_text().splitlines()]
    return next(r for r in records if r["restart_count"] == restart)


async def test_a_pytorch_job_resumes_on_every_rank_from_its_latest_complete_dcp_checkpoint(drill, recovery_worker):
    result = await drill.run(DrillOptions(trainer="torch"))
    report = result.report
    assert report.outcome == "recovered" and result.passed, (report.outcome, result.checks)
    [job] = report.jobs
    assert job.verified and job.restart_count == 1 and report.node not in job.nodes_after, job
    # the checkpoint it resumed from is the newest complete one when it stopped, named by DCP's layout
    run_dir = Path(result.run_dir)
    latest = f"step_{job.latest_complete_step}"
    assert job.resumed_step == job.latest_complete_step and (run_dir / latest / ".metadata").exists()
    assert resume_record(run_dir, 1)["checkpoint_id"] == latest
    assert job.confidence == "confirmed" and job.evidence[0] == f"resume record: {latest}", job.evidence
    assert resumes_of_restart(run_dir, 1) == [f"resumed from {latest}"] * 2  # both ranks, the same one
    assert job.lost_steps is not None and job.lost_steps >= 0 and job.lost_seconds is not None
    assert job.lost_seconds_basis == "lost steps x the job's mean step time"
    g = job.goodput  # the launch time and save time come from the job's own records
    assert g is not None and g.goodput is not None and 0 < g.goodput <= 1 and g.checkpoint_save_seconds > 0
    assert g.resume_seconds > 0 and g.reschedule_seconds > 0


@pytest.mark.parametrize(
    ("corruption", "why"),
    [
        ("no_metadata", "no .metadata: the save did not finish"),
        ("truncated_shard", "dcp.load failed: "),
    ],
)
async def test_a_newest_dcp_checkpoint_left_incomplete_is_skipped_by_job_and_controller_alike(
    drill, recovery_worker, corruption, why
):
    result = await drill.run(DrillOptions(trainer="torch", corrupt_latest_checkpoint=True, corruption=corruption))
    report = result.report
    assert report.outcome == "recovered" and result.passed, (report.outcome, result.checks)
    corrupted = result.corrupted_checkpoint
    assert corrupted is not None
    [job] = report.jobs
    # the controller expected the one before, and the job's own fallback loaded exactly that one
    assert job.verified and job.resumed_step == job.latest_complete_step < int(corrupted.removeprefix("step_"))
    [skipped] = [s for s in report.skipped_checkpoints if s.checkpoint_id == corrupted]
    assert skipped.why.startswith(why), skipped
    assert resumes_of_restart(Path(result.run_dir), 1) == [f"resumed from step_{job.resumed_step}"] * 2
