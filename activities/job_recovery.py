"""An incident's calls to its job's recovery (workflows/job_recovery.py), through the Temporal client.

`join_job_recovery`: an update-with-start, so that the first incident on the job starts its
recovery and the others join it; the update's id is the incident's, so a retried activity is the
same request. `job_verification`: asks the run the incident joined to verify, and waits for its result. Both wait long (a
requeue retried through a Slurm restart, a verification up to its deadline) and heartbeat meanwhile:
a worker that dies is noticed within the heartbeat timeout and the wait resumes on another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from temporalio import activity
from temporalio.client import Client, WithStartWorkflowOperation, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, FailureError
from temporalio.service import RPCError, RPCStatusCode

from contracts.models import JobJoin, JobRecovered, JobRequeued
from workflows.job_recovery import JobRecoveryWorkflow, job_recovery_workflow_id

T = TypeVar("T")
HEARTBEAT_EVERY = 2.0


class JobRecoveryActivities:
    def __init__(self, client: Client, task_queue: str):
        self._client = client
        self._task_queue = task_queue

    def all(self) -> list:
        return [self.join_job_recovery, self.job_verification]

    @activity.defn
    async def join_job_recovery(self, join: JobJoin) -> JobRequeued:
        """Joins (or starts) the recovery of the job; returns once its requeue took the job off join.node."""
        workflow_id = job_recovery_workflow_id(self._task_queue, join.snapshot.job.job_id)
        start = WithStartWorkflowOperation(
            JobRecoveryWorkflow.run, id=workflow_id, task_queue=self._task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            static_summary=f"Requeue and verify job {join.snapshot.job.job_id} for the incidents on its nodes")
        try:
            return await _heartbeating(self._client.execute_update_with_start_workflow(
                JobRecoveryWorkflow.requeue, join, start_workflow_operation=start,
                id=f"{join.incident_id}-job-{join.snapshot.job.job_id}"))
        except WorkflowUpdateFailedError as err:
            raise _final(err.cause) from err

    @activity.defn
    async def job_verification(self, job_id: int, run_id: str) -> JobRecovered:
        """The verification of the job's recovery run that took the job off this incident's node."""
        handle = self._client.get_workflow_handle_for(
            JobRecoveryWorkflow.run, job_recovery_workflow_id(self._task_queue, job_id), run_id=run_id)
        try:
            await handle.signal(JobRecoveryWorkflow.verify)
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:  # NOT_FOUND: it has ended; its result says how
                raise
        try:
            return await _heartbeating(handle.result())
        except WorkflowFailureError as err:
            raise _final(err.cause) from err


def _final(cause: BaseException | None) -> ApplicationError:
    """The job recovery's refusal or failure, as the incident's final failure of this step: a
    failed requeue keeps its cause's type (SlurmUnavailable, ...), as the incident's own would."""
    if isinstance(cause, ApplicationError) and cause.type:
        return ApplicationError(cause.message, type=cause.type, non_retryable=True)
    message = cause.message if isinstance(cause, FailureError) else str(cause)
    return ApplicationError(f"the job's recovery: {message}", type="JobRecoveryFailed", non_retryable=True)


async def _heartbeating(work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=HEARTBEAT_EVERY)
            if done:
                return task.result()
            activity.heartbeat()
    finally:
        task.cancel()  # the activity was cancelled, or its worker stops: stop waiting
