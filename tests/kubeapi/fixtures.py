"""pytest fixtures for tests that talk to Kubernetes (imported by tests/conftest.py).

    kube_api        what the tests talk to: the in-repo KubeApiServer (HTTPS, bearer token, the NodeSet
                    CRD slinky.slurm.net/v1alpha1 "nodesets" registered with /status and /scale), or a
                    KubeApiProxy in front of it (tests/kube runs every test both ways), or, when
                    RECOVERY_TEST_KUBECONFIG names a kubeconfig, a KubeApiProxy in front of that real
                    cluster. All three have the request log, injected faults (fail_next, faults),
                    compact(), stop() and kubeconfig(path); stopped after the test.
    kube_simulator  the in-repo server behind kube_api; None on a real cluster.
    kube_driver     a ClusterDriver: what a test needs the cluster to do that no API call of the
                    code under test does (watch history expiring, a kubelet finishing a pod, the
                    disruption controller computing a PDB's status), by the test server's hooks
                    or, on a real cluster, by that cluster's own means. kube_seed settles each PDB
                    through it.
    kube_client     a kubernetes.client.ApiClient built from kube_api's kubeconfig with
                    kubernetes.config.new_client_from_config (never the global default), closed after.
    kube_namespace  the name of a fresh namespace for the test (deleted after it on a real cluster).
    kube_seed       a KubeSeed: creates Nodes, Pods and PodDisruptionBudgets through the client in
                    the states tests usually need (a real apiserver resets a new Pod's status, so
                    a Running pod takes a create and a /status write; a PDB is returned once its
                    status is computed); on a real cluster it also deletes the Nodes it made.

Helpers: expect_api_error(status, call, *args, **kwargs) -> the Status body of the error;
eventually(probe, timeout=5) -> probe()'s first truthy result (polls, fails at the deadline);
raw_request(api_client, method, path, body=None, content_type=...) -> (status, body bytes).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Protocol

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from kubesim.front import ApiFront
from kubesim.proxy import KubeApiProxy
from kubesim.server import KubeApiServer
from kubesim.simulators import Provisioner

REAL_CLUSTER_ENV = "RECOVERY_TEST_KUBECONFIG"
# The NodeSet type of the test server: a cluster still on Slinky 0.x (v1alpha1), with no schema,
# so that the server's own tests can write any NodeSet. Today's v1beta1, validated by Slinky's CRD,
# is the drill's (kubesim/slinky.py) and test_k8s_nodeset_versions.py's.
FIXTURE_NODESET = ("slinky.slurm.net", "v1alpha1", "nodesets")
# The Kubernetes release whose built-in schemas (kubernetes-validate's) a test may have the server
# check every write against (KubeApiServer.store.builtin_schemas).
KUBERNETES_RELEASE = "1.37.0"


@pytest.fixture
def kube_simulator():
    if os.environ.get(REAL_CLUSTER_ENV):
        yield None
        return
    server = KubeApiServer().start()
    server.register_crd(*FIXTURE_NODESET, "NodeSet")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def kube_api(request, kube_simulator, tmp_path) -> ApiFront:
    """Parametrised indirectly with "direct" (the default) or "via-proxy"; a real cluster is
    always behind the proxy, which gives it the test server's hooks."""
    if kube_simulator is not None and getattr(request, "param", "direct") == "direct":
        yield kube_simulator
        return
    upstream = os.environ.get(REAL_CLUSTER_ENV) or kube_simulator.kubeconfig(tmp_path / "upstream-kubeconfig")
    proxy = KubeApiProxy(upstream).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def kube_client(kube_api, tmp_path):
    api_client = config.new_client_from_config(config_file=kube_api.kubeconfig(tmp_path / "kubeconfig"))
    yield api_client
    api_client.close()


class ClusterDriver(Protocol):
    def expired_resource_version(self, recent: str) -> str:
        """A resourceVersion a watch can no longer start from (410 Gone), given a `recent` one."""

    def finish_terminating_pods(self, namespace: str, node: str | None = None) -> int:
        """What a kubelet does once a deleted pod's containers stopped: remove the Terminating pods
        of the namespace (on `node`); returns how many."""

    def settle_budget(self, budget: client.V1PodDisruptionBudget) -> client.V1PodDisruptionBudget:
        """The PDB once the disruption controller has computed its status for its spec."""


