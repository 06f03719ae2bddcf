"""A simulated Slinky cluster (Slurm on Kubernetes) on the in-repo API server, mirroring the real
local Slurm cluster: the Kubernetes side of its slurmd processes, for `recovery drill --k8s`.

    with SlinkyCluster(server, slurm, compute_nodes=["gpu-1", ..., "gpu-4"], spare_nodes=["gpu-5"]) as slinky:
        slinky.kubeconfig          # a kubeconfig for the server (a worker's RECOVERY_K8S_KUBECONFIG)
        slinky.node_of("gpu-2")    # "k8s-gpu-2": the Node a compute Slurm node's slurmd pod starts on
        slinky.namespace, slinky.nodeset    # "slurm", "gpu"

start() seeds, through the API server: the namespace, one Ready Node per compute Slurm node
(8 nvidia.com/gpu allocatable), the NodeSet (slinky.slurm.net/v1beta1, which the server checks
against Slinky's CRD on every write) and, bound to each of
those Nodes, a Running and Ready slurmd pod whose name and hostname are the Slurm node's name.
Then these run in background threads, each talking to the server over HTTPS with the official
client, as the real ones would:

- slurm-operator's own reconciling (SlinkyOperator): the drains of cordoned Nodes' and cordoned
  pods' Slurm nodes, with its reason prefix, and their undrain; pod-protect on busy pods behind the
  workers' PodDisruptionBudget (created at start); the SlurmNodeState* pod conditions;
- the Kubelet (simulators.py): an evicted slurmd pod runs its preStop hook, which sets its Slurm
  node DOWN with the reason `slurm-operator: Pod is terminating`, and goes a second later;
- the Provisioner (simulators.py), which also brings up a Node when the NodeSet controller asks,
  as a cluster autoscaler does for a pod that no Node can take: NotReady, then Ready with GPUs;
- the NodeSet controller: when a slurmd pod is gone, it asks for a Node and, once a Node is Ready,
  schedulable, untainted, with GPUs and no slurmd pod, creates a slurmd pod bound to it for the
  next hot spare of the Slurm cluster, lets that slurmd register, and marks the pod Running and
  Ready.

The real cluster's slurmd processes are fixed, so a replacement slurmd is one of its hot spares,
which the local stack keeps drained on standby; its registering with slurmctld is played by
resuming it (`scontrol update NodeName=<spare> State=RESUME`).

stop() stops the threads (raising what one of them failed with) and removes the kubeconfig.
"""

from __future__ import annotations

import asyncio
import queue
import shutil
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from backends.slurm import SlurmCli
from contracts.kubernetes import SLURMD_PRE_STOP_REASON
from contracts.models import SlurmNode
from kubesim.server import KubeApiServer
from kubesim.simulators import NODESET, Kubelet, Provisioner, _Simulator

CONTROLLER = "slurm"  # the Slurm cluster (Controller) the NodeSet belongs to
CLUSTER_LABEL = "slinky.slurm.net/cluster"
SLURMD_LABELS = {"app.kubernetes.io/name": "slurmd", CLUSTER_LABEL: CONTROLLER}
SLURMD_SELECTOR = ",".join(f"{key}={value}" for key, value in SLURMD_LABELS.items())
GPU_RESOURCE = "nvidia.com/gpu"
GPUS_PER_NODE = 8
SLURMD_EXIT_SECONDS = 1.0  # slurmd stops this soon after SIGTERM: the kubelet then removes its pod
TICK_SECONDS = 0.25  # how often each simulated actor looks: quick enough for a drill, light on the CPU
NODESET_CRD = "slinky.slurm.net_nodesets.yaml"  # in kubesim/crds/
# slurm-operator's names (api/v1beta1/well_known.go, slurmcontrol.go, pkg/conditions)
OPERATOR_REASON_PREFIX = "slurm-operator: "
NODE_CORDON_REASON_ANNOTATION = "nodeset.slinky.slurm.net/node-cordon-reason"
POD_CORDON_ANNOTATION = "nodeset.slinky.slurm.net/pod-cordon"
POD_PROTECT_LABEL = "nodeset.slinky.slurm.net/pod-protect"
SLURM_CONDITION_FLAGS = {
    "COMPLETING",
    "DRAIN",
    "FAIL",
    "INVALID",
    "INVALID_REG",
    "MAINTENANCE",
    "NOT_RESPONDING",
    "UNDRAIN",
}


