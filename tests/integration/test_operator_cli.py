"""The operator's commands on a real incident, run as a separate process as operators and their
scripts run them: list, describe (by node and by incident id), approve at a gate, a decision
nobody awaits (refused: exit 2), and the HTML report once the incident has ended."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from starter.drill import DrillOptions
from workflows.node_recovery import NodeRecoveryWorkflow

RECOVERY = str(Path(sys.executable).parent / "recovery")


def recovery(temporal_env, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
           "TEMPORAL_NAMESPACE": temporal_env.client.namespace}
    return subprocess.run([RECOVERY, *args], capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)


def json_of(result: subprocess.CompletedProcess, code: int = 0):
    assert result.returncode == code, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.mark.slurm
async def test_an_operator_follows_and_approves_an_incident(temporal_env, drill, recovery_worker, tmp_path):
    drill.policy = drill.policy.model_copy(update={"approval_required": ["replacement"]})
    run = await drill.start(DrillOptions(xid=79))
    node = run.node

    async def awaiting():
        status = await run.handle.query(NodeRecoveryWorkflow.status)
        return status if status.awaiting_approval else None

    deadline = asyncio.get_running_loop().time() + 120
    while (status := await awaiting()) is None:
        assert asyncio.get_running_loop().time() < deadline, "the incident never asked for approval"
        await asyncio.sleep(0.5)
    incident_id = status.incident_id

    call = lambda *args: asyncio.to_thread(recovery, temporal_env, *args)  # noqa: E731
    listed = json_of(await call("list", "--node", node, "--running", "--json"))
    assert [(r["incident_id"], r["phase"], r["xid"]) for r in listed] == [(incident_id, "approval_replacement", 79)]

    described = json_of(await call("describe", node, "--json"))
    assert (described["incident_id"], described["status"], described["phase"]) == (
        incident_id, "RUNNING", "approval_replacement")
    assert [p["phase"] for p in described["timeline"]][:3] == ["classify", "breaker", "drain"]
    assert described["incident"]["awaiting_approval"]["gate"] == "replacement"

    # Two operators answer at once: one approval counts, the other is refused and changes nothing.
    first, second = await asyncio.gather(
        call("approve", incident_id, "--reason", "spare checked", "--actor", "ops on call", "--json"),
        call("approve", node, "--reason", "me too", "--actor", "second operator", "--json"))
    accepted, refused = (first, second) if first.returncode == 0 else (second, first)
    approved = json_of(accepted)
    assert [d["kind"] for d in approved["decisions"]] == ["approve"]
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "bad input, nothing was changed" in refused.stderr and "awaits no approval" in refused.stderr
    [decision] = approved["decisions"]

    result = await drill.finish(run, 300)
    assert result.report.outcome == "recovered", result.checks

    text = await call("describe", incident_id)
    assert text.returncode == 0, text.stderr
    assert f"incident {incident_id}" in text.stdout and "approval_replacement" in text.stdout
    assert f"approve by {decision['actor']}: {decision['reason']}" in text.stdout
    written = json_of(await call("report", incident_id, "--output", str(tmp_path / "incident.html"), "--json"))
    page = Path(written["report_html"]).read_text()
    assert incident_id in page and 'class="phase" data-phase="approval_replacement"' in page
    late = await call("abort", node, "--reason", "too late")
    assert late.returncode == 2 and f"incident {incident_id} has ended" in late.stderr


async def test_an_unknown_incident_is_bad_input(temporal_env):
    for args in (["describe", "gpu-nowhere"], ["report", "gpu-nowhere-20261130T001736Z"],
                 ["deny", "gpu-nowhere", "--reason", "no"]):
        result = await asyncio.to_thread(recovery, temporal_env, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert "no incident gpu-nowhere" in result.stderr
