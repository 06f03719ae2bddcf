"""Replacement capacity on Kubernetes, one provider per way a cluster gets it, chosen by
RECOVERY_K8S_REPLACEMENT. They play the role of backends/replacement.py's HotSparePool: asked once
per incident (and again on a retry, with one effect), they start the replacement; which Node then
serves is found by SpareWatch, unless the provider names it.

- NodeSetReplacement: Slinky's NodeSet brings a slurmd pod up on a healthy Node: in StatefulSet
  mode it recreates the evicted pod by itself (the same Slurm node, on another Node), or,
  configured to, gets one more replica through the /scale subresource. A DaemonSet-mode NodeSet
  has no replicas to ask for: only a new Node brings a pod, so this provider declines.
- NodeLifecycleReplacement: the failed Node is labelled for the cluster's node lifecycle (an
  autoscaler, Cluster API, a cloud's repair), and deleted when configured, so that a new one comes.
- HttpReplacement: a generic replacement API (docs/replacement-http-provider.md), for clouds.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal, Protocol, cast

import httpx
from kubernetes.client import (
    ApiClient,
    CoreV1Api,
    CustomObjectsApi,
    V1DeleteOptions,
    V1Node,
    V1Preconditions,
)
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from backends.kubernetes import calls
from backends.kubernetes.api import Progress, call, meta, uid_of, update_optimistically
from backends.kubernetes.errors import (
    NodeNotFound,
    NodeSetNotFound,
    ProviderUnavailable,
)
from backends.kubernetes.nodes import NodeFencing
from contracts.audit import record
from contracts.kubernetes import (
    NODESET_GROUP,
    NODESET_PLURAL,
    NODESET_VERSIONS,
    K8sReplacementRequest,
    K8sReplacementResult,
    NodeSetRef,
)
from contracts.models import ActionRecord, Invocation

# On the NodeSet: the replica count each incident scaled it to, so a retried request finds its
# own scale-up instead of adding a second replica. The newest incidents are kept.
SCALE_CLAIMS_ANNOTATION = "recovery.gpu/scale-ups"
SCALE_CLAIMS_KEPT = 16
REPLACE_REASON_ANNOTATION = "recovery.gpu/replace-reason"


class KubernetesReplacementProvider(Protocol):
    name: str

    async def request(self, req: K8sReplacementRequest, progress: Progress) -> K8sReplacementResult: ...


class NodeSetReplacement:
    name = "slinky-nodeset"

    def __init__(self, api: ApiClient, nodeset: NodeSetRef, *, scale_up: bool):
        self._objects = CustomObjectsApi(api)
        self._ref, self._scale_up = nodeset, scale_up
        self._target = f"NodeSet {nodeset.namespace}/{nodeset.name}"
        self.version: str | None = nodeset.version  # None until the first request discovers it

    async def _served_version(self) -> str:
        """The configured version, or the first of NODESET_VERSIONS the cluster serves NodeSets in
        (asked once, through discovery, which every authenticated client may read)."""
        if self.version is None:
            for version in NODESET_VERSIONS:
                try:
                    listing = await call(self._objects.get_api_resources, NODESET_GROUP, version)
                except ApiException as e:
                    if e.status == 404:
                        continue
                    raise
                if any(resource.name == NODESET_PLURAL for resource in listing.resources):
                    self.version = version
                    break
            else:
                raise NodeSetNotFound(
                    f"the cluster serves no NodeSets ({NODESET_GROUP} {' or '.join(NODESET_VERSIONS)}): "
                    "is Slinky's slurm-operator installed?"
                )
        return self.version

    async def _args(self) -> tuple[str, str, str, str, str]:
        return NODESET_GROUP, await self._served_version(), self._ref.namespace, NODESET_PLURAL, self._ref.name

    async def _names(self) -> dict[str, str]:
        return dict(version=await self._served_version(), namespace=self._ref.namespace, name=self._ref.name)

    async def _read(self) -> dict[str, Any]:
        args = await self._args()
        try:
            found = await call(self._objects.get_namespaced_custom_object, *args)
            return cast(dict[str, Any], found)  # a custom object comes as its JSON (the client says object)
        except ApiException as e:
            if e.status == 404:
                raise NodeSetNotFound(f"{self._target} ({NODESET_GROUP}/{args[1]}) does not exist") from e
            raise

    async def request(self, req: K8sReplacementRequest, progress: Progress) -> K8sReplacementResult:
        nodeset = await self._read()
        spec = nodeset.get("spec", {})
        if spec.get("scalingMode", "StatefulSet") == "DaemonSet":
            # One slurmd pod per matching Node, `replicas` ignored: the fenced Node gets none again,
            # and only a new Node brings one.
            action = record(
                "request_k8s_replacement",
                self._target,
                "none",
                req.ctx,
                "the NodeSet runs one slurmd pod per matching Node (scalingMode DaemonSet) and takes no "
                "replica count: capacity comes only with a new Node, which this provider cannot ask for "
                "(RECOVERY_K8S_REPLACEMENT=node-lifecycle or http can)",
            )
            return K8sReplacementResult(
                provider=self.name, accepted=False, node=None, detail=action.detail, actions=[action]
            )
        replicas = spec.get("replicas", 1)
        if not self._scale_up:
            action = record(
                "request_k8s_replacement",
                self._target,
                "none",
                req.ctx,
                f"the NodeSet recreates slurmd pod {req.slurm_node}, Slurm node and all, on another Node "
                f"that can take it ({replicas} replicas, scalingMode StatefulSet)",
            )
            return K8sReplacementResult(
                provider=self.name, accepted=True, node=None, detail=action.detail, actions=[action]
            )
        claim_action, target = await self._claim(req)
        scale_action = await self._scale_to(target, req)
        return K8sReplacementResult(
            provider=self.name,
            accepted=True,
            node=None,
            detail=f"{self._target} scaled to at least {target} replicas for {req.slurm_node}",
            actions=[claim_action, scale_action],
        )

    async def _claim(self, req: K8sReplacementRequest) -> tuple[ActionRecord, int]:
        """Write (once) the replica count this incident wants: one more than the NodeSet had."""
        incident = req.ctx.incident_id
        wanted: list[int] = []

        async def write(nodeset: dict[str, Any]) -> ActionRecord:
            metadata = nodeset.setdefault("metadata", {})
            annotations = dict(metadata.get("annotations") or {})
            claims: dict[str, int] = json.loads(annotations.get(SCALE_CLAIMS_ANNOTATION, "{}"))
            if incident in claims:
                wanted[:] = [claims[incident]]
                return record(
                    "claim_nodeset_scale_up",
                    self._target,
                    "none",
                    req.ctx,
                    f"this incident already asked for {claims[incident]} replicas",
                )
            target = nodeset.get("spec", {}).get("replicas", 1) + 1
            wanted[:] = [target]
            claims = dict(list(claims.items())[-(SCALE_CLAIMS_KEPT - 1) :]) | {incident: target}
            metadata["annotations"] = annotations | {SCALE_CLAIMS_ANNOTATION: json.dumps(claims)}
            invocation = calls.UPDATE_NODESET.invocation(
                dry_run=req.ctx.dry_run,
                body={f"metadata.annotations[{SCALE_CLAIMS_ANNOTATION}]": claims},
                **await self._names(),
            )
            if not req.ctx.dry_run:
                await call(self._objects.replace_namespaced_custom_object, *await self._args(), nodeset)
            return record(
                "claim_nodeset_scale_up", self._target, invocation, req.ctx, f"{incident} asks for {target} replicas"
            )

        action = await update_optimistically(self._read, write, self._target)
        return action, wanted[0]

    async def _scale_to(self, target: int, req: K8sReplacementRequest) -> ActionRecord:
        async def read_scale() -> dict[str, Any]:
            scale = await call(self._objects.get_namespaced_custom_object_scale, *await self._args())
            return cast(dict[str, Any], scale)  # as its JSON, as above

        async def write(scale: dict[str, Any]) -> ActionRecord:
            current = scale.get("spec", {}).get("replicas", 0)
            if current >= target:
                return record(
                    "scale_nodeset",
                    self._target,
                    "none",
                    req.ctx,
                    f"already {current} replicas (wanted at least {target})",
                )
            scale.setdefault("spec", {})["replicas"] = target
            invocation = calls.UPDATE_NODESET_SCALE.invocation(
                dry_run=req.ctx.dry_run, body={"spec.replicas": target}, **await self._names()
            )
            if not req.ctx.dry_run:
                # The Scale carries the NodeSet's resourceVersion: a concurrent change is a 409.
                await call(self._objects.replace_namespaced_custom_object_scale, *await self._args(), scale)
            return record("scale_nodeset", self._target, invocation, req.ctx, f"replicas {current} -> {target}")

        return await update_optimistically(read_scale, write, f"{self._target}/scale")


class NodeLifecycleReplacement:
    name = "node-lifecycle"

    def __init__(self, api: ApiClient, fencing: NodeFencing, *, label: str, delete_node: bool):
        self._core = CoreV1Api(api)
        self._fencing = fencing
        self._label_key, _, self._label_value = label.partition("=")
        self._delete = delete_node

    async def request(self, req: K8sReplacementRequest, progress: Progress) -> K8sReplacementResult:
        name, ctx = req.failed_node, req.ctx
        try:
            uid = uid_of(await self._fencing.read(name))
        except NodeNotFound:
            action = record("hand_node_to_lifecycle", name, "none", ctx, "the Node is already gone")
            return K8sReplacementResult(
                provider=self.name, accepted=True, node=None, detail=action.detail, actions=[action]
            )

        async def write(node: V1Node) -> ActionRecord:
            metadata = meta(node)
            labels, annotations = metadata.labels or {}, metadata.annotations or {}
            if labels.get(self._label_key) == self._label_value and REPLACE_REASON_ANNOTATION in annotations:
                return record("hand_node_to_lifecycle", name, "none", ctx, "already labelled")
            metadata.labels = labels | {self._label_key: self._label_value}
            metadata.annotations = annotations | {REPLACE_REASON_ANNOTATION: ctx.slurm_reason()}
            invocation = calls.UPDATE_NODE.invocation(
                dry_run=ctx.dry_run,
                name=name,
                body={
                    f"metadata.labels[{self._label_key}]": self._label_value,
                    f"metadata.annotations[{REPLACE_REASON_ANNOTATION}]": ctx.slurm_reason(),
                },
            )
            if not ctx.dry_run:
                await call(self._core.replace_node, name, node)
            return record(
                "hand_node_to_lifecycle",
                name,
                invocation,
                ctx,
                f"labelled {self._label_key}={self._label_value} for the node lifecycle",
            )

        actions = [await update_optimistically(lambda: self._fencing.read(name), write, f"Node {name}")]
        if self._delete:
            actions.append(await self._delete_node(name, uid, req))
        return K8sReplacementResult(
            provider=self.name, accepted=True, node=None, detail="; ".join(a.detail for a in actions), actions=actions
        )

    async def _delete_node(self, name: str, uid: str, req: K8sReplacementRequest) -> ActionRecord:
        # The uid precondition: a new Node that took the name is never the one deleted.
        invocation = calls.DELETE_NODE.invocation(dry_run=req.ctx.dry_run, body={"preconditions.uid": uid}, name=name)
        if not req.ctx.dry_run:
            try:
                await call(self._core.delete_node, name, body=V1DeleteOptions(preconditions=V1Preconditions(uid=uid)))
            except ApiException as e:
                if e.status not in (404, 409):
                    raise
                return record("delete_node", name, "none", req.ctx, f"already gone ({e.status})")
        return record("delete_node", name, invocation, req.ctx, "Node object deleted for the node lifecycle")


class ReplacementOrder(BaseModel):
    """A replacement as the API reports it (fields it adds later are ignored)."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1)
    state: Literal["pending", "provisioning", "ready", "failed"]
    node: str | None = None
    message: str = ""

    @model_validator(mode="after")
    def _ready_names_its_node(self) -> ReplacementOrder:
        if self.state == "ready" and not self.node:
            raise ValueError("a ready replacement names its node")
        return self