class SlinkyCluster:
    def __init__(
        self,
        server: KubeApiServer,
        slurm: SlurmCli,
        *,
        compute_nodes: list[str],
        spare_nodes: list[str],
        namespace: str = "slurm",
        nodeset: str = "gpu",
    ):
        self.server, self.namespace, self.nodeset = server, namespace, nodeset
        self._slurm = slurm
        self._compute, self._spares = list(compute_nodes), list(spare_nodes)
        self._actors = ExitStack()
        self._dir = ""
        self.kubeconfig: Path | None = None  # written by start()
        self.operator: SlinkyOperator | None = None  # started by start()

    @staticmethod
    def node_of(slurm_node: str) -> str:
        return f"k8s-{slurm_node}"

    def start(self) -> SlinkyCluster:
        self.server.register_crd(*NODESET, "NodeSet", crd=NODESET_CRD)
        self._dir = tempfile.mkdtemp(prefix="slinky-")
        self.kubeconfig = Path(self.server.kubeconfig(Path(self._dir) / "kubeconfig"))
        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        try:
            self._seed(client.CoreV1Api(api), client.CustomObjectsApi(api))
            provisioner = NodeProvisioner(
                api, name_pattern="k8s-gpu-new-{n}", gpus=GPUS_PER_NODE, interval=TICK_SECONDS
            )
            self.operator = SlinkyOperator(api, self._slurm, namespace=self.namespace, interval=TICK_SECONDS)
            self.operator.reconcile()  # the pods' labels and conditions as they are, before anyone looks
            for actor in (
                self.operator,
                Kubelet(api, finish_after=SLURMD_EXIT_SECONDS, interval=TICK_SECONDS, pre_stop=self._slurmd_pre_stop),
                provisioner,
                NodeSetController(
                    api, provisioner, self._slurm, namespace=self.namespace, serving=self._compute, spares=self._spares
                ),
            ):
                self._actors.enter_context(actor)
        except BaseException:
            self.stop()
            raise
        finally:
            api.close()  # each actor has an ApiClient of its own
        return self

    def _slurmd_pre_stop(self, pod: client.V1Pod) -> None:
        """The slurmd container's preStop hook, as Slinky's worker builder writes it (from v1.2.0):
        `scontrol update nodename=$(hostname) state=down reason='slurm-operator: Pod is terminating'`.
        Slurm keeps a DRAIN and replaces the reason, so whoever drained the node before reads it as
        the operator's now."""
        labels = pod.metadata.labels or {}
        if all(labels.get(key) == value for key, value in SLURMD_LABELS.items()) and pod.spec.hostname:
            asyncio.run(self._slurm.update_node(pod.spec.hostname, "DOWN", SLURMD_PRE_STOP_REASON))

    def _seed(self, core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
        core.create_namespace({"metadata": {"name": self.namespace}})
        client.PolicyV1Api(core.api_client).create_namespaced_pod_disruption_budget(
            self.namespace, workers_pdb(self.namespace, CONTROLLER)
        )
        custom.create_namespaced_custom_object(
            NODESET[0],
            NODESET[1],
            self.namespace,
            NODESET[2],
            {
                "apiVersion": f"{NODESET[0]}/{NODESET[1]}",
                "kind": "NodeSet",
                "metadata": {"name": self.nodeset},
                "spec": {"controllerRef": {"name": CONTROLLER}, "replicas": len(self._compute)},
            },
        )
        # what the operator's NodeSet controller reports once its pods run (status requires both)
        custom.patch_namespaced_custom_object_status(
            NODESET[0],
            NODESET[1],
            self.namespace,
            NODESET[2],
            self.nodeset,
            {"status": {"replicas": len(self._compute), "selector": SLURMD_SELECTOR, "nodeSetHash": "simulated"}},
        )
        for slurm_node in self._compute:
            node = self.node_of(slurm_node)
            core.create_node({"metadata": {"name": node}})
            core.patch_node_status(
                node,
                {
                    "status": {
                        **_gpu_resources(),
                        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                    }
                },
            )
            create_slurmd_pod(core, self.namespace, slurm_node, node)
            mark_running(core, self.namespace, slurm_node)

    def stop(self) -> None:
        try:
            self._actors.close()
        finally:
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> SlinkyCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _gpu_resources() -> dict:
    resources = {GPU_RESOURCE: str(GPUS_PER_NODE), "cpu": "64", "memory": "512Gi", "pods": "110"}
    return {"capacity": resources, "allocatable": resources}


def create_slurmd_pod(core: client.CoreV1Api, namespace: str, slurm_node: str, node: str) -> None:
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": slurm_node, "labels": SLURMD_LABELS},
            "spec": {
                "nodeName": node,
                "hostname": slurm_node,
                "containers": [
                    {
                        "name": "slurmd",
                        "image": "ghcr.io/slinkyproject/slurmd",
                        "resources": {"limits": {GPU_RESOURCE: str(GPUS_PER_NODE)}},
                    }
                ],
            },
        },
    )


