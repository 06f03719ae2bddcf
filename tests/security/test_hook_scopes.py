"""Issue #22, "Safe to switch on": each sender's credential names the nodes it may report on.
Before, any holder of the one token could open an incident on (and so drain) any node; a log
shipper of one rack, or a compromised node agent, could take down the whole cluster."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import yaml
from pydantic import ValidationError

from hooks.app import HookApp, ProblemAnswer
from hooks.credentials import agent_token
from hooks.intake import Intake
from hooks.settings import HookSettings
from tests.hook_support import (
    RecordingIncidents,
    alertmanager_payload,
    dcgm_alert,
    gpu_health_event,
    kernel_log_post,
    xid_line,
)

ALL_NODES_TOKEN = "single-token-5c1f0a"
SHIPPER_TOKEN = "rack-7-shipper-token-e2a9"
ALERTMANAGER_TOKEN = "alertmanager-token-40b7"
MASTER_KEY = "node-agent-master-key-91d3"


def recent() -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=5)


@pytest.fixture
def credentials_file(tmp_path):
    (tmp_path / "am-token").write_text(ALERTMANAGER_TOKEN + "\n")
    (tmp_path / "master").write_text(MASTER_KEY)
    path = tmp_path / "credentials.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "credentials": [
                    {"name": "alertmanager", "token_file": str(tmp_path / "am-token"), "nodes": "*"},
                    {"name": "rack-7-shipper", "token": SHIPPER_TOKEN, "nodes": "gpu-[1-4]"},
                ],
                "node_agents": {"master_key_file": str(tmp_path / "master"), "nodes": "gpu-[1-8]"},
            }
        )
    )
    return path


def hook(credentials_file) -> tuple[HookApp, RecordingIncidents]:
    config = HookSettings(token=ALL_NODES_TOKEN, credentials_file=credentials_file, max_alert_age_seconds=86400)
    incidents = RecordingIncidents()
    return HookApp(config, Intake(incidents, config.intake_limits())), incidents


async def post(app: HookApp, path: str, payload: dict, token: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.asgi()), base_url="http://hook") as c:
        return await c.post(
            path,
            content=json.dumps(payload).encode(),
            headers={"content-type": "application/json", "authorization": f"Bearer {token}"},
        )


async def metrics(app: HookApp) -> str:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.asgi()), base_url="http://hook") as c:
        return (await c.get("/metrics")).text


def forbidden(response: httpx.Response) -> list[str]:
    assert response.status_code == 403, response.text
    return [p.msg for p in ProblemAnswer.model_validate(response.json()).problems]


async def test_a_sender_reports_on_its_nodes_and_is_refused_whole_beyond_them(credentials_file, caplog):
    caplog.set_level(logging.INFO)
    app, incidents = hook(credentials_file)
    inside = kernel_log_post("gpu-2", [xid_line(79)], recent())
    assert (await post(app, "/v1/alerts/kernel-log", inside, SHIPPER_TOKEN)).status_code == 200
    handed_over = len(incidents.calls)

    mixed = alertmanager_payload(
        [dcgm_alert("gpu-3", 79, recent()), dcgm_alert("gpu-9", 79, recent()), dcgm_alert("gpu-12", 48, recent())]
    )
    assert forbidden(await post(app, "/v1/alerts/alertmanager", mixed, SHIPPER_TOKEN)) == [
        "credential rack-7-shipper may not report on node gpu-9",
        "credential rack-7-shipper may not report on node gpu-12",
    ]
    assert len(incidents.calls) == handed_over  # not even gpu-3's alert, which was in scope
    assert 'recovery_hook_out_of_scope_requests_total{credential="rack-7-shipper"} 1' in await metrics(app)
    assert "credential rack-7-shipper may not report on gpu-9, gpu-12" in caplog.text
    assert SHIPPER_TOKEN not in caplog.text


async def test_the_single_token_and_an_all_nodes_credential_report_on_any_node(credentials_file):
    app, _ = hook(credentials_file)
    for token in (ALL_NODES_TOKEN, ALERTMANAGER_TOKEN):
        response = await post(app, "/v1/alerts/gpu-health", gpu_health_event("gpu-900", 79, recent()), token)
        assert response.status_code == 200, response.text


async def test_a_node_agent_token_from_the_command_reports_on_its_own_node_only(credentials_file):
    env = os.environ | {"RECOVERY_HOOKS_CREDENTIALS_FILE": str(credentials_file)}
    printed = subprocess.run(
        [sys.executable, "-m", "hooks.credentials", "gpu-3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()
    assert printed == agent_token(MASTER_KEY.encode(), "gpu-3")
    app, incidents = hook(credentials_file)
    assert (
        await post(app, "/v1/alerts/gpu-health", gpu_health_event("gpu-3", 79, recent()), printed)
    ).status_code == 200
    assert forbidden(await post(app, "/v1/alerts/gpu-health", gpu_health_event("gpu-4", 79, recent()), printed)) == [
        "credential node-agent.gpu-3 may not report on node gpu-4"
    ]
    assert {node for _, node, _ in incidents.calls} == {"gpu-3"}

    outside = subprocess.run(
        [sys.executable, "-m", "hooks.credentials", "gpu-9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert outside.returncode == 2 and "gpu-9 is not in node_agents.nodes" in outside.stderr
    assert outside.stdout == ""


def test_a_json_credentials_file_is_read_too(tmp_path):
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps({"credentials": [{"name": "shipper", "token": SHIPPER_TOKEN, "nodes": "gpu-1"}]}))
    HookSettings(credentials_file=path).bearer_tokens()


@pytest.mark.parametrize(
    "content, words",
    [
        ({"credentials": [{"name": "a", "token": "x1", "nodes": "gpu-[1-"}]}, "not a Slurm hostlist"),
        ({"credentials": [{"name": "a", "token": "  ", "nodes": "*"}]}, "token is empty"),
        ({"credentials": [{"name": "a", "nodes": "*"}]}, "exactly one"),
        (
            {
                "credentials": [
                    {"name": "a", "token": "same", "nodes": "*"},
                    {"name": "b", "token": "same", "nodes": "gpu-1"},
                ]
            },
            "same token",
        ),
        (
            {"credentials": [{"name": "a", "token": "x1", "nodes": "*"}, {"name": "a", "token": "x2", "nodes": "*"}]},
            "unique",
        ),
        ({"credentials": [{"name": "a b", "token": "x1", "nodes": "*"}]}, "name"),
        ({"node_agents": {"master_key": "k", "nodes": "*"}}, "must be a hostlist"),
        ({"credentials": [{"name": "a", "token": "x", "nodes": "*", "scope": "all"}]}, "scope"),
    ],
)
def test_a_bad_credentials_file_is_refused_at_start(tmp_path, content, words):
    path = tmp_path / "credentials.yaml"
    path.write_text(yaml.safe_dump(content))
    with pytest.raises(ValidationError) as refused:
        HookSettings(credentials_file=path)
    assert "RECOVERY_HOOKS_CREDENTIALS_FILE" in str(refused.value) and words in str(refused.value)
    for secret in ("x1", "x2", "same"):
        assert f"'{secret}'" not in str(refused.value)


def test_a_file_that_is_not_yaml_is_refused_without_quoting_it(tmp_path):
    path = tmp_path / "credentials.yaml"
    path.write_text("credentials:\n  - name: a\n    token: x9-secret: [\n")
    with pytest.raises(ValidationError) as refused:
        HookSettings(credentials_file=path)
    assert "not YAML or JSON (line 3)" in str(refused.value) and "x9-secret" not in str(refused.value)
