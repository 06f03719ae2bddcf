"""Prometheus Alertmanager's webhook (payload version 4), carrying dcgm-exporter's XID alerts.

The shipped rule (deploy/monitoring/prometheus/gpu-xid.rules.yml) fires on
DCGM_FI_DEV_XID_ERRORS > 0 and puts the metric's value, the XID, in the ``xid`` label (a new XID
on a GPU is a new fault, so it is a new alert, with its own startsAt). The node comes from the
first present label of a configurable list (default: node, Hostname, instance; an ``instance``
of host:port gives host). The GPU comes from dcgm-exporter's labels: ``gpu`` (its index), ``UUID``
and ``pci_bus_id``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from contracts.models import GPU_UUID, MAX_GPU_INDEX, _check_node_name, canonical_pci_address
from hooks.problems import problem
from hooks.sources import (
    ACTOR_MAX,
    MESSAGE_MAX,
    REASON_MAX,
    Incoming,
    Timestamp,
    WireModel,
    clip,
    one_line,
)

LabelSet = Annotated[dict[str, Annotated[str, Field(max_length=4096)]], Field(max_length=128)]
Text = Annotated[str, Field(max_length=4096)]
SOURCE = "alertmanager"
XID_LABEL = "xid"
GPU_INDEX_LABEL, GPU_UUID_LABEL, PCI_ADDRESS_LABEL = "gpu", "UUID", "pci_bus_id"


class AlertmanagerAlert(WireModel):
    status: Literal["firing", "resolved"]
    labels: LabelSet
    annotations: LabelSet
    startsAt: Timestamp
    endsAt: Timestamp
    generatorURL: Text
    fingerprint: Annotated[str, Field(max_length=64)]


class AlertmanagerWebhook(WireModel):
    """https://prometheus.io/docs/alerting/latest/configuration/#webhook_config"""

    version: Literal["4"]
    groupKey: Text
    truncatedAlerts: Annotated[int, Field(ge=0)] = 0
    status: Literal["firing", "resolved"]
    receiver: Annotated[str, Field(max_length=256)]
    groupLabels: LabelSet
    commonLabels: LabelSet
    commonAnnotations: LabelSet
    externalURL: Text
    alerts: Annotated[list[AlertmanagerAlert], Field(min_length=1)]


def node_from_labels(labels: dict[str, str], node_labels: list[str]) -> tuple[str, str] | None:
    """(label, node) from the first label present; host:port (Prometheus' instance) gives host."""
    for label in node_labels:
        value = labels.get(label)
        if value:
            host, sep, port = value.rpartition(":")
            return label, host if sep and port.isdigit() else value
    return None


def gpu_from_labels(labels: dict[str, str]) -> tuple[int | None, str | None, str | None]:
    """(index, UUID, PCI address) of the alert's GPU, each None unless its label has the contract's
    shape: another exporter's label of the same name is no reason to refuse the alert's XID."""
    index = labels.get(GPU_INDEX_LABEL, "")
    uuid = labels.get(GPU_UUID_LABEL, "")
    return (
        int(index) if index.isascii() and index.isdigit() and int(index) <= MAX_GPU_INDEX else None,
        uuid if GPU_UUID.match(uuid) else None,
        canonical_pci_address(labels.get(PCI_ADDRESS_LABEL, "")),
    )


def to_incoming(hook: AlertmanagerWebhook, node_labels: list[str]) -> tuple[list[Incoming], list[dict[str, str]]]:
    alerts, problems = [], []
    actor = one_line(f"alertmanager receiver {hook.receiver or '?'}", ACTOR_MAX)
    for i, a in enumerate(hook.alerts):
        where = f"alerts[{i}].labels"
        found = node_from_labels(a.labels, node_labels)
        if found is None:
            problems.append(problem(where, f"no node label: expected one of {', '.join(node_labels)}"))
        else:
            try:
                _check_node_name(found[1])
            except ValueError as e:
                problems.append(problem(f"{where}.{found[0]}", str(e)))
                found = None
        raw_xid = a.labels.get(XID_LABEL)
        xid = int(raw_xid) if raw_xid is not None and raw_xid.isascii() and raw_xid.isdigit() else None
        if xid is None or not 1 <= xid <= 999:
            problems.append(
                problem(
                    f"{where}.{XID_LABEL}",
                    "the XID (1-999) is missing or not an integer; the shipped rule sets it "
                    "from DCGM_FI_DEV_XID_ERRORS",
                )
            )
        if problems:
            continue  # keep collecting every alert's problems; build nothing once one is bad
        alertname = a.labels.get("alertname", "alert")
        gpu = a.labels.get(GPU_INDEX_LABEL) or a.labels.get(GPU_UUID_LABEL) or "?"
        gpu_index, gpu_uuid, pci_address = gpu_from_labels(a.labels)
        alerts.append(
            Incoming(
                node=found[1],
                xid=xid,
                source=SOURCE,
                actor=actor,
                reason=one_line(a.annotations.get("summary", ""), REASON_MAX) or f"{alertname}: XID {xid} on GPU {gpu}",
                observed_at=a.startsAt,
                message=clip(a.annotations.get("description", ""), MESSAGE_MAX),
                resolved=a.status == "resolved",
                gpu_index=gpu_index,
                gpu_uuid=gpu_uuid,
                pci_address=pci_address,
            )
        )
    return alerts, problems
