"""The hook's HTTP interface: a plain ASGI application with one endpoint per source, its OpenAPI
document, metrics.

Every POST goes the same way: read the body within the size limit, authenticate, validate the whole
request strictly, then hand its alerts to the intake. A request with any problem is refused whole
(4xx, a JSON body naming each problem) before anything is handed over; a 200 means every alert in
it is in Temporal, or was dropped for the reason given (docs/alert-hooks.md, "What accepted means").

No web framework: routing is three paths, and in a storm a framework's per-request layers
(middleware, request and response objects) cost more CPU than the validation itself (measured).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Annotated, Any

from pydantic import BaseModel, Field, ValidationError
from pydantic.json_schema import models_json_schema

from contracts.models import utc_now
from hooks.auth import NONCE_CHARACTERS, NONCE_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, Authenticator
from hooks.credentials import Credential
from hooks.intake import Intake, Outcome, Result
from hooks.inventory import EveryNode, InventoryUnavailable, NodeInventory
from hooks.problems import Refused, from_validation, problem
from hooks.settings import HookSettings
from hooks.sources import (
    IgnoredLine,
    Incoming,
    Parsed,
    WireModel,
    alertmanager,
    clip,
    gpu_health,
    kernel_log,
)

log = logging.getLogger("training_recovery.hooks")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_CONTENT_TYPE = {"json": b"application/json", "text": b"text/plain; charset=utf-8"}
_NODES_NAMED = 20  # nodes named in a 403 or an unknown nodes' 422 answer, at most
_READ_HEADERS = frozenset(
    name.encode()
    for name in ("authorization", SIGNATURE_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, "content-type", "content-length")
)


# --- answers (also the OpenAPI document's response schemas) ------------------------------------


class AlertAnswer(BaseModel):
    node: str = Field(description="the node the alert was observed on")
    xid: int | None
    outcome: Outcome
    incident: str | None = Field(None, description="workflow id of the incident holding the alert")
    reason: str | None = Field(None, description="why it was dropped, or whose incident it joined")


class IgnoredAnswer(BaseModel):
    index: int = Field(description="the line's index in `lines`")
    reason: str


class HookAnswer(BaseModel):
    """200: each alert, in request order, with what happened to it."""

    accepted: int
    correlated: int
    duplicate: int
    dropped: int
    alerts: list[AlertAnswer]
    ignored: list[IgnoredAnswer] = Field(
        default_factory=list, description="kernel-log lines that are no Xid line, left out (absent when none)"
    )


class Problem(BaseModel):
    loc: str = Field(description="where in the request: a JSON path, a header, or 'body'")
    msg: str


class ProblemAnswer(BaseModel):
    """4xx: nothing of the request was handed over. 503: not all of it was; retry it whole (what did
    reach Temporal is answered as a duplicate on the retry)."""

    error: str
    problems: Annotated[list[Problem], Field(min_length=1)]


# --- the sources, as endpoints -----------------------------------------------------------------

Parse = Callable[[WireModel, HookSettings, datetime], Parsed]


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str
    model: type[WireModel]
    parse: Parse  # the validated body -> its alerts, problems and ignored lines
    summary: str


ENDPOINTS = [
    Endpoint(
        "alertmanager",
        "/v1/alerts/alertmanager",
        alertmanager.AlertmanagerWebhook,
        lambda body, s, now: Parsed(*alertmanager.to_incoming(body, s.node_labels)),
        "Prometheus Alertmanager webhook (version 4) with dcgm-exporter XID alerts",
    ),
    Endpoint(
        "gpu-health",
        "/v1/alerts/gpu-health",
        gpu_health.GpuHealthEvent,
        lambda body, s, now: Parsed([gpu_health.to_incoming(body)], []),
        "one GPU health event: an XID on a GPU, or an NCCL timeout",
    ),
    Endpoint(
        "kernel-log",
        "/v1/alerts/kernel-log",
        kernel_log.KernelLogPost,
        lambda body, s, now: kernel_log.to_incoming(body, now),
        "NVRM Xid lines from one node's kernel log",
    ),
]


class HookApp:
    def __init__(self, settings: HookSettings, intake: Intake, inventory: NodeInventory = EveryNode()) -> None:
        self.settings = settings
        self.intake = intake
        self._inventory = inventory
        self._unknown_node_requests = 0  # requests refused 422 for naming a node the cluster does not have
        self._auth = Authenticator(settings)
        self._requests: Counter[tuple[str, int]] = Counter()
        self._out_of_scope: Counter[str] = Counter()  # requests refused 403, by credential
        self._posts = {e.path: e for e in ENDPOINTS}
        self._gets: dict[str, Callable[[], tuple[str, bytes]]] = {
            "/openapi.json": lambda: ("json", self._openapi),
            "/healthz": lambda: ("text", b"ok\n"),
            "/metrics": lambda: ("text", self.metrics().encode()),
        }
        self._parsed = ParsedBodies(settings.dedupe_cache_size)

    @cached_property
    def _openapi(self) -> bytes:
        return _JSON.encode(openapi_document(self.settings)).encode()

    def asgi(self) -> ASGIApp:
        return self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1000})
            return
        if scope["type"] != "http":
            return  # lifespan: nothing to start or stop
        path, method = scope["path"], scope["method"]
        endpoint = self._posts.get(path)
        headers: list[tuple[bytes, bytes]] = []
        if endpoint is not None and method == "POST":
            status, kind, body, headers = await self._post(endpoint, scope, receive)
        elif path in self._gets and method in ("GET", "HEAD"):
            status, (kind, body) = 200, self._gets[path]()
        else:
            allowed = "POST" if endpoint is not None else "GET, HEAD" if path in self._gets else None
            status, error = (405, "Method Not Allowed") if allowed else (404, "Not Found")
            headers = [(b"allow", allowed.encode())] if allowed else []
            refusal = Refused(status, error, [problem("path", f"{method} {path}: {error}")])
            kind, body = "json", _JSON.encode(refusal.body()).encode()
        headers = [(b"content-type", _CONTENT_TYPE[kind]), (b"content-length", b"%d" % len(body)), *headers]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _post(
        self, endpoint: Endpoint, scope: Scope, receive: Receive
    ) -> tuple[int, str, bytes, list[tuple[bytes, bytes]]]:
        try:
            answer = await self._handle(endpoint, scope, receive)
        except Refused as refused:
            if refused.status >= 500:
                log.warning("%s: %s: %s", endpoint.name, refused.error, refused.problems[0]["msg"])
            self._requests[(endpoint.name, refused.status)] += 1
            headers = [(k.encode(), v.encode()) for k, v in refused.headers.items()]
            return refused.status, "json", _JSON.encode(refused.body()).encode(), headers
        self._requests[(endpoint.name, 200)] += 1
        return 200, "json", answer, []

    async def _handle(self, endpoint: Endpoint, scope: Scope, receive: Receive) -> bytes:
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            if name in _READ_HEADERS:
                headers.setdefault(name.decode(), value.decode("latin-1"))
        body = await self._read(headers.get("content-length"), receive)
        credential = self._auth.check(headers, body)
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise Refused(
                415,
                "unsupported media type",
                [problem("headers.content-type", f"expected application/json, got {media_type or 'none'}")],
            )
        parsed = self._parsed.get(endpoint.name, body) or self._parse(endpoint, body)
        incoming = parsed.alerts
        self._check_scope(endpoint, credential, incoming)
        await self._check_known_nodes(endpoint, incoming)
        try:
            results = await self.intake.submit(incoming)
        except Exception as e:
            raise Refused(
                503,
                "unavailable",
                [problem("temporal", f"not every alert could be handed over ({type(e).__name__}: {e}); retry")],
            ) from e
        dropped = [(i, r) for i, r in zip(incoming, results, strict=True) if r.outcome is Outcome.DROPPED]
        if dropped:
            log.info(
                "%s: dropped %d of %d alert(s); first: %s: %s",
                endpoint.name,
                len(dropped),
                len(results),
                dropped[0][0].node,
                dropped[0][1].reason,
            )
        return answer_json(incoming, results, parsed.ignored)

    def _parse(self, endpoint: Endpoint, body: bytes) -> Parsed:
        payload = _validate(endpoint.model, body)
        now = utc_now()
        parsed = endpoint.parse(payload, self.settings, now)
        incoming, problems = parsed.alerts, parsed.problems
        if len(incoming) > self.settings.max_alerts_per_request:
            problems.append(
                problem("body", f"{len(incoming)} alerts; at most {self.settings.max_alerts_per_request} per request")
            )
        if problems:
            raise Refused(422, "invalid alerts", problems)
        if all(i.observed_at != now for i in incoming):  # the same bytes will give the same alerts
            self._parsed.put(endpoint.name, body, parsed)
        return parsed

    def _check_scope(self, endpoint: Endpoint, credential: Credential, incoming: list[Incoming]) -> None:
        """Refused(403) when an alert names a node the credential may not report on: a sender holds
        the nodes it may open incidents on (and drain), no more."""
        outside = credential.outside(i.node for i in incoming)
        if not outside:
            return
        self._out_of_scope[credential.name] += 1
        log.warning(
            "%s: credential %s may not report on %s: request refused",
            endpoint.name,
            credential.name,
            ", ".join(outside[:_NODES_NAMED]),
        )
        raise Refused(
            403,
            "forbidden",
            [
                problem("body", f"credential {credential.name} may not report on node {node}")
                for node in outside[:_NODES_NAMED]
            ],
        )

    async def _check_known_nodes(self, endpoint: Endpoint, incoming: list[Incoming]) -> None:
        """Refused(422) when an alert names a node the cluster does not have, Refused(503) when the
        cluster's nodes cannot be read and none are known: an unknown name opens no incident, and
        takes no room in the hook's memory."""
        try:
            unknown = await self._inventory.unknown(i.node for i in incoming)
        except InventoryUnavailable as e:
            raise Refused(503, "unavailable", [problem("inventory", f"{e}; retry")]) from e
        if not unknown:
            return
        self._unknown_node_requests += 1
        log.warning(
            "%s: %d node(s) not in the cluster, first %s: request refused", endpoint.name, len(unknown), unknown[0]
        )
        raise Refused(
            422,
            "unknown nodes",
            [problem("body", f"node {node} is not in the cluster") for node in unknown[:_NODES_NAMED]],
        )

    async def _read(self, declared: str | None, receive: Receive) -> bytes:
        limit = self.settings.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(400, "client disconnected", [problem("body", "the client went away before sending it")])
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def metrics(self) -> str:
        """Prometheus text format: the hook's own counters."""
        lines = ["# TYPE recovery_hook_requests_total counter"]
        lines += [
            f'recovery_hook_requests_total{{endpoint="{e}",status="{s}"}} {n}'
            for (e, s), n in sorted(self._requests.items())
        ]
        lines.append("# TYPE recovery_hook_out_of_scope_requests_total counter")
        lines += [
            f'recovery_hook_out_of_scope_requests_total{{credential="{c}"}} {n}'
            for c, n in sorted(self._out_of_scope.items())
        ]
        lines.append("# TYPE recovery_hook_unknown_node_requests_total counter")
        lines.append(f"recovery_hook_unknown_node_requests_total {self._unknown_node_requests}")
        lines.append("# TYPE recovery_hook_alerts_total counter")
        lines += [f'recovery_hook_alerts_total{{outcome="{o.value}"}} {self.intake.outcomes[o.value]}' for o in Outcome]
        lines.append("# TYPE recovery_hook_temporal_calls_total counter")
        lines += [
            f'recovery_hook_temporal_calls_total{{call="{c}"}} {n}'
            for c, n in sorted(self.intake.temporal_calls.items())
        ]
        return "\n".join(lines) + "\n"


