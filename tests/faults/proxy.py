"""A fault-injecting HTTP reverse proxy, put between the worker's SlurmRest client and the real
slurmrestd of the local stack.

    proxy = await FaultProxy(cluster["SLURMRESTD_URL"]).start()
    proxy.inject("GET", r"/jobs$", status=500, times=2)        # the next two answers are a 500
    proxy.inject("POST", r"/node/[^/]+$", drop=True, after_forward=True)  # done, the answer lost
    proxy.inject("GET", r"/job/\\d+$", delay=12)                # held beyond the client's time-out
    proxy.inject("GET", r"/jobs$", status=503, times=None)     # every answer, for good
    ...                                                        # point SLURMRESTD_URL at proxy.url
    proxy.seen                                                 # every request, and the fault it met
    await proxy.stop()

A rule matches a request by method and a regex searched in its path (query left out); the first
rule with faults left applies. Faults: `status` (an answer with that status and a slurmrestd-
style error body), `delay` (the request is held that long before it is forwarded), `drop` (the
connection is closed without an answer). With `after_forward` the request reaches slurmrestd
first, so its effect happens and only the answer is replaced or lost. Requests no rule matches
pass through unchanged. HTTP/1.1 with keep-alive and Content-Length bodies, as httpx sends them.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from http import HTTPStatus

import httpx

# Hop-by-hop headers, and the ones the proxy sets itself.
_NOT_FORWARDED = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int | None = None
    delay: float = 0.0
    drop: bool = False
    times: int | None = 1  # None: every matching request, for good
    after_forward: bool = False
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        left = self.times is None or self.hits < self.times
        return left and method == self.method and self.path.search(path) is not None

    def describe(self) -> str:
        what = "drop" if self.drop else f"status {self.status}" if self.status else f"delay {self.delay:g}s"
        return what + (" after forwarding" if self.after_forward else "")


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    fault: str | None  # Fault.describe() of the fault it met, None when passed through


@dataclass
class FaultProxy:
    upstream: str
    faults: list[Fault] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    def __post_init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._http: httpx.AsyncClient | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> FaultProxy:
        self._http = httpx.AsyncClient(base_url=self.upstream.rstrip("/"), timeout=60)
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def inject(
        self,
        method: str,
        path_regex: str,
        *,
        status: int | None = None,
        delay: float = 0.0,
        drop: bool = False,
        times: int | None = 1,
        after_forward: bool = False,
    ) -> Fault:
        if sum((status is not None, delay > 0, drop)) != 1:
            raise ValueError("a fault is one of status, delay or drop")
        fault = Fault(method.upper(), re.compile(path_regex), status, delay, drop, times, after_forward)
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """No more faults: every request passes through from now on."""
        self.faults.clear()

    def requests(self, method: str, path_regex: str) -> list[Seen]:
        pattern = re.compile(path_regex)
        return [s for s in self.seen if s.method == method and pattern.search(s.path)]

    # --- serving -------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            while await self._one_request(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away (say, after its own time-out)
        except asyncio.CancelledError:
            pass  # stop(): asyncio's server would report a cancelled connection task as an error
        finally:
            self._connections.discard(task)
            writer.close()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answers one request (or drops the connection); False when the connection is over."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, target, _ = request_line.split(" ", 2)
        headers = [tuple(part.strip() for part in line.split(":", 1)) for line in header_lines if line]
        length = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
        body = await reader.readexactly(length) if length else b""
        path = target.split("?", 1)[0]
        fault = next((f for f in self.faults if f.matches(method, path)), None)
        self.seen.append(Seen(method, path, fault.describe() if fault else None))
        if fault is None:
            await self._respond(writer, await self._forward(method, target, headers, body))
            return True
        fault.hits += 1
        if fault.delay:
            await asyncio.sleep(fault.delay)
        if fault.after_forward or fault.delay:
            forwarded = await self._forward(method, target, headers, body)
            if fault.delay:
                await self._respond(writer, forwarded)
                return True
        if fault.drop:
            writer.transport.abort()
            return False
        error = {
            "error": f"injected by the test: {fault.describe()}",
            "error_number": 9000,
            "source": "tests/faults/proxy.py",
            "description": HTTPStatus(fault.status).phrase,
        }
        answer = httpx.Response(fault.status, json={"errors": [error], "warnings": []})
        await self._respond(writer, answer)
        return True

    async def _forward(self, method: str, target: str, headers: list[tuple[str, ...]], body: bytes) -> httpx.Response:
        kept = [(k, v) for k, v in headers if k.lower() not in _NOT_FORWARDED]
        return await self._http.request(method, target, headers=kept, content=body)

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, response: httpx.Response) -> None:
        content = response.content
        lines = [f"HTTP/1.1 {response.status_code} {response.reason_phrase or 'Status'}"]
        lines += [f"{k}: {v}" for k, v in response.headers.items() if k.lower() not in _NOT_FORWARDED]
        lines += [f"Content-Length: {len(content)}", "", ""]
        writer.write("\r\n".join(lines).encode("latin-1") + content)
        await writer.drain()
