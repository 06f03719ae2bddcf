"""The NodeSet's API version, as clusters serve it: slurm-operator 1.x serves only
slinky.slurm.net/v1beta1 (and answers v1alpha1 with 404), 0.x served v1alpha1. The replacement
finds the served version through discovery, and what it writes to a v1beta1 NodeSet passes Slinky's
own CRD schema (kubesim/crds/), which the test server applies to every write as a real one does."""

from __future__ import annotations

import pytest
from kubernetes import client, config

from backends.kubernetes.errors import NodeSetNotFound
from backends.kubernetes.providers import NodeSetReplacement
from contracts.kubernetes import NODESET_GROUP, NODESET_PLURAL, K8sReplacementRequest, NodeSetRef
from kubesim import schemas
from kubesim.server import KubeApiServer
from kubesim.slinky import NODESET_CRD
from tests.kube.k8s_support import ctx
from tests.kubeapi.fixtures import expect_api_error

NAMESPACE = "slurm"


@pytest.fixture
def serving(tmp_path):
    """A fresh API server serving the given NodeSet versions (v1beta1 with Slinky's CRD schema),
    with the namespace, and a client of it."""
    servers = []

    def start(*versions: str) -> client.ApiClient:
        server = KubeApiServer().start()
        servers.append(server)
        for version in versions:
            server.register_crd(
                NODESET_GROUP, version, NODESET_PLURAL, "NodeSet", crd=NODESET_CRD if version == "v1beta1" else None
            )
        api = config.new_client_from_config(config_file=server.kubeconfig(tmp_path / f"kubeconfig-{len(servers)}"))
        client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
        return api

    yield start
    for server in servers:
        server.stop()


def create_nodeset(api: client.ApiClient, version: str, spec: dict) -> dict:
    body = {"apiVersion": f"{NODESET_GROUP}/{version}", "kind": "NodeSet", "metadata": {"name": "gpu"}, "spec": spec}
    return client.CustomObjectsApi(api).create_namespaced_custom_object(
        NODESET_GROUP, version, NAMESPACE, NODESET_PLURAL, body
    )


def scaling_up(api: client.ApiClient, version: str | None = None) -> NodeSetReplacement:
    return NodeSetReplacement(api, NodeSetRef(namespace=NAMESPACE, name="gpu", version=version), scale_up=True)


def request() -> K8sReplacementRequest:
    return K8sReplacementRequest(failed_node="k8s-gpu-2", slurm_node="gpu-2", ctx=ctx())


async def test_on_slinky_1x_the_replacement_finds_v1beta1_and_its_writes_pass_slinkys_schema(serving):
    api = serving("v1beta1")
    created = create_nodeset(api, "v1beta1", {"controllerRef": {"name": "slurm"}, "replicas": 2})
    # the server applies the CRD's defaults, as the real one does
    assert created["spec"]["scalingMode"] == "StatefulSet"
    provider = scaling_up(api)
    result = await provider.request(request(), lambda _: None)
    assert provider.version == "v1beta1" and result.accepted
    assert [a.action for a in result.actions] == ["claim_nodeset_scale_up", "scale_nodeset"]
    assert all(f"/apis/{NODESET_GROUP}/v1beta1/namespaces/{NAMESPACE}/" in a.command for a in result.actions)
    nodeset = client.CustomObjectsApi(api).get_namespaced_custom_object(
        NODESET_GROUP, "v1beta1", NAMESPACE, NODESET_PLURAL, "gpu"
    )
    assert nodeset["spec"]["replicas"] == 3
    assert schemas.problems(NODESET_CRD, "v1beta1", nodeset) == []


def test_the_test_server_refuses_a_nodeset_that_breaks_slinkys_schema(serving):
    """The check above can fail: a NodeSet Slinky's CRD forbids is a 422, on create and on update."""
    api = serving("v1beta1")
    custom = client.CustomObjectsApi(api)
    for spec, field in (
        ({"replicas": 2}, "controllerRef"),  # required
        ({"controllerRef": {"name": "slurm"}, "scalingMode": "Deployment"}, "scalingMode"),  # not in its enum
        ({"controllerRef": {"name": "slurm"}, "replicas": "two"}, "replicas"),
        ({"controllerRef": {"name": "slurm"}, "replica": 2}, "replica"),  # unknown
    ):
        body = {"apiVersion": f"{NODESET_GROUP}/v1beta1", "kind": "NodeSet", "metadata": {"name": "bad"}, "spec": spec}
        refused = expect_api_error(
            422, custom.create_namespaced_custom_object, NODESET_GROUP, "v1beta1", NAMESPACE, NODESET_PLURAL, body
        )
        assert field in refused["message"], refused
    create_nodeset(api, "v1beta1", {"controllerRef": {"name": "slurm"}})
    expect_api_error(
        422,
        custom.patch_namespaced_custom_object,
        NODESET_GROUP,
        "v1beta1",
        NAMESPACE,
        NODESET_PLURAL,
        "gpu",
        {"spec": {"updateStrategy": {"type": "Sometimes"}}},
    )


async def test_a_cluster_still_on_v1alpha1_keeps_working(serving):
    api = serving("v1alpha1")
    create_nodeset(api, "v1alpha1", {"replicas": 2})
    provider = scaling_up(api)
    await provider.request(request(), lambda _: None)
    assert provider.version == "v1alpha1"
    assert (
        client.CustomObjectsApi(api).get_namespaced_custom_object(
            NODESET_GROUP, "v1alpha1", NAMESPACE, NODESET_PLURAL, "gpu"
        )["spec"]["replicas"]
        == 3
    )


async def test_a_cluster_serving_both_versions_is_asked_in_v1beta1(serving):
    api = serving("v1alpha1", "v1beta1")
    create_nodeset(api, "v1beta1", {"controllerRef": {"name": "slurm"}, "replicas": 1})
    provider = scaling_up(api)
    await provider.request(request(), lambda _: None)
    assert provider.version == "v1beta1"


async def test_no_nodeset_served_or_a_pinned_version_not_served_is_said_plainly(serving):
    with pytest.raises(NodeSetNotFound, match="is Slinky's slurm-operator installed"):
        await scaling_up(serving()).request(request(), lambda _: None)
    # pinned to v1alpha1 on a 1.x cluster: the 404 a user of the old default met, now with its version
    api = serving("v1beta1")
    create_nodeset(api, "v1beta1", {"controllerRef": {"name": "slurm"}})
    with pytest.raises(NodeSetNotFound, match=r"slinky.slurm.net/v1alpha1\) does not exist"):
        await scaling_up(api, "v1alpha1").request(request(), lambda _: None)
