"""The local stack's slurmrestd JWT is short-lived, private and renewed, and the worker's REST
client takes a renewed token without a restart (issue #22, "Safe to switch on").

Before: deploy/local/slurm-cluster.sh issued root a 30-day token, wrote it into env.sh (mode
0644, under /tmp) and never renewed it; the worker read SLURMRESTD_TOKEN once, at start.
The client against a real HTTP server; the token on the real local cluster, newest generation only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from backends.slurm import SlurmRest, SlurmUnavailable, TokenFile
from contracts.settings import ConfigError, load_settings
from drills.localstack import DEBIAN_RELEASE_OF_GENERATION, SLURM_SCRIPT, LocalStack

NEWEST_GENERATION = max(DEBIAN_RELEASE_OF_GENERATION, key=lambda g: [int(x) for x in g.split(".")])


class _RecordsTokens(BaseHTTPRequestHandler):
    """A slurmrestd that serves v0.0.42's ping, and records the token of every request."""

    tokens: list[str] = []

    def do_GET(self) -> None:
        self.tokens.append(self.headers["X-SLURM-USER-TOKEN"])
        answer = {"paths": {"/slurm/v0.0.42/ping": {}}} if self.path == "/openapi/v3" else {"pings": [{"pinged": "UP"}]}
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def slurmrestd_url() -> Iterator[str]:
    _RecordsTokens.tokens = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RecordsTokens)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def replace(path: Path, content: str) -> None:
    """As a renewer does: a new file renamed over the old one."""
    fresh = path.with_suffix(".new")
    fresh.write_text(content)
    fresh.rename(path)


async def test_a_rotated_token_file_is_used_without_a_restart(slurmrestd_url, tmp_path):
    token_file = tmp_path / "slurmrestd.jwt"
    token_file.write_text("first-token\n")
    rest = SlurmRest(slurmrestd_url, "root", TokenFile(token_file))
    try:
        await rest.discover()  # two requests: the OpenAPI document, a ping
        replace(token_file, "SLURM_JWT=second-token\n")  # `scontrol token` output as it is
        await rest.discover()
        token_file.unlink()  # a token that cannot be read is an outage of slurmrestd, not a crash
        with pytest.raises(SlurmUnavailable, match="cannot read the slurmrestd token file"):
            await rest.discover()
    finally:
        await rest.aclose()
    assert _RecordsTokens.tokens == ["first-token", "first-token", "second-token", "second-token"]


def test_the_token_file_is_checked_at_start(tmp_path):
    empty = tmp_path / "empty.jwt"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="SLURMRESTD_TOKEN_FILE: .*is empty"):
        load_settings(SLURMRESTD_TOKEN_FILE=empty)
    with pytest.raises(ConfigError, match="SLURMRESTD_TOKEN_FILE: .*cannot read"):
        load_settings(SLURMRESTD_TOKEN_FILE=tmp_path / "missing.jwt")
    empty.write_text("a-token")
    with pytest.raises(ConfigError, match="SLURMRESTD_TOKEN or SLURMRESTD_TOKEN_FILE, not both"):
        load_settings(SLURMRESTD_TOKEN_FILE=empty, SLURMRESTD_TOKEN="b-token")


# --- the real local cluster ------------------------------------------------------------------


def claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


@pytest.fixture
def newest_cluster(local_stack: LocalStack, slurm_cluster: dict[str, str]) -> dict[str, str]:
    if local_stack.slurm_generation != NEWEST_GENERATION:
        pytest.skip(f"the token's life is the script's, the same on every generation: run on {NEWEST_GENERATION}")
    return slurm_cluster


def script(local_stack: LocalStack, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SLURM_SCRIPT), *argv],
        env={**local_stack.slurm_env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


@pytest.mark.slurm
async def test_the_local_token_is_private_short_lived_and_renewed(local_stack, newest_cluster):
    token_file = Path(newest_cluster["SLURMRESTD_TOKEN_FILE"])
    assert "SLURMRESTD_TOKEN=" not in (local_stack.slurm_base / "env.sh").read_text()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    issued = claims(token_file.read_text().strip())
    assert time.time() < issued["exp"] <= time.time() + 3600 + 5
    renewer = int((local_stack.slurm_base / "run" / "token-renewer.pid").read_text())
    os.kill(renewer, 0)  # started with the cluster

    rest = SlurmRest(newest_cluster["SLURMRESTD_URL"], "root", TokenFile(token_file))
    try:
        await rest.discover()
        # A renewer at half a 4 s lifespan: the file is replaced within 2 s, and again.
        quick = subprocess.Popen(
            ["bash", str(SLURM_SCRIPT), "renew-tokens"],
            start_new_session=True,
            env={**local_stack.slurm_env(), "SLURM_TOKEN_LIFESPAN": "4"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            seen = {token_file.stat().st_ino}
            deadline = time.monotonic() + 8
            while len(seen) < 3 and time.monotonic() < deadline:
                seen.add(token_file.stat().st_ino)
                await asyncio.sleep(0.1)
            assert len(seen) >= 3, "the renewer did not replace the token twice in 8 s"
        finally:
            os.killpg(quick.pid, signal.SIGTERM)
            quick.wait(10)
        renewed = claims(token_file.read_text().strip())
        assert renewed["exp"] - renewed["iat"] == 4 and stat.S_IMODE(token_file.stat().st_mode) == 0o600
        await rest.get_node("gpu-1")  # the same client, the renewed token
        await asyncio.sleep(max(0.0, renewed["exp"] + 1 - time.time()))  # the token in the file has expired
        script(local_stack, "token")  # `token` renews at once (and leaves the session a 1-hour token)
        await rest.get_node("gpu-1")
    finally:
        await rest.aclose()
    assert claims(token_file.read_text().strip())["exp"] <= time.time() + 3600 + 5
