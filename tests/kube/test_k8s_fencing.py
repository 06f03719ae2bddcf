"""Fencing a Node and undoing exactly that, through the official client against the API server."""

from __future__ import annotations

import threading

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from temporalio.exceptions import ApplicationError

from backends.kubernetes.nodes import CORDON_REASON_ANNOTATION, FENCE_ANNOTATION
from contracts.kubernetes import K8sNodeRequest
from tests.kube.k8s_support import Recovery, SlurmStandIn, ctx, k8s_settings

OTHER_TAINT = {"key": "example.com/maintenance", "value": "rack-4", "effect": "NoSchedule"}


@pytest.fixture
def recovery(kube_api, kube_namespace, tmp_path):
    r = Recovery(k8s_settings(kube_api, tmp_path, namespace=kube_namespace), SlurmStandIn())
    yield r
    r.close()


def _state(core: client.CoreV1Api, name: str) -> tuple:
    node = core.read_node(name)
    taints = sorted((t.key, t.value or "", t.effect) for t in node.spec.taints or [])
    conditions = {c.type: (c.status, c.reason) for c in node.status.conditions or []}
    return bool(node.spec.unschedulable), taints, dict(node.metadata.annotations or {}), conditions


async def test_fence_keeps_prior_state_and_unfence_restores_it_keeping_what_others_added(recovery, kube_seed):
    kube_seed.node("gpu-2", taints=[OTHER_TAINT])
    core = kube_seed.core
    before = _state(core, "gpu-2")

    fenced = await recovery.run(recovery.activities.fence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx()))

    assert fenced.changed and not fenced.cordoned_by_other
    assert (fenced.prior.unschedulable, fenced.prior.taint, fenced.prior.condition) == (False, None, None)
    unschedulable, taints, annotations, conditions = _state(core, "gpu-2")
    assert unschedulable
    assert taints == sorted([tuple(OTHER_TAINT.values()), ("recovery.gpu/unhealthy", "xid-79", "NoSchedule")])
    assert conditions["GPURecoveryFenced"] == ("True", "XID79")
    assert annotations[CORDON_REASON_ANNOTATION].startswith("recovery: XID 79")
    assert [(a.action, a.command.split(" {")[0]) for a in fenced.actions] == [
        ("fence_k8s_node", "PUT /api/v1/nodes/gpu-2"),
        ("set_k8s_node_condition", "PUT /api/v1/nodes/gpu-2/status"),
    ]
    assert all(a.actor == "test" and a.reason == "GPU fell off the bus" for a in fenced.actions)

    # Another owner taints the Node while it is fenced: unfence must keep that taint.
    late = client.V1Taint(key="example.com/late", value="x", effect="NoExecute")
    node = core.read_node("gpu-2")
    node.spec.taints.append(late)
    core.replace_node("gpu-2", node)

    unfenced = await recovery.run(recovery.activities.unfence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx()))

    assert unfenced.changed and unfenced.restored == fenced.prior
    unschedulable, taints, annotations, conditions = _state(core, "gpu-2")
    assert (unschedulable, annotations, conditions) == (before[0], before[2], before[3])
    assert taints == sorted([tuple(OTHER_TAINT.values()), ("example.com/late", "x", "NoExecute")])


async def test_a_node_cordoned_by_someone_else_stays_cordoned_and_a_prior_fence_taint_comes_back(recovery, kube_seed):
    manual = {"key": "recovery.gpu/unhealthy", "value": "manual", "effect": "NoSchedule"}
    kube_seed.node("gpu-3", unschedulable=True, taints=[manual])
    core = kube_seed.core
    core.patch_node("gpu-3", {"metadata": {"annotations": {CORDON_REASON_ANNOTATION: "disk check"}}})
    before = _state(core, "gpu-3")

    fenced = await recovery.run(recovery.activities.fence_k8s_node, K8sNodeRequest(node="gpu-3", ctx=ctx()))
    assert fenced.cordoned_by_other and fenced.prior.taint.value == "manual"
    assert ("recovery.gpu/unhealthy", "xid-79", "NoSchedule") in _state(core, "gpu-3")[1]

    unfenced = await recovery.run(recovery.activities.unfence_k8s_node, K8sNodeRequest(node="gpu-3", ctx=ctx()))
    assert "left cordoned" in unfenced.detail
    assert _state(core, "gpu-3") == before


