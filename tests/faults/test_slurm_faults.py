"""Slurm faults at every call an incident makes: slurmrestd answering 500, 409 or 429, too slow
or not at all (a fault-injecting proxy between the worker and the real slurmrestd), and the CLI
unable to reach slurmctld. A transient fault is retried within the activity's policy and the
incident still recovers with every effect once; a persistent one on a read before a destructive
step ends the incident failed, naming the cause, with nothing destructive done.

Transient faults run on the real Temporal dev server (the retries take real seconds); persistent
ones on the time-skipping test server, where the ten minutes of retries (workflows/call_options.py)
pass without waiting, each attempt still a real call to the real cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import datetime
from pathlib import Path

import pytest
from temporalio.api.workflowservice.v1 import ListOpenWorkflowExecutionsRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.xid_policy import XidPolicyTable
from backends.slurm import SlurmClient
from backends.slurm.rest import ENDPOINTS
from contracts.models import IncidentReport, SlurmJob, SlurmNode
from contracts.settings import Settings
from drills.drill import Drill, DrillOptions, DrillRun
from tests.faults.proxy import FaultProxy
from tests.integration.conftest import settings, task_queue  # noqa: F401 (fixtures)
from worker import activities_for, build_slurm, build_worker
from workflows.call_options import SLURM_QUICK_TRY_BUDGET

pytestmark = pytest.mark.slurm

REST_TIMEOUT = 10.0  # SlurmRest's default time-out, as build_slurm makes it
FATAL_XID = 79


def rest_path(operation: str) -> tuple[str, str]:
    """The method and path regex of the request slurmrestd gets for an operation (rest.ENDPOINTS)."""
    method, template, _, _ = ENDPOINTS[operation]
    return method, r"^/slurm/v[\d.]+" + re.sub(r"\{\w+\}", "[^/]+", template) + "$"


@asynccontextmanager
async def worker_behind_proxy(client: Client, settings: Settings) -> AsyncIterator[tuple[FaultProxy, SlurmClient]]:
    """A worker on the test's task queue whose slurmrestd traffic goes through a FaultProxy."""
    async with FaultProxy(settings.slurmrestd_url) as proxy, AsyncExitStack() as stack:
        stack.push_async_callback(end_workflows_left_on, client, settings.task_queue)
        proxied = settings.model_copy(update={"slurmrestd_url": proxy.url})
        slurm = await build_slurm(proxied, stack)
        assert slurm.rest is not None, "slurmrestd must be usable through the proxy"
        async with build_worker(client, settings.task_queue, activities_for(proxied, slurm, client)):
            yield proxy, slurm


async def end_workflows_left_on(client: Client, task_queue: str) -> None:
    """Terminate what the test's incidents left running on its task queue (the fleet budget): its
    worker is gone, and on the time-skipping server a workflow task waiting for one would stop
    time from skipping for every later test."""
    listed = await client.workflow_service.list_open_workflow_executions(
        ListOpenWorkflowExecutionsRequest(namespace=client.namespace, maximum_page_size=1000)
    )
    for execution in listed.executions:
        handle = client.get_workflow_handle(execution.execution.workflow_id, run_id=execution.execution.run_id)
        if (await handle.describe()).task_queue == task_queue:
            try:
                await handle.terminate(reason="the test that started it is over")
            except RPCError as e:
                if e.status != RPCStatusCode.NOT_FOUND:  # else it ended meanwhile
                    raise


def drill_on(client: Client, local_stack, slurm_cluster, settings: Settings, **policy) -> Drill:
    stack = dataclasses.replace(local_stack, task_queue=settings.task_queue)
    return Drill(
        client,
        stack,
        slurm_cluster,
        settings.policy().model_copy(update=policy),
        XidPolicyTable(settings.xid_policy_file),
        say=print,
    )


