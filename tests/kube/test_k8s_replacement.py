"""Replacement capacity, end to end with the Provisioner (the cloud and node bootstrap) and a NodeSet
controller stand-in, and the wait for a healthy replacement: Node Ready, untainted, GPUs
allocatable, slurmd pod Ready, Slurm node idle, or an explicit failure at the deadline."""

from __future__ import annotations

import asyncio
import time

import pytest
from kubernetes import client
from temporalio.exceptions import ApplicationError

from contracts.kubernetes import (
    NODESET_GROUP,
    K8sNodeRequest,
    K8sReplacementRequest,
    K8sSpareWaitRequest,
)
from contracts.models import utc_now
from tests.kube.k8s_support import (
    NodeSetController,
    Recovery,
    SlurmStandIn,
    create_nodeset,
    ctx,
    k8s_settings,
    slurmd_pod,
)

FAILED = "gpu-2"


@pytest.fixture
def cluster(kube_seed, kube_namespace):
    """Two GPU Nodes, each with its slurmd pod (DaemonSet mode: hostname = pod name here)."""
    for node in (FAILED, "gpu-3"):
        kube_seed.node(node, labels={"pool": "gpu"})
        slurmd_pod(kube_seed, f"slurmd-{node}", kube_namespace, node)
    return kube_seed


@pytest.fixture
def slurm() -> SlurmStandIn:
    view = SlurmStandIn()
    view.set("slurmd-gpu-3", "allocated")  # busy with the requeued job: not a replacement
    view.set("slurmd-gpu-new-0", "idle")  # the Provisioner's first Node, once slurmd registers
    return view


def recovery_with(kube_api, namespace, tmp_path, slurm, **settings) -> Recovery:
    return Recovery(k8s_settings(kube_api, tmp_path, namespace=namespace, node_selector="pool=gpu", **settings), slurm)


def _request(slurm_node: str = f"slurmd-{FAILED}") -> K8sReplacementRequest:
    return K8sReplacementRequest(failed_node=FAILED, slurm_node=slurm_node, ctx=ctx())


def _wait(since, deadline: float = 20, node: str | None = None) -> K8sSpareWaitRequest:
    return K8sSpareWaitRequest(failed_node=FAILED, since=since, node=node, deadline_seconds=deadline)


async def test_nodeset_scale_up_brings_a_new_node_once(
    kube_api, kube_client, kube_provisioner, cluster, slurm, kube_namespace, tmp_path
):
    create_nodeset(kube_client, kube_namespace, replicas=2)
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm, nodeset_scale_up=True)
    since = utc_now()
    controller = NodeSetController(cluster, kube_namespace, known=[FAILED, "gpu-3"])
    controller.start()
    try:
        with kube_provisioner(kube_client, labels={"pool": "gpu"}) as provisioner:
            first = await recovery.run(recovery.activities.request_k8s_replacement, _request())
            again = await recovery.run(recovery.activities.request_k8s_replacement, _request())
            spare = await recovery.run(recovery.activities.wait_for_k8s_node, _wait(since))
        assert provisioner.created == ["gpu-new-0"]
    finally:
        controller.stop()
        recovery.close()
    scale = client.CustomObjectsApi(kube_client).get_namespaced_custom_object_scale(
        NODESET_GROUP, "v1alpha1", kube_namespace, "nodesets", "gpu"
    )
    assert scale["spec"]["replicas"] == 3
    assert first.accepted and [a.action for a in first.actions] == ["claim_nodeset_scale_up", "scale_nodeset"]
    assert [a.path for a in again.actions] == ["none", "none"]
    scale_writes = [r for r in kube_api.writes() if r[1].endswith("/nodesets/gpu/scale")]
    assert len(scale_writes) == 1
    assert (spare.healthy, spare.node, spare.slurm_node) == (True, "gpu-new-0", "slurmd-gpu-new-0")


async def test_nodeset_recreating_the_evicted_pod_on_a_free_node_is_the_replacement(
    kube_api, kube_client, kube_provisioner, cluster, slurm, kube_namespace, tmp_path
):
    create_nodeset(kube_client, kube_namespace, replicas=2)
    cluster.node("gpu-4", labels={"pool": "gpu"})  # free: no slurmd pod on it yet
    slurm.set("slurm-gpu-0", "idle")
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm)
    try:
        since = utc_now()
        asked = await recovery.run(recovery.activities.request_k8s_replacement, _request("slurm-gpu-0"))
        assert asked.accepted and [a.path for a in asked.actions] == ["none"]
        waiting = asyncio.ensure_future(recovery.run(recovery.activities.wait_for_k8s_node, _wait(since)))
        await asyncio.sleep(0.5)
        slurmd_pod(cluster, "slurm-gpu-0", kube_namespace, "gpu-4")  # the NodeSet controller's new pod
        spare = await asyncio.wait_for(waiting, 30)
    finally:
        recovery.close()
    assert (spare.healthy, spare.node, spare.slurm_node) == (True, "gpu-4", "slurm-gpu-0")


async def test_a_missing_nodeset_is_a_final_answer(kube_api, kube_namespace, slurm, tmp_path):
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm, nodeset_name="absent")
    try:
        with pytest.raises(ApplicationError) as raised:
            await recovery.run(recovery.activities.request_k8s_replacement, _request())
    finally:
        recovery.close()
    assert (raised.value.type, raised.value.non_retryable) == ("NodeSetNotFound", True)


