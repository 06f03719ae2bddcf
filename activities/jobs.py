"""Steps 3, 4 and 7 for the jobs on the failed node: find, signal, wait for a checkpoint,
requeue away from the node, and verify that each restarted from its latest complete checkpoint.

Waiting activities poll with a heartbeat, so a dead worker is noticed within the heartbeat
timeout and the poll resumes on another worker; the workflow owns every deadline.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import datetime, timedelta, timezone

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from backends.checkpoints import CheckpointStore
from backends.slurm import SlurmClient, SlurmNotFound, SlurmUnavailable
from contracts.audit import record
from contracts.models import (
    DIED_OF_THE_FAULT,
    FINISHED_JOB_STATES,
    HOLDS_ITS_NODES,
    ActionContext,
    ActionRecord,
    CheckpointRef,
    CheckpointWaitRequest,
    CheckpointWaitResult,
    FindJobsRequest,
    JobSnapshot,
    JobVerification,
    PinnedJobs,
    ReadmitRequest,
    RequeueRequest,
    RequeueResult,
    SignalRequest,
    SlurmJob,
    VerifyRequest,
    utc_now,
)

POLL_SECONDS = 0.5
# The signal's look at the job: a job read takes milliseconds; one that hangs must leave the signal
# its time (the call's quick tries have 10 s in all).
SIGNAL_LOOK_SECONDS = 3.0
# Why a pending job waits, where Slurm says it never starts as it is: no deadline needs waiting out.
NEVER_STARTS = frozenset(
    {"BadConstraints", "PartitionConfig", "DependencyNeverSatisfied", "InvalidAccount", "InvalidQOS"}
)


class JobActivities:
    def __init__(self, slurm: SlurmClient, checkpoints: CheckpointStore):
        self._slurm = slurm
        self._checkpoints = checkpoints

    @activity.defn
    async def find_jobs(self, req: FindJobsRequest | str) -> list[JobSnapshot]:
        """The jobs on the node, and those the fault may have killed already: with srun's
        --kill-on-bad-exit (common for torchrun jobs) the lost GPU's crashed rank ends the whole
        job, often before the alert arrives. (A node name alone: an incident begun before that.)"""
        req = req if isinstance(req, FindJobsRequest) else FindJobsRequest(node=req)
        node, died_since = req.node, req.died_since
        snapshots = []
        for job in await self._slurm.jobs_on_node(node, died_since=died_since):
            latest = progress = None
            if job.checkpoint_dir:
                latest, _ = await self._checkpoints.latest_complete(job.checkpoint_dir, fmt=job.checkpoint_format)
                progress = await self._checkpoints.progress(job.checkpoint_dir)
            snapshots.append(
                JobSnapshot(job=job, checkpoint_dir=job.checkpoint_dir, latest_complete=latest, progress=progress)
            )
        return snapshots

    @activity.defn
    async def signal_job(self, req: SignalRequest) -> ActionRecord:
        """The signal to the job, while it still runs where and as the incident found it. A job that
        has moved on (requeued by another node's incident, or ended) is not signalled, for good
        (JobMovedOn): a pending job cannot be signalled (Slurm refuses, retried for 10 minutes
        before), and a job that has just restarted may not have its handler in yet: the signal's
        default action would end it. A job Slurm cannot read now is signalled as found (seconds ago):
        the read is one short try, so a broken or hung read never holds the signal (it held it 10
        minutes)."""
        unread = ""
        if req.node is not None and req.restart_count is not None:
            try:
                job = await asyncio.wait_for(self._slurm.get_job(req.job_id), SIGNAL_LOOK_SECONDS)
            except (SlurmUnavailable, asyncio.TimeoutError) as e:
                unread = f"; as found (its state unread: {str(e)[:200] or 'no answer in time'})"
            else:
                if (
                    job.restart_count != req.restart_count
                    or job.state not in HOLDS_ITS_NODES
                    or req.node not in job.nodes
                ):
                    raise ApplicationError(
                        f"job {req.job_id} not signalled: it is {job.state} on {','.join(job.nodes) or 'no node'}, "
                        f"restart {job.restart_count}; found on {req.node}, restart {req.restart_count}",
                        type="JobMovedOn",
                        non_retryable=True,
                    )
        call = await self._slurm.acting(req.ctx.dry_run).signal_job(req.job_id, req.signal)
        return record(
            "signal_job",
            f"job {req.job_id}",
            call,
            req.ctx,
            f"SIG{req.signal} to the batch shell and every step{unread}",
        )

    @activity.defn
    async def readmit_node(self, req: ReadmitRequest) -> list[ActionRecord]:
        """Takes the node out of the exclusions of those jobs still pending (Slurm changes a job's
        exclusions only then; a running one keeps it until its next requeue). Safe to retry: a job
        without it is left alone."""
        actions = []
        for job_id in req.job_ids:
            try:
                job = await self._slurm.get_job(job_id)
            except SlurmNotFound:
                continue  # forgotten by Slurm: nothing to readmit it to
            if job.state != "PENDING" or req.node not in job.excluded_nodes:
                continue
            kept = [n for n in job.excluded_nodes if n != req.node]
            call = await self._slurm.acting(req.ctx.dry_run).set_excluded_nodes(job_id, kept)
            detail = f"ExcNodeList={','.join(kept) or '(none)'}: {req.why}"
            actions.append(record("readmit_node", f"job {job_id}", call, req.ctx, detail))
        return actions

    @activity.defn
    async def wait_for_checkpoint(self, req: CheckpointWaitRequest) -> CheckpointWaitResult:
        """One look for a complete checkpoint newer than `after_step`. Not there yet: a benign
        failure, and the retry policy looks again after `poll_seconds`. Each look is short, so
        the workflow's grace timer stays the only deadline and a worker crash loses nothing."""
        latest, _ = await self._checkpoints.latest_complete(req.checkpoint_dir, fmt=req.checkpoint_format)
        if latest is not None and (req.after_step is None or latest.step > req.after_step):
            waited = utc_now() - activity.info().scheduled_time
            return CheckpointWaitResult(job_id=req.job_id, new_checkpoint=latest, waited_seconds=waited.total_seconds())
        raise ApplicationError(
            f"no complete checkpoint after step {req.after_step} yet",
            type="NoNewCheckpointYet",
            category=ApplicationErrorCategory.BENIGN,
            next_retry_delay=timedelta(seconds=req.poll_seconds),
        )

    @activity.defn
    async def requeue_job(self, req: RequeueRequest) -> RequeueResult:
        """Requeue held, keep the job off its failed nodes, release. Safe to retry: Slurm's own
        restart count tells whether an earlier attempt (or another node's incident) already
        requeued the job since the snapshot `req.job`."""
        job_id, ctx, actions = req.job.job_id, req.ctx, list[ActionRecord]()
        if ctx.dry_run:
            return await self._plan_requeue(req)
        failed = req.failed_nodes
        job = await self._slurm.get_job(job_id)
        if req.pinned_jobs == PinnedJobs.LEAVE and (pinned := _pinned_to(job, failed)):
            return self._left(job, actions, ctx, _left_pinned_why(job, pinned), left_pinned_to=pinned)
        requeued_now = False
        if job.restart_count == req.job.restart_count:
            holds = job.state in HOLDS_ITS_NODES
            if job.state == "PENDING":
                pass  # not started again since: keep it off the failed nodes below
            elif not holds and job.state not in DIED_OF_THE_FAULT:
                return self._left(job, actions, ctx, f"not requeued: job is {job.state} ({job.state_reason})")
            elif not set(job.nodes) & set(failed):
                return self._left(
                    job,
                    actions,
                    ctx,
                    f"not requeued: job {'runs' if holds else 'ended'} on "
                    f"{','.join(job.nodes)}, off the failed node(s) {','.join(failed)}",
                )
            else:
                call = await self._slurm.requeue_hold(job_id)
                ended = f"{job.state} ({job.state_reason}) on the failed node"
                died = (
                    ""
                    if holds
                    else f"it had ended {ended} before the incident found it: "
                    if req.job.state in DIED_OF_THE_FAULT
                    else f"it ended {ended} after it was found running there: "
                )
                actions.append(
                    record(
                        "requeue_hold",
                        f"job {job_id}",
                        call,
                        ctx,
                        died + "requeued in held state so it cannot start before it is kept off the node",
                    )
                )
                requeued_now = True
        else:
            by = (
                "an earlier attempt, or by Slurm itself (the job asked --requeue=expedite: Slurm requeues "
                "it when its node fails)"
                if job.expedited_requeue
                else "an earlier attempt"
            )
            actions.append(
                record(
                    "requeue_hold",
                    f"job {job_id}",
                    "none",
                    ctx,
                    f"already requeued by {by} (restart count {job.restart_count})",
                )
            )
        job = await self._wait_until_pending(job_id)
        # Every process of the job has exited now: no checkpoint of this run can appear any more.
        at_stop = await self._latest_complete_before_restart(req.job, job.restart_count)
        if job.state == "PENDING":  # Slurm refuses ExcNodeList for a job that started
            # The job's other nodes fenced by their own incidents meanwhile, which may join later.
            fenced = await self._fenced_by_recovery(req.job.nodes, ctx.owner, failed)
            excluded = sorted({*job.excluded_nodes, *failed, *fenced})
            if pinned := _pinned_to(job, excluded):  # first: Slurm would keep it PENDING (BadConstraints)
                actions.append(await self._unpin(job, pinned, ctx))
            if excluded != sorted(job.excluded_nodes):
                call = await self._slurm.set_excluded_nodes(job_id, excluded)
                actions.append(
                    record(
                        "exclude_nodes",
                        f"job {job_id}",
                        call,
                        ctx,
                        f"ExcNodeList={','.join(excluded)}"
                        + (f" ({', '.join(fenced)} fenced by their own incidents)" if fenced else ""),
                    )
                )
        if job.held and job.restart_count != req.job.restart_count:  # held by a requeue, not by its owner
            call = await self._slurm.release_job(job_id)
            actions.append(record("release_job", f"job {job_id}", call, ctx, "released to run elsewhere"))
        return RequeueResult(
            job_id=job_id,
            requeued_now=requeued_now,
            restart_count=job.restart_count,
            latest_complete_at_stop=at_stop,
            actions=actions,
        )

    async def _fenced_by_recovery(self, nodes: list[str], owner: str, failed: list[str]) -> list[str]:
        """Those of `nodes`, beyond `failed`, that an incident has drained or marked down (its reason says so)."""
        others = set(nodes) - set(failed)
        if not others:
            return []
        return sorted(
            node.name
            for node in await self._slurm.list_nodes()
            if node.name in others
            and (node.drained or node.state == "down")
            and node.reason.startswith(f"{owner}: XID")
        )

    async def _unpin(
        self, job: SlurmJob, pinned: list[str], ctx: ActionContext, slurm: SlurmClient | None = None
    ) -> ActionRecord:
        kept = [node for node in job.required_nodes if node not in pinned]
        call = await (slurm or self._slurm).set_required_nodes(job.job_id, kept)
        return record(
            "unpin_job",
            f"job {job.job_id}",
            call,
            ctx,
            f"ReqNodeList={','.join(kept) or '(none)'}: it was pinned to the failed node(s) "
            f"{','.join(pinned)} (policy pinned_jobs=unpin)",
        )

    @staticmethod
    def _left(
        job: SlurmJob,
        actions: list[ActionRecord],
        ctx: ActionContext,
        why: str,
        left_pinned_to: list[str] | None = None,
    ) -> RequeueResult:
        actions.append(record("requeue_job", f"job {job.job_id}", "none", ctx, why))
        return RequeueResult(
            job_id=job.job_id,
            requeued_now=False,
            restart_count=job.restart_count,
            actions=actions,
            left_pinned_to=left_pinned_to or [],
        )

    async def _plan_requeue(self, req: RequeueRequest) -> RequeueResult:
        """Dry-run: the three calls a requeue makes, described and not made; the job keeps running."""
        slurm, job_id, ctx = self._slurm.planning(), req.job.job_id, req.ctx
        job = await slurm.get_job(job_id)
        pinned = _pinned_to(job, req.failed_nodes)
        if pinned and req.pinned_jobs == PinnedJobs.LEAVE:
            return self._left(job, [], ctx, "would leave it: " + _left_pinned_why(job, pinned), left_pinned_to=pinned)
        excluded = sorted({*job.excluded_nodes, *req.failed_nodes})
        actions = [
            record(
                "requeue_hold", f"job {job_id}", await slurm.requeue_hold(job_id), ctx, "would requeue in held state"
            ),
            *([await self._unpin(job, pinned, ctx, slurm)] if pinned else []),
            record(
                "exclude_nodes",
                f"job {job_id}",
                await slurm.set_excluded_nodes(job_id, excluded),
                ctx,
                f"ExcNodeList={','.join(excluded)}",
            ),
            record(
                "release_job", f"job {job_id}", await slurm.release_job(job_id), ctx, "would release to run elsewhere"
            ),
        ]
        return RequeueResult(
            job_id=job_id,
            requeued_now=False,
            restart_count=job.restart_count,
            latest_complete_at_stop=await self._latest_complete_before_restart(job, job.restart_count + 1),
            actions=actions,
        )

    async def _latest_complete_before_restart(self, job: SlurmJob, restart_count: int) -> CheckpointRef | None:
        """The checkpoint the restarted job should load. A retried activity may run after the job
        restarted: then only checkpoints from before the restart count."""
        if not job.checkpoint_dir:
            return None
        restarted = [
            r for r in await self._checkpoints.resume_records(job.checkpoint_dir) if r.restart_count == restart_count
        ]
        cutoff = restarted[-1].started_at if restarted else None
        latest, _ = await self._checkpoints.latest_complete(
            job.checkpoint_dir, created_before=cutoff, fmt=job.checkpoint_format
        )
        return latest

    async def _wait_until_pending(self, job_id: int) -> SlurmJob:
        # A requeued job is COMPLETING for a moment before it is PENDING again.
        while True:
            job = await self._slurm.get_job(job_id)
            if job.state == "PENDING" or job.state == "RUNNING":
                return job
            activity.heartbeat(job.state)
            await asyncio.sleep(POLL_SECONDS / 5)

    @activity.defn
    async def verify_restart(self, req: VerifyRequest) -> JobVerification:
        """Polls until the job runs again as it should, or the deadline passes (then it says why)."""
        deadline = time.monotonic() + req.deadline_seconds
        first_look = True
        while True:
            result, hopeless = await self._check_restart(req)
            if result.verified:
                result.verified_at = _verified_at(result, seen_now=not first_look)
            if result.verified or hopeless or time.monotonic() >= deadline:
                return result
            first_look = False
            activity.heartbeat(result.why_not)
            await asyncio.sleep(POLL_SECONDS)

    async def _check_restart(self, req: VerifyRequest) -> tuple[JobVerification, bool]:
        """The verification as it stands now, and whether waiting longer could change it."""
        before = req.snapshot.job
        why: list[str] = []
        if req.requeue.left_pinned_to:
            left = JobVerification(
                job_id=before.job_id,
                verified=False,
                restart_count_before=before.restart_count,
                restart_count_after=req.requeue.restart_count,
                nodes_before=before.nodes,
                nodes_after=[],
                why_not=[
                    f"not requeued: pinned to the failed node(s) "
                    f"{','.join(req.requeue.left_pinned_to)} (policy pinned_jobs=leave)"
                ],
            )
            return left, True
        try:
            job = await self._slurm.get_job(before.job_id)
        except SlurmNotFound:
            gone = JobVerification(
                job_id=before.job_id,
                verified=False,
                why_not=["job is gone from Slurm"],
                restart_count_before=before.restart_count,
                restart_count_after=-1,
                nodes_before=before.nodes,
                nodes_after=[],
            )
            return gone, True
        if job.state != "RUNNING":
            why.append(f"job is {job.state} ({job.state_reason}), not RUNNING")
        if on_failed := [node for node in req.failed_nodes if node in job.nodes and node not in req.readmitted]:
            why.append(f"job runs on the failed node {','.join(on_failed)}")
        if job.restart_count != req.expected_restart_count:
            why.append(f"restart count is {job.restart_count}, expected {req.expected_restart_count}")
        result = JobVerification(
            job_id=job.job_id,
            verified=False,
            why_not=why,
            restart_count_before=before.restart_count,
            restart_count_after=job.restart_count,
            nodes_before=before.nodes,
            nodes_after=job.nodes if job.state == "RUNNING" else [],
        )
        wrong_checkpoint = False
        if req.snapshot.checkpoint_dir:
            wrong_checkpoint = await self._check_resume(req, req.snapshot.checkpoint_dir, result)
        result.verified = not result.why_not
        hopeless = (
            wrong_checkpoint
            or job.restart_count > req.expected_restart_count
            or job.state in FINISHED_JOB_STATES
            or (job.state == "PENDING" and job.state_reason in NEVER_STARTS)
        )
        return result, hopeless

    async def _check_resume(self, req: VerifyRequest, run_dir: str, result: JobVerification) -> bool:
        """Adds what is not yet right about the resume; True when it resumed from the wrong checkpoint.
        The job's resume record says which checkpoint it loaded; a job that keeps none is judged by
        the first checkpoint it wrote after the restart (result.evidence and confidence say which)."""
        fmt = req.snapshot.job.checkpoint_format
        expected = result.expected_checkpoint = req.requeue.latest_complete_at_stop
        every_record = await self._checkpoints.resume_records(run_dir)
        records = [r for r in every_record if r.restart_count == req.expected_restart_count]
        interrupted = [r for r in every_record if r.restart_count == req.expected_restart_count - 1]
        result.previous_resume = interrupted[-1] if interrupted else None
        if not records:
            return await self._infer_resume(req, run_dir, result)
        resume = result.resume = records[-1]
        result.resumed_at = resume.started_at
        # What the job should have loaded: the newest checkpoint complete when it stopped.
        expected_id = expected.checkpoint_id if expected else None
        wrong_checkpoint = resume.checkpoint_id != expected_id
        if wrong_checkpoint:
            result.why_not.append(
                f"job resumed from {resume.checkpoint_id or 'scratch'}, "
                f"but the latest complete checkpoint was {expected_id or 'none'}"
            )
        result.evidence = [f"resume record: {resume.checkpoint_id or 'from scratch'}"]
        result.confidence = "confirmed"
        resumed_step = resume.resumed_step or 0
        progress = await self._checkpoints.progress(run_dir)
        if (
            progress is not None
            and progress.restart_count == req.expected_restart_count
            and progress.step > resumed_step
        ):
            result.progress_step_after = progress.step
            result.evidence.append(f"progress record: step {progress.step}")
        elif newer := [
            c for c in await self._checkpoints.written_after(run_dir, resume.started_at, fmt) if c.step > resumed_step
        ]:
            result.progress_step_after = newer[0].step
            result.evidence.append(f"checkpoint written after the restart: {newer[0].checkpoint_id}")
        else:
            result.why_not.append(f"no training progress past step {resumed_step} yet")
        return wrong_checkpoint

    async def _infer_resume(self, req: VerifyRequest, run_dir: str, result: JobVerification) -> bool:
        """No resume record: the first checkpoint the job wrote after it stopped shows where it went
        on from, when the expected one lies on the job's checkpoint grid (the steps' common interval):
        past its step, the job resumed from it (the newest when it stopped); at or below it, from an
        older one or from scratch. An expected checkpoint off the grid (an emergency save) cannot be
        told from the one before it so: the verification then waits for a resume record."""
        expected, fmt = result.expected_checkpoint, req.snapshot.job.checkpoint_format
        stopped = max((a.at for a in req.requeue.actions), default=None) or (expected.created_at if expected else None)
        written = [
            c
            for c in (await self._checkpoints.written_after(run_dir, stopped, fmt) if stopped else [])
            # the expected checkpoint itself, unchanged, is not new (a file server's clock may run ahead)
            if expected is None or (c.checkpoint_id, c.created_at) != (expected.checkpoint_id, expected.created_at)
        ]
        if not written:
            result.why_not.append(
                f"no resume record for restart {req.expected_restart_count}, and no checkpoint written since the "
                "restart yet"
            )
            return False
        first = min(written, key=lambda c: c.created_at)
        result.progress_step_after = max(c.step for c in written)
        result.evidence = [f"first checkpoint written after the restart: {first.checkpoint_id} (no resume record)"]
        result.confidence = "inferred"
        if expected is None:
            return False
        if first.step <= expected.step:
            result.why_not.append(
                f"the job's first checkpoint after the restart is {first.checkpoint_id} (step {first.step}), not past "
                f"{expected.checkpoint_id}: it went on from an older checkpoint or from scratch"
            )
            return True
        earlier = [c.step for c in await self._checkpoints.complete_before(run_dir, expected.created_at, fmt)]
        grid = math.gcd(*earlier) if earlier else 0
        if grid == 0 or expected.step % grid:
            result.why_not.append(
                f"no resume record, and {expected.checkpoint_id} lies off the job's checkpoint grid "
                f"({f'every {grid} steps' if grid else 'no earlier checkpoint'}): its first checkpoint after the "
                f"restart, {first.checkpoint_id}, cannot tell it from an older one"
            )
        return False


def _verified_at(result: JobVerification, seen_now: bool) -> datetime:
    """When the job was back: now, when this attempt saw it come back; found back at its first look
    (the attempt before it died with its worker, or none was running), the job's own record of its
    restart, so the incident's timeline says when the job came back, not when a worker looked."""
    now = datetime.now(timezone.utc)
    if seen_now or result.resumed_at is None:
        return now
    return min(now, result.resumed_at)


def _pinned_to(job: SlurmJob, nodes: list[str]) -> list[str]:
    """Those of `nodes` the job is pinned to (`sbatch -w`): kept off them, it would never start."""
    return [node for node in job.required_nodes if node in nodes]


def _left_pinned_why(job: SlurmJob, pinned: list[str]) -> str:
    return (
        f"not requeued: pinned to the failed node(s) {','.join(pinned)} (ReqNodeList={','.join(job.required_nodes)}), "
        "left as found (policy pinned_jobs=leave): it runs again only on its pinned nodes"
    )
