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

from contracts.audit import configure_sink, remove_sink
from drills.drill import DrillOptions
from starter.operator_key import new_key
from workflows.node_recovery import NodeRecoveryWorkflow

RECOVERY = str(Path(sys.executable).parent / "recovery")


def recovery(temporal_env, *args: str, key: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI as an operator runs it, signing with `key` (RECOVERY_OPERATOR_KEY_FILE)."""
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
        "TEMPORAL_NAMESPACE": temporal_env.client.namespace,
        **({"RECOVERY_OPERATOR_KEY_FILE": str(key)} if key else {}),
    }
    return subprocess.run(
        [RECOVERY, *args], capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL
    )


def json_of(result: subprocess.CompletedProcess, code: int = 0):
    assert result.returncode == code, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.mark.slurm
async def test_an_operator_follows_and_approves_an_incident(
    temporal_env, local_stack, drill, recovery_worker, tmp_path
):
    audit = tmp_path / "audit.jsonl"
    sink = configure_sink(audit)
    try:
        await follow_and_approve(temporal_env, local_stack, drill, tmp_path, audit)
    finally:
        remove_sink(sink)


async def follow_and_approve(temporal_env, local_stack, drill, tmp_path: Path, audit: Path) -> None:
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

    ops, other = "ops-on-call", "second-operator"
    for name in (ops, other):
        local_stack.ensure_operator_key(name)
    key = local_stack.operator_key_file_of
    call = lambda *args, key=key(ops): asyncio.to_thread(recovery, temporal_env, *args, key=key)  # noqa: E731, B008
    listed = json_of(await call("list", "--node", node, "--running", "--json"))
    assert [(r["incident_id"], r["phase"], r["xid"]) for r in listed] == [(incident_id, "approval_replacement", 79)]

    described = json_of(await call("describe", node, "--json"))
    assert (described["incident_id"], described["status"], described["phase"]) == (
        incident_id,
        "RUNNING",
        "approval_replacement",
    )
    assert [p["phase"] for p in described["timeline"]][:3] == ["classify", "breaker", "drain"]
    assert described["incident"]["awaiting_approval"]["gate"] == "replacement"

    # Whoever signs is who decides: a name given with another operator's key, no key, or a key the
    # worker does not list, is refused, audited as such, and changes nothing.
    forged = await call("approve", node, "--reason", "trust me", "--actor", ops, key=key(other))
    assert forged.returncode == 2, forged.stdout + forged.stderr
    assert f"approve refused: the signature does not verify with {ops}'s key SHA256:" in forged.stderr
    unsigned = await asyncio.to_thread(recovery, temporal_env, "approve", node, "--reason", "no key")
    assert unsigned.returncode == 2 and "RECOVERY_OPERATOR_KEY_FILE is not set" in unsigned.stderr
    unlisted = tmp_path / "keys"
    new_key("mallory", unlisted)
    stranger = await call("approve", node, "--reason", "hello", "--actor", "mallory", key=unlisted / "mallory")
    assert stranger.returncode == 2 and "'mallory' is not among the worker's operators" in stranger.stderr
    refusals = [
        json.loads(line) for line in audit.read_text().splitlines() if json.loads(line)["action"] == "approve_refused"
    ]
    assert [(r["actor"], r["actor_kind"], r["result"]) for r in refusals] == [
        (ops, "unverified", "refused"),
        ("mallory", "unverified", "refused"),
    ]
    assert (await run.handle.query(NodeRecoveryWorkflow.status)).decisions == []

    # Two operators answer at once: one approval counts, the other is refused and changes nothing.
    first, second = await asyncio.gather(
        call("approve", incident_id, "--reason", "spare checked", "--actor", ops, "--json"),
        call("approve", node, "--reason", "me too", "--actor", other, "--json", key=key(other)),
    )
    accepted, refused = (first, second) if first.returncode == 0 else (second, first)
    approved = json_of(accepted)
    assert [d["kind"] for d in approved["decisions"]] == ["approve"]
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "bad input, nothing was changed" in refused.stderr and "awaits no approval" in refused.stderr
    [decision] = approved["decisions"]
    assert decision["verified_by"].startswith("SHA256:")

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
    for args in (
        ["describe", "gpu-nowhere"],
        ["report", "gpu-nowhere-20261130T001736Z"],
        ["deny", "gpu-nowhere", "--reason", "no"],
    ):
        result = await asyncio.to_thread(recovery, temporal_env, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert "no incident gpu-nowhere" in result.stderr
