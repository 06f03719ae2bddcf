"""PATCH in its three formats. The official client picks the format from the body: a dict is a
strategic merge patch for built-in types and a JSON merge patch for custom objects, a list is a
JSON patch; `_content_type` forces one."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from tests.kubeapi.fixtures import expect_api_error, raw_request

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
NODESET = ("slinky.slurm.net", "v1alpha1")


@pytest.fixture
def core(kube_client) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


@pytest.fixture
def node(core, kube_namespace) -> str:
    name = f"{kube_namespace}-n0"
    core.create_node(
        {
            "metadata": {"name": name, "labels": {"pool": "a100"}},
            "spec": {"taints": [{"key": "old", "effect": "NoSchedule"}]},
        }
    )
    core.patch_node_status(
        name,
        {"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "GpuHealthy", "status": "True"}]}},
    )
    yield name
    core.delete_node(name)


def test_strategic_merge_merges_node_conditions_by_type(core, node):
    patched = core.patch_node_status(
        node, {"status": {"conditions": [{"type": "GpuHealthy", "status": "False", "reason": "Xid79"}]}}
    )
    conditions = {c.type: (c.status, c.reason) for c in patched.status.conditions}
    assert conditions == {"Ready": ("True", None), "GpuHealthy": ("False", "Xid79")}


def test_strategic_merge_replaces_node_taints_whole(core, node):
    # NodeSpec.Taints is +listType=atomic with no patch strategy: the list is replaced.
    patched = core.patch_node(node, {"spec": {"taints": [{"key": "new", "effect": "NoExecute"}]}})
    assert [t.key for t in patched.spec.taints] == ["new"]


def test_strategic_merge_null_deletes_a_key(core, node):
    patched = core.patch_node(node, {"metadata": {"labels": {"pool": None, "drained": "true"}}})
    assert patched.metadata.labels == {"drained": "true"}


def test_strategic_merge_patch_delete_directive_removes_a_list_element(core, node):
    patched = core.patch_node_status(node, {"status": {"conditions": [{"type": "GpuHealthy", "$patch": "delete"}]}})
    assert [c.type for c in patched.status.conditions] == ["Ready"]


def test_strategic_merge_merges_containers_by_name_and_owner_references_by_uid(core, kube_namespace):
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "o1", "uid": "uid-1"}
    core.create_namespaced_pod(
        kube_namespace,
        {
            "metadata": {"name": "p", "ownerReferences": [owner]},
            "spec": {"containers": [{"name": "a", "image": "img:1"}, {"name": "b", "image": "img:1"}]},
        },
    )
    patched = core.patch_namespaced_pod(
        "p",
        kube_namespace,
        {
            "metadata": {"ownerReferences": [{**owner, "uid": "uid-2", "name": "o2"}]},
            "spec": {"containers": [{"name": "b", "image": "img:2"}]},
        },
    )
    assert [(c.name, c.image) for c in patched.spec.containers] == [("a", "img:1"), ("b", "img:2")]
    assert [o.uid for o in patched.metadata.owner_references] == ["uid-1", "uid-2"]


def test_strategic_merge_merges_finalizers_as_a_set(core, kube_namespace):
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm", "finalizers": ["a/x"]}})
    patched = core.patch_namespaced_config_map("cm", kube_namespace, {"metadata": {"finalizers": ["a/x", "b/y"]}})
    assert patched.metadata.finalizers == ["a/x", "b/y"]
    patched = core.patch_namespaced_config_map(
        "cm", kube_namespace, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a/x", "b/y"]}}
    )
    assert not patched.metadata.finalizers


def test_merge_patch_replaces_lists(core, node):
    patched = core.patch_node_status(
        node, {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, _content_type=MERGE
    )
    assert [(c.type, c.status) for c in patched.status.conditions] == [("Ready", "False")]


def test_json_patch_applies_operations_in_order(core, node):
    patched = core.patch_node(
        node,
        [
            {"op": "test", "path": "/metadata/labels/pool", "value": "a100"},
            {"op": "add", "path": "/spec/taints/-", "value": {"key": "added", "effect": "NoSchedule"}},
        ],
    )
    assert [t.key for t in patched.spec.taints] == ["old", "added"]


def test_json_patch_with_a_failed_test_is_422_and_changes_nothing(core, node):
    before = core.read_node(node)
    expect_api_error(
        422,
        core.patch_node,
        node,
        [
            {"op": "add", "path": "/metadata/labels/x", "value": "y"},
            {"op": "test", "path": "/metadata/labels/pool", "value": "h100"},
        ],
    )
    assert core.read_node(node).metadata.resource_version == before.metadata.resource_version


def test_json_patch_body_must_be_a_list(kube_client, node):
    status, body = raw_request(
        kube_client, "PATCH", f"/api/v1/nodes/{node}", body={"op": "add"}, content_type=JSON_PATCH
    )
    assert status == 400 and json.loads(body)["reason"] == "BadRequest"


def test_an_unknown_patch_type_is_415(kube_client, node):
    status, _ = raw_request(kube_client, "PATCH", f"/api/v1/nodes/{node}", body={}, content_type="text/plain")
    assert status == 415


def test_a_resource_version_in_a_patch_is_a_precondition(core, node):
    current = core.read_node(node).metadata.resource_version
    core.patch_node(node, {"metadata": {"labels": {"step": "1"}}})
    status = expect_api_error(
        409, core.patch_node, node, {"metadata": {"resourceVersion": current, "labels": {"step": "2"}}}
    )
    assert status["reason"] == "Conflict"
    fresh = core.read_node(node).metadata.resource_version
    assert (
        core.patch_node(node, {"metadata": {"resourceVersion": fresh, "labels": {"step": "2"}}}).metadata.labels["step"]
        == "2"
    )


def test_custom_objects_take_merge_patches_but_not_strategic_ones(kube_client, kube_namespace):
    custom = client.CustomObjectsApi(kube_client)
    custom.create_namespaced_custom_object(
        *NODESET,
        kube_namespace,
        "nodesets",
        {
            "apiVersion": "slinky.slurm.net/v1alpha1",
            "kind": "NodeSet",
            "metadata": {"name": "ns"},
            "spec": {"replicas": 1, "template": {"labels": {"a": "1"}}},
        },
    )
    patched = custom.patch_namespaced_custom_object(
        *NODESET, kube_namespace, "nodesets", "ns", {"spec": {"template": {"labels": {"b": "2"}}}}
    )
    assert patched["spec"]["template"]["labels"] == {"a": "1", "b": "2"}
    status = expect_api_error(
        415,
        custom.patch_namespaced_custom_object,
        *NODESET,
        kube_namespace,
        "nodesets",
        "ns",
        {"spec": {"replicas": 2}},
        _content_type="application/strategic-merge-patch+json",
    )
    assert status["reason"] == "UnsupportedMediaType"
    patched = custom.patch_namespaced_custom_object(
        *NODESET,
        kube_namespace,
        "nodesets",
        "ns",
        [{"op": "replace", "path": "/spec/replicas", "value": 3}],
        _content_type=JSON_PATCH,
    )
    assert patched["spec"]["replicas"] == 3


def test_patch_of_a_missing_object_is_404(core):
    expect_api_error(404, core.patch_node, "no-such-node", {"metadata": {"labels": {"a": "b"}}})
