"""Kubernetes faults at every call the Kubernetes activities make (backends/kubernetes/calls.py):
the API server answering 500, 409 or 429, or dropping the connection (kubesim's `faults` hook).
A transient fault is retried within the activity's policy and the step takes effect once; a
persistent one fails the step closed: no slurmd pod is evicted while its pod or Node cannot be
read, nor while Slurm's state is unknown.

The activities run in a worker on the real Temporal test server (time-skipping: ten minutes of
retries take no wall time, each attempt is real), against kubesim and the real local Slurm, each
called with the options the incident gives it (workflows/call_options.py). Last, one `--k8s`
drill on the real dev server with transient faults on the fence and the eviction.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
import pytest_asyncio
import urllib3
from kubernetes import client as kube
from kubernetes.client.exceptions import ApiException
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.worker import Worker

from activities.kubernetes import KubernetesActivities
from activities.xid_policy import XidPolicyTable
from backends.kubernetes import load_api_client
from backends.slurm import SlurmCli
from contracts.kubernetes import (
    NODESET_GROUP,
    EvictRequest,
    EvictResult,
    K8sFenceResult,
    K8sNodeRequest,
    K8sReplacementRequest,
    K8sReplacementResult,
    SlurmdPodRequest,
)
from contracts.models import SlurmdPod
from drills.drill import Drill, DrillOptions, SimulatedKubernetes
from kubesim.front import ApiFront
from kubesim.simulators import Kubelet
from tests.faults.proxy import FaultProxy
from tests.faults.test_slurm_faults import rest_path
from tests.integration.conftest import settings, task_queue  # noqa: F401 (fixtures)
from tests.kube.k8s_support import SLURMD_LABELS, create_nodeset, ctx, k8s_settings
from tests.kubeapi.fixtures import eventually
from worker import build_slurm
from workflows.call_options import K8S_CALL, K8S_EVICTION, K8S_REPLACEMENT

pytestmark = pytest.mark.slurm

NODE, SLURM_NODE = "k8s-gpu-4", "gpu-4"  # a compute node no drill job runs on: drained for the test
INCIDENT = "gpu-4-20261130T001736Z"
NODE_PATH = rf"^/api/v1/nodes/{NODE}$"
NODE_STATUS_PATH = rf"^/api/v1/nodes/{NODE}/status$"
PODS_PATH = r"^/api/v1/namespaces/[^/]+/pods(\?|$)"
EVICTION_PATH = rf"^/api/v1/namespaces/[^/]+/pods/{SLURM_NODE}/eviction$"
NODESET_PATH = rf"^/apis/{NODESET_GROUP}/v1alpha1/namespaces/[^/]+/nodesets/gpu$"
NODESET_SCALE_PATH = NODESET_PATH.removesuffix("$") + "/scale$"
OPTIONS = {"call": K8S_CALL, "eviction": K8S_EVICTION, "replacement": K8S_REPLACEMENT}


# --- the hook itself ---------------------------------------------------------------------------


def test_the_fault_hook_answers_drops_and_delays_as_told(kube_api: ApiFront, kube_client, kube_seed):
    core = kube.CoreV1Api(kube_client)
    kube_seed.node("n1")
    kube_api.faults.inject("GET", r"^/api/v1/nodes/n1$", status=429, times=1)
    with pytest.raises(ApiException) as refused:
        core.read_node("n1")
    assert (refused.value.status, refused.value.reason) == (429, "Too Many Requests")
    assert core.read_node("n1").metadata.name == "n1"  # times=1: the next one passes

    dropped = kube_api.faults.inject("POST", r"/eviction$", drop=True, times=None)
    kube_seed.pod("p1", "default", node="n1")
    with pytest.raises(urllib3.exceptions.HTTPError):  # no answer at all (POST: urllib3 does not retry)
        core.create_namespaced_pod_eviction("p1", "default", kube.V1Eviction(metadata=kube.V1ObjectMeta(name="p1")))
    assert dropped.hits == 1 and core.read_namespaced_pod("p1", "default").metadata.deletion_timestamp is None

    # Held beyond the client's time-out, then served all the same: a slow server still acts.
    kube_api.faults.clear()
    kube_seed.pod("p2", "default", node="n1")
    kube_api.faults.inject("POST", r"/pods/p2/eviction$", delay=1.0)
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        core.create_namespaced_pod_eviction(
            "p2", "default", kube.V1Eviction(metadata=kube.V1ObjectMeta(name="p2")), _request_timeout=0.3
        )
    eventually(lambda: core.read_namespaced_pod("p2", "default").metadata.deletion_timestamp)
    with pytest.raises(ValueError, match="one of status, delay or drop"):
        kube_api.faults.inject("GET", "/", status=500, drop=True)


# --- activity-level: a worker with the Kubernetes activities ------------------------------------


@workflow.defn(sandboxed=False)  # a test harness: no module of its own for the sandbox to import
class KubernetesStep:
    """One Kubernetes activity, called with the options the incident gives it."""

    @workflow.run
    async def run(self, activity: str, options: str, arg: dict[str, Any]) -> dict[str, Any]:
        return await workflow.execute_activity(activity, arg, **OPTIONS[options])


@dataclasses.dataclass
class Stage:
    server: ApiFront  # the API server, or the proxy in front of a real cluster
    core: kube.CoreV1Api
    namespace: str
    proxy: FaultProxy  # between the worker and slurmrestd
    client: Client  # Temporal's
    task_queue: str
    seed_writes: int  # the server's writes that seeded the stage

    async def run(self, activity: str, arg: Any, options: str = "call") -> dict[str, Any]:
        return await self.client.execute_workflow(
            KubernetesStep.run,
            args=[activity, options, arg.model_dump(mode="json")],
            id=f"k8s-step-{uuid.uuid4()}",
            task_queue=self.task_queue,
        )

    def writes_to(self, path_regex: str) -> list[tuple[str, str]]:
        """The writes since the stage was seeded to paths that match."""
        return [r for r in self.server.writes()[self.seed_writes :] if re.search(path_regex, r[1].split("?")[0])]

    def pod(self) -> kube.V1Pod:
        return self.core.read_namespaced_pod(SLURM_NODE, self.namespace)


@pytest_asyncio.fixture
async def stage(
    time_skipping_env,
    slurm_cluster,
    settings,
    kube_api,
    kube_client,
    kube_namespace,  # noqa: F811
    kube_seed,
    tmp_path,
) -> AsyncIterator[Stage]:
    """kubesim with a Node and the slurmd pod of a real Slurm node, that Slurm node drained and
    empty (as it is when the incident evicts), and a worker with the Kubernetes activities whose
    Slurm traffic goes through a FaultProxy. Everything is undone on leaving."""
    kube_seed.node(NODE)
    kube_seed.pod(SLURM_NODE, kube_namespace, node=NODE, labels=SLURMD_LABELS, grace=1)
    create_nodeset(kube_client, kube_namespace, "gpu", replicas=2)
    seed_writes = len(kube_api.writes())
    cli = SlurmCli(slurm_conf=slurm_cluster["SLURM_CONF"], bin_dir=slurm_cluster.get("SLURM_BIN_DIR", ""))
    async with AsyncExitStack() as stack:
        await cli.update_node(SLURM_NODE, "DRAIN", f"recovery: XID 79 incident {INCIDENT} by test")
        stack.push_async_callback(cli.update_node, SLURM_NODE, "RESUME", None)
        proxy = await stack.enter_async_context(FaultProxy(settings.slurmrestd_url))
        slurm = await build_slurm(settings.model_copy(update={"slurmrestd_url": proxy.url}), stack)
        k8s = k8s_settings(
            kube_api,
            tmp_path,
            namespace=kube_namespace,
            eviction_deadline_seconds=10,
            termination_deadline_seconds=10,
            nodeset_scale_up=True,
        )
        worker_api = load_api_client(k8s).api
        stack.callback(worker_api.close)
        stack.enter_context(Kubelet(kube_client, finish_after=0.3))
        await stack.enter_async_context(
            Worker(
                time_skipping_env.client,
                task_queue=settings.task_queue,
                workflows=[KubernetesStep],
                activities=KubernetesActivities(worker_api, k8s, slurm).all(),
            )
        )
        yield Stage(
            kube_api,
            kube.CoreV1Api(kube_client),
            kube_namespace,
            proxy,
            time_skipping_env.client,
            settings.task_queue,
            seed_writes,
        )


async def located(stage: Stage) -> SlurmdPod:
    return SlurmdPod.model_validate(await stage.run("locate_slurmd_pod", SlurmdPodRequest(slurm_node=SLURM_NODE)))


# (activity, method, path, fault): one transient fault at each call the activity makes.
TRANSIENT = [
    ("locate_slurmd_pod", "GET", PODS_PATH, dict(status=500)),
    ("locate_slurmd_pod", "GET", PODS_PATH, dict(status=429, times=3)),
    ("locate_slurmd_pod", "GET", PODS_PATH, dict(drop=True, times=5)),
    ("fence_k8s_node", "GET", NODE_PATH, dict(status=500, times=2)),
    ("fence_k8s_node", "PUT", NODE_PATH, dict(status=409)),  # a conflict: read again, write again
    ("fence_k8s_node", "PUT", NODE_PATH, dict(drop=True, times=5)),
    ("fence_k8s_node", "PUT", NODE_STATUS_PATH, dict(status=429)),
    ("evict_slurmd_pod", "GET", PODS_PATH, dict(status=503)),  # the pod as it is now
    ("evict_slurmd_pod", "POST", EVICTION_PATH, dict(status=500)),
    ("evict_slurmd_pod", "POST", EVICTION_PATH, dict(drop=True)),
    ("evict_slurmd_pod", "POST", EVICTION_PATH, dict(status=409)),
    ("evict_slurmd_pod", "POST", EVICTION_PATH, dict(status=429, times=2)),  # as a PDB refuses
    ("request_k8s_replacement", "GET", NODESET_PATH, dict(status=500)),
    ("request_k8s_replacement", "PUT", NODESET_PATH, dict(status=409)),  # the scale-up claim
    ("request_k8s_replacement", "GET", NODESET_SCALE_PATH, dict(status=429)),
    ("request_k8s_replacement", "PUT", NODESET_SCALE_PATH, dict(status=503)),  # after the claim: not twice
]


@pytest.mark.parametrize(
    "activity, method, path, fault",
    TRANSIENT,
    ids=[f"{a}-{m}-{'-'.join(f'{k}={v}' for k, v in f.items())}" for a, m, _, f in TRANSIENT],
)
async def test_a_transient_api_fault_is_retried_and_the_step_takes_effect_once(stage, activity, method, path, fault):
    pod = await located(stage) if activity == "evict_slurmd_pod" else None
    injected = stage.server.faults.inject(method, path, **fault)
    if activity == "locate_slurmd_pod":
        found = SlurmdPod.model_validate(await stage.run(activity, SlurmdPodRequest(slurm_node=SLURM_NODE)))
        assert (found.name, found.node) == (SLURM_NODE, NODE)
    elif activity == "fence_k8s_node":
        fenced = K8sFenceResult.model_validate(await stage.run(activity, K8sNodeRequest(node=NODE, ctx=ctx(INCIDENT))))
        node = stage.core.read_node(NODE)
        taints = [t for t in node.spec.taints or [] if t.key == "recovery.gpu/unhealthy"]
        assert fenced.changed and node.spec.unschedulable and len(taints) == 1
        assert [c.type for c in node.status.conditions].count("GPURecoveryFenced") == 1
    elif activity == "request_k8s_replacement":
        asked = K8sReplacementResult.model_validate(
            await stage.run(
                activity,
                K8sReplacementRequest(failed_node=NODE, slurm_node=SLURM_NODE, ctx=ctx(INCIDENT)),
                options="replacement",
            )
        )
        nodeset = kube.CustomObjectsApi(stage.core.api_client).get_namespaced_custom_object(
            NODESET_GROUP, "v1alpha1", stage.namespace, "nodesets", "gpu"
        )
        assert asked.accepted and nodeset["spec"]["replicas"] == 3, (asked.detail, nodeset["spec"])  # one more, once
    else:
        evicted = EvictResult.model_validate(
            await stage.run(activity, EvictRequest(pod=pod, ctx=ctx(INCIDENT)), options="eviction")
        )
        assert evicted.evicted and evicted.terminated, evicted.detail
        assert [a.path for a in evicted.actions] == ["kubernetes"], evicted.actions
        assert f"Slurm: {SLURM_NODE} idle+DRAIN" in evicted.actions[0].detail
        with pytest.raises(ApiException) as gone:
            stage.pod()
        assert gone.value.status == 404
    assert injected.hits == injected.times


# --- persistent faults: failed closed ----------------------------------------------------------


async def test_an_unreadable_node_is_never_fenced(stage):
    stage.server.faults.inject("GET", NODE_PATH, status=500, times=None)
    failure = await _fails(stage.run("fence_k8s_node", K8sNodeRequest(node=NODE, ctx=ctx(INCIDENT))))
    assert failure.type == "ServiceException" and "500" in failure.message  # the client's ApiException for 5xx
    assert stage.writes_to(NODE_PATH) == [] and stage.writes_to(NODE_STATUS_PATH) == []
    stage.server.faults.clear()
    assert not stage.core.read_node(NODE).spec.unschedulable


@pytest.mark.parametrize("unreadable", ["pod list", "Slurm"])
async def test_no_eviction_while_the_pod_or_slurm_cannot_be_read(stage, unreadable):
    pod = await located(stage)
    if unreadable == "pod list":
        stage.server.faults.inject("GET", PODS_PATH, drop=True, times=None)
    else:  # slurmrestd answers 500 to the job list, on every generation
        stage.proxy.inject(*rest_path("list_jobs"), status=500, times=None)
    failure = await _fails(stage.run("evict_slurmd_pod", EvictRequest(pod=pod, ctx=ctx(INCIDENT)), options="eviction"))
    if unreadable == "Slurm":
        assert failure.type == "SlurmStateUnknown" and f"cannot read Slurm's view of {SLURM_NODE}" in failure.message
    else:
        assert failure.type in ("MaxRetryError", "ProtocolError"), failure
    assert stage.writes_to(EVICTION_PATH) == []
    stage.server.faults.clear()
    assert stage.pod().metadata.deletion_timestamp is None


async def _fails(call) -> ApplicationError:
    """The activity's final failure, after its retries within the policy."""
    with pytest.raises(WorkflowFailureError) as failed:
        await call
    activity_error = failed.value.cause
    assert isinstance(activity_error, ActivityError), activity_error
    assert isinstance(activity_error.cause, ApplicationError), activity_error.cause
    return activity_error.cause


