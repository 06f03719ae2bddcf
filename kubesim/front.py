"""What the in-repo API server and the recording proxy share: HTTPS with a self-signed
certificate, a bearer token, the request log, injected faults, and a uvicorn server in a thread
of its own (see server.py and proxy.py for what each serves behind it)."""

from __future__ import annotations

import asyncio
import functools
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
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .store import ApiError

WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")


@functools.cache
def _certificate() -> tuple[bytes, bytes]:
    """The PEM certificate and key of a self-signed certificate for IP 127.0.0.1 (its own CA),
    made once per process; each server writes them into a directory of its own."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError(
            "the Kubernetes test server needs the openssl command for its TLS certificate "
            "(Debian: apt-get install openssl)"
        )
    with tempfile.TemporaryDirectory(prefix="kubeapi-tls-") as directory:
        cert, key = os.path.join(directory, "ca.crt"), os.path.join(directory, "tls.key")
        subprocess.run(
            [
                openssl,
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                key,
                "-out",
                cert,
                "-days",
                "30",
                "-subj",
                "/CN=kubeapi-test",
                "-addext",
                "subjectAltName=IP:127.0.0.1,DNS:localhost",
            ],
            check=True,
            capture_output=True,
        )
        return Path(cert).read_bytes(), Path(key).read_bytes()


def _error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.status(), status_code=error.code)


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

    def inject(
        self,
        method: str,
        target_regex: str,
        *,
        status: int | None = None,
        reason: str = "",
        delay: float = 0.0,
        drop: bool = False,
        times: int | None = 1,
    ) -> Fault:
        if sum((status is not None, delay > 0, drop)) != 1:
            raise ValueError("a fault is one of status, delay or drop")
        fault = Fault(
            method.upper(),
            re.compile(target_regex),
            status,
            reason or (HTTPStatus(status).phrase.replace(" ", "") if status else ""),
            delay,
            drop,
            times,
        )
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
                if (
                    method == fault.method
                    and (fault.times is None or fault.hits < fault.times)
                    and fault.target.search(target)
                ):
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


class ApiFront:
    """HTTPS, the bearer token, the request log and the faults; a subclass answers what passes
    them (`_serve`) and ends its open streams when stopping (`_end_streams`). start() serves in a
    background thread with its own event loop, so synchronous clients, other threads and async
    code can all use it over TCP."""

    def __init__(self, *, tls: bool = True, token: str | None = "test-token"):
        self.tls = tls
        self.token = token
        self.requests: list[tuple[str, str]] = []
        self.fail_next: list[tuple[int, str]] = []
        self.faults = Faults()
        self.url = ""
        self.ca_file = ""
        self._server: _Uvicorn | None = None
        self._thread: threading.Thread | None = None
        self._tls_dir: str | None = None  # ca_file and the key, removed by stop()

    async def _serve(self, request: Request) -> Response:
        raise NotImplementedError

    def _end_streams(self) -> None:
        """Called from the stopping thread: end the open watches, so that their clients see the end."""

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self):
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
        config = uvicorn.Config(
            self._with_faults,
            interface="asgi3",
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            **tls,
        )
        self._server = _Uvicorn(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"kubeapi-{port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{type(self).__name__} did not start")
            time.sleep(0.01)
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._end_streams()
        self._server.stop_soon()
        self._thread.join(10)
        self._server = self._thread = None
        if self._tls_dir:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
            self._tls_dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what tests read -------------------------------------------------------------------------

    def kubeconfig(self, path) -> str:
        cluster = {"server": self.url}
        if self.tls:
            cluster["certificate-authority"] = self.ca_file
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "kubeapi-test",
            "clusters": [{"name": "kubeapi-test", "cluster": cluster}],
            "users": [{"name": "kubeapi-test", "user": {"token": self.token} if self.token else {}}],
            "contexts": [{"name": "kubeapi-test", "context": {"cluster": "kubeapi-test", "user": "kubeapi-test"}}],
        }
        Path(path).write_text(yaml.safe_dump(config))
        return str(path)

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
            return await self._serve(request)
        except ApiError as e:
            return _error(e)
