"""The recovery path end to end on the real stack: real Slurm, real Temporal dev server, the
reference training job with real checkpoints."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from contracts.settings import ConfigError
from drills.drill import DrillOptions
from drills.localstack import wait_async
from tests.integration.conftest import fleet
from tests.integration.test_fleet_budget import local_activities, workflow_tasks
from trainer import checkpoint as ckpt

# The drill, the REST-only worker and the incomplete checkpoint on every generation; the rest on the newest.
pytestmark = pytest.mark.slurm


# Which path each action takes, per Slurm generation (the README's table), and the slurmrestd API
# version a worker picks there.
NODE_UPDATE_PATH = {"22.05": "cli", "24.11": "rest", "26.05": "rest"}
REQUEUE_PATH = {"22.05": "cli", "24.11": "cli", "26.05": "rest"}
REST_VERSION = {"22.05": "v0.0.38", "24.11": "v0.0.42", "26.05": "v0.0.45"}


@pytest.mark.every_slurm_generation
async def test_xid79_drill_recovers_the_job_from_its_latest_complete_checkpoint(drill, recovery_worker, local_stack):
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
    # CRE's goodput over the window from the interrupted run's start: its terms are the report's own
    g = r.goodput
    assert g is not None and job.goodput == g and job.confidence == "confirmed"
    assert g.lost_work_seconds == r.lost_seconds and 0 < g.reschedule_seconds <= r.time_to_resume_seconds
    assert g.wall_seconds > g.reschedule_seconds + g.lost_work_seconds and g.checkpoint_save_seconds > 0
    assert g.goodput is not None and 0 < g.goodput <= 1
    names = [p.name for p in r.phases]
    assert names == [
        "classify",
        "breaker",
        "drain",
        "fence_node",
        "find_jobs",
        "budget",
        "signal",
        "grace",
        "requeue",
        "mark_down",
        "release_node",
        "request_replacement",
        "wait_for_spare",
        "verify",
        "return_to_service",
    ]
    assert r.return_to_service == f"return-to-service-{r.incident_id}"
    assert next(p for p in r.phases if p.name == "grace").result.startswith("skipped")
    # Every side effect is recorded with who asked and why, and which path it took.
    actions = {a.action: a for a in r.actions}
    assert {
        "drain_node",
        "signal_job",
        "requeue_hold",
        "exclude_nodes",
        "release_job",
        "down_node",
        "claim_spare",
        "resume_spare",
    } <= set(actions)
    node_path = NODE_UPDATE_PATH[local_stack.slurm_generation]
    assert [actions[a].path for a in ("drain_node", "down_node", "claim_spare", "resume_spare")] == [node_path] * 4
    assert actions["signal_job"].path == "rest"
    assert actions["requeue_hold"].path == REQUEUE_PATH[local_stack.slurm_generation]
    assert {actions[a].path for a in ("exclude_nodes", "release_job")} == {node_path}
    # The run says on which Slurm, exactly, and which slurmrestd API version.
    assert result.slurm_version.startswith(local_stack.slurm_generation + ".")
    assert result.slurmrestd_version == REST_VERSION[local_stack.slurm_generation]
    assert all(a.actor.startswith("drill by ") for a in r.actions)
    resumes = ckpt.read_resume_records(Path(result.run_dir))
    assert [rec["restart_count"] for rec in resumes] == [0, 1]


@pytest.mark.every_slurm_generation
async def test_a_worker_with_no_slurm_commands_recovers_over_rest_alone_where_slurmrestd_can_requeue(
    temporal_env, local_stack, slurm_cluster
):
    """RECOVERY_SLURM_CLI=false: the worker builds no Slurm CLI backend at all. On 26.05 (slurmrestd
    v0.0.45, which can requeue) the whole recovery runs over REST; an older slurmrestd cannot
    requeue, and the worker refuses to start, saying what it lacks."""
    if REQUEUE_PATH[local_stack.slurm_generation] != "rest":
        with pytest.raises(ConfigError, match="requeue_hold"):
            async with fleet(temporal_env, local_stack, slurm_cluster, slurm_cli=False):
                pass
        return
    async with fleet(temporal_env, local_stack, slurm_cluster, slurm_cli=False) as rest_only:
        result = await rest_only.drill.run(DrillOptions(xid=79))
    r = result.report
    assert r.outcome == "recovered" and result.passed, r.model_dump_json(indent=1)
    [job] = r.jobs
    assert job.restart_count == 1 and job.verified
    slurm_writes = [a for a in r.actions if a.path in ("cli", "rest")]
    assert {a.action for a in slurm_writes} >= {"drain_node", "signal_job", "requeue_hold", "release_job", "down_node"}
    assert {a.path for a in slurm_writes} == {"rest"}, [(a.action, a.path) for a in slurm_writes]


async def test_the_node_is_fenced_and_its_lease_asked_within_the_incidents_first_workflow_task(drill, recovery_worker):
    """Up to the first signal, no round trip through the server: the read of the node's partitions
    and the cluster's size, the breaker's word, the drain, the platform's fence, the jobs read, the lease request (both
    answered in their replies, the budget being within its limits) and the signals are local
    activities of the first workflow task (fence-in-one-task, fence-breaker)."""
    run = await drill.start(DrillOptions(xid=79))
    result = await drill.finish(run, 300)
    assert result.report.outcome == "recovered", result.report.model_dump_json(indent=1)
    history = [event async for event in run.handle.fetch_history_events()]
    tasks = [local_activities(commands) for commands in workflow_tasks(history)]
    task_of = {name: i for i, names in enumerate(tasks) for name in names}
    fence = ("fence_scope", "drain_node", "fence_node", "find_jobs", "request_lease", "signal_job")
    assert len({task_of[name] for name in fence}) == 1, tasks
    assert tasks[task_of["request_lease"]].count("request_lease") == 2  # the breaker's, then the lease's
    scheduled = {
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history
        if e.HasField("activity_task_scheduled_event_attributes")
    }
    assert not scheduled & {*fence, "partition_shares"}, scheduled


@pytest.mark.every_slurm_generation
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
    # Counted, not acted on: one incident on this GPU (two on a session's second Slurm generation).
    assert [p.name for p in r.phases] == ["classify", "count_application_xids"]
    assert " of 3 application XID(s) on GPU (unnamed)" in r.phases[-1].result
    assert r.actions == []


async def test_unknown_xid_drains_keeps_the_job_and_escalates(drill, recovery_worker):
    result = await drill.run(DrillOptions(xid=45))
    r = result.report
    assert (r.fault_class.value, r.action) == ("unknown", "fence_and_escalate")
    assert r.outcome.startswith("escalated"), r.outcome
    assert result.passed, result.checks
    node = await drill.slurm.get_node(r.node)
    assert node.drained and node.reason.startswith("recovery: XID 45 ")
    job = await drill.slurm.get_job(result.job_id)
    assert job.restart_count == 0


async def test_degrading_xid_waits_for_the_emergency_checkpoint_and_loses_nothing(drill, recovery_worker, settings):
    # A long grace period that must end early: the job checkpoints on SIGUSR1 within a step.
    drill.policy = settings.model_copy(update={"degrading_grace_seconds": 120.0}).policy()
    result = await drill.run(DrillOptions(xid=94))
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    grace = next(p for p in r.phases if p.name == "grace")
    assert grace.result == "1 job(s) checkpointed within the grace period"
    assert (grace.ended_at - grace.started_at).total_seconds() < 10
    # The emergency checkpoint on SIGUSR1, then one more on the requeue's SIGTERM: the job resumed
    # from the very step it had reached, so nothing was lost.
    [job] = r.jobs
    assert r.resumed_step == job.last_step_before_failure
    assert r.lost_steps == 0 and r.lost_seconds == 0


async def test_node_drained_by_someone_else_is_left_as_found(drill, recovery_worker):
    operator_reason = "admin: PSU replacement scheduled"

    async def operator_drains(job, node):
        await drill.slurm.update_node(node, "DRAIN", operator_reason)

    run = await drill.start(DrillOptions(xid=79), before_fault=operator_drains)
    result = await drill.finish(run, 300)
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    drain = next(a for a in r.actions if a.action == "drain_node")
    assert drain.path == "none" and operator_reason in drain.detail
    assert next(p for p in r.phases if p.name == "mark_down").result.startswith("skipped")
    node = await drill.slurm.get_node(r.node)
    assert node.reason == operator_reason and node.state != "down"


async def test_alert_for_a_node_slurm_does_not_know_fails_cleanly_and_changes_nothing(
    drill, recovery_worker, temporal_env
):
    from contracts.models import NodeFailureAlert
    from starter.alerts import raise_alert

    async def fences():
        return [(n.name, n.drained, n.state == "down", n.reason, n.comment) for n in await drill.slurm.list_nodes()]

    before = await fences()
    alert = NodeFailureAlert(node="gpu-99", xid=79, source="test", actor="pytest")
    handle = await raise_alert(temporal_env.client, alert, drill.stack.task_queue, drill.policy)
    report = await handle.result()
    # Its first read of Slurm, for the breaker, finds no such node: nothing asked of the budget.
    assert report.outcome.startswith("failed in breaker: SlurmNotFound"), report.outcome
    assert report.actions == [] and report.jobs == []
    assert await fences() == before


async def test_dry_run_describes_every_action_and_changes_nothing(drill, recovery_worker, local_stack):
    """Observe mode: every decision runs, each action it would take is listed with its exact
    command or API call, and Slurm sees no write (all nodes and jobs compared before and after)."""
    result = await drill.run(DrillOptions(xid=79, dry_run=True))
    r = result.report
    assert result.passed, [c for c in result.checks if not c.passed]
    assert r.dry_run and r.outcome.startswith("dry_run")
    intended = {a.action: a for a in r.intended_actions}
    assert {
        "drain_node",
        "signal_job",
        "requeue_hold",
        "exclude_nodes",
        "release_job",
        "down_node",
        "claim_spare",
        "resume_spare",
    } <= set(intended)
    assert not any(a.executed for a in r.intended_actions)
    assert (
        intended["requeue_hold"].command
        == {
            "cli": f"scontrol requeuehold {result.job_id}",
            "rest": f'POST /slurm/v0.0.45/jobs/requeue {{"flags": ["Hold"], "jobs": ["{result.job_id}"]}}',
        }[REQUEUE_PATH[local_stack.slurm_generation]]
    )
    drain = intended["drain_node"].command
    if NODE_UPDATE_PATH[local_stack.slurm_generation] == "cli":
        assert drain.startswith(f"scontrol update NodeName={r.node} State=DRAIN 'Reason=recovery: XID 79")
    else:
        assert drain.startswith("POST /slurm/v0.0.4") and f"/node/{r.node} " in drain and '"DRAIN"' in drain
    assert [p.result.split(":")[0] for p in r.phases if p.name in ("grace", "wait_for_spare", "verify")] == [
        "skipped"
    ] * 3


async def test_dry_run_is_not_upset_by_another_job_ending_meanwhile(drill, recovery_worker):
    """On a shared cluster other jobs end while a dry run looks on (CI once failed the check when
    one did): only what the incident could write is compared, and a write is still caught."""
    other: dict[str, str] = {}

    async def another_job_runs_elsewhere(job, node):
        free = [n.name for n in await drill.slurm.list_nodes() if n.state == "idle" and not n.drained]
        other["node"] = free[0]
        other["job"] = await drill.slurm.run(
            "sbatch", "--parsable", f"--nodelist={free[0]}", "--output=/dev/null", "--wrap=sleep 4"
        )

        async def running():
            return (await drill.slurm.get_job(int(other["job"]))).state == "RUNNING"

        await wait_async(running, 30, "the other job to run")

    run = await drill.start(DrillOptions(xid=79, dry_run=True), before_fault=another_job_runs_elsewhere)

    async def ended():
        return (await drill.slurm.get_job(int(other["job"]))).state == "COMPLETED"

    await wait_async(ended, 30, "the other job to end")
    await drill.slurm.update_node(other["node"], "DRAIN", "test: a write the dry run must see")
    try:
        result = await drill.finish(run, 300)
    finally:
        await drill.slurm.update_node(other["node"], "RESUME", "")
    [written] = [c for c in result.checks if not c.passed]
    assert written.name == "Slurm saw no write"
    assert written.detail.startswith(f"node {other['node']}: ") and "DRAIN" in written.detail, written.detail
    assert f"job {other['job']}" not in written.detail


async def test_a_job_that_asked_for_expedited_requeue_starts_again_at_once_once_released(
    drill, recovery_worker, local_stack
):
    """Slurm 25.11+ with enable_expedited_requeue (the local stack's 26.05): a job submitted
    --requeue=expedite starts again as soon as the incident releases it, where a plain --requeue
    job waits out the requeue delay (requeue_delay, by default cred_expire: 10 s here, 120 s in
    Slurm's default). Same recovery path, restart count exactly one either way."""
    if tuple(map(int, local_stack.slurm_generation.split("."))) < (25, 11):
        pytest.skip("expedited requeue exists from Slurm 25.11 on")
    gaps = {}
    for expedite in (False, True):
        result = await drill.run(DrillOptions(xid=79, expedited_requeue=expedite))
        r = result.report
        assert r.outcome == "recovered" and result.passed, r.model_dump_json(indent=1)
        [job] = r.jobs
        assert job.restart_count == 1 and job.verified
        released = next(a.at for a in r.actions if a.action == "release_job")
        [restarted] = [rec for rec in ckpt.read_resume_records(Path(result.run_dir)) if rec["restart_count"] == 1]
        gaps[expedite] = (datetime.fromisoformat(restarted["started_at"]) - released).total_seconds()
    print(f"release -> restarted: {gaps}")
    assert gaps[False] >= 9, gaps  # the requeue delay, 10 s on the local stack
    assert gaps[True] < 5, gaps
