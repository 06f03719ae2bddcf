"""Each source's wire schema and how its payloads become alerts."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from hooks.sources import alertmanager, gpu_health, kernel_log
from tests.hook_support import alertmanager_payload, dcgm_alert, gpu_health_event, kernel_log_post, xid_line

T0 = datetime(2026, 11, 30, 0, 17, 36, tzinfo=timezone.utc)
NODE_LABELS = ["node", "Hostname", "instance"]


def wire(model, payload: dict):
    """Validated as the hook validates a body: from JSON text."""
    return model.model_validate_json(json.dumps(payload))


def am(alerts: list[dict]) -> tuple[list, list]:
    return alertmanager.to_incoming(wire(alertmanager.AlertmanagerWebhook, alertmanager_payload(alerts)), NODE_LABELS)


# --- Alertmanager --------------------------------------------------------------------------------


def test_alertmanager_alert_becomes_an_alert_for_its_node():
    alerts, problems = am([dcgm_alert("gpu-2", 79, T0, gpu=3)])
    assert problems == []
    [a] = alerts
    assert (a.node, a.xid, a.observed_at, a.resolved) == ("gpu-2", 79, T0, False)
    assert a.source == "alertmanager" and a.actor == "alertmanager receiver training-recovery"
    assert a.reason == "XID 79 on GPU 3 of gpu-2"
    assert "DCGM_FI_DEV_XID_ERRORS is 79" in a.message
    a.to_alert()  # a valid NodeFailureAlert


def test_node_label_map_first_present_wins_and_instance_loses_its_port():
    labelled = dcgm_alert("gpu-2", 79, T0)
    labelled["labels"]["node"] = "slurm-gpu-2"
    by_instance = dcgm_alert("x", 79, T0, node_label="unused")
    by_instance["labels"]["instance"] = "gpu-7:9400"
    alerts, problems = am([labelled, by_instance])
    assert problems == []
    assert [a.node for a in alerts] == ["slurm-gpu-2", "gpu-7"]


def test_resolved_alerts_are_marked_resolved():
    alerts, _ = am([dcgm_alert("gpu-2", 79, T0, status="resolved")])
    assert alerts[0].resolved


@pytest.mark.parametrize(
    "change, loc, words",
    [
        (lambda labels: labels.update(xid="seventy-nine"), "alerts[0].labels.xid", "not an integer"),
        (lambda labels: labels.update(xid="0"), "alerts[0].labels.xid", "1-999"),
        (lambda labels: labels.update(xid="1000"), "alerts[0].labels.xid", "1-999"),
        (lambda labels: labels.pop("xid"), "alerts[0].labels.xid", "missing"),
        (lambda labels: labels.update(Hostname="gpu-[1-4]"), "alerts[0].labels.Hostname", "invalid node name"),
        (lambda labels: [labels.pop(k) for k in ("Hostname", "instance")], "alerts[0].labels", "no node label"),
    ],
)
def test_bad_alertmanager_alerts_name_the_problem(change, loc, words):
    alert = dcgm_alert("gpu-2", 79, T0)
    change(alert["labels"])
    _, problems = am([alert])
    assert [p["loc"] for p in problems] == [loc]
    assert words in problems[0]["msg"]


def test_every_bad_alert_is_named_not_only_the_first():
    good, bad1, bad2 = (dcgm_alert(n, 79, T0) for n in ("gpu-1", "gpu-2", "gpu-3"))
    bad1["labels"]["xid"] = "x"
    bad2["labels"]["Hostname"] = "gpu 3"
    _, problems = am([good, bad1, bad2])
    assert [p["loc"] for p in problems] == ["alerts[1].labels.xid", "alerts[2].labels.Hostname"]


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.update(version="3"),
        lambda p: p.update(unexpected=1),
        lambda p: p.update(alerts=[]),
        lambda p: p["alerts"][0].update(startsAt="2026-11-30T00:17:36"),  # no time zone
        lambda p: p["alerts"][0].update(status="pending"),
        lambda p: p["alerts"][0]["labels"].update(gpu=3),  # label values are strings
    ],
)
def test_alertmanager_schema_is_strict(change):
    payload = alertmanager_payload([dcgm_alert("gpu-2", 79, T0)])
    change(payload)
    with pytest.raises(ValidationError):
        wire(alertmanager.AlertmanagerWebhook, payload)


def test_long_free_text_is_clipped_to_the_alert_contract():
    alert = dcgm_alert("gpu-2", 79, T0)
    alert["annotations"] = {"summary": "s" * 4000, "description": "d\n" * 2000}
    [a], problems = am([alert])
    assert problems == [] and len(a.reason) == 500 and len(a.message) == 2000
    a.to_alert()


# --- kernel log ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, xid, pci, description, when",
    [
        (
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
            79,
            "PCI:0000:3b:00",
            "GPU has fallen off the bus.",
            None,
        ),
        (
            "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            79,
            "PCI:0000:3b:00",
            "GPU has fallen off the bus.",
            None,
        ),
        (
            "[ 8142.512345] NVRM: Xid (PCI:0000:18:00.0): 48, "
            "An uncorrectable double bit error (DBE) has been detected",
            48,
            "PCI:0000:18:00.0",
            "An uncorrectable double bit error (DBE) has been detected",
            None,
        ),
        (
            "2026-11-30T00:17:36+00:00 gpu-2 kernel: NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception: ESR 0x4041b0",
            13,
            "PCI:0000:3b:00",
            "Graphics Exception: ESR 0x4041b0",
            T0,
        ),
        (
            "2026-11-30T01:17:36.250+01:00 gpu-2 kernel: NVRM: Xid (PCI:0000:3b:00): 94, pid=7, Contained error",
            94,
            "PCI:0000:3b:00",
            "Contained error",
            T0 + timedelta(seconds=0.25),
        ),
        (
            "Nov 30 00:17:36 gpu-2 kernel: NVRM: Xid (PCI:0000:3b:00): 31, pid=9, name=a.out, Ch 00000010, MMU Fault",
            31,
            "PCI:0000:3b:00",
            "Ch 00000010, MMU Fault",
            None,
        ),
        ("NVRM: Xid (PCI:0000:3b:00): 79", 79, "PCI:0000:3b:00", "", None),
        # cut short by the shipper's line limit after the XID: still an Xid line
        ("NVRM: Xid (PCI:0000:01:00): 154 (", 154, "PCI:0000:01:00", "(", None),
    ],
)
def test_xid_lines_as_the_driver_writes_them(line, xid, pci, description, when):
    assert kernel_log.parse_line(line) == (xid, pci, description, when)


@pytest.mark.parametrize(
    "line",
    [
        "NVRM: GPU at PCI:0000:3b:00: GPU-2ad0b6c5-8f5c-1d1a-8e4e-3c3f8f0c2f4b",
        "NVRM: Xid (0000:3b:00): 79, pid=1",  # no PCI: prefix
        "NVRM: Xid (PCI:0000:3b:00): seventy-nine",
        "NVRM: Xid (PCI:0000:3b:00): 79x",
        "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
        "",
    ],
)
def test_other_lines_are_not_xid_lines(line):
    assert kernel_log.parse_line(line) is None


def test_kernel_log_post_gives_one_alert_per_line_with_its_time():
    received = T0 + timedelta(minutes=1)
    post = wire(
        kernel_log.KernelLogPost,
        kernel_log_post(
            "gpu-2",
            [
                xid_line(79),
                xid_line(79, when=T0 - timedelta(seconds=5)),
                xid_line(74, pci="0000:3c:00"),
            ],
        ),
    )
    alerts, problems, ignored = kernel_log.to_incoming(post, received)
    assert problems == [] and ignored == ()
    assert [(a.node, a.xid, a.observed_at) for a in alerts] == [
        ("gpu-2", 79, received),
        ("gpu-2", 79, T0 - timedelta(seconds=5)),
        ("gpu-2", 74, received),
    ]
    assert alerts[2].reason == "XID 74 on PCI:0000:3c:00: GPU fault 74"
    assert alerts[0].source == "kernel-log" and alerts[0].actor == "kernel log of gpu-2"


def test_kernel_log_post_time_is_used_for_lines_without_one():
    post = wire(kernel_log.KernelLogPost, kernel_log_post("gpu-2", [xid_line(79)], observed_at=T0))
    alerts = kernel_log.to_incoming(post, T0 + timedelta(hours=1)).alerts
    assert alerts[0].observed_at == T0


def test_kernel_log_other_lines_are_ignored_and_named_when_the_post_has_an_xid_line():
    post = wire(
        kernel_log.KernelLogPost,
        kernel_log_post(
            "gpu-2",
            [
                "NVRM: GPU Board Serial Number: 1234",
                xid_line(79),
                "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
            ],
        ),
    )
    alerts, problems, ignored = kernel_log.to_incoming(post, T0)
    assert [a.xid for a in alerts] == [79] and problems == []
    assert [line.index for line in ignored] == [0, 2]
    assert all("not an NVRM Xid line" in line.reason for line in ignored)


def test_kernel_log_problems_name_each_line():
    post = wire(
        kernel_log.KernelLogPost,
        kernel_log_post("gpu-2", [xid_line(79), "NVRM: GPU Board Serial Number: 1234", xid_line(1000)]),
    )
    _, problems, ignored = kernel_log.to_incoming(post, T0)
    assert [p["loc"] for p in problems] == ["lines[2]"] and [line.index for line in ignored] == [1]
    assert "out of range" in problems[0]["msg"]


def test_kernel_log_post_without_any_xid_line_names_each_line_as_a_problem():
    post = wire(kernel_log.KernelLogPost, kernel_log_post("gpu-2", ["hello", "NVRM: GPU Board Serial Number: 1"]))
    alerts, problems, ignored = kernel_log.to_incoming(post, T0)
    assert alerts == [] and ignored == ()
    assert [p["loc"] for p in problems] == ["lines[0]", "lines[1]"]
    assert all("not an NVRM Xid line" in p["msg"] for p in problems)


@pytest.mark.parametrize(
    "post",
    [
        {"node": "gpu-2", "lines": []},
        {"node": "gpu-[1-2]", "lines": ["x"]},
        {"node": "gpu-2", "lines": "NVRM: Xid (PCI:0000:3b:00): 79"},
        {"node": "gpu-2", "lines": ["x"], "observed_at": "yesterday"},
        {"node": "gpu-2", "lines": ["x"], "source": "kernel log"},
        {"lines": ["x"]},
    ],
)
def test_kernel_log_schema_is_strict(post):
    with pytest.raises(ValidationError):
        wire(kernel_log.KernelLogPost, post)


# --- GPU health events ----------------------------------------------------------------------------


def test_gpu_health_event_becomes_an_alert():
    event = wire(gpu_health.GpuHealthEvent, gpu_health_event("gpu-2", 79, T0, gpu=5))
    a = gpu_health.to_incoming(event)
    assert (a.node, a.xid, a.observed_at, a.source) == ("gpu-2", 79, T0, "dcgm-health")
    assert a.reason.startswith("XID 79 on GPU 5 GPU-") and a.reason.endswith(": reported by the node agent")
    a.to_alert()


def test_nccl_timeout_has_no_xid():
    event = wire(gpu_health.GpuHealthEvent, gpu_health_event("gpu-2", None, T0))
    a = gpu_health.to_incoming(event)
    assert a.xid is None and a.reason.startswith("NCCL timeout on GPU 0")


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda e: e.pop("xid"), "needs xid"),
        (lambda e: [e.pop("gpu_index"), e.pop("gpu_uuid")], "needs gpu_index or gpu_uuid"),
        (lambda e: e.update(kind="nccl_timeout"), "has no xid"),
        (lambda e: e.update(xid=0), "greater than or equal to 1"),
        (lambda e: e.update(gpu_uuid="GPU-1234"), "pattern"),
        (lambda e: e.update(gpu_index=64), "less than or equal to 63"),
        (lambda e: e.update(observed_at="2026-11-30T00:17:36"), "timezone"),
        (lambda e: e.update(xid="79"), "valid integer"),
    ],
)
def test_gpu_health_schema_is_strict(change, words):
    event = gpu_health_event("gpu-2", 79, T0)
    change(event)
    with pytest.raises(ValidationError) as e:
        wire(gpu_health.GpuHealthEvent, event)
    assert words in str(e.value)
