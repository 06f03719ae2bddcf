"""Fixtures on the real stack: the session's Slurm cluster and dev server, a worker per test on a
task queue of its own, and a Drill that drives the reference training job."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from datetime import timedelta

import pytest_asyncio
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from activities.xid_policy import XidPolicyTable
from contracts.models import IncidentStatus
from contracts.settings import Settings
from drills.drill import Drill
from tests.replay.replaying import REPLAYABLE_PREFIX, assert_every_run_replays
from worker import activities_for, build_slurm, build_worker, serving
from workflows.fleet_budget import FleetBudgetWorkflow, fleet_budget_workflow_id
from workflows.node_recovery import NodeRecoveryWorkflow


async def status_if_answered(handle: WorkflowHandle) -> IncidentStatus | None:
    """The incident's status, or None when no answer comes within 10 s, for a poll with a deadline of
    its own: a query waits for the run's workflow task in flight, and on a loaded 2-core CI host
    one call outran the client's own 30 s deadline ('Timeout expired')."""
    try:
        return await handle.query(NodeRecoveryWorkflow.status, rpc_timeout=timedelta(seconds=10))
    except RPCError as error:
        if error.status in (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED):
            return None
        raise


def stack_settings(local_stack, cluster: dict[str, str], task_queue: str, **overrides) -> Settings:
    local_stack.ensure_operator_key()
    return Settings(
        TEMPORAL_ADDRESS="unused",
        SLURM_CONF=cluster["SLURM_CONF"],
        SLURM_BIN_DIR=cluster.get("SLURM_BIN_DIR", ""),
        SLURMRESTD_URL=cluster["SLURMRESTD_URL"],
        SLURMRESTD_USER=cluster["SLURMRESTD_USER"],
        SLURMRESTD_TOKEN_FILE=cluster["SLURMRESTD_TOKEN_FILE"],
        task_queue=task_queue,
        spare_nodes=cluster["SLURM_SPARE_NODES"],
        health_check=local_stack.health_check,
        verify_deadline_seconds=120,
        spare_wait_seconds=60,
        operator_keys_file=local_stack.operator_keys_file,
        # As the local stack's worker: the tests set a policy per incident (test_worker_owns_the_policy.py
        # is about a worker that does not take it).
        **{"accept_starter_policy": True, **overrides},
    )


@dataclasses.dataclass
class Fleet:
    settings: Settings
    drill: Drill

    @property
    def budget(self) -> WorkflowHandle:
        return self.drill.client.get_workflow_handle_for(
            FleetBudgetWorkflow.run, fleet_budget_workflow_id(self.settings.task_queue)
        )


@asynccontextmanager
async def fleet(temporal_env, local_stack, slurm_cluster, **overrides) -> AsyncIterator[Fleet]:
    """A worker built from these settings on a task queue of its own, and a drill that uses it.
    After the test, every run on that queue replays on the current code, as a worker that lost
    its cache would replay it (the test polls the incidents' status as they start: a query then
    once split an incident's first workflow task so that it did not replay)."""
    task_queue = f"{REPLAYABLE_PREFIX}safety-{uuid.uuid4()}"
    settings = stack_settings(local_stack, slurm_cluster, task_queue, **overrides)
    async with AsyncExitStack() as stack:
        slurm = await build_slurm(settings, stack)
        async with build_worker(temporal_env.client, task_queue, activities_for(settings, slurm, temporal_env.client)):
            drill = Drill(
                temporal_env.client,
                dataclasses.replace(local_stack, task_queue=task_queue),
                slurm_cluster,
                settings.policy(),
                XidPolicyTable(settings.xid_policy_file),
                say=print,
            )
            yield Fleet(settings, drill)
    assert await assert_every_run_replays(temporal_env.client, task_queue) > 0


@contextmanager
def cluster_of_its_own(local_stack, name: str, nodes: int, port_offset: int, spares: int = 0) -> Iterator[tuple]:
    """A cluster with `nodes` compute nodes and `spares` hot spares, beside the session's
    (`port_offset` above its ports: a cluster takes 17 to 100 + nodes + spares above its base). It
    starts from a clean state: slurmctld restores saved node states, so the drains of an earlier
    run would otherwise greet this one as "drained by someone else"."""
    stack = dataclasses.replace(
        local_stack,
        state_dir=local_stack.state_dir / name,
        slurm_nodes=nodes,
        slurm_spares=spares,
        slurm_port_base=local_stack.slurm_port_base + port_offset,
    )
    stack.stop_slurm()
    cluster = stack.start_slurm(clean=True)
    try:
        yield stack, cluster
    finally:
        stack.stop_slurm()


@pytest_asyncio.fixture
async def task_queue() -> str:
    return f"recovery-test-{uuid.uuid4()}"


@pytest_asyncio.fixture
async def settings(local_stack, slurm_cluster, task_queue) -> Settings:
    return stack_settings(local_stack, slurm_cluster, task_queue)


@pytest_asyncio.fixture
async def recovery_worker(temporal_env, settings):
    """An in-process worker on the test's own task queue, with the real Slurm backends."""
    async with AsyncExitStack() as stack:
        slurm = await build_slurm(settings, stack)
        async with serving(temporal_env.client, settings, activities_for(settings, slurm, temporal_env.client)):
            yield slurm


@pytest_asyncio.fixture
async def drill(temporal_env, local_stack, slurm_cluster, settings) -> Drill:
    stack = dataclasses.replace(local_stack, task_queue=settings.task_queue)
    return Drill(
        temporal_env.client,
        stack,
        slurm_cluster,
        settings.policy(),
        XidPolicyTable(settings.xid_policy_file),
        say=print,
    )
