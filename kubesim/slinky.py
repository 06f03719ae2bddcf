"""A simulated Slinky cluster (Slurm on Kubernetes) on the in-repo API server, mirroring the real
local Slurm cluster: the Kubernetes side of its slurmd processes, for `recovery drill --k8s`.

    with SlinkyCluster(server, slurm, compute_nodes=["gpu-1", ..., "gpu-4"], spare_nodes=["gpu-5"],
                       scaling_mode="StatefulSet", replace_label=None, on_moved=None) as slinky:
        slinky.kubeconfig          # a kubeconfig for the server (a worker's RECOVERY_K8S_KUBECONFIG)
        slinky.node_of("gpu-2")    # "k8s-gpu-2": the Node a compute Slurm node's slurmd pod starts on
        slinky.namespace, slinky.nodeset    # "slurm", "gpu"

start() seeds, through the API server: the namespace, one Ready Node per compute Slurm node
(8 nvidia.com/gpu allocatable), the NodeSet (slinky.slurm.net/v1beta1, which the server checks
against Slinky's CRD on every write; scalingMode as asked) and, bound to each of those Nodes, a
Running and Ready slurmd pod whose hostname is the Slurm node's name (and so is its name in
StatefulSet mode; DaemonSet mode generates it). `replace_label`: the label key on a Node that
makes the Provisioner bring a new one (the node lifecycle); `on_moved(slurm_node)`: called when a
Slurm node's pod starts on another Node (new hardware under the old name).
Then these run in background threads, each talking to the server over HTTPS with the official
client, as the real ones would:

- slurm-operator's own reconciling (SlinkyOperator): the drains of cordoned Nodes' and cordoned
  pods' Slurm nodes, with its reason prefix, and their undrain; pod-protect on busy pods behind the
  workers' PodDisruptionBudget (created at start); the SlurmNodeState* pod conditions;
- the Kubelet (simulators.py): an evicted slurmd pod runs its preStop hook, which sets its Slurm
  node DOWN with the reason `slurm-operator: Pod is terminating`, and goes a second later;
- the Provisioner (simulators.py), which also brings up a Node when the NodeSet controller asks,
  as a cluster autoscaler does for a pod that no Node can take: NotReady, then Ready with GPUs;
- the NodeSet controller (NodeSetController), by the NodeSet's scaling mode: in StatefulSet mode
  (the default) a lost slurmd pod comes back under its identity (its Slurm node) on a Node that can
  take it, a Node being ordered when none can, and the operator sets that Slurm node IDLE once its
  pod runs on another Node; in DaemonSet mode every Node that can take one gets a slurmd pod, its
  Slurm node named by the Node's hostname-override annotation (a new Node is given the next hot
  spare's), and the fenced Node none.

The real cluster's slurmd processes are fixed, so a Slurm node new to the NodeSet is one of its
hot spares, which the local stack keeps drained on standby; its registering with slurmctld is
played by resuming it (`scontrol update NodeName=<spare> State=RESUME`).

stop() stops the threads (raising what one of them failed with) and removes the kubeconfig.
"""

from __future__ import annotations

