"""JobRecoveryWorkflow: one job's requeue and verification, for every incident on its nodes.

Nodes of one job fail together (a switch, an NVLink domain, a PDU): each node has its incident,
but the job must be requeued once, kept off every failed node, and verified once. Each incident
joins the job's recovery (`requeue`, an update-with-start from activities/job_recovery.py, one
run per job id at a time) and gets the requeue that took the job off its node; the run's result is
the verification, begun when the first incident asks for it (once its replacement is in). A
node that joins after a requeue (the job was pending, or had started again,
perhaps on that node) gets a requeue of its own that keeps the job off it as well, and the
verification waits for the last one. The requeue and the verification are JobActivities', as an
incident alone runs them.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.jobs import JobActivities
    from contracts.models import (
        JobJoin,
        JobRecovered,
        JobRequeued,
        PeerIncident,
        RequeueRequest,
        RequeueResult,
        VerifyRequest,
    )
    from workflows.call_options import HEARTBEAT, SLURM_CALL, SLURM_RETRY

# A job has a few nodes; this bounds what joins one run (and its history), whoever sends joins.
MOST_NODES_JOINED = 256


def job_recovery_workflow_id(task_queue: str, job_id: int) -> str:
    """One per job of the cluster (the workers of one task queue)."""
    return f"job-recovery-{task_queue}-{job_id}"


@workflow.defn
class JobRecoveryWorkflow:
    def __init__(self) -> None:
        self._joined: dict[str, JobJoin] = {}  # by node, in the order they joined
        self._covered: set[str] = set()  # the nodes the last requeue keeps the job off
        self._requeue: RequeueResult | None = None
        self._failed: tuple[str, str] | None = None  # the requeue's final failure: its type and message
        self._verify_asked = False

    @workflow.signal
    def verify(self) -> None:
        """An incident is ready for the verification (its replacement is in): the deadline runs from now."""
        self._verify_asked = True

    @workflow.update
    async def requeue(self, join: JobJoin) -> JobRequeued:
        """Joins the job's recovery; answers once a requeue has taken the job off `join.node`."""
        self._joined.setdefault(join.node, join)
        await workflow.wait_condition(lambda: join.node in self._covered or self._failed is not None)
        if self._failed is not None:
            error_type, message = self._failed
            raise ApplicationError(message, type=error_type, non_retryable=True)
        assert self._requeue is not None
        return JobRequeued(run_id=workflow.info().run_id, requeue=self._requeue, failed_together=self._peers())

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
            await workflow.wait_condition(lambda: self._verify_asked or self._uncovered())
            if self._uncovered():
                continue
            verifying = workflow.start_activity_method(
                JobActivities.verify_restart, self._verify_request(requeue),
                summary=f"Verify job {requeue.job_id} resumed off {', '.join(sorted(self._covered))} "
                        "from its latest complete checkpoint",
                start_to_close_timeout=timedelta(seconds=self._first.verify_deadline_seconds + 60),
                heartbeat_timeout=HEARTBEAT, retry_policy=SLURM_RETRY,
            )
            # Another node of the job failed meanwhile: requeue again (when the job runs there), then verify that.
            await workflow.wait_condition(lambda: verifying.done() or self._uncovered())
            if verifying.done():
                verification = await verifying
                await workflow.wait_condition(lambda: self._uncovered() or workflow.all_handlers_finished())
                if not self._uncovered():
                    return JobRecovered(requeue=requeue, verification=verification, failed_together=self._peers())
            else:
                verifying.cancel()

    async def _requeue_off(self, nodes: list[str]) -> RequeueResult:
        first = self._first
        since = self._requeue.restart_count if self._requeue is not None else first.snapshot.job.restart_count
        incidents = ", ".join(join.incident_id for join in self._joined.values())
        ctx = first.ctx.model_copy(update={"reason": f"{first.ctx.reason}; the job's failed nodes "
                                                     f"{', '.join(nodes)} (incidents {incidents})"[:1000]})
        try:
            self._requeue = await workflow.execute_activity_method(
                JobActivities.requeue_job,
                RequeueRequest(job=first.snapshot.job.model_copy(update={"restart_count": since}),
                               failed_node=nodes[0], also_failed=nodes[1:], ctx=ctx, pinned_jobs=first.pinned_jobs),
                summary=f"Requeue job {first.snapshot.job.job_id} away from {', '.join(nodes)}",
                heartbeat_timeout=HEARTBEAT, **SLURM_CALL,
            )
        except ActivityError as err:
            # Every joined incident fails as its own requeue would have: with the cause's type and message.
            cause = err.cause
            if isinstance(cause, ApplicationError) and cause.type:
                self._failed = cause.type, cause.message
            else:
                self._failed = "JobRequeueFailed", f"requeue of job {first.snapshot.job.job_id} failed: {cause or err}"
            await workflow.wait_condition(workflow.all_handlers_finished)
            raise
        self._covered = set(nodes)
        return self._requeue

    def _verify_request(self, requeue: RequeueResult) -> VerifyRequest:
        nodes = sorted(self._covered)
        return VerifyRequest(snapshot=self._first.snapshot, failed_node=nodes[0], also_failed=nodes[1:],
                             requeue=requeue, restart_count=requeue.restart_count,
                             deadline_seconds=self._first.verify_deadline_seconds)

    @property
    def _first(self) -> JobJoin:
        return next(iter(self._joined.values()))

    def _uncovered(self) -> bool:
        return any(node not in self._covered for node in self._joined)

    def _peers(self) -> list[PeerIncident]:
        return [PeerIncident(node=node, incident_id=self._joined[node].incident_id) for node in sorted(self._joined)]
