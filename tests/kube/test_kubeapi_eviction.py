"""policy/v1 Eviction and PodDisruptionBudgets. On a real cluster the disruption controller fills
in a PDB's status asynchronously: kube_seed.pdb returns once it has (kube_driver.settle_budget),
so the evictions below see the same budget as on the test server."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.kubeapi.fixtures import expect_api_error


@pytest.fixture
def core(kube_client) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


def evict(core: client.CoreV1Api, name: str, namespace: str, **delete_options):
    body = client.V1Eviction(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace),
        delete_options=client.V1DeleteOptions(**delete_options) if delete_options else None,
    )
    return core.create_namespaced_pod_eviction(name, namespace, body)


@pytest.fixture
def trainers(kube_seed, kube_namespace) -> list[str]:
    kube_seed.node(f"{kube_namespace}-n0")
    names = [f"train-{i}" for i in range(3)]
    for name in names:
        kube_seed.pod(name, kube_namespace, node=f"{kube_namespace}-n0", labels={"app": "train"})
    return names


def test_eviction_without_a_budget_makes_the_pod_terminating(core, kube_namespace, trainers):
    evict(core, "train-0", kube_namespace)
    pod = core.read_namespaced_pod("train-0", kube_namespace)
    assert pod.metadata.deletion_timestamp is not None and pod.metadata.deletion_grace_period_seconds == 30


def test_eviction_takes_its_delete_options(core, kube_namespace, trainers):
    evict(core, "train-0", kube_namespace, grace_period_seconds=0)
    expect_api_error(404, core.read_namespaced_pod, "train-0", kube_namespace)


@pytest.mark.parametrize(
    "budget", [{"min_available": 3}, {"max_unavailable": 0}, {"min_available": "100%"}, {"max_unavailable": "0%"}]
)
def test_a_budget_with_no_disruption_left_answers_429(core, kube_seed, kube_namespace, trainers, budget):
    kube_seed.pdb("train", kube_namespace, {"app": "train"}, **budget)
    status = expect_api_error(429, evict, core, "train-0", kube_namespace)
    assert status["reason"] == "TooManyRequests"
    assert [c["reason"] for c in status["details"]["causes"]] == ["DisruptionBudget"]
    assert core.read_namespaced_pod("train-0", kube_namespace).metadata.deletion_timestamp is None


@pytest.mark.parametrize("budget", [{"min_available": 2}, {"max_unavailable": 1}, {"max_unavailable": "33%"}])
def test_a_budget_allows_one_eviction_then_refuses(core, kube_seed, kube_namespace, trainers, budget):
    kube_seed.pdb("train", kube_namespace, {"app": "train"}, **budget)
    evict(core, "train-0", kube_namespace)
    # The Terminating pod no longer counts as healthy.
    status = expect_api_error(429, evict, core, "train-1", kube_namespace)
    assert "needs 2 healthy pods and has 2 currently" in status["details"]["causes"][0]["message"]


def test_a_budget_counts_only_its_namespace_and_selector(core, kube_seed, kube_namespace, trainers):
    kube_seed.pdb("other", kube_namespace, {"app": "other"}, min_available=1)
    evict(core, "train-0", kube_namespace)


def test_a_pod_that_is_not_running_is_evicted_despite_the_budget(core, kube_seed, kube_namespace, trainers):
    kube_seed.pod("pending", kube_namespace, node=f"{kube_namespace}-n0", labels={"app": "train"}, phase="Pending")
    kube_seed.pdb("train", kube_namespace, {"app": "train"}, min_available=4)
    evict(core, "pending", kube_namespace)


def test_two_budgets_for_one_pod_are_a_500(core, kube_seed, kube_namespace, trainers):
    kube_seed.pdb("a", kube_namespace, {"app": "train"}, min_available=0)
    kube_seed.pdb("b", kube_namespace, {"app": "train"}, min_available=0)
    expect_api_error(500, evict, core, "train-0", kube_namespace)


def test_evicting_a_missing_pod_is_404(core, kube_namespace):
    expect_api_error(404, evict, core, "no-such-pod", kube_namespace)