async def follow_to_the_end(drill: Drill, run: DrillRun) -> tuple[IncidentReport, SlurmJob, SlurmNode]:
    """The incident's report, and the job and the failed node as Slurm shows them at its end;
    then the drill's job is cancelled."""
    try:
        report = await drill.follow(run.handle, 600)
        return report, await drill.slurm.get_job(run.job_id), await drill.slurm.get_node(run.node)
    finally:
        await drill.slurm.run("scancel", str(run.job_id))


def actions(report: IncidentReport, name: str) -> list:
    return [a for a in report.actions if a.action == name]


# --- transient faults: retried, recovered, every effect once -----------------------------------

# One fault at each REST call of the incident, of every kind; those the server's API version
# does not serve over REST (rest.KNOWN_VERSIONS) go through the CLI and are left out.
TRANSIENT = [
    ("get_node", dict(status=500, times=2)),  # the drain's first read, twice
    ("update_node", dict(drop=True, after_forward=True)),  # drained, but the answer is lost
    ("list_jobs", dict(status=429)),  # find_jobs
    ("signal_job", dict(status=500)),
    ("get_job", dict(delay=REST_TIMEOUT + 2)),  # the requeue's first read: the client gives up
    ("set_excluded_nodes", dict(status=409)),  # after the requeue: the retry must not requeue again
    ("requeue_hold", dict(drop=True, after_forward=True)),  # v0.0.45: requeued, the answer lost
]


def test_the_transient_faults_meet_every_request_an_incident_sends_to_slurmrestd():
    # Every endpoint but the ping of SlurmRest.discover() at the worker's start (node updates and
    # the spare's comment share a path, as do a job's exclusion and release).
    assert {rest_path(op) for op, _ in TRANSIENT} == {rest_path(op) for op in ENDPOINTS if op != "ping"}


async def test_transient_slurmrestd_faults_at_every_call_are_retried_and_the_job_is_requeued_once(
    temporal_env, local_stack, slurm_cluster, settings
):
    async with worker_behind_proxy(temporal_env.client, settings) as (proxy, slurm):
        injected = {
            op: proxy.inject(*rest_path(op), **fault) for op, fault in TRANSIENT if slurm.path_for(op) == "rest"
        }
        drill = drill_on(temporal_env.client, local_stack, slurm_cluster, settings)
        run = await drill.start(DrillOptions(xid=FATAL_XID))
        report, job, node = await follow_to_the_end(drill, run)

    assert report.outcome == "recovered", report.model_dump_json(indent=1)
    assert {"list_jobs", "signal_job", "get_job"} <= injected.keys()  # REST on every generation
    for op, fault in injected.items():
        method, path = rest_path(op)
        seen = proxy.requests(method, path)
        assert fault.hits == (fault.times or 0), (op, seen)
        if op == "requeue_hold":  # its effect made, the retry read it in the restart count: never asked twice
            assert len(seen) == 1, seen
            continue
        # ... and the call was made again, and went through, after its faults
        assert any(s.fault is None for s in seen[fault.hits :]), (op, seen)
    # Every effect once: Slurm's own restart count, the audit trail, one drain of this incident.
    assert job.restart_count == 1, f"requeued {job.restart_count} times"
    [requeue] = actions(report, "requeue_hold")
    if {"set_excluded_nodes", "requeue_hold"} & injected.keys():  # failed after the requeue: the retry found it done
        assert (requeue.path, requeue.detail) == ("none", "already requeued by an earlier attempt (restart count 1)")
    else:
        assert requeue.path == "cli"
    assert len(actions(report, "drain_node")) == 1
    if "update_node" in injected:  # the lost answer's retry found the drain done
        assert "already done by this incident" in actions(report, "drain_node")[0].detail
    assert node.state == "down" and f"incident {report.incident_id} " in node.reason + " "


# --- a hung call: the worker's workflow task is not held --------------------------------------


