"""The node's fence and replacement in Slurm on Kubernetes (Slinky): find the slurmd pod that is
the Slurm node, cordon, taint and mark the Node under it, evict the pod once Slurm has let go of
the node, and ask the configured provider (NodeSet, node lifecycle or HTTP) for a new one."""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.kubernetes import KubernetesActivities
    from activities.platform import PlatformActivities
    from contracts.kubernetes import (
        EvictRequest,
        K8sNodeRequest,
        K8sReplacementRequest,
        K8sSpareWaitRequest,
        SlurmdPodRequest,
    )
    from contracts.models import ActionContext, ActionRecord, RecoveryPolicy, SlurmdPod, SpareResult
    from workflows.call_options import K8S_CALL, K8S_EVICTION, K8S_HEARTBEAT, K8S_REPLACEMENT, K8S_RETRY, SLURM_RETRY
    from workflows.incident.steps import Steps
    from workflows.incident.timeline import last_action_at


class KubernetesNode:
    """Slurm on Kubernetes as the incident's NodePlatform (workflows/incident/platform.py). Its
    fence finds the slurmd pod and when the fence began; the eviction and the replacement use them."""

    spares_on_standby = False

    def __init__(self, steps: Steps, actions: list[ActionRecord]) -> None:
        self._steps = steps
        self._actions = actions
        self._pod: SlurmdPod | None = None
        self._fenced_at: datetime | None = None

    @property
    def unfence_node(self) -> str | None:
        return self._pod.node if self._pod is not None else None

    async def fence(self, node: str, ctx: ActionContext) -> None:
        self._pod, self._fenced_at = await self._fence(node, ctx)

    async def release(self, ctx: ActionContext) -> None:
        assert self._pod is not None, "fence first"
        await self._evict(self._pod, ctx)

    async def replace(
        self, node: str, ctx: ActionContext, policy: RecoveryPolicy
    ) -> tuple[str | None, SpareResult | None]:
        assert self._pod is not None and self._fenced_at is not None, "fence first"
        return await self._replace(self._pod, self._fenced_at, ctx, policy)

    async def _fence(self, node: str, ctx: ActionContext) -> tuple[SlurmdPod, datetime]:
        """Find the slurmd pod that is this Slurm node, then cordon, taint and mark the Node under
        it. Returns the pod and when the fence began (replacements are newer)."""
        pod = await self._steps.run(
            "locate_slurmd_pod",
            workflow.execute_activity_method(
                KubernetesActivities.locate_slurmd_pod,
                SlurmdPodRequest(slurm_node=node),
                summary=f"Find the slurmd pod of {node} and its Kubernetes Node",
                **K8S_CALL,
            ),
        )
        self._steps.note(f"{pod.namespace}/{pod.name} on Node {pod.node or '(unscheduled)'}")
        if pod.node is None:
            self._steps.skip("fence_k8s_node", "the slurmd pod is not on any Node")
            return pod, workflow.now()
        fence = await self._steps.run(
            "fence_k8s_node",
            workflow.execute_activity_method(
                KubernetesActivities.fence_k8s_node,
                K8sNodeRequest(node=pod.node, ctx=ctx),
                summary=f"Cordon and taint Node {pod.node}, set its condition",
                **K8S_CALL,
            ),
            done_at=lambda fenced: last_action_at(fenced.actions),
        )
        self._actions.extend(fence.actions)
        self._steps.note("; ".join(a.detail for a in fence.actions) or "already fenced by this incident")
        return pod, fence.prior.fenced_at if fence.prior else workflow.now()

    async def _evict(self, pod: SlurmdPod, ctx: ActionContext) -> None:
        """Only now that Slurm shows the node drained and its jobs requeued (the activity reads
        Slurm again before evicting and refuses otherwise; unreadable Slurm fails closed)."""
        evicted = await self._steps.run(
            "evict_slurmd_pod",
            workflow.execute_activity_method(
                KubernetesActivities.evict_slurmd_pod,
                EvictRequest(pod=pod, ctx=ctx),
                summary=f"Evict slurmd pod {pod.namespace}/{pod.name} from Node {pod.node}",
                **K8S_EVICTION,
            ),
        )
        self._actions.extend(evicted.actions)
        self._steps.note(evicted.detail)

    async def _replace(
        self, pod: SlurmdPod, since: datetime, ctx: ActionContext, policy: RecoveryPolicy
    ) -> tuple[str | None, SpareResult | None]:
        """Ask the provider for capacity, then wait for a new slurmd pod on a healthy Node,
        registered and idle in Slurm. Returns why there is no replacement (or None), and the spare."""
        replacement = await self._steps.run(
            "request_replacement",
            workflow.execute_activity_method(
                KubernetesActivities.request_k8s_replacement,
                K8sReplacementRequest(failed_node=pod.node or "", slurm_node=pod.slurm_node, ctx=ctx),
                summary=f"Request replacement capacity for Node {pod.node}",
                **K8S_REPLACEMENT,
            ),
            done_at=lambda replaced: last_action_at(replaced.actions),
        )
        self._actions.extend(replacement.actions)
        self._steps.note(f"{replacement.provider}: {replacement.detail}")
        if not replacement.accepted:
            return replacement.detail, None
        if policy.dry_run:
            self._steps.skip("wait_for_spare", "dry-run: no replacement was requested")
            return None, None
        found = await self._steps.run(
            "wait_for_spare",
            workflow.execute_activity_method(
                KubernetesActivities.wait_for_k8s_node,
                K8sSpareWaitRequest(
                    failed_node=pod.node or "",
                    since=since,
                    node=replacement.node,
                    deadline_seconds=policy.spare_wait_seconds,
                ),
                summary="Wait for a new slurmd pod on a healthy Node, idle in Slurm",
                start_to_close_timeout=timedelta(seconds=policy.spare_wait_seconds + 60),
                heartbeat_timeout=K8S_HEARTBEAT,
                retry_policy=K8S_RETRY,
            ),
            done_at=lambda waited: waited.in_service_at,
        )
        self._steps.note(f"{found.slurm_node or '-'} on Node {found.node or '-'}: {found.detail}")
        spare = SpareResult(
            node=found.slurm_node or pod.slurm_node,
            healthy=found.healthy,
            in_service_at=found.in_service_at,
            detail=f"Node {found.node}: {found.detail}",
        )
        if found.healthy:
            # Ready, GPUs allocatable and idle in Slurm; the operator's health check has the last word.
            health = await self._steps.run(
                "check_spare_health",
                workflow.execute_activity_method(
                    PlatformActivities.check_node_health,
                    spare.node,
                    summary=f"Run the health check hook on {spare.node}",
                    start_to_close_timeout=timedelta(seconds=120),
                    retry_policy=SLURM_RETRY,
                ),
            )
            self._steps.note(health.detail)
            spare.healthy, spare.detail = health.healthy, f"{spare.detail}; {health.detail}"
        return None, spare