class HttpReplacement:
    """The client side of docs/replacement-http-provider.md."""

    name = "http"
    FINAL_STATES = ("ready", "failed")

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout_seconds: float,
        poll_seconds: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout, self._poll, self._transport = timeout_seconds, poll_seconds, transport

    @staticmethod
    async def _send(http: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; what retrying may fix (no answer, 408, 429, 5xx) is ProviderUnavailable."""
        try:
            response = await http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise ProviderUnavailable(f"{method} {path}: {type(e).__name__}: {e}") from e
        if response.status_code in (408, 429) or response.status_code >= 500:
            raise ProviderUnavailable(f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}")
        return response

    @staticmethod
    def _order(response: httpx.Response) -> ReplacementOrder:
        try:
            return ReplacementOrder.model_validate_json(response.content)
        except ValidationError as e:
            raise ProviderUnavailable(f"the replacement API answered an unreadable replacement: {e}") from e

    async def request(self, req: K8sReplacementRequest, progress: Progress) -> K8sReplacementResult:
        ctx = req.ctx
        body = {
            "failed_node": req.failed_node,
            "slurm_node": req.slurm_node,
            "incident_id": ctx.incident_id,
            "reason": ctx.slurm_reason(),
            "requested_by": ctx.actor,
        }
        invocation = Invocation(
            path="http",
            command=f"POST {self._base_url}/v1/replacements {json.dumps(body, sort_keys=True)}",
            executed=not ctx.dry_run,
        )
        if ctx.dry_run:
            action = record(
                "request_http_replacement",
                req.failed_node,
                invocation,
                ctx,
                "dry-run: would ask the provider (whether it would accept is not known)",
            )
            return K8sReplacementResult(
                provider=self.name, accepted=False, node=None, detail=action.detail, actions=[action]
            )
        # One client per request: a replacement is asked for once per incident.
        async with httpx.AsyncClient(
            base_url=self._base_url, headers=self._headers, timeout=30.0, transport=self._transport
        ) as http:
            # One replacement per incident and Node, however often this is retried.
            response = await self._send(
                http,
                "POST",
                "/v1/replacements",
                json=body,
                headers={"Idempotency-Key": f"{ctx.incident_id}/{req.failed_node}"},
            )
            if response.status_code not in (200, 201):
                action = record(
                    "request_http_replacement",
                    req.failed_node,
                    invocation,
                    ctx,
                    f"refused: HTTP {response.status_code}: {response.text[:300]}",
                )
                return K8sReplacementResult(
                    provider=self.name, accepted=False, node=None, detail=action.detail, actions=[action]
                )
            order = self._order(response)
            actions = [
                record(
                    "request_http_replacement",
                    req.failed_node,
                    invocation,
                    ctx,
                    f"replacement {order.id}: {order.state}",
                )
            ]
            deadline = time.monotonic() + self._timeout
            while order.state not in self.FINAL_STATES and time.monotonic() < deadline:
                progress(f"replacement {order.id}: {order.state} {order.message}".strip())
                await asyncio.sleep(self._poll)
                order = self._order(await self._send(http, "GET", f"/v1/replacements/{order.id}"))
        if order.state == "ready":
            return K8sReplacementResult(
                provider=self.name,
                accepted=True,
                node=order.node,
                detail=f"replacement {order.id}: Node {order.node} ready",
                actions=actions,
            )
        why = (
            f"failed: {order.message or 'no reason given'}"
            if order.state == "failed"
            else f"still {order.state} after {self._timeout:.0f} s"
        )
        return K8sReplacementResult(
            provider=self.name, accepted=False, node=None, detail=f"replacement {order.id} {why}", actions=actions
        )
