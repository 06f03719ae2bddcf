"""One incident per node whatever the number of alerts, and a worker crash loses nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
from temporalio.api.enums.v1 import EventType

from contracts.models import NodeFailureAlert
from drills.drill import DrillOptions
from drills.localstack import wait_async
from starter.alerts import raise_alert
from workflows.node_recovery import NodeRecoveryWorkflow

pytestmark = pytest.mark.slurm


async def test_duplicate_alert_joins_the_running_incident(drill, recovery_worker, temporal_env):
    run = await drill.start(DrillOptions(xid=79))
    duplicate = NodeFailureAlert(
        node=run.node, xid=79, source="kernel-log", actor="hook test", reason="the same failure seen by another source"
    )
    second = await raise_alert(temporal_env.client, duplicate, drill.stack.task_queue, drill.policy)
    assert second.id == run.handle.id
    assert second.result_run_id == run.handle.result_run_id
    result = await drill.finish(run, 300)
    assert result.report.outcome == "recovered"
    assert [a.source for a in result.report.alerts] == ["drill", "kernel-log"]
    query = f"WorkflowId='{run.handle.id}' AND TaskQueue='{drill.stack.task_queue}'"
    runs = [wf async for wf in temporal_env.client.list_workflows(query)]
    assert [wf.run_id for wf in runs] == [run.handle.result_run_id]
    job = await drill.slurm.get_job(result.job_id)
    assert job.restart_count == 1


async def test_worker_killed_mid_recovery_finishes_and_requeues_exactly_once(
    drill, temporal_env, local_stack, slurm_cluster, settings
):
    """The worker runs as its own process and is SIGKILLed while the incident is under way; a
    new worker finishes it, and Slurm's own restart count shows that the job was requeued once."""
    address = temporal_env.client.service_client.config.target_host
    stack = dataclasses.replace(
        local_stack, task_queue=settings.task_queue, temporal_port=int(address.rsplit(":", 1)[1])
    )
    stack.start_worker(slurm_cluster)
    first_pid = int(stack.worker_pidfile.read_text())
    try:
        run = await drill.start(DrillOptions(xid=79))

        async def recovery_under_way() -> str | None:
            phase = (await run.handle.query(NodeRecoveryWorkflow.status)).phase
            under_way = ("requeue", "mark_down", "release_node", "request_replacement", "wait_for_spare", "verify")
            return phase if phase in under_way else None

        killed_in = await wait_async(recovery_under_way, 60, "the recovery to reach the requeue", interval=0.02)
        os.kill(first_pid, signal.SIGKILL)
        await wait_async(lambda: asyncio.sleep(0, result=not stack.worker_running()), 10, "the worker to die")
        stack.start_worker(slurm_cluster)
        second_pid = int(stack.worker_pidfile.read_text())
        assert second_pid != first_pid
        started = time.monotonic()
        result = await drill.finish(run, 300)
    finally:
        stack.stop_worker()
    r = result.report
    assert r.outcome == "recovered", f"killed in {killed_in}: {r.model_dump_json(indent=1)}"
    job = await drill.slurm.get_job(result.job_id)
    assert job.restart_count == 1, f"requeued {job.restart_count} times (killed in {killed_in})"
    # One requeue in the audit trail too: done, or found done by the attempt the crash cut short.
    assert sum(a.action == "requeue_hold" for a in r.actions) == 1
    # The second worker did the rest: some activity ran under its identity.
    identities = {
        e.activity_task_started_event_attributes.identity
        async for e in run.handle.fetch_history_events()
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
    }
    assert any(i.startswith(f"{second_pid}@") for i in identities), (killed_in, identities)
    assert time.monotonic() - started < 120


async def test_worker_stops_cleanly_on_sigterm(temporal_env, local_stack, slurm_cluster, settings):
    address = temporal_env.client.service_client.config.target_host
    stack = dataclasses.replace(
        local_stack, task_queue=settings.task_queue, temporal_port=int(address.rsplit(":", 1)[1])
    )
    log = stack.worker_pidfile.with_suffix(".log")
    offset = log.stat().st_size if log.exists() else 0
    stack.start_worker(slurm_cluster)
    pid = int(stack.worker_pidfile.read_text())
    try:
        await wait_async(
            lambda: asyncio.sleep(0, result="worker polling" in log.read_text()[offset:]), 30, "the worker to poll"
        )
        os.kill(pid, signal.SIGTERM)
        await wait_async(lambda: asyncio.sleep(0, result=not stack.worker_running()), 15, "the worker to exit")
        _, status = os.waitpid(pid, 0)  # the worker is this process's child: collect its exit code
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        stack.stop_worker()
    text = log.read_text()[offset:]
    assert "stopping: finishing activities in flight" in text and text.rstrip().endswith("stopped")
