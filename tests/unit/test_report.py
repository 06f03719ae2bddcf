"""The report keeps lost training progress apart from replacement and resume times."""

from datetime import datetime, timedelta, timezone

from contracts.models import (
    CheckpointRef,
    FaultClass,
    FaultClassification,
    IncidentAction,
    JobProgress,
    JobSnapshot,
    JobVerification,
    OutcomeKind,
    ResumeRecord,
    SkippedCheckpoint,
    SlurmJob,
    SpareResult,
)
from workflows.report import build_report

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def snapshot(job_id: int, last_step: int) -> JobSnapshot:
    return JobSnapshot(
        job=SlurmJob(job_id=job_id, state="RUNNING", nodes=["gpu-1", "gpu-2"], restart_count=0),
        checkpoint_dir=f"/ckpt/{job_id}",
        latest_complete=None,
        progress=JobProgress(
            job_id=str(job_id), restart_count=0, step=last_step, train_seconds=0.0, updated_at=T0, state="stalled"
        ),
    )


def verification(
    job_id: int,
    resumed_step: int,
    previous_step: int,
    resumed_at: float,
    previous_seconds: float,
    resumed_seconds: float,
    skipped=(),
) -> JobVerification:
    return JobVerification(
        job_id=job_id,
        verified=True,
        restart_count_before=0,
        restart_count_after=1,
        nodes_before=["gpu-1", "gpu-2"],
        nodes_after=["gpu-1", "gpu-3"],
        expected_checkpoint=CheckpointRef(
            checkpoint_id=f"step-{resumed_step:09d}",
            step=resumed_step,
            train_seconds=resumed_seconds,
            created_at=at(-5),
        ),
        resume=ResumeRecord(
            job_id=str(job_id),
            restart_count=1,
            resumed_step=resumed_step,
            checkpoint_id=f"step-{resumed_step:09d}",
            skipped_checkpoints=list(skipped),
            previous_last_step=previous_step,
            previous_train_seconds=previous_seconds,
            resumed_train_seconds=resumed_seconds,
            started_at=at(resumed_at),
        ),
        resumed_at=at(resumed_at),
    )


def report(jobs, verifications, spare):
    return build_report(
        incident_id="i",
        node="gpu-2",
        classification=FaultClassification(xid=79, fault_class=FaultClass.FATAL, policy_source="t"),
        action=IncidentAction.RECOVER,
        outcome="recovered",
        outcome_kind=OutcomeKind.RECOVERED,
        failure_at=T0,
        phases=[],
        jobs=jobs,
        verifications=verifications,
        spare=spare,
        alerts=[],
        alert_counts={},
        actions=[],
    )


def test_lost_progress_and_times_for_one_job():
    skipped = [SkippedCheckpoint(checkpoint_id="step-000000030", why="no manifest")]
    r = report(
        [snapshot(5, 34)],
        [verification(5, 20, 37, 14.5, 7.4, 4.0, skipped)],
        SpareResult(node="gpu-5", healthy=True, in_service_at=at(3.25)),
    )
    assert r.replacement_seconds == 3.25
    assert r.time_to_resume_seconds == 14.5
    # The job's own record of how far it got (37) wins over the controller's snapshot (34).
    assert (r.lost_steps, r.lost_seconds) == (17, 3.4)
    assert (r.resumed_step, r.latest_complete_step) == (20, 20)
    assert r.skipped_checkpoints == skipped
    job = r.jobs[0]
    assert (job.job_id, job.restart_count, job.nodes_before, job.nodes_after) == (
        5,
        1,
        ["gpu-1", "gpu-2"],
        ["gpu-1", "gpu-3"],
    )


