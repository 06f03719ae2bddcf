"""A bad environment stops the worker and every `recovery` command with one line on stderr and
exit code 2 (issue #22, "Safe to switch on"): never a traceback and exit 1, never a start with a
secret that is set to nothing.

Before: RECOVERY_APPROVAL_REQUIRED=requeue (not JSON) raised pydantic-settings' SettingsError
through every command, the worker exited 1 on any bad setting, and an empty SLURMRESTD_TOKEN or
RECOVERY_TEMPORAL_API_KEY (as the Kubernetes base shipped them) was taken as a secret.
Each case runs the real entry point in a process of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.app import app

ROOT = Path(__file__).resolve().parents[2]

# Each command with the arguments it needs to get as far as reading the configuration.
COMMAND_ARGS = {
    "drill": [],
    "inject": ["--node", "gpu-1", "--xid", "79"],
    "status": [],
    "list": [],
    "describe": ["gpu-1"],
    "report": ["gpu-1"],
    "approve": ["gpu-1", "--reason", "r"],
    "deny": ["gpu-1", "--reason", "r"],
    "abort": ["gpu-1", "--reason", "r"],
    "release-quarantine": ["gpu-1", "--reason", "r"],
    "reset-breaker": ["--reason", "r"],
    "budget": [],
    "config": [],
    "stack": ["status"],
    "hooks": [],
}

BAD_ENVIRONMENTS = {
    "not JSON": {"RECOVERY_APPROVAL_REQUIRED": "requeue"},
    "not a gate": {"RECOVERY_APPROVAL_REQUIRED": '["reboot"]'},
    "empty Slurm token": {"SLURMRESTD_TOKEN": ""},
    "blank Temporal API key": {"RECOVERY_TEMPORAL_API_KEY": "  "},
    "blank webhook bearer token": {
        "RECOVERY_NOTIFY_WEBHOOK_URL": "https://hooks.example.net/x",
        "RECOVERY_NOTIFY_BEARER_TOKEN": " \t",
    },
    "empty webhook HMAC secret": {
        "RECOVERY_NOTIFY_WEBHOOK_URL": "https://hooks.example.net/x",
        "RECOVERY_NOTIFY_HMAC_SECRET": "",
    },
    "empty OTLP headers": {"OTEL_EXPORTER_OTLP_HEADERS": ""},
    "blank webhook URL": {"RECOVERY_NOTIFY_WEBHOOK_URL": "  "},
    "empty Slurm token file": {"SLURMRESTD_TOKEN_FILE": "/dev/null"},
    "empty operator list": {"RECOVERY_OPERATOR_KEYS_FILE": "/dev/null"},
    "operator list without keys": {"RECOVERY_OPERATOR_KEYS_FILE": str(ROOT / "pyproject.toml")},
    "no operator list there": {"RECOVERY_OPERATOR_KEYS_FILE": "/nonexistent/operators.list"},
}


def _run(argv: list[str], environment: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RECOVERY_", "SLURMRESTD_", "OTEL_"))}
    # Nothing may be started: a command that got past its configuration would fail to reach this.
    env |= {
        "PYTHONPATH": str(ROOT),
        "TEMPORAL_ADDRESS": "127.0.0.1:1",
        "RECOVERY_STATE_DIR": str(tmp_path),
        **environment,
    }
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def _refused_in_one_line(done: subprocess.CompletedProcess[str], variable: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert variable in line


def test_every_command_is_listed():
    names = {command.name or command.callback.__name__ for command in app.registered_commands}
    assert names == set(COMMAND_ARGS)


@pytest.mark.parametrize("command", sorted(COMMAND_ARGS))
def test_every_command_refuses_an_invalid_approval_gate(command, tmp_path):
    done = _run(["-m", "cli.app", command, *COMMAND_ARGS[command]], BAD_ENVIRONMENTS["not JSON"], tmp_path)
    _refused_in_one_line(done, "RECOVERY_APPROVAL_REQUIRED")


@pytest.mark.parametrize("case", sorted(BAD_ENVIRONMENTS))
def test_the_worker_and_recovery_config_refuse_a_bad_environment(case, tmp_path):
    environment = BAD_ENVIRONMENTS[case]
    variable = next(name for name, value in environment.items() if not value.startswith("https://"))
    for argv in ([str(ROOT / "worker.py")], ["-m", "cli.app", "config"]):
        _refused_in_one_line(_run(argv, environment, tmp_path), variable)


def test_the_worker_refuses_an_empty_kubernetes_token(tmp_path):
    done = _run([str(ROOT / "worker.py")], {"RECOVERY_K8S_ENABLED": "true", "RECOVERY_K8S_HTTP_TOKEN": ""}, tmp_path)
    _refused_in_one_line(done, "RECOVERY_K8S_HTTP_TOKEN")
