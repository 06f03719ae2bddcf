"""The Temporal connection settings (RECOVERY_TEMPORAL_TLS*, RECOVERY_TEMPORAL_API_KEY): validated
at start with errors that name the variables, turned into the SDK's `tls` argument, the API key
never printed. tests/integration/test_temporal_tls.py connects with them for real."""

from __future__ import annotations

import pytest
from temporalio.service import TLSConfig

from contracts.settings import MASK, ConfigError, describe_config, load_settings, load_telemetry_settings
from worker import temporal_tls

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
VARIABLES = (
    "RECOVERY_TEMPORAL_TLS",
    "RECOVERY_TEMPORAL_TLS_CA",
    "RECOVERY_TEMPORAL_TLS_CERT",
    "RECOVERY_TEMPORAL_TLS_KEY",
    "RECOVERY_TEMPORAL_TLS_SERVER_NAME",
    "RECOVERY_TEMPORAL_API_KEY",
    "RECOVERY_CONFIG_FILE",
)


@pytest.fixture
def env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def pem(tmp_path):
    def write(name: str, content: str = PEM):
        path = tmp_path / name
        path.write_text(content)
        return str(path)

    return write


def test_unset_means_plain_grpc(env):
    assert temporal_tls(load_settings()) is None  # and no API key: the SDK dials without TLS


def test_the_files_and_the_server_name_make_a_tls_config(env, pem):
    env.setenv("RECOVERY_TEMPORAL_TLS_CA", pem("ca.pem"))
    env.setenv("RECOVERY_TEMPORAL_TLS_CERT", pem("client.pem"))
    env.setenv("RECOVERY_TEMPORAL_TLS_KEY", pem("client.key", PEM.replace("CERTIFICATE", "PRIVATE KEY")))
    env.setenv("RECOVERY_TEMPORAL_TLS_SERVER_NAME", "temporal.example.net")
    tls = temporal_tls(load_settings())
    assert tls == TLSConfig(
        server_root_ca_cert=PEM.encode(),
        domain="temporal.example.net",
        client_cert=PEM.encode(),
        client_private_key=PEM.replace("CERTIFICATE", "PRIVATE KEY").encode(),
    )


def test_an_api_key_alone_leaves_tls_to_the_sdk_which_turns_it_on(env):
    env.setenv("RECOVERY_TEMPORAL_API_KEY", "secret-key")
    assert temporal_tls(load_settings()) is None
    env.setenv("RECOVERY_TEMPORAL_TLS", "false")
    assert temporal_tls(load_settings()) is False
    env.setenv("RECOVERY_TEMPORAL_TLS", "true")
    assert temporal_tls(load_settings()) is True  # the system's roots (Temporal Cloud)


@pytest.mark.parametrize("given", ["RECOVERY_TEMPORAL_TLS_CERT", "RECOVERY_TEMPORAL_TLS_KEY"])
def test_a_client_certificate_without_its_key_or_the_reverse_is_refused_naming_both(env, pem, given):
    env.setenv(given, pem("half.pem"))
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert "RECOVERY_TEMPORAL_TLS_CERT and RECOVERY_TEMPORAL_TLS_KEY go together" in str(refused.value)


def test_an_unreadable_file_is_refused_at_start(env, pem, tmp_path):
    env.setenv("RECOVERY_TEMPORAL_TLS_CA", str(tmp_path / "absent.pem"))
    with pytest.raises(
        ConfigError,
        match=r"RECOVERY_TEMPORAL_TLS_CA: Value error, cannot read .*absent.pem: "
        r"No such file or directory",
    ):
        load_settings()
    env.setenv("RECOVERY_TEMPORAL_TLS_CA", str(tmp_path))
    with pytest.raises(ConfigError, match="RECOVERY_TEMPORAL_TLS_CA: Value error, cannot read .*: Is a directory"):
        load_settings()
    env.setenv("RECOVERY_TEMPORAL_TLS_CA", pem("ca.der", "0\x82\x01"))
    with pytest.raises(ConfigError, match="RECOVERY_TEMPORAL_TLS_CA: Value error, .*ca.der is not a PEM file"):
        load_settings()


def test_tls_turned_off_with_tls_files_is_refused(env, pem):
    env.setenv("RECOVERY_TEMPORAL_TLS", "false")
    env.setenv("RECOVERY_TEMPORAL_TLS_CA", pem("ca.pem"))
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert str(refused.value) == (
        "invalid configuration: Value error, RECOVERY_TEMPORAL_TLS is false, yet "
        "RECOVERY_TEMPORAL_TLS_CA configure TLS: remove one or the other"
    )


def test_config_masks_the_api_key(env, pem):
    env.setenv("RECOVERY_TEMPORAL_API_KEY", "secret-key")
    env.setenv("RECOVERY_TEMPORAL_TLS_CA", pem("ca.pem"))
    entries = {e.variable: e for e in describe_config(load_settings(), load_telemetry_settings())}
    assert "secret-key" not in repr(entries)
    assert (entries["RECOVERY_TEMPORAL_API_KEY"].value, entries["RECOVERY_TEMPORAL_API_KEY"].source) == (
        MASK,
        "environment",
    )
    assert entries["RECOVERY_TEMPORAL_TLS_CA"].value.endswith("ca.pem")
