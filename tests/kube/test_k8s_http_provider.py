"""The HTTP replacement provider against a small replacement API that keeps the contract of
docs/replacement-http-provider.md, and that provisions its Node on the Kubernetes API server."""

from __future__ import annotations

import socket
import threading
import time
from itertools import count

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from temporalio.exceptions import ApplicationError

from contracts.kubernetes import K8sReplacementRequest, K8sSpareWaitRequest
from contracts.models import utc_now
from tests.kube.k8s_support import (
    NodeSetController,
    Recovery,
    SlurmStandIn,
    ctx,
    k8s_settings,
)

TOKEN = "cloud-token"


class ReplacementApi:
    """The provider's side. `outcome`: "ready" (after `polls` polls it creates the Node and
    reports it), "failed", "stuck" (provisioning for ever), "refuse" (422), "down" (503)."""

    def __init__(self, seed, outcome: str = "ready", polls: int = 2):
        self.seed, self.outcome, self.polls = seed, outcome, polls
        self.orders: dict[str, dict] = {}
        self.by_key: dict[str, str] = {}
        self.posts = 0
        self._ids = count(1)
        app = Starlette(
            routes=[
                Route("/v1/replacements", self._create, methods=["POST"]),
                Route("/v1/replacements/{id}", self._get, methods=["GET"]),
            ]
        )
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> ReplacementApi:
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    async def _create(self, request: Request) -> JSONResponse:
        self.posts += 1
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"message": "unauthorized"}, 401)
        if self.outcome == "down":
            return JSONResponse({"message": "maintenance"}, 503)
        body, key = await request.json(), request.headers.get("idempotency-key")
        if self.outcome == "refuse" or not key or not {"failed_node", "incident_id"} <= set(body):
            return JSONResponse({"message": f"no capacity for {body.get('failed_node')}"}, 422)
        if key in self.by_key:
            return JSONResponse(self.orders[self.by_key[key]], 200)
        order = {"id": f"r-{next(self._ids)}", "state": "pending", "node": None, "message": "", "_polls": 0}
        self.orders[order["id"]], self.by_key[key] = order, order["id"]
        return JSONResponse(self._public(order), 201)

    async def _get(self, request: Request) -> JSONResponse:
        order = self.orders[request.path_params["id"]]
        order["_polls"] += 1
        if order["state"] in ("pending", "provisioning"):
            order["state"] = "provisioning"
            if order["_polls"] >= self.polls and self.outcome == "ready":
                node = f"gpu-cloud-{order['id']}"
                self.seed.node(node)
                order.update(state="ready", node=node)
            elif order["_polls"] >= self.polls and self.outcome == "failed":
                order.update(state="failed", message="no H100 left in zone b")
        return JSONResponse(self._public(order))

    @staticmethod
    def _public(order: dict) -> dict:
        return {k: v for k, v in order.items() if not k.startswith("_")}


def _recovery(kube_api, namespace, tmp_path, api: ReplacementApi, slurm=None, **settings) -> Recovery:
    values = (
        dict(
            namespace=namespace,
            replacement="http",
            http_url=api.url,
            http_token=TOKEN,
            http_poll_seconds=0.1,
            http_timeout_seconds=5,
        )
        | settings
    )
    return Recovery(k8s_settings(kube_api, tmp_path, **values), slurm or SlurmStandIn())


REQUEST = K8sReplacementRequest(failed_node="gpu-2", slurm_node="gpu-2", ctx=ctx())


async def test_a_named_node_comes_ready_once_however_often_it_is_asked(kube_api, kube_seed, kube_namespace, tmp_path):
    slurm = SlurmStandIn()
    slurm.set("slurmd-gpu-cloud-r-1", "idle")
    controller = NodeSetController(kube_seed, kube_namespace, known=[])
    controller.start()
    with ReplacementApi(kube_seed) as api:
        recovery = _recovery(kube_api, kube_namespace, tmp_path, api, slurm)
        try:
            first = await recovery.run(recovery.activities.request_k8s_replacement, REQUEST)
            again = await recovery.run(recovery.activities.request_k8s_replacement, REQUEST)
            spare = await recovery.run(
                recovery.activities.wait_for_k8s_node,
                K8sSpareWaitRequest(failed_node="gpu-2", since=utc_now(), node=first.node, deadline_seconds=20),
            )
        finally:
            controller.stop()
            recovery.close()
    assert (first.accepted, first.node) == (True, "gpu-cloud-r-1") and again.node == first.node
    assert len(api.orders) == 1 and api.posts == 2
    assert any("provisioning" in str(h) for h in recovery.heartbeats)
    (action,) = first.actions
    assert action.path == "http" and action.command.startswith(f"POST {api.url}/v1/replacements ")
    assert (spare.healthy, spare.node, spare.slurm_node) == (True, "gpu-cloud-r-1", "slurmd-gpu-cloud-r-1")


@pytest.mark.parametrize(
    "outcome, detail",
    [
        ("failed", "replacement r-1 failed: no H100 left in zone b"),
        ("stuck", "replacement r-1 still provisioning after 1 s"),
        ("refuse", "refused: HTTP 422"),
    ],
)
async def test_no_replacement_is_an_explicit_answer(kube_api, kube_seed, kube_namespace, tmp_path, outcome, detail):
    with ReplacementApi(kube_seed, outcome=outcome) as api:
        recovery = _recovery(kube_api, kube_namespace, tmp_path, api, http_timeout_seconds=1)
        try:
            result = await recovery.run(recovery.activities.request_k8s_replacement, REQUEST)
        finally:
            recovery.close()
    assert not result.accepted and result.node is None
    assert detail in result.detail


async def test_an_unreachable_api_is_retryable(kube_api, kube_seed, kube_namespace, tmp_path):
    with ReplacementApi(kube_seed, outcome="down") as api:
        recovery = _recovery(kube_api, kube_namespace, tmp_path, api)
        try:
            with pytest.raises(ApplicationError) as raised:
                await recovery.run(recovery.activities.request_k8s_replacement, REQUEST)
        finally:
            recovery.close()
    assert (raised.value.type, raised.value.non_retryable) == ("ProviderUnavailable", False)