async def test_a_hung_slurm_call_leaves_the_workflow_task_once_the_quick_try_budget_is_spent(
    temporal_env, local_stack, slurm_cluster, settings
):
    """slurmrestd takes the incident's GET /jobs and never answers. Tried first within the
    incident's workflow task, which holds one of the worker's few workflow-task slots while it
    waits, the call moves to an activity timed by the server once SLURM_QUICK_TRY_BUDGET is spent
    (three attempts of REST's 10 s time-out held it 30 s). Once slurmrestd answers again, the
    incident recovers, its job requeued once."""
    method, path = rest_path("list_jobs")
    async with worker_behind_proxy(temporal_env.client, settings) as (proxy, slurm):
        hung = proxy.inject(method, path, delay=3600, times=None)
        drill = drill_on(temporal_env.client, local_stack, slurm_cluster, settings)
        run = await drill.start(DrillOptions(xid=FATAL_XID))
        started, moved = await _started_and_first_scheduled(run.handle, "find_jobs", within=90)
        assert hung.hits >= 1, proxy.seen  # the local tries did meet the hung slurmrestd
        proxy.clear()
        report, job, _ = await follow_to_the_end(drill, run)

    budget = SLURM_QUICK_TRY_BUDGET.total_seconds()
    held = (moved - started).total_seconds()
    assert budget <= held <= budget + 5, f"find_jobs became an activity {held:.1f} s into the incident"
    assert report.outcome == "recovered", report.model_dump_json(indent=1)
    assert job.restart_count == 1 and len(actions(report, "requeue_hold")) == 1


async def _started_and_first_scheduled(handle, activity_type: str, within: float) -> tuple[datetime, datetime]:
    """When the run started, and when its first activity of `activity_type` was scheduled (polled
    for up to `within` seconds)."""
    deadline = time.monotonic() + within
    while True:
        history = [event async for event in handle.fetch_history_events()]
        scheduled = [
            e.event_time.ToDatetime()
            for e in history
            if e.HasField("activity_task_scheduled_event_attributes")
            and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type
        ]
        if scheduled:
            return history[0].event_time.ToDatetime(), scheduled[0]
        assert time.monotonic() < deadline, f"no {activity_type} activity after {within} s"
        await asyncio.sleep(0.5)


# --- persistent faults on a read before a destructive step: fail closed -------------------------

PERSISTENT = [
    # (operation, fault, the phase that fails, what the outcome names)
    ("get_node", dict(status=503), "drain", "503"),  # nothing is known of the node: not even drained
    ("list_jobs", dict(status=500), "find_jobs", "500"),  # drained; which jobs run there is unknown
    ("get_job", dict(drop=True), "requeue", "slurmrestd unreachable"),  # the read before requeue
]


@pytest.mark.parametrize("operation, fault, phase, cause", PERSISTENT, ids=[p[0] for p in PERSISTENT])
async def test_a_persistent_fault_on_a_read_before_a_destructive_step_fails_the_incident_closed(
    time_skipping_env, local_stack, slurm_cluster, settings, operation, fault, phase, cause
):
    async with worker_behind_proxy(time_skipping_env.client, settings) as (proxy, slurm):
        if slurm.path_for(operation) != "rest":
            pytest.skip(f"{operation} goes through the CLI with slurmrestd {slurm.rest.version}")
        # The drill sets its scene through the CLI, never through the proxy.
        proxy.inject(*rest_path(operation), times=None, **fault)
        drill = drill_on(
            time_skipping_env.client, local_stack, slurm_cluster, settings, search_attributes=False, fleet_budget=False
        )  # no budget on the time-skipping server (see test_workflow_decisions)
        run = await drill.start(DrillOptions(xid=FATAL_XID))
        report, job, node = await follow_to_the_end(drill, run)

    method, path = rest_path(operation)
    attempts = len(proxy.requests(method, path))
    assert report.outcome.startswith(f"failed in {phase}: SlurmUnavailable: "), report.outcome
    assert cause in report.outcome
    # Retried with backoff within the policy, then given up: a bounded number of attempts.
    assert 5 <= attempts <= 40, attempts
    # Nothing destructive: no requeue (Slurm's restart count), no mark-down, the job still there.
    assert job.restart_count == 0 and not actions(report, "requeue_hold")
    assert node.state != "down" and not actions(report, "down_node")
    assert job.state == "RUNNING" and run.node in job.nodes
    if phase == "drain":
        assert report.actions == [] and not node.drained
    else:
        assert node.drained and f"incident {report.incident_id} " in node.reason + " "
    signalled = actions(report, "signal_job")
    assert bool(signalled) == (phase == "requeue")  # the jobs were found and told to checkpoint, no more
    if operation == "get_job":  # the signal's own look at the job failed too: it went out as found, at once
        assert all("as found (its state unread" in a.detail for a in signalled), signalled


