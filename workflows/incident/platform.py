"""Where the failed node lives, as the incident's story sees it: the platform seam the worker was
bound to (backends/platform.py, run by activities/platform.py), through the handle its fence
returns. The story fences, frees and replaces the node without asking which platform; hot spares
on standby are claimed through their SpareClaimWorkflows (hot_spares.py).

Runs begun before the `one-platform-seam` patch replay the two paths they took: hot_spares.py for
bare Slurm, kubernetes.py for Slurm on Kubernetes, both NodePlatforms as this one is."""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.platform import PlatformActivities
    from contracts.models import (
        ActionContext,
        ActionRecord,
        FenceHandle,
        FenceRequest,
        RecoveryPolicy,
        ReleaseRequest,
        ReplacementRequest,
        ReplacementResult,
        SpareResult,
        SpareWaitRequest,
    )
    from workflows.call_options import K8S_EVICTION, K8S_HEARTBEAT, K8S_REPLACEMENT, K8S_RETRY
    from workflows.incident.hot_spares import HotSpares
    from workflows.incident.slurm_calls import fence_call
    from workflows.incident.steps import Steps
    from workflows.incident.timeline import last_action_at

# New runs take the platform seam; runs begun before it replay HotSpares or KubernetesNode.
ONE_PLATFORM_SEAM = "one-platform-seam"
# The platform's calls are timed for its slowest platform's: Kubernetes' eviction, provider and watch.
# Besides the spare wait's deadline: the health check hook's own time-out, and margin.
SPARE_WAIT_MARGIN = timedelta(seconds=120)


class NodePlatform(Protocol):
    @property
    def spares_on_standby(self) -> bool:
        """Whether spares wait on standby (a hot-spare pool), which an idle node's incident leaves there."""
        ...

    async def fence(self, node: str, ctx: ActionContext) -> None:
        """After the Slurm drain: the platform's own fence of the node."""
        ...

    async def release(self, ctx: ActionContext) -> None:
        """Once Slurm has let go of the node (jobs requeued, node down): what the platform frees."""
        ...

    async def replace(
        self, node: str, ctx: ActionContext, policy: RecoveryPolicy
    ) -> tuple[str | None, SpareResult | None]:
        """Replacement capacity: why there is none (or None), and the spare."""
        ...

    @property
    def unfence_node(self) -> str | None:
        """What the return to service unfences besides Slurm (a Kubernetes Node), if anything."""
        ...


class BoundPlatform:
    """The NodePlatform of every run since `one-platform-seam`."""

    def __init__(self, steps: Steps, actions: list[ActionRecord], hot_spares: HotSpares) -> None:
        self._steps = steps
        self._actions = actions
        self._hot_spares = hot_spares
        self._handle: FenceHandle | None = None

    @property
    def spares_on_standby(self) -> bool:
        return self._fenced.spares_on_standby

    @property
    def unfence_node(self) -> str | None:
        return self._fenced.unfence_node

    async def fence(self, node: str, ctx: ActionContext) -> None:
        """In the drain's workflow task, as a local activity first (slurm_calls.py)."""
        fenced = await self._steps.run(
            "fence_node",
            fence_call(
                PlatformActivities.fence_node, FenceRequest(node=node, ctx=ctx), f"The platform's fence of {node}"
            ),
            index_now=False,
            done_at=lambda result: last_action_at(result.actions),
        )
        self._handle = fenced.handle
        self._actions.extend(fenced.actions)
        self._steps.note(fenced.detail)

    async def release(self, ctx: ActionContext) -> None:
        released = await self._steps.run(
            "release_node",
            workflow.execute_activity_method(
                PlatformActivities.release_node,
                ReleaseRequest(handle=self._fenced, ctx=ctx),
                summary=f"Free {self._fenced.slurm_node} on its platform now that Slurm has let go of it",
                **K8S_EVICTION,
            ),
            done_at=lambda result: last_action_at(result.actions),
        )
        self._actions.extend(released.actions)
        self._steps.note(released.detail)

    async def replace(
        self, node: str, ctx: ActionContext, policy: RecoveryPolicy
    ) -> tuple[str | None, SpareResult | None]:
        """Capacity claimed or requested, then waited for until healthy and in service. Returns
        why there is no replacement (or None), and the spare."""
        handle = self._fenced
        if handle.spares_on_standby:
            replacement = await self._hot_spares.claim(node, ctx, policy)
        else:
            replacement = await self._request(
                ReplacementRequest(failed_node=node, spare_nodes=[], ctx=ctx, handle=handle)
            )
        if not replacement.coming:
            return replacement.detail, None
        if policy.dry_run:
            self._steps.skip("wait_for_spare", "dry-run: no replacement was brought in")
            return None, None
        spare = await self._steps.run(
            "wait_for_spare",
            workflow.execute_activity_method(
                PlatformActivities.wait_for_spare,
                SpareWaitRequest(node=replacement.node, deadline_seconds=policy.spare_wait_seconds, handle=handle),
                summary=f"Wait for {replacement.node or 'the replacement'} to be healthy and in service",
                start_to_close_timeout=timedelta(seconds=policy.spare_wait_seconds) + SPARE_WAIT_MARGIN,
                heartbeat_timeout=K8S_HEARTBEAT,
                retry_policy=K8S_RETRY,
            ),
            done_at=lambda waited: waited.in_service_at,
        )
        self._steps.note(spare.detail)
        return None, spare

    async def _request(self, request: ReplacementRequest) -> ReplacementResult:
        replacement = await self._steps.run(
            "request_replacement",
            workflow.execute_activity_method(
                PlatformActivities.request_replacement,
                request,
                summary=f"Request replacement capacity for {request.failed_node}",
                **K8S_REPLACEMENT,
            ),
            done_at=lambda result: last_action_at(result.actions),
        )
        self._actions.extend(replacement.actions)
        self._steps.note(f"{replacement.provider}: {replacement.detail}")
        return replacement

    @property
    def _fenced(self) -> FenceHandle:
        assert self._handle is not None, "fence first"
        return self._handle