def mark_running(core: client.CoreV1Api, namespace: str, pod: str) -> None:
    """What the kubelet reports once the slurmd container runs and its readiness probe passes."""
    core.patch_namespaced_pod_status(
        pod, namespace, {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
    )


def is_ready(obj: client.V1Node | client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in obj.status.conditions or [])


def can_take_slurmd(node: client.V1Node) -> bool:
    """Where the scheduler would put a slurmd pod: Ready, schedulable, no taint that keeps pods
    off, GPUs allocatable."""
    blocked = node.spec.unschedulable or any(t.effect in ("NoSchedule", "NoExecute") for t in node.spec.taints or [])
    return is_ready(node) and not blocked and int((node.status.allocatable or {}).get(GPU_RESOURCE, "0")) > 0


class SlinkyOperator(_Simulator):
    """What Slinky's slurm-operator (1.2, internal/controller/nodeset at f2ed3fc5) does to the
    slurmd pods it runs and their Slurm nodes, besides creating them (NodeSetController, below):

    - syncCordon: a pod on a cordoned Node has its Slurm node drained with the reason
      `slurm-operator: ` + the Node's `nodeset.slinky.slurm.net/node-cordon-reason`, or
      `Node (<node>) was cordoned, Pod (<ns>/<pod>) must be cordoned`, and gets the annotation
      `nodeset.slinky.slurm.net/pod-cordon=true`; a pod with that annotation (on a schedulable Node)
      is drained with `Pod (<ns>/<pod>) was cordoned`; without it, an operator-owned drain is
      undrained (and the pod-cordon it set for a cordoned Node goes once the Node is schedulable).
      Only a reason that is empty or the operator's (the prefix) counts as its own: an external
      drain, or a node DOWN for "Not responding", is never touched.
    - workloadDisruptionProtection: a pod whose Slurm node is busy (allocated, mixed or completing)
      carries `nodeset.slinky.slurm.net/pod-protect=true`, which the PodDisruptionBudget
      `slurm-workers-pdb-<controller>` (maxUnavailable 0) matches, so evicting it gets 429.
    - Pod conditions SlurmNodeState<State> (status True, message the Slurm node's reason), one
      per base state and flag, stale ones removed.

    Reconciled every tick (the operator: on events and every 30 s).
    """

    def __init__(self, api_client: client.ApiClient, slurm: SlurmCli, *, namespace: str, interval: float):
        super().__init__(api_client, interval)
        self._slurm, self._namespace = slurm, namespace
        self._cordoned_for_node: set[str] = set()  # pod UIDs it annotated pod-cordon because of their Node

    def reconcile(self) -> None:
        self._tick()

    def _tick(self) -> None:
        core = client.CoreV1Api(self._api)
        pods = core.list_namespaced_pod(self._namespace, label_selector=SLURMD_SELECTOR).items
        nodes = {n.metadata.name: n for n in core.list_node().items}
        slurm = {n.name: n for n in asyncio.run(self._slurm.list_nodes())}
        for pod in pods:
            found = slurm.get(pod.spec.hostname or "")
            node = nodes.get(pod.spec.node_name or "")
            if pod.metadata.deletion_timestamp is not None or found is None or node is None:
                continue
            self._sync_cordon(core, pod, node, found)
            self._sync_protection(core, pod, found)
            self._sync_conditions(core, pod, found)

    def _sync_cordon(self, core: client.CoreV1Api, pod: client.V1Pod, node: client.V1Node, found: SlurmNode) -> None:
        ours = not found.reason or found.reason.startswith(OPERATOR_REASON_PREFIX)
        if not ours or (found.state == "down" and "Not responding" in found.reason):
            return
        annotations = pod.metadata.annotations or {}
        where = f"{pod.metadata.namespace}/{pod.metadata.name}"
        if node.spec.unschedulable:
            reason = (node.metadata.annotations or {}).get(NODE_CORDON_REASON_ANNOTATION) or (
                f"Node ({node.metadata.name}) was cordoned, Pod ({where}) must be cordoned"
            )
            if annotations.get(POD_CORDON_ANNOTATION) != "true":
                self._annotate(core, pod, "true")
                self._cordoned_for_node.add(pod.metadata.uid)
            self._drain(found, reason)
        elif pod.metadata.uid in self._cordoned_for_node:
            # syncPodUncordon: its own pod-cordon goes once the Node is schedulable again
            self._annotate(core, pod, None)
            self._cordoned_for_node.discard(pod.metadata.uid)
        elif annotations.get(POD_CORDON_ANNOTATION) == "true":
            self._drain(found, f"Pod ({where}) was cordoned")
        elif found.drained and "UNDRAIN" not in found.flags:
            asyncio.run(self._slurm.run("scontrol", "update", f"NodeName={found.name}", "State=UNDRAIN"))

    def _annotate(self, core: client.CoreV1Api, pod: client.V1Pod, cordon: str | None) -> None:
        patch = {"metadata": {"annotations": {POD_CORDON_ANNOTATION: cordon}}}  # None: a merge patch removes it
        core.patch_namespaced_pod(pod.metadata.name, self._namespace, patch)

    def _drain(self, found: SlurmNode, reason: str) -> None:
        # MakeNodeDrain keeps a reason already there (the operator's own, by now)
        if not (found.drained and found.reason):
            asyncio.run(self._slurm.update_node(found.name, "DRAIN", OPERATOR_REASON_PREFIX + reason))

    def _sync_protection(self, core: client.CoreV1Api, pod: client.V1Pod, found: SlurmNode) -> None:
        busy = found.state in ("allocated", "mixed") or "COMPLETING" in found.flags
        labelled = (pod.metadata.labels or {}).get(POD_PROTECT_LABEL) == "true"
        if busy != labelled:
            value = "true" if busy else None  # None: a merge patch removes the label
            core.patch_namespaced_pod(
                pod.metadata.name, self._namespace, {"metadata": {"labels": {POD_PROTECT_LABEL: value}}}
            )

    def _sync_conditions(self, core: client.CoreV1Api, pod: client.V1Pod, found: SlurmNode) -> None:
        states = [found.state.upper(), *(f for f in found.flags if f in SLURM_CONDITION_FLAGS)]
        wanted = {f"SlurmNodeState{s.title().replace('_', '')}": found.reason for s in states}
        conditions = pod.status.conditions or []
        have = {c.type: c.message or "" for c in conditions if c.type.startswith("SlurmNodeState")}
        if have == wanted:
            return
        kept = [
            core.api_client.sanitize_for_serialization(c) for c in conditions if not c.type.startswith("SlurmNodeState")
        ]
        merged = kept + [{"type": t, "status": "True", "message": m} for t, m in sorted(wanted.items())]
        # A strategic merge keyed on type would keep the stale ones: the whole list is replaced, only
        # if the pod is as read (a kubelet's Ready written meanwhile must not be lost); else next tick.
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": pod.metadata.resource_version},
            {"op": "replace", "path": "/status/conditions", "value": merged},
        ]
        try:
            core.patch_namespaced_pod_status(pod.metadata.name, self._namespace, patch)
        except ApiException as e:
            if e.status not in (409, 422):
                raise


