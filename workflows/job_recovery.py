"""JobRecoveryWorkflow: one job's requeue and verification, for every incident on its nodes.

Nodes of one job fail together (a switch, an NVLink domain, a PDU): each node has its incident,
but the job must be requeued once, kept off every failed node, and verified once. Each incident
joins the job's recovery (`requeue`, an update-with-start from activities/job_recovery.py, one
run per job id at a time) and is told by signal, as NodeRecoveryWorkflow waits durably (no
activity held open, so a storm of incidents holds no worker slots): `job_requeued` once a requeue
has taken the job off its node, `job_recovered` with the one verification, begun when the first
incident asks for it (once its replacement is in), or `job_requeue_failed`. A node that joins
after a requeue (the job was pending, or had started again, perhaps on that node) gets a requeue
of its own that keeps the job off it as well, and the verification waits for the last one. The
requeue and the verification are JobActivities', as an incident alone runs them.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from activities.jobs import JobActivities
    from contracts.models import (
        JobJoin,
        JobRecovered,
        JobRecoveryFailure,
        JobRequeued,
        PeerIncident,
        RequeueRequest,
        RequeueResult,
        VerifyRequest,
    )
    from workflows.call_options import HEARTBEAT, SLURM_CALL, SLURM_RETRY

# A job has a few nodes; this bounds what joins one run (and its history), whoever sends joins.
MOST_NODES_JOINED = 256
# NodeRecoveryWorkflow's signals, by name: this module cannot import the incident's.
JOB_REQUEUED, JOB_RECOVERED, JOB_REQUEUE_FAILED = "job_requeued", "job_recovered", "job_requeue_failed"
# A node may join while the run tells its end: it is told too (a failure), or its node is requeued
# and verified as well (a recovery), where runs before this patch ended without a word to it.
LATE_JOINERS_TOLD = "late-joiners-told"


def job_recovery_workflow_id(task_queue: str, job_id: int) -> str:
    """One per job of the cluster (the workers of one task queue)."""
    return f"job-recovery-{task_queue}-{job_id}"


@workflow.defn
class JobRecoveryWorkflow:
    def __init__(self) -> None:
        self._joined: dict[str, JobJoin] = {}  # by node, in the order they joined
        self._covered: set[str] = set()  # the nodes the last requeue keeps the job off
        self._told: set[str] = set()  # the nodes whose incidents heard of that requeue
        self._requeue: RequeueResult | None = None
        self._verify_asked = False
        self._readmitted: set[str] = set()

    @workflow.signal
    def verify(self, readmitted: list[str] | None = None) -> None:
        """An incident is ready for the verification (its replacement is in): the deadline runs from
        now. `readmitted`: its node, when it serves again from new hardware (the job may run there)."""
        self._verify_asked = True
        self._readmitted.update(node for node in readmitted or [] if node in self._joined)  # bounded by the joined

    @workflow.update
    def requeue(self, join: JobJoin) -> str:
        """Joins the job's recovery; returns this run's id. The incident hears the rest by signal."""
        self._joined.setdefault(join.node, join)
        return workflow.info().run_id

    @requeue.validator
    def _one_job_and_room(self, join: JobJoin) -> None:
        first = next(iter(self._joined.values()), None)
        if first is not None and join.snapshot.job.job_id != first.snapshot.job.job_id:
            raise ValueError(f"this is the recovery of job {first.snapshot.job.job_id}, not {join.snapshot.job.job_id}")
        if join.node not in self._joined and len(self._joined) >= MOST_NODES_JOINED:
            raise ValueError(f"{MOST_NODES_JOINED} nodes have joined this job's recovery already")

    @workflow.run
    async def run(self) -> JobRecovered:
        while True:
            await workflow.wait_condition(self._uncovered)
            requeue = await self._requeue_off(sorted(self._joined))
            await self._tell_requeued(requeue)
            await workflow.wait_condition(lambda: self._verify_asked or self._uncovered())
            if self._uncovered():
                continue
            verifying = workflow.start_activity_method(
                JobActivities.verify_restart,
                self._verify_request(requeue),
                summary=f"Verify job {requeue.job_id} resumed off {', '.join(sorted(self._covered))} "
                "from its latest complete checkpoint",
                start_to_close_timeout=timedelta(seconds=self._first.verify_deadline_seconds + 60),
                heartbeat_timeout=HEARTBEAT,
                retry_policy=SLURM_RETRY,
            )
            # Another node of the job failed meanwhile: requeue again (when the job runs there), then verify that.
            await workflow.wait_condition(lambda: verifying.done() or self._uncovered())  # noqa: B023 (awaited here)
            if not verifying.done():
                verifying.cancel()
                continue
            recovered = JobRecovered(requeue=requeue, verification=await verifying, failed_together=self._peers())
            if not self._uncovered():
                await self._tell(list(self._joined.values()), JOB_RECOVERED, recovered)
                if not self._uncovered() or not workflow.patched(LATE_JOINERS_TOLD):
                    return recovered

    async def _requeue_off(self, nodes: list[str]) -> RequeueResult:
        first = self._first
        job = first.snapshot.job
        since = self._requeue.restart_count if self._requeue is not None else job.restart_count
        incidents = ", ".join(join.incident_id for join in self._joined.values())
        ctx = first.ctx.model_copy(
            update={
                "reason": f"{first.ctx.reason}; the job's failed nodes {', '.join(nodes)} (incidents {incidents})"[
                    :1000
                ]
            }
        )
        try:
            self._requeue = await workflow.execute_activity_method(
                JobActivities.requeue_job,
                RequeueRequest(
                    job=job.model_copy(update={"restart_count": since}),
                    failed_node=nodes[0],
                    also_failed=nodes[1:],
                    ctx=ctx,
                    pinned_jobs=first.pinned_jobs,
                ),
                summary=f"Requeue job {job.job_id} away from {', '.join(nodes)}",
                heartbeat_timeout=HEARTBEAT,
                **SLURM_CALL,
            )
        except ActivityError as err:
            # Every joined incident fails as its own requeue would have: with the cause's type and message.
            cause = err.cause
            failure = (
                JobRecoveryFailure(job_id=job.job_id, error_type=cause.type, message=cause.message)
                if isinstance(cause, ApplicationError) and cause.type
                else JobRecoveryFailure(
                    job_id=job.job_id,
                    error_type="JobRequeueFailed",
                    message=f"requeue of job {job.job_id} failed: {cause or err}",
                )
            )
            await self._tell_every_joined(JOB_REQUEUE_FAILED, failure)
            raise
        self._covered = set(nodes)
        return self._requeue

    async def _tell_requeued(self, requeue: RequeueResult) -> None:
        """Each incident whose node the requeue covers, once."""
        news = [join for node, join in self._joined.items() if node in self._covered and node not in self._told]
        self._told.update(join.node for join in news)
        await self._tell(
            news,
            JOB_REQUEUED,
            JobRequeued(run_id=workflow.info().run_id, requeue=requeue, failed_together=self._peers()),
        )

    async def _tell_every_joined(self, signal: str, news: object) -> None:
        """Every incident that joined, those that join while it is told as well."""
        told: set[str] = set()
        while untold := [join for node, join in self._joined.items() if node not in told]:
            if told and not workflow.patched(LATE_JOINERS_TOLD):
                return
            told.update(join.node for join in untold)
            await self._tell(untold, signal, news)

    @staticmethod
    async def _tell(joins: list[JobJoin], signal: str, news: object) -> None:
        async def tell(join: JobJoin) -> None:
            try:
                await workflow.get_external_workflow_handle(join.workflow_id).signal(signal, news)
            except FailureError:
                workflow.logger.warning(f"{join.workflow_id} did not hear {signal}: it has ended")

        await asyncio.gather(*(tell(join) for join in joins))

    def _verify_request(self, requeue: RequeueResult) -> VerifyRequest:
        nodes = sorted(self._covered)
        return VerifyRequest(
            snapshot=self._first.snapshot,
            failed_node=nodes[0],
            also_failed=nodes[1:],
            requeue=requeue,
            restart_count=requeue.restart_count,
            deadline_seconds=self._first.verify_deadline_seconds,
            readmitted=sorted(self._readmitted & self._covered),
        )

    @property
    def _first(self) -> JobJoin:
        return next(iter(self._joined.values()))

    def _uncovered(self) -> bool:
        return any(node not in self._covered for node in self._joined)

    def _peers(self) -> list[PeerIncident]:
        return [PeerIncident(node=node, incident_id=self._joined[node].incident_id) for node in sorted(self._joined)]
