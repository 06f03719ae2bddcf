"""The hook's HTTP interface (Starlette): one endpoint per source, its OpenAPI document, metrics.

Every POST goes the same way: read the body within the size limit, authenticate, validate the whole
request strictly, then hand its alerts to the intake. A request with any problem is refused whole
(4xx, a JSON body naming each problem) before anything is handed over; a 200 means every alert in
it is in Temporal, or was dropped for the reason given (docs/alert-hooks.md, "What accepted means").
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Annotated

from pydantic import BaseModel, Field, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from contracts.models import utc_now
from starter.hooks.auth import SIGNATURE_HEADER, Authenticator
from starter.hooks.intake import Intake, Outcome, Result
from starter.hooks.problems import Refused, from_validation, problem
from starter.hooks.settings import HookSettings
from starter.hooks.sources import Incoming, WireModel, alertmanager, gpu_health, kernel_log

log = logging.getLogger("training_recovery.hooks")


# --- answers (also the OpenAPI document's response schemas) ------------------------------------


class AlertAnswer(BaseModel):
    node: str = Field(description="the node the alert was observed on")
    xid: int | None
    outcome: Outcome
    incident: str | None = Field(None, description="workflow id of the incident holding the alert")
    reason: str | None = Field(None, description="why it was dropped, or whose incident it joined")


class HookAnswer(BaseModel):
    """200: each alert, in request order, with what happened to it."""

    accepted: int
    correlated: int
    duplicate: int
    dropped: int
    alerts: list[AlertAnswer]


class Problem(BaseModel):
    loc: str = Field(description="where in the request: a JSON path, a header, or 'body'")
    msg: str


class ProblemAnswer(BaseModel):
    """4xx: nothing of the request was handed over. 503: not all of it was; retry it whole (what did
    reach Temporal is answered as a duplicate on the retry)."""

    error: str
    problems: Annotated[list[Problem], Field(min_length=1)]


# --- the sources, as endpoints -----------------------------------------------------------------

Parse = Callable[[WireModel, HookSettings, datetime], tuple[list[Incoming], list[dict[str, str]]]]


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str
    model: type[WireModel]
    parse: Parse  # the validated body -> (alerts, problems)
    summary: str


ENDPOINTS = [
    Endpoint("alertmanager", "/v1/alerts/alertmanager", alertmanager.AlertmanagerWebhook,
             lambda body, s, now: alertmanager.to_incoming(body, s.node_labels),
             "Prometheus Alertmanager webhook (version 4) with dcgm-exporter XID alerts"),
    Endpoint("gpu-health", "/v1/alerts/gpu-health", gpu_health.GpuHealthEvent,
             lambda body, s, now: ([gpu_health.to_incoming(body)], []),
             "one GPU health event: an XID on a GPU, or an NCCL timeout"),
    Endpoint("kernel-log", "/v1/alerts/kernel-log", kernel_log.KernelLogPost,
             lambda body, s, now: kernel_log.to_incoming(body, now),
             "NVRM Xid lines from one node's kernel log"),
]


class HookApp:
    def __init__(self, settings: HookSettings, intake: Intake) -> None:
        self.settings = settings
        self.intake = intake
        self._auth = Authenticator(settings)
        self._requests: Counter[tuple[str, int]] = Counter()

    @cached_property
    def _openapi(self) -> dict:
        return openapi_document(self.settings)

    def asgi(self) -> Starlette:
        routes = [Route(e.path, self._endpoint(e), methods=["POST"]) for e in ENDPOINTS]
        routes += [
            Route("/openapi.json", lambda _: JSONResponse(self._openapi), methods=["GET"]),
            Route("/healthz", lambda _: PlainTextResponse("ok\n"), methods=["GET"]),
            Route("/metrics", lambda _: PlainTextResponse(self.metrics()), methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    def _endpoint(self, endpoint: Endpoint):
        async def handle(request: Request) -> Response:
            try:
                answer = await self._handle(endpoint, request)
            except Refused as refused:
                if refused.status >= 500:
                    log.warning("%s: %s: %s", endpoint.name, refused.error, refused.problems[0]["msg"])
                self._requests[(endpoint.name, refused.status)] += 1
                return JSONResponse(refused.body(), status_code=refused.status, headers=refused.headers)
            self._requests[(endpoint.name, 200)] += 1
            return Response(answer.model_dump_json(exclude_none=True), media_type="application/json")

        return handle

    async def _handle(self, endpoint: Endpoint, request: Request) -> HookAnswer:
        body = await self._read(request)
        self._auth.check(request.headers.get("authorization"), request.headers.get(SIGNATURE_HEADER), body)
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise Refused(415, "unsupported media type",
                          [problem("headers.content-type", f"expected application/json, got {media_type or 'none'}")])
        payload = _validate(endpoint.model, body)
        now = utc_now()
        incoming, problems = endpoint.parse(payload, self.settings, now)
        if len(incoming) > self.settings.max_alerts_per_request:
            problems.append(problem("body", f"{len(incoming)} alerts; at most "
                                            f"{self.settings.max_alerts_per_request} per request"))
        if problems:
            raise Refused(422, "invalid alerts", problems)
        try:
            results = await self.intake.submit(incoming)
        except Exception as e:
            raise Refused(503, "unavailable", [problem("temporal", f"not every alert could be handed over "
                                                                   f"({type(e).__name__}: {e}); retry")]) from e
        dropped = [(i, r) for i, r in zip(incoming, results, strict=True) if r.outcome is Outcome.DROPPED]
        if dropped:
            log.info("%s: dropped %d of %d alert(s); first: %s: %s", endpoint.name, len(dropped), len(results),
                     dropped[0][0].node, dropped[0][1].reason)
        return _answer(incoming, results)

    async def _read(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        too_large = Refused(413, "body too large", [problem("body", f"larger than {limit} bytes")])
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def metrics(self) -> str:
        """Prometheus text format: the hook's own counters."""
        lines = ["# TYPE recovery_hook_requests_total counter"]
        lines += [f'recovery_hook_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(self._requests.items())]
        lines.append("# TYPE recovery_hook_alerts_total counter")
        lines += [f'recovery_hook_alerts_total{{outcome="{o.value}"}} {self.intake.outcomes[o.value]}' for o in Outcome]
        lines.append("# TYPE recovery_hook_temporal_calls_total counter")
        lines += [f'recovery_hook_temporal_calls_total{{call="{c}"}} {n}'
                  for c, n in sorted(self.intake.temporal_calls.items())]
        return "\n".join(lines) + "\n"


def _validate(model: type[WireModel], body: bytes) -> WireModel:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        if any(err["type"] == "json_invalid" for err in e.errors()):
            raise Refused(400, "body is not JSON", [problem("body", "not a valid JSON document")]) from None
        raise Refused(422, "invalid payload", from_validation(e)) from None


def _answer(incoming: list[Incoming], results: list[Result]) -> HookAnswer:
    counts = Counter(r.outcome for r in results)
    return HookAnswer(
        accepted=counts[Outcome.ACCEPTED], correlated=counts[Outcome.CORRELATED],
        duplicate=counts[Outcome.DUPLICATE], dropped=counts[Outcome.DROPPED],
        alerts=[AlertAnswer(node=i.node, xid=i.xid, outcome=r.outcome, incident=r.incident, reason=r.reason or None)
                for i, r in zip(incoming, results, strict=True)],
    )


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """404 and 405 in the same shape as every other refusal."""
    body = {"error": exc.detail, "problems": [problem("path", f"{request.method} {request.url.path}: {exc.detail}")]}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def openapi_document(settings: HookSettings) -> dict:
    models = [(e.model, "validation") for e in ENDPOINTS] + [(HookAnswer, "serialization"),
                                                            (ProblemAnswer, "serialization")]
    refs, schemas = models_json_schema(models, ref_template="#/components/schemas/{model}")

    def ref(model: type[BaseModel], mode: str) -> dict:
        return refs[(model, mode)]

    def problems(description: str) -> dict:
        return {"description": description,
                "content": {"application/json": {"schema": ref(ProblemAnswer, "serialization")}}}

    schemes = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "hmac": {"type": "apiKey", "in": "header", "name": SIGNATURE_HEADER,
                 "description": "sha256=<hex HMAC-SHA256 of the raw body, keyed with the shared key>"},
    }
    paths = {
        e.path: {"post": {
            "operationId": e.name.replace("-", "_"),
            "summary": e.summary,
            "security": [{mode: []} for mode in settings.auth],
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref(e.model, "validation")}}},
            "responses": {
                "200": {"description": "every alert is in Temporal, or was dropped for the reason given",
                        "content": {"application/json": {"schema": ref(HookAnswer, "serialization")}}},
                "400": problems("the body is not JSON"),
                "401": problems("no valid credentials"),
                "413": problems(f"the body is larger than {settings.max_body_bytes} bytes"),
                "415": problems("the body is not application/json"),
                "422": problems("the payload or an alert in it is invalid"),
                "503": problems("Temporal could not take every alert; retry the request"),
            },
        }}
        for e in ENDPOINTS
    }
    paths["/healthz"] = {"get": {"summary": "liveness", "security": [], "responses": {"200": {"description": "ok"}}}}
    paths["/metrics"] = {"get": {"summary": "the hook's counters, Prometheus text format", "security": [],
                                 "responses": {"200": {"description": "counters"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "training-recovery alert hooks", "version": "1",
                 "description": "Failure alerts in, one incident per node out (docs/alert-hooks.md)."},
        "paths": paths,
        "components": {"schemas": schemas["$defs"], "securitySchemes": {m: schemes[m] for m in settings.auth}},
    }
