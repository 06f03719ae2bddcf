"""Slurm on Kubernetes (Slinky) behind the platform seam (backends/platform.py). The fence finds
the slurmd pod that is the Slurm node and cordons, taints and marks the Node under it; the release
evicts the pod, only while Slurm shows the node drained with no job on it; capacity comes from the
configured provider (NodeSet, node lifecycle or HTTP) and is in service once a new slurmd pod runs
on a healthy Node, idle in Slurm, and the operator's health check passes."""

from __future__ import annotations

from datetime import datetime

from kubernetes.client import ApiClient

from backends.health import HealthCheck
from backends.kubernetes.errors import JobsStillRunning, NodeNotDrained, NodeStillBusy
from backends.kubernetes.nodes import NodeFencing
from backends.kubernetes.pods import SlurmdPods
from backends.kubernetes.providers import (
    HttpReplacement,
    KubernetesReplacementProvider,
    NodeLifecycleReplacement,
    NodeSetReplacement,
)
from backends.kubernetes.slurm_view import SlurmNodeView, confirm_evictable
from backends.kubernetes.spares import SpareWatch
from backends.platform import Progress, telling_progress
from contracts.audit import record
from contracts.k8s_settings import KubernetesSettings
from contracts.kubernetes import EvictResult, K8sReplacementRequest, K8sSpareWaitRequest, K8sUnfenceResult
from contracts.models import (
    ActionContext,
    FenceHandle,
    FenceRequest,
    FenceResult,
    ReleaseRequest,
    ReleaseResult,
    ReplacementRequest,
    ReplacementResult,
    SlurmdPod,
    SpareResult,
    SpareWaitRequest,
    utc_now,
)


def build_provider(settings: KubernetesSettings, api: ApiClient, fencing: NodeFencing) -> KubernetesReplacementProvider:
    if settings.replacement == "nodeset":
        return NodeSetReplacement(api, settings.nodeset(), scale_up=settings.nodeset_scale_up)
    if settings.replacement == "node-lifecycle":
        return NodeLifecycleReplacement(api, fencing, label=settings.replace_label, delete_node=settings.delete_node)
    return HttpReplacement(
        settings.http_url,
        settings.http_token.get_secret_value() if settings.http_token else None,
        timeout_seconds=settings.http_timeout_seconds,
        poll_seconds=settings.http_poll_seconds,
    )


