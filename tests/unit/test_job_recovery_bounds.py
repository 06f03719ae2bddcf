"""What one job's recovery (workflows/job_recovery.py) lets join it: the validator's refusals,
which are never written to its history, bound the history whoever sends joins."""

from __future__ import annotations

import pytest

from contracts.models import ActionContext, JobJoin, JobSnapshot, SlurmJob
from workflows.job_recovery import MOST_NODES_JOINED, JobRecoveryWorkflow


def join(node: str, job_id: int = 42) -> JobJoin:
    job = SlurmJob(job_id=job_id, state="RUNNING", nodes=[node])
    return JobJoin(
        incident_id=f"{node}-20261204T000000Z",
        workflow_id=f"node-recovery-{node}",
        node=node,
        verify_deadline_seconds=60,
        snapshot=JobSnapshot(job=job, checkpoint_dir=None, latest_complete=None, progress=None),
        ctx=ActionContext(incident_id="i", owner="recovery", actor="pytest", reason="test", xid=79),
    )


def test_at_most_its_bound_of_nodes_join_and_a_repeated_join_is_still_heard():
    recovery = JobRecoveryWorkflow()
    for n in range(MOST_NODES_JOINED):
        recovery._one_job_and_room(join(f"gpu-{n}"))
        recovery._joined[f"gpu-{n}"] = join(f"gpu-{n}")  # as the update handler keeps it
    with pytest.raises(ValueError, match=f"{MOST_NODES_JOINED} nodes have joined"):
        recovery._one_job_and_room(join("gpu-new"))
    recovery._one_job_and_room(join("gpu-0"))  # a retried join of a node that joined


def test_a_join_for_another_job_is_refused():
    recovery = JobRecoveryWorkflow()
    recovery._joined["gpu-1"] = join("gpu-1")
    with pytest.raises(ValueError, match="this is the recovery of job 42, not 43"):
        recovery._one_job_and_room(join("gpu-2", job_id=43))
