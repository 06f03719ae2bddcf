"""An in-repo Kubernetes API server for tests, served over real HTTP(S) to the unmodified
official `kubernetes` client.

    server = KubeApiServer(tls=True, token="test-token", add_not_ready_taint=False).start()
    server.url                 # https://127.0.0.1:<free port>
    server.token               # None: no authentication
    server.ca_file             # PEM of the self-signed certificate (its own CA, SAN IP:127.0.0.1); removed by stop()
    server.kubeconfig(path)    # writes a kubeconfig (server, CA, bearer token); returns its path
    server.register_crd(group, version, plural, kind, *, namespaced=True,
                        scale=(".spec.replicas", ".status.replicas"))
    server.requests            # [(METHOD, "path?query"), ...] of every request
    server.writes()            # the requests with a writing verb (POST, PUT, PATCH, DELETE)
    server.fail_next.append((500, "InternalError"))   # the next request gets that status
    server.faults.inject("POST", r"/eviction$", status=500, times=2)  # faults by method and path:
    server.faults.inject("PUT", r"/nodes/gpu-2$", drop=True)         # a status, a dropped connection,
    server.faults.inject("GET", r"/pods", delay=5, times=None)        # a delay; class Faults below
    server.compact()           # older resourceVersions now give 410 Expired on watch
    server.finish_terminating_pods(node=None) -> int  # plays kubelet
    server.stop()

It serves Namespaces, Nodes, Pods (with /status and /eviction), Events, ConfigMaps, Secrets
(core/v1), PodDisruptionBudgets (policy/v1), Leases (coordination.k8s.io/v1) and registered
custom resources (with /status and /scale), plus the discovery documents DynamicClient reads.
The semantics (store.py), patches (patch.py) and selectors (selectors.py) are described in
docs/kubernetes-test-server.md, each with the test that holds it to them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

import uvicorn
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .resources import ResourceType, custom_type
from .selectors import SelectorError, fields_match, labels_match, parse_fields, parse_labels
from .store import ApiError, Event, Matcher, Store, apply_patch, bad_request, status_body, watch_view

VERSION = {"major": "1", "minor": "34", "gitVersion": "v1.34.0+kubeapi-test", "gitCommit": "", "gitTreeState": "clean",
           "buildDate": "2026-01-01T00:00:00Z", "goVersion": "", "compiler": "", "platform": "linux/amd64"}
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")
# A real apiserver ends a watch after a random 30-60 min when the client names no timeout.
DEFAULT_WATCH_SECONDS = 1800


@functools.cache
def _certificate() -> tuple[bytes, bytes]:
    """The PEM certificate and key of a self-signed certificate for IP 127.0.0.1 (its own CA),
    made once per process; each server writes them into a directory of its own."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the Kubernetes test server needs the openssl command for its TLS certificate "
                           "(Debian: apt-get install openssl)")
    with tempfile.TemporaryDirectory(prefix="kubeapi-tls-") as directory:
        cert, key = os.path.join(directory, "ca.crt"), os.path.join(directory, "tls.key")
        subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                        "-keyout", key, "-out", cert, "-days", "30", "-subj", "/CN=kubeapi-test",
                        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
        return Path(cert).read_bytes(), Path(key).read_bytes()


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.status(), status_code=error.code)


def _no_such_path() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource")


async def _json_body(request: Request) -> object:
    raw = await request.body()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise bad_request(f"the body is not JSON: {e}") from None


@dataclass
class Fault:
    method: str
    target: re.Pattern[str]
    status: int | None
    reason: str
    delay: float
    drop: bool
    times: int | None  # None: every matching request, for good
    hits: int = 0


