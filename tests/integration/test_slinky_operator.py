"""The simulated slurm-operator (kubesim/slinky.py SlinkyOperator) against the real Slurm cluster,
each behaviour as Slinky's NodeSet controller has it (1.2, internal/controller/nodeset): the drain
of a cordoned Node's or a cordoned pod's Slurm node and its undrain, only of drains it owns; the
pod-protect label behind the workers' PodDisruptionBudget; the SlurmNodeState* pod conditions."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from backends.slurm import SlurmCli
from drills.localstack import wait_async
from kubesim.server import KubeApiServer
from kubesim.slinky import (
    NODE_CORDON_REASON_ANNOTATION,
    POD_CORDON_ANNOTATION,
    POD_PROTECT_LABEL,
    SlinkyCluster,
)

pytestmark = pytest.mark.slurm

NODE = "gpu-4"  # no other test's job lands here while this module runs
COMPUTE, SPARES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"], ["gpu-5"]


@pytest.fixture
async def slinky(slurm_cluster, drill, tmp_path):
    """A Slinky cluster over the session's Slurm cluster; Slurm as the drills start it, before and after."""
    await drill.reset_cluster()
    server = KubeApiServer().start()
    cluster = SlinkyCluster(server, drill.slurm, compute_nodes=COMPUTE, spare_nodes=SPARES)
    await asyncio.to_thread(cluster.start)
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        yield cluster, client.CoreV1Api(api), drill.slurm
    finally:
        api.close()
        await asyncio.to_thread(cluster.stop)
        server.stop()
        await drill.reset_cluster()


async def node_reads(slurm: SlurmCli, check, what: str, seconds: float = 15):
    async def found():
        node = await slurm.get_node(NODE)
        return node if check(node) else None

    return await wait_async(found, seconds, what)


async def pod_reads(core: client.CoreV1Api, check, what: str, seconds: float = 15):
    async def found():
        pod = await asyncio.to_thread(core.read_namespaced_pod, NODE, "slurm")
        return pod if check(pod) else None

    return await wait_async(found, seconds, what)


async def test_a_cordoned_node_drains_its_pods_slurm_node_as_the_operators_and_an_uncordon_undrains_it(slinky):
    cluster, core, slurm = slinky
    core.patch_node(cluster.node_of(NODE), {"spec": {"unschedulable": True}})
    drained = await node_reads(slurm, lambda n: n.drained, f"{NODE} drained")
    assert drained.reason == f"slurm-operator: Node (k8s-{NODE}) was cordoned, Pod (slurm/{NODE}) must be cordoned"
    pod = await pod_reads(core, lambda p: (p.metadata.annotations or {}).get(POD_CORDON_ANNOTATION), "pod-cordon")
    assert pod.metadata.annotations[POD_CORDON_ANNOTATION] == "true"
    core.patch_node(cluster.node_of(NODE), {"spec": {"unschedulable": False}})
    await node_reads(slurm, lambda n: n.in_service, f"{NODE} undrained")
    pod = core.read_namespaced_pod(NODE, "slurm")
    assert POD_CORDON_ANNOTATION not in (pod.metadata.annotations or {})


async def test_the_nodes_cordon_reason_annotation_is_the_drain_reason(slinky):
    cluster, core, slurm = slinky
    core.patch_node(
        cluster.node_of(NODE),
        {
            "metadata": {"annotations": {NODE_CORDON_REASON_ANNOTATION: "dcgm diag failed"}},
            "spec": {"unschedulable": True},
        },
    )
    drained = await node_reads(slurm, lambda n: n.drained, f"{NODE} drained")
    assert drained.reason == "slurm-operator: dcgm diag failed"