# --- end to end: a --k8s incident with transient faults on the fence and the eviction ------------


async def test_a_k8s_incident_with_transient_faults_on_the_fence_and_the_eviction_recovers_with_one_eviction(
    temporal_env, local_stack, slurm_cluster, settings
):  # noqa: F811
    stack = dataclasses.replace(local_stack, task_queue=settings.task_queue)
    drill = Drill(
        temporal_env.client,
        stack,
        slurm_cluster,
        settings.policy(),
        XidPolicyTable(settings.xid_policy_file),
        say=print,
    )
    async with SimulatedKubernetes(drill) as kubernetes:
        faults = kubernetes.server.faults
        injected = [
            faults.inject("PUT", r"^/api/v1/nodes/[^/]+$", status=500),  # the fence's cordon and taint
            faults.inject("PUT", r"^/api/v1/nodes/[^/]+/status$", drop=True),  # its condition
            faults.inject("POST", r"/eviction$", status=500),
            faults.inject("POST", r"/eviction$", drop=True),
        ]
        run = await drill.start(DrillOptions(xid=79), kubernetes=kubernetes)
        result = await drill.finish(run, 300)
        evictions = [
            path for method, path in kubernetes.server.requests if method == "POST" and path.endswith("/eviction")
        ]
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    assert all(f.hits == 1 for f in injected), injected
    # Two eviction requests met a fault and took no effect (and Slinky's pod-protect budget may have
    # refused some while the operator still saw the node busy); the last evicted the pod, once.
    assert set(evictions) == {f"/api/v1/namespaces/slurm/pods/{r.node}/eviction"} and len(evictions) >= 3, evictions
    assert [a.path for a in r.actions if a.action == "evict_slurmd_pod"] == ["kubernetes"]
    assert result.passed, [c for c in result.checks if not c.passed]
    [job] = r.jobs
    assert job.restart_count == 1 and job.verified
