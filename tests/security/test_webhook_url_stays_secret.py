"""No part of a webhook URL that may be a secret reaches a log, a Temporal history or `recovery
config` (issue #22, "Safe to switch on"): not its user info, not a Slack-style secret path, not a
?token= query. Only scheme://host:port and a fingerprint of the whole URL are shown.

Before: httpx logged the full URL of every delivery at INFO, the delivery's result (in the
history) and its errors kept the URL's path, and `recovery config` printed the path and query.
A real NotificationWorkflow on the time-skipping server posts to a real HTTP server; the worker's
own logging setup; `recovery config` in a process of its own.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import worker
from activities.notify import NotifyActivities
from contracts.budget import Notification, NotificationKind
from contracts.redaction import fingerprint
from contracts.settings import load_settings
from workflows.notify import NotificationWorkflow

ROOT = Path(__file__).resolve().parents[2]
SECRET_PARTS = (
    "hook-user-7f3a",
    "hook-password-7f3a",
    "T0SECRET7F3A",
    "xoxb-path-secret-7f3a",
    "query-token-7f3a",
    "hmac-secret-7f3a",
)
NOTIFICATION = Notification(
    kind=NotificationKind.RECOVERED,
    incident_id="gpu-2-20261201T000000Z",
    node="gpu-2",
    at=datetime(2026, 12, 1, tzinfo=timezone.utc),
    summary="recovered",
)


class _Answer(BaseHTTPRequestHandler):
    status = 204

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:  # the server's own log is not the worker's
        pass


@pytest.fixture
def webhook_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def worker_logging(caplog) -> Iterator[pytest.LogCaptureFixture]:
    """The worker's logging setup, everything captured down to DEBUG."""
    before = {name: logging.getLogger(name).level for name in worker.QUIET_LOGGERS}
    worker.configure_logging()
    caplog.set_level(logging.DEBUG)
    yield caplog
    for name, level in before.items():
        logging.getLogger(name).setLevel(level)


def secret_url(port: int) -> str:
    return (
        f"http://hook-user-7f3a:hook-password-7f3a@127.0.0.1:{port}"
        "/services/T0SECRET7F3A/xoxb-path-secret-7f3a?token=query-token-7f3a"
    )


def assert_no_secret(text: str) -> None:
    leaked = [part for part in SECRET_PARTS if part in text]
    assert not leaked, f"{leaked} in {text[:2000]}"


async def test_a_delivery_leaves_no_secret_in_the_logs_or_the_history(time_skipping_env, webhook_port, worker_logging):
    url = secret_url(webhook_port)
    settings = load_settings(notify_webhook_url=url, notify_hmac_secret="hmac-secret-7f3a")
    client, task_queue = time_skipping_env.client, f"notify-{uuid.uuid4()}"
    deliver = NotifyActivities(settings.webhook_target()).deliver_notification
    async with worker.build_worker(client, task_queue, [deliver]):
        handle = await client.start_workflow(
            NotificationWorkflow.run, NOTIFICATION, id=f"notify-{uuid.uuid4()}", task_queue=task_queue
        )
        result = await handle.result()
        history = (await handle.fetch_history()).to_json()
    assert result.delivered and result.status_code == 204
    assert result.detail == f"http://127.0.0.1:{webhook_port} ({fingerprint(url)}) answered 204"
    assert_no_secret(history)
    assert_no_secret(worker_logging.text)
    assert not [r for r in worker_logging.records if r.name.startswith(worker.QUIET_LOGGERS)]


@pytest.mark.parametrize("status", [503, 404])
async def test_a_failed_delivery_says_no_secret(webhook_port, worker_logging, monkeypatch, status):
    monkeypatch.setattr(_Answer, "status", status)
    url = secret_url(webhook_port)
    deliver = NotifyActivities(load_settings(notify_webhook_url=url).webhook_target()).deliver_notification
    with pytest.raises(ApplicationError) as failed:
        await ActivityEnvironment().run(deliver, NOTIFICATION)
    assert failed.value.message.startswith(f"http://127.0.0.1:{webhook_port} ({fingerprint(url)})")
    assert_no_secret(str(failed.value))
    assert_no_secret(worker_logging.text)


def test_recovery_config_shows_where_the_webhook_is_and_its_fingerprint(tmp_path):
    url = secret_url(8443)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECOVERY_")}
    env |= {
        "PYTHONPATH": str(ROOT),
        "RECOVERY_NOTIFY_WEBHOOK_URL": url,
        "RECOVERY_NOTIFY_HMAC_SECRET": "hmac-secret-7f3a",
        "COLUMNS": "250",
    }  # the table's value column unwrapped
    for argv in (["config"], ["config", "--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "cli.app", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert_no_secret(done.stdout + done.stderr)
        assert f"http://127.0.0.1:8443 ({fingerprint(url)})" in done.stdout
