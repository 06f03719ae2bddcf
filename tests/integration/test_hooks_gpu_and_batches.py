"""What real senders send reaches the incident whole (issue #29, items 3 and 4), on the real stack:
the hook in front of a real worker, its incidents on a node of the real cluster (observe mode:
they plan their drains, and make none).

- A kernel-log batch as log shipping sends it: the Xid line, the driver's follow-up line, and an
  Xid line cut short after its code. Before: the batch was refused whole (422) for its one
  non-Xid line, and the XID 79 was lost.
- The GPU the sender named: Alertmanager's gpu, UUID and pci_bus_id labels, the kernel line's PCI
  address. Before: `gpu: null` in the incident, and application XIDs counted per node."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import httpx
import pytest

from contracts.models import IncidentReport
from hooks.server import build_app, listening
from hooks.settings import HookSettings
from tests.hook_support import alertmanager_payload, dcgm_alert, gpu_uuid
from workflows.node_recovery import incident_workflow_id

pytestmark = [pytest.mark.slurm, pytest.mark.host_and_newest_slurm_generation]

TOKEN = "batches-token-7e41"
AUTH = {"authorization": f"Bearer {TOKEN}"}


async def compute_node(drill) -> str:
    await drill.reset_cluster()
    return next(n.name for n in await drill.slurm.list_nodes() if n.name not in drill.spare_nodes)


async def incident_report(client, node: str) -> IncidentReport:
    """The node's incident, ended (an incident left running would take the next test's alerts on
    this node, with no worker on its task queue to answer)."""
    return await asyncio.wait_for(
        client.get_workflow_handle(incident_workflow_id(node), result_type=IncidentReport).result(), 180
    )


async def test_a_log_batch_with_the_drivers_follow_up_line_opens_the_incident_with_its_gpu(
    drill, recovery_worker, temporal_env, settings
):
    node = await compute_node(drill)
    lines = [
        "NVRM: Xid (PCI:0000:01:00): 79, pid=0, name=python, GPU has fallen off the bus.",
        "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:02:00): 154 (",
    ]
    hook = HookSettings(token=TOKEN, port=0, inventory="off")
    app = build_app(settings.model_copy(update={"dry_run": True}), hook, temporal_env.client)
    async with listening(app.asgi(), hook) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.post(
            "/v1/alerts/kernel-log",
            json={"node": node, "lines": lines, "observed_at": datetime.now(timezone.utc).isoformat()},
            headers=AUTH,
        )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [(a["outcome"], a["incident"]) for a in answer["alerts"]] == [
        ("accepted", incident_workflow_id(node)),
        ("accepted", incident_workflow_id(node)),
    ], answer
    assert [i["index"] for i in answer["ignored"]] == [1] and "not an NVRM Xid line" in answer["ignored"][0]["reason"]

    report = await incident_report(temporal_env.client, node)
    assert sorted((a.xid, a.pci_address, a.gpu) for a in report.alerts) == [
        (79, "0000:01:00.0", "0000:01:00.0"),
        (154, "0000:02:00.0", "0000:02:00.0"),
    ]


async def test_alertmanagers_gpu_labels_reach_the_incident(drill, recovery_worker, temporal_env, settings):
    node = await compute_node(drill)
    alert = dcgm_alert(node, 79, datetime.now(timezone.utc), gpu=3)
    alert["labels"]["pci_bus_id"] = "00000000:3B:00.0"  # as dcgm-exporter writes it
    hook = HookSettings(token=TOKEN, port=0, inventory="off")
    app = build_app(settings.model_copy(update={"dry_run": True}), hook, temporal_env.client)
    async with listening(app.asgi(), hook) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.post("/v1/alerts/alertmanager", json=alertmanager_payload([alert]), headers=AUTH)
    assert response.status_code == 200, response.text

    [seen] = (await incident_report(temporal_env.client, node)).alerts
    uuid = gpu_uuid(node, 3)
    assert (seen.xid, seen.gpu_index, seen.gpu_uuid, seen.pci_address) == (79, 3, uuid, "0000:3b:00.0")
    assert seen.gpu == uuid  # the UUID names one GPU for its life
