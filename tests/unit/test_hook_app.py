"""The hook's HTTP interface in process (ASGI), with a recording stand-in for Temporal."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from pydantic import ValidationError

from hooks.app import HookAnswer, HookApp, ProblemAnswer
from hooks.auth import SIGNATURE_HEADER, signed_headers
from hooks.intake import Intake
from hooks.settings import HookSettings
from tests.hook_support import (
    RecordingIncidents,
    alertmanager_payload,
    dcgm_alert,
    gpu_health_event,
    gpu_uuid,
    kernel_log_post,
    xid_line,
)

TOKEN = "tok-3f1d9a7c55e2b8"
HMAC_KEY = "hmac-key-a81c0d2e9f"
RECENT = datetime.now(timezone.utc) - timedelta(seconds=5)


def hook_app(**settings) -> tuple[HookApp, RecordingIncidents]:
    incidents = RecordingIncidents()
    # The payloads are built when the module is collected; in the whole suite these tests run a
    # quarter of an hour later, so the staleness limit is a day here (its own tests set theirs).
    config = HookSettings(
        **{"token": TOKEN, "hmac_key": HMAC_KEY, "auth": ["bearer", "hmac"], "max_alert_age_seconds": 86400} | settings
    )
    return HookApp(config, Intake(incidents, config.intake_limits())), incidents


def client(app: HookApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app.asgi()), base_url="http://hook")


BEARER = {"authorization": f"Bearer {TOKEN}"}


async def post(app: HookApp, path: str, payload, headers=BEARER) -> httpx.Response:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    async with client(app) as c:
        return await c.post(path, content=body, headers={"content-type": "application/json"} | headers)


def refused(response: httpx.Response, status: int) -> list[dict]:
    assert response.status_code == status, response.text
    return ProblemAnswer.model_validate(response.json()).model_dump()["problems"]


@pytest.mark.parametrize(
    "path, payload, n",
    [
        (
            "/v1/alerts/alertmanager",
            alertmanager_payload([dcgm_alert("gpu-2", 79, RECENT, gpu=g) for g in range(3)]),
            3,
        ),
        ("/v1/alerts/kernel-log", kernel_log_post("gpu-2", [xid_line(79), xid_line(79, pid=7)]), 2),
        ("/v1/alerts/gpu-health", gpu_health_event("gpu-2", 79, RECENT), 1),
    ],
)
async def test_each_source_hands_its_alerts_to_the_nodes_incident(path, payload, n):
    app, incidents = hook_app()
    response = await post(app, path, payload)
    assert response.status_code == 200, response.text
    answer = HookAnswer.model_validate(response.json())
    assert answer.accepted == n and len(answer.alerts) == n
    assert {(a.node, a.xid, a.incident) for a in answer.alerts} == {("gpu-2", 79, "node-recovery-gpu-2")}
    assert [len(runs) for runs in incidents.runs.values()] == [1]
    assert len(incidents.handed_over) == n


async def test_a_resolved_alert_starts_nothing():
    app, incidents = hook_app()
    response = await post(
        app, "/v1/alerts/alertmanager", alertmanager_payload([dcgm_alert("gpu-2", 79, RECENT, status="resolved")])
    )
    answer = HookAnswer.model_validate(response.json())
    assert (answer.dropped, answer.alerts[0].reason.split(":")[0]) == (1, "resolved")
    assert incidents.calls == []


# --- authentication ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers, loc",
    [
        ({}, "headers"),
        ({"authorization": "Bearer not-the-token"}, "headers.authorization"),
        ({"authorization": f"Basic {TOKEN}"}, "headers.authorization"),
        (
            signed_headers(HMAC_KEY.encode(), b"{}") | {SIGNATURE_HEADER: "sha256=" + "0" * 64},
            f"headers.{SIGNATURE_HEADER}",
        ),
        (signed_headers(b"other key", b"{}"), f"headers.{SIGNATURE_HEADER}"),
    ],
)
async def test_without_valid_credentials_401_and_nothing_happens(headers, loc):
    app, incidents = hook_app()
    response = await post(app, "/v1/alerts/gpu-health", gpu_health_event("gpu-2", 79, RECENT), headers)
    assert [p["loc"] for p in refused(response, 401)] == [loc]
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert incidents.calls == []


async def test_hmac_signature_over_the_body_is_accepted():
    app, incidents = hook_app()
    body = json.dumps(gpu_health_event("gpu-2", 79, RECENT)).encode()
    response = await post(app, "/v1/alerts/gpu-health", body, signed_headers(HMAC_KEY.encode(), body))
    assert response.status_code == 200
    tampered = body.replace(b"79", b"48")
    response = await post(app, "/v1/alerts/gpu-health", tampered, signed_headers(HMAC_KEY.encode(), body))
    assert response.status_code == 401
    assert len(incidents.handed_over) == 1


async def test_only_the_configured_schemes_are_accepted():
    app, _ = hook_app(auth=["hmac"])
    response = await post(app, "/v1/alerts/gpu-health", gpu_health_event("gpu-2", 79, RECENT))
    assert refused(response, 401)[0]["msg"] == "these credentials are for a scheme this hook does not accept"
    assert "www-authenticate" not in response.headers


async def test_secrets_never_appear_in_logs_or_answers(caplog):
    caplog.set_level(logging.DEBUG)
    app, _ = hook_app()
    texts = []
    for headers in (BEARER, {"authorization": f"Bearer {TOKEN}x"}, {SIGNATURE_HEADER: "sha256=00"}):
        for payload in (gpu_health_event("gpu-2", 79, RECENT), {"node": "bad node"}):
            texts.append((await post(app, "/v1/alerts/gpu-health", payload, headers)).text)
    async with client(app) as c:
        texts += [(await c.get(p)).text for p in ("/metrics", "/openapi.json")]
    texts += [caplog.text, repr(app.settings), str(app.settings.model_dump())]
    for text in texts:
        assert TOKEN not in text and HMAC_KEY not in text


@pytest.mark.parametrize(
    "env, words",
    [
        ({"RECOVERY_HOOKS_AUTH": "bearer"}, "RECOVERY_HOOKS_TOKEN"),
        ({"RECOVERY_HOOKS_AUTH": "hmac", "RECOVERY_HOOKS_TOKEN": "t"}, "RECOVERY_HOOKS_HMAC_KEY"),
        ({"RECOVERY_HOOKS_AUTH": "basic", "RECOVERY_HOOKS_TOKEN": "t"}, "bearer"),
        ({"RECOVERY_HOOKS_TOKEN": "t", "RECOVERY_HOOKS_SECONDARY_XIDS": "45,1000"}, "secondary_xids"),
    ],
)
def test_settings_refuse_what_cannot_work(monkeypatch, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as e:
        HookSettings()
    assert words in str(e.value)


def test_token_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.setenv("RECOVERY_HOOKS_TOKEN_FILE", str(tmp_path / "token"))
    assert HookSettings().token.get_secret_value() == TOKEN


# --- bad input -----------------------------------------------------------------------------------


async def test_a_body_over_the_limit_is_refused_declared_or_streamed():
    app, incidents = hook_app(max_body_bytes=1000)
    payload = json.dumps(kernel_log_post("gpu-2", [xid_line(79)] * 20)).encode()
    assert [p["loc"] for p in refused(await post(app, "/v1/alerts/kernel-log", payload), 413)] == ["body"]

    async def chunked():  # no Content-Length: counted while it is read
        for i in range(0, len(payload), 100):
            yield payload[i : i + 100]

    async with client(app) as c:
        response = await c.post(
            "/v1/alerts/kernel-log", content=chunked(), headers=BEARER | {"content-type": "application/json"}
        )
    assert "content-length" not in response.request.headers
    refused(response, 413)
    assert incidents.calls == []


async def test_too_many_alerts_in_one_request_are_refused():
    app, incidents = hook_app(max_alerts_per_request=3)
    problems = refused(await post(app, "/v1/alerts/kernel-log", kernel_log_post("gpu-2", [xid_line(79)] * 4)), 422)
    assert problems[0]["msg"] == "4 alerts; at most 3 per request"
    assert incidents.calls == []


@pytest.mark.parametrize(
    "body, headers, status, loc",
    [
        (b"{not json", {}, 400, "body"),
        (b"", {}, 400, "body"),
        (json.dumps({"node": "gpu-2"}).encode(), {"content-type": "text/plain"}, 415, "headers.content-type"),
        (json.dumps({"node": "gpu-[1-2]", "lines": [xid_line(79)]}).encode(), {}, 422, "node"),
        (
            json.dumps({"node": "gpu-2", "lines": ["hello", "NVRM: GPU Board Serial Number: 1"]}).encode(),
            {},
            422,
            "lines[1]",
        ),
    ],
)
async def test_bad_input_is_a_4xx_naming_the_problem_and_nothing_is_handed_over(body, headers, status, loc):
    app, incidents = hook_app()
    response = await post(app, "/v1/alerts/kernel-log", body, BEARER | headers)
    assert loc in [p["loc"] for p in refused(response, status)]
    assert incidents.calls == []


async def test_unknown_paths_and_methods_answer_in_the_same_shape():
    app, _ = hook_app()
    async with client(app) as c:
        assert refused(await c.get("/v1/alerts/gpu-health"), 405)[0]["loc"] == "path"
        assert refused(await c.post("/v1/alerts/nagios", content=b"{}"), 404)[0]["loc"] == "path"


async def test_when_temporal_is_unavailable_503_and_the_retry_is_accepted():
    app, incidents = hook_app()
    incidents.fail_with = RuntimeError("connection refused")
    payload = gpu_health_event("gpu-2", 79, RECENT)
    problems = refused(await post(app, "/v1/alerts/gpu-health", payload), 503)
    assert problems[0]["loc"] == "temporal" and "retry" in problems[0]["msg"]
    incidents.fail_with = None
    response = await post(app, "/v1/alerts/gpu-health", payload)
    assert HookAnswer.model_validate(response.json()).accepted == 1


async def test_a_kernel_log_batch_with_other_lines_hands_over_its_xid_and_names_the_rest():
    app, incidents = hook_app()
    lines = [
        f"{RECENT.isoformat()} gpu-2 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python, "
        "GPU has fallen off the bus.",
        f"{RECENT.isoformat()} gpu-2 kernel: NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
        f"{RECENT.isoformat()} gpu-2 kernel: NVRM: Xid (PCI:0000:01:00): 154 (",
    ]
    for _ in range(2):  # the second time from the parsed-bodies cache: the same answer
        response = await post(app, "/v1/alerts/kernel-log", kernel_log_post("gpu-2", lines))
        assert response.status_code == 200, response.text
        answer = HookAnswer.model_validate(response.json())
        assert [a.xid for a in answer.alerts] == [79, 154]
        assert [(i.index, "not an NVRM Xid line" in i.reason) for i in answer.ignored] == [(1, True)]
    assert [a.xid for a in incidents.handed_over] == [79, 154]


async def test_an_answer_with_nothing_ignored_has_no_ignored_field():
    app, _ = hook_app()
    response = await post(app, "/v1/alerts/kernel-log", kernel_log_post("gpu-2", [xid_line(79)], RECENT))
    assert "ignored" not in response.json()


# --- documents -----------------------------------------------------------------------------------


async def test_openapi_document_describes_every_endpoint_and_answer():
    app, _ = hook_app()
    async with client(app) as c:
        doc = (await c.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {
        "/v1/alerts/alertmanager",
        "/v1/alerts/gpu-health",
        "/v1/alerts/kernel-log",
        "/healthz",
        "/metrics",
    }
    schemas = doc["components"]["schemas"]
    for path in ("/v1/alerts/alertmanager", "/v1/alerts/gpu-health", "/v1/alerts/kernel-log"):
        op = doc["paths"][path]["post"]
        assert op["security"] == [{"bearer": []}, {"hmac": []}]
        body_ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert body_ref.rsplit("/", 1)[1] in schemas
        assert {"200", "400", "401", "413", "415", "422", "503"} <= set(op["responses"])
    assert set(schemas["AlertmanagerWebhook"]["required"]) >= {"version", "alerts", "status"}
    assert schemas["GpuHealthEvent"]["additionalProperties"] is False
    assert schemas["HookAnswer"]["properties"]["ignored"]["items"]["$ref"].endswith("/IgnoredAnswer")
    assert set(schemas["IgnoredAnswer"]["properties"]) == {"index", "reason"}
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "hmac"}


async def test_metrics_count_requests_and_outcomes():
    app, _ = hook_app()
    await post(app, "/v1/alerts/gpu-health", gpu_health_event("gpu-2", 79, RECENT))
    await post(app, "/v1/alerts/gpu-health", gpu_health_event("gpu-2", 79, RECENT))
    await post(app, "/v1/alerts/gpu-health", {})
    async with client(app) as c:
        text = (await c.get("/metrics")).text
    assert 'recovery_hook_requests_total{endpoint="gpu-health",status="200"} 2' in text
    assert 'recovery_hook_requests_total{endpoint="gpu-health",status="422"} 1' in text
    assert 'recovery_hook_alerts_total{outcome="duplicate"} 1' in text
    assert 'recovery_hook_temporal_calls_total{call="join_or_open"} 1' in text


# --- the alert's GPU -----------------------------------------------------------------------------


async def test_the_gpu_each_source_names_reaches_the_incident():
    app, incidents = hook_app()
    alert = dcgm_alert("gpu-2", 13, RECENT, gpu=3)
    alert["labels"]["pci_bus_id"] = "00000000:3B:00.0"
    line = f"{RECENT.isoformat()} gpu-7 kernel: NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=python, GPU fault"
    for path, payload in [
        ("/v1/alerts/alertmanager", alertmanager_payload([alert])),
        ("/v1/alerts/kernel-log", kernel_log_post("gpu-7", [line])),
        ("/v1/alerts/gpu-health", gpu_health_event("gpu-9", 79, RECENT, gpu=5)),
    ]:
        assert (await post(app, path, payload)).status_code == 200
    by_node = {a.node: a for a in incidents.handed_over}
    assert (by_node["gpu-2"].gpu_index, by_node["gpu-2"].gpu_uuid, by_node["gpu-2"].pci_address) == (
        3,
        gpu_uuid("gpu-2", 3),
        "0000:3b:00.0",
    )
    assert by_node["gpu-2"].gpu == gpu_uuid("gpu-2", 3)
    assert (by_node["gpu-7"].gpu, by_node["gpu-7"].pci_address, by_node["gpu-7"].gpu_index) == (
        "0000:01:00.0",
        "0000:01:00.0",
        None,
    )
    assert (by_node["gpu-9"].gpu, by_node["gpu-9"].gpu_index) == (gpu_uuid("gpu-9", 5), 5)


async def test_gpu_labels_of_another_shape_name_no_gpu_and_keep_the_alert():
    app, incidents = hook_app()
    alert = dcgm_alert("gpu-2", 13, RECENT)
    alert["labels"] |= {"gpu": "nvidia0", "UUID": "not-a-uuid", "pci_bus_id": "slot 3"}
    assert (await post(app, "/v1/alerts/alertmanager", alertmanager_payload([alert]))).status_code == 200
    handed = incidents.handed_over[0]
    assert (handed.gpu, handed.gpu_index, handed.gpu_uuid, handed.pci_address) == (None, None, None, None)
