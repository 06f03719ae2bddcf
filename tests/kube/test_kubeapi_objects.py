"""Create, read, list, replace and delete, as the apiserver's generic registry does them. Each test
drives the official client over HTTPS; those on kube_api also hold on a real cluster."""

from __future__ import annotations

import base64
import datetime
import ssl

import httpx
import pytest
from kubernetes import client
from kubernetes.leaderelection.leaderelectionrecord import LeaderElectionRecord
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from tests.kubeapi.fixtures import KUBERNETES_RELEASE, eventually, expect_api_error

NODESET = ("slinky.slurm.net", "v1alpha1")


@pytest.fixture
def core(kube_client) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


def test_create_fills_in_server_metadata(core, kube_namespace):
    pod = core.create_namespaced_pod(
        kube_namespace, {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    )
    meta = pod.metadata
    assert meta.uid and meta.resource_version and meta.creation_timestamp is not None
    assert meta.generation == 1 and meta.namespace == kube_namespace
    assert pod.status.phase == "Pending"  # a new pod's status is the server's, not the client's


def test_generate_name_makes_a_unique_name(core, kube_namespace):
    first = core.create_namespaced_config_map(kube_namespace, {"metadata": {"generateName": "cm-"}})
    second = core.create_namespaced_config_map(kube_namespace, {"metadata": {"generateName": "cm-"}})
    assert first.metadata.name.startswith("cm-") and len(first.metadata.name) == len("cm-") + 5
    assert first.metadata.name != second.metadata.name


def test_create_of_an_existing_name_is_409_already_exists(core, kube_namespace):
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm"}})
    status = expect_api_error(409, core.create_namespaced_config_map, kube_namespace, {"metadata": {"name": "cm"}})
    assert status["reason"] == "AlreadyExists" and status["details"]["name"] == "cm"


def test_create_without_a_name_is_422_invalid(core, kube_namespace):
    status = expect_api_error(422, core.create_namespaced_config_map, kube_namespace, {"metadata": {}})
    assert status["reason"] == "Invalid"


def test_create_in_a_missing_namespace_is_404(core):
    status = expect_api_error(404, core.create_namespaced_config_map, "no-such-namespace", {"metadata": {"name": "cm"}})
    assert status["details"]["kind"] == "namespaces"


def test_get_of_a_missing_object_is_404_with_a_status_body(core):
    status = expect_api_error(404, core.read_node, "no-such-node")
    assert status["kind"] == "Status" and status["status"] == "Failure" and status["reason"] == "NotFound"
    assert status["code"] == 404 and status["message"] == 'nodes "no-such-node" not found'
    assert status["details"] == {"name": "no-such-node", "kind": "nodes"}


def test_list_carries_a_resource_version_and_filters_by_namespace(core, kube_namespace):
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "b"}})
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "a"}})
    listed = core.list_namespaced_config_map(kube_namespace)
    assert [cm.metadata.name for cm in listed.items] == ["a", "b"]
    assert int(listed.metadata.resource_version) >= int(listed.items[1].metadata.resource_version)
    everywhere = core.list_config_map_for_all_namespaces()
    assert {"a", "b"} <= {cm.metadata.name for cm in everywhere.items if cm.metadata.namespace == kube_namespace}


def test_replace_with_a_stale_resource_version_is_409_conflict(core, kube_namespace):
    created = core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm"}, "data": {"k": "1"}})
    core.patch_namespaced_config_map("cm", kube_namespace, {"data": {"k": "2"}})
    created.data = {"k": "3"}
    status = expect_api_error(409, core.replace_namespaced_config_map, "cm", kube_namespace, created)
    assert status["reason"] == "Conflict" and "the object has been modified" in status["message"]
    assert core.read_namespaced_config_map("cm", kube_namespace).data == {"k": "2"}


def test_replace_with_the_current_resource_version_succeeds(core, kube_namespace):
    created = core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm"}, "data": {"k": "1"}})
    created.data = {"k": "2"}
    replaced = core.replace_namespaced_config_map("cm", kube_namespace, created)
    assert replaced.data == {"k": "2"}
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)
    assert replaced.metadata.uid == created.metadata.uid


def test_a_no_op_update_keeps_the_resource_version(core, kube_namespace):
    created = core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm"}, "data": {"k": "1"}})
    patched = core.patch_namespaced_config_map("cm", kube_namespace, {"data": {"k": "1"}})
    replaced = core.replace_namespaced_config_map("cm", kube_namespace, created)
    assert patched.metadata.resource_version == replaced.metadata.resource_version == created.metadata.resource_version


