"""Correlation on the real stack: the reference job runs on two Slurm nodes, one of them fails
(XID 79, a real NodeRecoveryWorkflow on a real worker), and the job's other node reports what
follows from it through the hook.

The hook's own incidents run in observe mode (dry run): an uncorrelated XID 74 opens an incident
that would drain its node, and this test only needs to see that it was opened.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from temporalio.client import Client

from backends.slurm.cli import SlurmCli
from drills.drill import DrillOptions
from hooks.inventory import SlurmInventory
from hooks.server import build_app, listening, node_inventory
from hooks.settings import HookSettings
from tests.hook_support import gpu_health_event, kernel_log_post, xid_line
from workflows.node_recovery import NodeRecoveryWorkflow, incident_workflow_id

pytestmark = pytest.mark.slurm

TOKEN = "correlation-token-31c9"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WINDOW = 5.0  # seconds; short, so that the test can step outside it
HOLD = 20.0  # long enough for the failed node's incident to find its jobs on a busy machine


def now() -> datetime:
    return datetime.now(timezone.utc)


async def incidents_of(client: Client, node: str) -> list[str]:
    return [wf.run_id async for wf in client.list_workflows(f"WorkflowId='{incident_workflow_id(node)}'")]


async def post(http: httpx.AsyncClient, path: str, payload: dict) -> dict:
    response = await http.post(path, json=payload, headers=AUTH)
    assert response.status_code == 200, response.text
    [answer] = response.json()["alerts"]
    return answer


async def test_a_job_peers_secondary_alerts_join_the_failed_nodes_incident(
    drill, recovery_worker, temporal_env, settings
):
    client = temporal_env.client
    run = await drill.start(DrillOptions(xid=79))  # the job's checkpoints, the lost GPU, the incident
    failed = run.node
    [peer] = [n for n in (await drill.slurm.get_job(run.job_id)).nodes if n != failed]
    stranger = f"hk{uuid.uuid4().hex[:8]}-stranger"  # shares no job with anyone
    started_at = (await run.handle.describe()).start_time
    peer_before = await incidents_of(client, peer)  # earlier tests on this Temporal server may have had some

    # The stranger is no Slurm node (a name of its own keeps its incident apart from other tests'):
    # the cluster's inventory is off here, and tested below.
    hook = HookSettings(
        token=TOKEN, port=0, correlation_window_seconds=WINDOW, correlation_hold_seconds=HOLD, inventory="off"
    )
    app = build_app(settings.model_copy(update={"dry_run": True}), hook, client)
    async with listening(app.asgi(), hook) as url, httpx.AsyncClient(base_url=url, timeout=HOLD + 30) as http:
        # Right after the failure, before its incident has found its jobs: the peer's NVLink error
        # and NCCL timeout wait for it, then join it.
        nvlink, nccl = await asyncio.gather(
            post(http, "/v1/alerts/kernel-log", kernel_log_post(peer, [xid_line(74, when=now())])),
            post(http, "/v1/alerts/gpu-health", gpu_health_event(peer, None, now())),
        )
        assert (nvlink["outcome"], nvlink["incident"]) == ("correlated", incident_workflow_id(failed))
        assert (nccl["outcome"], nccl["incident"]) == ("correlated", incident_workflow_id(failed))
        assert nvlink["reason"].startswith(f"correlated: XID 74 on {peer}, which shares a job with {failed}, ")
        assert await incidents_of(client, peer) == peer_before

        status = await run.handle.query(NodeRecoveryWorkflow.status)
        assert status.peer_nodes == [peer]
        # the incident's own alert first (it decides the XID class), then the peer's, which keep
        # their XID (the NCCL timeout, which has none, carries the failure's)
        assert (status.alerts[0].xid, status.alerts[0].observed_on) == (79, None)
        assert sorted((a.node, a.observed_on, a.xid) for a in status.alerts[1:]) == [
            (failed, peer, 74),
            (failed, peer, 79),
        ]

        # An XID 74 on a node that shares no job, and one on the peer observed after the window:
        # each waits out the hold, then opens its own node's incident.
        await asyncio.sleep((started_at + timedelta(seconds=WINDOW + 1) - now()).total_seconds())
        unrelated, late = await asyncio.gather(
            post(http, "/v1/alerts/kernel-log", kernel_log_post(stranger, [xid_line(74, when=now())])),
            post(http, "/v1/alerts/kernel-log", kernel_log_post(peer, [xid_line(74, pid=7, when=now())])),
        )
    assert (unrelated["outcome"], unrelated["incident"]) == ("accepted", incident_workflow_id(stranger))
    assert (late["outcome"], late["incident"]) == ("accepted", incident_workflow_id(peer))
    for node, before in ((stranger, []), (peer, peer_before)):
        assert len(await incidents_of(client, node)) == len(before) + 1
        own = await client.get_workflow_handle(incident_workflow_id(node)).query(NodeRecoveryWorkflow.status)
        assert [(a.node, a.xid, a.observed_on) for a in own.alerts] == [(node, 74, None)]

    # The failed node's recovery is unaffected, and its report lists what its peer saw.
    result = await drill.finish(run, DrillOptions().timeout_seconds)
    assert result.report.outcome == "recovered", result.report.model_dump_json(indent=1)
    assert sorted((a.xid, a.observed_on or "") for a in result.report.alerts) == [(74, peer), (79, ""), (79, peer)]


async def test_the_hook_refuses_alerts_on_nodes_slurm_does_not_have(settings, temporal_env):
    """With the stack's SLURM_CONF the hook reads the cluster's node names through the Slurm CLI:
    a node the cluster has is known, an alert on a name it does not have is refused (422)."""
    hook = HookSettings(token=TOKEN, port=0)
    inventory = node_inventory(settings, hook)
    assert isinstance(inventory, SlurmInventory)
    slurm = SlurmCli(slurm_conf=settings.slurm_conf, bin_dir=settings.slurm_bin_dir)
    cluster = [n.name for n in await slurm.list_nodes()]
    stranger = f"hk{uuid.uuid4().hex[:8]}-stranger"
    assert await inventory.unknown([*cluster, stranger]) == [stranger]
    app = build_app(settings, hook, temporal_env.client)
    async with listening(app.asgi(), hook) as url, httpx.AsyncClient(base_url=url) as http:
        response = await http.post(
            "/v1/alerts/kernel-log", headers=AUTH, json=kernel_log_post(stranger, [xid_line(79, when=now())])
        )
    assert response.status_code == 422, response.text
    assert response.json()["problems"] == [{"loc": "body", "msg": f"node {stranger} is not in the cluster"}]
    assert await incidents_of(temporal_env.client, stranger) == []