class SlinkyNodes:
    """The NodePlatform of Slurm on Kubernetes. `api` is the worker's own client
    (backends.kubernetes.load_api_client); `slurm` the project's SlurmClient, or a stand-in with
    its two reads."""

    name = "kubernetes"

    def __init__(
        self,
        api: ApiClient,
        settings: KubernetesSettings,
        slurm: SlurmNodeView,
        health: HealthCheck,
        provider: KubernetesReplacementProvider | None = None,
    ):
        self._settings, self._slurm, self._health = settings, slurm, health
        self.fencing = NodeFencing(
            api,
            taint_key=settings.taint_key,
            taint_effect=settings.taint_effect,
            condition_type=settings.condition_type,
        )
        self.pods = SlurmdPods(
            api, namespace=settings.namespace, selector=settings.slurmd_selector, watch_seconds=settings.watch_seconds
        )
        self.spares = SpareWatch(
            api,
            self.pods,
            slurm,
            node_selector=settings.node_selector,
            gpu_resource=settings.gpu_resource,
            watch_seconds=settings.watch_seconds,
        )
        self.provider = provider or build_provider(settings, api, self.fencing)

    async def fence(self, req: FenceRequest) -> FenceResult:
        pod = await self.pods.locate(req.node)
        where = f"{pod.namespace}/{pod.name} on Node {pod.node or '(unscheduled)'}"
        if pod.node is None:
            return FenceResult(handle=self._handle(pod, utc_now()), detail=f"{where}: no Node to fence")
        fenced = await self.fencing.fence(pod.node, req.ctx)
        # Replacements are newer than this incident's first fence, not than this retry.
        handle = self._handle(pod, fenced.prior.fenced_at if fenced.prior is not None else utc_now())
        detail = "; ".join(a.detail for a in fenced.actions) or "already fenced by this incident"
        return FenceResult(handle=handle, detail=f"{where}: {detail}", actions=fenced.actions)

    async def unfence(self, node: str, slurm_node: str | None, ctx: ActionContext) -> K8sUnfenceResult:
        """Undo this incident's fence of the Node, once the return to service found `slurm_node`
        repaired; but not when that Slurm node's slurmd pod now runs on another Node (a
        StatefulSet-mode NodeSet recreates it wherever it can): its health then says nothing of
        this Node, which stays fenced for a person to repair."""
        if slurm_node is not None:
            elsewhere = [
                p
                for p in await self.pods.list()
                if p.slurm_node == slurm_node and not p.terminating and p.node not in (None, node)
            ]
            if elsewhere:
                moved = elsewhere[0]
                action = record(
                    "unfence_k8s_node",
                    node,
                    "none",
                    ctx,
                    f"left fenced: Slurm node {slurm_node} now runs on Node {moved.node} (its slurmd pod "
                    f"{moved.namespace}/{moved.name} was recreated there), so its health says nothing of "
                    f"{node}; uncordon {node} once it is repaired",
                )
                return K8sUnfenceResult(node=node, changed=False, restored=None, detail=action.detail, actions=[action])
        return await self.fencing.unfence(node, ctx)

    def _handle(self, pod: SlurmdPod, fenced_at: datetime) -> FenceHandle:
        return FenceHandle(
            platform=self.name,
            slurm_node=pod.slurm_node,
            fenced_at=fenced_at,
            spares_on_standby=False,
            pod=pod,
            unfence_node=pod.node,
        )

    async def release(self, req: ReleaseRequest, progress: Progress) -> ReleaseResult:
        _, pod = self._fenced(req.handle)
        evicted = await self.evict(pod, req.ctx, progress)
        return ReleaseResult(detail=evicted.detail, actions=evicted.actions)

    async def evict(self, pod: SlurmdPod, ctx: ActionContext, progress: Progress) -> EvictResult:
        """Evict the pod only while Slurm shows its node drained with no job on it (read again
        right before every attempt); wait, with deadlines, through PDB refusals and termination."""

        async def slurm_lets_go() -> str:
            try:
                return await confirm_evictable(self._slurm, pod.slurm_node)
            except (JobsStillRunning, NodeNotDrained, NodeStillBusy) as e:
                if ctx.dry_run:  # the drain before it was only described: say what would stop it now
                    return f"would be refused now: {e}"
                raise

        return await self.pods.evict(
            pod,
            ctx,
            confirm=slurm_lets_go,
            eviction_deadline=self._settings.eviction_deadline_seconds,
            termination_deadline=self._settings.termination_deadline_seconds,
            first_backoff=self._settings.eviction_backoff_seconds,
            progress=progress,
        )

    async def request(self, req: ReplacementRequest, progress: Progress) -> ReplacementResult:
        _, pod = self._fenced(req.handle)
        asked = await self.provider.request(
            K8sReplacementRequest(failed_node=pod.node or "", slurm_node=pod.slurm_node, ctx=req.ctx), progress
        )
        return ReplacementResult(
            node=asked.node,
            provider=asked.provider,
            detail=asked.detail,
            actions=asked.actions,
            accepted=asked.accepted,
        )

    async def wait(self, req: SpareWaitRequest, progress: Progress) -> SpareResult:
        """A new slurmd pod Ready on a healthy Node (Ready, untainted, GPUs allocatable) and idle in
        Slurm, then the operator's health check, which has the last word."""
        handle, pod = self._fenced(req.handle)
        found = await self.spares.wait(
            K8sSpareWaitRequest(
                failed_node=pod.node or "",
                since=handle.fenced_at,
                node=req.node,
                deadline_seconds=req.deadline_seconds,
            ),
            progress,
        )
        spare = SpareResult(
            node=found.slurm_node or pod.slurm_node,
            healthy=found.healthy,
            in_service_at=found.in_service_at,
            detail=f"{found.slurm_node or '-'} on Node {found.node or '-'}: {found.detail}",
        )
        if not found.healthy:
            return spare
        healthy, checked = await telling_progress(
            self._health.check(spare.node), progress, f"health check of {spare.node}"
        )
        return spare.model_copy(update={"healthy": healthy, "detail": f"{spare.detail}; {checked}"})

    @staticmethod
    def _fenced(handle: FenceHandle | None) -> tuple[FenceHandle, SlurmdPod]:
        if handle is None or handle.pod is None:
            raise ValueError("Slurm on Kubernetes acts on the slurmd pod its fence located: pass the fence's handle")
        return handle, handle.pod
