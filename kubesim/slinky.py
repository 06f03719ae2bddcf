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

from backends.slurm import SlurmCli
from contracts.kubernetes import SLURMD_PRE_STOP_REASON
from kubesim.server import KubeApiServer
from kubesim.simulators import NODESET, Kubelet, Provisioner, _Simulator

SLURMD_LABELS = {"app.kubernetes.io/name": "slurmd"}
SLURMD_SELECTOR = ",".join(f"{key}={value}" for key, value in SLURMD_LABELS.items())
GPU_RESOURCE = "nvidia.com/gpu"
GPUS_PER_NODE = 8
SLURMD_EXIT_SECONDS = 1.0  # slurmd stops this soon after SIGTERM: the kubelet then removes its pod
TICK_SECONDS = 0.25  # how often each simulated actor looks: quick enough for a drill, light on the CPU
NODESET_CRD = "slinky.slurm.net_nodesets.yaml"  # in kubesim/crds/


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
            for actor in (
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
        custom.create_namespaced_custom_object(
            NODESET[0],
            NODESET[1],
            self.namespace,
            NODESET[2],
            {
                "apiVersion": f"{NODESET[0]}/{NODESET[1]}",
                "kind": "NodeSet",
                "metadata": {"name": self.nodeset},
                "spec": {"controllerRef": {"name": "slurm"}, "replicas": len(self._compute)},
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
