"""Temporal over TLS, mutual TLS and with an API key, for real: the test's Temporal dev server sits
behind a TLS-terminating proxy (asyncio and the ssl module, ALPN h2), with certificates made by
the openssl command. The worker's connect() (which the CLI, the hooks and the worker all use)
dials the proxy with the RECOVERY_TEMPORAL_* settings and runs a workflow; a wrong CA or a
missing client certificate is refused; the API key reaches the server as the `authorization:
Bearer` gRPC metadata, which the proxy reads from the HTTP/2 HEADERS frames the client sent."""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import hpack
import pytest
from temporalio import activity, workflow
from temporalio.worker import Worker

from contracts.settings import load_settings
from worker import connect

RECOVERY = str(Path(sys.executable).parent / "recovery")
SERVER_NAME = "temporal.test"  # the only name in the server's certificate: the client must be told it
API_KEY = "tk-3f1c9e-not-a-real-key"


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _certificate(directory: Path, name: str, issuer: str | None, extensions: str) -> None:
    """`name`.pem and `name`.key: self-signed when there is no issuer, else signed by `issuer`."""
    key, pem, ext = directory / f"{name}.key", directory / f"{name}.pem", directory / f"{name}.ext"
    ext.write_text(extensions + "\n")
    new_key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        key,
        "-subj",
        f"/CN={name}",
    ]
    if issuer is None:
        _openssl(
            "req",
            "-x509",
            *new_key,
            "-out",
            pem,
            "-days",
            "2",
            "-extensions",
            "v3",
            "-config",
            _config_with(directory, ext),
        )
        return
    csr = directory / f"{name}.csr"
    _openssl("req", *new_key, "-out", csr)
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        directory / f"{issuer}.pem",
        "-CAkey",
        directory / f"{issuer}.key",
        "-CAcreateserial",
        "-out",
        pem,
        "-days",
        "2",
        "-extfile",
        ext,
    )


def _config_with(directory: Path, ext: Path) -> Path:
    config = directory / "ca.cnf"
    config.write_text("[req]\ndistinguished_name = dn\n[dn]\n[v3]\n" + ext.read_text())
    return config


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    """A CA, a server certificate for SERVER_NAME, a client certificate, and another CA."""
    directory = tmp_path_factory.mktemp("temporal-tls")
    ca = "basicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign"
    _certificate(directory, "ca", None, ca)
    _certificate(directory, "other-ca", None, ca)
    _certificate(directory, "server", "ca", f"subjectAltName = DNS:{SERVER_NAME}\nextendedKeyUsage = serverAuth")
    _certificate(directory, "client", "ca", "subjectAltName = DNS:recovery-worker\nextendedKeyUsage = clientAuth")
    return directory


class TcpProxy:
    """Relays TCP connections to `upstream`, terminating TLS first when given a context, and keeps
    the bytes each client sent (after TLS), to read what reached the server."""

    def __init__(self, upstream: str, tls: ssl.SSLContext | None):
        self._upstream_host, _, port = upstream.rpartition(":")
        self._upstream_port = int(port)
        self._tls = tls
        self._relays: set[asyncio.Task] = set()
        self.sent: list[bytearray] = []  # per connection, client to server
        self.address = ""

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self._tls)
        self.address = "127.0.0.1:%d" % self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        for relay in self._relays:  # the SDK keeps its connections open: end them here
            relay.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)
        await self._server.wait_closed()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._relays.add(asyncio.current_task())
        sent = bytearray()
        self.sent.append(sent)
        upstream_reader, upstream_writer = await asyncio.open_connection(self._upstream_host, self._upstream_port)
        try:
            await asyncio.gather(
                _pipe(client_reader, upstream_writer, sent),
                _pipe(upstream_reader, client_writer),
                return_exceptions=True,
            )  # a peer that resets ends the relay, nothing more
        finally:
            for writer in (upstream_writer, client_writer):
                writer.close()

    def request_headers(self) -> list[dict[str, str]]:
        return [headers for sent in self.sent for headers in http2_request_headers(bytes(sent))]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: bytearray | None = None) -> None:
    while data := await reader.read(65536):
        if keep is not None:
            keep += data
        writer.write(data)
        await writer.drain()
    writer.close()


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, CONTINUATION = 0x1, 0x9
END_HEADERS, PADDED, PRIORITY = 0x4, 0x8, 0x20


def http2_request_headers(sent: bytes) -> list[dict[str, str]]:
    """The header lists of the requests in what an HTTP/2 client sent (RFC 9113 frames, RFC 7541
    HPACK: every header block in order, as the dynamic table is shared across them)."""
    assert sent.startswith(PREFACE), f"not HTTP/2 in the clear: {sent[:24]!r}"
    decoder, requests, block, at = hpack.Decoder(), [], b"", len(PREFACE)
    while at + 9 <= len(sent):
        length, kind, flags = int.from_bytes(sent[at : at + 3], "big"), sent[at + 3], sent[at + 4]
        payload = sent[at + 9 : at + 9 + length]
        if len(payload) < length:
            break  # a frame still in flight
        at += 9 + length
        if kind == HEADERS:
            padding = payload[0] if flags & PADDED else 0
            start = (1 if flags & PADDED else 0) + (5 if flags & PRIORITY else 0)
            block = payload[start : len(payload) - padding]
        elif kind == CONTINUATION:
            block += payload
        else:
            continue
        if flags & END_HEADERS:
            requests.append(dict(decoder.decode(block)))
            block = b""
    return requests


def _server_context(certificates: Path, *, client_certificate_required: bool) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificates / "server.pem", certificates / "server.key")
    context.set_alpn_protocols(["h2"])  # gRPC's client insists on HTTP/2 by ALPN
    if client_certificate_required:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(certificates / "ca.pem")
    return context


