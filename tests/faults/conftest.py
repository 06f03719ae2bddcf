"""What the crash tests share: a dev server of the module's own (so that it can be killed without
touching the session's), and an incident case on it, run by the stack's worker processes."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.client import Client

from contracts.settings import Settings
from drills.localstack import LocalStack
from tests.faults.crash_support import Case
from tests.integration.conftest import stack_settings
from worker import connect, register_search_attributes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest_asyncio.fixture(scope="module")
async def crash_temporal(request: pytest.FixtureRequest) -> AsyncIterator[tuple[LocalStack, Client]]:
    """A dev server of this module on a fresh sqlite file of its own, and a client to it."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    state = Path(os.environ.get("RECOVERY_TEST_STATE_DIR", "/tmp/training-recovery-tests")) / f"crash-temporal-{module}"
    server = LocalStack(state_dir=state, temporal_port=free_port(), ui_port=free_port())
    server.stop_temporal()  # one left by an interrupted run
    shutil.rmtree(state, ignore_errors=True)
    try:
        server.start_temporal()
        # Its port opens before its frontend is healthy: a first dial then failed ("Frontend is not
        # healthy yet", CI: every crash test of a module errored); worker.connect dials again.
        client = await connect(Settings(TEMPORAL_ADDRESS=server.temporal_address))
        await register_search_attributes(client, client.namespace)
        yield server, client
    finally:
        server.stop_temporal()


@pytest_asyncio.fixture
async def case(crash_temporal, local_stack, slurm_cluster) -> AsyncIterator[Case]:
    server, client = crash_temporal
    task_queue = f"crash-{uuid.uuid4()}"
    stack = dataclasses.replace(local_stack, temporal_port=server.temporal_port)
    crash = Case.on(client, stack, slurm_cluster, stack_settings(local_stack, slurm_cluster, task_queue))
    try:
        yield crash
    finally:
        await crash.end()
