"""After a recovery the failed node comes back only once it is repaired: its fence is still the
incident's, slurmd answers and the health check hook passes. Real Slurm, real dev server."""

from __future__ import annotations

import asyncio

import pytest

from drills.drill import DrillOptions
from workflows.return_to_service import ReturnToServiceWorkflow

pytestmark = pytest.mark.slurm


async def recovered_drill(drill):
    drill.policy = drill.policy.model_copy(update={"repair_poll_seconds": 0.5})
    result = await drill.run(DrillOptions(xid=79))
    assert result.report.outcome == "recovered", result.report.outcome
    return result.report


async def test_the_failed_node_returns_to_service_once_repaired(drill, recovery_worker, temporal_env):
    report = await recovered_drill(drill)
    assert report.return_to_service == f"return-to-service-{report.incident_id}"
    handle = temporal_env.client.get_workflow_handle_for(ReturnToServiceWorkflow.run, report.return_to_service)
    # Not repaired yet: the GPU fault is still there, the node stays out of service.
    await asyncio.sleep(1.5)  # three looks at 0.5 s
    node = await drill.slurm.get_node(report.node)
    assert node.state == "down" and not node.in_service
    assert (await handle.describe()).status.name == "RUNNING"

    (drill.stack.fault_dir / report.node).unlink()  # the repair
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.returned and result.checks >= 2, result
    [action] = result.actions
    assert (action.action, action.actor) == ("return_to_service", "recovery policy")
    assert action.detail.startswith("repaired and healthy") and action.command
    assert result.outcome.startswith(("repaired and healthy", "in service, repaired and healthy"))
    assert (await drill.slurm.get_node(report.node)).in_service


async def test_a_node_fenced_by_someone_else_meanwhile_is_left_as_found(drill, recovery_worker, temporal_env):
    report = await recovered_drill(drill)
    handle = temporal_env.client.get_workflow_handle_for(ReturnToServiceWorkflow.run, report.return_to_service)
    await drill.slurm.update_node(report.node, "DRAIN", "ops: bad fan, ticket 4711")
    (drill.stack.fault_dir / report.node).unlink()
    result = await asyncio.wait_for(handle.result(), 60)
    assert not result.returned and result.outcome.startswith("left as found: fenced by someone else")
    node = await drill.slurm.get_node(report.node)
    assert node.reason == "ops: bad fan, ticket 4711" and not node.in_service


async def test_a_node_whose_slurmd_pod_went_is_left_to_slinky_to_bring_back(drill, recovery_worker, temporal_env):
    """Slurm on Kubernetes: the slurmd pod's preStop hook (Slinky) sets the node DOWN with its own
    reason when the incident evicts the pod. The watcher neither calls that someone else's fence
    (and gives up) nor resumes the node over the operator: it waits for Slinky to bring it back."""
    from contracts.kubernetes import SLURMD_PRE_STOP_REASON
    from drills.localstack import wait_async

    report = await recovered_drill(drill)
    handle = temporal_env.client.get_workflow_handle_for(ReturnToServiceWorkflow.run, report.return_to_service)
    await drill.slurm.update_node(report.node, "DOWN", SLURMD_PRE_STOP_REASON)
    (drill.stack.fault_dir / report.node).unlink()  # repaired: still not ours to resume

    async def looked_at_the_operators_reason():
        details = (await handle.describe()).raw_description.pending_activities  # none between looks
        history = [e async for e in handle.fetch_history_events()]
        return not details and sum(e.HasField("timer_started_event_attributes") for e in history) >= 3

    await wait_async(looked_at_the_operators_reason, 30, "three looks at the node")
    node = await drill.slurm.get_node(report.node)
    assert (node.state, node.reason) == ("down", SLURMD_PRE_STOP_REASON) and not node.in_service
    assert (await handle.describe()).status.name == "RUNNING"

    await drill.slurm.update_node(report.node, "RESUME", None)  # Slinky: the slurmd pod back, the node IDLE
    result = await asyncio.wait_for(handle.result(), 60)
    assert result.returned and result.actions == [], result
