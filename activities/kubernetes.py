"""The Kubernetes steps of a recovery on Slurm-on-Kubernetes (Slinky): fence the Node, evict the
slurmd pod once Slurm has let go of the node, request replacement capacity, wait for it.

Each activity is idempotent (what it writes records enough to know, on a retry, what is already
done) and every write leaves an ActionRecord with the exact API call. Final answers are
non-retryable ApplicationErrors named after their cause: NodeNotFound, SlurmdPodNotFound,
NodeSetNotFound, JobsStillRunning, NodeNotDrained, EvictionBlocked, SlurmNotFound. Retryable:
SlurmStateUnknown, NodeStillBusy, ProviderUnavailable, ConflictPersists and API/transport errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kubernetes.client import ApiClient
from temporalio import activity
from temporalio.exceptions import ApplicationError

from backends.kubernetes import (
    HttpReplacement,
    JobsStillRunning,
    KubeRecoveryError,
    KubernetesReplacementProvider,
    NodeFencing,
    NodeLifecycleReplacement,
    NodeNotDrained,
    NodeSetReplacement,
    NodeStillBusy,
    SlurmdPods,
    SlurmNodeView,
    SpareWatch,
    confirm_evictable,
)
from backends.slurm import SlurmNotFound
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
    SlurmdPod,
    SlurmdPodRequest,
)


@contextmanager
def final_answers() -> Iterator[None]:
    """Backend answers become ApplicationErrors of the same name, non-retryable when final."""
    try:
        yield
    except KubeRecoveryError as e:
        raise ApplicationError(str(e), type=type(e).__name__, non_retryable=e.final) from e
    except SlurmNotFound as e:
        raise ApplicationError(str(e), type="SlurmNotFound", non_retryable=True) from e


def _heartbeat(detail: str) -> None:
    activity.heartbeat(detail)


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


class KubernetesActivities:
    def __init__(
        self,
        api: ApiClient,
        settings: KubernetesSettings,
        slurm: SlurmNodeView,
        provider: KubernetesReplacementProvider | None = None,
    ):
        """`api` is this worker's own client (backends.kubernetes.load_api_client); `slurm` the
        project's SlurmClient, or a stand-in with its two reads."""
        self._settings, self._slurm = settings, slurm
        self._fencing = NodeFencing(
            api,
            taint_key=settings.taint_key,
            taint_effect=settings.taint_effect,
            condition_type=settings.condition_type,
        )
        self._pods = SlurmdPods(
            api, namespace=settings.namespace, selector=settings.slurmd_selector, watch_seconds=settings.watch_seconds
        )
        self._spares = SpareWatch(
            api,
            self._pods,
            slurm,
            node_selector=settings.node_selector,
            gpu_resource=settings.gpu_resource,
            watch_seconds=settings.watch_seconds,
        )
        self._provider = provider or build_provider(settings, api, self._fencing)

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
    async def fence_k8s_node(self, req: K8sNodeRequest) -> K8sFenceResult:
        """Cordon, taint and mark the Node; its state before is kept on it for unfence."""
        with final_answers():
            return await self._fencing.fence(req.node, req.ctx)

    @activity.defn
    async def unfence_k8s_node(self, req: K8sNodeRequest) -> K8sUnfenceResult:
        """Undo this incident's fence, restoring what the Node had before it and nothing else."""
        with final_answers():
            return await self._fencing.unfence(req.node, req.ctx)

    @activity.defn
    async def locate_slurmd_pod(self, req: SlurmdPodRequest) -> SlurmdPod:
        """The slurmd pod that is this Slurm node, and the Node under it."""
        with final_answers():
            return await self._pods.locate(req.slurm_node)

    @activity.defn
    async def evict_slurmd_pod(self, req: EvictRequest) -> EvictResult:
        """Evict the pod only while Slurm shows its node drained with no job on it (read again
        right before every attempt); wait, with deadlines, through PDB refusals and termination."""

        async def slurm_lets_go() -> str:
            try:
                return await confirm_evictable(self._slurm, req.pod.slurm_node)
            except (JobsStillRunning, NodeNotDrained, NodeStillBusy) as e:
                if req.ctx.dry_run:  # the drain before it was only described: say what would stop it now
                    return f"would be refused now: {e}"
                raise

        with final_answers():
            return await self._pods.evict(
                req.pod,
                req.ctx,
                confirm=slurm_lets_go,
                eviction_deadline=self._settings.eviction_deadline_seconds,
                termination_deadline=self._settings.termination_deadline_seconds,
                first_backoff=self._settings.eviction_backoff_seconds,
                progress=_heartbeat,
            )

    @activity.defn
    async def request_k8s_replacement(self, req: K8sReplacementRequest) -> K8sReplacementResult:
        with final_answers():
            return await self._provider.request(req, _heartbeat)

    @activity.defn
    async def wait_for_k8s_node(self, req: K8sSpareWaitRequest) -> K8sSpareResult:
        """A replacement in service: Node Ready, untainted, GPUs allocatable; its slurmd pod Ready
        and its Slurm node idle. At the deadline: healthy=False, saying what was missing."""
        with final_answers():
            return await self._spares.wait(req, _heartbeat)
