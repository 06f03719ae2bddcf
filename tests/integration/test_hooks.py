"""The hook server over HTTP against the real Temporal dev server: one incident per node whatever
the storm, nothing on bad input or resolved alerts, no restart from a replayed alert, and
`recovery hooks` itself (correlation, which needs a worker and Slurm: test_hooks_correlation.py).

No worker runs: signal-with-start needs none, so each incident stays as handed over, and what it
absorbed is read back from its history (the signals' payloads).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from bench.storm import StormSpec, run_once
from contracts.models import NodeFailureAlert, RecoveryPolicy
from contracts.settings import Settings
from drills.localstack import wait_async
from hooks.server import build_app, listening
from hooks.settings import HookSettings
from starter.alerts import raise_alerts
from tests.hook_support import alertmanager_payload, dcgm_alert, gpu_health_event, kernel_log_post, xid_line
from workflows.node_recovery import incident_workflow_id

TOKEN = "integration-token-5be0c1"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def now() -> datetime:
    return datetime.now(timezone.utc)


@pytest_asyncio.fixture
async def task_queue() -> str:
    return f"hooks-test-{uuid.uuid4()}"


@pytest_asyncio.fixture
async def nodes() -> list[str]:
    """Node names of this test alone: workflow ids are namespace-wide."""
    prefix = uuid.uuid4().hex[:8]
    return [f"hk{prefix}-{i}" for i in range(5)]


def hook_settings(**overrides) -> HookSettings:
    return HookSettings(**{"token": TOKEN, "port": 0} | overrides)


def start_hook(temporal_env, task_queue: str, **overrides):
    settings = Settings(TEMPORAL_ADDRESS="unused", task_queue=task_queue)
    app = build_app(settings, hook_settings(**overrides), temporal_env.client)
    return listening(app.asgi(), app.settings)


async def runs_of(client: Client, node: str) -> list[str]:
    return [wf.run_id async for wf in client.list_workflows(f"WorkflowId='{incident_workflow_id(node)}'")]


async def assert_runs(client: Client, expected: dict[str, int]) -> None:
    """Each node has exactly the expected number of incident runs (visibility catches up first)."""

    async def counted():
        counts = {node: len(await runs_of(client, node)) for node in expected}
        return counts if counts == expected else None

    await wait_async(counted, 15, f"incident runs {expected}", interval=0.1)
    await asyncio.sleep(0.3)  # and no more appear
    assert {node: len(await runs_of(client, node)) for node in expected} == expected


async def absorbed(client: Client, node: str, run_id: str | None = None) -> list[NodeFailureAlert]:
    """The alerts an incident received, from its history."""
    handle = client.get_workflow_handle(incident_workflow_id(node), run_id=run_id)
    alerts = []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            payloads = event.workflow_execution_signaled_event_attributes.input.payloads
            [batch] = await client.data_converter.decode(payloads, [list[NodeFailureAlert]])
            alerts += batch
    return alerts


async def post(http: httpx.AsyncClient, path: str, payload: dict, headers=AUTH) -> httpx.Response:
    return await http.post(path, json=payload, headers=headers)


async def test_a_storm_from_every_source_makes_one_incident_per_node(temporal_env, task_queue, nodes):
    t0 = now() - timedelta(seconds=30)
    requests = []
    for node in nodes[:3]:
        for gpu in range(4):
            when = t0 + timedelta(seconds=gpu)
            requests.append(("/v1/alerts/alertmanager", alertmanager_payload([dcgm_alert(node, 79, when, gpu=gpu)])))
            requests.append(("/v1/alerts/gpu-health", gpu_health_event(node, 79, when, gpu=gpu)))
            lines = [xid_line(79, pid=gpu, when=when), xid_line(45, pid=gpu, when=when)]
            requests.append(("/v1/alerts/kernel-log", kernel_log_post(node, lines)))
    requests *= 3  # every payload delivered three times, as Alertmanager and shippers retry
    random.Random(7).shuffle(requests)

    async with start_hook(temporal_env, task_queue) as url, httpx.AsyncClient(base_url=url) as http:
        sem = asyncio.Semaphore(16)

        async def send(path, payload):
            async with sem:
                return await post(http, path, payload)

        responses = await asyncio.gather(*(send(p, b) for p, b in requests))
    assert {r.status_code for r in responses} == {200}
    outcomes = [a["outcome"] for r in responses for a in r.json()["alerts"]]
    distinct = 3 * 4 * 4  # per node: 4 GPUs x (Alertmanager, health event, 2 kernel lines)
    assert outcomes.count("accepted") == distinct
    assert outcomes.count("duplicate") == 2 * distinct
    assert {a["incident"] for r in responses for a in r.json()["alerts"]} == {
        incident_workflow_id(n) for n in nodes[:3]
    }

    await assert_runs(temporal_env.client, {n: 1 for n in nodes[:3]})
    for node in nodes[:3]:
        alerts = await absorbed(temporal_env.client, node)
        assert len(alerts) == 16 and {a.node for a in alerts} == {node}
        assert {a.source for a in alerts} == {"alertmanager", "dcgm-health", "kernel-log"}


async def test_bad_input_and_resolved_alerts_start_nothing(temporal_env, task_queue, nodes):
    node = nodes[0]
    async with start_hook(temporal_env, task_queue) as url, httpx.AsyncClient(base_url=url) as http:
        bad = [
            ("/v1/alerts/gpu-health", gpu_health_event(node, 79, now()), {}),  # no token
            ("/v1/alerts/gpu-health", gpu_health_event(node, 1000, now()), AUTH),
            ("/v1/alerts/kernel-log", kernel_log_post(node, ["not a driver line"]), AUTH),  # no Xid line at all
            (
                "/v1/alerts/alertmanager",
                alertmanager_payload([dcgm_alert(node, 79, now()), dcgm_alert("gpu[1-2]", 79, now())]),
                AUTH,
            ),
        ]
        for path, payload, headers in bad:
            response = await post(http, path, payload, headers)
            assert 400 <= response.status_code < 500 and response.json()["problems"]
        resolved = alertmanager_payload([dcgm_alert(node, 79, now() - timedelta(seconds=10), status="resolved")])
        answer = (await post(http, "/v1/alerts/alertmanager", resolved)).json()
        assert answer["dropped"] == 1 and answer["alerts"][0]["reason"].startswith("resolved")
    with pytest.raises(RPCError) as e:
        await temporal_env.client.get_workflow_handle(incident_workflow_id(node)).describe()
    assert e.value.status == RPCStatusCode.NOT_FOUND
    assert await runs_of(temporal_env.client, node) == []


async def test_a_replay_after_the_incident_ended_never_restarts_it(temporal_env, task_queue, nodes):
    node = nodes[0]
    failure = alertmanager_payload([dcgm_alert(node, 79, now() - timedelta(seconds=60))])
    handle = temporal_env.client.get_workflow_handle(incident_workflow_id(node))
    async with start_hook(temporal_env, task_queue) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await post(http, "/v1/alerts/alertmanager", failure)).json()["accepted"] == 1
        await handle.terminate("the recovery finished (test)")
        ended_at = (await handle.describe()).close_time
        # the same hook learns of the end from the signal that no longer finds a running incident
        late = gpu_health_event(node, 79, now() - timedelta(seconds=30), gpu=1)
        assert (await post(http, "/v1/alerts/gpu-health", late)).json()["dropped"] == 1

    # the hook restarts (nothing remembered) and Alertmanager re-sends the firing alert
    async with start_hook(temporal_env, task_queue) as url, httpx.AsyncClient(base_url=url) as http:
        answer = (await post(http, "/v1/alerts/alertmanager", failure)).json()
        assert answer["dropped"] == 1
        assert answer["alerts"][0]["reason"] == (
            f"the node's last incident ended at {ended_at.isoformat()}, after this alert was observed"
        )
        await assert_runs(temporal_env.client, {node: 1})

        # a failure observed after the end is a new incident
        fresh = gpu_health_event(node, 48, now())
        assert (await post(http, "/v1/alerts/gpu-health", fresh)).json()["accepted"] == 1
    await assert_runs(temporal_env.client, {node: 2})
    assert [a.xid for a in await absorbed(temporal_env.client, node)] == [48]


async def test_a_hook_that_knows_an_ended_run_hands_over_to_the_one_opened_since(temporal_env, task_queue, nodes):
    """The hook signals the run it handed alerts to; once that has ended and someone else (another
    hook, `recovery inject`) opened a new incident, its next alert joins that one: no third run."""
    node = nodes[0]
    async with start_hook(temporal_env, task_queue) as url, httpx.AsyncClient(base_url=url) as http:
        first = gpu_health_event(node, 79, now() - timedelta(seconds=60))
        assert (await post(http, "/v1/alerts/gpu-health", first)).json()["accepted"] == 1
        await temporal_env.client.get_workflow_handle(incident_workflow_id(node)).terminate("recovered (test)")
        injected = NodeFailureAlert(node=node, xid=48, source="inject", actor="test")
        opened = await raise_alerts(temporal_env.client, [injected], task_queue, RecoveryPolicy())
        later = gpu_health_event(node, 94, now(), gpu=2)
        answer = (await post(http, "/v1/alerts/gpu-health", later)).json()
        assert answer["accepted"] == 1, answer
        # the signal went to the ended run and failed; describe, then signal-with-start joined
        calls = (await http.get("/metrics")).text
        for call in ("join", "ended_at", "open_after_end"):
            assert f'recovery_hook_temporal_calls_total{{call="{call}"}} 1' in calls, calls
    await assert_runs(temporal_env.client, {node: 2})
    assert [a.xid for a in await absorbed(temporal_env.client, node, opened.result_run_id)] == [48, 94]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_recovery_hooks_serves_the_openapi_document_and_alerts(temporal_env, task_queue, nodes):
    port = free_port()
    env = os.environ | {
        "TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "RECOVERY_TASK_QUEUE": task_queue,
        "RECOVERY_HOOKS_PORT": str(port),
        "RECOVERY_HOOKS_TOKEN": TOKEN,
    }
    recovery = Path(sys.executable).parent / "recovery"
    proc = subprocess.Popen([str(recovery), "hooks"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:

            async def up():
                try:
                    return (await http.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_async(up, 30, "recovery hooks to listen", interval=0.1)
            doc = (await http.get("/openapi.json")).json()
            assert "/v1/alerts/alertmanager" in doc["paths"]
            answer = (await post(http, "/v1/alerts/gpu-health", gpu_health_event(nodes[0], 79, now()))).json()
            assert answer["alerts"][0]["incident"] == incident_workflow_id(nodes[0])
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=20)[0].decode()
    assert proc.returncode == 0, output
    assert TOKEN not in output
    await assert_runs(temporal_env.client, {nodes[0]: 1})


async def test_the_storm_benchmark_keeps_temporal_on_a_wal_sqlite_file(tmp_path):
    """`python -m bench storm` as it measures: a fresh dev server on a sqlite file in WAL mode (the
    pragmas are taken, not ignored: the file's header says WAL), `recovery hooks` in front of it, and a
    small storm still makes exactly one incident per node, every distinct alert handed over once."""
    spec = StormSpec(nodes=6, copies=2, temporal_db="sqlite-wal")
    run = await run_once(spec, tmp_path)
    distinct = spec.nodes * spec.distinct_per_node
    assert (run.incidents, run.errors) == (spec.nodes, 0)
    assert run.outcomes == {"accepted": distinct, "correlated": 0, "duplicate": distinct, "dropped": 0}
    [database] = tmp_path.glob("temporal-*.db")
    assert database.read_bytes()[18:20] == b"\x02\x02"  # sqlite's file format versions: 2 = WAL
    assert all(ms > 0 for ms in run.cpu_ms_per_alert.values()), run.cpu_ms_per_alert
