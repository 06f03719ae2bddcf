"""One request can no longer drain the fleet (issue #22, "One request drains the fleet"): one
authenticated Alertmanager POST reports XID 79 on every node of an 8-node cluster. With the
default fence circuit breaker (half the fleet per 5 minutes), 4 nodes are drained; the other 4
incidents are held before their drain, the breaker trips once and says so in one notification.
`recovery reset-breaker` lets the held ones be weighed again; a reset of a closed breaker is
refused with exit 2.

Before: every node was drained within a second of the POST (the disruption budget applied only
after the drain). Real Slurm, real dev server, the worker as the project builds it, the hook
over HTTP, the CLI as a separate process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from contextlib import AsyncExitStack
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from contracts.budget import Notification, NotificationKind
from drills.localstack import wait_async
from hooks.server import build_app, listening
from hooks.settings import HookSettings
from tests.hook_support import alertmanager_payload, dcgm_alert
from tests.integration.conftest import cluster_of_its_own, stack_settings, status_if_answered
from tests.integration.test_fleet_budget import webhook_server
from worker import activities_for, build_slurm, serving
from workflows.fleet_budget import FleetBudgetWorkflow, fleet_budget_workflow_id
from workflows.node_recovery import NodeRecoveryWorkflow, incident_workflow_id

pytestmark = pytest.mark.slurm

NODES = 8
TOKEN = "one-request-token-5c2a"
RECOVERY = str(Path(sys.executable).parent / "recovery")
# Above the session cluster's ports and the storm's (tests/integration/test_budget_storm.py).
PORT_OFFSET = 600


@pytest.fixture(scope="module")
def small_fleet(local_stack):
    with cluster_of_its_own(local_stack, "one-request", NODES, PORT_OFFSET) as stack_and_cluster:
        yield stack_and_cluster


async def recovery(temporal_env, task_queue: str, key: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI as a process of its own, signing with `key`, waited for off the event loop (the
    worker runs on it)."""
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "TEMPORAL_NAMESPACE": temporal_env.client.namespace,
        "RECOVERY_TASK_QUEUE": task_queue,
        "RECOVERY_OPERATOR_KEY_FILE": str(key),
    }
    return await asyncio.to_thread(
        subprocess.run,
        [RECOVERY, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        stdin=subprocess.DEVNULL,
    )


async def test_one_request_for_every_node_drains_half_and_holds_the_rest(temporal_env, small_fleet):
    stack, cluster = small_fleet
    nodes = [f"gpu-{i}" for i in range(1, NODES + 1)]
    task_queue = f"one-request-{uuid.uuid4()}"
    budget_id = fleet_budget_workflow_id(task_queue)
    async with webhook_server() as (url, received, healthy), AsyncExitStack() as resources:
        healthy.set()
        settings = stack_settings(stack, cluster, task_queue, notify_webhook_url=url, repair_wait_seconds=1)
        slurm = await build_slurm(settings, resources)
        await resources.enter_async_context(
            serving(temporal_env.client, settings, activities_for(settings, slurm, temporal_env.client))
        )
        app = build_app(settings, HookSettings(token=TOKEN, port=0), temporal_env.client)
        now = datetime.now(timezone.utc)
        async with (
            listening(app.asgi(), app.settings) as hook,
            httpx.AsyncClient(base_url=hook, headers={"authorization": f"Bearer {TOKEN}"}, timeout=60) as http,
        ):
            answer = await http.post(
                "/v1/alerts/alertmanager", json=alertmanager_payload([dcgm_alert(node, 79, now) for node in nodes])
            )
            assert answer.status_code == 200 and answer.json()["accepted"] == NODES, answer.text
        budget = temporal_env.client.get_workflow_handle_for(FleetBudgetWorkflow.run, budget_id)

        async def four_held():
            status = await budget.query(FleetBudgetWorkflow.status)
            return status if len(status.fence_held) == 4 and len(status.fenced_in_window) == 4 else None

        status = await wait_async(four_held, 120, "4 incidents held by the tripped breaker")
        assert status.breaker is not None and "limit of 4" in status.breaker.reason
        held = {lease.node for lease in status.fence_held}
        assert set(status.fenced_in_window) == set(nodes) - held

        # The held nodes are in service, untouched (the 4 permitted go on to recover, and are
        # returned to service at their end: Slurm's view of them changes, the reports keep it).
        in_slurm = {n.name: n for n in await slurm.list_nodes()}
        assert not [node for node in held if in_slurm[node].drained or in_slurm[node].state == "down"]
        for node in held:  # waiting at the breaker gate, for a reset or an operator
            incident = temporal_env.client.get_workflow_handle(incident_workflow_id(node))

            async def at_the_breaker_gate():  # the budget holds it first; the incident then hears so
                status = await status_if_answered(incident)  # noqa: B023 (awaited in this iteration)
                return status if status is not None and status.awaiting_approval is not None else None

            status = await wait_async(at_the_breaker_gate, 60, f"{node}'s incident to wait at the breaker gate")
            assert status.phase == "breaker" and status.awaiting_approval.gate == "breaker"

        async def breaker_notified():
            sent = [Notification.model_validate_json(body) for _, body in received]
            tripped = [n for n in sent if n.kind == NotificationKind.BREAKER_TRIPPED]
            return tripped or None

        [notification] = await wait_async(breaker_notified, 60, "the breaker's notification")
        assert notification.node in held and "recovery reset-breaker" in notification.summary

        reset_at = datetime.now(timezone.utc)
        stack.ensure_operator_key("alice")
        alice = stack.operator_key_file_of("alice")
        reset = await recovery(
            temporal_env, task_queue, alice, "reset-breaker", "--reason", "the PDU was replaced", "--actor", "alice"
        )
        assert reset.returncode == 0, reset.stdout + reset.stderr
        assert "fence circuit breaker reset by alice; closed; 0 incident(s) still held" in reset.stdout
        again = await recovery(
            temporal_env, task_queue, alice, "reset-breaker", "--reason", "twice", "--actor", "alice"
        )
        assert again.returncode == 2 and "not tripped" in again.stderr, again.stdout + again.stderr

        reports = await asyncio.wait_for(
            asyncio.gather(
                *(
                    temporal_env.client.get_workflow_handle_for(
                        NodeRecoveryWorkflow.run, incident_workflow_id(node)
                    ).result()
                    for node in nodes
                )
            ),
            300,
        )
        await budget.cancel()
    assert all(r.outcome.startswith("no_replacement") for r in reports), [r.outcome for r in reports]
    drained_at = {r.node: a.at for r in reports for a in r.actions if a.action == "drain_node" and a.executed}
    assert drained_at.keys() == set(nodes)  # the held ones too, once the breaker was reset
    assert {node for node, at in drained_at.items() if at >= reset_at} == held
    assert (
        sum(
            n.kind == NotificationKind.BREAKER_TRIPPED
            for n in (Notification.model_validate_json(body) for _, body in received)
        )
        == 1
    )
