"""The simulated NodeSet controller in each scaling mode (kubesim/slinky.py NodeSetController,
as Slinky 1.2's nodeset_sync.go has it), against the real Slurm cluster, after a fence like the
recovery's (the Node cordoned and tainted NoSchedule, the Slurm node drained) and the slurmd pod's
end: in StatefulSet mode the pod comes back under its identity on another Node and the operator
sets its Slurm node IDLE; in DaemonSet mode the fenced Node gets no pod, and a new Node brings one,
its Slurm node named by the Node."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client, config

from contracts.kubernetes import SLURMD_PRE_STOP_REASON
from drills.localstack import wait_async
from kubesim.server import KubeApiServer
from kubesim.slinky import HOSTNAME_OVERRIDE_ANNOTATION, SCALING_MODE_LABEL, SLURMD_SELECTOR, SlinkyCluster, is_ready

pytestmark = pytest.mark.slurm

FAILED = "gpu-4"  # no other test's job lands here while this module runs
COMPUTE, SPARES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"], ["gpu-5"]
REPLACE_LABEL = "recovery.gpu/replace"


@pytest.fixture
async def slinky(slurm_cluster, drill, request):
    """A Slinky cluster of the given scaling mode over the session's Slurm cluster; Slurm as the
    drills start it, before and after. Yields the cluster, a CoreV1Api and the Slurm nodes it
    reported moved."""
    await drill.reset_cluster()
    moved: list[str] = []
    server = KubeApiServer().start()
    cluster = SlinkyCluster(
        server,
        drill.slurm,
        compute_nodes=COMPUTE,
        spare_nodes=SPARES,
        scaling_mode=request.param,
        replace_label=REPLACE_LABEL,
        on_moved=moved.append,
    )
    await asyncio.to_thread(cluster.start)
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        yield cluster, client.CoreV1Api(api), moved
    finally:
        api.close()
        await asyncio.to_thread(cluster.stop)
        server.stop()
        await drill.reset_cluster()


def slurmd_pods(core: client.CoreV1Api) -> dict[str, client.V1Pod]:
    """The live slurmd pods by hostname (their Slurm node)."""
    pods = core.list_namespaced_pod("slurm", label_selector=SLURMD_SELECTOR).items
    return {p.spec.hostname: p for p in pods if p.metadata.deletion_timestamp is None}


async def fence_and_end_the_pod(cluster: SlinkyCluster, core: client.CoreV1Api, drill) -> client.V1Pod:
    """As the recovery does: drain, cordon and taint, then the pod goes (its preStop sets DOWN)."""
    await drill.slurm.update_node(FAILED, "DRAIN", "recovery: XID 79 (test)")
    taint = {"key": "recovery.gpu/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
    core.patch_node(cluster.node_of(FAILED), {"spec": {"unschedulable": True, "taints": [taint]}})
    pod = slurmd_pods(core)[FAILED]
    core.delete_namespaced_pod(pod.metadata.name, "slurm")
    return pod


@pytest.mark.parametrize("slinky", ["StatefulSet"], indirect=True)
async def test_statefulset_mode_recreates_the_pod_under_its_identity_on_another_node(slinky, drill):
    cluster, core, moved = slinky
    pods = slurmd_pods(core)
    assert {p.metadata.name for p in pods.values()} == set(COMPUTE)  # named by identity
    assert {p.metadata.labels[SCALING_MODE_LABEL] for p in pods.values()} == {"StatefulSet"}
    gone = await fence_and_end_the_pod(cluster, core, drill)

    async def back_elsewhere():
        pod = slurmd_pods(core).get(FAILED)
        fresh = pod is not None and pod.metadata.uid != gone.metadata.uid and is_ready(pod)
        return pod if fresh else None

    pod = await wait_async(back_elsewhere, 30, f"{FAILED}'s pod recreated")
    # Same name and Slurm node, on the Node ordered for it (every other one holds a pod or is fenced).
    assert (pod.metadata.name, pod.spec.node_name) == (FAILED, "k8s-gpu-new-0")

    async def idle():
        node = await drill.slurm.get_node(FAILED)
        return node if node.in_service else None

    # The operator set it IDLE on the move: the preStop's DOWN and the recovery's DRAIN are gone.
    await wait_async(idle, 15, f"{FAILED} in service again")
    assert moved == [FAILED]
    fenced = core.read_node(cluster.node_of(FAILED))
    assert fenced.spec.unschedulable and fenced.spec.taints
    assert all(p.spec.node_name != cluster.node_of(FAILED) for p in slurmd_pods(core).values())


@pytest.mark.parametrize("slinky", ["DaemonSet"], indirect=True)
async def test_daemonset_mode_leaves_the_fenced_node_without_a_pod_and_a_new_node_brings_one(slinky, drill):
    cluster, core, moved = slinky
    pods = slurmd_pods(core)
    assert set(pods) == set(COMPUTE) and all(p.metadata.name.startswith("gpu-") for p in pods.values())
    assert not set(COMPUTE) & {p.metadata.name for p in pods.values()}  # generated names
    assert {p.metadata.labels[SCALING_MODE_LABEL] for p in pods.values()} == {"DaemonSet"}
    await fence_and_end_the_pod(cluster, core, drill)
    await wait_async(lambda: asyncio.to_thread(lambda: FAILED not in slurmd_pods(core)), 15, "the pod gone")
    assert cluster.operator is not None
    ticks = cluster.operator.ticks

    async def rounds_passed():
        return cluster.operator.ticks >= ticks + 8

    await wait_async(rounds_passed, 15, "a few reconcile rounds")
    assert FAILED not in slurmd_pods(core)
    node = await drill.slurm.get_node(FAILED)
    assert (node.state, node.reason) == ("down", SLURMD_PRE_STOP_REASON), node

    # The node lifecycle replaces the machine: the new Node is named gpu-5 by its bootstrap.
    core.patch_node(cluster.node_of(FAILED), {"metadata": {"labels": {REPLACE_LABEL: "true"}}})

    async def spare_serves():
        pod = slurmd_pods(core).get("gpu-5")
        return pod if pod is not None and is_ready(pod) and (await drill.slurm.get_node("gpu-5")).in_service else None

    pod = await wait_async(spare_serves, 30, "a slurmd pod on the new Node")
    new = core.read_node(pod.spec.node_name)
    assert new.metadata.name == "k8s-gpu-new-0"
    assert new.metadata.annotations[HOSTNAME_OVERRIDE_ANNOTATION] == "gpu-5"
    assert moved == []
