"""Issue #22, "Safe to switch on": `recovery hooks` as a server facing a hostile network, tested
with raw sockets against the real process (on the session's Temporal dev server).

Before: uvicorn buffered a request head of any size (a 20 MiB header was 20 MiB of the hook's
memory), let a connection that never finished its headers stay open for good, took any number of
connections, and served plain HTTP only."""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from bench.services import free_port, process
from hooks.settings import HookSettings

TOKEN = "server-test-token-c4e1"
MiB = 1 << 20


@contextmanager
def hook(temporal_env, log: Path, **settings: str) -> Iterator[tuple[int, int]]:
    """`recovery hooks` from this checkout with these RECOVERY_HOOKS_* settings; yields (pid, port)."""
    port = free_port()
    env = (
        {k: v for k, v in os.environ.items() if not k.startswith("RECOVERY_HOOKS_")}
        | {
            "TEMPORAL_ADDRESS": temporal_env.client.service_client.config.target_host,
            "RECOVERY_HOOKS_PORT": str(port),
            "RECOVERY_HOOKS_TOKEN": TOKEN,
        }
        | {f"RECOVERY_HOOKS_{k.upper()}": v for k, v in settings.items()}
    )
    with process([sys.executable, "-m", "cli.app", "hooks"], env, log) as proc:
        deadline = time.monotonic() + 60
        while not healthy(port, settings.get("tls_cert_file")):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield proc.pid, port


