"""No sender can grow an incident's history without bound (issue #22, "An alert flood ends a
running incident"): while an incident waits at an approval gate, 100,000 distinct kernel-log
alerts for its node go through the real hook. The incident absorbs them as counts, its history
stays small, and once approved it completes and reports what it absorbed.

Before: every alert was kept in the incident (status, report) and handed over in full, 200 to a
signal; a flood of 32,000 lines grew a history to 52 MB and Temporal terminated the incident.
Real Slurm, real dev server, the worker as the project builds it, the hook over HTTP.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import httpx
import pytest

from drills.drill import DrillOptions
from drills.localstack import wait_async
from hooks.server import build_app, listening
from hooks.settings import HookSettings
from starter.decisions import decide
from tests.hook_support import kernel_log_post, xid_line
from tests.integration.conftest import drill, recovery_worker, settings, task_queue  # noqa: F401
from workflows.node_recovery import NodeRecoveryWorkflow

pytestmark = pytest.mark.slurm

TOKEN = "flood-test-token-9d1e"
FLOOD = 100_000
PER_REQUEST = 1_000
# What the flood may add to the incident's history: the first alerts in full, then digests.
HISTORY_GROWTH_BOUND = 256 * 1024


async def history_bytes(handle) -> int:
    history = await handle.fetch_history()
    return sum(event.ByteSize() for event in history.events)


async def test_a_flood_of_100000_alerts_on_a_waiting_incident_leaves_it_small_and_it_completes(
    temporal_env, local_stack, drill, recovery_worker, settings
):  # noqa: F811
    drill.policy = drill.policy.model_copy(update={"approval_required": ["replacement"]})
    run = await drill.start(DrillOptions(xid=79))

    async def at_the_gate():
        status = await run.handle.query(NodeRecoveryWorkflow.status)
        return status if status.awaiting_approval is not None else None

    await wait_async(at_the_gate, 120, "the incident to wait at its replacement gate")
    before = await history_bytes(run.handle)

    app = build_app(settings, HookSettings(token=TOKEN, port=0), temporal_env.client)
    observed = datetime.now(timezone.utc)
    async with (
        listening(app.asgi(), app.settings) as url,
        httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=60) as http,
    ):

        async def post(first: int) -> dict:
            lines = [xid_line(79, pid=first + i) for i in range(PER_REQUEST)]
            answer = await http.post("/v1/alerts/kernel-log", json=kernel_log_post(run.node, lines, observed))
            assert answer.status_code == 200, answer.text
            return answer.json()

        answers = []
        for wave in range(0, FLOOD, 8 * PER_REQUEST):  # 8 senders at once
            answers += await asyncio.gather(
                *(post(first) for first in range(wave, min(FLOOD, wave + 8 * PER_REQUEST), PER_REQUEST))
            )
        assert sum(a["accepted"] for a in answers) == FLOOD

        async def all_counted():
            status = await run.handle.query(NodeRecoveryWorkflow.status)
            return status if status.alert_counts.get("kernel-log") == FLOOD else None

        status = await wait_async(all_counted, 120, "the incident to have counted the whole flood")

    assert status.awaiting_approval is not None  # still waiting: the flood changed nothing else
    assert len(status.alerts) <= 12
    growth = await history_bytes(run.handle) - before
    assert growth < HISTORY_GROWTH_BOUND, f"the flood grew the history by {growth} bytes"

    await decide(run.handle, "approve", local_stack.operator_signer("alice"), "flood test: spare checked")
    result = await drill.finish(run, 300)
    report = result.report
    assert report.outcome == "recovered", result.checks
    assert report.alert_counts == {"drill": 1, "kernel-log": FLOOD}
    assert report.alerts[0].source == "drill" and len(report.alerts) <= 12