class TestServerDriver:
    """The in-repo server: its hooks do at once what a cluster's controllers do in time."""

    def __init__(self, server: KubeApiServer):
        self.server = server

    def expired_resource_version(self, recent: str) -> str:
        self.server.compact()  # only now does the server forget history
        return recent

    def finish_terminating_pods(self, namespace: str, node: str | None = None) -> int:
        return self.server.finish_terminating_pods(node=node)  # the server holds this test's namespace only

    def settle_budget(self, budget: client.V1PodDisruptionBudget) -> client.V1PodDisruptionBudget:
        return budget  # evictions compute the budget when they are asked (no status is kept)


class RealClusterDriver:
    """A real cluster. kube_seed's Nodes have no kubelet, so this driver makes the kubelet's last
    write itself: the DELETE with a zero grace period, for that pod's uid only."""

    DEADLINE = 60.0  # seconds for a controller or the apiserver to catch up

    def __init__(self, api_client: client.ApiClient):
        self.core = client.CoreV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)

    def expired_resource_version(self, recent: str) -> str:
        # etcd compacts every 5 minutes and the watch cache holds fewer events: "1" is long gone.
        return "1"

    def finish_terminating_pods(self, namespace: str, node: str | None = None) -> int:
        selector = f"spec.nodeName={node}" if node else ""
        pods = [
            p
            for p in self.core.list_namespaced_pod(namespace, field_selector=selector).items
            if p.metadata.deletion_timestamp is not None
        ]
        for pod in pods:
            self.core.delete_namespaced_pod(
                pod.metadata.name,
                namespace,
                grace_period_seconds=0,
                body=client.V1DeleteOptions(preconditions={"uid": pod.metadata.uid}),
            )
        names = {p.metadata.name for p in pods}
        eventually(
            lambda: not names & {p.metadata.name for p in self.core.list_namespaced_pod(namespace).items},
            timeout=self.DEADLINE,
        )
        return len(pods)

    def settle_budget(self, budget: client.V1PodDisruptionBudget) -> client.V1PodDisruptionBudget:
        name, namespace = budget.metadata.name, budget.metadata.namespace

        def computed():
            read = self.policy.read_namespaced_pod_disruption_budget(name, namespace)
            status = read.status
            return read if status and status.observed_generation == read.metadata.generation else None

        return eventually(computed, timeout=self.DEADLINE, interval=0.2)


@pytest.fixture
def kube_upstream_client(kube_simulator):
    """On a real cluster, a client straight to it, for what the cluster's own actors do and for the
    clean-up: neither goes through the proxy's log (nor fails when a test has stopped it). None on
    the test server, which does both by its hooks."""
    if kube_simulator is not None:
        yield None
        return
    api_client = config.new_client_from_config(config_file=os.environ[REAL_CLUSTER_ENV])
    yield api_client
    api_client.close()


@pytest.fixture
def kube_driver(kube_simulator, kube_upstream_client) -> ClusterDriver:
    return TestServerDriver(kube_simulator) if kube_simulator is not None else RealClusterDriver(kube_upstream_client)


@pytest.fixture
def kube_namespace(kube_simulator, kube_client, kube_upstream_client):
    core = client.CoreV1Api(kube_client)
    name = f"kt-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    if kube_simulator is None:
        # A real cluster admits pods only once its controller has made the default ServiceAccount.
        eventually(
            lambda: core.list_namespaced_service_account(name, field_selector="metadata.name=default").items, timeout=30
        )
    yield name
    if kube_simulator is not None:  # the test server goes away whole
        return
    try:
        client.CoreV1Api(kube_upstream_client).delete_namespace(name)
    except ApiException as e:
        if e.status != 404:
            raise


