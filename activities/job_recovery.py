"""An incident's calls to its job's recovery (workflows/job_recovery.py), through the Temporal client.

`join_job_recovery`: an update-with-start, so that the first incident on the job starts its
recovery and the others join it; the update's id is the incident's, so a retried activity is the
same request; it returns the run's id at once. `ask_job_verification`: tells that run the
incident is ready for the verification. The incident hears the requeue and the verification by
signal (it waits for them durably, holding no activity open).
"""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client, WithStartWorkflowOperation, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, FailureError
from temporalio.service import RPCError, RPCStatusCode

from contracts.models import JobJoin, JobRecovered
from workflows.job_recovery import JobRecoveryWorkflow, job_recovery_workflow_id


class JobRecoveryActivities:
    def __init__(self, client: Client, task_queue: str):
        self._client = client
        self._task_queue = task_queue

    def all(self) -> list:
        return [self.join_job_recovery, self.ask_job_verification]

    @activity.defn
    async def join_job_recovery(self, join: JobJoin) -> str:
        """Joins (or starts) the recovery of the job; returns its run id."""
        workflow_id = job_recovery_workflow_id(self._task_queue, join.snapshot.job.job_id)
        start = WithStartWorkflowOperation(
            JobRecoveryWorkflow.run,
            id=workflow_id,
            task_queue=self._task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            static_summary=f"Requeue and verify job {join.snapshot.job.job_id} for the incidents on its nodes",
        )
        try:
            return await self._client.execute_update_with_start_workflow(
                JobRecoveryWorkflow.requeue,
                join,
                start_workflow_operation=start,
                id=f"{join.incident_id}-job-{join.snapshot.job.job_id}",
            )
        except WorkflowUpdateFailedError as err:  # refused: another job's recovery, or too many nodes
            cause = err.cause
            message = cause.message if isinstance(cause, FailureError) else str(cause)
            raise ApplicationError(
                f"the job's recovery refused it: {message}", type="JobRecoveryRefused", non_retryable=True
            ) from err

    @activity.defn
    async def ask_job_verification(self, job_id: int, run_id: str, readmitted: list[str] | None = None) -> None:
        """The incident is ready for the verification of the run that took the job off its node;
        `readmitted`: its node, when it serves again from new hardware (the job may run there)."""
        # get_workflow_handle_for(JobRecoveryWorkflow.run, ...) is this call, but mypy cannot infer its
        # types from a run method without a parameter.
        handle: WorkflowHandle[JobRecoveryWorkflow, JobRecovered] = self._client.get_workflow_handle(
            job_recovery_workflow_id(self._task_queue, job_id), run_id=run_id, result_type=JobRecovered
        )
        try:
            await handle.signal(JobRecoveryWorkflow.verify, readmitted or [])
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:  # NOT_FOUND: it has ended, and told its incidents how
                raise
