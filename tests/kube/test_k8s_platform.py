"""Slurm on Kubernetes behind the platform seam (backends/kubernetes/platform.py), through the
activities every incident runs (activities/platform.py): the fence finds the slurmd pod and fences
the Node under it, its handle carries what the release, the replacement and the return to service
need; the release evicts only what Slurm has let go of; the replacement is waited for until its
Node, its slurmd pod, Slurm and the health check hook all say it is in service."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError

from backends.health import HealthCheck
from contracts.models import FenceRequest, ReleaseRequest, ReplacementRequest, SlurmJob, SpareWaitRequest
from tests.kube.k8s_support import (
    NodeSetController,
    Recovery,
    SlurmStandIn,
    create_nodeset,
    ctx,
    k8s_settings,
    slurmd_pod,
)

FAILED, SLURM_NODE = "gpu-2", "slurmd-gpu-2"
DRAINED = "recovery: XID 79 incident gpu-2-20261130T001736Z by test"


@pytest.fixture
def cluster(kube_seed, kube_namespace):
    for node in (FAILED, "gpu-3"):
        kube_seed.node(node, labels={"pool": "gpu"})
        slurmd_pod(kube_seed, f"slurmd-{node}", kube_namespace, node, grace=1)
    return kube_seed


@pytest.fixture
def slurm() -> SlurmStandIn:
    view = SlurmStandIn()
    view.set(SLURM_NODE, "idle", "DRAIN", reason=DRAINED)
    view.set("slurmd-gpu-3", "allocated")
    view.set("slurmd-gpu-new-0", "idle")
    return view


def recovery_with(kube_api, namespace, tmp_path, slurm, health: HealthCheck | None = None) -> Recovery:
    settings = k8s_settings(
        kube_api,
        tmp_path,
        namespace=namespace,
        node_selector="pool=gpu",
        nodeset_scale_up=True,
        eviction_deadline_seconds=10,
        termination_deadline_seconds=10,
    )
    return Recovery(settings, slurm, health=health)


async def test_the_fence_handle_carries_the_pod_its_node_and_when_the_first_fence_began(
    kube_api, kube_namespace, tmp_path, cluster, slurm
):
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm)
    try:
        first = await recovery.run(recovery.platform.fence_node, FenceRequest(node=SLURM_NODE, ctx=ctx()))
        again = await recovery.run(recovery.platform.fence_node, FenceRequest(node=SLURM_NODE, ctx=ctx()))
    finally:
        recovery.close()
    handle = first.handle
    assert (handle.platform, handle.slurm_node, handle.spares_on_standby) == ("kubernetes", SLURM_NODE, False)
    assert handle.pod is not None and (handle.pod.name, handle.pod.node) == (SLURM_NODE, FAILED)
    assert handle.unfence_node == FAILED
    assert [a.action for a in first.actions] == ["fence_k8s_node", "set_k8s_node_condition"]
    assert first.detail.startswith(f"{kube_namespace}/{SLURM_NODE} on Node {FAILED}: ")
    # A retried fence writes nothing and keeps the first fence's time: replacements are newer than it.
    assert [a.path for a in again.actions] == ["none", "none"]
    assert again.handle.fenced_at == handle.fenced_at
    node = cluster.core.read_node(FAILED)
    assert node.spec.unschedulable


async def test_the_release_evicts_the_pod_only_once_slurm_has_let_go_of_the_node(
    kube_api, kube_namespace, tmp_path, cluster, slurm
):
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm)
    try:
        fenced = await recovery.run(recovery.platform.fence_node, FenceRequest(node=SLURM_NODE, ctx=ctx()))
        slurm.jobs = [SlurmJob(job_id=7, state="RUNNING", nodes=[SLURM_NODE])]
        with pytest.raises(ApplicationError) as refused:
            await recovery.run(recovery.platform.release_node, ReleaseRequest(handle=fenced.handle, ctx=ctx()))
        assert refused.value.type == "JobsStillRunning" and refused.value.non_retryable
        assert cluster.core.list_namespaced_pod(kube_namespace, field_selector=f"metadata.name={SLURM_NODE}").items
        slurm.jobs = []
        released = await recovery.run(recovery.platform.release_node, ReleaseRequest(handle=fenced.handle, ctx=ctx()))
    finally:
        recovery.close()
    assert [a.action for a in released.actions] == ["evict_slurmd_pod"]
    assert f"Slurm: {SLURM_NODE} idle+DRAIN" in released.detail


@pytest.mark.parametrize(
    ("hook", "healthy"),
    [(["true"], True), (["sh", "-c", "echo {node}: GPU 3 missing; exit 1"], False)],
    ids=["hook-passes", "hook-fails"],
)
async def test_the_replacement_is_in_service_once_the_health_check_hook_agrees(
    kube_api, kube_client, kube_provisioner, kube_namespace, tmp_path, cluster, slurm, hook, healthy
):
    create_nodeset(kube_client, kube_namespace, replicas=2)
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm, health=HealthCheck(hook))
    controller = NodeSetController(cluster, kube_namespace, known=[FAILED, "gpu-3"])
    controller.start()
    try:
        fenced = await recovery.run(recovery.platform.fence_node, FenceRequest(node=SLURM_NODE, ctx=ctx()))
        with kube_provisioner(kube_client, labels={"pool": "gpu"}):
            request = ReplacementRequest(failed_node=SLURM_NODE, spare_nodes=[], ctx=ctx(), handle=fenced.handle)
            asked = await recovery.run(recovery.platform.request_replacement, request)
            wait = SpareWaitRequest(node=asked.node, deadline_seconds=20, handle=fenced.handle)
            spare = await recovery.run(recovery.platform.wait_for_spare, wait)
    finally:
        controller.stop()
        recovery.close()
    assert asked.coming and asked.provider == "slinky-nodeset"
    assert spare.node == "slurmd-gpu-new-0" and spare.healthy is healthy
    assert spare.detail.startswith("slurmd-gpu-new-0 on Node gpu-new-0: ")
    if healthy:
        assert spare.in_service_at is not None and spare.detail.endswith("; health check passed")
    else:
        assert spare.detail.endswith("; health check exited 1: slurmd-gpu-new-0: GPU 3 missing"), spare.detail


async def test_a_call_without_the_fence_handle_is_refused(kube_api, kube_namespace, tmp_path, cluster, slurm):
    recovery = recovery_with(kube_api, kube_namespace, tmp_path, slurm)
    try:
        with pytest.raises(ValueError, match="pass the fence's handle"):
            await recovery.run(
                recovery.platform.request_replacement,
                ReplacementRequest(failed_node=SLURM_NODE, spare_nodes=[], ctx=ctx()),
            )
    finally:
        recovery.close()
