"""The optional add_not_ready_taint: new Nodes get node.kubernetes.io/not-ready:NoSchedule (the
TaintNodesByCondition admission plugin), and the taint follows the Ready condition afterwards
(the node lifecycle controller), each change a write of its own that watches see."""

from __future__ import annotations

import pytest
from kubernetes import client, config, watch

from kubesim.server import KubeApiServer

NOT_READY = "node.kubernetes.io/not-ready"


@pytest.fixture
def core(tmp_path):
    with KubeApiServer(add_not_ready_taint=True) as server:
        with config.new_client_from_config(config_file=server.kubeconfig(tmp_path / "kubeconfig")) as api_client:
            yield client.CoreV1Api(api_client)


def taints(node: client.V1Node) -> list[tuple[str, str]]:
    return [(t.key, t.effect) for t in node.spec.taints or []]


def test_a_new_node_is_tainted_not_ready_until_it_is_ready(core):
    core.create_node({"metadata": {"name": "gpu-9"}, "spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}})
    assert taints(core.read_node("gpu-9")) == [("gpu", "NoSchedule"), (NOT_READY, "NoSchedule")]
    core.patch_node_status("gpu-9", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert taints(core.read_node("gpu-9")) == [("gpu", "NoSchedule")]
    core.patch_node_status("gpu-9", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert taints(core.read_node("gpu-9")) == [("gpu", "NoSchedule"), (NOT_READY, "NoSchedule")]


def test_a_node_created_ready_loses_the_taint_in_a_write_of_its_own(core):
    listed = core.list_node()
    core.create_node({"metadata": {"name": "gpu-9"}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert core.read_node("gpu-9").spec.taints is None
    seen = []
    for event in watch.Watch().stream(
        core.list_node, resource_version=listed.metadata.resource_version, timeout_seconds=5
    ):
        seen.append((event["type"], taints(event["object"])))
        if len(seen) == 2:
            break
    assert seen == [("ADDED", [(NOT_READY, "NoSchedule")]), ("MODIFIED", [])]


def test_without_the_option_nodes_are_left_untainted(tmp_path):
    # The test server's own option, off by default: a real cluster always taints (so not kube_api).
    with (
        KubeApiServer() as server,
        config.new_client_from_config(config_file=server.kubeconfig(tmp_path / "kubeconfig")) as api_client,
    ):
        core = client.CoreV1Api(api_client)
        core.create_node({"metadata": {"name": "gpu-9"}})
        assert core.read_node("gpu-9").spec.taints is None
