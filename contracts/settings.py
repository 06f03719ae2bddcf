"""Configuration from the environment (and an optional .env-style file), validated at start."""

from __future__ import annotations

import shlex
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts.models import RecoveryPolicy, _check_node_name

DEFAULT_XID_POLICY = Path(__file__).with_name("xid_policy.csv")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RECOVERY_", env_file=None, extra="forbid")

    temporal_address: str = Field(
        "127.0.0.1:7233", validation_alias=AliasChoices("TEMPORAL_ADDRESS", "RECOVERY_TEMPORAL_ADDRESS")
    )
    temporal_namespace: str = Field(
        "default", validation_alias=AliasChoices("TEMPORAL_NAMESPACE", "RECOVERY_TEMPORAL_NAMESPACE")
    )
    task_queue: str = "training-recovery"

    slurm_conf: str | None = Field(None, validation_alias=AliasChoices("SLURM_CONF", "RECOVERY_SLURM_CONF"))
    slurm_bin_dir: str = Field("", validation_alias=AliasChoices("RECOVERY_SLURM_BIN_DIR", "SLURM_BIN_DIR"))
    slurmrestd_url: str | None = Field(
        None, validation_alias=AliasChoices("SLURMRESTD_URL", "RECOVERY_SLURMRESTD_URL")
    )
    slurmrestd_user: str = Field("root", validation_alias=AliasChoices("SLURMRESTD_USER", "RECOVERY_SLURMRESTD_USER"))
    slurmrestd_token: SecretStr | None = Field(
        None, validation_alias=AliasChoices("SLURMRESTD_TOKEN", "RECOVERY_SLURMRESTD_TOKEN")
    )

    xid_policy_file: Path = DEFAULT_XID_POLICY
    owner: str = "recovery"
    spare_nodes: str = Field("", description="comma-separated hot spares, drained until needed")
    health_check: str = Field("", description="command run with the node name as {node}; exit 0 = healthy")
    degrading_grace_seconds: float = 120.0
    checkpoint_poll_seconds: float = 1.0
    spare_wait_seconds: float = 300.0
    verify_deadline_seconds: float = 600.0

    @field_validator("spare_nodes")
    @classmethod
    def _spares_are_node_names(cls, value: str) -> str:
        for name in filter(None, (n.strip() for n in value.split(","))):
            _check_node_name(name)
        return value

    @field_validator("xid_policy_file")
    @classmethod
    def _policy_file_exists(cls, value: Path) -> Path:
        if not value.is_file():
            raise ValueError(f"XID policy file {value} does not exist")
        return value

    def health_check_argv(self) -> list[str]:
        return shlex.split(self.health_check)

    def policy(self) -> RecoveryPolicy:
        return RecoveryPolicy(
            owner=self.owner,
            degrading_grace_seconds=self.degrading_grace_seconds,
            checkpoint_poll_seconds=self.checkpoint_poll_seconds,
            spare_nodes=[n.strip() for n in self.spare_nodes.split(",") if n.strip()],
            spare_wait_seconds=self.spare_wait_seconds,
            verify_deadline_seconds=self.verify_deadline_seconds,
        )
