"""An alert storm against the running hook: `python -m bench storm [--json]`.

Each run starts a fresh Temporal dev server on its own sqlite file (as the local stack keeps its
state; in WAL mode, bench/services.py's SQLITE_WAL) and `recovery hooks` (as documented, one
process), builds the storm, drives it from several concurrent keep-alive clients on 127.0.0.1, then
counts the incidents in Temporal. Every node fails once and its failure is reported by all
three sources, each payload delivered several times (Alertmanager HA pairs and re-sends, shipper
retries), all shuffled together:

  per node  1 Alertmanager notification  (4 alerts: XID 79 on the bad GPU, XID 74 on 3 NVLink peers)
            4 kernel-log posts           (4 lines each: XID 79 from each process on the GPU, 74, 45)
            5 GPU health events          (XID 79 from two agents, XID 74 on the 3 peers)
  = 10 requests, 25 distinct alerts; x copies (default 4) = 100 alerts per node

Latency is per request: from the first byte sent to the last byte of the answer, which the hook
gives once the request's alerts are in Temporal.

CPU is counted per process (/proc/<pid>/stat) over the storm, as milliseconds per alert: other jobs
on the machine take cores from the storm, and inflate what each alert costs far less (the same storm
on this project's 2-core machine: 0.32 ms quiet, up to 0.48 with a core taken). cores / (hook +
Temporal + load generator CPU per alert) is the rate at which the three would fill the machine's
cores: measured on a quiet machine, the throughput's ceiling (the closed-loop clients reached 87% of
it); measured on a busy one, less than that ceiling.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import uvloop
from temporalio.client import Client

from bench.services import SQLITE_WAL, cpu_seconds, hook_server, machine_busy_seconds, temporal_dev_server
from tests.hook_support import alertmanager_payload, dcgm_alert, gpu_health_event, kernel_log_post, xid_line

# Where the dev server keeps its state: sqlite pragmas, None in memory.
TEMPORAL_DBS: dict[str, tuple[str, ...] | None] = {"sqlite-wal": SQLITE_WAL, "sqlite": (), "memory": None}

PATHS = {
    "alertmanager": "/v1/alerts/alertmanager",
    "gpu-health": "/v1/alerts/gpu-health",
    "kernel-log": "/v1/alerts/kernel-log",
}


@dataclass(frozen=True)
class StormSpec:
    nodes: int = 500
    copies: int = 4  # deliveries of every payload
    clients: int = 8  # concurrent keep-alive connections, each sending its next request once answered
    seed: int = 1
    deadline_seconds: float = 600.0  # a run that takes longer is abandoned
    # a key of TEMPORAL_DBS; RECOVERY_BENCH_STORM_TEMPORAL_DB=sqlite|memory measures the others
    temporal_db: str = field(default_factory=lambda: os.environ.get("RECOVERY_BENCH_STORM_TEMPORAL_DB", "sqlite-wal"))

    distinct_per_node = 25
    requests_per_node = 10

    def __post_init__(self) -> None:
        if self.temporal_db not in TEMPORAL_DBS:
            raise ValueError(f"temporal_db {self.temporal_db!r}: one of {', '.join(TEMPORAL_DBS)}")

    @property
    def alerts(self) -> int:
        return self.nodes * self.distinct_per_node * self.copies


@dataclass
class Request:
    path: str
    alerts: int
    raw: bytes = b""  # the whole HTTP/1.1 request, built before the clock starts


@dataclass
class RunResult:
    alerts: int
    requests: int
    nodes: int
    incidents: int
    seconds: float
    alerts_per_s: float
    requests_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    latency_by_kind: dict[str, dict[str, float]]
    outcomes: dict[str, int]
    errors: int
    temporal_calls: dict[str, int]
    cpu_cores: dict[str, float] = field(default_factory=dict)  # cores used during the storm, per process
    cpu_ms_per_alert: dict[str, float] = field(default_factory=dict)  # hook, temporal, bench and their total
    cpu_bound_alerts_per_s: int = 0  # cores / total CPU per alert (module docstring)
    load_average: tuple[float, float] = (0.0, 0.0)  # 1 min, before and after the storm
    temporal_db: str = ""


def node_payloads(node: str, when: datetime) -> list[tuple[str, dict]]:
    """One node's failure as every source reports it (the 10 payloads of the module docstring)."""
    bad_gpu, peers = 3, (0, 1, 2)
    am = alertmanager_payload(
        [dcgm_alert(node, 79, when, gpu=bad_gpu)]
        + [dcgm_alert(node, 74, when + timedelta(seconds=1), gpu=g) for g in peers]
    )
    lines = [xid_line(79, pid=1000 + p, when=when) for p in range(8)]
    lines += [xid_line(74, pci=f"0000:1{g}:00", pid=2000 + g, when=when + timedelta(seconds=1)) for g in range(4)]
    lines += [xid_line(45, pid=3000 + p, when=when + timedelta(seconds=2)) for p in range(4)]
    health = [gpu_health_event(node, 79, when, gpu=bad_gpu, source=s) for s in ("dcgm-health", "node-agent")]
    health += [gpu_health_event(node, 74, when + timedelta(seconds=1), gpu=g) for g in peers]
    return (
        [("alertmanager", am)]
        + [("kernel-log", kernel_log_post(node, lines[i : i + 4])) for i in range(0, 16, 4)]
        + [("gpu-health", h) for h in health]
    )


