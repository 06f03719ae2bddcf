"""Configuration in one place: environment variables and an optional file, validated at start.

The file (RECOVERY_CONFIG_FILE) holds the same variables as the environment, one `NAME=value` a
line; a variable set in the environment wins over the file. OpenTelemetry keeps its standard
OTEL_* environment variables (TelemetrySettings), which its SDK reads itself.
`recovery config` prints what is in effect, secrets masked, and where each value came from.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

from dotenv import dotenv_values
from pydantic import (
    AliasChoices,
    BaseModel,
    Field,
    JsonValue,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from contracts.budget import BudgetPolicy, WebhookTarget, partition_fractions_from
from contracts.models import ApprovalGate, CheckpointFormat, PinnedJobs, RecoveryPolicy, _check_node_name
from contracts.operators import parse_operator_keys
from contracts.redaction import fingerprinted_url

DEFAULT_XID_POLICY = Path(__file__).with_name("xid_policy.csv")
CONFIG_FILE_VARIABLE = "RECOVERY_CONFIG_FILE"
MASK = "********"
# URLs that may be a secret as a whole (a Slack-style path, a ?token=): shown as host and fingerprint.
SECRET_URLS = frozenset({"notify_webhook_url"})


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the variable and what is wrong."""


def config_file() -> Path | None:
    value = os.environ.get(CONFIG_FILE_VARIABLE)
    if not value:
        return None
    path = Path(value)
    if not path.is_file():
        raise ConfigError(f"{CONFIG_FILE_VARIABLE}={value}: no such file")
    return path


