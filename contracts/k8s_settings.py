"""The Kubernetes side's configuration, from RECOVERY_K8S_* environment variables, validated at start.

Kept apart from contracts/settings.py so that a bare-Slurm worker reads none of it; the worker
builds the Kubernetes activities only when `RECOVERY_K8S_ENABLED` is true.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contracts.kubernetes import NodeSetRef, NodeSetVersion, TaintEffect
from contracts.settings import secret_not_blank

ReplacementKind = Literal["nodeset", "node-lifecycle", "http"]

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RECOVERY_K8S_", env_file=None, extra="forbid")

    enabled: bool = Field(False, description="build the Kubernetes activities (Slurm on Kubernetes, Slinky)")

    # --- the API server (backends/kubernetes/config.py: explicit file, KUBECONFIG, in-cluster, ~/.kube/config) ---
    kubeconfig: Path | None = Field(None, description="an explicit kubeconfig; wins over everything else")
    context: str | None = Field(None, description="the kubeconfig context (default: its current-context)")
    service_account_dir: Path = Field(
        SERVICE_ACCOUNT_DIR, description="where the in-cluster token and ca.crt are mounted"
    )

    # --- where Slurm runs ---
    namespace: str = Field("slurm", description="the namespace of the slurmd pods and the NodeSet")
    slurmd_selector: str = Field(
        "app.kubernetes.io/name=slurmd", description="label selector of the slurmd pods (every NodeSet's)"
    )
    node_selector: str = Field(
        "", description="label selector of the Nodes that can hold a replacement (the GPU pool); empty: any"
    )
    gpu_resource: str = Field("nvidia.com/gpu", description="a healthy spare has more than 0 of it allocatable")

    # --- fencing ---
    taint_key: str = "recovery.gpu/unhealthy"
    taint_effect: TaintEffect = "NoSchedule"
    condition_type: str = Field("GPURecoveryFenced", description="the Node condition the fence sets")

    # --- eviction ---
    eviction_deadline_seconds: float = Field(
        600.0, gt=0, description="how long a PodDisruptionBudget may keep refusing (429) the eviction"
    )
    termination_deadline_seconds: float = Field(
        300.0, gt=0, description="how long an evicted slurmd pod may stay Terminating"
    )
    eviction_backoff_seconds: float = Field(1.0, gt=0, description="first wait after a 429; doubles up to 30 s")
    watch_seconds: int = Field(
        5, ge=1, le=60, description="timeoutSeconds of each watch: the heartbeat cadence of long waits"
    )
    request_timeout_seconds: float = Field(
        30.0, gt=0, description="how long one API request may go unanswered before it fails (and is retried)"
    )

    # --- replacement ---
    replacement: ReplacementKind = "nodeset"
    nodeset_name: str = Field("", description="the NodeSet of the slurmd pods (nodeset provider)")
    nodeset_version: NodeSetVersion | None = Field(
        None,
        description="the version of slinky.slurm.net to use; unset: the one the cluster serves (v1beta1 from "
        "slurm-operator 1.0 on, v1alpha1 before)",
    )
    nodeset_scale_up: bool = Field(
        False,
        description="add one replica per incident through /scale; false: the NodeSet recreates the "
        "evicted pod on a healthy Node (right unless its pods are pinned to their Nodes). Either way a "
        "StatefulSet-mode NodeSet: a DaemonSet-mode one takes no replicas, and needs node-lifecycle or http",
    )
    replace_label: str = Field(
        "recovery.gpu/replace=true", description="key=value put on the failed Node for the node lifecycle"
    )
    delete_node: bool = Field(False, description="node-lifecycle provider: also delete the failed Node object")
    http_url: str = Field("", description="base URL of the replacement API (docs/replacement-http-provider.md)")
    http_token: SecretStr | None = None
    http_token_file: Path | None = Field(None, description="a file holding the token (instead of http_token)")
    http_timeout_seconds: float = Field(1800.0, gt=0, description="how long a replacement may take")
    http_poll_seconds: float = Field(10.0, gt=0)

    _secrets_not_blank = field_validator("http_token")(secret_not_blank)

    @field_validator("replace_label")
    @classmethod
    def _is_key_value(cls, value: str) -> str:
        key, sep, _ = value.partition("=")
        if not (sep and key):
            raise ValueError("RECOVERY_K8S_REPLACE_LABEL: write key=value")
        return value

    @model_validator(mode="after")
    def _provider_is_configured(self) -> KubernetesSettings:
        if self.http_token_file is not None:
            if self.http_token is not None:
                raise ValueError("set RECOVERY_K8S_HTTP_TOKEN or RECOVERY_K8S_HTTP_TOKEN_FILE, not both")
            try:
                token = self.http_token_file.read_text().strip()
            except OSError as e:
                raise ValueError(f"RECOVERY_K8S_HTTP_TOKEN_FILE: {e}") from e
            if not token:
                raise ValueError(f"RECOVERY_K8S_HTTP_TOKEN_FILE {self.http_token_file} is empty")
            self.http_token = SecretStr(token)
        if self.enabled and self.replacement == "nodeset" and not self.nodeset_name:
            raise ValueError("the nodeset provider needs RECOVERY_K8S_NODESET_NAME")
        if self.enabled and self.replacement == "http" and not self.http_url:
            raise ValueError("the http provider needs RECOVERY_K8S_HTTP_URL")
        return self

    def nodeset(self) -> NodeSetRef:
        return NodeSetRef(namespace=self.namespace, name=self.nodeset_name, version=self.nodeset_version)
