"""labelSelector and fieldSelector on list (watch uses the same matching: see test_kubeapi_watch)."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.kubeapi.fixtures import expect_api_error


@pytest.fixture
def core(kube_client, kube_seed, kube_namespace) -> client.CoreV1Api:
    kube_seed.node(f"{kube_namespace}-n0")
    kube_seed.node(f"{kube_namespace}-n1", unschedulable=True)
    for name, labels, node in [
        ("a", {"app": "train", "tier": "gpu"}, "n0"),
        ("b", {"app": "train"}, "n1"),
        ("c", {"app": "serve", "tier": "cpu"}, "n0"),
        ("d", {}, None),
    ]:
        kube_seed.pod(name, kube_namespace, labels=labels, node=node and f"{kube_namespace}-{node}")
    return client.CoreV1Api(kube_client)


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=train", "ab"),
        ("app==train", "ab"),
        ("app!=train", "cd"),
        ("app in (train, serve)", "abc"),
        ("app notin (train)", "cd"),
        ("tier", "ac"),
        ("!tier", "bd"),
        ("app=train,tier", "a"),
        ("app in (train),!tier", "b"),
        ("", "abcd"),
    ],
)
def test_label_selector_operators(core, kube_namespace, selector, expected):
    pods = core.list_namespaced_pod(kube_namespace, label_selector=selector).items
    assert "".join(p.metadata.name for p in pods) == expected


def test_field_selector_on_dotted_paths(core, kube_namespace):
    def names(selector: str) -> str:
        return "".join(p.metadata.name for p in core.list_namespaced_pod(kube_namespace, field_selector=selector).items)

    assert names(f"spec.nodeName={kube_namespace}-n0") == "ac"
    assert names(f"spec.nodeName!={kube_namespace}-n0") == "bd"
    assert names("spec.nodeName=") == "d"
    assert names(f"metadata.name==b,spec.nodeName={kube_namespace}-n1") == "b"
    assert names("status.phase=Running") == "abcd"


def test_field_selector_on_node_unschedulable(core, kube_namespace):
    def names(selector: str) -> set[str]:
        return {n.metadata.name for n in core.list_node(field_selector=selector).items}

    assert f"{kube_namespace}-n1" in names("spec.unschedulable=true")
    unschedulable_false = names("spec.unschedulable=false")  # an absent field counts as false
    assert f"{kube_namespace}-n0" in unschedulable_false and f"{kube_namespace}-n1" not in unschedulable_false


def test_selectors_apply_across_namespaces(core, kube_namespace):
    pods = core.list_pod_for_all_namespaces(
        label_selector="app=train", field_selector=f"metadata.namespace={kube_namespace}"
    )
    assert [p.metadata.name for p in pods.items] == ["a", "b"]


@pytest.mark.parametrize("selector", ["app in train", "app=(x", "=x"])
def test_a_malformed_label_selector_is_400(core, kube_namespace, selector):
    expect_api_error(400, core.list_namespaced_pod, kube_namespace, label_selector=selector)
