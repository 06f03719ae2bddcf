"""The NodeSet provider by the NodeSet's scaling mode: a StatefulSet-mode NodeSet recreates the
evicted pod (or, configured to, gains a replica); a DaemonSet-mode one runs a pod per matching
Node and ignores replicas, so the provider declines, saying which provider can bring a Node, and
writes nothing (before: it claimed the NodeSet would recreate the pod, or scaled a count Slinky ignores)."""

from __future__ import annotations

import pytest
from kubernetes import client

from backends.kubernetes.providers import NodeSetReplacement
from contracts.kubernetes import NODESET_GROUP, NODESET_PLURAL, NodeSetRef
from tests.kube.test_k8s_nodeset_versions import NAMESPACE, create_nodeset, request, serving  # noqa: F401


def nodeset(api: client.ApiClient) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(
        NODESET_GROUP, "v1beta1", NAMESPACE, NODESET_PLURAL, "gpu"
    )


@pytest.mark.parametrize("scale_up", [False, True])
async def test_a_daemonset_mode_nodeset_is_not_asked_for_capacity_it_cannot_give(serving, scale_up):  # noqa: F811
    api = serving("v1beta1")
    create_nodeset(api, "v1beta1", {"controllerRef": {"name": "slurm"}, "scalingMode": "DaemonSet"})
    before = nodeset(api)
    provider = NodeSetReplacement(api, NodeSetRef(namespace=NAMESPACE, name="gpu"), scale_up=scale_up)
    result = await provider.request(request(), lambda _: None)
    assert not result.accepted
    assert "scalingMode DaemonSet" in result.detail and "RECOVERY_K8S_REPLACEMENT=node-lifecycle" in result.detail
    assert [(a.action, a.path) for a in result.actions] == [("request_k8s_replacement", "none")]
    assert nodeset(api)["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


async def test_a_statefulset_mode_nodeset_recreates_the_pod_under_its_identity(serving):  # noqa: F811
    api = serving("v1beta1")
    create_nodeset(api, "v1beta1", {"controllerRef": {"name": "slurm"}, "replicas": 4})  # the default mode
    provider = NodeSetReplacement(api, NodeSetRef(namespace=NAMESPACE, name="gpu"), scale_up=False)
    result = await provider.request(request(), lambda _: None)
    assert result.accepted
    assert result.detail == (
        "the NodeSet recreates slurmd pod gpu-2, Slurm node and all, on another Node that can take it "
        "(4 replicas, scalingMode StatefulSet)"
    )
