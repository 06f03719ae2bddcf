"""Unknown nodes refused against the cluster's node list (cached), and the hook's per-node state
bounded however many names senders use (issue #22)."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from backends.slurm.api import SlurmUnavailable
from contracts.settings import Settings
from hooks.app import HookAnswer, HookApp, ProblemAnswer
from hooks.intake import Intake
from hooks.inventory import EveryNode, InventoryUnavailable, SlurmInventory
from hooks.server import node_inventory
from hooks.settings import HookSettings
from tests.hook_support import RecordingIncidents, alertmanager_payload, dcgm_alert

TOKEN = "tok-9c2e41d7a0b3f5"
AUTH = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
CLUSTER = ["gpu-1", "gpu-2", "gpu-3"]


class FakeSlurm:
    """The cluster's node names as the Slurm client lists them; fails while `down`."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.down = False
        self.reads = 0

    async def node_names(self) -> list[str]:
        self.reads += 1
        await asyncio.sleep(0)  # a read takes a moment: concurrent callers overlap
        if self.down:
            raise SlurmUnavailable("Unable to contact slurm controller")
        return list(self.names)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def recent() -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=5)


def hook_app(inventory, **settings) -> tuple[HookApp, RecordingIncidents]:
    incidents = RecordingIncidents()
    config = HookSettings(**{"token": TOKEN} | settings)
    return HookApp(config, Intake(incidents, config.intake_limits()), inventory), incidents


async def post(app: HookApp, alerts: list[dict]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.asgi()), base_url="http://hook") as c:
        return await c.post("/v1/alerts/alertmanager", content=json.dumps(alertmanager_payload(alerts)), headers=AUTH)


# --- the inventory -------------------------------------------------------------------------------


async def test_the_node_list_is_read_once_per_ttl_and_shared_by_concurrent_requests():
    slurm, clock = FakeSlurm(CLUSTER), Clock()
    inventory = SlurmInventory(slurm.node_names, ttl=60, clock=clock)
    answers = await asyncio.gather(*(inventory.unknown(["gpu-2", "gpu-9", "gpu-9"]) for _ in range(50)))
    assert answers == [["gpu-9"]] * 50 and slurm.reads == 1
    clock.now = 59
    slurm.names.append("gpu-9")
    assert await inventory.unknown(["gpu-9"]) == ["gpu-9"] and slurm.reads == 1  # cached
    clock.now = 60
    assert await inventory.unknown(["gpu-9"]) == [] and slurm.reads == 2


async def test_without_a_node_list_the_inventory_fails_closed_and_retries_after_a_pause():
    slurm, clock = FakeSlurm(CLUSTER), Clock()
    slurm.down = True
    inventory = SlurmInventory(slurm.node_names, ttl=60, clock=clock)
    for _ in range(3):
        with pytest.raises(InventoryUnavailable):
            await inventory.unknown(["gpu-2"])
    assert slurm.reads == 1  # not a call per request
    slurm.down, clock.now = False, SlurmInventory.RETRY_AFTER_FAILURE
    assert await inventory.unknown(["gpu-2"]) == [] and slurm.reads == 2


async def test_a_failed_read_keeps_the_nodes_known_before():
    slurm, clock = FakeSlurm(CLUSTER), Clock()
    inventory = SlurmInventory(slurm.node_names, ttl=60, clock=clock)
    await inventory.unknown(["gpu-2"])
    slurm.down, clock.now = True, 61
    assert await inventory.unknown(["gpu-2", "gpu-7"]) == ["gpu-7"] and slurm.reads == 2


def test_the_inventory_is_slurms_when_slurm_is_configured_else_off_unless_set():
    hook = HookSettings(token=TOKEN)
    with_slurm = Settings(TEMPORAL_ADDRESS="unused", SLURM_CONF="/etc/slurm/slurm.conf")
    without = Settings(TEMPORAL_ADDRESS="unused")
    assert isinstance(node_inventory(with_slurm, hook), SlurmInventory)
    assert isinstance(node_inventory(without, hook), EveryNode)
    assert isinstance(node_inventory(with_slurm, HookSettings(token=TOKEN, inventory="off")), EveryNode)
    assert isinstance(node_inventory(without, HookSettings(token=TOKEN, inventory="slurm")), SlurmInventory)


# --- through the hook ----------------------------------------------------------------------------


async def test_an_alert_on_an_unknown_node_refuses_the_request_naming_the_node_and_is_counted():
    app, incidents = hook_app(SlurmInventory(FakeSlurm(CLUSTER).node_names, ttl=60))
    response = await post(app, [dcgm_alert("gpu-2", 79, recent()), dcgm_alert("gpu-77", 79, recent())])
    assert response.status_code == 422, response.text
    problems = ProblemAnswer.model_validate(response.json()).problems
    assert [p.msg for p in problems] == ["node gpu-77 is not in the cluster"]
    assert incidents.calls == []
    assert "recovery_hook_unknown_node_requests_total 1\n" in app.metrics()
    response = await post(app, [dcgm_alert("gpu-2", 79, recent())])
    assert HookAnswer.model_validate(response.json()).accepted == 1


async def test_when_the_node_list_cannot_be_read_the_hook_fails_closed_with_503():
    slurm = FakeSlurm(CLUSTER)
    slurm.down = True
    app, incidents = hook_app(SlurmInventory(slurm.node_names, ttl=60))
    response = await post(app, [dcgm_alert("gpu-2", 79, recent())])
    assert response.status_code == 503, response.text
    [problem] = ProblemAnswer.model_validate(response.json()).problems
    assert problem.loc == "inventory" and "could not be read" in problem.msg
    assert incidents.calls == []


# --- bounded per-node state ----------------------------------------------------------------------

NAMES = 100_000
PER_REQUEST = 1000


async def test_100000_unknown_node_names_leave_no_per_node_state():
    app, incidents = hook_app(SlurmInventory(FakeSlurm(CLUSTER).node_names, ttl=60), dedupe_cache_size=5000)
    when = recent()
    for first in range(0, NAMES, PER_REQUEST):
        alerts = [dcgm_alert(f"stranger-{n}", 79, when) for n in range(first, first + PER_REQUEST)]
        assert (await post(app, alerts)).status_code == 422
    assert incidents.calls == []
    assert (len(app.intake._nodes), len(app.intake._seen), len(app.intake._own_incident_news)) == (0, 0, 0)
    assert app._parsed._items <= 5000  # validated bodies, bounded by what they hold


async def test_without_an_inventory_node_names_keep_at_most_node_state_size_nodes():
    app, incidents = hook_app(EveryNode(), node_state_size=1000, dedupe_cache_size=5000)
    when = recent()
    for first in range(0, NAMES // 5, PER_REQUEST):  # 20 times the bound: enough, at a fifth of the CPU
        alerts = [dcgm_alert(f"stranger-{n}", 79, when) for n in range(first, first + PER_REQUEST)]
        assert HookAnswer.model_validate((await post(app, alerts)).json()).accepted == PER_REQUEST
    assert len(incidents.runs) == NAMES // 5
    assert len(app.intake._nodes) <= 1000 and len(app.intake._seen) <= 5000
