"""Configuration: environment and an optional file, validated at start with errors that name the
variable, printed with secrets masked."""

from __future__ import annotations

import pytest

from activities.budget import LEASE_UPDATES_IN_FLIGHT
from contracts.settings import (
    ConfigError,
    Settings,
    describe_config,
    load_settings,
    load_telemetry_settings,
)


@pytest.fixture
def env(monkeypatch):
    """None of the variables the tests set."""
    for name in (
        "TEMPORAL_ADDRESS",
        "RECOVERY_DEGRADING_GRACE_SECONDS",
        "SLURMRESTD_TOKEN",
        "SLURMRESTD_URL",
        "RECOVERY_CONFIG_FILE",
        "RECOVERY_PROMETHEUS_ADDRESS",
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_METRICS_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def config_file(env, tmp_path):
    """Writes the file RECOVERY_CONFIG_FILE names."""
    path = tmp_path / "recovery.env"

    def write(text: str) -> str:
        path.write_text(text)
        env.setenv("RECOVERY_CONFIG_FILE", str(path))
        return str(path)

    return write


def test_the_file_sets_values_and_the_environment_wins(env, config_file):
    config_file("TEMPORAL_ADDRESS=temporal.example.net:7233\nRECOVERY_DEGRADING_GRACE_SECONDS=30\n")
    env.setenv("RECOVERY_DEGRADING_GRACE_SECONDS", "45")
    settings = load_settings()
    assert settings.temporal_address == "temporal.example.net:7233"
    assert settings.degrading_grace_seconds == 45


@pytest.mark.parametrize(
    "content, problem",
    [
        ("RECOVERY_DEGRADING_GRACE_SECONDS=soon\n", "RECOVERY_DEGRADING_GRACE_SECONDS: Input should be a valid number"),
        ("RECOVERY_SPARE_NODES=gpu-[1-2]\n", "RECOVERY_SPARE_NODES: Value error, invalid node name"),
        ("RECOVERY_GRACE=30\n", "RECOVERY_GRACE in "),  # a typo is refused, not ignored
        ("RECOVERY_PROMETHEUS_ADDRESS=9464\n", "RECOVERY_PROMETHEUS_ADDRESS: Value error, '9464' is not host:port"),
        # a worker with no Slurm commands has nothing to reach Slurm with but slurmrestd
        ("RECOVERY_SLURM_CLI=false\n", "RECOVERY_SLURM_CLI=false needs slurmrestd: set SLURMRESTD_URL"),
        ("RECOVERY_SLURM_CLI=false\nSLURMRESTD_TOKEN=t\n", "RECOVERY_SLURM_CLI=false needs slurmrestd"),
        # fewer could leave the fleet budget no slot while incidents wait on its answer
        (
            "RECOVERY_WORKFLOW_TASK_SLOTS=5\n",
            "RECOVERY_WORKFLOW_TASK_SLOTS: Input should be greater than or equal to 8",
        ),
    ],
)
def test_a_bad_file_is_refused_naming_the_variable(config_file, content, problem):
    config_file(content)
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert problem in str(refused.value)


def test_a_missing_file_is_refused(env, tmp_path):
    env.setenv("RECOVERY_CONFIG_FILE", str(tmp_path / "absent.env"))
    with pytest.raises(ConfigError, match="RECOVERY_CONFIG_FILE=.*absent.env: no such file"):
        load_settings()


def test_config_shows_each_value_with_its_source_and_masks_secrets(env, config_file):
    path = config_file("SLURMRESTD_URL=http://admin:hunter2@slurm:6820\nRECOVERY_DEGRADING_GRACE_SECONDS=30\n")
    env.setenv("SLURMRESTD_TOKEN", "eyJ-secret-token")
    env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=secret-key")
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    entries = {e.variable: e for e in describe_config(load_settings(), load_telemetry_settings())}
    printed = repr(entries)
    assert "eyJ-secret-token" not in printed and "hunter2" not in printed and "secret-key" not in printed
    assert entries["SLURMRESTD_TOKEN"].value == "********"
    assert entries["SLURMRESTD_URL"].value == "http://admin:********@slurm:6820"
    assert entries["OTEL_EXPORTER_OTLP_HEADERS"].value == "********"
    assert (
        entries["SLURMRESTD_TOKEN"].source,
        entries["RECOVERY_DEGRADING_GRACE_SECONDS"].source,
        entries["TEMPORAL_ADDRESS"].source,
    ) == ("environment", path, "default")
    assert entries["OTEL_EXPORTER_OTLP_ENDPOINT"].value == "http://collector:4318"


@pytest.mark.parametrize(
    "variables, traces, metrics",
    [
        ({}, "none", "none"),  # nothing configured: nothing exported, no failed exports logged
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "otlp", "otlp"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, "otlp", "none"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_METRICS_EXPORTER": "none"}, "otlp", "none"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "console", "none"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}, "none", "none"),
    ],
)
def test_which_telemetry_is_exported(env, variables, traces, metrics):
    for name, value in variables.items():
        env.setenv(name, value)
    otel = load_telemetry_settings()
    assert (otel.traces(), otel.metrics()) == (traces, metrics)


def test_an_otlp_protocol_that_is_not_installed_is_refused(env):
    env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL: Input should be 'http/protobuf'"):
        load_telemetry_settings()


def test_the_fewest_workflow_task_slots_leave_the_fleet_budget_one_of_its_own():
    """Up to LEASE_UPDATES_IN_FLIGHT of a worker's tasks may each hold a slot while they wait on
    the fleet budget's answer: the budget's own task must still find one free."""
    fewest = next(rule.ge for rule in Settings.model_fields["workflow_task_slots"].metadata if hasattr(rule, "ge"))
    assert fewest > LEASE_UPDATES_IN_FLIGHT
    assert load_settings(workflow_task_slots=fewest).workflow_task_slots == fewest
    with pytest.raises(ConfigError, match="RECOVERY_WORKFLOW_TASK_SLOTS"):
        load_settings(workflow_task_slots=fewest - 1)
