"""How workflows call activities that talk to Slurm: time-outs and retries, in one place; and a
local activity's final failure raised as an activity's is.

Each set of options is a CallOptions (or HeartbeatCallOptions): a TypedDict whose keys are the
exact keyword arguments of workflow.execute_activity_method and its kin, so that a type checker
follows `**SLURM_CALL` into the call (at run time it is the plain dict it always was).
"""

from __future__ import annotations

from collections.abc import Awaitable
from datetime import timedelta
from typing import TypedDict, TypeVar

from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, FailureError

T = TypeVar("T")


class CallOptions(TypedDict, total=False):
    """Time-outs and retries of an activity or a local activity call (workflow.execute_activity,
    execute_local_activity and their _method and start_ variants take these keywords)."""

    start_to_close_timeout: timedelta
    schedule_to_close_timeout: timedelta
    retry_policy: RetryPolicy


class HeartbeatCallOptions(CallOptions, total=False):
    """An activity call's options with its heartbeat time-out (an activity only: a local activity has none)."""

    heartbeat_timeout: timedelta


# Slurm calls: retried with backoff for up to ten minutes (a restarting slurmctld, a busy
# slurmrestd); a node or job that does not exist is final.
SLURM_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=["SlurmNotFound", "Unsupported", "ValidationError"],
)
SLURM_CALL = CallOptions(
    start_to_close_timeout=timedelta(seconds=30),
    schedule_to_close_timeout=timedelta(minutes=10),
    retry_policy=SLURM_RETRY,
)
# An incident's wait for its job's requeue by the job's recovery: longer than the requeue's retries.
JOB_REQUEUE_WAIT = timedelta(minutes=11)
# A Slurm call tried first as a local activity, within the workflow task: up to three attempts,
# all within SLURM_QUICK_TRY_BUDGET; then (NodeRecoveryWorkflow._locally_first) as an activity with
# SLURM_CALL, timed by the server (a local activity's deadline is kept by the worker). While it
# runs, the task holds one of the worker's few workflow-task slots (RECOVERY_WORKFLOW_TASK_SLOTS),
# which the fleet budget and every other run need too: a Slurm that takes requests and never
# answers must not keep it. Bounded by attempts alone, three hung attempts held it 30 s (measured:
# REST's 10 s time-out three times; the CLI's is 20 s). 10 s is Temporal's default workflow task time-out.
SLURM_QUICK_TRY_BUDGET = timedelta(seconds=10)
SLURM_QUICK_TRY = CallOptions(
    schedule_to_close_timeout=SLURM_QUICK_TRY_BUDGET,
    retry_policy=RetryPolicy(
        initial_interval=SLURM_RETRY.initial_interval,
        backoff_coefficient=SLURM_RETRY.backoff_coefficient,
        maximum_attempts=3,
        non_retryable_error_types=SLURM_RETRY.non_retryable_error_types,
    ),
)
# Long polls heartbeat; a worker that dies mid-poll is noticed within this timeout.
HEARTBEAT = timedelta(seconds=5)

# Kubernetes calls: the same ten minutes of retries. Long ones heartbeat at least every 5 s
# (watch windows, PDB back-off) or every HTTP provider poll (10 s by default).
K8S_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=[
        "NodeNotFound",
        "SlurmdPodNotFound",
        "NodeSetNotFound",
        "JobsStillRunning",
        "NodeNotDrained",
        "EvictionBlocked",
        "SlurmNotFound",
    ],
)
K8S_CALL = CallOptions(
    start_to_close_timeout=timedelta(seconds=60),
    schedule_to_close_timeout=timedelta(minutes=10),
    retry_policy=K8S_RETRY,
)
K8S_HEARTBEAT = timedelta(seconds=30)
# An eviction waits through PodDisruptionBudget refusals and then the pod's termination, each
# with its own deadline (RECOVERY_K8S_EVICTION_DEADLINE_SECONDS, ..._TERMINATION_DEADLINE_SECONDS).
K8S_EVICTION = HeartbeatCallOptions(
    start_to_close_timeout=timedelta(minutes=20),
    schedule_to_close_timeout=timedelta(minutes=30),
    heartbeat_timeout=K8S_HEARTBEAT,
    retry_policy=K8S_RETRY,
)
# An HTTP replacement provider may take RECOVERY_K8S_HTTP_TIMEOUT_SECONDS (30 min) to deliver.
K8S_REPLACEMENT = HeartbeatCallOptions(
    start_to_close_timeout=timedelta(minutes=40),
    schedule_to_close_timeout=timedelta(minutes=60),
    heartbeat_timeout=K8S_HEARTBEAT,
    retry_policy=K8S_RETRY,
)


async def failing_as_activity(name: str, call: Awaitable[T]) -> T:
    """The local activity's result. Its final failure is raised as ActivityError, as an
    activity's is: Temporal's core raises a local activity's bare (an ApplicationError), and the
    steps handle one kind."""
    try:
        return await call
    except (ActivityError, CancelledError):
        raise
    except FailureError as err:
        raise ActivityError(
            f"local activity {name} failed",
            scheduled_event_id=0,
            started_event_id=0,
            identity="",
            activity_type=name,
            activity_id="",
            retry_state=None,
        ) from err


def failed_for_good(err: ActivityError, retry: RetryPolicy) -> bool:
    """Whether the failure is one that `retry` would not try again: another attempt fails alike."""
    cause = err.cause
    return isinstance(cause, ApplicationError) and (
        cause.non_retryable or cause.type in (retry.non_retryable_error_types or ())
    )
