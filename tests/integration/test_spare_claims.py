"""Two incidents on two workers reach for the one hot spare at the same moment: exactly one takes
it (workflows/spare_claim.py), the other says there is none, and Slurm shows one claim. Real
Slurm, real dev server; each worker with its own activities, as two worker processes have.

So that the two claims overlap for certain, every write to the spare is held 1 s on its way to
slurmrestd (a fault proxy): without the claim lock both incidents read the spare on standby, both
write their claim and both take it. Slurm 24.11 only: 22.05's slurmrestd (v0.0.38) cannot write
a node, so its writes go through scontrol, past the proxy."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from contextlib import AsyncExitStack

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from activities.xid_policy import XidPolicyTable
from backends.replacement import HotSparePool
from contracts.models import ActionContext, NodeFailureAlert
from drills.drill import Drill
from starter.alerts import raise_alert
from tests.conftest import NEWEST_GENERATION
from tests.faults.proxy import FaultProxy
from tests.integration.conftest import stack_settings
from worker import activities_for, build_slurm, build_worker

pytestmark = pytest.mark.slurm

FAILED = ["gpu-3", "gpu-4"]


# REST node updates (from 24.11 on): the delay is injected at slurmrestd
@pytest.mark.parametrize("local_stack", [NEWEST_GENERATION], indirect=True)
async def test_two_incidents_on_two_workers_never_both_take_the_one_spare(temporal_env, local_stack, slurm_cluster):
    task_queue = f"spare-claims-{uuid.uuid4()}"
    # The budget lets both incidents under remediation at once (by default one node of the partition).
    # Neither failed node runs a job: the spare goes to an idle node's incident only when the policy says so.
    settings = stack_settings(
        local_stack, slurm_cluster, task_queue, budget_partition_fraction=1.0, spare_for_idle_node=True
    )
    policy = settings.policy()
    (spare,) = policy.spare_nodes
    async with AsyncExitStack() as resources:
        proxy = await resources.enter_async_context(FaultProxy(settings.slurmrestd_url))
        held = proxy.inject("POST", rf"/node/{spare}$", delay=1.0, times=None)
        slurm = await build_slurm(settings.model_copy(update={"slurmrestd_url": proxy.url}), resources)
        drill = Drill(
            temporal_env.client,
            dataclasses.replace(local_stack, task_queue=task_queue),
            slurm_cluster,
            policy,
            XidPolicyTable(settings.xid_policy_file),
        )
        await drill.reset_cluster()
        resources.push_async_callback(drill.reset_cluster)
        for _ in range(2):  # two workers, each with a connection and a HotSparePool (and its lock) of its own
            client = await Client.connect(
                temporal_env.client.service_client.config.target_host,
                namespace=temporal_env.client.namespace,
                data_converter=pydantic_data_converter,
            )
            # One activity at a time each: while one worker's claim is held, the other claim can
            # only run on the other worker.
            await resources.enter_async_context(
                build_worker(client, task_queue, activities_for(settings, slurm, client), max_concurrent_activities=1)
            )
        handles = await asyncio.gather(
            *(
                raise_alert(
                    temporal_env.client,
                    NodeFailureAlert(node=node, xid=79, source="test", actor="pytest", reason="two nodes lost at once"),
                    task_queue,
                    policy,
                )
                for node in FAILED
            )
        )
        reports = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 300)
        claimed = (await drill.slurm.get_node(spare)).comment

    winners = [r for r in reports if r.spare_node == spare]
    assert len(winners) == 1, [(r.node, r.outcome, r.spare_node) for r in reports]
    (winner,) = winners
    (loser,) = [r for r in reports if r is not winner]
    assert winner.outcome == "recovered", winner.outcome
    assert loser.outcome.startswith("no_replacement: no hot spare on standby"), loser.outcome
    ctx = ActionContext(incident_id=winner.incident_id, owner=policy.owner, actor="", reason="", xid=79)
    assert claimed == HotSparePool.claim_comment(ctx)
    resumed = [(r.node, a.target) for r in reports for a in r.actions if a.action == "resume_spare" and a.executed]
    assert resumed == [(winner.node, spare)], resumed
    assert held.hits >= 2  # the claim and the RESUME went through the proxy, held
