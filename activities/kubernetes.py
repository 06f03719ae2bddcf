"""The Kubernetes activities of Slurm on Kubernetes (Slinky) outside the platform seam: the Node's
unfence by the return to service, and, until the `one-platform-seam` patch retires
(docs/upgrades.md), the steps by which incidents begun before it fence, evict and replace. Each
is one part of SlinkyNodes (backends/kubernetes/platform.py), which activities/platform.py runs
whole for every incident since; errors as there (final_answers)."""

from __future__ import annotations

from kubernetes.client import ApiClient
from temporalio import activity

from activities.platform import final_answers, heartbeat
from backends.health import HealthCheck
from backends.kubernetes import KubernetesReplacementProvider, SlurmNodeView
from backends.kubernetes.platform import SlinkyNodes
from contracts.k8s_settings import KubernetesSettings
from contracts.kubernetes import (
    EvictRequest,
    EvictResult,
    K8sFenceResult,
    K8sNodeRequest,
    K8sReplacementRequest,
    K8sReplacementResult,
    K8sSpareResult,
    K8sSpareWaitRequest,
    K8sUnfenceResult,
    SlurmdPodRequest,
)
from contracts.models import SlurmdPod


class KubernetesActivities:
    def __init__(
        self,
        api: ApiClient,
        settings: KubernetesSettings,
        slurm: SlurmNodeView,
        provider: KubernetesReplacementProvider | None = None,
        health: HealthCheck | None = None,
    ):
        """`api` is this worker's own client (backends.kubernetes.load_api_client); `slurm` the
        project's SlurmClient, or a stand-in with its two reads. `platform` is what the worker binds
        to the platform seam."""
        self.platform = SlinkyNodes(api, settings, slurm, health or HealthCheck([]), provider)

    def all(self) -> list:
        return [
            self.fence_k8s_node,
            self.unfence_k8s_node,
            self.locate_slurmd_pod,
            self.evict_slurmd_pod,
            self.request_k8s_replacement,
            self.wait_for_k8s_node,
        ]

    @activity.defn
    async def unfence_k8s_node(self, req: K8sNodeRequest) -> K8sUnfenceResult:
        """Undo this incident's fence, restoring what the Node had before it and nothing else;
        left fenced when `req.slurm_node` has moved to another Node (SlinkyNodes.unfence)."""
        with final_answers():
            return await self.platform.unfence(req.node, req.slurm_node, req.ctx)

    @activity.defn
    async def fence_k8s_node(self, req: K8sNodeRequest) -> K8sFenceResult:
        """Cordon, taint and mark the Node; its state before is kept on it for unfence."""
        with final_answers():
            return await self.platform.fencing.fence(req.node, req.ctx)

    @activity.defn
    async def locate_slurmd_pod(self, req: SlurmdPodRequest) -> SlurmdPod:
        """The slurmd pod that is this Slurm node, and the Node under it."""
        with final_answers():
            return await self.platform.pods.locate(req.slurm_node)

    @activity.defn
    async def evict_slurmd_pod(self, req: EvictRequest) -> EvictResult:
        with final_answers():
            return await self.platform.evict(req.pod, req.ctx, heartbeat)

    @activity.defn
    async def request_k8s_replacement(self, req: K8sReplacementRequest) -> K8sReplacementResult:
        with final_answers():
            return await self.platform.provider.request(req, heartbeat)

    @activity.defn
    async def wait_for_k8s_node(self, req: K8sSpareWaitRequest) -> K8sSpareResult:
        """A replacement in service: Node Ready, untainted, GPUs allocatable; its slurmd pod Ready
        and its Slurm node idle. At the deadline: healthy=False, saying what was missing."""
        with final_answers():
            return await self.platform.spares.wait(req, heartbeat)