def build_storm(spec: StormSpec, port: int, token: str) -> list[Request]:
    rng = random.Random(spec.seed)
    now = datetime.now(timezone.utc)
    requests = []
    for n in range(spec.nodes):
        when = now - timedelta(seconds=rng.uniform(5, 60))
        for source, payload in node_payloads(f"gpu-{n:04d}", when):
            body = json.dumps(payload).encode()
            head = (
                f"POST {PATHS[source]} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            alerts = {
                "alertmanager": len(payload.get("alerts", [])),
                "kernel-log": len(payload.get("lines", [])),
                "gpu-health": 1,
            }[source]
            requests += [Request(PATHS[source], alerts, head + body)] * spec.copies
    rng.shuffle(requests)
    assert len(requests) == spec.nodes * spec.requests_per_node * spec.copies
    assert sum(r.alerts for r in requests) == spec.alerts
    return requests


class Connection:
    """A minimal HTTP/1.1 keep-alive client: the load generator shares the machine's two cores with
    the hook and Temporal, so it must cost little (httpx would cost it more than the hook)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def drive(
    requests: list[Request], clients: int, port: int, deadline: float
) -> tuple[dict[str, list[float]], dict, int, float]:
    """Send every request from `clients` closed-loop connections.

    Returns the latencies by kind of request (one that opened its node's incident, one that handed
    new alerts to a running incident, one made only of duplicates), the outcomes, the failed
    requests and the seconds the storm took."""
    latencies: dict[str, list[float]] = {"opened": [], "joined": [], "duplicates": []}
    outcomes = {"accepted": 0, "correlated": 0, "duplicate": 0, "dropped": 0}
    opened: set[str] = set()
    errors = 0
    queue = iter(requests)

    async def client() -> None:
        nonlocal errors
        conn = await Connection.open(port)
        try:
            for request in queue:
                started = time.perf_counter()
                status, body = await conn.send(request.raw)
                took = time.perf_counter() - started
                if status != 200:
                    errors += 1
                    continue
                answer = json.loads(body)
                for outcome in outcomes:
                    outcomes[outcome] += answer[outcome]
                new = {a["incident"] for a in answer["alerts"] if a["outcome"] == "accepted"}
                kind = "duplicates" if not new else "joined" if new <= opened else "opened"
                opened.update(new)
                latencies[kind].append(took)
        finally:
            await conn.close()

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(client() for _ in range(clients))), deadline)
    return latencies, outcomes, errors, time.perf_counter() - started


async def count_incidents(address: str, expected: int) -> int:
    """NodeRecoveryWorkflow runs on this (fresh) server, once visibility has caught up."""
    client = await Client.connect(address)
    deadline, last, stable_since = time.monotonic() + 30, -1, time.monotonic()
    while time.monotonic() < deadline:
        count = (await client.count_workflows("WorkflowType='NodeRecoveryWorkflow'")).count
        if count != last:
            last, stable_since = count, time.monotonic()
        elif count >= expected and time.monotonic() - stable_since > 1:
            break
        await asyncio.sleep(0.2)
    return last


def _metric_counts(text: str, metric: str, label: str) -> dict[str, int]:
    counts = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            labels, value = line[len(metric) + 1 :].rsplit("} ", 1)
            counts[labels.split(f'{label}="', 1)[1].split('"', 1)[0]] = int(value)
    return counts


async def run_once(spec: StormSpec, workdir: Path) -> RunResult:
    token = secrets.token_hex(16)
    with (
        temporal_dev_server(workdir, TEMPORAL_DBS[spec.temporal_db]) as (temporal, address),
        hook_server(workdir, address, token) as (hook, port),
    ):
        requests = build_storm(spec, port, token)

        def cpu() -> dict[str, float]:
            return {
                "hook": cpu_seconds(hook.pid),
                "temporal": cpu_seconds(temporal.pid),
                "bench": time.process_time(),
                "machine": machine_busy_seconds(),
            }

        cpu_before, load_before = cpu(), os.getloadavg()[0]
        # The clients run on uvloop (in a thread: the caller's loop may be asyncio's), which costs
        # the load generator a fraction of asyncio's CPU on the same two cores as the hook.
        latencies, outcomes, errors, seconds = await asyncio.to_thread(
            uvloop.run, drive(requests, spec.clients, port, spec.deadline_seconds)
        )
        cpu_after, load_after = cpu(), os.getloadavg()[0]
        conn = await Connection.open(port)
        _, metrics = await conn.send(f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        await conn.close()
        incidents = await count_incidents(address, spec.nodes)
    alerts = sum(r.alerts for r in requests)
    every = sorted(t for kind in latencies.values() for t in kind)
    per_alert = _cpu_ms_per_alert(cpu_before, cpu_after, alerts)

    def pct(q: float, values: list[float] = every) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 2) if values else 0.0

    return RunResult(
        alerts=alerts,
        requests=len(requests),
        nodes=spec.nodes,
        incidents=incidents,
        seconds=round(seconds, 3),
        alerts_per_s=round(alerts / seconds),
        requests_per_s=round(len(requests) / seconds),
        p50_ms=pct(0.50),
        p90_ms=pct(0.90),
        p99_ms=pct(0.99),
        max_ms=pct(1.0),
        latency_by_kind={
            kind: {"requests": len(v), "p50_ms": pct(0.5, sorted(v)), "p99_ms": pct(0.99, sorted(v))}
            for kind, v in latencies.items()
        },
        outcomes=outcomes,
        errors=errors,
        temporal_calls=_metric_counts(metrics.decode(), "recovery_hook_temporal_calls_total", "call"),
        cpu_cores=_cores(cpu_before, cpu_after, seconds),
        cpu_ms_per_alert=per_alert,
        cpu_bound_alerts_per_s=round(os.cpu_count() * 1000 / per_alert["total"]),
        load_average=(round(load_before, 2), round(load_after, 2)),
        temporal_db=spec.temporal_db,
    )


def _cpu_ms_per_alert(before: dict[str, float], after: dict[str, float], alerts: int) -> dict[str, float]:
    per_alert = {k: (after[k] - before[k]) * 1000 / alerts for k in ("hook", "temporal", "bench")}
    per_alert["total"] = sum(per_alert.values())
    return {k: round(v, 4) for k, v in per_alert.items()}


def _cores(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores used during the storm by the hook, Temporal and the load generator, and by everything
    else on the machine (another job running here skews the figures; this shows by how much)."""
    used = {k: (after[k] - before[k]) / seconds for k in before}
    used["other"] = max(0.0, used.pop("machine") - used["hook"] - used["temporal"] - used["bench"])
    return {k: round(v, 2) for k, v in used.items()}


def summary(spec: StormSpec, runs: list[RunResult]) -> dict:
    """The medians over the runs, with every run and the spec."""

    def median(name: str) -> float:
        return statistics.median(getattr(r, name) for r in runs)

    return {
        "alerts": spec.alerts,
        "nodes": spec.nodes,
        "clients": spec.clients,
        "copies": spec.copies,
        "incidents": int(median("incidents")),
        "alerts_per_s": median("alerts_per_s"),
        "requests_per_s": median("requests_per_s"),
        "p50_ms": median("p50_ms"),
        "p99_ms": median("p99_ms"),
        "temporal_db": spec.temporal_db,
        "cpu_ms_per_alert": {
            k: statistics.median(r.cpu_ms_per_alert[k] for r in runs) for k in runs[0].cpu_ms_per_alert
        },
        "cpu_bound_alerts_per_s": median("cpu_bound_alerts_per_s"),
        "ok": all(r.incidents == spec.nodes and r.errors == 0 and r.outcomes["dropped"] == 0 for r in runs),
        "runs": [asdict(r) for r in runs],
    }