def secret_not_blank(value: SecretStr | None) -> SecretStr | None:
    """A secret set to nothing (an empty value left in a manifest) is refused: unset it instead."""
    if value is not None and not value.get_secret_value().strip():
        raise ValueError("empty or whitespace only: leave it unset, or give the secret")
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RECOVERY_", env_file=None, extra="forbid")

    temporal_address: str = Field(
        "127.0.0.1:7233", validation_alias=AliasChoices("TEMPORAL_ADDRESS", "RECOVERY_TEMPORAL_ADDRESS")
    )
    temporal_namespace: str = Field(
        "default", validation_alias=AliasChoices("TEMPORAL_NAMESPACE", "RECOVERY_TEMPORAL_NAMESPACE")
    )
    # How the connection to Temporal is secured (worker.temporal_tls builds the SDK's TLSConfig).
    temporal_tls: bool | None = Field(
        None,
        description=(
            "TLS to Temporal: unset means on when a TLS file, a server name or an API key is set; "
            "true alone trusts the system roots (Temporal Cloud)"
        ),
    )
    temporal_tls_ca: Path | None = Field(None, description="PEM file of the CA the server's certificate must chain to")
    temporal_tls_cert: Path | None = Field(None, description="PEM client certificate for mTLS (with the key)")
    temporal_tls_key: Path | None = Field(
        None, validate_default=True, description="PEM private key of the client certificate (with the cert)"
    )
    temporal_tls_server_name: str | None = Field(
        None, description="the name the server's certificate is verified against (and the SNI), if not the host"
    )
    temporal_api_key: SecretStr | None = Field(
        None, description="sent as 'authorization: Bearer <key>'; turns TLS on unless RECOVERY_TEMPORAL_TLS=false"
    )
    task_queue: str = "training-recovery"

    slurm_conf: str | None = Field(None, validation_alias=AliasChoices("SLURM_CONF", "RECOVERY_SLURM_CONF"))
    slurm_bin_dir: str = Field("", validation_alias=AliasChoices("RECOVERY_SLURM_BIN_DIR", "SLURM_BIN_DIR"))
    slurmrestd_url: str | None = Field(None, validation_alias=AliasChoices("SLURMRESTD_URL", "RECOVERY_SLURMRESTD_URL"))
    slurmrestd_user: str = Field("root", validation_alias=AliasChoices("SLURMRESTD_USER", "RECOVERY_SLURMRESTD_USER"))
    slurmrestd_token: SecretStr | None = Field(
        None, validation_alias=AliasChoices("SLURMRESTD_TOKEN", "RECOVERY_SLURMRESTD_TOKEN")
    )
    slurmrestd_token_file: Path | None = Field(
        None,
        validation_alias=AliasChoices("SLURMRESTD_TOKEN_FILE", "RECOVERY_SLURMRESTD_TOKEN_FILE"),
        description="a file holding the slurmrestd JWT (instead of SLURMRESTD_TOKEN), read again whenever it "
        "changes, so that a renewer can replace a short-lived token without a restart",
    )
    slurm_cli: bool = Field(
        True,
        description="false: never run a Slurm command; every call goes to slurmrestd, which must serve "
        "v0.0.45 (Slurm 26.05 or later), so the worker needs no Slurm client installed",
    )

    xid_policy_file: Path = DEFAULT_XID_POLICY
    checkpoint_format: CheckpointFormat | None = Field(
        None,
        description="how jobs write checkpoints where their comment does not say (checkpoint_format=): reference, "
        "dcp, hf_trainer, lightning or megatron; unset: detected from each job's checkpoint directory",
    )
    owner: str = "recovery"
    spare_nodes: str = Field("", description="comma-separated hot spares, drained until needed")
    health_check: str = Field("", description="command run with the node name as {node}; exit 0 = healthy")
    degrading_grace_seconds: float = 120.0
    checkpoint_poll_seconds: float = 1.0
    spare_wait_seconds: float = 300.0
    spare_for_idle_node: bool = False
    verify_deadline_seconds: float = 600.0
    pinned_jobs: PinnedJobs = PinnedJobs.UNPIN
    search_attributes: bool = True
    # Safety (RecoveryPolicy documents each): observe mode, approval gates, application XIDs, repair.
    dry_run: bool = False
    # NoDecode: _json_list decodes it, so that a value that is not JSON is named in one line.
    approval_required: Annotated[list[ApprovalGate], NoDecode] = Field(default_factory=list)
    approval_min_job_nodes: int = 1
    approval_timeout_seconds: float = 3600.0
    approval_timeout_action: Literal["deny", "approve"] = "deny"
    application_xid_threshold: int = 3
    application_xid_window_seconds: float = 24 * 3600.0
    repair_poll_seconds: float = 300.0
    repair_wait_seconds: float = 7 * 24 * 3600.0
    k8s_enabled: bool = Field(False, description="Slurm on Kubernetes (RECOVERY_K8S_* configure that side)")
    prometheus_address: str = Field(
        "", description="host:port where the worker serves the Temporal SDK's metrics for Prometheus; empty: off"
    )
    # Workflow tasks the worker takes at once; the rest wait their turn at the server. A task that
    # fences a node holds its slot while its local activities run, so the worker must not take more
    # than it can finish within Temporal's 10 s task timeout. On 2 cores with 1,000 incidents at
    # once, the SDK's 100 slots let tasks time out and run again; 20 had none and every node was
    # drained and signalled in 258 s (10: 402 s). At least 8: up to 5 of them may wait on the fleet
    # budget's answer (activities/budget.py, LEASE_UPDATES_IN_FLIGHT), which needs a slot of its own.
    workflow_task_slots: int = Field(20, ge=8, description="workflow tasks this worker runs at once")
    # Fleet safety (docs/safety.md): the disruption budget, lemon nodes, notifications, the audit log.
    fleet_budget: bool = Field(True, description="incidents take a lease from the fleet disruption budget")
    budget_max_nodes: int = Field(5, ge=1, description="K: nodes under remediation at once, fleet-wide")
    budget_partition_fraction: float = Field(
        0.1, gt=0, le=1, description="of each partition's nodes at once (at least 1)"
    )
    budget_partition_fractions: str = Field("", description="per-partition overrides: gpu=0.2,debug=0.5")
    budget_max_disrupted_jobs: int = Field(20, ge=1, description="J: running jobs disrupted per window")
    budget_disruption_window_seconds: float = Field(3600.0, gt=0)
    lemon_incidents: int = Field(3, ge=2, description="N incidents on a node within the window make it a lemon")
    lemon_window_seconds: float = Field(7 * 24 * 3600.0, gt=0)
    lease_max_seconds: float = Field(
        6 * 3600.0, gt=0, description="a lease held longer is reclaimed (a stuck incident)"
    )
    lease_holder_check_seconds: float = Field(60.0, gt=0)
    # The fence circuit breaker (docs/safety.md), before any drain; held incidents wait fence_hold_seconds.
    breaker_max_fences: int = Field(10, ge=1, description="nodes fenced per breaker window, fleet-wide")
    breaker_fleet_fraction: float = Field(0.5, gt=0, le=1, description="of the cluster's nodes fenced per window")
    breaker_partition_fraction: float = Field(0.5, gt=0, le=1, description="of each partition's nodes per window")
    breaker_window_seconds: float = Field(300.0, gt=0)
    fence_hold_seconds: float = Field(3600.0, gt=0, description="how long a held incident waits for a reset")
    notify_webhook_url: str = Field("", pattern=r"^(https?://.+)?$", description="POST notifications here; empty: none")
    notify_bearer_token: SecretStr | None = None
    notify_hmac_secret: SecretStr | None = None
    notify_timeout_seconds: float = Field(10.0, gt=0)
    audit_log: Path | None = Field(None, description="append every action and decision as a JSON line here")
    accept_starter_policy: bool = Field(
        False,
        description="drills only: an incident runs on the policy its starter sent; off, on the worker's "
        "own, which a starter can only make safer (dry-run, more approval gates)",
    )
    # Verified operators (contracts/operators.py): the worker's list of operators' public keys, and
    # the CLI's own signing key.
    operator_keys_file: Path | None = Field(
        None,
        description="the operators whose signed decisions the worker accepts, one `NAME ssh-ed25519 KEY` "
        "per line; unset: every operator decision is refused",
    )
    operator_key_file: Path | None = Field(
        None, description="the CLI's operator key (OpenSSH Ed25519, no passphrase) that signs its decisions"
    )
    operator: str = Field("", description="the CLI's operator name, as the worker's list has it; empty: the login name")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Arguments first, then the environment, then the file.
        path = config_file()
        if path is None:
            return init_settings, env_settings
        return init_settings, env_settings, DotEnvSettingsSource(settings_cls, env_file=path)

    @field_validator("approval_required", mode="before")
    @classmethod
    def _json_list(cls, value: object) -> object:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f'{value!r} is not a JSON list: write e.g. \'["requeue","replacement"]\'') from None
        return value

    _secrets_not_blank = field_validator(
        "temporal_api_key", "slurmrestd_token", "notify_bearer_token", "notify_hmac_secret"
    )(secret_not_blank)

    @field_validator("slurmrestd_token_file")
    @classmethod
    def _token_file_holds_a_token(cls, value: Path | None) -> Path | None:
        # Read now, so that a missing or empty file stops the start-up, not the first Slurm call.
        if value is not None:
            try:
                token = value.read_text()
            except OSError as e:
                raise ValueError(f"cannot read {value}: {e.strerror}") from None
            if not token.strip():
                raise ValueError(f"{value} is empty")
        return value

    @field_validator("operator_keys_file")
    @classmethod
    def _operator_list_reads(cls, value: Path | None) -> Path | None:
        if value is not None:
            try:
                if not parse_operator_keys(value.read_text(), str(value)):
                    raise ValueError(f"{value} lists no operator")
            except OSError as e:
                raise ValueError(f"cannot read {value}: {e.strerror}") from None
        return value

    @model_validator(mode="after")
    def _one_slurmrestd_token(self) -> Settings:
        if self.slurmrestd_token is not None and self.slurmrestd_token_file is not None:
            raise ValueError("set SLURMRESTD_TOKEN or SLURMRESTD_TOKEN_FILE, not both")
        if not self.slurm_cli and not (
            self.slurmrestd_url and (self.slurmrestd_token is not None or self.slurmrestd_token_file is not None)
        ):
            raise ValueError(
                "RECOVERY_SLURM_CLI=false needs slurmrestd: set SLURMRESTD_URL and SLURMRESTD_TOKEN(_FILE)"
            )
        return self

    @field_validator("spare_nodes")
    @classmethod
    def _spares_are_node_names(cls, value: str) -> str:
        for name in filter(None, (n.strip() for n in value.split(","))):
            _check_node_name(name)
        return value

    @field_validator("temporal_tls_ca", "temporal_tls_cert", "temporal_tls_key")
    @classmethod
    def _readable_pem(cls, value: Path | None) -> Path | None:
        # Read now, so that a bad path stops the start-up instead of the first dial.
        if value is not None:
            try:
                content = value.read_bytes()
            except OSError as e:
                raise ValueError(f"cannot read {value}: {e.strerror}") from None
            if b"-----BEGIN " not in content:
                raise ValueError(f"{value} is not a PEM file")
        return value

    @field_validator("temporal_tls_key")
    @classmethod
    def _client_cert_and_key_together(cls, key: Path | None, info: ValidationInfo) -> Path | None:
        if "temporal_tls_cert" not in info.data:
            return key  # the cert itself was refused: that error says why
        if (info.data["temporal_tls_cert"] is None) != (key is None):
            raise ValueError(
                "RECOVERY_TEMPORAL_TLS_CERT and RECOVERY_TEMPORAL_TLS_KEY go together (mTLS): set both or neither"
            )
        return key

    @model_validator(mode="after")
    def _tls_files_need_tls(self) -> Settings:
        given = [
            name for name in ("temporal_tls_ca", "temporal_tls_cert", "temporal_tls_server_name") if getattr(self, name)
        ]
        if self.temporal_tls is False and given:
            raise ValueError(
                f"RECOVERY_TEMPORAL_TLS is false, yet {', '.join(f'RECOVERY_{n.upper()}' for n in given)} "
                "configure TLS: remove one or the other"
            )
        return self

    @field_validator("xid_policy_file")
    @classmethod
    def _policy_file_exists(cls, value: Path) -> Path:
        if not value.is_file():
            raise ValueError(f"XID policy file {value} does not exist")
        return value

    @field_validator("prometheus_address")
    @classmethod
    def _host_and_port(cls, value: str) -> str:
        if value:
            host, _, port = value.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{value!r} is not host:port (e.g. 127.0.0.1:9464)")
        return value

    @field_validator("budget_partition_fractions")
    @classmethod
    def _partition_fractions(cls, value: str) -> str:
        BudgetPolicy(partition_fractions=partition_fractions_from(value))
        return value

    @model_validator(mode="after")
    def _webhook_authenticates_one_way(self) -> Settings:
        try:
            self.webhook_target()
        except ValidationError as e:
            raise ValueError(f"RECOVERY_NOTIFY_*: {e.errors()[0]['msg']}") from None
        return self

    def budget_policy(self) -> BudgetPolicy:
        return BudgetPolicy(
            max_nodes=self.budget_max_nodes,
            partition_fraction=self.budget_partition_fraction,
            partition_fractions=partition_fractions_from(self.budget_partition_fractions),
            max_disrupted_jobs=self.budget_max_disrupted_jobs,
            disruption_window_seconds=self.budget_disruption_window_seconds,
            lemon_incidents=self.lemon_incidents,
            lemon_window_seconds=self.lemon_window_seconds,
            lease_max_seconds=self.lease_max_seconds,
            holder_check_seconds=self.lease_holder_check_seconds,
            breaker_max_fences=self.breaker_max_fences,
            breaker_fleet_fraction=self.breaker_fleet_fraction,
            breaker_partition_fraction=self.breaker_partition_fraction,
            breaker_window_seconds=self.breaker_window_seconds,
            notifications=bool(self.notify_webhook_url),
        )

    def webhook_target(self) -> WebhookTarget | None:
        if not self.notify_webhook_url:
            return None
        return WebhookTarget(
            url=self.notify_webhook_url,
            bearer_token=self.notify_bearer_token,
            hmac_secret=self.notify_hmac_secret,
            timeout_seconds=self.notify_timeout_seconds,
        )

    def health_check_argv(self) -> list[str]:
        return shlex.split(self.health_check)

    def policy(self) -> RecoveryPolicy:
        """The incident policy: every RecoveryPolicy field of the same name, validated there."""
        same_name = {
            name: getattr(self, name)
            for name in RecoveryPolicy.model_fields
            if name in type(self).model_fields and name != "spare_nodes"
        }
        return RecoveryPolicy(
            **same_name,
            kubernetes=self.k8s_enabled,
            notify=bool(self.notify_webhook_url),
            spare_nodes=[n.strip() for n in self.spare_nodes.split(",") if n.strip()],
        )


