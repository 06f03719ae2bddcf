"""The Kubelet and Provisioner simulators, each seen from the controller's side: over the API,
through list and watch, with deadlines. On a real cluster (RECOVERY_TEST_KUBECONFIG) they act on
the seeded Nodes and pods only, and the Nodes a Provisioner makes are deleted after the test."""

from __future__ import annotations

import time

import pytest
from kubernetes import client, watch

from kubesim.simulators import Kubelet, Provisioner
from tests.kubeapi.fixtures import eventually

NODESET = ("slinky.slurm.net", "v1alpha1")


@pytest.fixture
def core(kube_api, kube_client) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


def gone(core: client.CoreV1Api, name: str, namespace: str) -> bool:
    return not core.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}").items


def ready_gpus(node: client.V1Node) -> str | None:
    """The node's allocatable GPUs once it is Ready, else None."""
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    return (node.status.allocatable or {}).get("nvidia.com/gpu") if ready else None


def test_kubelet_finishes_an_evicted_pod_after_its_grace_period(core, kube_client, kube_seed, kube_namespace):
    kube_seed.node("gpu-0")
    kube_seed.pod("train", kube_namespace, node="gpu-0", grace=2)
    kube_seed.pod("other-node", kube_namespace, node="gpu-1", grace=2)
    with Kubelet(kube_client, node="gpu-0") as kubelet:
        evicted_at = time.monotonic()
        for name in ("train", "other-node"):
            core.create_namespaced_pod_eviction(
                name,
                kube_namespace,
                client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=kube_namespace)),
            )
        # deletionTimestamp has whole seconds: a 2 s grace period leaves the pod more than 1 s.
        assert core.read_namespaced_pod("train", kube_namespace).metadata.deletion_timestamp is not None
        eventually(lambda: gone(core, "train", kube_namespace))
        assert time.monotonic() - evicted_at > 1
    assert kubelet.finished == [f"{kube_namespace}/train"]
    assert core.read_namespaced_pod("other-node", kube_namespace).metadata.deletion_timestamp is not None


def test_kubelet_can_finish_sooner_than_the_grace_period(core, kube_client, kube_seed, kube_namespace):
    kube_seed.node("gpu-0")
    kube_seed.pod("train", kube_namespace, node="gpu-0", grace=300)
    with Kubelet(kube_client, finish_after=0.1):
        core.delete_namespaced_pod("train", kube_namespace)
        eventually(lambda: gone(core, "train", kube_namespace))


def test_kubelet_runs_the_pre_stop_hook_once_while_the_pod_is_still_there(core, kube_client, kube_seed, kube_namespace):
    kube_seed.node("gpu-0")
    kube_seed.pod("slurmd", kube_namespace, node="gpu-0", grace=300)
    hooked: list[tuple[str, bool]] = []

    def pre_stop(pod):  # as Slinky's slurmd preStop: the pod is Terminating and still exists
        still_there = core.read_namespaced_pod(pod.metadata.name, kube_namespace).metadata.deletion_timestamp
        hooked.append((pod.metadata.name, still_there is not None))

    with Kubelet(kube_client, finish_after=0.5, pre_stop=pre_stop):
        core.delete_namespaced_pod("slurmd", kube_namespace)
        eventually(lambda: gone(core, "slurmd", kube_namespace))
    assert hooked == [("slurmd", True)]


def test_provisioner_answers_a_nodeset_scale_up_with_a_ready_gpu_node(
    core, kube_client, kube_namespace, kube_provisioner
):
    custom = client.CustomObjectsApi(kube_client)
    custom.create_namespaced_custom_object(
        *NODESET,
        kube_namespace,
        "nodesets",
        {
            "apiVersion": "slinky.slurm.net/v1alpha1",
            "kind": "NodeSet",
            "metadata": {"name": "gpu"},
            "spec": {"replicas": 1},
        },
    )
    listed = core.list_node()
    with kube_provisioner(kube_client, name_pattern="gpu-new-{n}", ready_after=0.2, gpus=8) as provisioner:
        custom.patch_namespaced_custom_object_scale(
            *NODESET, kube_namespace, "nodesets", "gpu", {"spec": {"replicas": 2}}
        )
        seen = []
        for event in watch.Watch().stream(
            core.list_node, resource_version=listed.metadata.resource_version, timeout_seconds=5
        ):
            node = event["object"]
            seen.append((event["type"], node.metadata.name, ready_gpus(node)))
            if ready_gpus(node):
                break
        assert seen == [("ADDED", "gpu-new-0", None), ("MODIFIED", "gpu-new-0", "8")]
        eventually(
            lambda: (
                custom.get_namespaced_custom_object(*NODESET, kube_namespace, "nodesets", "gpu")
                .get("status", {})
                .get("replicas")
                == 1
            )
        )
    assert provisioner.created == ["gpu-new-0"]


def test_provisioner_replaces_a_deleted_node(core, kube_client, kube_seed, kube_provisioner):
    kube_seed.node("gpu-new-0")
    kube_seed.node("gpu-3")
    with kube_provisioner(kube_client, ready_after=0.1) as provisioner:
        core.delete_node("gpu-3")
        eventually(lambda: provisioner.created and ready_gpus(core.read_node(provisioner.created[0])))
    assert provisioner.created == ["gpu-new-1"]  # the lowest free name


def test_provisioner_replaces_a_node_labelled_for_replacement(core, kube_client, kube_seed, kube_provisioner):
    kube_seed.node("gpu-3")
    with kube_provisioner(
        kube_client, replace_label="recovery/replace", ready_after=0.1, gpus=4, labels={"pool": "spare"}
    ) as provisioner:
        core.patch_node("gpu-3", {"metadata": {"labels": {"recovery/replace": "xid-79"}}})
        eventually(lambda: provisioner.created and ready_gpus(core.read_node(provisioner.created[0])) == "4")
        core.patch_node("gpu-3", {"metadata": {"labels": {"touched": "again"}}})
        ticks = provisioner.ticks  # a node is replaced once, however often it changes afterwards
        eventually(lambda: provisioner.ticks >= ticks + 3)
    assert provisioner.created == ["gpu-new-0"]
    assert core.read_node("gpu-new-0").metadata.labels == {"pool": "spare"}


def test_a_failing_simulator_reports_its_error_on_stop(kube_api, kube_client):
    provisioner = Provisioner(kube_client).start()
    kube_api.fail_next.extend([(500, "InternalError")] * 5)
    eventually(lambda: provisioner.error is not None)
    with pytest.raises(RuntimeError, match="Provisioner simulator failed"):
        provisioner.stop()
