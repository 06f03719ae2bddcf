"""Evicting the slurmd pod: only once Slurm shows the node drained with no job on it (and never
when Slurm cannot be read), through the Eviction API, waiting out a PodDisruptionBudget and the
pod's termination, each with a deadline."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.exceptions import ApplicationError

from backends.kubernetes import SlurmNodeView
from backends.slurm import SlurmCli, SlurmClient
from contracts.kubernetes import EvictRequest, SlurmdPodRequest
from contracts.models import SlurmJob
from kubesim.simulators import Kubelet
from tests.kube.k8s_support import (
    SLURMD_LABELS,
    Recovery,
    SlurmStandIn,
    ctx,
    k8s_settings,
    slurmd_pod,
)

POD, NODE = "slurm-gpu-0", "gpu-2"  # StatefulSet mode: the Slurm node is the pod's hostname
EVICTION = ("POST", "/api/v1/namespaces/{ns}/pods/slurm-gpu-0/eviction")


@pytest.fixture
def slurm() -> SlurmStandIn:
    view = SlurmStandIn()
    view.set(POD, "idle", "DRAIN", reason="recovery: XID 79 incident gpu-2-20261130T001736Z by test")
    return view


def make_recovery(kube_api, namespace, tmp_path, slurm, **overrides) -> Recovery:
    values = dict(namespace=namespace, eviction_deadline_seconds=10, termination_deadline_seconds=10) | overrides
    return Recovery(k8s_settings(kube_api, tmp_path, **values), slurm)


@pytest.fixture
def recovery(kube_api, kube_namespace, tmp_path, slurm):
    r = make_recovery(kube_api, kube_namespace, tmp_path, slurm)
    yield r
    r.close()


@pytest.fixture
def seeded(kube_seed, kube_namespace):
    kube_seed.node(NODE)
    kube_seed.node("gpu-3")
    slurmd_pod(kube_seed, POD, kube_namespace, NODE, grace=1)
    slurmd_pod(kube_seed, "slurm-gpu-1", kube_namespace, "gpu-3")
    return kube_seed


async def _located(recovery):
    return await recovery.run(recovery.activities.locate_slurmd_pod, SlurmdPodRequest(slurm_node=POD))


def _evictions(server, namespace) -> int:
    target = (EVICTION[0], EVICTION[1].format(ns=namespace))
    return sum(1 for r in server.requests if r == target)


def test_the_project_slurm_client_is_a_slurm_view():
    assert isinstance(SlurmClient(SlurmCli()), SlurmNodeView)


async def test_locate_finds_the_pod_of_a_slurm_node_and_its_node(recovery, seeded):
    pod = await _located(recovery)
    assert (pod.name, pod.slurm_node, pod.node, pod.ready, pod.terminating) == (POD, POD, NODE, True, False)
    with pytest.raises(ApplicationError) as raised:
        await recovery.run(recovery.activities.locate_slurmd_pod, SlurmdPodRequest(slurm_node="gpu-404"))
    assert (raised.value.type, raised.value.non_retryable) == ("SlurmdPodNotFound", True)


@pytest.mark.parametrize(
    "situation, error, final",
    [
        ("job running", "JobsStillRunning", True),
        ("not drained", "NodeNotDrained", True),
        ("allocated", "NodeStillBusy", False),  # no job listed, work completing: settles, so retried
        ("unknown to Slurm", "SlurmNotFound", True),
        ("Slurm unreadable", "SlurmStateUnknown", False),
    ],
)
async def test_no_eviction_unless_slurm_has_let_go_of_the_node(
    recovery, seeded, slurm, kube_api, kube_namespace, situation, error, final
):
    pod = await _located(recovery)
    if situation == "job running":
        slurm.jobs.append(SlurmJob(job_id=3, state="RUNNING", nodes=[POD, "slurm-gpu-1"]))
    elif situation == "not drained":
        slurm.set(POD, "idle")
    elif situation == "allocated":
        slurm.set(POD, "allocated", "DRAIN")
    elif situation == "unknown to Slurm":
        del slurm.nodes[POD]
    else:
        slurm.unreadable = True
    with pytest.raises(ApplicationError) as raised:
        await recovery.run(recovery.activities.evict_slurmd_pod, EvictRequest(pod=pod, ctx=ctx()))
    assert (raised.value.type, raised.value.non_retryable) == (error, final)
    assert _evictions(kube_api, kube_namespace) == 0
    assert not seeded.core.read_namespaced_pod(POD, kube_namespace).metadata.deletion_timestamp


async def test_a_pdb_refusal_is_retried_with_backoff_until_the_budget_allows(
    recovery, seeded, kube_api, kube_client, kube_namespace
):
    seeded.pdb("slurmd", kube_namespace, SLURMD_LABELS, min_available=2)
    pod = await _located(recovery)
    with Kubelet(kube_client, finish_after=0.3):
        evicting = asyncio.ensure_future(
            recovery.run(recovery.activities.evict_slurmd_pod, EvictRequest(pod=pod, ctx=ctx()))
        )
        while _evictions(kube_api, kube_namespace) < 3:  # refused, waited, refused again ...
            assert not evicting.done(), evicting.result()
            await asyncio.sleep(0.05)
        seeded.policy.patch_namespaced_pod_disruption_budget("slurmd", kube_namespace, {"spec": {"minAvailable": 1}})
        result = await asyncio.wait_for(evicting, 30)
    assert result.evicted and result.terminated and result.pdb_refusals >= 2
    assert any("eviction refused" in str(h) for h in recovery.heartbeats)
    assert "idle+DRAIN" in result.slurm_state
    (action,) = result.actions
    assert action.command.startswith(f"POST /api/v1/namespaces/{kube_namespace}/pods/{POD}/eviction")
    assert (action.actor, action.reason) == ("test", "GPU fell off the bus")


async def test_a_pdb_that_never_allows_is_a_final_answer_at_the_deadline(
    kube_api, seeded, slurm, kube_namespace, tmp_path
):
    seeded.pdb("slurmd", kube_namespace, SLURMD_LABELS, min_available=2)
    recovery = make_recovery(kube_api, kube_namespace, tmp_path, slurm, eviction_deadline_seconds=1)
    try:
        pod = await _located(recovery)
        with pytest.raises(ApplicationError) as raised:
            await recovery.run(recovery.activities.evict_slurmd_pod, EvictRequest(pod=pod, ctx=ctx()))
    finally:
        recovery.close()
    assert (raised.value.type, raised.value.non_retryable) == ("EvictionBlocked", True)
    assert "minAvailable" in str(raised.value) or "disruption" in str(raised.value).lower()


async def test_a_pod_that_stays_terminating_is_waited_for_until_the_deadline(
    kube_api, kube_seed, slurm, kube_namespace, tmp_path
):
    kube_seed.node(NODE)
    slurmd_pod(kube_seed, POD, kube_namespace, NODE, grace=300)  # and no kubelet to end it
    recovery = make_recovery(kube_api, kube_namespace, tmp_path, slurm, termination_deadline_seconds=2)
    try:
        pod = await _located(recovery)
        result = await recovery.run(recovery.activities.evict_slurmd_pod, EvictRequest(pod=pod, ctx=ctx()))
    finally:
        recovery.close()
    assert result.evicted and not result.terminated
    assert "still Terminating after 2 s" in result.detail
    assert any("still Terminating" in str(h) for h in recovery.heartbeats)


async def test_a_retried_eviction_evicts_once_and_waits_for_the_same_pod(
    kube_api, kube_seed, slurm, kube_client, kube_namespace, tmp_path
):
    kube_seed.node(NODE)
    slurmd_pod(kube_seed, POD, kube_namespace, NODE, grace=300)
    recovery = make_recovery(kube_api, kube_namespace, tmp_path, slurm, termination_deadline_seconds=2)
    try:
        pod = await _located(recovery)
        request = EvictRequest(pod=pod, ctx=ctx())
        first = await recovery.run(recovery.activities.evict_slurmd_pod, request)  # no kubelet: still Terminating
        with Kubelet(kube_client, finish_after=0.2):
            again = await recovery.run(recovery.activities.evict_slurmd_pod, request)
        third = await recovery.run(recovery.activities.evict_slurmd_pod, request)
    finally:
        recovery.close()
    assert (first.evicted, first.terminated, again.terminated, third.terminated) == (True, False, True, True)
    assert _evictions(kube_api, kube_namespace) == 1
    assert [a.detail for a in again.actions] == ["already terminating"]
    assert [a.detail for a in third.actions] == ["already gone"]


async def test_dry_run_describes_the_eviction_and_makes_none(recovery, seeded, slurm, kube_api, kube_namespace):
    slurm.set(POD, "allocated")  # the drain before it was only described
    pod = await _located(recovery)
    result = await recovery.run(recovery.activities.evict_slurmd_pod, EvictRequest(pod=pod, ctx=ctx(dry_run=True)))
    assert not result.evicted and _evictions(kube_api, kube_namespace) == 0
    (action,) = result.actions
    assert not action.executed and "would be refused now" in action.detail
