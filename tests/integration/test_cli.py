"""The `recovery` command as users and their scripts run it: a separate process, real stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

RECOVERY = str(Path(sys.executable).parent / "recovery")
REPORT_FIELDS = {
    "incident_id",
    "node",
    "xid",
    "action",
    "outcome",
    "phases",
    "replacement_seconds",
    "time_to_resume_seconds",
    "lost_steps",
    "lost_seconds",
    "resumed_step",
    "latest_complete_step",
    "skipped_checkpoints",
    "jobs",
}
JOB_FIELDS = {"job_id", "restart_count", "nodes_before", "nodes_after"}


def recovery(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RECOVERY, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--node", "gpu-[1-2]", "--xid", "79"], "invalid node name"),
        (["--node", "gpu-1;reboot", "--xid", "79"], "invalid node name"),
        (["--node", "gpu-1", "--xid", "0"], "xid"),
        (["--node", "gpu-1", "--xid", "79", "--actor", ""], "actor"),
    ],
)
def test_inject_refuses_bad_input_before_touching_anything(args, problem):
    # No Temporal server listens on this address: a refusal must come before any connection.
    result = recovery("inject", *args, env={"TEMPORAL_ADDRESS": "127.0.0.1:9"})
    assert result.returncode == 2, result.stderr
    assert "bad input, nothing was changed" in result.stderr and problem in result.stderr


def test_unreachable_temporal_is_a_clear_error():
    result = recovery("status", env={"TEMPORAL_ADDRESS": "127.0.0.1:9"})
    assert result.returncode == 3
    assert "127.0.0.1:9" in result.stderr or "connect" in result.stderr.lower()


@pytest.mark.slurm
def test_drill_json_on_a_fresh_local_stack_then_status_and_stack_down(tmp_path):
    """The README's main command, from nothing: it starts the Temporal dev server, the Slurm
    cluster and a worker, runs the XID 79 drill, and prints the report as one JSON object."""
    env = {
        "RECOVERY_STATE_DIR": str(tmp_path / "stack"),
        "RECOVERY_TASK_QUEUE": f"cli-test-{uuid.uuid4()}",
        # ports of its own: a drill's stack (7233, 8233, 16800) may be up on this machine
        "RECOVERY_LOCAL_TEMPORAL_PORT": "7633",
        "RECOVERY_LOCAL_UI_PORT": "8633",
        "RECOVERY_LOCAL_SLURM_PORT_BASE": "23800",
    }
    temporal_before = json.loads(recovery("stack", "status", env=env).stdout)["temporal"]
    try:
        drill = recovery("drill", "--json", env=env, timeout=600)
        assert drill.returncode == 0, drill.stdout + drill.stderr
        report = json.loads(drill.stdout)
        assert REPORT_FIELDS <= set(report), REPORT_FIELDS - set(report)
        assert (report["xid"], report["outcome"], report["drill"]["passed"]) == (79, "recovered", True)
        assert all({"name", "started_at", "ended_at"} <= set(p) for p in report["phases"])
        [job] = report["jobs"]
        assert JOB_FIELDS <= set(job) and job["restart_count"] == 1
        assert report["node"] in job["nodes_before"] and report["node"] not in job["nodes_after"]
        assert "phase: verify" in drill.stderr  # the live progress went to stderr, the report to stdout

        status = recovery("status", "--json", report["node"], env={**env, "TEMPORAL_ADDRESS": "127.0.0.1:7633"})
        assert status.returncode == 0, status.stderr
        incidents = {row["incident_id"]: row for row in json.loads(status.stdout) if "incident_id" in row}
        assert incidents[report["incident_id"]]["outcome"] == "recovered"
    finally:
        down = recovery("stack", "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr
    after = recovery("stack", "status", env=env)
    # Only what the drill started is stopped (a dev server that was already up stays up).
    assert json.loads(after.stdout) == {"temporal": temporal_before, "slurm": False, "worker": False}
