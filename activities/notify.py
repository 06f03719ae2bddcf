"""Deliver a notification to the configured webhook (RECOVERY_NOTIFY_WEBHOOK_URL).

One POST of the Notification as JSON. A 2xx answer is a delivery; a 408, 425, 429, 5xx answer or
a network error is retried by Temporal (NotificationWorkflow's retry policy); any other answer is
final (the receiver refuses this payload; sending it again will not change that).

Each attempt carries the same Idempotency-Key, so a receiver can drop a retried delivery; with
a secret, an HMAC-SHA256 signature of "<timestamp>.<body>" (X-Recovery-Signature: sha256=<hex>);
with a token, Authorization: Bearer. Secrets never appear in errors, results or logs, and
neither does the URL beyond its scheme, host and port (user info, path and query often hold a
token): it is shown with a fingerprint (contracts/redaction.py), and the worker keeps httpx,
which logs every URL, at WARNING.
"""

from __future__ import annotations

import hashlib
import hmac
import time

import httpx
from pydantic import SecretStr
from temporalio import activity
from temporalio.exceptions import ApplicationError

from contracts.budget import DeliveryResult, Notification, WebhookTarget

RETRIED_STATUSES = frozenset({408, 425, 429})


def signature(secret: SecretStr, timestamp: str, body: bytes) -> str:
    digest = hmac.new(secret.get_secret_value().encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"sha256={digest.hexdigest()}"


def request_headers(target: WebhookTarget, notification: Notification, body: bytes, timestamp: str) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "training-recovery",
        "Idempotency-Key": notification.delivery_id,
        "X-Recovery-Event": notification.kind.value,
    }
    if target.hmac_secret is not None:
        headers["X-Recovery-Timestamp"] = timestamp
        headers["X-Recovery-Signature"] = signature(target.hmac_secret, timestamp, body)
    if target.bearer_token is not None:
        headers["Authorization"] = f"Bearer {target.bearer_token.get_secret_value()}"
    return headers


class NotifyActivities:
    def __init__(self, target: WebhookTarget | None, transport: httpx.AsyncBaseTransport | None = None):
        self._target = target
        self._transport = transport

    @activity.defn
    async def deliver_notification(self, notification: Notification) -> DeliveryResult:
        attempt = activity.info().attempt
        target = self._target
        if target is None:
            return DeliveryResult(delivered=False, attempt=attempt, detail="no webhook configured")
        body = notification.model_dump_json().encode()
        headers = request_headers(target, notification, body, str(int(time.time())))
        try:
            # A client per delivery: notifications are a few per incident, and nothing is left to close.
            async with httpx.AsyncClient(timeout=target.timeout_seconds, transport=self._transport) as http:
                response = await http.post(target.url, content=body, headers=headers)
        except httpx.HTTPError as err:
            # `from None`: httpx's own message and traceback may carry the full URL.
            raise ApplicationError(
                f"{type(err).__name__} reaching {target.redacted_url}", type="WebhookUnavailable"
            ) from None
        code = response.status_code
        if response.is_success:
            return DeliveryResult(
                delivered=True, status_code=code, attempt=attempt, detail=f"{target.redacted_url} answered {code}"
            )
        if code in RETRIED_STATUSES or code >= 500:
            raise ApplicationError(f"{target.redacted_url} answered {code}", type="WebhookUnavailable")
        raise ApplicationError(
            f"{target.redacted_url} refused the notification: {code}", type="WebhookRejected", non_retryable=True
        )