def healthy(port: int, ca_file: str | None) -> bool:
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        with httpx.Client(verify=context or True) as http:
            return http.get(f"{'https' if ca_file else 'http'}://127.0.0.1:{port}/healthz").status_code == 200
    except httpx.TransportError:
        return False


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def whole_response(sock: socket.socket) -> tuple[int, bytes]:
    """The status and body of one response, read to its Content-Length (a recv can end anywhere)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < content_length(data):
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def response_of(sock: socket.socket) -> tuple[int, dict]:
    status, body = whole_response(sock)
    return status, json.loads(body) if body else {}


def content_length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def send_huge_header(port: int, size: int) -> tuple[int | None, int]:
    """Send one header of `size` bytes in 64 KiB writes until the hook answers or hangs up;
    (status answered or None, bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/alerts/gpu-health HTTP/1.1\r\nhost: hook\r\nx-padding: ")
        chunk = b"a" * 65536
        try:
            while sent < size:
                sock.sendall(chunk)
                sent += len(chunk)
                if select.select([sock], [], [], 0)[0]:
                    return response_of(sock)[0], sent
            sock.sendall(b"\r\n\r\n")
            return response_of(sock)[0], sent
        except (BrokenPipeError, ConnectionResetError):
            return None, sent


@pytest.fixture(scope="module")
def hook_process(temporal_env, tmp_path_factory):
    with hook(temporal_env, tmp_path_factory.mktemp("hook") / "hooks.log", max_connections="400") as running:
        yield running


async def test_a_20_mib_header_is_refused_431_without_growing_the_hooks_memory(hook_process):
    pid, port = hook_process
    before = rss_bytes(pid)
    status, sent = send_huge_header(port, 20 * MiB)
    after = rss_bytes(pid)
    print(
        f"\n20 MiB header: answered {status} after {sent / 1024:.0f} KiB sent; "
        f"RSS {before / MiB:.1f} -> {after / MiB:.1f} MiB"
    )
    assert status == 431
    # Answered before the header ended (how much the client wrote by then is the sockets' buffers: 0.5-3 MiB).
    assert sent < 20 * MiB
    assert after - before < 4 * MiB


@pytest.mark.parametrize("size, status", [(15 * 1024, 401), (17 * 1024, 431), (200 * 1024, 431)])
async def test_the_request_head_limit_is_16_kib_however_it_arrives(hook_process, size, status):
    _, port = hook_process
    head = b"POST /v1/alerts/gpu-health HTTP/1.1\r\nhost: hook\r\ncontent-length: 2\r\nx-padding: "
    request = head + b"a" * (size - len(head) - 10) + b"\r\n\r\n{}"  # all in one write: one read for the hook
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer, problem = response_of(sock)
    assert answer == status, problem
    if status == 431:
        assert problem["problems"][0]["loc"] == "headers"


async def test_connections_that_never_finish_their_headers_are_closed_after_10_s(hook_process):
    pid, port = hook_process
    assert HookSettings(token=TOKEN).header_timeout_seconds == 10
    fds_before = open_fds(pid)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
    for sock in idle[:100]:  # half send half a request head, half nothing at all
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: hook\r\n")
    opened = time.monotonic()
    try:
        time.sleep(1)
        held_at_1s, fds_at_1s = still_open(idle), open_fds(pid)
        time.sleep(max(0.0, opened + 8 - time.monotonic()))
        held_at_8s = still_open(idle)
        time.sleep(max(0.0, opened + 12 - time.monotonic()))
        held_at_12s, fds_at_12s = still_open(idle), open_fds(pid)
    finally:
        for sock in idle:
            sock.close()
    print(
        f"\n200 idle connections: held {held_at_1s} at 1 s, {held_at_8s} at 8 s, {held_at_12s} at 12 s; "
        f"hook's open fds {fds_before} -> {fds_at_1s} -> {fds_at_12s}"
    )
    assert (held_at_1s, held_at_8s, held_at_12s) == (200, 200, 0)
    assert fds_at_12s <= fds_before + 2


def still_open(sockets: list[socket.socket]) -> int:
    """How many the hook has not closed: nothing to read yet, and no end of stream."""
    readable = select.select(sockets, [], [], 0)[0]
    closed = 0
    for sock in readable:
        try:
            closed += sock.recv(1, socket.MSG_PEEK) == b""
        except ConnectionResetError:
            closed += 1
    return len(sockets) - closed


async def test_connections_beyond_the_cap_are_answered_503_and_closed_and_a_kept_alive_request_has_the_deadline(
    temporal_env, tmp_path
):
    with hook(temporal_env, tmp_path / "hooks.log", max_connections="20", header_timeout_seconds="2") as (_, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as kept_alive:
            kept_alive.sendall(b"GET /healthz HTTP/1.1\r\nhost: hook\r\n\r\n")
            # the whole response (one recv can end mid-body: the rest then read as an answer to what follows)
            assert whole_response(kept_alive) == (200, b"ok\n")
            kept_alive.sendall(b"GET /healthz HTTP/1.1\r\nhost: hook\r\n")  # the next request, half its head
            started = time.monotonic()
            assert kept_alive.recv(1) == b""  # closed by the header deadline (uvicorn's keep-alive timer is off now)
            assert 1.5 < time.monotonic() - started < 4
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        try:
            time.sleep(0.5)  # all accepted
            with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
                status, problem = response_of(extra)
                assert status == 503 and problem["problems"][0]["loc"] == "connection"
                assert extra.recv(1) == b""  # and closed
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.5)
        assert healthy(port, None)  # room again


async def test_tls_serves_https_with_the_configured_certificate(temporal_env, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=hook",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    with hook(temporal_env, tmp_path / "hooks.log", tls_cert_file=str(cert), tls_key_file=str(key)) as (_, port):
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as https:
            response = https.post(
                f"https://127.0.0.1:{port}/v1/alerts/gpu-health",
                content=b"{}",
                headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
            )
        assert response.status_code == 422, response.text  # through TLS to the hook's validation
        with pytest.raises(httpx.TransportError), httpx.Client() as plain:
            plain.get(f"http://127.0.0.1:{port}/healthz")
    assert "https://" in (tmp_path / "hooks.log").read_text()


@pytest.mark.parametrize(
    "tls, words",
    [
        ({"tls_cert_file": __file__}, "needs both"),
        ({"tls_cert_file": "/nonexistent.pem", "tls_key_file": __file__}, "file"),
    ],
)
def test_a_tls_configuration_that_cannot_work_is_refused_at_start(tls, words):
    with pytest.raises(ValidationError) as refused:
        HookSettings(token=TOKEN, **tls)
    assert words in str(refused.value)
