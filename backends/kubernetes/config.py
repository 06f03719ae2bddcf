"""One ApiClient per worker, from the first configuration that applies, never the global default.

Order: an explicit kubeconfig (RECOVERY_K8S_KUBECONFIG), then $KUBECONFIG, then the in-cluster
service account (KUBERNETES_SERVICE_HOST and a mounted token), then ~/.kube/config. Each is read
when the worker starts (the client's own KUBE_CONFIG_DEFAULT_LOCATION is fixed at import time),
and the client's process-wide default Configuration is never touched: two workers in one
process, or a test next to a worker, cannot leak credentials into each other.

Every request has a time-out (RECOVERY_K8S_REQUEST_TIMEOUT_SECONDS): the official client waits
forever by default, and an API server that accepts a connection and never answers would hold
the call's thread, and the step that made it, until the activity's own timeout. A watch passes a
time-out of its own, longer than its timeoutSeconds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client import ApiClient, Configuration
from kubernetes.client.rest import RESTResponse
from kubernetes.config import load_kube_config
from kubernetes.config.incluster_config import (
    SERVICE_HOST_ENV_NAME,
    InClusterConfigLoader,
)

from contracts.k8s_settings import KubernetesSettings


class NoKubernetesConfig(Exception):
    """No configuration applies: the message lists where it looked."""


class TimedApiClient(ApiClient):
    """The official ApiClient with a default (connect, read) time-out for every request that
    does not set `_request_timeout` itself."""

    def __init__(self, configuration: Configuration, request_timeout: float):
        super().__init__(configuration)
        self.request_timeout = request_timeout

    def call_api(
        self,
        method: str,
        url: str,
        header_params: Any = None,
        body: Any = None,
        post_params: Any = None,
        _request_timeout: Any = None,
    ) -> RESTResponse:
        return super().call_api(
            method,
            url,
            header_params,
            body,
            post_params,
            self.request_timeout if _request_timeout is None else _request_timeout,
        )


@dataclass(frozen=True)
class LoadedClient:
    api: ApiClient
    source: str  # which configuration it came from, for the worker's start-up log


def load_api_client(settings: KubernetesSettings, environ: Mapping[str, str] = os.environ) -> LoadedClient:
    if settings.kubeconfig is not None:
        return _from_kubeconfig(str(settings.kubeconfig), settings, "RECOVERY_K8S_KUBECONFIG")
    if environ.get("KUBECONFIG"):
        # May name several files (':'-separated): the client merges them as kubectl does.
        return _from_kubeconfig(environ["KUBECONFIG"], settings, "KUBECONFIG")
    token = settings.service_account_dir / "token"
    if environ.get(SERVICE_HOST_ENV_NAME) and token.is_file():
        configuration = Configuration()
        InClusterConfigLoader(
            token_filename=str(token),
            cert_filename=str(settings.service_account_dir / "ca.crt"),
            environ=environ,
        ).load_and_set(configuration)
        return LoadedClient(
            TimedApiClient(configuration, settings.request_timeout_seconds),
            f"in-cluster service account ({settings.service_account_dir})",
        )
    home = Path(environ.get("HOME") or Path.home())
    default = home / ".kube" / "config"
    if default.is_file():
        return _from_kubeconfig(str(default), settings, "~/.kube/config")
    raise NoKubernetesConfig(
        "no Kubernetes configuration: set RECOVERY_K8S_KUBECONFIG or KUBECONFIG, run in a pod with a "
        f"service account ({token}), or provide {default}"
    )


def _from_kubeconfig(path: str, settings: KubernetesSettings, source: str) -> LoadedClient:
    configuration = Configuration()
    load_kube_config(
        config_file=path, context=settings.context, client_configuration=configuration, persist_config=False
    )
    return LoadedClient(TimedApiClient(configuration, settings.request_timeout_seconds), f"{source} ({path})")
