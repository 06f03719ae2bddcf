"""How workflows call activities that talk to Slurm: time-outs and retries, in one place."""

from __future__ import annotations

from datetime import timedelta

from temporalio.common import RetryPolicy

# Slurm calls: retried with backoff for up to ten minutes (a restarting slurmctld, a busy
# slurmrestd); a node or job that does not exist is final.
SLURM_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=["SlurmNotFound", "Unsupported", "ValidationError"],
)
SLURM_CALL = dict(
    start_to_close_timeout=timedelta(seconds=30),
    schedule_to_close_timeout=timedelta(minutes=10),
    retry_policy=SLURM_RETRY,
)
# Long polls heartbeat; a worker that dies mid-poll is noticed within this timeout.
HEARTBEAT = timedelta(seconds=5)
