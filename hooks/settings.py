"""The hook server's configuration, from RECOVERY_HOOKS_* environment variables, validated at start."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, FilePath, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contracts.models import Xid
from hooks.credentials import BearerTokens, Credential, CredentialsFile
from hooks.intake import IntakeLimits

AuthMode = Literal["bearer", "hmac"]
TOKEN_CREDENTIAL = Credential("token", None)  # RECOVERY_HOOKS_TOKEN: every node


def _comma_list(value: object) -> object:
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value


class HookSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RECOVERY_HOOKS_", env_file=None, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8910, ge=0, le=65535, description="0 picks a free port")

    # --- authentication ---
    auth: Annotated[list[AuthMode], NoDecode] = Field(
        default_factory=lambda: ["bearer"], description="accepted schemes, comma-separated: bearer, hmac"
    )
    token: SecretStr | None = Field(None, description="the bearer token, valid for every node")
    token_file: Path | None = Field(None, description="a file holding the bearer token (instead of token)")
    hmac_key: SecretStr | None = Field(
        None, description="the key of the HMAC-SHA256 signature over timestamp.nonce.body, valid for every node"
    )
    hmac_key_file: Path | None = None
    credentials_file: Path | None = Field(
        None,
        description="named bearer credentials, each scoped to the nodes it may report on, and node agents' "
        "derived tokens (hooks/credentials.py)",
    )
    signature_window_seconds: float = Field(
        300.0,
        gt=0,
        description="a signature is valid this long either side of its X-Recovery-Timestamp, and "
        "its nonce is remembered as long",
    )
    nonce_cache_size: int = Field(
        100_000, gt=0, description="nonces remembered within the window; when full, signed requests get 503"
    )

    # --- the server, facing the network ---
    tls_cert_file: FilePath | None = Field(None, description="serve HTTPS with this certificate chain (PEM)")
    tls_key_file: FilePath | None = Field(None, description="the certificate's private key (PEM)")
    max_header_bytes: int = Field(16 * 1024, gt=0, description="request line and headers; larger: 431")
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="a connection that has not sent its request's headers this long after it opened "
        "(or after the request's first byte) is closed",
    )
    max_connections: int = Field(1000, gt=0, description="connections beyond this many are answered 503 and closed")

    # --- input limits ---
    max_body_bytes: int = Field(1 << 20, gt=0)
    max_alerts_per_request: int = Field(1000, gt=0)

    # --- what is dropped ---
    max_alert_age_seconds: float = Field(900.0, gt=0, description="older alerts are dropped")
    clock_skew_seconds: float = Field(300.0, ge=0, description="alerts further in the future are dropped")

    # --- correlation (docs/alert-hooks.md, "Correlation") ---
    correlation_window_seconds: float = Field(
        120.0, ge=0, description="a secondary alert joins an incident that started at most this far from it"
    )
    correlation_hold_seconds: float = Field(
        10.0,
        ge=0,
        description="how long a secondary alert on a node with no incident of its own waits for "
        "the incident it follows from (its job peers are known once that incident has found its jobs)",
    )
    correlation_refresh_seconds: float = Field(
        1.0, gt=0, description="the running incidents are read from visibility at most this often"
    )
    secondary_xids: Annotated[list[Xid], NoDecode] = Field(
        default_factory=lambda: [45, 74],
        description="XIDs that follow from a failure elsewhere: they join a peer's incident",
    )

    # --- sources ---
    node_labels: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["node", "Hostname", "instance"],
        description="Alertmanager labels holding the node name, first present wins",
    )

    # --- the cluster's nodes (docs/alert-hooks.md, "Unknown nodes") ---
    inventory: Literal["slurm", "off"] | None = Field(
        None,
        description="refuse alerts on nodes the cluster does not have: slurm (its node list, read through "
        "the Slurm CLI) or off; unset: slurm when SLURM_CONF (or RECOVERY_SLURM_CONF) says where Slurm is, else off",
    )
    inventory_ttl_seconds: float = Field(
        60.0,
        gt=0,
        description="the cluster's node list is read again after this long (a node added to the "
        "cluster is refused until then)",
    )

    # --- per-node state ---
    node_state_size: int = Field(
        100_000,
        gt=0,
        description="nodes whose state the hook keeps (last incident, flood counts); beyond it "
        "the longest idle node's is forgotten",
    )

    # --- hand-over ---
    max_batch_alerts: int = Field(200, gt=0, description="alerts per hand-over to one incident")
    max_inflight_handovers: int = Field(64, gt=0, description="concurrent Temporal calls")
    dedupe_cache_size: int = Field(100_000, gt=0, description="alerts remembered as handed over")
    access_log: bool = False

    @field_validator("auth", "secondary_xids", "node_labels", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        return _comma_list(value)

    @model_validator(mode="after")
    def _secrets_for_each_scheme(self) -> HookSettings:
        if not self.auth:
            raise ValueError("RECOVERY_HOOKS_AUTH: name at least one of bearer, hmac")
        self.token = _secret(self.token, self.token_file, "TOKEN")
        self.hmac_key = _secret(self.hmac_key, self.hmac_key_file, "HMAC_KEY")
        if "bearer" in self.auth and self.token is None and self.credentials_file is None:
            raise ValueError(
                "bearer authentication needs RECOVERY_HOOKS_TOKEN, RECOVERY_HOOKS_TOKEN_FILE or "
                "RECOVERY_HOOKS_CREDENTIALS_FILE"
            )
        if "hmac" in self.auth and self.hmac_key is None:
            raise ValueError("hmac authentication needs RECOVERY_HOOKS_HMAC_KEY or RECOVERY_HOOKS_HMAC_KEY_FILE")
        if self.credentials_file is not None:
            try:
                self.bearer_tokens()  # a bad file is refused at start, not at the first request
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"RECOVERY_HOOKS_CREDENTIALS_FILE {self.credentials_file}: {' '.join(str(e).split())}"
                ) from None
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both RECOVERY_HOOKS_TLS_CERT_FILE and RECOVERY_HOOKS_TLS_KEY_FILE")
        if not self.node_labels:
            raise ValueError("RECOVERY_HOOKS_NODE_LABELS: name at least one label")
        return self

    def bearer_tokens(self) -> BearerTokens:
        """Every bearer token with its credential: RECOVERY_HOOKS_TOKEN's for every node, and the
        credentials file's (their secrets read now)."""
        tokens = [] if self.token is None else [(self.token.get_secret_value().encode(), TOKEN_CREDENTIAL)]
        if self.credentials_file is not None:
            tokens += CredentialsFile.read(self.credentials_file).bearer_tokens()
        return BearerTokens(tokens)

    def intake_limits(self) -> IntakeLimits:
        return IntakeLimits(
            max_age=timedelta(seconds=self.max_alert_age_seconds),
            clock_skew=timedelta(seconds=self.clock_skew_seconds),
            correlation_window=timedelta(seconds=self.correlation_window_seconds),
            correlation_hold=timedelta(seconds=self.correlation_hold_seconds),
            secondary_xids=frozenset(self.secondary_xids),
            max_batch=self.max_batch_alerts,
            max_inflight=self.max_inflight_handovers,
            dedupe_size=self.dedupe_cache_size,
            node_state_size=self.node_state_size,
        )


def _secret(value: SecretStr | None, path: Path | None, name: str) -> SecretStr | None:
    """The secret from the variable or its file, stripped; an empty one is refused, never taken as
    "no secret needed" (with an empty token, `Authorization: Bearer ` would be a valid credential)."""
    if path is None:
        if value is None:
            return None
        text = value.get_secret_value().strip()
        if not text:
            raise ValueError(f"RECOVERY_HOOKS_{name} is empty or only whitespace")
        return SecretStr(text)
    if value is not None:
        raise ValueError(f"set RECOVERY_HOOKS_{name} or RECOVERY_HOOKS_{name}_FILE, not both")
    text = path.read_text().strip()
    if not text:
        raise ValueError(f"RECOVERY_HOOKS_{name}_FILE {path} is empty or only whitespace")
    return SecretStr(text)
