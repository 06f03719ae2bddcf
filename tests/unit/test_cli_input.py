"""The `recovery` command's input: what it refuses (exit 2) before touching anything, and the
visibility queries it builds. No Temporal server listens on 127.0.0.1:9: a refusal must come
before any connection (a connection attempt would exit 3)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.app import BadInput, _check_torch_drill, incident_query, parse_incident_ref
from drills.localstack import DEBIAN_RELEASE_OF_GENERATION, host_slurm_generation

RECOVERY = str(Path(sys.executable).parent / "recovery")
NO_SERVER = {"TEMPORAL_ADDRESS": "127.0.0.1:9"}


def recovery(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RECOVERY, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **NO_SERVER, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    "args, problem",
    [
        (["describe", "gpu-[1-2]"], "invalid node name"),
        (["report", "gpu-1;reboot"], "invalid node name"),
        (["approve", "gpu-1", "--reason", ""], "reason"),
        (["deny", "gpu-1", "--reason", "no", "--actor", ""], "actor"),
        (["abort", "gpu-1"], "Missing option '--reason'"),
        (["list", "--outcome", "recovered' OR WorkflowId != '"], "use letters, digits"),
        (["list", "--node", "gpu-1 OR 1=1"], "invalid node name"),
        (["stack", "sideways"], "'sideways' is not one of"),
        (["drill", "--slurm-version", "23.02"], "'23.02' is not one of"),
        (["drill", "--k8s-scaling-mode", "DaemonSet"], "--k8s-scaling-mode applies to a drill on Slurm on Kubernetes"),
        (["drill", "--k8s", "--k8s-scaling-mode", "ReplicaSet"], "'ReplicaSet' is not one"),
        (["drill", "--trainer", "pytorch"], "'pytorch' is not one of"),
        (["drill", "--scenario", "all", "--trainer", "torch"], "--trainer, --corrupt-latest-checkpoint"),
    ],
)
def test_bad_input_is_refused_with_exit_2_before_any_connection(args, problem):
    result = recovery(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert problem in " ".join((result.stderr + result.stdout).split())


def test_a_bad_configuration_is_refused_with_exit_2(tmp_path):
    config = tmp_path / "recovery.env"
    config.write_text("RECOVERY_VERIFY_DEADLINE_SECONDS=later\n")
    result = recovery("list", env={"RECOVERY_CONFIG_FILE": str(config)})
    assert result.returncode == 2
    assert "RECOVERY_VERIFY_DEADLINE_SECONDS: Input should be a valid number" in result.stderr


def test_config_json_masks_secrets_and_names_sources():
    result = recovery("config", "--json", env={"SLURMRESTD_TOKEN": "eyJ-secret"})
    assert result.returncode == 0, result.stderr
    entries = {e["variable"]: e for e in json.loads(result.stdout)}
    assert entries["SLURMRESTD_TOKEN"] == {"variable": "SLURMRESTD_TOKEN", "value": "********", "source": "environment"}
    assert entries["TEMPORAL_ADDRESS"]["value"] == "127.0.0.1:9"
    assert "eyJ-secret" not in result.stdout


def test_an_unreachable_temporal_is_exit_3_for_the_new_commands():
    for args in (["list"], ["describe", "gpu-1"], ["approve", "gpu-1", "--reason", "go"]):
        result = recovery(*args)
        assert result.returncode == 3, (args, result.stderr)
        assert "127.0.0.1:9" in result.stderr


def test_incident_references():
    assert parse_incident_ref("gpu-2") == ("gpu-2", None)
    assert parse_incident_ref("gpu-2-20261130T001736Z") == ("gpu-2", "gpu-2-20261130T001736Z")
    with pytest.raises(BadInput):
        parse_incident_ref("gpu-[2-3]-20261130T001736Z")


def test_list_filters_become_one_visibility_query():
    assert incident_query("gpu-2", 79, "done", "recovered", running=False) == (
        "WorkflowType = 'NodeRecoveryWorkflow' AND RecoveryNode = 'gpu-2' AND RecoveryXid = 79"
        " AND RecoveryPhase = 'done' AND RecoveryOutcome = 'recovered'"
    )
    assert incident_query(None, None, None, "failed in drain", running=True) == (
        "WorkflowType = 'NodeRecoveryWorkflow' AND RecoveryOutcome = 'failed in drain' AND ExecutionStatus = 'Running'"
    )


def test_a_torch_drill_on_a_debian_roots_generation_is_refused():
    """The PyTorch job runs with the worker's python: a Debian root's has no PyTorch."""
    root_generation = next(g for g in DEBIAN_RELEASE_OF_GENERATION if g != host_slurm_generation())
    result = recovery("drill", "--trainer", "torch", "--slurm-version", root_generation)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"the Debian root of {root_generation} has no PyTorch" in " ".join(result.stderr.split())


def test_a_torch_drill_without_pytorch_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else object())
    with pytest.raises(BadInput, match=r"install PyTorch \(pip install -e '.\[torch\]'"):
        _check_torch_drill(None)
