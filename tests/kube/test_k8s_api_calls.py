"""The API server's request log during a whole recovery's Kubernetes steps: every request the code
makes is one that backends/kubernetes/calls.py declares (so the shipped RBAC, which grants exactly
that table, covers it), every declared call is made, and each audit record names a call that was."""

from __future__ import annotations

import asyncio
from collections import Counter

from backends.kubernetes.calls import rbac_rules
from contracts.kubernetes import (
    NODESET_GROUP,
    EvictRequest,
    K8sNodeRequest,
    K8sReplacementRequest,
    K8sSpareWaitRequest,
    SlurmdPodRequest,
)
from contracts.models import utc_now
from tests.kube.k8s_support import (
    Recovery,
    SlurmStandIn,
    create_nodeset,
    ctx,
    k8s_settings,
    rbac_rule_of,
    slurmd_pod,
)
from tests.kubeapi.fixtures import KUBERNETES_RELEASE


class RequestLog:
    """The requests the code made: what the server logged while an activity ran, less what the
    test itself sent meanwhile."""

    def __init__(self, server):
        self.server = server
        self.made: list[tuple[str, str]] = []

    async def during(self, work, *, test_sends: list[tuple[str, str]] = ()):
        start = len(self.server.requests)
        result = await work
        ours = Counter(self.server.requests[start:])
        ours.subtract(Counter(test_sends))
        self.made += list(ours.elements())
        return result


async def test_every_request_is_declared_and_every_declared_call_is_made(
    kube_api, kube_simulator, kube_client, kube_seed, kube_driver, kube_namespace, tmp_path
):
    """And every object the steps write (Nodes and their status, the Eviction, pods) passes its
    type's schema in a current Kubernetes release, which the test server checks (422 otherwise)."""
    if kube_simulator is not None:
        kube_simulator.store.builtin_schemas = KUBERNETES_RELEASE
    ns = kube_namespace
    for node in ("gpu-2", "gpu-3", "gpu-4"):
        kube_seed.node(node)
    slurmd_pod(kube_seed, "slurm-gpu-0", ns, "gpu-2", grace=30)
    create_nodeset(kube_client, ns, replicas=2)
    slurm = SlurmStandIn()
    slurm.set("slurm-gpu-0", "idle", "DRAIN")
    slurm.set("slurm-gpu-9", "idle")
    nodeset = Recovery(k8s_settings(kube_api, tmp_path, namespace=ns, nodeset_scale_up=True), slurm)
    lifecycle = Recovery(
        k8s_settings(kube_api, tmp_path, namespace=ns, replacement="node-lifecycle", delete_node=True), slurm
    )
    log, records = RequestLog(kube_api), []
    try:
        acts = nodeset.activities
        since = utc_now()
        fenced = await log.during(nodeset.run(acts.fence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx())))
        pod = await log.during(nodeset.run(acts.locate_slurmd_pod, SlurmdPodRequest(slurm_node="slurm-gpu-0")))
        evicting = asyncio.ensure_future(
            log.during(nodeset.run(acts.evict_slurmd_pod, EvictRequest(pod=pod, ctx=ctx())))
        )
        deadline = asyncio.get_running_loop().time() + 10
        while not kube_driver.finish_terminating_pods(ns):  # the kubelet, once the pod is Terminating
            assert asyncio.get_running_loop().time() < deadline and not evicting.done(), "the pod was not evicted"
            await asyncio.sleep(0.05)
        evicted = await evicting
        scaled = await log.during(
            nodeset.run(
                acts.request_k8s_replacement,
                K8sReplacementRequest(failed_node="gpu-2", slurm_node="slurm-gpu-0", ctx=ctx()),
            )
        )
        handed = await log.during(
            lifecycle.run(
                lifecycle.activities.request_k8s_replacement,
                K8sReplacementRequest(failed_node="gpu-4", slurm_node="slurm-gpu-4", ctx=ctx()),
            )
        )
        waiting = asyncio.ensure_future(
            log.during(
                nodeset.run(
                    acts.wait_for_k8s_node, K8sSpareWaitRequest(failed_node="gpu-2", since=since, deadline_seconds=20)
                ),
                test_sends=[
                    ("POST", f"/api/v1/namespaces/{ns}/pods"),
                    ("PATCH", f"/api/v1/namespaces/{ns}/pods/slurm-gpu-9/status"),
                ],
            )
        )
        await asyncio.sleep(1.5)  # a watch window passes first
        slurmd_pod(kube_seed, "slurm-gpu-9", ns, "gpu-3")
        spare = await waiting
        unfenced = await log.during(nodeset.run(acts.unfence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx())))
    finally:
        nodeset.close()
        lifecycle.close()
    assert evicted.terminated and spare.healthy and unfenced.changed

    # Discovery (the NodeSet's served version) is a non-resource URL every authenticated client may
    # read (system:discovery): no rule of ours; every other request is one the RBAC grants.
    discovery = [
        (m, p) for m, p in log.made if m == "GET" and len(p.strip("/").split("/")) == 3 and p.startswith("/apis/")
    ]
    assert discovery == [("GET", f"/apis/{NODESET_GROUP}/v1beta1"), ("GET", f"/apis/{NODESET_GROUP}/v1alpha1")]
    used = {rbac_rule_of(method, path) for method, path in log.made if (method, path) not in discovery}
    assert used == rbac_rules(namespaced=False) | rbac_rules(namespaced=True)

    for result in (fenced, evicted, scaled, handed, unfenced):
        records += [a for a in result.actions if a.path == "kubernetes"]
    made = {f"{method} {path.split('?')[0]}" for method, path in log.made}
    for action in records:
        assert action.command.split(" {")[0] in made, action.command