class ParsedBodies:
    """Bodies already validated, as parsed, by endpoint and a digest of the exact bytes.

    A storm is mostly re-sends of byte-identical bodies (Alertmanager's repeats and HA pairs, shipper
    retries); they are authenticated as any other request, but not parsed again. Only bodies whose
    alerts do not depend on when they arrived are kept (a kernel log line without a time takes the
    time of receipt). Bounded by the alerts and ignored lines held."""

    def __init__(self, max_items: int) -> None:
        self._max_items = max_items
        self._items = 0
        self._bodies: OrderedDict[tuple[str, bytes], Parsed] = OrderedDict()

    @staticmethod
    def _key(endpoint: str, body: bytes) -> tuple[str, bytes]:
        return endpoint, hashlib.blake2b(body, digest_size=16).digest()

    def get(self, endpoint: str, body: bytes) -> Parsed | None:
        return self._bodies.get(self._key(endpoint, body))

    def put(self, endpoint: str, body: bytes, parsed: Parsed) -> None:
        self._bodies[self._key(endpoint, body)] = parsed
        self._items += _size(parsed)
        while self._items > self._max_items:
            self._items -= _size(self._bodies.popitem(last=False)[1])


def _size(parsed: Parsed) -> int:
    return len(parsed.alerts) + len(parsed.ignored)