def test_losses_add_up_and_resume_waits_for_the_last_job():
    r = report(
        [snapshot(5, 30), snapshot(6, 50)],
        [verification(5, 20, 30, 10.0, 6.0, 4.0), verification(6, 40, 50, 22.0, 10.0, 8.0)],
        None,
    )
    assert r.lost_steps == 10 + 10
    assert r.lost_seconds == 4.0
    assert r.time_to_resume_seconds == 22.0
    assert r.replacement_seconds is None and r.spare_node is None


def test_unhealthy_spare_has_no_replacement_time_and_unverified_job_no_losses():
    snap = snapshot(5, 30)
    unverified = JobVerification(
        job_id=5,
        verified=False,
        why_not=["job is PENDING"],
        restart_count_before=0,
        restart_count_after=1,
        nodes_before=["gpu-1", "gpu-2"],
        nodes_after=[],
    )
    r = report([snap], [unverified], SpareResult(node="gpu-5", healthy=False, detail="health check exited 1"))
    assert r.spare_node == "gpu-5" and r.replacement_seconds is None
    assert r.lost_steps is None and r.time_to_resume_seconds is None
    assert r.jobs[0].why_not == ["job is PENDING"]


def test_fresh_start_loses_everything_it_had_done():
    v = verification(5, 0, 12, 9.0, 2.4, 0.0)
    v.resume.resumed_step = None
    v.resume.checkpoint_id = None
    r = report([snapshot(5, 12)], [v], None)
    assert r.lost_steps == 12 and r.lost_seconds == 2.4


def with_goodput_records(v: JobVerification, launched_at: float, verified_at: float, run_started: float):
    """The resume record with its launch time, the interrupted run's record, and when verified."""
    assert v.resume is not None
    resume = v.resume.model_copy(update={"launched_at": at(launched_at)})
    interrupted = resume.model_copy(update={"restart_count": 0, "started_at": at(run_started), "launched_at": None})
    return v.model_copy(update={"resume": resume, "previous_resume": interrupted, "verified_at": at(verified_at)})


def test_goodput_follows_cre_over_the_window_from_the_interrupted_run_to_training_again():
    """(t_w - t_ch - t_rm - t_re - t_save) / (t_w - t_re); the reschedule time leaves the denominator,
    so the replacement's wait does not count against the job's own progress."""
    snap = snapshot(5, 37)
    assert snap.progress is not None
    snap.progress.save_seconds = 1.5
    # the run began 100 s before the failure; relaunched 12 s after it, training again at 14.5 s
    v = with_goodput_records(verification(5, 20, 37, 14.5, 7.4, 4.0), 12.0, 20.0, -100.0)
    r = report([snap], [v], None)
    g = r.jobs[0].goodput
    assert g is not None
    assert (g.wall_seconds, g.lost_work_seconds, g.resume_seconds, g.reschedule_seconds, g.checkpoint_save_seconds) == (
        120.0,
        3.4,
        2.5,
        12.0,
        1.5,
    )
    assert g.goodput == round((120.0 - 3.4 - 2.5 - 12.0 - 1.5) / (120.0 - 12.0), 4)
    assert r.goodput == g  # one job: the incident's is its own


def test_goodput_is_left_unknown_without_the_launch_time_and_sums_over_jobs():
    plain = verification(6, 40, 50, 22.0, 10.0, 8.0)
    r = report([snapshot(6, 50)], [plain], None)
    assert r.jobs[0].goodput is None and r.goodput is None
    both = report(
        [snapshot(5, 30), snapshot(6, 50)],
        [
            with_goodput_records(verification(5, 20, 30, 10.0, 6.0, 4.0), 9.0, 12.0, -48.0),
            with_goodput_records(verification(6, 40, 50, 22.0, 10.0, 8.0), 20.0, 24.0, -76.0),
        ],
        None,
    )
    assert both.goodput is not None and (both.goodput.wall_seconds, both.goodput.reschedule_seconds) == (160.0, 29.0)
    assert both.goodput.goodput == round((160.0 - 4.0 - 3.0 - 29.0) / (160.0 - 29.0), 4)