TelemetryExporter = Literal["otlp", "console", "none"]


class TelemetrySettings(BaseSettings):
    """The standard OpenTelemetry variables this project acts on, validated at start. The OTLP
    exporters read the rest of theirs (timeouts, certificates, OTEL_RESOURCE_ATTRIBUTES, ...)."""

    model_config = SettingsConfigDict(env_prefix="OTEL_", env_file=None, extra="ignore")

    sdk_disabled: bool = False
    service_name: str = "training-recovery"
    # Unset: otlp when an OTLP endpoint is set, otherwise none (the specification's default,
    # otlp to localhost:4318, would make every unconfigured worker log failed exports).
    traces_exporter: TelemetryExporter | None = None
    metrics_exporter: TelemetryExporter | None = None
    exporter_otlp_endpoint: str | None = None
    exporter_otlp_traces_endpoint: str | None = None
    exporter_otlp_metrics_endpoint: str | None = None
    exporter_otlp_protocol: Literal["http/protobuf"] = Field(
        "http/protobuf", description="the OTLP exporter installed is http/protobuf; grpc is not"
    )
    exporter_otlp_headers: SecretStr | None = Field(None, description="often an API key: masked when printed")
    metric_export_interval: int = Field(60000, gt=0, description="milliseconds between metric exports")

    _secrets_not_blank = field_validator("exporter_otlp_headers")(secret_not_blank)

    def traces(self) -> TelemetryExporter:
        return self._exporter(self.traces_exporter, self.exporter_otlp_traces_endpoint)

    def metrics(self) -> TelemetryExporter:
        return self._exporter(self.metrics_exporter, self.exporter_otlp_metrics_endpoint)

    def _exporter(self, chosen: TelemetryExporter | None, signal_endpoint: str | None) -> TelemetryExporter:
        if self.sdk_disabled:
            return "none"
        if chosen is not None:
            return chosen
        return "otlp" if (signal_endpoint or self.exporter_otlp_endpoint) else "none"


