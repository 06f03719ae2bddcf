"""What a job's restart is verified on, and how sure it is: its resume record (confirmed), with its
progress record or a checkpoint it wrote after the restart as the progress; or, for a job that
keeps no resume record, the first checkpoint it wrote after the restart (inferred): past the
expected checkpoint's step it went on from it, at or below it from an older one or from scratch."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from activities.jobs import JobActivities
from backends.checkpoints import CheckpointStore
from contracts.models import (
    ActionRecord,
    JobSnapshot,
    JobVerification,
    RequeueResult,
    SlurmJob,
    VerifyRequest,
)
from trainer.checkpoint import append_resume_record, save_checkpoint, write_progress

FILES = {"model.bin": b"m" * 1024}


async def check(run: Path, stopped: datetime, expected_before: datetime | None = None) -> tuple[JobVerification, bool]:
    """`stopped`: the requeue's time by the controller's clock; the expected checkpoint is the newest
    written before `expected_before` (default: `stopped`)."""
    store = CheckpointStore()
    expected, _ = await store.latest_complete(str(run), created_before=expected_before or stopped)
    job = SlurmJob(job_id=7, state="RUNNING", nodes=["gpu-3"], comment=f"checkpoint_dir={run}")
    requeue_action = ActionRecord(at=stopped, action="requeue_hold", target="job 7", path="cli", actor="t", reason="t")
    request = VerifyRequest(
        snapshot=JobSnapshot(job=job, checkpoint_dir=str(run), latest_complete=expected, progress=None),
        failed_node="gpu-1",
        requeue=RequeueResult(
            job_id=7, requeued_now=True, restart_count=1, latest_complete_at_stop=expected, actions=[requeue_action]
        ),
        deadline_seconds=1,
    )
    result = JobVerification(
        job_id=7, verified=False, restart_count_before=0, restart_count_after=1, nodes_before=["gpu-1"], nodes_after=[]
    )
    wrong = await JobActivities(None, store)._check_resume(request, str(run), result)  # type: ignore[arg-type]
    return result, wrong


def trained_until_stopped(tmp_path: Path) -> tuple[Path, datetime]:
    run = tmp_path / "run"
    for step in (10, 20, 30):
        save_checkpoint(run, step, step * 0.1, FILES)
    return run, datetime.now(timezone.utc)


def record_resume(run: Path, checkpoint_id: str | None, step: int | None) -> None:
    # the three lines any job can write (docs/checkpoints.md), here through the library's append
    started = datetime.now(timezone.utc).isoformat()
    append_resume_record(
        run,
        {
            "job_id": "7",
            "restart_count": 1,
            "checkpoint_id": checkpoint_id,
            "resumed_step": step,
            "started_at": started,
        },
    )


async def test_a_resume_record_and_a_progress_record_confirm_the_restart(tmp_path):
    run, stopped = trained_until_stopped(tmp_path)
    record_resume(run, "step-000000030", 30)
    write_progress(
        run,
        {
            "job_id": "7",
            "restart_count": 1,
            "step": 33,
            "train_seconds": 3.3,
            "updated_at": stopped.isoformat(),
            "state": "running",
        },
    )
    result, wrong = await check(run, stopped)
    assert not wrong and result.why_not == [] and result.confidence == "confirmed"
    assert result.evidence == ["resume record: step-000000030", "progress record: step 33"]


async def test_a_resume_record_and_a_checkpoint_written_since_confirm_a_job_without_progress_record(tmp_path):
    run, stopped = trained_until_stopped(tmp_path)
    record_resume(run, "step-000000030", 30)
    result, _ = await check(run, stopped)
    assert result.why_not == ["no training progress past step 30 yet"]
    save_checkpoint(run, 40, 4.0, FILES)
    result, wrong = await check(run, stopped)
    assert not wrong and result.why_not == [] and result.progress_step_after == 40
    assert result.evidence[1] == "checkpoint written after the restart: step-000000040"


async def test_without_a_resume_record_the_first_checkpoint_after_the_restart_is_inferred_evidence(tmp_path):
    run, stopped = trained_until_stopped(tmp_path)
    result, wrong = await check(run, stopped)
    assert not wrong and result.why_not == [
        "no resume record for restart 1, and no checkpoint written since the restart yet"
    ]
    save_checkpoint(run, 40, 4.0, FILES)
    result, wrong = await check(run, stopped)
    assert not wrong and result.why_not == [] and result.confidence == "inferred"
    assert result.evidence == ["first checkpoint written after the restart: step-000000040 (no resume record)"]


async def test_without_a_resume_record_a_first_checkpoint_not_past_the_expected_one_is_a_wrong_resume(tmp_path):
    run, stopped = trained_until_stopped(tmp_path)
    (run / "step-000000010").rename(run / "old-10")  # the job started over: its step 10 is new
    save_checkpoint(run, 10, 1.0, FILES)
    result, wrong = await check(run, stopped)
    assert wrong and result.confidence == "inferred"
    assert result.why_not == [
        "the job's first checkpoint after the restart is step-000000010 (step 10), not past step-000000030: "
        "it went on from an older checkpoint or from scratch"
    ]


async def test_the_resume_record_a_job_writes_in_three_lines_is_one_the_controller_reads(tmp_path, monkeypatch):
    """The snippet of docs/checkpoints.md, run as a job would run it."""
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    loaded_id, step, run_dir = "step_30", 30, tmp_path
    # --- the snippet
    with open(os.path.join(run_dir, "resume-log.jsonl"), "a") as log:
        env, now = os.environ, datetime.now(timezone.utc).isoformat()
        log.write(
            json.dumps(
                {
                    "job_id": env["SLURM_JOB_ID"],
                    "restart_count": int(env.get("SLURM_RESTART_COUNT", 0)),
                    "checkpoint_id": loaded_id,
                    "resumed_step": step,
                    "started_at": now,
                }
            )
            + "\n"
        )
    # ---
    [read] = await CheckpointStore().resume_records(str(tmp_path))
    assert (read.job_id, read.restart_count, read.checkpoint_id, read.resumed_step) == ("7", 1, "step_30", 30)


async def test_a_record_without_a_time_zone_is_utc_and_one_that_does_not_read_is_left_out(tmp_path):
    with open(tmp_path / "resume-log.jsonl", "w") as log:
        log.write(json.dumps({"job_id": "7", "restart_count": 0, "checkpoint_id": None, "resumed_step": None}) + "\n")
        record = {"job_id": "7", "restart_count": 1, "checkpoint_id": "step_30", "resumed_step": 30}
        log.write(json.dumps({**record, "started_at": "2026-12-05T10:00:00"}) + "\n")
    [read] = await CheckpointStore().resume_records(str(tmp_path))
    assert read.started_at == datetime(2026, 12, 5, 10, 0, tzinfo=timezone.utc)


async def test_an_expected_checkpoint_off_the_checkpoint_grid_leaves_the_inference_inconclusive(tmp_path):
    """An emergency checkpoint at step 37 and a job that resumed from step 30 would both write step 40 next."""
    run, _ = trained_until_stopped(tmp_path)
    save_checkpoint(run, 37, 3.7, FILES)
    stopped = datetime.now(timezone.utc)
    save_checkpoint(run, 40, 4.0, FILES)
    result, wrong = await check(run, stopped)
    assert result.expected_checkpoint is not None and result.expected_checkpoint.step == 37
    assert not wrong and result.confidence == "inferred"
    assert result.why_not == [
        "no resume record, and step-000000037 lies off the job's checkpoint grid (every 10 steps): its first "
        "checkpoint after the restart, step-000000040, cannot tell it from an older one"
    ]


async def test_the_expected_checkpoint_written_after_the_controllers_clock_says_stop_is_not_new(tmp_path):
    """A file server's clock ahead of the worker's: the SIGTERM checkpoint seems written after the requeue."""
    run = tmp_path / "run"
    for step in (10, 20):
        save_checkpoint(run, step, step * 0.1, FILES)
    stopped = datetime.now(timezone.utc)
    save_checkpoint(run, 30, 3.0, FILES)  # the newest when the job stopped, by the files' clock
    result, wrong = await check(run, stopped, expected_before=datetime.now(timezone.utc))
    assert result.expected_checkpoint is not None and result.expected_checkpoint.step == 30
    assert not wrong and result.why_not == [
        "no resume record for restart 1, and no checkpoint written since the restart yet"
    ]


async def test_a_resume_record_cannot_grow_the_incidents_history_without_bound(tmp_path):
    """The job writes it: an endless skipped list or reason is cut, and the record still counts."""
    skipped = [{"checkpoint_id": f"step_{i}", "why": "x" * 10_000} for i in range(5_000)]
    record = {"job_id": "7", "restart_count": 1, "checkpoint_id": "step_30", "resumed_step": 30}
    (tmp_path / "resume-log.jsonl").write_text(
        json.dumps({**record, "started_at": "2026-12-05T10:00:00+00:00", "skipped_checkpoints": skipped}) + "\n"
    )
    [read] = await CheckpointStore().resume_records(str(tmp_path))
    assert read.checkpoint_id == "step_30" and len(read.skipped_checkpoints) == 20
    assert read.skipped_checkpoints[0].checkpoint_id == "step_0" and len(read.skipped_checkpoints[0].why) == 300
