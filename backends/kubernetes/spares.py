"""Waiting for the replacement: a slurmd pod that came up after the failure on a healthy Node,
whose Slurm node is registered and idle.

"After the failure" makes it the replacement whatever provider brought it: the NodeSet recreating
the evicted pod on a free Node, a scaled-up NodeSet, or a new Node from the node lifecycle. When a
provider names the Node, only that Node counts (its slurmd pod's age does not matter then).
"""

from __future__ import annotations

import time
from typing import Any

from kubernetes.client import ApiClient, CoreV1Api

from backends.kubernetes.api import Progress, watch_until
from backends.kubernetes.nodes import node_unhealthy_because
from backends.kubernetes.pods import SlurmdPods
from backends.kubernetes.slurm_view import SlurmNodeView, idle_because
from contracts.kubernetes import K8sSpareResult, K8sSpareWaitRequest
from contracts.models import utc_now


class SpareWatch:
    def __init__(
        self,
        api: ApiClient,
        pods: SlurmdPods,
        slurm: SlurmNodeView,
        *,
        node_selector: str,
        gpu_resource: str,
        watch_seconds: int,
    ):
        self._core = CoreV1Api(api)
        self._pods, self._slurm = pods, slurm
        self._node_selector, self._gpu_resource, self._watch_seconds = node_selector, gpu_resource, watch_seconds

    async def wait(self, req: K8sSpareWaitRequest, progress: Progress) -> K8sSpareResult:
        # creationTimestamp has whole seconds: a pod created in the second of `since` is new.
        since = req.since.replace(microsecond=0)

        async def in_service(nodes: dict[str, Any]) -> tuple[K8sSpareResult | None, str]:
            why_not: list[str] = []
            for node_name, pods in sorted((await self._pods.on_nodes()).items()):
                if node_name == req.failed_node or (req.node is not None and node_name != req.node):
                    continue
                fresh = [p for p in pods if not p.terminating and (req.node is not None or p.created_at >= since)]
                if not fresh:
                    continue
                node = nodes.get(node_name)
                unhealthy = (
                    f"{node_name}: not listed" if node is None else node_unhealthy_because(node, self._gpu_resource)
                )
                if unhealthy:
                    why_not.append(unhealthy)
                    continue
                for pod in fresh:
                    if not pod.ready:
                        why_not.append(f"{node_name}: slurmd pod {pod.name} not Ready")
                    elif (busy := await idle_because(self._slurm, pod.slurm_node)) is not None:
                        why_not.append(busy)
                    else:
                        return K8sSpareResult(
                            node=node_name,
                            slurm_node=pod.slurm_node,
                            healthy=True,
                            in_service_at=utc_now(),
                            detail=f"{node_name}: Ready, untainted, {self._gpu_resource} allocatable; "
                            f"slurmd pod {pod.name} is Slurm node {pod.slurm_node}, idle",
                        ), ""
            return None, "; ".join(why_not) or _nothing_yet(req)

        selector = {"label_selector": self._node_selector} if self._node_selector else {}
        found, detail = await watch_until(
            self._core.list_node,
            in_service,
            deadline=time.monotonic() + req.deadline_seconds,
            watch_seconds=self._watch_seconds,
            progress=progress,
            **selector,
        )
        return found or K8sSpareResult(
            node=req.node,
            slurm_node=None,
            healthy=False,
            detail=f"no healthy replacement within {req.deadline_seconds:.0f} s: {detail}",
        )


def _nothing_yet(req: K8sSpareWaitRequest) -> str:
    if req.node is not None:
        return f"no slurmd pod on {req.node} yet"
    return f"no slurmd pod created since {req.since.isoformat(timespec='seconds')} outside {req.failed_node} yet"
