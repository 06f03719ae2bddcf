"""uvicorn's httptools protocol with the limits a server facing a hostile network needs and
uvicorn does not have: a bound on the request head, a deadline for it, and a cap on connections.

Without them, a sender could make the hook buffer a header without end (httptools keeps a header
value until it ends: 20 MiB of one header were 20 MiB of the hook's memory), or hold connections
open with half a request, each one a file descriptor and a buffer, until the hook ran out of either.
"""

from __future__ import annotations

import asyncio
import http
import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from hooks.problems import Refused, problem

# How long a refused connection is still read (and what comes discarded) after its answer: closed
# at once with the sender's bytes unread, the kernel answers them with a reset, which can reach the
# sender before the answer does (seen under load: a 20 MiB header's sender got no 431).
LINGER_SECONDS = 2.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int  # the request line and headers together
    header_timeout: float  # seconds from the connection (or the request's first byte) to its last header
    max_connections: int


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits: ConnectionLimits  # set by guarded_protocol

    _header_timer: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _awaiting_headers = True
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # Refused at once: waiting for its request would hold the connection it should free.
            self._refuse(
                Refused(
                    503,
                    "unavailable",
                    [
                        problem(
                            "connection",
                            f"the hook holds {self.limits.max_connections} connections already; retry later",
                        )
                    ],
                )
            )
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._awaiting_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # Checked after every read: the parser never holds more than one read past the limit.
        if self._awaiting_headers and not self._refused and self._header_bytes > self.limits.max_header_bytes:
            self._refuse_large_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a later request on a kept-alive connection
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._awaiting_headers = False
        self._disarm_header_timer()
        # The whole head may have come in one read: measure what the parser kept.
        head = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if head > self.limits.max_header_bytes:
            self._refuse_large_headers()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:  # the rest of a refused request's last read
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()
            self._awaiting_headers, self._header_bytes = True, 0  # the next request's head is counted anew

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        self._refused = True
        self.transport.close()

    def _refuse_large_headers(self) -> None:
        self._refuse(
            Refused(
                431,
                "request header fields too large",
                [
                    problem(
                        "headers", f"the request line and headers are larger than {self.limits.max_header_bytes} bytes"
                    )
                ],
            ),
            linger=True,
        )

    def _refuse(self, refused: Refused, linger: bool = False) -> None:
        """Answer with the refusal's JSON problem and close: nothing more of this connection is
        parsed. `linger`: a sender still sending hears the answer first (see LINGER_SECONDS)."""
        self._refused = True
        self._disarm_header_timer()
        body = json.dumps(refused.body(), separators=(",", ":")).encode()
        head = (
            f"HTTP/1.1 {refused.status} {http.HTTPStatus(refused.status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})