# --- loading and printing ----------------------------------------------------------------------


SettingsModel = TypeVar("SettingsModel", bound=BaseSettings)


def load_settings(**overrides: Any) -> Settings:
    """Settings() with errors that name the variable to fix."""
    return loaded(Settings, **overrides)


def load_telemetry_settings() -> TelemetrySettings:
    return loaded(TelemetrySettings)


def loaded(model: type[SettingsModel], **overrides: Any) -> SettingsModel:
    """model(**overrides) read from its sources; a bad value raises ConfigError naming its variable."""
    try:
        return model(**overrides)
    except ValidationError as e:
        raise ConfigError(_explain(e, model)) from None
    except SettingsError as e:  # a value a source could not decode (pydantic-settings names the field)
        raise ConfigError(f"invalid configuration: {e}") from None


def _explain(error: ValidationError, model: type[BaseSettings]) -> str:
    path = os.environ.get(CONFIG_FILE_VARIABLE)
    problems = []
    for err in error.errors():
        key = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            problems.append(f"{key.upper()} in {path}: not a setting of this project")
            continue
        field = model.model_fields.get(key)
        name = variable_names(model, key)[0] if field is not None else key.upper()
        problems.append(f"{name}: {err['msg']}" if name else err["msg"])  # a model-level check names its own
    return "invalid configuration: " + "; ".join(problems)


