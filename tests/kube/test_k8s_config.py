"""Where the worker's ApiClient comes from, in order: an explicit kubeconfig, $KUBECONFIG, the
in-cluster service account, ~/.kube/config; never from or into the client's global default."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import urllib3
from kubernetes.client import Configuration, CoreV1Api

from backends.kubernetes import NoKubernetesConfig, load_api_client
from backends.kubernetes.api import watch_until
from contracts.k8s_settings import KubernetesSettings


@pytest.fixture(autouse=True)
def global_default_untouched():
    before = Configuration.get_default_copy().host
    yield
    assert Configuration.get_default_copy().host == before


def _settings(**values) -> KubernetesSettings:
    return KubernetesSettings(enabled=True, nodeset_name="gpu", **values)


def _works(loaded) -> None:
    try:
        CoreV1Api(loaded.api).list_node(limit=1)
    finally:
        loaded.api.close()


def test_an_explicit_kubeconfig_comes_first(kube_api, tmp_path):
    path = kube_api.kubeconfig(tmp_path / "explicit")
    loaded = load_api_client(
        _settings(kubeconfig=Path(path)), environ={"KUBECONFIG": str(tmp_path / "missing"), "HOME": str(tmp_path)}
    )
    assert loaded.source == f"RECOVERY_K8S_KUBECONFIG ({path})"
    _works(loaded)


def test_then_the_kubeconfig_environment_variable(kube_api, tmp_path):
    path = kube_api.kubeconfig(tmp_path / "from-env")
    loaded = load_api_client(
        _settings(), environ={"KUBECONFIG": str(path), "KUBERNETES_SERVICE_HOST": "10.0.0.1", "HOME": str(tmp_path)}
    )
    assert loaded.source == f"KUBECONFIG ({path})"
    _works(loaded)


def test_then_the_in_cluster_service_account(kube_api, tmp_path):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(kube_api.token)
    shutil.copy(kube_api.ca_file, account / "ca.crt")
    url = urlsplit(kube_api.url)
    loaded = load_api_client(
        _settings(service_account_dir=account),
        environ={
            "KUBERNETES_SERVICE_HOST": url.hostname,
            "KUBERNETES_SERVICE_PORT": str(url.port),
            "HOME": str(tmp_path),
        },
    )
    assert loaded.source.startswith("in-cluster service account")
    assert loaded.api.configuration.host == kube_api.url
    _works(loaded)


def test_then_the_home_directory_kubeconfig(kube_api, tmp_path):
    (tmp_path / ".kube").mkdir()
    kube_api.kubeconfig(tmp_path / ".kube" / "config")
    # A service host without a mounted token is not a pod: it does not count.
    loaded = load_api_client(
        _settings(service_account_dir=tmp_path / "none"),
        environ={"HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": "10.0.0.1"},
    )
    assert loaded.source == f"~/.kube/config ({tmp_path / '.kube' / 'config'})"
    _works(loaded)


def test_nothing_to_load_says_where_it_looked(tmp_path):
    with pytest.raises(NoKubernetesConfig, match="RECOVERY_K8S_KUBECONFIG or KUBECONFIG"):
        load_api_client(_settings(service_account_dir=tmp_path), environ={"HOME": str(tmp_path)})


def test_every_request_has_the_configured_time_out_and_a_watch_outlasts_it(kube_api, tmp_path):
    """An API server that never answers fails the call after RECOVERY_K8S_REQUEST_TIMEOUT_SECONDS
    (the client's own default is to wait forever); a watch window longer than that still runs."""
    path = kube_api.kubeconfig(tmp_path / "timed")
    loaded = load_api_client(
        _settings(kubeconfig=Path(path), request_timeout_seconds=0.5), environ={"HOME": str(tmp_path)}
    )
    core = CoreV1Api(loaded.api)
    try:
        stalled = kube_api.faults.inject("GET", r"^/api/v1/nodes/n1$", delay=3.0, times=None)
        started = time.monotonic()
        with pytest.raises(urllib3.exceptions.HTTPError):
            core.read_node("n1")
        assert time.monotonic() - started < 2.9 and stalled.hits >= 1
        kube_api.faults.clear()
        # 2 s of watching with nothing to see: no time-out error, the window just ends.
        objects, detail = asyncio.run(
            watch_until(
                core.list_node, _nothing_found, deadline=time.monotonic() + 2, watch_seconds=2, progress=lambda _: None
            )
        )
        assert objects is None and detail == "waiting"
    finally:
        loaded.api.close()


async def _nothing_found(objects):
    return None, "waiting"
