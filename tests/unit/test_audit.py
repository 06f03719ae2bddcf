"""The audit sink (contracts/audit.py): one JSON line per record, appended, flushed at once; the
fields of a side effect's record and of a workflow decision."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.audit import write_audit
from contracts.audit import AuditEvent, configure_sink, record, remove_sink
from contracts.models import ActionContext

CTX = ActionContext(
    incident_id="gpu-2-20261201T000000Z", owner="recovery", actor="alertmanager", reason="hook: XID 79", xid=79
)


@pytest.fixture
def sink_file(tmp_path: Path):
    path = tmp_path / "logs" / "audit.jsonl"
    sink = configure_sink(path)
    yield path
    remove_sink(sink)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_record_is_one_json_line_flushed_at_once(sink_file: Path):
    record("drain_node", "gpu-2", "cli", CTX, "State=DRAIN")
    assert len(lines(sink_file)) == 1  # readable before anything is closed or flushed by hand
    record("requeue_hold", "job 42", "cli", CTX)
    first, second = lines(sink_file)
    assert {k: first[k] for k in ("incident", "action", "target", "path", "detail", "actor", "reason")} == {
        "incident": "gpu-2-20261201T000000Z",
        "action": "drain_node",
        "target": "gpu-2",
        "path": "cli",
        "detail": "State=DRAIN",
        "actor": "alertmanager",
        "reason": "hook: XID 79",
    }
    assert (first["node"], first["job"], first["actor_kind"], first["result"]) == ("gpu-2", None, "policy", "done")
    assert (second["node"], second["job"]) == (None, 42)
    datetime.fromisoformat(first["at"])


def test_the_sink_appends_and_is_configured_once_per_file(sink_file: Path):
    sink_file.write_text('{"earlier": "line"}\n')
    assert configure_sink(sink_file) is configure_sink(sink_file)
    record("drain_node", "gpu-2", "cli", CTX)
    assert [line.get("earlier") for line in lines(sink_file)] == ["line", None]


async def test_a_workflow_decision_is_written_by_its_local_activity(sink_file: Path):
    decision = AuditEvent(
        incident="gpu-2-20261201T000000Z",
        at=datetime(2026, 12, 1, tzinfo=timezone.utc),
        action="lease_granted",
        target="gpu-2",
        path="workflow",
        actor="alice",
        actor_kind="operator",
        reason="approved over budget",
        node="gpu-2",
        parameters={"holders": 6, "seq": 17},
        result="granted",
        event_id="fleet-budget/run-1/9",
    )
    await ActivityEnvironment().run(write_audit, decision)
    [line] = lines(sink_file)
    assert AuditEvent.model_validate(line) == decision