class KubeSeed:
    def __init__(self, api_client: client.ApiClient, driver: ClusterDriver):
        self.core = client.CoreV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)
        self.driver = driver
        self.nodes: list[str] = []

    def node(
        self,
        name: str,
        *,
        ready: bool = True,
        gpus: int = 8,
        labels: dict | None = None,
        unschedulable: bool = False,
        taints: list[dict] | None = None,
    ) -> client.V1Node:
        spec = {"unschedulable": True} if unschedulable else {}
        if taints:
            spec["taints"] = taints
        self.core.create_node({"metadata": {"name": name, "labels": labels or {}}, "spec": spec})
        self.nodes.append(name)
        resources = {"nvidia.com/gpu": str(gpus), "cpu": "64", "memory": "512Gi", "pods": "110"}
        return self.core.patch_node_status(
            name,
            {
                "status": {
                    "capacity": resources,
                    "allocatable": resources,
                    "conditions": [{"type": "Ready", "status": str(ready)}],
                }
            },
        )

    def pod(
        self,
        name: str,
        namespace: str,
        *,
        node: str | None = None,
        labels: dict | None = None,
        phase: str = "Running",
        grace: int | None = None,
    ) -> client.V1Pod:
        spec = {"containers": [{"name": "main", "image": "busybox"}]}
        if node:
            spec["nodeName"] = node
        if grace is not None:
            spec["terminationGracePeriodSeconds"] = grace
        self.core.create_namespaced_pod(namespace, {"metadata": {"name": name, "labels": labels or {}}, "spec": spec})
        ready = "True" if phase == "Running" else "False"
        return self.core.patch_namespaced_pod_status(
            name, namespace, {"status": {"phase": phase, "conditions": [{"type": "Ready", "status": ready}]}}
        )

    def pdb(
        self,
        name: str,
        namespace: str,
        match_labels: dict,
        *,
        min_available: int | str | None = None,
        max_unavailable: int | str | None = None,
    ) -> client.V1PodDisruptionBudget:
        spec = {"selector": {"matchLabels": match_labels}}
        if min_available is not None:
            spec["minAvailable"] = min_available
        if max_unavailable is not None:
            spec["maxUnavailable"] = max_unavailable
        return self.driver.settle_budget(
            self.policy.create_namespaced_pod_disruption_budget(namespace, {"metadata": {"name": name}, "spec": spec})
        )

    def cleanup(self, core: client.CoreV1Api) -> None:
        self.delete_nodes(core, self.nodes)

    @staticmethod
    def delete_nodes(core: client.CoreV1Api, names: list[str]) -> None:
        for name in names:
            try:
                core.delete_node(name)
            except ApiException as e:
                if e.status != 404:
                    raise


@pytest.fixture
def kube_seed(kube_simulator, kube_client, kube_driver, kube_upstream_client):
    seed = KubeSeed(kube_client, kube_driver)
    yield seed
    if kube_simulator is None:  # the test server goes away whole
        seed.cleanup(client.CoreV1Api(kube_upstream_client))


@pytest.fixture
def kube_provisioner(kube_simulator, kube_upstream_client):
    """Provisioner(...) (kubesim/simulators.py) that, on a real cluster, deletes the Nodes it made
    after the test: the cluster keeps them, and the next test's "lowest unused name" moves on."""
    made: list[Provisioner] = []

    def new(*args, **kwargs) -> Provisioner:
        made.append(Provisioner(*args, **{"nodeset_version": FIXTURE_NODESET[1], **kwargs}))
        return made[-1]

    yield new
    if kube_simulator is None:
        KubeSeed.delete_nodes(client.CoreV1Api(kube_upstream_client), [n for p in made for n in p.created])


def expect_api_error(status: int, call, *args, **kwargs) -> dict:
    """Calls the client method and returns the Status body of the ApiException it must raise."""
    with pytest.raises(ApiException) as raised:
        call(*args, **kwargs)
    assert raised.value.status == status, raised.value.body
    return json.loads(raised.value.body)


def eventually(probe, *, timeout: float = 5.0, interval: float = 0.02):
    """Polls `probe()` until it returns something truthy, which it returns; fails at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"not true within {timeout} s: {probe}")
        time.sleep(interval)


def raw_request(
    api_client: client.ApiClient, method: str, path: str, *, body: object = None, content_type: str = "application/json"
) -> tuple[int, bytes]:
    """A request the client's API methods cannot make (its REST layer turns a non-list JSON patch
    into a strategic merge patch), sent through its own connection pool, TLS and bearer token."""
    configuration = api_client.configuration
    headers = {"Content-Type": content_type, "Accept": "application/json"}
    if auth := configuration.auth_settings().get("BearerToken"):
        headers["Authorization"] = auth["value"]
    response = api_client.rest_client.pool_manager.request(
        method, configuration.host + path, body=None if body is None else json.dumps(body), headers=headers, timeout=10
    )
    return response.status, response.data