def test_custom_resource_replace_needs_a_resource_version(kube_client, kube_namespace):
    custom = client.CustomObjectsApi(kube_client)
    body = {
        "apiVersion": "slinky.slurm.net/v1alpha1",
        "kind": "NodeSet",
        "metadata": {"name": "ns"},
        "spec": {"replicas": 1},
    }
    custom.create_namespaced_custom_object(*NODESET, kube_namespace, "nodesets", body)
    expect_api_error(422, custom.replace_namespaced_custom_object, *NODESET, kube_namespace, "nodesets", "ns", body)


def test_delete_removes_and_answers_a_success_status(core, kube_namespace):
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm"}})
    status = core.delete_namespaced_config_map("cm", kube_namespace)
    assert status["status"] == "Success"
    expect_api_error(404, core.read_namespaced_config_map, "cm", kube_namespace)


def test_delete_waits_for_finalizers(core, kube_namespace):
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm", "finalizers": ["test/hold"]}})
    core.delete_namespaced_config_map("cm", kube_namespace)
    held = core.read_namespaced_config_map("cm", kube_namespace)
    assert held.metadata.deletion_timestamp is not None
    core.patch_namespaced_config_map("cm", kube_namespace, [{"op": "remove", "path": "/metadata/finalizers"}])
    expect_api_error(404, core.read_namespaced_config_map, "cm", kube_namespace)


def test_delete_preconditions_are_checked(core, kube_namespace):
    created = core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm"}})
    stale = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="not-the-uid"))
    status = expect_api_error(409, core.delete_namespaced_config_map, "cm", kube_namespace, body=stale)
    assert "Precondition failed: UID" in status["message"]
    right = client.V1DeleteOptions(
        preconditions=client.V1Preconditions(
            uid=created.metadata.uid, resource_version=created.metadata.resource_version
        )
    )
    core.delete_namespaced_config_map("cm", kube_namespace, body=right)


def test_deleting_a_pod_on_a_node_leaves_it_terminating(core, kube_namespace, kube_seed):
    node = f"{kube_namespace}-n0"
    kube_seed.node(node)
    kube_seed.pod("bound", kube_namespace, node=node, grace=30)
    kube_seed.pod("unbound", kube_namespace)
    terminating = core.delete_namespaced_pod("bound", kube_namespace)
    assert terminating.metadata.deletion_timestamp is not None
    assert terminating.metadata.deletion_grace_period_seconds == 30
    assert core.read_namespaced_pod("bound", kube_namespace).metadata.deletion_timestamp is not None
    core.delete_namespaced_pod("unbound", kube_namespace)  # no kubelet to wait for
    expect_api_error(404, core.read_namespaced_pod, "unbound", kube_namespace)


def test_the_kubelet_finishes_terminating_pods(kube_driver, core, kube_namespace, kube_seed):
    node, other = f"{kube_namespace}-n0", f"{kube_namespace}-n1"
    kube_seed.node(node)
    kube_seed.pod("p", kube_namespace, node=node)
    core.delete_namespaced_pod("p", kube_namespace)
    assert kube_driver.finish_terminating_pods(kube_namespace, node=other) == 0
    assert core.read_namespaced_pod("p", kube_namespace).metadata.deletion_timestamp is not None
    assert kube_driver.finish_terminating_pods(kube_namespace, node=node) == 1
    expect_api_error(404, core.read_namespaced_pod, "p", kube_namespace)


def test_a_grace_period_of_zero_deletes_a_pod_at_once(core, kube_namespace, kube_seed):
    node = f"{kube_namespace}-n0"
    kube_seed.node(node)
    kube_seed.pod("p", kube_namespace, node=node)
    core.delete_namespaced_pod("p", kube_namespace, grace_period_seconds=0)
    expect_api_error(404, core.read_namespaced_pod, "p", kube_namespace)


def test_dry_run_writes_nothing(core, kube_namespace):
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "dry"}}, dry_run="All")
    expect_api_error(404, core.read_namespaced_config_map, "dry", kube_namespace)
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "cm"}, "data": {"k": "1"}})
    answer = core.patch_namespaced_config_map("cm", kube_namespace, {"data": {"k": "2"}}, dry_run="All")
    assert answer.data == {"k": "2"}
    core.delete_namespaced_config_map("cm", kube_namespace, dry_run="All")
    assert core.read_namespaced_config_map("cm", kube_namespace).data == {"k": "1"}


def test_secret_string_data_is_stored_as_base64_data(core, kube_namespace):
    core.create_namespaced_secret(kube_namespace, {"metadata": {"name": "s"}, "stringData": {"token": "abc"}})
    secret = core.read_namespaced_secret("s", kube_namespace)
    assert secret.data == {"token": base64.b64encode(b"abc").decode()} and not secret.string_data


