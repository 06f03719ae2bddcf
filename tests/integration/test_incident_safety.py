"""The fleet safety pieces in real incidents (issue #5): the disruption budget's lease, waiting
fenced when over budget, lemon quarantine and its release, notifications and the audit log.
Real Slurm, real dev server, the worker as the project builds it (worker.activities_for)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import WorkflowHandle

from backends.replacement import SPARE_STANDBY_REASON
from contracts.audit import configure_sink, remove_sink
from contracts.budget import BudgetState, FleetBudgetInput, IncidentMark, LeaseState, Quarantine, TimelineKind
from contracts.models import NodeFailureAlert
from drills.drill import DrillOptions
from drills.localstack import REPO, wait_async
from starter.alerts import raise_alert
from starter.decisions import decide
from tests.integration.conftest import fleet
from tests.integration.test_fleet_budget import local_activities
from workflows.fleet_budget import FleetBudgetWorkflow
from workflows.node_recovery import NodeRecoveryWorkflow, incident_workflow_id
from workflows.return_to_service import ReturnToServiceWorkflow

pytestmark = pytest.mark.slurm


class WebhookReceiver(ThreadingHTTPServer):
    """The operators' chat bridge: keeps every notification POSTed to it. With `hold`, the first
    POST of that kind waits for an answer until `held` is set (a slow receiver)."""

    def __init__(self, hold: str | None = None):
        self.received: list[tuple[dict[str, str], dict]] = []
        self.holding = threading.Event()  # the held POST has arrived
        self.held = threading.Event()  # answer it now
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.received.append((dict(self.headers), body))
                if body["kind"] == hold and not receiver.holding.is_set():
                    receiver.holding.set()
                    receiver.held.wait(120)
                try:
                    self.send_response(204)
                    self.end_headers()
                except OSError:  # the sender is gone (killed while it waited)
                    pass

            def log_message(self, *_):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hooks/recovery"


async def test_a_recovery_holds_a_lease_notifies_and_audits_every_step(
    temporal_env, local_stack, slurm_cluster, tmp_path: Path
):
    receiver = WebhookReceiver()
    audit = tmp_path / "audit.jsonl"
    sink = configure_sink(audit)
    try:
        async with fleet(temporal_env, local_stack, slurm_cluster, notify_webhook_url=receiver.url) as f:
            result = await f.drill.run(DrillOptions(xid=79))
            timeline = await f.budget.query(FleetBudgetWorkflow.timeline)
            lease = await f.budget.query(FleetBudgetWorkflow.lease, result.report.incident_id)

            async def opened_and_recovered() -> bool:
                return len(receiver.received) >= 2

            await wait_async(opened_and_recovered, 60, "two notifications at the webhook")
    finally:
        remove_sink(sink)
        receiver.shutdown()
    report = result.report
    assert report.outcome == "recovered", result.checks

    # The lease: taken after the drain (fenced, nothing killed yet) and before the first
    # destructive step, for the node's real Slurm partitions, and returned at the end.
    names = [p.name for p in report.phases]
    assert names.index("drain") < names.index("find_jobs") < names.index("budget") < names.index("signal")
    assert report.phases[names.index("budget")].result.startswith("lease granted by policy")
    partitions = (await f.drill.slurm.get_node(report.node)).partitions
    assert partitions and lease is not None and lease.partitions == partitions
    assert lease.status == "released" and lease.running_jobs == 1
    mine = [e.kind for e in timeline if e.incident_id == report.incident_id]
    assert mine == [TimelineKind.FENCE_PERMITTED, TimelineKind.GRANTED, TimelineKind.RELEASED]

    # Notifications: opened and recovered, once each, never a secret-less duplicate.
    kinds = sorted(body["kind"] for _, body in receiver.received)
    assert kinds == ["incident_opened", "recovered"], receiver.received
    assert {headers["Idempotency-Key"] for headers, _ in receiver.received} == {
        f"{report.incident_id}/incident_opened",
        f"{report.incident_id}/recovered",
    }

    # The audit log: every side effect and decision as one JSON line, with who and why.
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    incident_lines = [line for line in lines if line.get("incident") == report.incident_id]
    actions = [line["action"] for line in incident_lines]
    for expected in (
        "drain_node",
        "signal_job",
        "requeue_hold",
        "down_node",
        "lease_granted",
        "lease_released",
        "incident_outcome",
    ):
        assert expected in actions, (expected, actions)
    assert all(line["actor"] and line["reason"] and line["at"] for line in incident_lines)
    [outcome] = [line for line in incident_lines if line["action"] == "incident_outcome"]
    assert (outcome["result"], outcome["actor_kind"]) == ("recovered", "policy")


async def status_of(handle: WorkflowHandle):
    return await handle.query(NodeRecoveryWorkflow.status)


async def test_over_budget_an_incident_waits_drained_and_an_operator_decides(temporal_env, local_stack, slurm_cluster):
    """K = 1: while one incident holds the lease (parked at its replacement approval), a second
    failure is drained and waits with nothing killed; an operator approves it over budget, and
    a third is denied and stays drained. Each gate is notified."""
    receiver = WebhookReceiver()
    # Three nodes of the 5-node cluster fenced at once: past the default breaker (half the fleet), which
    # this test is not about.
    async with fleet(
        temporal_env,
        local_stack,
        slurm_cluster,
        budget_max_nodes=1,
        approval_required=["replacement"],
        notify_webhook_url=receiver.url,
        breaker_fleet_fraction=1.0,
        breaker_partition_fraction=1.0,
    ) as f:
        holder = await f.drill.start(DrillOptions(xid=79))

        async def holder_at_its_gate():
            s = await status_of(holder.handle)
            return s if s.awaiting_approval is not None else None

        await wait_async(holder_at_its_gate, 120, "the first incident to hold its lease at the replacement gate")
        spares = f.drill.spare_nodes
        job = await f.drill.slurm.get_job(holder.job_id)
        others = [
            n.name
            for n in await f.drill.slurm.list_nodes()
            if n.name not in spares and n.name != holder.node and n.in_service
        ]
        second_node, third_node = others[:2]
        # No gate and no spare for these two: the one spare stays for the first incident.
        policy = f.drill.policy.model_copy(update={"approval_required": [], "spare_nodes": []})

        async def over_budget(node: str) -> WorkflowHandle:
            alert = NodeFailureAlert(node=node, xid=79, source="test", actor="pytest", reason=f"storm on {node}")
            handle = await raise_alert(temporal_env.client, alert, f.settings.task_queue, policy)

            async def waiting_at_the_budget():
                s = await status_of(handle)
                return s if s.awaiting_approval is not None and s.awaiting_approval.gate == "budget" else None

            status = await wait_async(waiting_at_the_budget, 60, f"{node} to wait over budget")
            assert status.awaiting_approval.deadline_at is None
            slurm_node = await f.drill.slurm.get_node(node)
            assert slurm_node.drained and slurm_node.state != "down", slurm_node
            assert [a.action for a in status.actions] == ["drain_node"]
            return handle

        second = await over_budget(second_node)
        await decide(second, "approve", local_stack.operator_signer("alice"), "INC-7: this rack must come back first")
        second_report = await asyncio.wait_for(second.result(), 120)
        lease: LeaseState = await f.budget.query(FleetBudgetWorkflow.lease, second_report.incident_id)
        assert lease.granted_by == "alice" and lease.over_budget
        assert any(a.action == "down_node" for a in second_report.actions)

        third = await over_budget(third_node)
        await decide(third, "deny", local_stack.operator_signer("bob"), "wait for the window")
        third_report = await asyncio.wait_for(third.result(), 60)
        assert third_report.outcome.startswith("denied: over budget (bob: wait for the window)")
        assert [a.action for a in third_report.actions] == ["drain_node"]
        third_slurm = await f.drill.slurm.get_node(third_node)
        assert third_slurm.drained and third_slurm.state != "down"

        await decide(holder.handle, "approve", local_stack.operator_signer("carol"), "ok")
        result = await f.drill.finish(holder, 180)
        assert result.report.outcome == "recovered", result.checks
        assert job.job_id == result.job_id

        async def every_gate_notified() -> list:
            asked = [body for _, body in receiver.received if body["kind"] == "approval_needed"]
            return asked if len(asked) >= 3 else None

        asked = await wait_async(every_gate_notified, 30, "an approval_needed notification for each gate")
    receiver.shutdown()
    assert sorted((body["node"], body["summary"].split(":")[0]) for body in asked) == sorted(
        [(holder.node, "replacement"), (second_node, "budget"), (third_node, "budget")]
    )


async def test_a_lemon_is_quarantined_and_returns_to_service_only_after_an_operator_releases_it(
    temporal_env, local_stack, slurm_cluster
):
    async with fleet(temporal_env, local_stack, slurm_cluster, lemon_incidents=2, repair_poll_seconds=0.5) as f:
        first = await f.drill.run(DrillOptions(xid=79))
        node = first.report.node
        second = await f.drill.run(DrillOptions(xid=79, node=node))
        assert second.report.outcome == "recovered", second.checks
        budget_phase = next(p for p in second.report.phases if p.name == "budget")
        assert "quarantined lemon" in budget_phase.result
        quarantine = await f.budget.query(FleetBudgetWorkflow.quarantine, node)
        assert quarantine.quarantined and len(quarantine.incidents_in_window) == 2

        watcher = temporal_env.client.get_workflow_handle_for(
            ReturnToServiceWorkflow.run, second.report.return_to_service
        )
        (f.drill.stack.fault_dir / node).unlink(missing_ok=True)  # repaired: only the quarantine holds it

        async def held_as_a_lemon() -> bool:
            metadata = await watcher.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
            return "quarantined as a lemon" in metadata.current_details

        await wait_async(held_as_a_lemon, 30, "the watcher to hold the repaired node as a lemon")
        assert not (await f.drill.slurm.get_node(node)).in_service

        local_stack.ensure_operator_key("dana")
        env = {
            **os.environ,
            "TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
            "RECOVERY_TASK_QUEUE": f.settings.task_queue,
            "RECOVERY_OPERATOR_KEY_FILE": str(local_stack.operator_key_file_of("dana")),
        }

        async def recovery(*args: str) -> tuple[int, str, str]:
            # Not subprocess.run: this process's worker must keep serving the budget meanwhile.
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "cli.app",
                *args,
                env=env,
                cwd=REPO,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            return proc.returncode, out.decode(), err.decode()

        code, out, err = await recovery("budget", "--json")
        assert code == 0, err
        assert [q["node"] for q in json.loads(out)["quarantined"]] == [node]
        code, out, err = await recovery(
            "release-quarantine", node, "--reason", "PSU replaced, RMA 991", "--actor", "dana", "--json"
        )
        assert code == 0, err
        assert json.loads(out)["quarantined"] is False
        code, _, err = await recovery("release-quarantine", node, "--reason", "twice", "--actor", "dana")
        assert code == 2 and "not quarantined" in err, err

        result = await asyncio.wait_for(watcher.result(), 60)
        assert result.returned, result
        assert (await f.drill.slurm.get_node(node)).in_service
        timeline = await f.budget.query(FleetBudgetWorkflow.timeline)
        [release] = [e for e in timeline if e.kind == TimelineKind.QUARANTINE_RELEASED]
        assert release.actor == "dana" and "PSU replaced, RMA 991" in release.detail, release


async def test_a_quarantined_spare_is_passed_over_with_the_lemons_the_lease_answer_carries(
    temporal_env, local_stack, slurm_cluster
):
    async with fleet(temporal_env, local_stack, slurm_cluster) as f:
        [lemon] = f.drill.spare_nodes
        # The budget already holds the only spare as a lemon, as a budget that quarantined it and
        # continued as new would.
        policy = f.settings.budget_policy()
        marks = [
            IncidentMark(incident_id=f"{lemon}-2026113{n}T000000Z", at=datetime.now(timezone.utc))
            for n in range(policy.lemon_incidents)
        ]
        state = BudgetState(
            policy=policy, quarantines={lemon: Quarantine(node=lemon, since=marks[-1].at, incidents=marks)}
        )
        await temporal_env.client.start_workflow(
            FleetBudgetWorkflow.run,
            FleetBudgetInput(policy=policy, state=state),
            id=f.budget.id,
            task_queue=f.settings.task_queue,
        )

        result = await f.drill.run(DrillOptions(xid=79))
        report = result.report
        assert report.outcome.startswith("no_replacement"), report.outcome  # and every job verified
        assert report.spare_node is None
        replacement = next(p for p in report.phases if p.name == "request_replacement")
        assert f"quarantined spares passed over: {lemon}" in replacement.result, replacement.result
        spare = await f.drill.slurm.get_node(lemon)
        assert spare.drained and spare.reason.endswith(SPARE_STANDBY_REASON), spare  # never resumed

        # From the lease's answer: the incident asked the budget nothing else (a query per
        # incident overflows the budget's query buffer in a storm).
        incident = temporal_env.client.get_workflow_handle(incident_workflow_id(report.node))
        history = [event async for event in incident.fetch_history_events()]
        activities = [
            event.activity_task_scheduled_event_attributes.activity_type.name
            for event in history
            if event.HasField("activity_task_scheduled_event_attributes")
        ]
        activities += local_activities(history)
        assert "request_lease" in activities and "quarantined_among" not in activities, activities

        # The failed node was no lemon when its incident took the lease: its watcher looks at it
        # without asking the budget (a thousand watchers asking at once hold the budget up).
        watcher = temporal_env.client.get_workflow_handle(report.return_to_service)

        async def watcher_activities() -> list[str] | None:
            names = [
                event.activity_task_scheduled_event_attributes.activity_type.name
                async for event in watcher.fetch_history_events()
                if event.HasField("activity_task_scheduled_event_attributes")
            ]
            return names if "return_to_service" in names else None

        looks = await wait_async(watcher_activities, 30, "the watcher's first look at the node")
        assert "check_quarantine" not in looks, looks
