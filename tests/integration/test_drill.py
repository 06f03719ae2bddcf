"""The recovery path end to end on the real stack: real Slurm, real Temporal dev server, the
reference training job with real checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from starter.drill import DrillOptions
from trainer import checkpoint as ckpt

pytestmark = pytest.mark.slurm


async def test_xid79_drill_recovers_the_job_from_its_latest_complete_checkpoint(drill, recovery_worker):
    result = await drill.run(DrillOptions(xid=79))
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    assert result.passed, result.checks
    assert (r.xid, r.fault_class.value, r.action) == (79, "fatal", "recover")
    [job] = r.jobs
    assert job.restart_count == 1 and job.verified
    assert r.node in job.nodes_before and r.node not in job.nodes_after
    # The job stalled on the lost GPU: it resumed from the newest complete checkpoint and lost
    # only the steps after it.
    assert r.resumed_step == r.latest_complete_step and r.resumed_step >= 10
    assert r.lost_steps == job.last_step_before_failure - r.resumed_step
    assert 0 <= r.lost_steps < 10 + 2  # at most one checkpoint interval (+ the step in flight)
    assert r.skipped_checkpoints == []
    # Replacement time and time to resume are measured apart; Slurm's requeue delay dominates the latter.
    assert r.spare_node == "gpu-5" and 0 < r.replacement_seconds < r.time_to_resume_seconds
    names = [p.name for p in r.phases]
    assert names == ["classify", "drain", "find_jobs", "signal", "grace", "requeue", "mark_down",
                     "request_replacement", "wait_for_spare", "verify"]
    assert next(p for p in r.phases if p.name == "grace").result.startswith("skipped")
    # Every side effect is recorded with who asked and why, and which path it took.
    actions = {a.action: a for a in r.actions}
    assert {"drain_node", "signal_job", "requeue_hold", "exclude_nodes", "release_job", "down_node",
            "claim_spare", "resume_spare"} <= set(actions)
    assert actions["drain_node"].path == "cli" and actions["signal_job"].path == "rest"
    assert all(a.actor.startswith("drill by ") for a in r.actions)
    resumes = ckpt.read_resume_records(Path(result.run_dir))
    assert [rec["restart_count"] for rec in resumes] == [0, 1]


async def test_corrupted_latest_checkpoint_is_skipped_and_reported(drill, recovery_worker):
    result = await drill.run(DrillOptions(xid=79, corrupt_latest_checkpoint=True))
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    assert result.passed, result.checks
    corrupted_step = int(result.corrupted_checkpoint.removeprefix("step-"))
    assert r.resumed_step == corrupted_step - 10
    assert r.latest_complete_step == r.resumed_step
    assert [s.checkpoint_id for s in r.skipped_checkpoints] == [result.corrupted_checkpoint]
    assert "truncated" in r.skipped_checkpoints[0].why or "checksum" in r.skipped_checkpoints[0].why
    assert r.lost_steps >= 10


async def test_application_xid_leaves_node_and_job_alone(drill, recovery_worker):
    result = await drill.run(DrillOptions(xid=13))
    r = result.report
    assert (r.fault_class.value, r.action, r.outcome) == ("application", "none", "no_node_action")
    assert result.passed, result.checks
    assert [p.name for p in r.phases] == ["classify"]
    assert r.actions == []
