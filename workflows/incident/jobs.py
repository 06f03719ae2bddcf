"""The incident's work on the jobs of its node, each job by its id: the checkpoint signal, the
grace period, the requeue off the node and the verification of the restart. Since the
jobs-recovered-together patch the requeue and the verification run in the job's own recovery
(workflows/job_recovery.py), which every incident on the job's nodes joins and which tells each
of them by signal; runs begun before requeue and verify the job themselves."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.job_recovery import JobRecoveryActivities
    from activities.jobs import JobActivities
    from contracts.models import (
        HOLDS_ITS_NODES,
        ActionContext,
        ActionRecord,
        CheckpointWaitRequest,
        JobJoin,
        JobRecovered,
        JobRecoveryFailure,
        JobRequeued,
        JobSnapshot,
        JobVerification,
        PeerIncident,
        ReadmitRequest,
        RecoveryPolicy,
        RequeueRequest,
        RequeueResult,
        SignalRequest,
        SpareResult,
        VerifyRequest,
    )
    from workflows.call_options import HEARTBEAT, JOB_REQUEUE_WAIT, SLURM_CALL, SLURM_RETRY
    from workflows.incident.identity import IncidentRef
    from workflows.incident.slurm_calls import fence_call
    from workflows.incident.steps import Steps

T = TypeVar("T")


def _still_running(jobs: list[JobSnapshot]) -> list[JobSnapshot]:
    """The jobs that can still checkpoint: not those the fault had killed when they were found."""
    return [s for s in jobs if s.job.state in HOLDS_ITS_NODES]


class JobRecoveryFailed(Exception):
    """The job's recovery failed to requeue the job, or said nothing in time (workflows/job_recovery.py)."""


