"""Fencing a Kubernetes Node (cordon, taint, condition) and undoing exactly that; Node health.

The fence is one optimistic update of the Node (cordon, the taint in the whole taint list, and an
annotation holding what was there before) plus a condition through the status subresource. The
annotation makes every step idempotent: a retried fence finds its own prior state instead of
recording its own fence as the state before it, and unfence restores that prior state, keeping
whatever anyone else changed on the Node meanwhile (another owner's taint stays).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes.client import ApiClient, CoreV1Api, V1Node, V1NodeCondition, V1Taint
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from backends.kubernetes import calls
from backends.kubernetes.api import call, meta, node_spec, node_status, update_optimistically
from backends.kubernetes.errors import NodeNotFound
from contracts.audit import record
from contracts.kubernetes import (
    FencePriorState,
    K8sFenceResult,
    K8sUnfenceResult,
    NodeCondition,
    Taint,
    TaintEffect,
)
from contracts.models import ActionContext, ActionRecord, utc_now

FENCE_ANNOTATION = "recovery.gpu/fence"
# Slinky's slurm-operator drains the Slurm nodes of a cordoned Node with this annotation as the
# reason (prefixed "slurm-operator:"): the fence sets it, so that such a drain says why.
CORDON_REASON_ANNOTATION = "nodeset.slinky.slurm.net/node-cordon-reason"
UNSCHEDULABLE_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


def node_unhealthy_because(node: V1Node, gpu_resource: str) -> str | None:
    """Why the Node cannot take work, or None: Ready, schedulable, no NoSchedule/NoExecute
    taint (not even one a provider leaves on purpose: a spare must accept pods now), GPUs allocatable."""
    name = meta(node).name
    ready = next((c for c in node.status.conditions or [] if c.type == "Ready"), None) if node.status else None
    if ready is None or ready.status != "True":
        return f"{name}: not Ready"
    if node.spec and node.spec.unschedulable:
        return f"{name}: cordoned"
    blocking = [t for t in (node.spec.taints or []) if t.effect in UNSCHEDULABLE_EFFECTS] if node.spec else []
    if blocking:
        return f"{name}: tainted {', '.join(_taint_text(t) for t in blocking)}"
    gpus = (node_status(node).allocatable or {}).get(gpu_resource, "0")
    if parse_quantity(gpus) <= 0:
        return f"{name}: no {gpu_resource} allocatable"
    return None


def _taint_text(t: V1Taint | Taint) -> str:
    return f"{t.key}={t.value or ''}:{t.effect}"


class NodeFencing:
    def __init__(self, api: ApiClient, *, taint_key: str, taint_effect: TaintEffect, condition_type: str):
        self._core = CoreV1Api(api)
        self._taint_key, self._taint_effect, self._condition_type = taint_key, taint_effect, condition_type

    # --- reading ---

    async def read(self, name: str) -> V1Node:
        try:
            return await call(self._core.read_node, name)
        except ApiException as e:
            if e.status == 404:
                raise NodeNotFound(f"Kubernetes Node {name} does not exist") from e
            raise

    @staticmethod
    def prior_state(node: V1Node) -> FencePriorState | None:
        text = (meta(node).annotations or {}).get(FENCE_ANNOTATION)
        return FencePriorState.model_validate_json(text) if text else None

    def _is_fence_taint(self, t: V1Taint) -> bool:
        # A Node has at most one taint per (key, effect): that pair is the fence's.
        return t.key == self._taint_key and t.effect == self._taint_effect

    def _condition(self, node: V1Node) -> V1NodeCondition | None:
        return next((c for c in (node_status(node).conditions or []) if c.type == self._condition_type), None)

    # --- fence ---

    async def fence(self, name: str, ctx: ActionContext) -> K8sFenceResult:
        node = await self.read(name)
        found = self.prior_state(node)
        if found is not None and found.incident_id != ctx.incident_id:
            action = record(
                "fence_k8s_node", name, "none", ctx, f"left as found: fenced by incident {found.incident_id}"
            )
            return K8sFenceResult(
                node=name,
                prior=None,
                changed=False,
                cordoned_by_other=True,
                fenced_by_other_incident=found.incident_id,
                actions=[action],
            )
        spec_action, prior = await self._fence_spec(name, ctx)
        condition = NodeCondition(
            type=self._condition_type, status="True", reason=f"XID{ctx.xid}", message=ctx.slurm_reason()
        )
        actions = [spec_action, await self._update_condition(name, ctx, "set_k8s_node_condition", condition)]
        return K8sFenceResult(
            node=name,
            prior=prior,
            changed=any(_wrote(a) for a in actions),
            cordoned_by_other=prior.unschedulable,
            actions=actions,
        )

    def _prior_of(self, node: V1Node, ctx: ActionContext) -> FencePriorState:
        fence_taint = next((t for t in node_spec(node).taints or [] if self._is_fence_taint(t)), None)
        condition = self._condition(node)
        return FencePriorState(
            incident_id=ctx.incident_id,
            owner=ctx.owner,
            fenced_at=utc_now(),
            unschedulable=bool(node_spec(node).unschedulable),
            taint=Taint(key=fence_taint.key, value=fence_taint.value or "", effect=fence_taint.effect)
            if fence_taint
            else None,
            condition=NodeCondition(
                type=condition.type,
                status=condition.status,
                reason=condition.reason or "",
                message=condition.message or "",
                last_transition_time=condition.last_transition_time,
            )
            if condition
            else None,
            cordon_reason=(meta(node).annotations or {}).get(CORDON_REASON_ANNOTATION),
        )

    async def _fence_spec(self, name: str, ctx: ActionContext) -> tuple[ActionRecord, FencePriorState]:
        taint = V1Taint(key=self._taint_key, value=f"xid-{ctx.xid}", effect=self._taint_effect)
        kept: list[FencePriorState] = []

        def fenced(node: V1Node) -> dict[str, Any] | None:
            # Recorded once, by the first write: a retry finds it on the Node.
            prior = self.prior_state(node) or self._prior_of(node, ctx)
            kept[:] = [prior]
            others = [t for t in node_spec(node).taints or [] if not self._is_fence_taint(t)]
            annotations: dict[str, str | None] = {
                FENCE_ANNOTATION: prior.model_dump_json(),
                CORDON_REASON_ANNOTATION: ctx.slurm_reason(),
            }
            return self._changes(
                node,
                unschedulable=True if not prior.unschedulable else None,
                taints=[*others, taint],
                annotations=annotations,
            )

        detail = f"cordon, taint {_taint_text(taint)}, prior state kept in {FENCE_ANNOTATION}"
        action = await self._update(name, ctx, "fence_k8s_node", fenced, detail)
        return action, kept[0]

    # --- unfence ---

    async def unfence(self, name: str, ctx: ActionContext) -> K8sUnfenceResult:
        try:
            node = await self.read(name)
        except NodeNotFound:
            action = record("unfence_k8s_node", name, "none", ctx, "the Node no longer exists: nothing to undo")
            return K8sUnfenceResult(node=name, changed=False, restored=None, detail=action.detail, actions=[action])
        prior = self.prior_state(node)
        if prior is None or prior.incident_id != ctx.incident_id:
            why = (
                "no fence of this incident on the Node" if prior is None else f"fenced by incident {prior.incident_id}"
            )
            action = record("unfence_k8s_node", name, "none", ctx, f"left as found: {why}")
            return K8sUnfenceResult(node=name, changed=False, restored=None, detail=action.detail, actions=[action])
        # The condition first: until the annotation goes, a retry still knows the prior condition.
        actions = [
            await self._update_condition(name, ctx, "restore_k8s_node_condition", prior.condition),
            await self._unfence_spec(name, ctx, prior),
        ]
        return K8sUnfenceResult(
            node=name,
            changed=any(_wrote(a) for a in actions),
            restored=prior,
            detail="; ".join(a.detail for a in actions),
            actions=actions,
        )

    async def _unfence_spec(self, name: str, ctx: ActionContext, prior: FencePriorState) -> ActionRecord:
        def restored(node: V1Node) -> dict[str, Any] | None:
            others = [t for t in node_spec(node).taints or [] if not self._is_fence_taint(t)]
            if prior.taint is not None:
                others.append(V1Taint(key=prior.taint.key, value=prior.taint.value or None, effect=prior.taint.effect))
            return self._changes(
                node,
                unschedulable=False if not prior.unschedulable else None,
                taints=others,
                annotations={FENCE_ANNOTATION: None, CORDON_REASON_ANNOTATION: prior.cordon_reason},
            )

        detail = ("uncordon, " if not prior.unschedulable else "left cordoned (cordoned before the fence), ") + (
            f"taint back to {_taint_text(prior.taint)}" if prior.taint else f"taint {self._taint_key} removed"
        )
        return await self._update(name, ctx, "unfence_k8s_node", restored, detail)

    # --- writes ---

    @staticmethod
    def _changes(
        node: V1Node, *, unschedulable: bool | None, taints: list[V1Taint], annotations: dict[str, str | None]
    ) -> dict[str, Any] | None:
        """Apply to `node` what differs; return that difference (what the PUT changes, for the
        audit record), or None when the Node already is so. A None annotation means absent;
        `unschedulable` None means leave it."""
        diff: dict[str, Any] = {}
        spec, metadata = node_spec(node), meta(node)
        if unschedulable is not None and bool(spec.unschedulable) != unschedulable:
            spec.unschedulable = unschedulable or None
            diff["spec.unschedulable"] = unschedulable
        current = [(t.key, t.value or "", t.effect) for t in spec.taints or []]
        if sorted(current) != sorted((t.key, t.value or "", t.effect) for t in taints):
            spec.taints = taints or None
            diff["spec.taints"] = [_taint_text(t) for t in taints]
        have = dict(metadata.annotations or {})
        for key, value in annotations.items():
            if have.get(key) != value:
                if value is None:
                    del have[key]
                else:
                    have[key] = value
                diff[f"metadata.annotations[{key}]"] = value
        metadata.annotations = have or None
        return diff or None

    async def _update(
        self, name: str, ctx: ActionContext, action: str, change: Callable[[V1Node], dict[str, Any] | None], detail: str
    ) -> ActionRecord:
        async def write(node: V1Node) -> ActionRecord:
            diff = change(node)
            if diff is None:
                return record(action, name, "none", ctx, "already so")
            invocation = calls.UPDATE_NODE.invocation(dry_run=ctx.dry_run, body=diff, name=name)
            if not ctx.dry_run:
                # The object carries the resourceVersion it was read at: the server refuses (409)
                # a write over a change it did not see.
                await call(self._core.replace_node, name, node)
            return record(action, name, invocation, ctx, detail)

        return await update_optimistically(lambda: self.read(name), write, f"Node {name}")

    async def _update_condition(
        self, name: str, ctx: ActionContext, action: str, want: NodeCondition | None
    ) -> ActionRecord:
        """Make the fence's condition type what `want` says (None: absent), through /status. A
        condition whose status does not change keeps its lastTransitionTime."""

        async def write(node: V1Node) -> ActionRecord:
            current = self._condition(node)
            if (current is None and want is None) or (
                current is not None
                and want is not None
                and (current.status, current.reason or "", current.message or "")
                == (want.status, want.reason, want.message)
            ):
                return record(action, name, "none", ctx, f"condition {self._condition_type} already so")
            status = node_status(node)
            others = [c for c in status.conditions or [] if c.type != self._condition_type]
            if want is None:
                status.conditions = others
                body: Any = {"status.conditions": f"remove {self._condition_type}"}
                detail = f"condition {self._condition_type} removed"
            else:
                now = utc_now()
                transition = (
                    current.last_transition_time
                    if current is not None and current.status == want.status
                    else want.last_transition_time or now
                )
                condition = V1NodeCondition(
                    type=want.type,
                    status=want.status,
                    reason=want.reason,
                    message=want.message,
                    last_heartbeat_time=now,
                    last_transition_time=transition,
                )
                status.conditions = [*others, condition]
                body = {"status.conditions[]": self._core.api_client.sanitize_for_serialization(condition)}
                detail = f"condition {want.type}={want.status} ({want.reason})"
            invocation = calls.UPDATE_NODE_STATUS.invocation(dry_run=ctx.dry_run, body=body, name=name)
            if not ctx.dry_run:
                await call(self._core.replace_node_status, name, node)
            return record(action, name, invocation, ctx, detail)

        return await update_optimistically(lambda: self.read(name), write, f"Node {name} status")


def _wrote(action: ActionRecord) -> bool:
    return action.executed and action.path == calls.PATH