@pytest.mark.parametrize("delete_node", [False, True])
async def test_node_lifecycle_gets_a_new_node(
    kube_api, kube_client, kube_provisioner, cluster, slurm, kube_namespace, tmp_path, delete_node
):
    recovery = recovery_with(
        kube_api, kube_namespace, tmp_path, slurm, replacement="node-lifecycle", delete_node=delete_node
    )
    await recovery.run(recovery.activities.fence_k8s_node, K8sNodeRequest(node=FAILED, ctx=ctx()))
    since = utc_now()
    controller = NodeSetController(cluster, kube_namespace, known=[FAILED, "gpu-3"])
    controller.start()
    try:
        with kube_provisioner(kube_client, labels={"pool": "gpu"}, replace_label="recovery.gpu/replace"):
            first = await recovery.run(recovery.activities.request_k8s_replacement, _request())
            again = await recovery.run(recovery.activities.request_k8s_replacement, _request())
            spare = await recovery.run(recovery.activities.wait_for_k8s_node, _wait(since))
    finally:
        controller.stop()
        recovery.close()
    assert (spare.healthy, spare.node) == (True, "gpu-new-0")
    node_writes = [r for r in kube_api.writes() if r[1] == f"/api/v1/nodes/{FAILED}"]
    if delete_node:
        assert [a.action for a in first.actions] == ["hand_node_to_lifecycle", "delete_node"]
        assert [m for m, _ in node_writes] == ["PUT", "PUT", "DELETE"]  # fence, label, delete
        assert again.actions[0].detail == "the Node is already gone"
    else:
        assert [m for m, _ in node_writes] == ["PUT", "PUT"]
        labels = cluster.core.read_node(FAILED).metadata.labels
        assert labels["recovery.gpu/replace"] == "true" and again.actions[0].path == "none"


async def test_only_a_healthy_node_counts_and_the_deadline_is_an_explicit_failure(
    kube_api, kube_seed, slurm, kube_namespace, tmp_path
):
    kube_seed.node(FAILED, labels={"pool": "gpu"})
    since = utc_now()
    kube_seed.node("gpu-t", labels={"pool": "gpu"}, taints=[{"key": "gpu.example/burn-in", "effect": "NoSchedule"}])
    kube_seed.node("gpu-z", labels={"pool": "gpu"}, gpus=0)
    kube_seed.node("gpu-n", labels={"pool": "gpu"}, ready=False)
    for node in ("gpu-t", "gpu-z", "gpu-n"):
        slurmd_pod(kube_seed, f"slurmd-{node}", kube_namespace, node)
        slurm.set(f"slurmd-{node}", "idle")
    slurmd_pod(kube_seed, "slurmd-gpu-2b", kube_namespace, FAILED)  # on the failed Node: never
    slurm.set("slurmd-gpu-2b", "idle")
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm)
    try:
        started = time.monotonic()
        spare = await recovery.run(recovery.activities.wait_for_k8s_node, _wait(since, deadline=2))
        took = time.monotonic() - started
        assert not spare.healthy and 2 <= took < 10
        for why in (
            "gpu-t: tainted gpu.example/burn-in=:NoSchedule",
            "gpu-z: no nvidia.com/gpu allocatable",
            "gpu-n: not Ready",
        ):
            assert why in spare.detail
        assert recovery.heartbeats, "a long wait heartbeats"

        kube_seed.core.patch_node("gpu-t", {"spec": {"taints": None}})
        spare = await recovery.run(recovery.activities.wait_for_k8s_node, _wait(since, deadline=10))
    finally:
        recovery.close()
    assert (spare.healthy, spare.node) == (True, "gpu-t")


async def test_slurm_must_show_the_replacement_idle(kube_api, kube_seed, slurm, kube_namespace, tmp_path):
    kube_seed.node("gpu-9", labels={"pool": "gpu"})
    since = utc_now()
    slurmd_pod(kube_seed, "slurmd-gpu-9", kube_namespace, "gpu-9")
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm)
    try:
        unregistered = await recovery.run(recovery.activities.wait_for_k8s_node, _wait(since, deadline=1))
        slurm.set("slurmd-gpu-9", "idle", "DRAIN")
        drained = await recovery.run(recovery.activities.wait_for_k8s_node, _wait(since, deadline=1))
        slurm.set("slurmd-gpu-9", "idle")
        named = await recovery.run(recovery.activities.wait_for_k8s_node, _wait(since, node="gpu-9"))
    finally:
        recovery.close()
    assert "not registered in Slurm yet" in unregistered.detail and not unregistered.healthy
    assert "idle+DRAIN" in drained.detail and not drained.healthy
    assert (named.healthy, named.slurm_node) == (True, "slurmd-gpu-9")


async def test_the_wait_lists_again_after_410_gone(kube_api, kube_seed, slurm, kube_namespace, tmp_path):
    kube_seed.node(FAILED, labels={"pool": "gpu"})
    since = utc_now()
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm)
    node_lists = lambda: sum(  # noqa: E731
        1 for m, p in kube_api.requests if m == "GET" and p.startswith("/api/v1/nodes?") and "watch=" not in p
    )
    try:
        waiting = asyncio.ensure_future(recovery.run(recovery.activities.wait_for_k8s_node, _wait(since, 30)))
        while node_lists() < 2:  # history moves on without the watched Nodes, then is compacted away
            assert not waiting.done(), waiting.result()
            kube_seed.core.create_namespaced_config_map(kube_namespace, {"metadata": {"generateName": "noise-"}})
            kube_api.compact()
            await asyncio.sleep(0.3)
        kube_seed.node("gpu-new-0", labels={"pool": "gpu"})
        slurmd_pod(kube_seed, "slurmd-gpu-new-0", kube_namespace, "gpu-new-0")
        spare = await asyncio.wait_for(waiting, 30)
    finally:
        recovery.close()
    assert (spare.healthy, spare.node) == (True, "gpu-new-0")