async def test_retried_fence_and_unfence_write_once(recovery, kube_api, kube_seed):
    kube_seed.node("gpu-2")
    first = await recovery.run(recovery.activities.fence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx()))
    writes = len(kube_api.writes())
    again = await recovery.run(recovery.activities.fence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx()))

    assert not again.changed and again.prior == first.prior  # the prior state is the one before the first fence
    assert len(kube_api.writes()) == writes
    assert [a.path for a in again.actions] == ["none", "none"]

    await recovery.run(recovery.activities.unfence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx()))
    writes = len(kube_api.writes())
    repeat = await recovery.run(recovery.activities.unfence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx()))
    assert not repeat.changed and "no fence of this incident" in repeat.detail
    assert len(kube_api.writes()) == writes


async def test_another_incidents_fence_is_left_as_found(recovery, kube_seed):
    kube_seed.node("gpu-2")
    await recovery.run(recovery.activities.fence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx("earlier")))
    later = await recovery.run(recovery.activities.fence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx("later")))
    assert later.fenced_by_other_incident == "earlier" and not later.changed
    kept = await recovery.run(recovery.activities.unfence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx("later")))
    assert not kept.changed
    assert FENCE_ANNOTATION in kube_seed.core.read_node("gpu-2").metadata.annotations


async def test_dry_run_describes_the_fence_and_writes_nothing(recovery, kube_api, kube_seed):
    kube_seed.node("gpu-2")
    writes = len(kube_api.writes())
    planned = await recovery.run(
        recovery.activities.fence_k8s_node, K8sNodeRequest(node="gpu-2", ctx=ctx(dry_run=True))
    )
    assert not planned.changed and len(kube_api.writes()) == writes
    assert [(a.executed, a.command.split(" {")[0]) for a in planned.actions] == [
        (False, "PUT /api/v1/nodes/gpu-2"),
        (False, "PUT /api/v1/nodes/gpu-2/status"),
    ]


async def test_unknown_node_is_a_final_answer(recovery):
    with pytest.raises(ApplicationError) as raised:
        await recovery.run(recovery.activities.fence_k8s_node, K8sNodeRequest(node="gpu-404", ctx=ctx()))
    assert (raised.value.type, raised.value.non_retryable) == ("NodeNotFound", True)


async def test_taint_write_that_meets_a_conflict_rereads_and_keeps_the_concurrent_taints(recovery, kube_api, kube_seed):
    """Another writer adds taints while the fence runs: whenever our PUT meets 409 Conflict it
    reads again, so every taint of theirs survives. Repeated until a conflict really happened."""
    core = kube_seed.core

    def writer(name: str, stop: threading.Event, added: list[str]) -> None:
        """An optimistic writer of its own, with PATCH so that its writes are told apart from ours.
        A few writes, not an endless stream: against a writer that never pauses, the fence gives
        up after 10 fresh reads by design (ConflictPersists, retried by Temporal)."""
        while not stop.is_set() and len(added) < 3:
            node = core.read_node(name)
            taint = {"key": f"other.example/t{len(added)}", "value": "x", "effect": "NoSchedule"}
            taints = [core.api_client.sanitize_for_serialization(t) for t in node.spec.taints or []]
            try:
                core.patch_node(
                    name,
                    {
                        "metadata": {"resourceVersion": node.metadata.resource_version},
                        "spec": {"taints": [*taints, taint]},
                    },
                )
                added.append(taint["key"])
            except ApiException as e:
                if e.status != 409:
                    raise

    for attempt in range(20):
        name = f"gpu-c{attempt}"
        kube_seed.node(name)
        stop, added = threading.Event(), []
        thread = threading.Thread(target=writer, args=(name, stop, added), daemon=True)
        thread.start()
        try:
            await recovery.run(recovery.activities.fence_k8s_node, K8sNodeRequest(node=name, ctx=ctx()))
        finally:
            stop.set()
            thread.join(10)
        keys = {t.key for t in core.read_node(name).spec.taints}
        assert {"recovery.gpu/unhealthy", *added} <= keys
        our_puts = [r for r in kube_api.requests if r == ("PUT", f"/api/v1/nodes/{name}")]
        if len(our_puts) > 1:  # a 409 was met and the write retried from a fresh read
            return
    pytest.fail("no conflict happened in 20 tries")