# --- the CLI cannot reach slurmctld -------------------------------------------------------------


@pytest.mark.every_slurm_generation
async def test_the_cli_unable_to_reach_slurmctld_fails_the_incident_closed(
    time_skipping_env, local_stack, slurm_cluster, settings
):
    """The worker's Slurm tools read a slurm.conf naming a port where no slurmctld listens: every
    CLI call fails (scontrol exits non-zero; 22.05's sinfo and squeue --json exit 0 with the failure
    in their `errors`). slurmrestd still answers, so the incident goes as far as the REST calls
    take it and stops at its first CLI call: with 22.05 the drain's read of the node; with 24.11,
    whose node and job calls are REST, after the jobs were found, before any was requeued (its
    slurmrestd cannot requeue). With 26.05 no call is the CLI's: the incident recovers."""
    unreachable = _conf_with_unreachable_controller(Path(slurm_cluster["SLURM_CONF"]))
    try:
        cut_off = settings.model_copy(update={"slurm_conf": str(unreachable)})
        async with worker_behind_proxy(time_skipping_env.client, cut_off) as (proxy, slurm):
            node_reads_by_cli = slurm.path_for("get_node") == "cli"
            rest_alone = SlurmClient(None, slurm.rest).without_a_path() == []
            drill = drill_on(
                time_skipping_env.client,
                local_stack,
                slurm_cluster,
                settings,
                search_attributes=False,
                fleet_budget=False,
            )  # no budget on the time-skipping server (see test_workflow_decisions)
            run = await drill.start(DrillOptions(xid=FATAL_XID))
            report, job, node = await follow_to_the_end(drill, run)
    finally:
        unreachable.unlink()
    if rest_alone:
        assert report.outcome == "recovered" and job.restart_count == 1, report.outcome
        assert {a.path for a in report.actions if a.path in ("cli", "rest")} == {"rest"}
        return
    failed_in = report.phases[-1].name
    assert report.outcome.startswith(f"failed in {failed_in}: SlurmUnavailable: "), report.outcome
    assert re.search(
        "Unable to contact slurm controller|could not read slurmctld|Unexpected message received", report.outcome
    ), report.outcome
    if node_reads_by_cli:
        assert failed_in == "drain" and report.actions == [] and not node.drained
    else:
        assert "find_jobs" in [p.name for p in report.phases] and [j.job_id for j in report.jobs] == [run.job_id]
    assert job.restart_count == 0 and job.state == "RUNNING" and not actions(report, "requeue_hold")
    assert node.state != "down" and not actions(report, "down_node")


def _conf_with_unreachable_controller(conf: Path) -> Path:
    """A copy of the cluster's slurm.conf whose SlurmctldPort nobody listens on, next to it (a
    Slurm run from a Debian root reads it at the same path)."""
    with socket.socket() as probe:  # a port that was free a moment ago, closed again
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    text = re.sub(r"(?m)^SlurmctldPort=\d+$", f"SlurmctldPort={port}", conf.read_text())
    copy = conf.with_name(f"slurm-unreachable-{uuid.uuid4().hex[:8]}.conf")
    copy.write_text(text)
    return copy
