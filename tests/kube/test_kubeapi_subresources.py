"""The /status and /scale subresources, and metadata.generation."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.kubeapi.fixtures import expect_api_error

NODESET = ("slinky.slurm.net", "v1alpha1")


@pytest.fixture
def core(kube_client) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


@pytest.fixture
def custom(kube_client) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(kube_client)


@pytest.fixture
def nodeset(custom, kube_namespace) -> str:
    custom.create_namespaced_custom_object(
        *NODESET,
        kube_namespace,
        "nodesets",
        {
            "apiVersion": "slinky.slurm.net/v1alpha1",
            "kind": "NodeSet",
            "metadata": {"name": "gpu"},
            "spec": {"replicas": 2},
            "status": {"replicas": 9},
        },
    )
    return "gpu"


def test_node_status_writes_change_only_status(core, kube_seed, kube_namespace):
    name = f"{kube_namespace}-n0"
    kube_seed.node(name, labels={"pool": "a"})
    patched = core.patch_node_status(
        name,
        {
            "metadata": {"labels": {"pool": "b"}},
            "spec": {"unschedulable": True},
            "status": {"conditions": [{"type": "GpuHealthy", "status": "False"}]},
        },
    )
    assert patched.metadata.labels == {"pool": "a"} and not patched.spec.unschedulable
    assert "GpuHealthy" in {c.type for c in patched.status.conditions}


def test_node_main_resource_writes_ignore_status(core, kube_seed, kube_namespace):
    name = f"{kube_namespace}-n0"
    kube_seed.node(name)
    patched = core.patch_node(
        name, {"spec": {"unschedulable": True}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    assert patched.spec.unschedulable
    assert [(c.type, c.status) for c in patched.status.conditions] == [("Ready", "True")]
    node = core.read_node(name)
    node.status.conditions = []
    replaced = core.replace_node(name, node)
    assert [(c.type, c.status) for c in replaced.status.conditions] == [("Ready", "True")]


def test_pod_status_is_written_only_through_status(core, kube_namespace):
    core.create_namespaced_pod(
        kube_namespace,
        {
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]},
            "status": {"phase": "Running"},
        },
    )
    assert core.patch_namespaced_pod("p", kube_namespace, {"status": {"phase": "Failed"}}).status.phase == "Pending"
    assert (
        core.patch_namespaced_pod_status("p", kube_namespace, {"status": {"phase": "Running"}}).status.phase
        == "Running"
    )


def test_custom_resource_status_is_reset_on_create_and_written_through_status(custom, kube_namespace, nodeset):
    created = custom.get_namespaced_custom_object(*NODESET, kube_namespace, "nodesets", nodeset)
    assert "status" not in created
    ignored = custom.patch_namespaced_custom_object(
        *NODESET, kube_namespace, "nodesets", nodeset, {"status": {"replicas": 5}}
    )
    assert "status" not in ignored
    written = custom.patch_namespaced_custom_object_status(
        *NODESET, kube_namespace, "nodesets", nodeset, {"spec": {"replicas": 7}, "status": {"replicas": 1}}
    )
    assert written["status"] == {"replicas": 1} and written["spec"]["replicas"] == 2


def test_scale_reads_and_writes_an_autoscaling_v1_scale(custom, kube_namespace, nodeset):
    custom.patch_namespaced_custom_object_status(
        *NODESET, kube_namespace, "nodesets", nodeset, {"status": {"replicas": 2}}
    )
    scale = custom.get_namespaced_custom_object_scale(*NODESET, kube_namespace, "nodesets", nodeset)
    assert (scale["kind"], scale["apiVersion"]) == ("Scale", "autoscaling/v1")
    assert scale["spec"] == {"replicas": 2} and scale["status"]["replicas"] == 2
    patched = custom.patch_namespaced_custom_object_scale(
        *NODESET, kube_namespace, "nodesets", nodeset, {"spec": {"replicas": 3}}
    )
    assert patched["spec"]["replicas"] == 3
    scale = custom.get_namespaced_custom_object_scale(*NODESET, kube_namespace, "nodesets", nodeset)
    scale["spec"]["replicas"] = 4
    assert (
        custom.replace_namespaced_custom_object_scale(*NODESET, kube_namespace, "nodesets", nodeset, scale)["spec"][
            "replicas"
        ]
        == 4
    )
    assert custom.get_namespaced_custom_object(*NODESET, kube_namespace, "nodesets", nodeset)["spec"]["replicas"] == 4


def test_scale_with_a_stale_resource_version_is_409(custom, kube_namespace, nodeset):
    stale = custom.get_namespaced_custom_object_scale(*NODESET, kube_namespace, "nodesets", nodeset)
    custom.patch_namespaced_custom_object_scale(
        *NODESET, kube_namespace, "nodesets", nodeset, {"spec": {"replicas": 3}}
    )
    stale["spec"]["replicas"] = 5
    expect_api_error(
        409, custom.replace_namespaced_custom_object_scale, *NODESET, kube_namespace, "nodesets", nodeset, stale
    )


def test_generation_counts_spec_changes_only(custom, kube_namespace, nodeset):
    def generation() -> int:
        return custom.get_namespaced_custom_object(*NODESET, kube_namespace, "nodesets", nodeset)["metadata"][
            "generation"
        ]

    assert generation() == 1
    custom.patch_namespaced_custom_object(
        *NODESET, kube_namespace, "nodesets", nodeset, {"metadata": {"labels": {"a": "b"}}}
    )
    custom.patch_namespaced_custom_object_status(
        *NODESET, kube_namespace, "nodesets", nodeset, {"status": {"replicas": 1}}
    )
    assert generation() == 1
    custom.patch_namespaced_custom_object_scale(
        *NODESET, kube_namespace, "nodesets", nodeset, {"spec": {"replicas": 5}}
    )
    assert generation() == 2
