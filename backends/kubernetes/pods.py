"""The slurmd pods: which one is a Slurm node, evicting it (PodDisruptionBudgets honoured), and
waiting until it has terminated.

A slurmd pod's hostname is the Slurm node name slurmd registers (Slinky sets it: the pod name in
the NodeSet's StatefulSet mode, the Node's name in its DaemonSet mode).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes.client import (
    ApiClient,
    CoreV1Api,
    V1DeleteOptions,
    V1Eviction,
    V1ObjectMeta,
    V1Pod,
    V1Preconditions,
)
from kubernetes.client.exceptions import ApiException

from backends.kubernetes import calls
from backends.kubernetes.api import Progress, call, meta, pod_spec, watch_until
from backends.kubernetes.errors import EvictionBlocked, SlurmdPodNotFound
from contracts.audit import record
from contracts.kubernetes import EvictResult
from contracts.models import ActionContext, ActionRecord, SlurmdPod

MAX_BACKOFF_SECONDS = 30.0


def slurmd_pod(pod: V1Pod) -> SlurmdPod:
    conditions = (pod.status.conditions if pod.status else None) or []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    metadata, spec = meta(pod), pod_spec(pod)
    return SlurmdPod(
        namespace=metadata.namespace,
        name=metadata.name,
        uid=metadata.uid,
        node=spec.node_name or None,
        slurm_node=spec.hostname or metadata.name,
        created_at=metadata.creation_timestamp,
        ready=ready,
        terminating=metadata.deletion_timestamp is not None,
    )


class SlurmdPods:
    def __init__(self, api: ApiClient, *, namespace: str, selector: str, watch_seconds: int):
        self._core = CoreV1Api(api)
        self._namespace, self._selector, self._watch_seconds = namespace, selector, watch_seconds

    async def list(self, **selectors: str) -> list[SlurmdPod]:
        listed = await call(self._core.list_namespaced_pod, self._namespace, label_selector=self._selector, **selectors)
        return [slurmd_pod(p) for p in listed.items]

    async def locate(self, slurm_node: str) -> SlurmdPod:
        """The pod that is the Slurm node: the live one, or the one going away when there is no
        other (a pod being replaced under the same hostname has both, briefly)."""
        pods = sorted((p for p in await self.list() if p.slurm_node == slurm_node), key=lambda p: p.terminating)
        if not pods:
            raise SlurmdPodNotFound(
                f"no pod in {self._namespace} matching {self._selector!r} has hostname {slurm_node}"
            )
        return pods[0]

    async def on_nodes(self) -> dict[str, builtins.list[SlurmdPod]]:  # list: the method above
        """Every slurmd pod by the Node it is bound to."""
        by_node: dict[str, list[SlurmdPod]] = {}
        for pod in await self.list():
            if pod.node:
                by_node.setdefault(pod.node, []).append(pod)
        return by_node

    async def _current(self, pod: SlurmdPod) -> SlurmdPod | None:
        """The pod as it is now, or None once it is gone (a successor under its name is not it)."""
        found = [p for p in await self.list(field_selector=f"metadata.name={pod.name}") if p.uid == pod.uid]
        return found[0] if found else None

    async def evict(
        self,
        pod: SlurmdPod,
        ctx: ActionContext,
        *,
        confirm: Callable[[], Awaitable[str]],
        eviction_deadline: float,
        termination_deadline: float,
        first_backoff: float,
        progress: Progress,
    ) -> EvictResult:
        """Evict `pod` (by uid) through the Eviction API, after `confirm` says it may go (it raises
        if not, and is asked again before every attempt); a 429 from a PodDisruptionBudget is
        retried with doubling waits until `eviction_deadline` seconds, then EvictionBlocked. Then
        waits up to `termination_deadline` seconds for the pod to be gone."""
        current = await self._current(pod)
        state = "not read: the pod was already gone" if current is None else ""
        actions: list[ActionRecord] = []
        refusals = 0
        if current is not None and not current.terminating:
            state, refusals, action = await self._evict_through_pdb(
                pod, ctx, confirm, time.monotonic() + eviction_deadline, first_backoff, progress
            )
            actions.append(action)
            if ctx.dry_run:
                return EvictResult(
                    pod=pod,
                    evicted=False,
                    terminated=False,
                    pdb_refusals=0,
                    slurm_state=state,
                    detail=action.detail,
                    actions=actions,
                )
        else:
            actions.append(
                record(
                    "evict_slurmd_pod",
                    f"pod {pod.namespace}/{pod.name}",
                    "none",
                    ctx,
                    "already gone" if current is None else "already terminating",
                )
            )
        terminated = await self.wait_gone(pod, termination_deadline, progress)
        detail = "; ".join(
            [a.detail for a in actions]
            + ["terminated" if terminated else f"still Terminating after {termination_deadline:.0f} s"]
        )
        return EvictResult(
            pod=pod,
            evicted=True,
            terminated=terminated,
            pdb_refusals=refusals,
            slurm_state=state,
            detail=detail,
            actions=actions,
        )

    async def _evict_through_pdb(
        self,
        pod: SlurmdPod,
        ctx: ActionContext,
        confirm: Callable[[], Awaitable[str]],
        deadline: float,
        backoff: float,
        progress: Progress,
    ) -> tuple[str, int, ActionRecord]:
        target = f"pod {pod.namespace}/{pod.name}"
        # The uid precondition: a pod recreated under the same name is never the one evicted.
        eviction = V1Eviction(
            metadata=V1ObjectMeta(name=pod.name, namespace=pod.namespace),
            delete_options=V1DeleteOptions(preconditions=V1Preconditions(uid=pod.uid)),
        )
        invocation = calls.EVICT_POD.invocation(
            dry_run=ctx.dry_run, body={"preconditions.uid": pod.uid}, namespace=pod.namespace, name=pod.name
        )
        refusals = 0
        while True:
            state = await confirm()
            if ctx.dry_run:
                return state, 0, record("evict_slurmd_pod", target, invocation, ctx, f"Slurm: {state}")
            try:
                await call(self._core.create_namespaced_pod_eviction, pod.name, pod.namespace, eviction)
            except ApiException as e:
                if e.status == 404 or (e.status == 409 and await self._current(pod) is None):
                    # gone, or the name is another pod's now
                    return (
                        state,
                        refusals,
                        record("evict_slurmd_pod", target, "none", ctx, f"already gone ({e.status}); Slurm: {state}"),
                    )
                if e.status not in (409, 429):  # 409 with the pod still there: a conflict (say on
                    raise  # its PodDisruptionBudget's status), so not evicted yet: try again
                refusals += 1
                if time.monotonic() + backoff > deadline:
                    raise EvictionBlocked(
                        f"{target}: eviction refused {refusals} times until the deadline: {_message(e)}"
                    ) from e
                await self._pause(
                    backoff, progress, f"{target}: eviction refused ({_message(e)}), again in {backoff:.1f} s"
                )
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                continue
            after = f" after {refusals} refusal(s) by a PodDisruptionBudget" if refusals else ""
            return (
                state,
                refusals,
                record("evict_slurmd_pod", target, invocation, ctx, f"evicted{after}; Slurm: {state}"),
            )

    async def _pause(self, seconds: float, progress: Progress, detail: str) -> None:
        """Sleep, reporting progress at least every watch window (the cadence heartbeats keep)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            progress(detail)
            await asyncio.sleep(min(left, self._watch_seconds))

    async def wait_gone(self, pod: SlurmdPod, deadline_seconds: float, progress: Progress) -> bool:
        async def gone(pods: dict[str, Any]) -> tuple[bool | None, str]:
            same = pods.get(pod.name)
            if same is None or same.metadata.uid != pod.uid:
                return True, f"pod {pod.name} gone"
            return None, f"pod {pod.name} still Terminating"

        found, _ = await watch_until(
            self._core.list_namespaced_pod,
            gone,
            deadline=time.monotonic() + deadline_seconds,
            watch_seconds=self._watch_seconds,
            progress=progress,
            namespace=self._namespace,
            field_selector=f"metadata.name={pod.name}",
        )
        return bool(found)


def _message(error: ApiException) -> str:
    """The Status message the server gave (a PDB names itself there), else the HTTP reason."""
    try:
        return str(json.loads(error.body or "")["message"])[:300]
    except (TypeError, ValueError, KeyError):
        return str(error.reason or error.status)
