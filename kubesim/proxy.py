"""A recording, fault-injecting proxy in front of a Kubernetes API server: what lets the tests that
read the request log or inject faults run against a real cluster too (RECOVERY_TEST_KUBECONFIG).

    proxy = KubeApiProxy("/path/to/kubeconfig").start()   # the cluster that kubeconfig names
    proxy.url, proxy.token, proxy.ca_file, proxy.kubeconfig(path)   # as KubeApiServer's (front.py)
    proxy.requests, proxy.writes(), proxy.fail_next, proxy.faults   # the same test hooks
    proxy.compact()     # from now on a watch from a resourceVersion handed out before gets 410
    proxy.stop()        # ends the open watches, as a stopping apiserver does

Clients talk HTTPS to the proxy with its own token; the proxy sends each request on, unchanged but
for the credentials, with the upstream's (token, client certificate, CA: whatever the kubeconfig
holds, an exec plugin's token included, taken once at start). Answers come back unchanged; watches
are streamed as they arrive.

compact() stands in for etcd's compaction, which no client can trigger: the proxy remembers the
resourceVersions it passes on after the call (of lists, objects and watch events), and answers a
watch from any other, older one the way the apiserver does, a 200 stream with one ERROR event
holding a 410 Expired Status. An upstream that has compacted for real answers that itself.
"""

from __future__ import annotations

import asyncio
import json
import ssl

import httpx
from kubernetes import client, config
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .front import ApiFront
from .store import ApiError

# Headers that describe the request or answer itself (not the connection, nor the credentials).
REQUEST_HEADERS = ("content-type", "accept", "user-agent")
ANSWER_HEADERS = ("content-type", "warning", "retry-after", "audit-id")
WATCHING = ("true", "True", "1")


def _upstream_client(kubeconfig: str) -> httpx.AsyncClient:
    """An httpx client with the credentials `kubeconfig` names, read as the official client reads it."""
    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    verify: ssl.SSLContext | bool = False
    if configuration.verify_ssl:
        verify = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
        if configuration.cert_file:
            verify.load_cert_chain(configuration.cert_file, configuration.key_file)
    headers = {"Accept-Encoding": "identity"}  # answers are passed on as they are
    for auth in configuration.auth_settings().values():  # the token, as the official client sends it
        headers[auth["key"]] = auth["value"]
    # No read time-out: a watch ends when its timeoutSeconds says; the client's own time-outs apply.
    return httpx.AsyncClient(
        base_url=configuration.host.rstrip("/"),
        verify=verify,
        headers=headers,
        timeout=httpx.Timeout(None, connect=10.0),
    )


class KubeApiProxy(ApiFront):
    def __init__(self, upstream_kubeconfig: str, *, tls: bool = True, token: str | None = "test-token"):
        super().__init__(tls=tls, token=token)
        self._upstream_kubeconfig = upstream_kubeconfig
        self._upstream: httpx.AsyncClient | None = None  # made in the server's loop, on its first request
        self._since_compaction: set[str] | None = None  # None until compact()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None  # set by stop(): the open watches end

    def register_crd(self, *args, **kwargs) -> None:
        """A real cluster serves the custom resources installed in it (the NodeSet CRD comes with
        Slinky's slurm-operator chart)."""

    def compact(self) -> None:
        self._since_compaction = set()

    def _end_streams(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    def _remember(self, obj: object) -> None:
        if self._since_compaction is not None and isinstance(obj, dict):
            if version := (obj.get("metadata") or {}).get("resourceVersion"):
                self._since_compaction.add(version)

    def _expired(self, request: Request) -> bool:
        version = request.query_params.get("resourceVersion")
        return (
            request.query_params.get("watch") in WATCHING
            and version not in (None, "", "0")
            and self._since_compaction is not None
            and version not in self._since_compaction
        )

    async def _serve(self, request: Request) -> Response:
        if self._upstream is None:
            self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
            self._upstream = _upstream_client(self._upstream_kubeconfig)
        if self._expired(request):
            error = ApiError(410, "Expired", f"too old resource version: {request.query_params['resourceVersion']}")
            return Response(
                json.dumps({"type": "ERROR", "object": error.status()}) + "\n", media_type="application/json"
            )
        headers = {k: v for k, v in request.headers.items() if k in REQUEST_HEADERS}
        outgoing = self._upstream.build_request(
            request.method, request.url.path, params=request.url.query, headers=headers, content=await request.body()
        )
        watching = request.query_params.get("watch") in WATCHING
        try:
            answer = await self._upstream.send(outgoing, stream=watching)
        except httpx.HTTPError as e:  # the whole answer but a watch's is read here: a cut one too
            raise ApiError(503, "ServiceUnavailable", f"the proxy's upstream: {type(e).__name__}: {e}") from e
        passed = {k: v for k, v in answer.headers.items() if k in ANSWER_HEADERS}
        if not watching:
            body = answer.content
            if self._since_compaction is not None and answer.is_success:
                self._remember_answer(body)
            return Response(body, status_code=answer.status_code, headers=passed)
        return StreamingResponse(self._relay(answer), status_code=answer.status_code, headers=passed)

    def _remember_answer(self, body: bytes) -> None:
        try:
            document = json.loads(body)
        except ValueError:
            return
        if isinstance(document, dict):
            self._remember(document)
            for item in document.get("items") or ():
                self._remember(item)

    async def _relay(self, answer: httpx.Response):
        """The watch's events as they come, until the upstream ends it or stop(); after a compact(),
        each event's resourceVersion is remembered."""
        chunks, pending = answer.aiter_raw(), b""
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while True:
                following = asyncio.ensure_future(anext(chunks))
                await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    following.cancel()
                    return
                try:
                    chunk = following.result()
                except (StopAsyncIteration, httpx.HTTPError, httpx.StreamError):
                    return  # the upstream ended the watch: so does the client's
                yield chunk
                if self._since_compaction is not None:
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in filter(None, lines):
                        try:
                            self._remember(json.loads(line).get("object"))
                        except (ValueError, AttributeError):
                            pass
        finally:
            stopping.cancel()
            await answer.aclose()
