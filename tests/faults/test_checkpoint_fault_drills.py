"""Checkpoint faults end to end: the drill breaks the reference job's checkpoints at the moment of
the failure (drills/drill.py corrupt_latest_checkpoint), and the incident must bring the job back
from the newest checkpoint still complete, never from an incomplete one, and its report must say
which checkpoints were skipped and why. (A truncated newest checkpoint: tests/integration/
test_drill.py.) The library's side of each case: tests/unit/test_checkpoint_faults.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from drills.drill import DrillOptions
from tests.integration.conftest import drill, recovery_worker, settings, task_queue  # noqa: F401 (fixtures)
from trainer import checkpoint as ckpt

pytestmark = pytest.mark.slurm

WHY = {
    "no_manifest": "no manifest",
    "checksum": "checksum mismatch",
    "missing_file": "manifest names missing file",
    "being_written": ckpt.BEING_WRITTEN,
}


@pytest.mark.parametrize("kind", list(WHY))
async def test_a_broken_newest_checkpoint_is_skipped_and_the_report_says_why(drill, recovery_worker, kind):  # noqa: F811
    result = await drill.run(DrillOptions(xid=79, corrupt_latest_checkpoint=True, corruption=kind))
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    assert result.passed, [c for c in result.checks if not c.passed]
    broken = result.corrupted_checkpoint
    [skipped] = r.skipped_checkpoints
    assert skipped.checkpoint_id == broken and WHY[kind] in skipped.why
    # The job resumed from what the controller found complete when it stopped, older than the broken one.
    assert r.resumed_step is not None and r.resumed_step == r.latest_complete_step
    if kind == "being_written":  # the one caught mid-write was newer than the newest complete one
        assert broken.startswith(f".tmp-step-{r.resumed_step + 1:09d}-")
        assert not (Path(result.run_dir) / broken).exists()  # on record, then cleared by the job
    else:
        assert f"step-{r.resumed_step:09d}" < broken
    [resume] = [rec for rec in ckpt.read_resume_records(Path(result.run_dir)) if rec["restart_count"] == 1]
    assert resume["checkpoint_id"] == f"step-{r.resumed_step:09d}"


async def test_every_checkpoint_incomplete_the_job_starts_from_scratch_and_the_report_says_so(drill, recovery_worker):  # noqa: F811
    result = await drill.run(DrillOptions(xid=79, corrupt_latest_checkpoint=True, corruption="all"))
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    assert result.passed, [c for c in result.checks if not c.passed]
    # Nothing complete when the job stopped: the verification expected a start from scratch,
    # and that is what the job did (no checkpoint loaded), losing all its progress.
    assert (r.resumed_step, r.latest_complete_step) == (None, None)
    [job] = r.jobs
    assert job.verified and job.restart_count == 1
    assert r.lost_steps == job.last_step_before_failure and r.lost_steps >= 20
    skipped = [s.checkpoint_id for s in r.skipped_checkpoints]
    assert skipped[0] == result.corrupted_checkpoint and len(skipped) >= 2
    assert all("truncated" in s.why for s in r.skipped_checkpoints)
    [resume] = [rec for rec in ckpt.read_resume_records(Path(result.run_dir)) if rec["restart_count"] == 1]
    assert (resume["checkpoint_id"], resume["resumed_step"]) == (None, None)