def test_events_can_be_recorded_and_listed(core, kube_namespace):
    core.create_namespaced_event(
        kube_namespace,
        {
            "metadata": {"generateName": "gpu-0."},
            "involvedObject": {"kind": "Node", "name": "gpu-0"},
            "reason": "NodeRecovery",
            "message": "drained for XID 79",
            "type": "Warning",
        },
    )
    events = core.list_namespaced_event(kube_namespace, field_selector="involvedObject.name=gpu-0").items
    assert [e.reason for e in events] == ["NodeRecovery"]


def test_deleting_a_namespace_deletes_what_is_in_it(core, kube_namespace):
    doomed = f"{kube_namespace}-doomed"
    core.create_namespace({"metadata": {"name": doomed}})
    core.create_namespaced_config_map(doomed, {"metadata": {"name": "cm"}})
    core.delete_namespace(doomed)

    def gone() -> bool:  # at once on the test server; a real one's namespace controller takes a while
        try:
            core.read_namespace(doomed)
        except client.ApiException as e:
            assert e.status == 404, e.body
            return True
        return False

    eventually(gone, timeout=120, interval=0.5)
    assert core.list_namespaced_config_map(doomed).items == []


def test_leases_work_with_the_clients_lease_lock(kube_client, kube_namespace):
    def candidate(identity: str) -> LeaseLock:
        lock = LeaseLock("recovery-leader", kube_namespace, identity)
        lock.api_instance = client.CoordinationV1Api(kube_client)  # not the global default config
        return lock

    def record(holder: str, renewed: datetime.datetime) -> LeaderElectionRecord:
        return LeaderElectionRecord(holder, "15", str(start), str(renewed))

    start = datetime.datetime.now(datetime.timezone.utc)
    a, b = candidate("worker-a"), candidate("worker-b")
    assert a.get("recovery-leader", kube_namespace)[0] is False
    assert a.create("recovery-leader", kube_namespace, record("worker-a", start))
    found, seen_by_b = b.get("recovery-leader", kube_namespace)
    assert found and seen_by_b.holder_identity == "worker-a"
    assert a.update("recovery-leader", kube_namespace, record("worker-a", start + datetime.timedelta(seconds=5)))
    # b's copy is stale now: its take-over is a 409 on the lease's resourceVersion, so it fails.
    assert not b.update("recovery-leader", kube_namespace, record("worker-b", start + datetime.timedelta(seconds=6)))
    assert a.get("recovery-leader", kube_namespace)[1].holder_identity == "worker-a"


def test_with_builtin_schemas_a_write_that_breaks_its_types_schema_is_422(kube_simulator, core, kube_namespace):
    """KubeApiServer.store.builtin_schemas: each built-in object written, and an Eviction, is checked
    against its type's schema in that Kubernetes release (test_k8s_api_calls.py turns it on). Sent
    raw: the official client refuses such bodies itself."""
    if kube_simulator is None:
        pytest.skip("a real cluster checks its own schemas")
    kube_simulator.store.builtin_schemas = KUBERNETES_RELEASE
    headers = {"Authorization": f"Bearer {kube_simulator.token}"}
    trust = ssl.create_default_context(cafile=kube_simulator.ca_file)

    def sent(method: str, path: str, body: dict) -> httpx.Response:
        with httpx.Client(base_url=kube_simulator.url, headers=headers, verify=trust) as api:
            return api.request(method, path, json=body)

    core.create_node({"metadata": {"name": "gpu-schema"}, "spec": {"unschedulable": True}})  # valid
    refused = sent("POST", "/api/v1/nodes", {"metadata": {"name": "gpu-bad"}, "spec": {"unschedulabel": True}})
    assert refused.status_code == 422 and "unschedulabel" in refused.json()["message"], refused.text
    node = core.read_node("gpu-schema").to_dict()
    wrong_taint = {"metadata": {"name": "gpu-schema", "resourceVersion": node["metadata"]["resource_version"]}}
    wrong_taint["spec"] = {"taints": [{"key": "k", "effect": "NoSchedule", "valu": "x"}]}
    assert sent("PUT", "/api/v1/nodes/gpu-schema", wrong_taint).status_code == 422
    core.create_namespaced_pod(kube_namespace, {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}})
    eviction = {"metadata": {"name": "p"}, "gracePeriod": 1}
    refused = sent("POST", f"/api/v1/namespaces/{kube_namespace}/pods/p/eviction", eviction)
    assert refused.status_code == 422 and "gracePeriod" in refused.json()["message"], refused.text
    assert "gpu-bad" not in {n.metadata.name for n in core.list_node().items}