class Faults:
    """Test control: faults injected into the requests that match, before they reach the store.

    `inject(method, target_regex, status=|delay=|drop=, times=1)` adds a rule; the regex is searched
    in the request's path and query as `server.requests` records it, and the first rule with faults
    left applies. `status` answers that code with a Status body (reason from `reason`, or the HTTP
    phrase); `delay` holds the request that many seconds and then serves it (a slow server still
    does what it was asked, even if the client has given up); `drop` closes the connection without
    an answer. Requests no rule matches are served as usual. Thread-safe: tests inject from their
    own thread while the server's loop takes."""

    def __init__(self) -> None:
        self._rules: list[Fault] = []
        self._lock = threading.Lock()

    def inject(self, method: str, target_regex: str, *, status: int | None = None, reason: str = "",
               delay: float = 0.0, drop: bool = False, times: int | None = 1) -> Fault:
        if sum((status is not None, delay > 0, drop)) != 1:
            raise ValueError("a fault is one of status, delay or drop")
        fault = Fault(method.upper(), re.compile(target_regex), status,
                      reason or (HTTPStatus(status).phrase.replace(" ", "") if status else ""), delay, drop, times)
        with self._lock:
            self._rules.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def take(self, method: str, target: str) -> Fault | None:
        """The fault this request meets (counted as hit), or None."""
        with self._lock:
            for fault in self._rules:
                if (method == fault.method and (fault.times is None or fault.hits < fault.times)
                        and fault.target.search(target)):
                    fault.hits += 1
                    return fault
        return None


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while (message := await receive())["type"] == "http.request":
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` that gives `body` first, then whatever the connection has next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict:
        return pending.pop() if pending else await receive()
    return replay


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, stopped at once by stop_soon() instead of at its next 0.1 s tick (a test
    server starts and stops once per test)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        await super().startup(sockets=sockets)

    async def main_loop(self) -> None:
        await self._wake.wait()

    def stop_soon(self) -> None:
        # No graceful drain either: idle keep-alive TLS connections would hold it up for seconds.
        self.should_exit = self.force_exit = True
        self._loop.call_soon_threadsafe(self._wake.set)


class KubeApiServer:
    """See the module docstring. start() serves in a background thread with its own event loop,
    so synchronous clients, other threads and async code can all use it over TCP."""

    def __init__(self, *, tls: bool = True, token: str | None = "test-token", add_not_ready_taint: bool = False):
        self.tls = tls
        self.token = token
        self.store = Store(add_not_ready_taint=add_not_ready_taint)
        self.requests: list[tuple[str, str]] = []
        self.fail_next: list[tuple[int, str]] = []
        self.faults = Faults()
        self.url = ""
        self.ca_file = ""
        self._server: _Uvicorn | None = None
        self._thread: threading.Thread | None = None
        self._tls_dir: str | None = None  # ca_file and the key, removed by stop()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> KubeApiServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        tls = {}
        if self.tls:
            cert, key = _certificate()
            self._tls_dir = tempfile.mkdtemp(prefix="kubeapi-tls-")
            self.ca_file, key_file = os.path.join(self._tls_dir, "ca.crt"), os.path.join(self._tls_dir, "tls.key")
            Path(self.ca_file).write_bytes(cert)
            Path(key_file).write_bytes(key)
            tls = {"ssl_certfile": self.ca_file, "ssl_keyfile": key_file}
        self._app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", *WRITE_VERBS])])
        config = uvicorn.Config(self._with_faults, interface="asgi3", log_level="warning", access_log=False,
                                lifespan="off", ws="none", **tls)
        self._server = _Uvicorn(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name=f"kubeapi-{port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the Kubernetes test server did not start")
            time.sleep(0.01)
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self.store.close_watches()
        self._server.stop_soon()
        self._thread.join(10)
        self._server = self._thread = None
        if self._tls_dir:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
            self._tls_dir = None

    def __enter__(self) -> KubeApiServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- test hooks ------------------------------------------------------------------------------

    def kubeconfig(self, path) -> str:
        cluster = {"server": self.url}
        if self.tls:
            cluster["certificate-authority"] = self.ca_file
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kubeapi-test",
            "clusters": [{"name": "kubeapi-test", "cluster": cluster}],
            "users": [{"name": "kubeapi-test", "user": {"token": self.token} if self.token else {}}],
            "contexts": [{"name": "kubeapi-test", "context": {"cluster": "kubeapi-test", "user": "kubeapi-test"}}],
        }
        Path(path).write_text(yaml.safe_dump(config))
        return str(path)

    def register_crd(self, group: str, version: str, plural: str, kind: str, *, namespaced: bool = True,
                     scale: tuple[str, str] | None = (".spec.replicas", ".status.replicas")) -> None:
        self.store.register(custom_type(group, version, plural, kind, namespaced=namespaced, scale=scale))

    def compact(self) -> None:
        self.store.compact()

    def finish_terminating_pods(self, node: str | None = None) -> int:
        return self.store.finish_terminating_pods(node)

    def writes(self) -> list[tuple[str, str]]:
        return [r for r in self.requests if r[0] in WRITE_VERBS]

    # -- HTTP ------------------------------------------------------------------------------------

    async def _with_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app: the injected faults (Faults), then the API."""
        fault = None
        if scope["type"] == "http":
            query = scope["query_string"].decode("latin-1")
            target = scope["path"] + (f"?{query}" if query else "")
            fault = self.faults.take(scope["method"], target)
            if fault is not None and not fault.delay:
                self.requests.append((scope["method"], target))
        if fault is None:
            return await self._app(scope, receive, send)
        if fault.delay:
            # The request is read first, so that it is served even if the client gave up meanwhile.
            body = await _read_body(receive)
            await asyncio.sleep(fault.delay)
            return await self._app(scope, _replaying(body, receive), send)
        if fault.drop:
            # ASGI cannot close a connection unanswered; uvicorn's send is a method of the
            # request's cycle, which holds the connection's transport.
            send.__self__.transport.abort()
            return None
        error = ApiError(fault.status, fault.reason, f"injected by the test: {fault.status} {fault.reason}")
        return await _error(error)(scope, receive, send)

    async def _handle(self, request: Request) -> Response:
        query = request.url.query
        self.requests.append((request.method, request.url.path + (f"?{query}" if query else "")))
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if self.token is not None and (scheme.lower() != "bearer" or token.strip() != self.token):
            return _error(ApiError(401, "Unauthorized", "Unauthorized"))
        if self.fail_next:
            code, reason = self.fail_next.pop(0)
            return _error(ApiError(code, reason, f"injected by the test: {code} {reason}"))
        try:
            return await self._dispatch(request)
        except ApiError as e:
            return _error(e)

    async def _dispatch(self, request: Request) -> Response:
        parts = [p for p in request.url.path.split("/") if p]
        method, query = request.method, request.query_params
        if method == "GET" and (document := self._discovery(parts)) is not None:
            return JSONResponse(document)
        rt, namespace, name, sub = self._resolve(parts)
        dry_run = query.get("dryRun") == "All"
        store = self.store
        if name is None:
            if method == "GET":
                return self._watch(rt, namespace, query) if query.get("watch") in ("true", "True", "1") \
                    else self._list(rt, namespace, query)
            if method == "POST" and (namespace or not rt.namespaced):
                return JSONResponse(store.create(rt, namespace, await _json_body(request), dry_run=dry_run), 201)
        elif sub is None or (sub == "status" and rt.status):
            if method == "GET":
                return JSONResponse(store.get(rt, namespace, name))
            if method == "PUT":
                return JSONResponse(store.replace(rt, namespace, name, await _json_body(request), subresource=sub,
                                                  dry_run=dry_run))
            if method == "PATCH":
                return JSONResponse(store.patch(rt, namespace, name, self._content_type(request),
                                                await _json_body(request), subresource=sub, dry_run=dry_run))
            if method == "DELETE" and sub is None:
                return await self._delete(request, rt, namespace, name, dry_run)
        elif sub == "scale" and rt.scale:
            if method == "GET":
                return JSONResponse(store.scale(rt, namespace, name))
            body = await _json_body(request)
            if method == "PUT":
                return JSONResponse(store.write_scale(rt, namespace, name, lambda _: body, dry_run=dry_run))
            if method == "PATCH":
                content_type = self._content_type(request)
                return JSONResponse(store.write_scale(
                    rt, namespace, name, lambda scale: apply_patch(rt, name, content_type, scale, body), dry_run=dry_run))
        elif sub == "eviction" and (rt.group, rt.plural) == ("", "pods"):
            if method == "POST":
                return await self._evict(request, namespace, name, dry_run)
        else:
            raise _no_such_path()
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    @staticmethod
    def _content_type(request: Request) -> str:
        return request.headers.get("content-type", "").split(";")[0].strip()

    def _resolve(self, parts: list[str]) -> tuple[ResourceType, str | None, str | None, str | None]:
        """/api/v1/[namespaces/NS/]PLURAL[/NAME[/SUBRESOURCE]], or the same under /apis/GROUP/VERSION."""
        if parts[:1] == ["api"] and len(parts) >= 3:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 4:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise _no_such_path()
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            inner = self.store.find(group, version, rest[2])
            if inner is not None and inner.namespaced:  # else it is /namespaces/NAME/status
                namespace, rest = rest[1], rest[2:]
        rt = self.store.find(group, version, rest[0])
        if rt is None or len(rest) > 3 or (rt.namespaced and namespace is None and len(rest) > 1):
            raise _no_such_path()
        return rt, namespace, (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)

    def _discovery(self, parts: list[str]) -> dict | None:
        types = list(self.store.types.values())
        if parts == ["version"]:
            return VERSION
        if parts == ["api"]:
            return {"kind": "APIVersions", "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.url.split("//")[1]}]}
        groups: dict[str, dict] = {}
        for rt in types:
            if rt.group:
                version = {"groupVersion": rt.api_version, "version": rt.version}
                group = groups.setdefault(rt.group, {"name": rt.group, "versions": [], "preferredVersion": version})
                if version not in group["versions"]:
                    group["versions"].append(version)
        if parts == ["apis"]:
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": list(groups.values())}
        if len(parts) == 2 and parts[0] == "apis" and parts[1] in groups:
            return {"kind": "APIGroup", "apiVersion": "v1", **groups[parts[1]]}
        if parts == ["api", "v1"] or (len(parts) == 3 and parts[0] == "apis"):
            group, version = ("", "v1") if parts[0] == "api" else (parts[1], parts[2])
            resources = [entry for rt in types if (rt.group, rt.version) == (group, version) for entry in rt.discovery()]
            if resources:
                return {"kind": "APIResourceList", "apiVersion": "v1",
                        "groupVersion": f"{group}/{version}" if group else version, "resources": resources}
        return None

    # -- list and watch --------------------------------------------------------------------------

    @staticmethod
    def _matcher(query) -> Matcher:
        try:
            labels, fields = parse_labels(query.get("labelSelector")), parse_fields(query.get("fieldSelector"))
        except SelectorError as e:
            raise bad_request(str(e)) from None
        return lambda obj: labels_match(labels, obj) and fields_match(fields, obj)

    def _list(self, rt: ResourceType, namespace: str | None, query) -> Response:
        # limit/continue are not served: the whole list in one page is a valid answer to them.
        items, rv = self.store.list_objects(rt, namespace, self._matcher(query))
        return JSONResponse({"kind": f"{rt.kind}List", "apiVersion": rt.api_version,
                             "metadata": {"resourceVersion": rv}, "items": items})

    def _watch(self, rt: ResourceType, namespace: str | None, query) -> Response:
        match = self._matcher(query)
        try:
            timeout = float(query.get("timeoutSeconds") or DEFAULT_WATCH_SECONDS)
        except ValueError:
            raise bad_request("timeoutSeconds must be a number") from None
        resource_version = query.get("resourceVersion")
        store = self.store

        async def stream():
            loop = asyncio.get_running_loop()
            events: asyncio.Queue[Event | None] = asyncio.Queue()

            def listener(event: Event | None) -> None:  # called by writers on any thread
                try:
                    loop.call_soon_threadsafe(events.put_nowait, event)
                except RuntimeError:  # the server's loop has closed, and this stream with it
                    pass

            try:
                initial = store.watch(rt, namespace, match, resource_version, listener)
            except ApiError as e:  # a watch's errors come as an ERROR event in a 200 stream
                yield json.dumps({"type": "ERROR", "object": e.status()}) + "\n"
                return
            try:
                for kind, obj in initial:
                    yield json.dumps({"type": kind, "object": obj}) + "\n"
                deadline = loop.time() + timeout
                while (remaining := deadline - loop.time()) > 0:
                    try:
                        event = await asyncio.wait_for(events.get(), remaining)
                    except TimeoutError:
                        return
                    if event is None:  # the server is stopping
                        return
                    if seen := watch_view(event, rt, namespace, match):
                        yield json.dumps({"type": seen[0], "object": seen[1]}) + "\n"
            finally:
                store.unwatch(listener)

        return StreamingResponse(stream(), media_type="application/json")

    # -- delete and eviction ---------------------------------------------------------------------

    async def _delete(self, request: Request, rt: ResourceType, namespace: str | None, name: str,
                      dry_run: bool) -> Response:
        options = await _json_body(request) or {}
        if not isinstance(options, dict):
            raise bad_request("the body must be DeleteOptions")
        if "gracePeriodSeconds" in request.query_params:
            options["gracePeriodSeconds"] = request.query_params["gracePeriodSeconds"]
        dry_run = dry_run or options.get("dryRun") == ["All"]
        obj, gone = self.store.delete(rt, namespace, name, options, dry_run=dry_run)
        if gone and (rt.group, rt.plural) != ("", "pods"):  # only pods answer with the deleted object
            details = {"name": name, "group": rt.group, "kind": rt.plural, "uid": obj["metadata"]["uid"]}
            return JSONResponse(status_body(200, "", "", details={k: v for k, v in details.items() if v},
                                            failure=False))
        return JSONResponse(obj)

    async def _evict(self, request: Request, namespace: str, name: str, dry_run: bool) -> Response:
        eviction = await _json_body(request)
        if isinstance(eviction, dict) and (eviction.get("metadata") or {}).get("name") not in (None, name):
            raise bad_request("name in URL does not match name in Eviction object")
        dry_run = dry_run or (isinstance(eviction, dict) and (eviction.get("deleteOptions") or {}).get("dryRun") == ["All"])
        self.store.evict(namespace, name, eviction, dry_run=dry_run)
        return JSONResponse(status_body(201, "", "", failure=False), status_code=201)
