"""For tests and the benchmark (bench/storm.py): payloads as each source sends them, and stand-ins for the
Temporal side of the intake.

RecordingIncidents keeps incidents the way Temporal would (one running run per node; an ended run
refuses a REJECT_DUPLICATE hand-over) so the intake's logic can be checked without a server;
FixedDirectory shows running incidents the way visibility would. The integration tests check the
same behaviour against the real dev server.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass, field
from datetime import datetime

from contracts.models import AlertDigest, NodeFailureAlert
from hooks.correlation import RunningIncident, Snapshot
from hooks.intake import IncidentEnded


@dataclass
class RecordedRun:
    run_id: str
    alerts: list[NodeFailureAlert] = field(default_factory=list)
    ended_at: datetime | None = None
    digests: list[AlertDigest] = field(default_factory=list)


class RecordingIncidents:
    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay  # seconds each hand-over takes, to let alerts pile up behind it
        self.calls: list[tuple[str, str, list[NodeFailureAlert]]] = []  # (call, node, alerts)
        self.runs: dict[str, list[RecordedRun]] = {}
        self.fail_with: Exception | None = None

    def end(self, node: str, at: datetime) -> None:
        self.runs[node][-1].ended_at = at

    async def join_or_open(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        await self._call("join_or_open", node, alerts)
        runs = self.runs.setdefault(node, [])
        if runs and runs[-1].ended_at is not None:
            raise IncidentEnded(node)
        return self._hand_over(node, alerts)

    async def join(self, node: str, alerts: list[NodeFailureAlert], run_id: str | None) -> None:
        await self._call("join", node, alerts)
        runs = [r for r in self.runs.get(node, []) if run_id is None or r.run_id == run_id]
        if not runs or runs[-1].ended_at is not None:
            raise IncidentEnded(node)
        runs[-1].alerts.extend(alerts)

    async def join_digest(self, node: str, digest: AlertDigest, run_id: str) -> None:
        await self._call("join_digest", node, digest.alerts)
        runs = [r for r in self.runs.get(node, []) if r.run_id == run_id]
        if not runs or runs[-1].ended_at is not None:
            raise IncidentEnded(node)
        runs[-1].digests.append(digest)

    async def ended_at(self, node: str) -> datetime | None:
        await self._call("ended_at", node, [])
        runs = self.runs.get(node)
        return runs[-1].ended_at if runs else None

    async def open_after_end(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        await self._call("open_after_end", node, alerts)
        return self._hand_over(node, alerts)

    async def _call(self, name: str, node: str, alerts: list[NodeFailureAlert]) -> None:
        self.calls.append((name, node, list(alerts)))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail_with is not None:
            raise self.fail_with

    def _hand_over(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        runs = self.runs.setdefault(node, [])
        if not runs or runs[-1].ended_at is not None:
            runs.append(RecordedRun(run_id=f"{node}-run-{len(runs) + 1}"))
        runs[-1].alerts.extend(alerts)
        return runs[-1].run_id

    @property
    def handed_over(self) -> list[NodeFailureAlert]:
        return [a for runs in self.runs.values() for run in runs for a in run.alerts]


class FixedDirectory:
    """Running incidents as a test sets them; a new snapshot is taken whenever the test says so."""

    def __init__(self, *incidents: RunningIncident) -> None:
        self._current = Snapshot({i.node: i for i in incidents})
        self._next: asyncio.Future[Snapshot] | None = None
        self.snapshots = 0  # how many times the intake read it

    async def snapshot(self) -> Snapshot:
        self.snapshots += 1
        return self._current

    async def refreshed(self) -> Snapshot:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        return await asyncio.shield(self._next)

    def show(self, *incidents: RunningIncident) -> None:
        """Visibility now shows these running incidents (and no others)."""
        self._current = Snapshot({i.node: i for i in incidents})
        if self._next is not None:
            self._next.set_result(self._current)
            self._next = None


# --- payloads, as the sources send them -------------------------------------------------------

NEVER = "0001-01-01T00:00:00Z"  # Alertmanager's endsAt of a firing alert


def gpu_uuid(node: str, gpu: int) -> str:
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/{gpu}')}"


def dcgm_alert(
    node: str, xid: int, starts_at: datetime, *, gpu: int = 0, status: str = "firing", node_label: str = "Hostname"
) -> dict:
    """One alert of the shipped rule, as Alertmanager delivers it (labels of dcgm-exporter)."""
    labels = {
        "alertname": "GpuXidError",
        node_label: node,
        "gpu": str(gpu),
        "UUID": gpu_uuid(node, gpu),
        "device": f"nvidia{gpu}",
        "modelName": "NVIDIA H100 80GB HBM3",
        "xid": str(xid),
        "instance": "dcgm-exporter:9400",
        "job": "dcgm-exporter",
        "severity": "critical",
    }
    return {
        "status": status,
        "labels": labels,
        "annotations": {
            "summary": f"XID {xid} on GPU {gpu} of {node}",
            "description": f"DCGM_FI_DEV_XID_ERRORS is {xid} on {node} GPU {gpu}",
        },
        "startsAt": starts_at.isoformat(),
        "endsAt": NEVER if status == "firing" else starts_at.isoformat(),
        "generatorURL": "http://prometheus:9090/graph?g0.expr=DCGM_FI_DEV_XID_ERRORS+%3E+0",
        "fingerprint": hashlib.sha256(repr(sorted(labels.items())).encode()).hexdigest()[:16],
    }


def alertmanager_payload(alerts: list[dict], receiver: str = "training-recovery") -> dict:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    common = {k: v for k, v in alerts[0]["labels"].items() if all(a["labels"].get(k) == v for a in alerts)}
    return {
        "version": "4",
        "groupKey": '{}:{alertname="GpuXidError"}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": receiver,
        "groupLabels": {"alertname": "GpuXidError"},
        "commonLabels": common,
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": alerts,
    }


def xid_line(xid: int, *, pci: str = "0000:3b:00", pid: int = 4242, when: datetime | None = None) -> str:
    line = f"NVRM: Xid (PCI:{pci}): {xid}, pid={pid}, name=python, GPU fault {xid}"
    return f"{when.isoformat()} node kernel: {line}" if when else line


def kernel_log_post(node: str, lines: list[str], observed_at: datetime | None = None) -> dict:
    post: dict = {"node": node, "lines": lines}
    if observed_at is not None:
        post["observed_at"] = observed_at.isoformat()
    return post


def gpu_health_event(
    node: str, xid: int | None, observed_at: datetime, *, gpu: int = 0, source: str = "dcgm-health"
) -> dict:
    event = {
        "node": node,
        "gpu_index": gpu,
        "gpu_uuid": gpu_uuid(node, gpu),
        "observed_at": observed_at.isoformat(),
        "source": source,
        "message": "reported by the node agent",
    }
    if xid is None:
        event["kind"] = "nccl_timeout"
    else:
        event["xid"] = xid
    return event
