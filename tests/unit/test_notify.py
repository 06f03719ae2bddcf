"""Webhook delivery (activities/notify.py): what is sent, which answers are retried and which are
final, and that no secret reaches an error message."""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime, timezone

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.notify import NotifyActivities
from contracts.budget import Notification, NotificationKind, WebhookTarget

NOTIFICATION = Notification(
    kind=NotificationKind.RECOVERED,
    incident_id="gpu-2-20261201T000000Z",
    node="gpu-2",
    at=datetime(2026, 12, 1, tzinfo=timezone.utc),
    summary="recovered",
    details={"jobs": "42"},
)
URL = "https://hooks.example.net:8443/recovery?token=query-token"
URL_WITH_PASSWORD = "https://user:url-password@hooks.example.net:8443/recovery?token=query-token"


def shown(url: str) -> str:
    """Where it goes and a fingerprint of the whole URL (contracts/redaction.py)."""
    return f"https://hooks.example.net:8443 (sha256:{hashlib.sha256(url.encode()).hexdigest()[:12]})"


def target(url: str = URL, **fields) -> WebhookTarget:
    if "@" not in url:
        fields.setdefault("bearer_token", "bearer-token")
    return WebhookTarget(url=url, hmac_secret="hmac-secret", **fields)


async def deliver(webhook: WebhookTarget | None, answer) -> tuple:
    requests: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        return answer(request)

    notifier = NotifyActivities(webhook, transport=httpx.MockTransport(handler))
    return await ActivityEnvironment().run(notifier.deliver_notification, NOTIFICATION), requests


async def test_a_delivery_is_one_signed_json_post():
    result, [request] = await deliver(target(), lambda _: httpx.Response(204))
    assert result.delivered and result.status_code == 204
    assert request.method == "POST" and str(request.url) == URL
    assert Notification.model_validate_json(request.content) == NOTIFICATION
    headers = request.headers
    assert headers["content-type"] == "application/json"
    assert headers["idempotency-key"] == "gpu-2-20261201T000000Z/recovered"
    assert headers["x-recovery-event"] == "recovered"
    assert headers["authorization"] == "Bearer bearer-token"
    signed = headers["x-recovery-timestamp"].encode() + b"." + request.content
    assert headers["x-recovery-signature"] == "sha256=" + hmac.new(b"hmac-secret", signed, hashlib.sha256).hexdigest()
    assert result.detail == f"{shown(URL)} answered 204"


def test_a_bearer_token_and_a_password_in_the_url_are_refused_together():
    with pytest.raises(ValueError, match="a bearer token or user info in its URL, not both"):
        WebhookTarget(url=URL_WITH_PASSWORD, bearer_token="bearer-token")


async def test_without_secrets_no_signature_and_no_authorization():
    _, [request] = await deliver(WebhookTarget(url="http://127.0.0.1:9/hook"), lambda _: httpx.Response(200))
    assert not {"authorization", "x-recovery-signature", "x-recovery-timestamp"} & set(request.headers)


async def test_no_webhook_configured_is_not_a_failure():
    result, requests = await deliver(None, lambda _: httpx.Response(200))
    assert (result.delivered, result.detail, requests) == (False, "no webhook configured", [])


@pytest.mark.parametrize("status", [500, 502, 503, 408, 425, 429])
async def test_server_errors_and_throttling_are_retried(status):
    with pytest.raises(ApplicationError) as failed:
        await deliver(target(URL_WITH_PASSWORD), lambda _: httpx.Response(status))
    assert failed.value.type == "WebhookUnavailable" and not failed.value.non_retryable
    assert failed.value.message == f"{shown(URL_WITH_PASSWORD)} answered {status}"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
async def test_a_refusal_is_final(status):
    with pytest.raises(ApplicationError) as failed:
        await deliver(target(), lambda _: httpx.Response(status))
    assert failed.value.type == "WebhookRejected" and failed.value.non_retryable


async def test_a_network_error_is_retried_and_says_nothing_secret():
    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot connect to {request.url}", request=request)

    with pytest.raises(ApplicationError) as failed:
        await deliver(target(URL_WITH_PASSWORD), unreachable)
    error = failed.value
    assert error.type == "WebhookUnavailable" and not error.non_retryable
    assert error.message == f"ConnectError reaching {shown(URL_WITH_PASSWORD)}"
    assert error.__cause__ is None and error.__suppress_context__  # httpx's message (with the URL) is dropped


def test_secrets_stay_out_of_the_settings_repr():
    shown = repr(target())
    assert "bearer-token" not in shown and "hmac-secret" not in shown