import asyncio
import queue
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from backends.slurm import SlurmCli
from contracts.kubernetes import SLURMD_PRE_STOP_REASON, ScalingMode
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
SCALING_MODE_LABEL = "nodeset.slinky.slurm.net/scaling-mode"
POD_HOSTNAME_LABEL = "nodeset.slinky.slurm.net/pod-hostname"
HOSTNAME_OVERRIDE_ANNOTATION = "nodeset.slinky.slurm.net/hostname-override"
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
        scaling_mode: ScalingMode = "StatefulSet",
        replace_label: str | None = None,
        on_moved: Callable[[str], None] | None = None,
    ):
        self.server, self.namespace, self.nodeset = server, namespace, nodeset
        self.scaling_mode = scaling_mode
        self._replace_label, self._on_moved = replace_label, on_moved
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
                api,
                name_pattern="k8s-gpu-new-{n}",
                replace_label=self._replace_label,
                gpus=GPUS_PER_NODE,
                interval=TICK_SECONDS,
            )
            self.operator = SlinkyOperator(
                api, self._slurm, namespace=self.namespace, interval=TICK_SECONDS, on_moved=self._on_moved
            )
            self.operator.reconcile()  # the pods' labels and conditions as they are, before anyone looks
            for actor in (
                self.operator,
                Kubelet(api, finish_after=SLURMD_EXIT_SECONDS, interval=TICK_SECONDS, pre_stop=self._slurmd_pre_stop),
                provisioner,
                NodeSetController(
                    api,
                    provisioner,
                    self._slurm,
                    namespace=self.namespace,
                    nodeset=self.nodeset,
                    mode=self.scaling_mode,
                    serving=self._compute,
                    spares=self._spares,
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
                "spec": {
                    "controllerRef": {"name": CONTROLLER},
                    "scalingMode": self.scaling_mode,
                    # ignored in DaemonSet mode: one pod per matching Node
                    **({"replicas": len(self._compute)} if self.scaling_mode == "StatefulSet" else {}),
                },
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
            # In DaemonSet mode the pod's hostname, so its Slurm node, is the Node's name or this override.
            override = {HOSTNAME_OVERRIDE_ANNOTATION: slurm_node} if self.scaling_mode == "DaemonSet" else {}
            core.create_node({"metadata": {"name": node, "annotations": override}})
            core.patch_node_status(
                node,
                {
                    "status": {
                        **_gpu_resources(),
                        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                    }
                },
            )
            pod = create_slurmd_pod(
                core, self.namespace, slurm_node, node, mode=self.scaling_mode, nodeset=self.nodeset
            )
            mark_running(core, self.namespace, pod)

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


def create_slurmd_pod(
    core: client.CoreV1Api, namespace: str, slurm_node: str, node: str, *, mode: ScalingMode, nodeset: str
) -> str:
    """A slurmd pod bound to `node` whose hostname is `slurm_node`; returns its name. StatefulSet
    mode names it after its identity (here the Slurm node), DaemonSet mode generates a name from
    the NodeSet's (utils.go initIdentity, newNodeSetPodDaemon)."""
    name = {"name": slurm_node} if mode == "StatefulSet" else {"generateName": f"{nodeset}-"}
    labels = SLURMD_LABELS | {SCALING_MODE_LABEL: mode, POD_HOSTNAME_LABEL: slurm_node}
    pod = core.create_namespaced_pod(
        namespace,
        {
            "metadata": {**name, "labels": labels},
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
    return pod.metadata.name


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
    - UpdateNodeWithPodInfo (slurmcontrol.go): when a Slurm node's pod runs on another Node than
      before (a StatefulSet-mode pod recreated elsewhere), the Slurm node is set IDLE, which clears
      a DOWN and a DRAIN, whoever set them. The operator keeps the pod's Node in the Slurm node's
      comment; this simulation keeps it in memory, leaving the comments to the recovery.
      `on_moved(slurm_node)` is called first (a drill clears the old machine's fault).

    Reconciled every tick (the operator: on events and every 30 s).
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        slurm: SlurmCli,
        *,
        namespace: str,
        interval: float,
        on_moved: Callable[[str], None] | None = None,
    ):
        super().__init__(api_client, interval)
        self._slurm, self._namespace, self._on_moved = slurm, namespace, on_moved
        self._cordoned_for_node: set[str] = set()  # pod UIDs it annotated pod-cordon because of their Node
        self._pod_node: dict[str, str] = {}  # Slurm node -> the Node its pod was last seen on (the podInfo)

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
            if self._moved(found, node.metadata.name):
                found = asyncio.run(self._slurm.get_node(found.name))
            self._sync_cordon(core, pod, node, found)
            self._sync_protection(core, pod, found)
            self._sync_conditions(core, pod, found)

    def _moved(self, found: SlurmNode, node: str) -> bool:
        before = self._pod_node.get(found.name)
        self._pod_node[found.name] = node
        if before is None or before == node:
            return False
        if self._on_moved is not None:  # the machine is new before Slurm hears of it
            self._on_moved(found.name)
        asyncio.run(self._slurm.run("scontrol", "update", f"NodeName={found.name}", "State=IDLE"))
        return True

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
    """The NodeSet controller's pods, by scaling mode (nodeset_sync.go, syncNodeSetPods):

    - StatefulSet: one pod per replica, each with its identity: here the Slurm nodes served at
      start, then the hot spares as the next ones. A lost pod comes back under its identity (pod
      name, hostname, Slurm node) on a Node that can take it; with none free, a Node is ordered, as
      a cluster autoscaler does for a pod no Node can take. Replicas added: the next identities, on
      the Nodes the Provisioner brings for them.
    - DaemonSet: a pod on every Node that can take one (Ready, GPUs, no NoSchedule or NoExecute
      taint: PodShouldRunOnNode; a pod already there stays), named from the NodeSet's, its Slurm
      node the Node's hostname-override annotation. A new Node without one is given the next hot
      spare's name, as its bootstrap would name the machine. `replicas` plays no part.

    Every hot spare's slurmd registering with slurmctld is played by resuming the spare from its
    standby drain; a recreated identity's Slurm node is the operator's to bring back (SlinkyOperator).
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        provisioner: NodeProvisioner,
        slurm: SlurmCli,
        *,
        namespace: str,
        nodeset: str,
        mode: ScalingMode,
        serving: list[str],
        spares: list[str],
    ):
        super().__init__(api_client, TICK_SECONDS)
        self._provisioner, self._slurm, self._namespace = provisioner, slurm, namespace
        self._nodeset, self._mode = nodeset, mode
        self._identities = list(serving) + list(spares)  # in order: the replicas' identities
        self._spares = set(spares)
        self._registered = set(serving)  # Slurm nodes whose slurmd has registered
        self._ordered: set[str] = set()  # identities a Node was ordered for

    def _tick(self) -> None:
        core = client.CoreV1Api(self._api)
        pods = core.list_namespaced_pod(self._namespace, label_selector=SLURMD_SELECTOR).items
        nodes = core.list_node().items
        if self._mode == "StatefulSet":
            self._keep_replicas(core, pods, nodes)
        else:
            self._one_per_node(core, pods, nodes)

    def _keep_replicas(self, core: client.CoreV1Api, pods: list[client.V1Pod], nodes: list[client.V1Node]) -> None:
        group, version, plural = NODESET
        nodeset = client.CustomObjectsApi(self._api).get_namespaced_custom_object(
            group, version, self._namespace, plural, self._nodeset
        )
        replicas = (nodeset.get("spec") or {}).get("replicas") or 0
        # A pod that is only Terminating still counts: like a StatefulSet, it waits until it is gone.
        missing = [i for i in self._identities[:replicas] if i not in {p.spec.hostname for p in pods}]
        free = [n.metadata.name for n in self._free_nodes(pods, nodes, can_take_slurmd)]
        for identity in missing:
            if free:
                self._start(core, identity, free.pop(0))
            elif identity in self._registered and identity not in self._ordered:
                self._ordered.add(identity)  # lost: a Node for it, as an autoscaler brings one
                self._provisioner.order()

    def _one_per_node(self, core: client.CoreV1Api, pods: list[client.V1Pod], nodes: list[client.V1Node]) -> None:
        for node in self._free_nodes(pods, nodes, _daemon_pod_fits):
            annotations = node.metadata.annotations or {}
            identity = annotations.get(HOSTNAME_OVERRIDE_ANNOTATION)
            if identity is None:
                unnamed = [s for s in self._identities if s in self._spares and s not in self._registered]
                if not unnamed:
                    continue  # no slurmd to play this machine's
                identity = unnamed[0]
                patch = {"metadata": {"annotations": {HOSTNAME_OVERRIDE_ANNOTATION: identity}}}
                core.patch_node(node.metadata.name, patch)
            self._start(core, identity, node.metadata.name)

    def _free_nodes(
        self, pods: list[client.V1Pod], nodes: list[client.V1Node], fits: Callable[[client.V1Node], bool]
    ) -> list[client.V1Node]:
        taken = {p.spec.node_name for p in pods}
        free = [n for n in nodes if n.metadata.name not in taken and fits(n)]
        return sorted(free, key=lambda n: n.metadata.name)

    def _start(self, core: client.CoreV1Api, identity: str, node: str) -> None:
        pod = create_slurmd_pod(core, self._namespace, identity, node, mode=self._mode, nodeset=self._nodeset)
        if identity not in self._registered:
            # slurmd registers with slurmctld: the spare leaves its standby drain
            asyncio.run(self._slurm.update_node(identity, "RESUME", None))
            self._registered.add(identity)
        self._ordered.discard(identity)
        mark_running(core, self._namespace, pod)


def _daemon_pod_fits(node: client.V1Node) -> bool:
    """Where a DaemonSet-mode pod should run: Slinky's predicates look at taints (a cordon alone
    does not stop a daemon pod), and it runs once the Node is Ready with GPUs."""
    blocked = any(t.effect in ("NoSchedule", "NoExecute") for t in node.spec.taints or [])
    return is_ready(node) and not blocked and int((node.status.allocatable or {}).get(GPU_RESOURCE, "0")) > 0
