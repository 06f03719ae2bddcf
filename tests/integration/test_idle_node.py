"""A node fails with no job on it (issue #29, item 6): it is fenced like any other, and the hot
spares stay on standby for an incident with a job to resume; RECOVERY_SPARE_FOR_IDLE_NODE=true
spends one on capacity for the queue. Real Slurm, real dev server, the host's generation and the newest."""

from __future__ import annotations

import asyncio

import pytest

from backends.replacement import SPARE_STANDBY_REASON
from backends.slurm.client import SlurmClient
from contracts.models import IncidentReport, NodeFailureAlert
from drills.localstack import wait_async
from starter.alerts import raise_alert
from tests.integration.conftest import Fleet, fleet

pytestmark = [pytest.mark.slurm, pytest.mark.host_and_newest_slurm_generation]


async def fail_an_idle_node(f: Fleet, nth: int) -> IncidentReport:
    """XID 79 on the nth compute node (a node of its own per test: two incidents on one node within
    the same second would have the same incident id)."""
    await f.drill.reset_cluster()  # no drill job anywhere, every compute node idle
    spares = f.drill.spare_nodes
    node = [n.name for n in await f.drill.slurm.list_nodes() if n.name not in spares][nth]
    # A job cancelled by the reset may still be completing on it: it holds the node until it ends.
    await wait_async(lambda: _no_job_on(f, node), 60, f"the jobs on {node} to end")
    alert = NodeFailureAlert(node=node, xid=79, source="test", actor="pytest", reason=f"XID 79 on idle {node}")
    handle = await raise_alert(f.drill.client, alert, f.settings.task_queue, f.drill.policy)
    return await asyncio.wait_for(handle.result(), 120)


async def _no_job_on(f: Fleet, node: str) -> bool:
    return not await SlurmClient(f.drill.slurm).jobs_on_node(node)  # as the incident's find_jobs sees it


def phase_result(report: IncidentReport, name: str) -> str | None:
    return next(p.result for p in report.phases if p.name == name)


async def test_a_failed_idle_node_is_fenced_and_the_spares_stay_on_standby(temporal_env, local_stack, slurm_cluster):
    async with fleet(temporal_env, local_stack, slurm_cluster) as f:
        report = await fail_an_idle_node(f, 0)
        assert report.outcome == "recovered" and report.spare_node is None, report.outcome
        assert [a.action for a in report.actions] == ["drain_node", "down_node"]
        assert phase_result(report, "request_replacement") == (
            f"skipped: no job was on {report.node}: the hot spares stay on standby for a job to resume "
            "(spare_for_idle_node is off)"
        )
        for spare in f.drill.spare_nodes:
            node = await f.drill.slurm.get_node(spare)
            assert node.drained and node.reason.endswith(SPARE_STANDBY_REASON) and not node.comment, node


async def test_the_policy_can_spend_a_spare_on_an_idle_node(temporal_env, local_stack, slurm_cluster):
    async with fleet(temporal_env, local_stack, slurm_cluster, spare_for_idle_node=True) as f:
        report = await fail_an_idle_node(f, 1)
        assert report.outcome == "recovered" and report.spare_node in f.drill.spare_nodes, report.outcome
        assert (await f.drill.slurm.get_node(report.spare_node)).in_service
        await f.drill.reset_cluster()