def workers_pdb(namespace: str, controller: str) -> dict:
    """The PodDisruptionBudget slurm-operator makes for a Slurm cluster's workers (worker_pdb.go)."""
    return {
        "metadata": {"name": f"slurm-workers-pdb-{controller}", "namespace": namespace},
        "spec": {
            "maxUnavailable": 0,
            "selector": {"matchLabels": {POD_PROTECT_LABEL: "true", CLUSTER_LABEL: controller}},
        },
    }


class NodeProvisioner(Provisioner):
    """The Provisioner, also bringing up one Node per order()."""

    def __init__(self, api_client: client.ApiClient, **options):
        super().__init__(api_client, **options)
        self._orders: queue.SimpleQueue[None] = queue.SimpleQueue()

    def order(self) -> None:
        """Thread-safe: the Node comes on one of the next rounds."""
        self._orders.put(None)

    def _tick(self) -> None:
        core = client.CoreV1Api(self._api)
        names = {n.metadata.name for n in core.list_node().items}
        while not self._orders.empty():
            self._orders.get()
            name = self._create_node(core, names)
            names.add(name)
            self._booting.append((time.monotonic() + self.ready_after, name, None))
        super()._tick()


class NodeSetController(_Simulator):
    """Keeps a slurmd pod for each Slurm node it serves; a lost one is replaced by the next hot spare."""

    def __init__(
        self,
        api_client: client.ApiClient,
        provisioner: NodeProvisioner,
        slurm: SlurmCli,
        *,
        namespace: str,
        serving: list[str],
        spares: list[str],
    ):
        super().__init__(api_client, TICK_SECONDS)
        self._provisioner, self._slurm, self._namespace = provisioner, slurm, namespace
        self._serving = set(serving)
        self._spares = list(spares)  # not brought up yet, in order
        self._waiting: list[str] = []  # spares waiting for a free Node

    def _tick(self) -> None:
        core = client.CoreV1Api(self._api)
        pods = core.list_namespaced_pod(self._namespace, label_selector=SLURMD_SELECTOR).items
        # A pod that is only Terminating still counts: a NodeSet, like a StatefulSet, waits until it is gone.
        for lost in sorted(self._serving - {p.spec.hostname for p in pods}):
            self._serving.remove(lost)
            if self._spares:  # without one, the NodeSet stays a replica short
                self._waiting.append(self._spares.pop(0))
                self._provisioner.order()  # every Node holds a slurmd pod: the replacement needs a new one
        if not self._waiting:
            return
        taken = {p.spec.node_name for p in pods}
        free = [n.metadata.name for n in core.list_node().items if n.metadata.name not in taken and can_take_slurmd(n)]
        for spare, node in list(zip(self._waiting, free)):
            self._waiting.remove(spare)
            create_slurmd_pod(core, self._namespace, spare, node)
            # slurmd registers with slurmctld: the spare leaves its standby drain
            asyncio.run(self._slurm.update_node(spare, "RESUME", None))
            mark_running(core, self._namespace, spare)
            self._serving.add(spare)