def _too_large(limit: int) -> Refused:
    return Refused(413, "body too large", [problem("body", f"larger than {limit} bytes")])


def _validate(model: type[WireModel], body: bytes) -> WireModel:
    try:
        payload = model.model_validate_json(body)
    except ValidationError as e:
        if any(err["type"] == "json_invalid" for err in e.errors()):
            raise Refused(400, "body is not JSON", [problem("body", "not a valid JSON document")]) from None
        raise Refused(422, "invalid payload", from_validation(e)) from None
    # pydantic takes a key's last value; another reader of the same body may take its first. Checked
    # once the body is valid, so only a document of the schema's depth and size is parsed again.
    json.loads(body, object_pairs_hook=_refuse_duplicate_keys)
    return payload


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> None:
    # None for each object: only the check is wanted, and building no dicts saves a third of its cost.
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise Refused(
                400, "body is not JSON", [problem("body", f"the key {clip(key, 64)!r} is twice in one object")]
            )
        seen.add(key)


def answer_json(incoming: list[Incoming], results: list[Result], ignored: tuple[IgnoredLine, ...] = ()) -> bytes:
    """The 200 answer (HookAnswer), encoded directly: in a storm this is every request's last step."""
    counts = dict.fromkeys(Outcome, 0)
    alerts = []
    for i, r in zip(incoming, results, strict=True):
        counts[r.outcome] += 1
        alert: dict[str, object] = {"node": i.node, "xid": i.xid, "outcome": r.outcome.value}
        if r.incident is not None:
            alert["incident"] = r.incident
        if r.reason:
            alert["reason"] = r.reason
        alerts.append(alert)
    answer = {o.value: n for o, n in counts.items()} | {"alerts": alerts}
    if ignored:
        answer["ignored"] = [{"index": line.index, "reason": line.reason} for line in ignored]
    return _JSON.encode(answer).encode()


