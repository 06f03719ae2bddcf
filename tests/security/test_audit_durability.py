"""An audit line is on disk when its write returns, or the write fails and Temporal retries it
(issue #22, "Safe to switch on"): never a line lost in silence. One write and one fsync per
batch, through a file opened for that batch, so that logrotate's move-and-create works; a torn
last line (a crash in a write) does not swallow the next line.

Before: the sink was a logging.FileHandler, which prints an error to stderr and goes on (a full
disk lost every line while the activities succeeded), kept writing to the file logrotate had
moved away, flushed without fsync, and appended the next line to a torn one.
The real local activities (in a real workflow on the time-skipping server where retries matter).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.testing import ActivityEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

import contracts.audit
from activities.audit import write_audit, write_audit_lines
from contracts.audit import AuditEvent, configure_sink, record, remove_sink
from contracts.models import ActionContext
from workflows.audit_trail import AuditTrail


def event(n: int) -> AuditEvent:
    return AuditEvent(
        incident="gpu-2-20261201T000000Z",
        at=datetime(2026, 12, 1, tzinfo=timezone.utc),
        action="lease_granted",
        target="gpu-2",
        path="workflow",
        actor="policy",
        actor_kind="policy",
        reason="within budget",
        result="granted",
        event_id=f"fleet-budget/run-1/{n}",
    )


@pytest.fixture
def sink_at():
    sinks = []

    def configure(path: Path) -> Path:
        sinks.append(configure_sink(path))
        return path

    yield configure
    for sink in sinks:
        remove_sink(sink)


def event_ids(path: Path) -> list[str]:
    return [json.loads(line)["event_id"] for line in path.read_text().splitlines()]


def counted(calls: list[str], name: str, real):
    def call(*args):
        calls.append(name)
        return real(*args)

    return call


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
async def test_a_full_disk_fails_the_write(sink_at):
    sink_at(Path("/dev/full"))  # every write: ENOSPC
    with pytest.raises(OSError, match="No space left on device"):
        await ActivityEnvironment().run(write_audit, event(1))
    with pytest.raises(OSError, match="No space left on device"):
        record(
            "drain_node",
            "gpu-2",
            "cli",
            ActionContext(
                incident_id="gpu-2-20261201T000000Z", owner="recovery", actor="alertmanager", reason="XID 79", xid=79
            ),
        )


async def test_a_batch_is_one_open_one_write_and_one_fsync(sink_at, tmp_path, monkeypatch):
    path = sink_at(tmp_path / "audit.jsonl")
    calls: list[str] = []
    for name in ("open", "write", "fsync"):
        monkeypatch.setattr(contracts.audit.os, name, counted(calls, name, getattr(os, name)))
    await ActivityEnvironment().run(write_audit_lines, [event(n) for n in range(1, 51)])
    assert calls == ["open", "write", "fsync"]
    assert event_ids(path) == [f"fleet-budget/run-1/{n}" for n in range(1, 51)]
    assert path.stat().st_mode & 0o777 == 0o640


async def test_logrotate_move_and_create_needs_no_signal(sink_at, tmp_path):
    path = sink_at(tmp_path / "audit.jsonl")
    await ActivityEnvironment().run(write_audit, event(1))
    path.rename(tmp_path / "audit.jsonl.1")  # logrotate: move, then (create) an empty file
    path.touch()
    await ActivityEnvironment().run(write_audit, event(2))
    path.rename(tmp_path / "audit.jsonl.2")  # or no create: the next batch creates it
    await ActivityEnvironment().run(write_audit, event(3))
    assert [event_ids(tmp_path / name) for name in ("audit.jsonl.1", "audit.jsonl.2", "audit.jsonl")] == [
        ["fleet-budget/run-1/1"],
        ["fleet-budget/run-1/2"],
        ["fleet-budget/run-1/3"],
    ]


async def test_a_torn_last_line_does_not_swallow_the_next(sink_at, tmp_path):
    path = sink_at(tmp_path / "audit.jsonl")
    path.write_text(event(1).model_dump_json() + "\n" + event(2).model_dump_json()[:40])  # a crash in a write
    await ActivityEnvironment().run(write_audit_lines, [event(3), event(4)])
    first, torn, third, fourth = path.read_text().splitlines()
    assert torn == event(2).model_dump_json()[:40]
    assert [json.loads(line)["event_id"] for line in (first, third, fourth)] == [
        "fleet-budget/run-1/1",
        "fleet-budget/run-1/3",
        "fleet-budget/run-1/4",
    ]


@workflow.defn(sandboxed=False)
class DecidesOnce:
    @workflow.run
    async def run(self) -> None:
        trail = AuditTrail()
        trail.decision(
            "lease_granted", incident="gpu-2-20261201T000000Z", node="gpu-2", reason="within budget", result="granted"
        )
        await trail.flush()


async def test_an_unwritable_log_is_retried_until_the_line_is_written(
    time_skipping_env, sink_at, tmp_path, monkeypatch
):
    """The directory is replaced by a file (no line can be opened), and back after three attempts."""
    directory = tmp_path / "logs"
    directory.mkdir()
    path = sink_at(directory / "audit.jsonl")
    directory.rename(tmp_path / "logs.away")
    directory.write_text("not a directory")
    attempts: list[str] = []
    monkeypatch.setattr(
        contracts.audit.AuditFile, "append", counted(attempts, "append", contracts.audit.AuditFile.append)
    )
    client, task_queue = time_skipping_env.client, f"audit-{uuid.uuid4()}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[DecidesOnce],
        activities=[write_audit],
        workflow_runner=UnsandboxedWorkflowRunner(),
    ):
        handle = await client.start_workflow(DecidesOnce.run, id=f"audit-{uuid.uuid4()}", task_queue=task_queue)
        async with asyncio.timeout(30):
            while len(attempts) < 3:  # the local activity fails, and is retried 200 ms later, then 400 ms
                await asyncio.sleep(0.05)
        directory.unlink()
        (tmp_path / "logs.away").rename(directory)
        await handle.result()
    assert len(attempts) > 3
    [written] = event_ids(path)
    assert written.startswith(f"{handle.id}/")