class JobWork:
    def __init__(self, incident: IncidentRef, steps: Steps, actions: list[ActionRecord]) -> None:
        self._incident = incident
        self._steps = steps
        self._actions = actions
        # The jobs' recoveries, by job id: joined, and what they told.
        self._joining: set[int] = set()
        self._requeued: dict[int, JobRequeued] = {}
        self._recovered: dict[int, JobRecovered] = {}
        self._failures: dict[int, JobRecoveryFailure] = {}
        self.failed_together: dict[int, list[PeerIncident]] = {}
        self._readmitted: list[str] = []  # the node, once it serves from new hardware

    # --- what the jobs' recoveries tell (the workflow's signals) --------------------------------

    def heard_requeued(self, heard: JobRequeued) -> None:
        if heard.requeue.job_id in self._joining:  # one answer kept per job, whoever signals
            self._requeued[heard.requeue.job_id] = heard

    def heard_recovered(self, heard: JobRecovered) -> None:
        if heard.requeue.job_id in self._joining:
            self._recovered[heard.requeue.job_id] = heard

    def heard_failure(self, heard: JobRecoveryFailure) -> None:
        if heard.job_id in self._joining:
            self._failures[heard.job_id] = heard

    # --- the steps -----------------------------------------------------------------------------

    async def signal(self, jobs: list[JobSnapshot], ctx: ActionContext) -> None:
        live = _still_running(jobs)
        outcomes = await for_each_job(live, lambda snap: self._signal_job(snap, ctx))
        signalled = [action for action in outcomes if isinstance(action, ActionRecord)]
        self._actions.extend(signalled)
        not_signalled = [why for why in outcomes if isinstance(why, str)]
        died = [f"{s.job.job_id} ({s.job.state})" for s in jobs if s not in live]
        self._steps.note(
            f"SIGUSR1 to {len(signalled)} job(s)"
            + (f"; {'; '.join(not_signalled)}" if not_signalled else "")
            + (f"; already ended: {', '.join(died)}" if died else "")
        )

    async def _signal_job(self, snap: JobSnapshot, ctx: ActionContext) -> ActionRecord | str:
        """The signal's record, or why the job was not signalled: it had moved on (another node's
        incident requeued it) or ended meanwhile; the requeue and the verification say the rest."""
        try:
            return await fence_call(
                JobActivities.signal_job,
                SignalRequest(
                    job_id=snap.job.job_id,
                    signal="USR1",
                    ctx=ctx,
                    node=self._incident.node,
                    restart_count=snap.job.restart_count,
                ),
                f"SIGUSR1 to job {snap.job.job_id}: checkpoint now if you can",
            )
        except ActivityError as e:
            workflow.logger.warning("could not signal job %s: %s", snap.job.job_id, e.cause)
            return str(e.cause.message if isinstance(e.cause, ApplicationError) else e.cause)[:300]

    async def readmit(self, jobs: list[JobSnapshot], node: str, spare: SpareResult, ctx: ActionContext) -> None:
        """The failed Slurm node is the replacement, on new hardware (a StatefulSet-mode slurmd pod
        recreated on another Node): the jobs requeued off it may use it again."""
        readmitted = await workflow.execute_activity_method(
            JobActivities.readmit_node,
            ReadmitRequest(
                node=node,
                job_ids=[s.job.job_id for s in jobs],
                why=f"{node} serves from new hardware ({spare.detail.split(';')[0]})"[:500],
                ctx=ctx,
            ),
            summary=f"Let the jobs kept off {node} use it again: it runs on new hardware",
            **SLURM_CALL,
        )
        self._actions.extend(readmitted)
        self._readmitted = [node]
        self._steps.note("; ".join(a.detail for a in readmitted) or "no job still pending kept off it")

    async def grace(self, jobs: list[JobSnapshot], grace_seconds: float, poll_seconds: float) -> None:
        """Durable grace timer; ends early once every job has written a new complete checkpoint."""
        waits = [
            workflow.start_activity_method(
                JobActivities.wait_for_checkpoint,
                CheckpointWaitRequest(
                    job_id=s.job.job_id,
                    checkpoint_dir=s.checkpoint_dir,
                    checkpoint_format=s.job.checkpoint_format,
                    after_step=s.latest_complete.step if s.latest_complete else None,
                    poll_seconds=poll_seconds,
                ),
                summary=f"Wait for job {s.job.job_id} to write a checkpoint newer than the one it had",
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=poll_seconds), backoff_coefficient=1.0),
            )
            for s in _still_running(jobs)
            if s.checkpoint_dir
        ]
        try:
            await workflow.wait_condition(
                lambda: all(w.done() for w in waits), timeout=timedelta(seconds=grace_seconds)
            )
            self._steps.note(f"{len(waits)} job(s) checkpointed within the grace period")
        except TimeoutError:
            late = sum(not w.done() for w in waits)
            self._steps.note(f"grace period of {grace_seconds:.0f} s ended; {late} job(s) without a new checkpoint")
        finally:
            # Also when the incident is aborted mid-grace: no look for a checkpoint outlives it.
            for w in waits:
                if not w.done():
                    w.cancel()

    async def requeue(
        self, jobs: list[JobSnapshot], node: str, ctx: ActionContext, policy: RecoveryPolicy, together: bool
    ) -> list[RequeueResult]:
        """Each job off the node: through its recovery (`together`), or by this incident. A final
        failure of one requeue ends the incident, with the actions of the others."""
        if together and not ctx.dry_run:
            outcomes = await for_each_job(jobs, lambda snap: self._join_job_recovery(snap, node, ctx, policy))
        else:
            outcomes = await for_each_job(
                jobs,
                lambda snap: workflow.execute_activity_method(
                    JobActivities.requeue_job,
                    RequeueRequest(job=snap.job, failed_node=node, ctx=ctx, pinned_jobs=policy.pinned_jobs),
                    summary=f"Requeue job {snap.job.job_id} away from {node}",
                    heartbeat_timeout=HEARTBEAT,
                    **SLURM_CALL,
                ),
            )
        results = [outcome for outcome in outcomes if isinstance(outcome, RequeueResult)]
        for result in results:
            self._actions.extend(result.actions)
        failed = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        if failed is not None:
            raise failed
        self._steps.note(f"{len(jobs)} job(s) requeued off {node}")
        return results

    async def _join_job_recovery(
        self, snap: JobSnapshot, node: str, ctx: ActionContext, policy: RecoveryPolicy
    ) -> RequeueResult:
        """The job's requeue off this node, by the job's recovery that the incidents on its nodes share."""
        job_id = snap.job.job_id
        self._joining.add(job_id)
        await workflow.execute_activity_method(
            JobRecoveryActivities.join_job_recovery,
            JobJoin(
                incident_id=self._incident.incident_id,
                workflow_id=workflow.info().workflow_id,
                node=node,
                snapshot=snap,
                ctx=ctx,
                verify_deadline_seconds=policy.verify_deadline_seconds,
                pinned_jobs=policy.pinned_jobs,
            ),
            summary=f"Join the recovery of job {job_id}: its requeue away from {node} and its other failed nodes",
            **SLURM_CALL,
        )
        joined = await self._hear(
            job_id, lambda: self._requeued.get(job_id), JOB_REQUEUE_WAIT, f"the requeue of job {job_id}"
        )
        self.failed_together[job_id] = joined.failed_together
        return joined.requeue

    async def verify(
        self, jobs: list[JobSnapshot], requeued: list[RequeueResult], node: str, deadline: float
    ) -> list[JobVerification]:
        """Each job resumed off the node from its latest complete checkpoint: as its recovery
        verified it, or verified by this incident when it requeued the job itself."""
        if self._requeued:
            return list(await asyncio.gather(*(self._verify_together(snap.job.job_id, deadline) for snap in jobs)))
        results = []
        for snap, requeue in zip(jobs, requeued):
            results.append(
                await workflow.execute_activity_method(
                    JobActivities.verify_restart,
                    VerifyRequest(snapshot=snap, failed_node=node, requeue=requeue, deadline_seconds=deadline),
                    summary=f"Verify job {snap.job.job_id} resumed off {node} from its latest complete checkpoint",
                    start_to_close_timeout=timedelta(seconds=deadline + 60),
                    heartbeat_timeout=HEARTBEAT,
                    retry_policy=SLURM_RETRY,
                )
            )
        return results

    async def _verify_together(self, job_id: int, deadline: float) -> JobVerification:
        await workflow.execute_activity_method(
            JobRecoveryActivities.ask_job_verification,
            args=[job_id, self._requeued[job_id].run_id, *([self._readmitted] if self._readmitted else [])],
            summary=f"Ask job {job_id}'s recovery for its verification",
            **SLURM_CALL,
        )
        recovered = await self._hear(
            job_id,
            lambda: self._recovered.get(job_id),
            timedelta(seconds=2 * deadline + 600),
            f"job {job_id}'s verification",
        )
        self.failed_together[job_id] = recovered.failed_together
        return recovered.verification

    async def _hear(self, job_id: int, told: Callable[[], T | None], within: timedelta, what: str) -> T:
        """What the job's recovery tells, by its signal; its failure, or none in time, is this step's."""
        try:
            await workflow.wait_condition(lambda: told() is not None or job_id in self._failures, timeout=within)
        except asyncio.TimeoutError:
            raise JobRecoveryFailed(
                f"JobRecoveryTimeout: no word of {what} from the job's recovery within {within.total_seconds():.0f} s"
            ) from None
        if (failure := self._failures.get(job_id)) is not None:
            raise JobRecoveryFailed(f"{failure.error_type}: {failure.message}")
        answer = told()
        assert answer is not None
        return answer


async def for_each_job(jobs: list[JobSnapshot], work: Callable[[JobSnapshot], Awaitable[T]]) -> list[T | BaseException]:
    """work(job) for every job, all at once: each touches only its own job, and the last job is
    reached no later than the first. Outcomes in the jobs' order, a failure as its exception."""
    return list(await asyncio.gather(*(work(snap) for snap in jobs), return_exceptions=True))
