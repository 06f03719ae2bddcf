"""Property-based: over 10,000 generated bad payloads, each is a 4xx whose JSON body names the
problem, and nothing is handed over; generated good payloads are handed over exactly.

Hypothesis is derandomized (same examples every run) and runs the ASGI app in process against a
recording stand-in for Temporal, so "nothing handed over" means no call at all reached it.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hooks.app import HookAnswer, HookApp, ProblemAnswer
from hooks.intake import Intake
from hooks.settings import HookSettings
from hooks.sources.kernel_log import parse_line
from tests.hook_support import (
    RecordingIncidents,
    alertmanager_payload,
    dcgm_alert,
    gpu_health_event,
    kernel_log_post,
    xid_line,
)

TOKEN = "property-token"
PATHS = {
    "alertmanager": "/v1/alerts/alertmanager",
    "gpu-health": "/v1/alerts/gpu-health",
    "kernel-log": "/v1/alerts/kernel-log",
}
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def examples(n: int):
    return settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


class Harness:
    """The app on an event loop of its own (hypothesis drives plain functions)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.settings = HookSettings(token=TOKEN, max_alerts_per_request=50)
        self.fresh()

    def fresh(self) -> None:
        """A new app and stand-in for Temporal: nothing remembered from earlier examples."""
        self.incidents = RecordingIncidents()
        self.app = HookApp(self.settings, Intake(self.incidents, self.settings.intake_limits())).asgi()

    def post(self, source: str, body: bytes) -> Answer:
        """One request straight through the ASGI interface (an HTTP client would cost 10 times more
        per example; test_hook_app.py goes through httpx)."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": PATHS[source],
            "raw_path": PATHS[source].encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"authorization", f"Bearer {TOKEN}".encode()),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            "client": ("127.0.0.1", 40000),
            "server": ("127.0.0.1", 8910),
        }
        sent = []

        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        self.loop.run_until_complete(self.app(scope, receive, send))
        return Answer(sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:])))

    def close(self) -> None:
        self.loop.close()


@dataclass
class Answer:
    status_code: int
    body: dict

    def json(self) -> dict:
        return self.body

    @property
    def text(self) -> str:
        return json.dumps(self.body)


@pytest.fixture(scope="module")
def hook():
    harness = Harness()
    yield harness
    harness.close()


def assert_refused(hook: Harness, response: Answer, expected_loc: str | None = None) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    answer = ProblemAnswer.model_validate(response.json())
    assert answer.problems and all(p.loc and p.msg for p in answer.problems)
    if expected_loc is not None:
        assert any(p.loc.startswith(expected_loc) for p in answer.problems), (expected_loc, answer.problems)
    assert hook.incidents.calls == []


# --- strategies ----------------------------------------------------------------------------------

ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
node_names = st.builds(str.__add__, st.sampled_from(ALNUM), st.text(alphabet=ALNUM + "._-", max_size=62))
bad_node_names = st.one_of(
    st.sampled_from(["gpu-[1-4]", "gpu-1,gpu-2", "-gpu", "gpu 2", "gpu=2", "", "g" * 64, "gpu\n2", "gpu;rm"]),
    st.text(max_size=70).filter(lambda s: not NODE_RE.fullmatch(s)),
)
xids = st.integers(1, 999)
bad_xid_values = st.one_of(
    st.integers(max_value=0),
    st.integers(min_value=1000),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)
recent = st.integers(0, 600).map(lambda s: datetime.now(timezone.utc) - timedelta(seconds=s))
bad_times = st.one_of(
    st.sampled_from(["2026-11-30T00:17:36", "yesterday", "", "2026-13-01T00:00:00Z", "1700000000"]),
    st.integers(),
    st.text(max_size=30).filter(lambda s: not re.match(r"^\d{4}-", s)),
)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
field_names = st.sampled_from(
    [
        "version",
        "alerts",
        "status",
        "labels",
        "node",
        "lines",
        "xid",
        "observed_at",
        "source",
        "kind",
        "gpu_index",
        "receiver",
        "startsAt",
    ]
) | st.text(max_size=10)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(field_names, inner, max_size=5),
    max_leaves=8,
)


@st.composite
def valid_payloads(draw) -> tuple[str, dict, list[tuple[str, int]]]:
    """(source, payload, the (node, xid) of each alert it carries)."""
    source = draw(st.sampled_from(sorted(PATHS)))
    node = draw(node_names)
    if source == "gpu-health":
        xid = draw(xids)
        return source, gpu_health_event(node, xid, draw(recent), gpu=draw(st.integers(0, 63))), [(node, xid)]
    found = draw(st.lists(xids, min_size=1, max_size=5))
    if source == "kernel-log":
        lines = [xid_line(x, pid=i) for i, x in enumerate(found)]
        return source, kernel_log_post(node, lines), [(node, x) for x in found]
    when = draw(recent)
    return (
        source,
        alertmanager_payload([dcgm_alert(node, x, when, gpu=i) for i, x in enumerate(found)]),
        [(node, x) for x in found],
    )


@st.composite
def broken_payloads(draw) -> tuple[str, dict, str]:
    """A valid payload with one thing made wrong: (source, payload, where the problem is)."""
    source, payload, _ = draw(valid_payloads())
    if source == "gpu-health":
        field = draw(
            st.sampled_from(
                ["node", "xid", "observed_at", "gpu_index", "gpu_uuid", "source", "extra", "missing", "kind"]
            )
        )
        if field == "node":
            payload["node"] = draw(bad_node_names)
        elif field == "xid":
            payload["xid"] = draw(bad_xid_values)
            field = "xid" if payload["xid"] is not None else ""  # a null xid is refused as a whole
        elif field == "observed_at":
            payload["observed_at"] = draw(bad_times)
        elif field == "gpu_index":
            payload["gpu_index"] = draw(st.integers(min_value=64) | st.integers(max_value=-1) | st.text(max_size=3))
        elif field == "gpu_uuid":
            payload["gpu_uuid"] = draw(st.text(max_size=40).filter(lambda s: not s.startswith(("GPU-", "MIG-"))))
        elif field == "source":
            payload["source"] = draw(st.sampled_from(["", "a b", "x" * 65, "sl/ash\n"]))
        elif field == "extra":
            payload[draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in payload))] = draw(json_scalars)
            field = ""  # pydantic names the extra key itself
        elif field == "kind":
            payload["kind"] = draw(st.sampled_from(["nccl_timeout", "XID", "", "ecc"]))
            field = ""  # an nccl_timeout with an xid is refused as a whole
        else:
            del payload[field := draw(st.sampled_from(["node", "observed_at", "source", "xid"]))]
            field = "" if field == "xid" else field  # a missing xid is refused as a whole
        return source, payload, field
    if source == "kernel-log":
        what = draw(st.sampled_from(["node", "line", "lines", "observed_at", "extra"]))
        if what == "node":
            payload["node"] = draw(bad_node_names)
        elif what == "line":
            i = draw(st.integers(0, len(payload["lines"]) - 1))
            out_of_range = st.builds(lambda x: f"NVRM: Xid (PCI:0000:3b:00): {x}, pid=1, bad", st.integers(1000, 10**6))
            not_xid = st.text(max_size=120).filter(lambda line: parse_line(line) is None)
            if draw(st.booleans()):
                payload["lines"][i] = draw(out_of_range)
            else:  # other lines are ignored beside an Xid line: refused only when no line is one
                payload["lines"] = [draw(not_xid) for _ in payload["lines"]]
            return source, payload, f"lines[{i}]"
        elif what == "lines":
            payload["lines"] = draw(st.sampled_from([[], None, "NVRM: Xid (PCI:0000:3b:00): 79", [79]]))
        elif what == "observed_at":
            payload["observed_at"] = draw(bad_times)
        else:
            payload["unexpected"] = draw(json_scalars)
            return source, payload, "unexpected"
        return source, payload, what
    i = draw(st.integers(0, len(payload["alerts"]) - 1))
    alert = payload["alerts"][i]
    what = draw(st.sampled_from(["xid", "node", "no-node", "status", "startsAt", "version", "labels"]))
    if what == "xid":
        alert["labels"]["xid"] = draw(
            st.one_of(
                st.text(max_size=6).filter(lambda s: not (s.isascii() and s.isdigit() and 1 <= int(s) <= 999)),
                st.integers(1000, 10**9).map(str),
            )
        )
        return source, payload, f"alerts[{i}].labels.xid"
    if what == "node":
        alert["labels"]["Hostname"] = draw(bad_node_names.filter(bool))
        return source, payload, f"alerts[{i}].labels.Hostname"
    if what == "no-node":
        del alert["labels"]["Hostname"], alert["labels"]["instance"]
        return source, payload, f"alerts[{i}].labels"
    if what == "status":
        alert["status"] = draw(st.sampled_from(["pending", "FIRING", "", "inactive"]))
        return source, payload, f"alerts[{i}].status"
    if what == "startsAt":
        alert["startsAt"] = draw(bad_times)
        return source, payload, f"alerts[{i}].startsAt"
    if what == "labels":
        alert["labels"][draw(st.text(min_size=1, max_size=8))] = draw(st.integers() | st.none() | st.booleans())
        return source, payload, f"alerts[{i}].labels"
    payload["version"] = draw(st.sampled_from(["3", "5", 4, "", None]))
    return source, payload, "version"


# --- properties ----------------------------------------------------------------------------------


@examples(5000)
@given(case=broken_payloads())
def test_a_payload_with_one_thing_wrong_is_refused_naming_it(hook, case):
    source, payload, where = case
    assert_refused(hook, hook.post(source, json.dumps(payload).encode()), where or None)


@examples(2500)
@given(source=st.sampled_from(sorted(PATHS)), value=json_values)
def test_arbitrary_json_is_refused(hook, source, value):
    assert_refused(hook, hook.post(source, json.dumps(value).encode()))


@examples(2500)
@given(source=st.sampled_from(sorted(PATHS)), body=st.binary(max_size=300))
def test_arbitrary_bytes_are_refused(hook, source, body):
    assert_refused(hook, hook.post(source, body))


@pytest.fixture(scope="module")
def fresh_hook():
    harness = Harness()
    yield harness
    harness.close()


@examples(500)
@given(case=valid_payloads())
def test_a_valid_payload_is_handed_over_exactly(fresh_hook, case):
    source, payload, expected = case
    fresh_hook.fresh()
    response = fresh_hook.post(source, json.dumps(payload).encode())
    assert response.status_code == 200, response.text
    answer = HookAnswer.model_validate(response.json())
    assert [(a.node, a.xid) for a in answer.alerts] == expected
    assert answer.accepted + answer.duplicate == len(expected)
    handed_over = [(a.node, a.xid) for a in fresh_hook.incidents.handed_over]
    assert sorted(set(handed_over)) == sorted(set(expected)) and len(handed_over) == answer.accepted
    assert len(fresh_hook.incidents.runs) == 1
