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
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from . import schemas
from .front import ApiFront
from .resources import ResourceType, custom_type
from .selectors import SelectorError, fields_match, labels_match, parse_fields, parse_labels
from .store import ApiError, Event, Matcher, Store, apply_patch, bad_request, status_body, watch_view

VERSION = {
    "major": "1",
    "minor": "34",
    "gitVersion": "v1.34.0+kubeapi-test",
    "gitCommit": "",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "",
    "compiler": "",
    "platform": "linux/amd64",
}
# A real apiserver ends a watch after a random 30-60 min when the client names no timeout.
DEFAULT_WATCH_SECONDS = 1800


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


class KubeApiServer(ApiFront):
    """See the module docstring; HTTPS, the token, the request log and the faults are ApiFront's."""

    def __init__(self, *, tls: bool = True, token: str | None = "test-token", add_not_ready_taint: bool = False):
        super().__init__(tls=tls, token=token)
        self.store = Store(add_not_ready_taint=add_not_ready_taint)

    def _end_streams(self) -> None:
        self.store.close_watches()

    # -- test hooks ------------------------------------------------------------------------------

    def register_crd(
        self,
        group: str,
        version: str,
        plural: str,
        kind: str,
        *,
        namespaced: bool = True,
        scale: tuple[str, str] | None = (".spec.replicas", ".status.replicas"),
        crd: str | None = None,
    ) -> None:
        """A custom resource type; with `crd` (a file in kubesim/crds/), its schema for this
        version defaults and validates every write, as a real API server's does."""
        self.store.register(custom_type(group, version, plural, kind, namespaced=namespaced, scale=scale, crd=crd))

    def compact(self) -> None:
        self.store.compact()

    def finish_terminating_pods(self, node: str | None = None) -> int:
        return self.store.finish_terminating_pods(node)

    # -- the API ---------------------------------------------------------------------------------

    async def _serve(self, request: Request) -> Response:
        parts = [p for p in request.url.path.split("/") if p]
        method, query = request.method, request.query_params
        if method == "GET" and (document := self._discovery(parts)) is not None:
            return JSONResponse(document)
        rt, namespace, name, sub = self._resolve(parts)
        dry_run = query.get("dryRun") == "All"
        store = self.store
        if name is None:
            if method == "GET":
                return (
                    self._watch(rt, namespace, query)
                    if query.get("watch") in ("true", "True", "1")
                    else self._list(rt, namespace, query)
                )
            if method == "POST" and (namespace or not rt.namespaced):
                return JSONResponse(store.create(rt, namespace, await _json_body(request), dry_run=dry_run), 201)
        elif sub is None or (sub == "status" and rt.status):
            if method == "GET":
                return JSONResponse(store.get(rt, namespace, name))
            if method == "PUT":
                return JSONResponse(
                    store.replace(rt, namespace, name, await _json_body(request), subresource=sub, dry_run=dry_run)
                )
            if method == "PATCH":
                return JSONResponse(
                    store.patch(
                        rt,
                        namespace,
                        name,
                        self._content_type(request),
                        await _json_body(request),
                        subresource=sub,
                        dry_run=dry_run,
                    )
                )
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
                return JSONResponse(
                    store.write_scale(
                        rt,
                        namespace,
                        name,
                        lambda scale: apply_patch(rt, name, content_type, scale, body),
                        dry_run=dry_run,
                    )
                )
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
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.url.split("//")[1]}],
            }
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
            resources = [
                entry for rt in types if (rt.group, rt.version) == (group, version) for entry in rt.discovery()
            ]
            if resources:
                return {
                    "kind": "APIResourceList",
                    "apiVersion": "v1",
                    "groupVersion": f"{group}/{version}" if group else version,
                    "resources": resources,
                }
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
        return JSONResponse(
            {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version,
                "metadata": {"resourceVersion": rv},
                "items": items,
            }
        )

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

    async def _delete(
        self, request: Request, rt: ResourceType, namespace: str | None, name: str, dry_run: bool
    ) -> Response:
        options = await _json_body(request) or {}
        if not isinstance(options, dict):
            raise bad_request("the body must be DeleteOptions")
        if "gracePeriodSeconds" in request.query_params:
            options["gracePeriodSeconds"] = request.query_params["gracePeriodSeconds"]
        dry_run = dry_run or options.get("dryRun") == ["All"]
        obj, gone = self.store.delete(rt, namespace, name, options, dry_run=dry_run)
        if gone and (rt.group, rt.plural) != ("", "pods"):  # only pods answer with the deleted object
            details = {"name": name, "group": rt.group, "kind": rt.plural, "uid": obj["metadata"]["uid"]}
            return JSONResponse(
                status_body(200, "", "", details={k: v for k, v in details.items() if v}, failure=False)
            )
        return JSONResponse(obj)

    async def _evict(self, request: Request, namespace: str, name: str, dry_run: bool) -> Response:
        eviction = await _json_body(request)
        if isinstance(eviction, dict) and (eviction.get("metadata") or {}).get("name") not in (None, name):
            raise bad_request("name in URL does not match name in Eviction object")
        dry_run = dry_run or (
            isinstance(eviction, dict) and (eviction.get("deleteOptions") or {}).get("dryRun") == ["All"]
        )
        if self.store.builtin_schemas is not None and isinstance(eviction, dict):
            # the server takes the type from the URL when the body leaves it out (clients often do)
            typed = {"apiVersion": "policy/v1", "kind": "Eviction", **eviction}
            if found := schemas.builtin_problems(self.store.builtin_schemas, typed):
                raise ApiError(422, "Invalid", f'Eviction "{name}" is invalid: {", ".join(found)}', name=name)
        self.store.evict(namespace, name, eviction, dry_run=dry_run)
        return JSONResponse(status_body(201, "", "", failure=False), status_code=201)
