"""Issue #22, "Safe to switch on": bad input is a 4xx with a JSON problem, never a 500, and what
the OpenAPI document says of a field is what the code enforces.

Before: a kernel-log line whose leading time was not a real one (February 30th) crashed the
request (500); a body with a key twice was taken with its last value, the other one unseen by
anything that read the first; the document showed a node name as any string."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, strategies as st

from hooks.app import HookAnswer, ProblemAnswer, openapi_document
from hooks.settings import HookSettings
from tests.hook_support import alertmanager_payload, dcgm_alert, gpu_health_event, kernel_log_post, xid_line
from tests.unit.test_hook_properties import Answer, assert_refused, examples, hook  # noqa: F401


def recent() -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=5)


def answered_well(response: Answer) -> None:
    """A 200 with its answer, or a 4xx naming each problem: never a 5xx."""
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code == 200:
        HookAnswer.model_validate(response.json())
    else:
        assert ProblemAnswer.model_validate(response.json()).problems


@pytest.mark.parametrize(
    "stamp",
    [
        "2026-02-30T00:17:36+00:00",
        "2026-11-30T25:00:00Z",
        "2026-11-30T00:61:00Z",
        "2026-11-30T00:17:36+99:99",
        "0000-01-01T00:00:00Z",
    ],
)
def test_a_kernel_log_line_with_an_impossible_time_is_a_422_naming_the_line(hook, stamp):  # noqa: F811
    hook.fresh()
    line = f"{stamp} gpu-2 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
    body = json.dumps(kernel_log_post("gpu-2", [xid_line(79), line], recent())).encode()
    response = hook.post("kernel-log", body)
    assert_refused(hook, response, "lines[1]")
    assert "not a valid time" in response.json()["problems"][0]["msg"]


# Times in the RFC 3339 shape with any digits: impossible dates, hours, offsets, the ends of the calendar.
rfc3339_shaped = st.from_regex(
    r"\A[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}(:[0-9]{2}([.,][0-9]{1,12})?)?"
    r"(Z|z|[+-][0-9]{2}:?[0-9]{2})?\Z"
)
edge_times = st.sampled_from(
    [
        "9999-12-31T23:59:59-23:59",
        "0001-01-01T00:00:00+23:59",
        "9999-12-31T23:59:59Z",
        "0001-01-01T00:00:00Z",
        "2026-02-29T00:00:00Z",
        "2024-02-29T00:00:00Z",
    ]
)
times = rfc3339_shaped | edge_times
numbers = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=False), st.just(10**400))


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    source = draw(st.sampled_from(["alertmanager", "gpu-health", "kernel-log"]))
    when = draw(times)
    if source == "alertmanager":
        alert = dcgm_alert("gpu-2", 79, recent())
        alert[draw(st.sampled_from(["startsAt", "endsAt"]))] = when
        payload = alertmanager_payload([alert])
        payload[draw(st.sampled_from(["truncatedAlerts", "version"]))] = draw(numbers)
    elif source == "gpu-health":
        payload = gpu_health_event("gpu-2", 79, recent())
        payload["observed_at"] = when
        payload[draw(st.sampled_from(["xid", "gpu_index"]))] = draw(numbers)
    else:
        payload = kernel_log_post("gpu-2", [f"{when} gpu-2 kernel: " + xid_line(draw(st.integers(0, 10**6)))])
        payload["observed_at"] = draw(st.none() | times)
    text = json.dumps(payload)
    return source, text.replace("1e+400", "1" + "0" * 400).encode()


@examples(1500)
@given(bodies())
def test_fuzzed_times_and_numbers_in_every_source_never_give_a_500(hook, case):  # noqa: F811
    hook.fresh()
    answered_well(hook.post(*case))


@pytest.mark.parametrize(
    "source, body",
    [
        (
            "gpu-health",
            '{"node": "gpu-2", "node": "gpu-7", "xid": 79, "gpu_index": 0, '
            '"observed_at": "%s", "source": "dcgm-health"}',
        ),
        ("kernel-log", '{"node": "gpu-2", "lines": ["not a line"], "lines": ["%s"]}'),
        ("alertmanager", None),
    ],
)
def test_a_key_twice_in_an_object_is_refused_400(hook, source, body):  # noqa: F811
    # Each body is valid with its last value of the key, which is what a lenient parser would take.
    hook.fresh()
    if source == "alertmanager":
        text = json.dumps(alertmanager_payload([dcgm_alert("gpu-2", 79, recent())]))
        text = text.replace('"labels": {', '"labels": {"xid": "48", ', 1)  # nested: the alert's labels
    elif source == "gpu-health":
        text = body % recent().isoformat()
    else:
        text = body % xid_line(79)
    response = hook.post(source, text.encode())
    assert_refused(hook, response, "body")
    assert response.status_code == 400 and "twice" in response.json()["problems"][0]["msg"]


# --- the OpenAPI document says what is enforced --------------------------------------------------


def field_schema(document: dict, model: str, field: str) -> dict:
    schema = document["components"]["schemas"][model]["properties"][field]
    options = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    return options[0]


def schema_accepts(schema: dict, value: object) -> bool:
    """The few JSON Schema keywords these checks use (no validator library is a dependency)."""
    if schema.get("type") == "string":
        return (
            isinstance(value, str)
            and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1e9)
            and ("pattern" not in schema or re.search(schema["pattern"], value) is not None)
        )
    if schema.get("type") == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", -1e99) <= value <= schema.get("maximum", 1e99)
        )
    raise AssertionError(f"no check for {schema}")


DOCUMENT = openapi_document(HookSettings(token="t"))
AGREEMENT = [  # (model, field, source, how to put the value in a valid body)
    ("GpuHealthEvent", "node", "gpu-health", lambda v: gpu_health_event("gpu-2", 79, recent()) | {"node": v}),
    ("KernelLogPost", "node", "kernel-log", lambda v: kernel_log_post("gpu-2", [xid_line(79)], recent()) | {"node": v}),
    ("GpuHealthEvent", "xid", "gpu-health", lambda v: gpu_health_event("gpu-2", 79, recent()) | {"xid": v}),
    ("GpuHealthEvent", "gpu_index", "gpu-health", lambda v: gpu_health_event("gpu-2", 79, recent()) | {"gpu_index": v}),
    ("GpuHealthEvent", "source", "gpu-health", lambda v: gpu_health_event("gpu-2", 79, recent()) | {"source": v}),
]
NODE_LIKE = st.text(alphabet="abz09.-_ [],", max_size=70) | st.sampled_from(["", "g" * 63, "g" * 64, "-gpu", "9"])


@pytest.mark.parametrize("model, field, source, put", AGREEMENT, ids=[f"{m}.{f}" for m, f, *_ in AGREEMENT])
@examples(300)
@given(data=st.data())
def test_the_openapi_document_and_the_code_agree_on_each_fields_rule(hook, model, field, source, put, data):  # noqa: F811
    schema = field_schema(DOCUMENT, model, field)
    value = data.draw(st.integers(-5, 1005) if schema["type"] == "integer" else NODE_LIKE)
    hook.fresh()
    response = hook.post(source, json.dumps(put(value)).encode())
    assert schema_accepts(schema, value) == (response.status_code == 200), (value, schema, response.text)


def test_the_document_carries_the_node_name_rule():
    for model in ("GpuHealthEvent", "KernelLogPost"):
        assert {"minLength": 1, "maxLength": 63}.items() <= field_schema(DOCUMENT, model, "node").items()