def variable_names(model: type[BaseSettings], field_name: str) -> list[str]:
    """The variables that set a field, the preferred one first."""
    alias = model.model_fields[field_name].validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    return [f"{model.model_config.get('env_prefix', '')}{field_name}".upper()]


class ConfigEntry(BaseModel):
    variable: str
    value: JsonValue
    source: str = Field(description="environment, the file's path, or default")


def describe_config(settings: Settings, telemetry: TelemetrySettings) -> list[ConfigEntry]:
    """What `recovery config` prints: every setting in effect, secrets masked."""
    environment = {k.upper() for k in os.environ}
    path = config_file()
    in_file = {k.upper() for k in dotenv_values(path)} if path else set()
    entries = []
    for model in (settings, telemetry):
        for name in type(model).model_fields:
            names = variable_names(type(model), name)
            source = next(("environment" for n in names if n in environment), None)
            if source is None and model is settings:
                source = next((str(path) for n in names if n in in_file), None)
            value = getattr(model, name)
            shown = fingerprinted_url(value) if name in SECRET_URLS and value else _shown(value)
            entries.append(ConfigEntry(variable=names[0], value=shown, source=source or "default"))
    return entries


def _shown(value: object) -> JsonValue:
    if isinstance(value, SecretStr):
        return MASK
    if isinstance(value, str) and "://" in value:
        return _without_password(value)
    if isinstance(value, Path):
        return str(value)
    # Every other setting is a str (or a str enum), a number, a bool, None or a list of str.
    return cast(JsonValue, value)


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:{MASK}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
