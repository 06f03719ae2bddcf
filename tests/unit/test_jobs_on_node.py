"""Which jobs an incident finds on its node: those holding it, and, counted from a moment, those
that died on it since (the lost GPU's crashed rank can end a job before the alert arrives)."""

from datetime import datetime, timedelta, timezone

from backends.slurm import SlurmClient
from contracts.models import SlurmJob

FAULT = datetime(2026, 12, 5, 7, 46, 55, tzinfo=timezone.utc)


class JobList:
    """A Slurm backend that can list jobs, nothing else."""

    path = "cli"

    def __init__(self, jobs: list[SlurmJob]) -> None:
        self.jobs = jobs

    def supports(self, operation: str) -> bool:
        return operation == "list_jobs"

    async def list_jobs(self) -> list[SlurmJob]:
        return self.jobs


def job(job_id: int, state: str, nodes: str = "gpu-1,gpu-2", ended: datetime | None = None, **more) -> SlurmJob:
    return SlurmJob(job_id=job_id, state=state, nodes=nodes.split(","), end_time=ended, **more)


JOBS = [
    job(1, "RUNNING"),
    job(2, "COMPLETING"),
    job(3, "FAILED", ended=FAULT + timedelta(seconds=2)),  # the crash ended it
    job(4, "NODE_FAIL", ended=FAULT + timedelta(seconds=30)),
    job(5, "FAILED", ended=FAULT - timedelta(seconds=1)),  # before the window
    job(6, "COMPLETED", ended=FAULT + timedelta(seconds=2)),  # finished its work
    job(7, "CANCELLED", ended=FAULT + timedelta(seconds=2)),
    job(8, "FAILED", ended=FAULT + timedelta(seconds=2), requeue=False),  # never asked to be requeued
    job(9, "FAILED", nodes="gpu-3", ended=FAULT + timedelta(seconds=2)),  # elsewhere
    job(10, "PENDING", nodes=""),
]


async def test_without_a_moment_only_the_jobs_holding_the_node():
    found = await SlurmClient(JobList(JOBS)).jobs_on_node("gpu-2")
    assert [j.job_id for j in found] == [1, 2]


async def test_from_a_moment_also_the_requeueable_jobs_that_died_on_it_since():
    found = await SlurmClient(JobList(JOBS)).jobs_on_node("gpu-2", died_since=FAULT)
    assert [j.job_id for j in found] == [1, 2, 3, 4]
