"""Issue #22, "Safe to switch on": a signed request is valid once, within a window around its
timestamp. Before, the signature covered the body alone: a captured request could be replayed at
any time, forever."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from hooks.app import HookApp, ProblemAnswer
from hooks.auth import NONCE_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, Authenticator, sign, signed_headers
from hooks.intake import Intake
from hooks.problems import Refused
from hooks.settings import HookSettings
from tests.hook_support import RecordingIncidents, gpu_health_event

KEY = "replay-test-key-7b0e"


def hook(**settings) -> tuple[HookApp, RecordingIncidents]:
    config = HookSettings(**{"auth": ["hmac"], "hmac_key": KEY} | settings)
    incidents = RecordingIncidents()
    return HookApp(config, Intake(incidents, config.intake_limits())), incidents


def body(node: str = "gpu-2") -> bytes:
    return json.dumps(gpu_health_event(node, 79, datetime.now(timezone.utc) - timedelta(seconds=5))).encode()


async def post(app: HookApp, content: bytes, headers: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app.asgi()), base_url="http://hook") as c:
        return await c.post(
            "/v1/alerts/gpu-health", content=content, headers={"content-type": "application/json"} | headers
        )


def problem_locs(response: httpx.Response, status: int) -> list[str]:
    assert response.status_code == status, response.text
    return [p.loc for p in ProblemAnswer.model_validate(response.json()).problems]


async def test_a_signed_request_is_accepted_once_and_its_replay_refused():
    app, incidents = hook()
    content = body()
    headers = signed_headers(KEY.encode(), content)
    assert (await post(app, content, headers)).status_code == 200
    replay = await post(app, content, headers)
    assert problem_locs(replay, 401) == [f"headers.{NONCE_HEADER}"]
    assert "replay" in replay.json()["problems"][0]["msg"]
    assert len(incidents.calls) == 1  # the replay reached nothing


async def test_the_old_signature_over_the_body_alone_is_refused():
    app, incidents = hook()
    content = body()
    old = {SIGNATURE_HEADER: "sha256=" + hmac.new(KEY.encode(), content, hashlib.sha256).hexdigest()}
    assert problem_locs(await post(app, content, old), 401) == [f"headers.{TIMESTAMP_HEADER}"]
    fresh = signed_headers(KEY.encode(), content)
    fresh[SIGNATURE_HEADER] = old[SIGNATURE_HEADER]  # the body's old signature with a timestamp and nonce
    assert problem_locs(await post(app, content, fresh), 401) == [f"headers.{SIGNATURE_HEADER}"]
    assert incidents.calls == []


@pytest.mark.parametrize("age, status", [(-299, 200), (299, 200), (-301, 401), (301, 401), (-86400, 401)])
async def test_a_signature_is_valid_only_within_the_window(age, status):
    app, _ = hook(signature_window_seconds=300)
    content = body()
    response = await post(app, content, signed_headers(KEY.encode(), content, now=time.time() + age))
    assert response.status_code == status, response.text
    if status == 401:
        assert problem_locs(response, 401) == [f"headers.{TIMESTAMP_HEADER}"]


@pytest.mark.parametrize(
    "nonce, status",
    [
        ("n" * 15, 401),
        ("n" * 16, 200),
        ("n" * 128, 200),
        ("n" * 129, 401),
        ("has space in it 0123", 401),
        ("ü" * 20, 401),
    ],
)
async def test_the_nonce_is_16_to_128_plain_characters(nonce, status):
    app, _ = hook()
    content, now = body(), int(time.time())
    headers = {
        TIMESTAMP_HEADER: str(now),
        NONCE_HEADER: nonce,
        SIGNATURE_HEADER: sign(KEY.encode(), content, now, nonce),
    }
    response = await post(app, content, {k: v.encode() for k, v in headers.items()})
    assert response.status_code == status, response.text


def test_the_nonce_cache_is_bounded_503_when_full_of_unexpired_nonces_and_frees_as_they_expire():
    clock = [1_000_000.0]
    auth = Authenticator(
        HookSettings(auth=["hmac"], hmac_key=KEY, nonce_cache_size=3, signature_window_seconds=300),
        clock=lambda: clock[0],
    )
    content = b"{}"
    for _ in range(3):
        auth.check(signed_headers(KEY.encode(), content, now=clock[0]), content)
    with pytest.raises(Refused) as full:
        auth.check(signed_headers(KEY.encode(), content, now=clock[0]), content)
    assert full.value.status == 503 and full.value.problems[0]["loc"] == f"headers.{NONCE_HEADER}"
    clock[0] += 301  # the first three have left the window: their nonces are forgotten, room again
    auth.check(signed_headers(KEY.encode(), content, now=clock[0]), content)


async def test_a_full_nonce_cache_answers_503_with_a_json_problem():
    app, incidents = hook(nonce_cache_size=1)
    first, second = body("gpu-2"), body("gpu-3")
    assert (await post(app, first, signed_headers(KEY.encode(), first))).status_code == 200
    assert problem_locs(await post(app, second, signed_headers(KEY.encode(), second)), 503) == [
        f"headers.{NONCE_HEADER}"
    ]
    assert len(incidents.calls) == 1


def test_a_nonce_is_remembered_only_for_a_valid_signature():
    auth = Authenticator(HookSettings(auth=["hmac"], hmac_key=KEY, nonce_cache_size=1))
    content = b"{}"
    for _ in range(5):  # without the key nobody fills the cache
        with pytest.raises(Refused):
            auth.check(signed_headers(b"not the key", content), content)
    auth.check(signed_headers(KEY.encode(), content), content)
