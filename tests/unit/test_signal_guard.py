"""signal_job signals a job only while it still runs on the incident's node, in the run the incident
found (issue #29: a late incident of a job another incident had requeued retried SIGUSR1 on the
pending job for 10 minutes; a restarted job would have been signalled before its handler was in).
Each condition on its own, and a job Slurm cannot read now (signalled as found, at once). The real
stack's test is in tests/integration/test_failures_together.py."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import jobs as job_activities
from activities.jobs import JobActivities
from backends.slurm import SlurmUnavailable
from contracts.models import ActionContext, Invocation, SignalRequest, SlurmJob

FOUND = SlurmJob(job_id=7, name="train", state="RUNNING", nodes=["gpu-1", "gpu-2"], restart_count=2)
CTX = ActionContext(incident_id="gpu-1-1", owner="recovery", actor="pytest", reason="XID 79", xid=79)


class Slurm:
    def __init__(self, now: SlurmJob | Exception | None) -> None:
        self.now = now
        self.signalled: list[int] = []

    def acting(self, dry_run: bool) -> Slurm:
        return self

    async def get_job(self, job_id: int) -> SlurmJob:
        if self.now is None:
            await asyncio.sleep(3600)  # a read that hangs
        if isinstance(self.now, Exception):
            raise self.now
        assert isinstance(self.now, SlurmJob)
        return self.now

    async def signal_job(self, job_id: int, signal: str) -> Invocation:
        self.signalled.append(job_id)
        return Invocation(path="cli", command=f"scancel --signal={signal} --full {job_id}", executed=True)


async def signal(slurm: Slurm):
    request = SignalRequest(job_id=7, signal="USR1", ctx=CTX, node="gpu-1", restart_count=2)
    return await ActivityEnvironment().run(JobActivities(slurm, None).signal_job, request)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "moved_on",
    [
        {"restart_count": 3},  # requeued and running again, on the same nodes even
        {"state": "PENDING", "nodes": []},
        {"state": "FAILED"},
        {"nodes": ["gpu-3", "gpu-4"]},  # running off the node, same restart count (as Slurm shows a job it moved)
    ],
    ids=["restarted", "pending", "ended", "elsewhere"],
)
async def test_a_job_that_moved_on_is_not_signalled_and_not_tried_again(moved_on):
    slurm = Slurm(FOUND.model_copy(update=moved_on))
    with pytest.raises(ApplicationError, match="job 7 not signalled") as refused:
        await signal(slurm)
    assert refused.value.type == "JobMovedOn" and refused.value.non_retryable
    assert slurm.signalled == []


async def test_a_job_as_found_is_signalled():
    slurm = Slurm(FOUND)
    action = await signal(slurm)
    assert slurm.signalled == [7] and action.detail == "SIGUSR1 to the batch shell and every step"


@pytest.mark.parametrize("unreadable", [SlurmUnavailable("slurmrestd unreachable"), None], ids=["fails", "hangs"])
async def test_a_job_slurm_cannot_read_now_is_signalled_as_found_at_once(unreadable, monkeypatch):
    monkeypatch.setattr(job_activities, "SIGNAL_LOOK_SECONDS", 0.05)
    slurm = Slurm(unreadable)
    action = await asyncio.wait_for(signal(slurm), 5)
    assert slurm.signalled == [7] and "as found (its state unread: " in action.detail