def openapi_document(settings: HookSettings) -> dict:
    models = [(e.model, "validation") for e in ENDPOINTS] + [
        (HookAnswer, "serialization"),
        (ProblemAnswer, "serialization"),
    ]
    refs, schemas = models_json_schema(models, ref_template="#/components/schemas/{model}")

    def ref(model: type[BaseModel], mode: str) -> dict:
        return refs[(model, mode)]

    def problems(description: str) -> dict:
        return {
            "description": description,
            "content": {"application/json": {"schema": ref(ProblemAnswer, "serialization")}},
        }

    schemes = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "hmac": {
            "type": "apiKey",
            "in": "header",
            "name": SIGNATURE_HEADER,
            "description": f"sha256=<hex HMAC-SHA256 of '<timestamp>.<nonce>.<raw body>', keyed with the "
            f"shared key>, sent with {TIMESTAMP_HEADER} (Unix seconds, within "
            f"{settings.signature_window_seconds:g} s of the hook's clock) and {NONCE_HEADER} "
            f"(16-128 characters of {NONCE_CHARACTERS}, used once)",
        },
    }
    paths = {
        e.path: {
            "post": {
                "operationId": e.name.replace("-", "_"),
                "summary": e.summary,
                "security": [{mode: []} for mode in settings.auth],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": ref(e.model, "validation")}},
                },
                "responses": {
                    "200": {
                        "description": "every alert is in Temporal, or was dropped for the reason given",
                        "content": {"application/json": {"schema": ref(HookAnswer, "serialization")}},
                    },
                    "400": problems("the body is not JSON, or an object in it has a key twice"),
                    "401": problems("no valid credentials, or a replayed signature"),
                    "403": problems("an alert names a node the credential may not report on"),
                    "413": problems(f"the body is larger than {settings.max_body_bytes} bytes"),
                    "415": problems("the body is not application/json"),
                    "422": problems(
                        "the payload or an alert in it is invalid, or names a node the cluster does not have"
                    ),
                    "431": problems(f"the request line and headers are larger than {settings.max_header_bytes} bytes"),
                    "503": problems(
                        "Temporal could not take every alert, the replay window holds too many "
                        "signatures, or the cluster's nodes could not be read; retry the request"
                    ),
                },
            }
        }
        for e in ENDPOINTS
    }
    paths["/healthz"] = {"get": {"summary": "liveness", "security": [], "responses": {"200": {"description": "ok"}}}}
    paths["/metrics"] = {
        "get": {
            "summary": "the hook's counters, Prometheus text format",
            "security": [],
            "responses": {"200": {"description": "counters"}},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "training-recovery alert hooks",
            "version": "1",
            "description": "Failure alerts in, one incident per node out (docs/alert-hooks.md).",
        },
        "paths": paths,
        "components": {"schemas": schemas["$defs"], "securitySchemes": {m: schemes[m] for m in settings.auth}},
    }
