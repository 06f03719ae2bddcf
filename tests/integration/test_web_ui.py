"""The Temporal Web UI as an operator uses it: Debian's chromium, headless, opens the dev server's
UI, filters the workflows by a node's search attribute and finds that node's incident (and not
another node's); screenshots go to test-artifacts/."""

from __future__ import annotations

import socket
import sys
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from urllib.parse import quote

import pytest_asyncio
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from contracts.models import NodeFailureAlert
from contracts.settings import Settings
from starter.alerts import raise_alert
from tests.chromium import Chromium
from worker import activities_for, build_slurm, build_worker, register_search_attributes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest_asyncio.fixture(scope="module")
async def ui_env():
    """A dev server of its own with the Web UI on (the session's has none), attributes registered."""
    port = free_port()
    async with await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        dev_server_log_level="error",
        ui=True,
        ui_port=port,
        data_converter=pydantic_data_converter,
    ) as env:
        await register_search_attributes(env.client, env.client.namespace)
        yield env, f"http://127.0.0.1:{port}"


async def test_filtering_by_node_finds_the_incident(ui_env, tmp_path):
    env, ui = ui_env
    # Application XIDs: real incidents through the real worker that leave Slurm alone.
    settings = Settings(TEMPORAL_ADDRESS="unused", task_queue=f"ui-{uuid.uuid4()}")
    nodes = [f"gpu-ui-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    wanted, other = nodes
    async with AsyncExitStack() as stack:
        worker = build_worker(
            env.client, settings.task_queue, activities_for(settings, await build_slurm(settings, stack), env.client)
        )
        await stack.enter_async_context(worker)
        for node in nodes:
            alert = NodeFailureAlert(node=node, xid=13, source="test", actor="pytest", reason="web UI test")
            handle = await raise_alert(env.client, alert, settings.task_queue, settings.policy())
            await handle.result()

    query = quote(f'RecoveryNode="{wanted}"')
    async with Chromium() as browser:
        await browser.open(f"{ui}/namespaces/default/workflows?query={query}")
        await browser.wait_for(
            f"document.body.innerText.includes('node-recovery-{wanted}')", 60, "the incident in the filtered list"
        )
        listed = await browser.evaluate("document.body.innerText")
        await browser.screenshot("web-ui-filtered-by-node.png")
        # The incident's own page: its timeline tells each activity's summary. (Classify is a local
        # activity, a marker without a summary in the UI, so the first one shown is the count.)
        await browser.open(f"{ui}/namespaces/default/workflows/node-recovery-{wanted}")
        story = await browser.wait_for(
            "document.body.innerText.includes('Count recent application XIDs') && document.body.innerText",
            60,
            "the incident's activity summaries",
        )
        await browser.screenshot("web-ui-incident.png")
    assert f"node-recovery-{other}" not in listed
    assert "Record the incident's metrics" in story
