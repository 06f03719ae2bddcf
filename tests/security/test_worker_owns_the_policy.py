"""The worker, not the starter, owns an incident's policy (issue #22, "Verified operators, policy
owned by the worker"). Before: the policy was the starter's workflow input, so anyone who could
start an incident chose its approval gates, its spares and whether it was a dry run. Now the
incident reads the worker's policy once, at its start, and its history records it; a starter can
only make it safer. Real Slurm, real dev server, a worker that does not take the starter's policy."""

from __future__ import annotations

import json

import pytest

from contracts.models import RecoveryPolicy
from drills.drill import DrillOptions
from drills.localstack import wait_async
from starter.decisions import decide
from tests.integration.conftest import fleet, status_if_answered

pytestmark = pytest.mark.slurm


async def recorded_policy(handle) -> RecoveryPolicy:
    """The policy the incident's history recorded: the result of its first local activity."""
    async for event in handle.fetch_history_events():
        marker = event.marker_recorded_event_attributes
        if marker.marker_name == "core_local_activity":
            assert json.loads(marker.details["data"].payloads[0].data)["activity_type"] == "incident_policy"
            return RecoveryPolicy.model_validate_json(marker.details["result"].payloads[0].data)
    raise AssertionError("no local activity in the incident's history")


async def test_a_starter_cannot_take_a_gate_away_but_can_ask_for_a_dry_run(temporal_env, local_stack, slurm_cluster):
    async with fleet(
        temporal_env, local_stack, slurm_cluster, accept_starter_policy=False, approval_required=["replacement"]
    ) as f:
        # The starter asks for no gate, no spares and no grace: the worker's gate stands.
        f.drill.policy = f.drill.policy.model_copy(
            update={"approval_required": [], "spare_nodes": [], "degrading_grace_seconds": 0.0}
        )
        run = await f.drill.start(DrillOptions(xid=79))

        async def at_the_gate():
            status = await status_if_answered(run.handle)
            return status if status is not None and status.awaiting_approval is not None else None

        status = await wait_async(at_the_gate, 120, "the incident to wait at the worker's replacement gate")
        assert status.awaiting_approval.gate == "replacement"
        policy = await recorded_policy(run.handle)
        assert policy.approval_required == ["replacement"] and policy.spare_nodes == f.drill.spare_nodes
        assert policy.degrading_grace_seconds == f.settings.degrading_grace_seconds
        await decide(run.handle, "deny", local_stack.operator_signer(), "the starter's policy did not count")
        report = await run.handle.result()
        assert report.outcome.startswith("no_replacement: denied by local-operator"), report.outcome

        # A dry run asked for by the starter is one: safer is allowed.
        await f.drill.reset_cluster()
        dry = await f.drill.start(DrillOptions(xid=79, dry_run=True))
        result = await f.drill.finish(dry, 180)
        assert result.report.outcome.startswith("dry_run: "), result.report.outcome
        assert (await recorded_policy(dry.handle)).dry_run
