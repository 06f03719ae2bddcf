"""Discovery, authentication, TLS, the ways a client gets configured, and the test hooks on
requests (the request log, injected faults)."""

from __future__ import annotations

import json

import pytest
import urllib3
from kubernetes import client, config
from kubernetes.config.incluster_config import InClusterConfigLoader
from kubernetes.dynamic import DynamicClient

from kubesim.server import KubeApiServer
from tests.kubeapi.fixtures import expect_api_error, raw_request


def test_version_and_discovery_documents(kube_client):
    assert client.VersionApi(kube_client).get_code().major == "1"
    groups = {g.name: g.preferred_version.group_version for g in client.ApisApi(kube_client).get_api_versions().groups}
    assert groups["slinky.slurm.net"] == "slinky.slurm.net/v1alpha1"
    assert {"policy", "coordination.k8s.io"} <= set(groups)
    core = {r.name: r for r in client.CoreV1Api(kube_client).get_api_resources().resources}
    assert {
        "nodes",
        "nodes/status",
        "pods",
        "pods/status",
        "pods/eviction",
        "namespaces",
        "events",
        "configmaps",
        "secrets",
    } <= set(core)
    assert core["pods"].namespaced and not core["nodes"].namespaced and "watch" in core["nodes"].verbs
    nodesets = {
        r.name: r
        for r in client.CustomObjectsApi(kube_client).get_api_resources("slinky.slurm.net", "v1alpha1").resources
    }
    assert nodesets["nodesets"].kind == "NodeSet" and nodesets["nodesets/scale"].kind == "Scale"


def test_the_dynamic_client_discovers_and_uses_resources(kube_client, kube_namespace, kube_seed, tmp_path):
    kube_seed.node(f"{kube_namespace}-n0")
    dynamic = DynamicClient(kube_client, cache_file=str(tmp_path / "discovery.json"))
    nodesets = dynamic.resources.get(api_version="slinky.slurm.net/v1alpha1", kind="NodeSet")
    nodesets.create(
        body={
            "apiVersion": "slinky.slurm.net/v1alpha1",
            "kind": "NodeSet",
            "metadata": {"name": "gpu"},
            "spec": {"replicas": 1},
        },
        namespace=kube_namespace,
    )
    nodesets.patch(
        body={"spec": {"replicas": 2}},
        name="gpu",
        namespace=kube_namespace,
        content_type="application/merge-patch+json",
    )
    assert nodesets.get(name="gpu", namespace=kube_namespace).spec.replicas == 2
    nodes = dynamic.resources.get(api_version="v1", kind="Node")
    assert nodes.get(name=f"{kube_namespace}-n0").metadata.name == f"{kube_namespace}-n0"


def test_the_kube_client_fixture_leaves_the_global_configuration_alone(kube_api, kube_client):
    assert kube_client.configuration.host != client.Configuration.get_default_copy().host


def test_a_request_without_the_bearer_token_is_401(kube_api):
    for api_key in ({}, {"BearerToken": "Bearer wrong-token"}):
        configuration = client.Configuration(host=kube_api.url, api_key=api_key)
        configuration.ssl_ca_cert = kube_api.ca_file
        with client.ApiClient(configuration) as anonymous:
            status = expect_api_error(401, client.CoreV1Api(anonymous).list_node)
            assert status["reason"] == "Unauthorized"


def test_a_client_that_does_not_trust_the_certificate_is_refused(kube_api):
    configuration = client.Configuration(host=kube_api.url, api_key={"BearerToken": f"Bearer {kube_api.token}"})
    configuration.retries = 0
    with client.ApiClient(configuration) as untrusting:
        with pytest.raises(urllib3.exceptions.MaxRetryError, match="CERTIFICATE_VERIFY_FAILED"):
            client.CoreV1Api(untrusting).list_node()


def test_the_in_cluster_config_loader_works_over_https(kube_api, tmp_path):
    token_file, ca_file = tmp_path / "token", tmp_path / "ca.crt"
    token_file.write_text(kube_api.token)  # no trailing newline: the client would send it in the header
    ca_file.write_text(open(kube_api.ca_file).read())
    port = kube_api.url.rsplit(":", 1)[1]
    configuration = client.Configuration()
    InClusterConfigLoader(
        token_filename=str(token_file),
        cert_filename=str(ca_file),
        environ={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port},
    ).load_and_set(configuration)
    with client.ApiClient(configuration) as in_cluster:
        assert client.CoreV1Api(in_cluster).read_namespace("default").metadata.name == "default"


def test_plain_http_without_a_token(tmp_path):
    with KubeApiServer(tls=False, token=None) as server:
        assert server.url.startswith("http://")
        with config.new_client_from_config(config_file=server.kubeconfig(tmp_path / "kubeconfig")) as api_client:
            assert client.CoreV1Api(api_client).read_namespace("kube-system").status.phase == "Active"


def test_injected_faults_answer_the_next_requests(kube_api, kube_client):
    core = client.CoreV1Api(kube_client)
    kube_api.fail_next.extend([(500, "InternalError"), (429, "TooManyRequests")])
    assert expect_api_error(500, core.list_node)["reason"] == "InternalError"
    assert expect_api_error(429, core.list_node)["reason"] == "TooManyRequests"
    core.list_node()


def test_the_request_log_tells_reads_from_writes(kube_api, kube_client, kube_namespace):
    core = client.CoreV1Api(kube_client)
    before = len(kube_api.writes())
    core.list_node(label_selector="pool=a100")
    core.read_namespace(kube_namespace)
    assert kube_api.writes()[before:] == []
    assert kube_api.requests[-2:] == [
        ("GET", "/api/v1/nodes?labelSelector=pool%3Da100"),
        ("GET", f"/api/v1/namespaces/{kube_namespace}"),
    ]
    core.patch_namespace(kube_namespace, {"metadata": {"labels": {"a": "b"}}})
    assert kube_api.writes()[before:] == [("PATCH", f"/api/v1/namespaces/{kube_namespace}")]


def test_unknown_paths_and_methods(kube_api, kube_client):
    for path in ("/api/v2/nodes", "/apis/nope/v1/things", "/api/v1/nodes/n/log", "/api/v1/widgets"):
        status, body = raw_request(kube_client, "GET", path)
        assert status == 404 and json.loads(body)["kind"] == "Status", path
    for method, path in (("PUT", "/api/v1/nodes"), ("POST", "/api/v1/pods"), ("DELETE", "/api/v1/nodes/n/status")):
        status, _ = raw_request(kube_client, method, path, body={})
        assert status == 405, (method, path)