async def test_an_external_drain_is_never_the_operators_to_touch(slinky):
    """As the recovery's own fence: drained first with its reason, then the Node cordoned; the
    operator neither rewrites the reason nor, once the Node is schedulable again, undrains it."""
    cluster, core, slurm = slinky
    reason = "recovery: XID 79 incident gpu-4-test"
    await slurm.update_node(NODE, "DRAIN", reason)
    core.patch_node(cluster.node_of(NODE), {"spec": {"unschedulable": True}})
    operator = cluster.operator
    ticks = operator.ticks
    await wait_async(lambda: asyncio.sleep(0, operator.ticks >= ticks + 3), 10, "three reconciles")
    node = await slurm.get_node(NODE)
    assert node.drained and node.reason == reason
    pod = core.read_namespaced_pod(NODE, "slurm")
    assert POD_CORDON_ANNOTATION not in (pod.metadata.annotations or {})
    core.patch_node(cluster.node_of(NODE), {"spec": {"unschedulable": False}})
    ticks = operator.ticks
    await wait_async(lambda: asyncio.sleep(0, operator.ticks >= ticks + 3), 10, "three reconciles")
    node = await slurm.get_node(NODE)
    assert node.drained and node.reason == reason


async def test_a_cordoned_pod_drains_and_its_uncordon_undrains(slinky):
    _, core, slurm = slinky
    core.patch_namespaced_pod(NODE, "slurm", {"metadata": {"annotations": {POD_CORDON_ANNOTATION: "true"}}})
    drained = await node_reads(slurm, lambda n: n.drained, f"{NODE} drained")
    assert drained.reason == f"slurm-operator: Pod (slurm/{NODE}) was cordoned"
    core.patch_namespaced_pod(NODE, "slurm", {"metadata": {"annotations": {POD_CORDON_ANNOTATION: None}}})
    await node_reads(slurm, lambda n: n.in_service, f"{NODE} undrained")


async def test_a_busy_slurmd_pod_is_protected_and_evicted_only_once_its_jobs_have_left(
    slinky, local_stack, slurm_cluster
):
    _, core, slurm = slinky
    [job_id] = [
        int(line.split(";")[0])
        for line in (
            await slurm.run("sbatch", "--parsable", f"--nodelist={NODE}", "--output=/dev/null", "--wrap=sleep 300")
        ).split()
    ]
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name=NODE, namespace="slurm"))
    try:
        await pod_reads(core, lambda p: (p.metadata.labels or {}).get(POD_PROTECT_LABEL) == "true", "pod-protect")
        with pytest.raises(ApiException) as refused:
            core.create_namespaced_pod_eviction(NODE, "slurm", eviction)
        assert refused.value.status == 429 and "slurm-workers-pdb-slurm" in refused.value.body
    finally:
        await slurm.run("scancel", str(job_id))
    await pod_reads(core, lambda p: POD_PROTECT_LABEL not in (p.metadata.labels or {}), "pod-protect removed")
    core.create_namespaced_pod_eviction(NODE, "slurm", eviction)
    # the pod's preStop hook: the Slurm node DOWN with the operator's reason
    down = await node_reads(slurm, lambda n: n.state == "down", f"{NODE} down by the preStop hook")
    assert down.reason == "slurm-operator: Pod is terminating"


async def test_the_pods_slurm_node_state_conditions_mirror_slurm(slinky):
    _, core, slurm = slinky

    def conditions(pod) -> dict[str, str]:
        return {c.type: (c.status, c.message or "") for c in pod.status.conditions if c.type.startswith("SlurmNode")}

    idle = await pod_reads(core, lambda p: "SlurmNodeStateIdle" in conditions(p), "an Idle condition")
    assert conditions(idle) == {"SlurmNodeStateIdle": ("True", "")}
    await slurm.update_node(NODE, "DRAIN", "ops: fan")
    drained = await pod_reads(core, lambda p: "SlurmNodeStateDrain" in conditions(p), "a Drain condition")
    assert conditions(drained) == {
        "SlurmNodeStateIdle": ("True", "ops: fan"),
        "SlurmNodeStateDrain": ("True", "ops: fan"),
    }
    assert any(c.type == "Ready" for c in drained.status.conditions)  # the kubelet's own are kept
