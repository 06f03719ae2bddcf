"""One ApiClient per worker, from the first configuration that applies, never the global default.

Order: an explicit kubeconfig (RECOVERY_K8S_KUBECONFIG), then $KUBECONFIG, then the in-cluster
service account (KUBERNETES_SERVICE_HOST and a mounted token), then ~/.kube/config. Each is read
when the worker starts (the client's own KUBE_CONFIG_DEFAULT_LOCATION is fixed at import time),
and the client's process-wide default Configuration is never touched: two workers in one
process, or a test next to a worker, cannot leak credentials into each other.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kubernetes.client import ApiClient, Configuration
from kubernetes.config import new_client_from_config
from kubernetes.config.incluster_config import (
    SERVICE_HOST_ENV_NAME,
    InClusterConfigLoader,
)

from contracts.k8s_settings import KubernetesSettings


class NoKubernetesConfig(Exception):
    """No configuration applies: the message lists where it looked."""


@dataclass(frozen=True)
class LoadedClient:
    api: ApiClient
    source: str  # which configuration it came from, for the worker's start-up log


def load_api_client(settings: KubernetesSettings, environ: Mapping[str, str] = os.environ) -> LoadedClient:
    if settings.kubeconfig is not None:
        return _from_kubeconfig(str(settings.kubeconfig), settings.context, "RECOVERY_K8S_KUBECONFIG")
    if environ.get("KUBECONFIG"):
        # May name several files (':'-separated): the client merges them as kubectl does.
        return _from_kubeconfig(environ["KUBECONFIG"], settings.context, "KUBECONFIG")
    token = settings.service_account_dir / "token"
    if environ.get(SERVICE_HOST_ENV_NAME) and token.is_file():
        configuration = Configuration()
        InClusterConfigLoader(
            token_filename=str(token), cert_filename=str(settings.service_account_dir / "ca.crt"), environ=environ,
        ).load_and_set(configuration)
        return LoadedClient(ApiClient(configuration), f"in-cluster service account ({settings.service_account_dir})")
    home = Path(environ.get("HOME") or Path.home())
    default = home / ".kube" / "config"
    if default.is_file():
        return _from_kubeconfig(str(default), settings.context, "~/.kube/config")
    raise NoKubernetesConfig(
        "no Kubernetes configuration: set RECOVERY_K8S_KUBECONFIG or KUBECONFIG, run in a pod with a "
        f"service account ({token}), or provide {default}")


def _from_kubeconfig(path: str, context: str | None, source: str) -> LoadedClient:
    api = new_client_from_config(config_file=path, context=context, persist_config=False,
                                 client_configuration=Configuration())
    return LoadedClient(api, f"{source} ({path})")