def _dev_server(temporal_env) -> str:
    return temporal_env.client.service_client.config.target_host


@pytest.fixture
async def mtls_proxy(temporal_env, certificates):
    async with TcpProxy(
        _dev_server(temporal_env), _server_context(certificates, client_certificate_required=True)
    ) as proxy:
        yield proxy


@pytest.fixture
async def plain_proxy(temporal_env):
    async with TcpProxy(_dev_server(temporal_env), None) as proxy:
        yield proxy


def _mtls_settings(certificates: Path, **changes) -> dict[str, object]:
    return {
        "temporal_tls_ca": certificates / "ca.pem",
        "temporal_tls_cert": certificates / "client.pem",
        "temporal_tls_key": certificates / "client.key",
        "temporal_tls_server_name": SERVER_NAME,
        **changes,
    }


@activity.defn(name="tls_greeting")
async def tls_greeting(name: str) -> str:
    return f"hello {name}"


@workflow.defn(name="TlsGreeting", sandboxed=False)
class TlsGreeting:
    @workflow.run
    async def run(self, name: str) -> str:
        return await workflow.execute_activity(tls_greeting, name, start_to_close_timeout=timedelta(seconds=30))


async def test_a_worker_and_a_client_run_a_workflow_over_mutual_tls(temporal_env, certificates, mtls_proxy):
    settings = load_settings(
        TEMPORAL_ADDRESS=mtls_proxy.address,
        TEMPORAL_NAMESPACE=temporal_env.client.namespace,
        **_mtls_settings(certificates),
    )
    client = await connect(settings, attempts=1)
    task_queue = f"tls-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=task_queue, workflows=[TlsGreeting], activities=[tls_greeting]):
        result = await client.execute_workflow(
            TlsGreeting.run,
            "gpu-2",
            id=f"tls-{uuid.uuid4().hex}",
            task_queue=task_queue,
            execution_timeout=timedelta(seconds=60),
        )
    assert result == "hello gpu-2"
    paths = {headers[":path"] for headers in mtls_proxy.request_headers()}
    assert {
        "/temporal.api.workflowservice.v1.WorkflowService/PollWorkflowTaskQueue",
        "/temporal.api.workflowservice.v1.WorkflowService/PollActivityTaskQueue",
        "/temporal.api.workflowservice.v1.WorkflowService/StartWorkflowExecution",
    } <= paths


@pytest.mark.parametrize(
    "changes, refusal",
    [
        # The server's certificate is not trusted; 127.0.0.1 is not a name in it; the proxy requires a
        # client certificate (the server just hangs up: the error says none was offered).
        ({"temporal_tls_ca": "other-ca.pem"}, ["CA ", "other-ca.pem, client certificate", "UnknownIssuer"]),
        ({"temporal_tls_server_name": None}, ["InvalidCertificate(NotValidForName"]),
        ({"temporal_tls_cert": None, "temporal_tls_key": None}, [f"ca.pem, server name {SERVER_NAME}): "]),
    ],
)
async def test_a_connection_the_certificates_do_not_allow_is_refused(
    temporal_env, certificates, mtls_proxy, changes, refusal
):
    changes = {name: certificates / value if isinstance(value, str) else value for name, value in changes.items()}
    settings = load_settings(TEMPORAL_ADDRESS=mtls_proxy.address, **_mtls_settings(certificates, **changes))
    with pytest.raises(RuntimeError) as refused:
        await connect(settings, attempts=1)
    assert all(fragment in str(refused.value) for fragment in refusal), refused.value
    assert not mtls_proxy.sent, "refused in the TLS handshake, before the proxy relayed a byte"


def _recovery_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RECOVERY_TEMPORAL_", "TEMPORAL_"))}
    return subprocess.run(
        [RECOVERY, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env={**clean, **env}
    )


async def test_the_cli_connects_over_mutual_tls_and_sends_the_api_key_as_a_bearer_token(
    temporal_env, certificates, mtls_proxy
):
    env = {
        "TEMPORAL_ADDRESS": mtls_proxy.address,
        "TEMPORAL_NAMESPACE": temporal_env.client.namespace,
        "RECOVERY_TEMPORAL_API_KEY": API_KEY,
        **{f"RECOVERY_{name.upper()}": str(value) for name, value in _mtls_settings(certificates).items()},
    }
    listed = await asyncio.to_thread(_recovery_cli, "list", "--limit", "1", "--json", env=env)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    requests = [h for h in mtls_proxy.request_headers() if h[":path"].startswith("/temporal.api.workflowservice.")]
    assert requests and all(h.get("authorization") == f"Bearer {API_KEY}" for h in requests), requests
    shown = await asyncio.to_thread(_recovery_cli, "config", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    assert API_KEY not in shown.stdout and "RECOVERY_TEMPORAL_API_KEY" in shown.stdout


async def test_an_api_key_turns_tls_on_unless_it_is_turned_off(temporal_env, plain_proxy):
    without_tls = load_settings(TEMPORAL_ADDRESS=plain_proxy.address, temporal_api_key=API_KEY, temporal_tls=False)
    await (await connect(without_tls, attempts=1)).count_workflows()
    assert plain_proxy.request_headers()[-1]["authorization"] == f"Bearer {API_KEY}"

    # The key alone: the client opens TLS (a ClientHello, record type 22), which a plain server refuses.
    with pytest.raises(RuntimeError):
        await connect(load_settings(TEMPORAL_ADDRESS=plain_proxy.address, temporal_api_key=API_KEY), attempts=1)
    assert plain_proxy.sent[-1][:2] == b"\x16\x03"
