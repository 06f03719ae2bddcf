"""The incident report: pure arithmetic over what the workflow recorded (no I/O, deterministic).

Lost training progress (steps and training seconds between the checkpoint a job resumed from and
the last step it had reached) is kept apart from node-replacement time (failure to spare in
service) and from time to resume (failure to the job training again).
"""

from __future__ import annotations

from datetime import datetime

from contracts.models import (
    ActionRecord,
    DecisionRecord,
    FaultClassification,
    Goodput,
    IncidentAction,
    IncidentReport,
    JobReport,
    JobSnapshot,
    JobVerification,
    NodeFailureAlert,
    OutcomeKind,
    PeerIncident,
    Phase,
    SpareResult,
)


def seconds_between(start: datetime, end: datetime | None) -> float | None:
    return None if end is None else round((end - start).total_seconds(), 3)


def job_report(snapshot: JobSnapshot, verification: JobVerification | None, failure_at: datetime) -> JobReport:
    job = snapshot.job
    report = JobReport(
        job_id=job.job_id, restart_count=job.restart_count, nodes_before=job.nodes, nodes_after=[], verified=False
    )
    if verification is None:
        return report
    report.restart_count = verification.restart_count_after
    report.nodes_after = verification.nodes_after
    report.verified = verification.verified
    report.why_not = verification.why_not
    report.evidence, report.confidence = verification.evidence, verification.confidence
    if verification.expected_checkpoint is not None:
        report.latest_complete_step = verification.expected_checkpoint.step
    resume = verification.resume
    if resume is None:
        return report
    report.resumed_step = resume.resumed_step
    report.skipped_checkpoints = resume.skipped_checkpoints
    report.time_to_resume_seconds = seconds_between(failure_at, resume.started_at)
    # The job itself recorded how far the previous run got; the snapshot is the fallback.
    last_step = resume.previous_last_step
    if last_step is None and snapshot.progress is not None:
        last_step = snapshot.progress.step
    report.last_step_before_failure = last_step
    if last_step is not None:
        report.lost_steps = max(0, last_step - (resume.resumed_step or 0))
    progress = snapshot.progress
    if resume.previous_train_seconds is not None:
        report.lost_seconds = round(max(0.0, resume.previous_train_seconds - resume.resumed_train_seconds), 3)
        report.lost_seconds_basis = "training time recorded by the job"
    elif report.lost_steps is not None and progress is not None and progress.step > 0:
        # a job that records no training time at its checkpoints (a DCP job's resume record)
        report.lost_seconds = round(report.lost_steps * progress.train_seconds / progress.step, 3)
        report.lost_seconds_basis = "lost steps x the job's mean step time"
    report.goodput = job_goodput(snapshot, verification, report.lost_seconds, failure_at)
    return report


def job_goodput(
    snapshot: JobSnapshot, verification: JobVerification, lost_seconds: float | None, failure_at: datetime
) -> Goodput | None:
    """CRE's goodput over the incident's window: from the start of the run the failure interrupted
    (its resume record) to the job training again (verified). None while a term is unknown."""
    resume, interrupted = verification.resume, verification.previous_resume
    end = verification.verified_at if verification.verified else None
    if resume is None or resume.launched_at is None or interrupted is None or end is None or lost_seconds is None:
        return None
    progress = snapshot.progress
    return goodput_of(
        Goodput(
            window_start=interrupted.started_at,
            window_end=end,
            wall_seconds=round((end - interrupted.started_at).total_seconds(), 3),
            lost_work_seconds=lost_seconds,
            resume_seconds=round(max(0.0, (resume.started_at - resume.launched_at).total_seconds()), 3),
            reschedule_seconds=round(max(0.0, (resume.launched_at - failure_at).total_seconds()), 3),
            checkpoint_save_seconds=round(progress.save_seconds or 0.0, 3) if progress is not None else 0.0,
            goodput=None,
        )
    )


def goodput_of(terms: Goodput) -> Goodput:
    """The terms with their ratio: (t_w - t_ch - t_rm - t_re - t_save) / (t_w - t_re)."""
    useful = (
        terms.wall_seconds
        - terms.lost_work_seconds
        - terms.resume_seconds
        - terms.reschedule_seconds
        - terms.checkpoint_save_seconds
    )
    held = terms.wall_seconds - terms.reschedule_seconds
    return terms.model_copy(update={"goodput": round(useful / held, 4) if held > 0 else None})


_GOODPUT_TERMS = (
    "wall_seconds",
    "lost_work_seconds",
    "resume_seconds",
    "reschedule_seconds",
    "checkpoint_save_seconds",
)


def incident_goodput(jobs: list[JobReport]) -> Goodput | None:
    """Every job's terms summed (the ratio of the sums), over the jobs whose goodput is known."""
    known = [j.goodput for j in jobs if j.goodput is not None]
    if not known:
        return None
    summed = {term: round(sum(getattr(g, term) for g in known), 3) for term in _GOODPUT_TERMS}
    return goodput_of(
        Goodput(
            window_start=min(g.window_start for g in known),
            window_end=max(g.window_end for g in known),
            goodput=None,
            **summed,
        )
    )


def build_report(
    *,
    incident_id: str,
    node: str,
    classification: FaultClassification,
    action: IncidentAction,
    outcome: str,
    outcome_kind: OutcomeKind,
    failure_at: datetime,
    phases: list[Phase],
    jobs: list[JobSnapshot],
    verifications: list[JobVerification],
    spare: SpareResult | None,
    alerts: list[NodeFailureAlert],
    alert_counts: dict[str, int],
    actions: list[ActionRecord],
    decisions: list[DecisionRecord] | None = None,
    return_to_service: str | None = None,
    failed_together: dict[int, list[PeerIncident]] | None = None,
) -> IncidentReport:
    by_id = {v.job_id: v for v in verifications}
    job_reports = [job_report(s, by_id.get(s.job.job_id), failure_at) for s in jobs]
    for job in job_reports:
        job.failed_together = [peer for peer in (failed_together or {}).get(job.job_id, []) if peer.node != node]
    report = IncidentReport(
        incident_id=incident_id,
        node=node,
        xid=classification.xid,
        fault_class=classification.fault_class,
        action=action,
        outcome=outcome,
        outcome_kind=outcome_kind,
        failure_at=failure_at,
        phases=phases,
        jobs=job_reports,
        alerts=alerts,
        alert_counts=alert_counts,
        actions=[a for a in actions if a.executed],
        decisions=decisions or [],
        return_to_service=return_to_service,
        intended_actions=[a for a in actions if not a.executed],
        dry_run=any(not a.executed for a in actions),
    )
    if spare is not None:
        report.spare_node = spare.node
        if spare.healthy:
            report.replacement_seconds = seconds_between(failure_at, spare.in_service_at)
    resumed = [j for j in job_reports if j.time_to_resume_seconds is not None]
    if resumed:
        # The incident is over for training when the last job trains again; losses add up.
        report.time_to_resume_seconds = max(j.time_to_resume_seconds or 0.0 for j in resumed)
        report.lost_steps = sum(j.lost_steps or 0 for j in resumed)
        report.lost_seconds = round(sum(j.lost_seconds or 0.0 for j in resumed), 3)
        first = resumed[0]
        report.resumed_step = first.resumed_step
        report.latest_complete_step = first.latest_complete_step
        report.skipped_checkpoints = [s for j in resumed for s in j.skipped_checkpoints]
    report.goodput = incident_goodput(job_reports)
    return report
