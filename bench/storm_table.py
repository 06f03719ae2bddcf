"""The alert storm (bench/storm.py, used as a library) as rows of the table, with a baseline measured
in the same run: Temporal alone.

  ours      the storm through `recovery hooks`: HTTP, validation, dedupe, correlation, hand-over.
  baseline  the Temporal calls that storm made (the hook's /metrics count them: signal-with-start
            to open each incident, signals to join it; the hook's few other calls, such as listing
            the running incidents at start, are left out), made straight from one client with the
            same concurrency, through the hook's own Temporal side (hooks/temporal.py), on
            a fresh dev server kept as the storm's: the rate at which Temporal alone takes what the
            storm needs.
            Its alerts/s = the storm's alerts / that time.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.services import temporal_dev_server
from bench.stack import say
from bench.storm import TEMPORAL_DBS, RunResult, StormSpec, run_once, summary
from bench.table import Row, goal, median, percentile, row
from contracts.models import NodeFailureAlert, RecoveryPolicy
from contracts.settings import Settings
from hooks.temporal import CLIENT_OPTIONS, TemporalIncidents
from worker import connect

QUICK_NODES = 50


@dataclass
class TemporalAlone:
    seconds: float
    p99_ms: float


@dataclass
class StormResult:
    spec: StormSpec
    storm: dict  # bench.storm.summary()
    baseline: list[TemporalAlone]

    def rows(self) -> list[Row]:
        return [
            row(
                f"alert storm: alerts/s through the hooks, with dedupe ({self.spec.alerts:,} alerts)",
                self.storm["alerts_per_s"],
                "alerts/s",
                median(self.spec.alerts / b.seconds for b in self.baseline),
                goal("value >= 5000"),
                digits=0,
            ),
            row(
                "alert storm: p99 per request",
                self.storm["p99_ms"],
                "ms",
                median(b.p99_ms for b in self.baseline),
                goal("value <= 50"),
                digits=1,
            ),
            row(
                "alert storm: incidents (baseline: distinct nodes)",
                self.storm["incidents"],
                "",
                self.spec.nodes,
                goal("value == baseline"),
                digits=0,
            ),
        ]

    def details(self) -> str:
        lines = [
            f"  {len(self.storm['runs'])} run(s): {self.spec.alerts:,} alerts over {self.spec.nodes} nodes from "
            f"{self.spec.clients} clients, Temporal on {self.spec.temporal_db}; baseline: the storm's Temporal "
            "calls made straight (Temporal alone)"
        ]
        for i, run in enumerate(self.storm["runs"]):
            lines.append(
                f"  storm run {i + 1}: {run['alerts_per_s']} alerts/s, p50 {run['p50_ms']} ms, p99 "
                f"{run['p99_ms']} ms; Temporal calls {run['temporal_calls']}; cores {run['cpu_cores']}; "
                f"CPU ms per alert {run['cpu_ms_per_alert']} (cores / CPU per alert: "
                f"{run['cpu_bound_alerts_per_s']} alerts/s); load average {run['load_average']}"
            )
        lines += [
            f"  Temporal alone {i + 1}: {b.seconds:.2f} s, p99 {b.p99_ms:.1f} ms per call"
            for i, b in enumerate(self.baseline)
        ]
        lines.append(
            "  (the storm's own benchmark: `python -m bench storm`; figures and analysis in "
            'docs/benchmarks.md, "Alert storm", and docs/alert-hooks.md, "Performance")'
        )
        return "\n".join(lines)


async def run(runs: int, quick: bool) -> StormResult:
    spec = StormSpec(nodes=QUICK_NODES) if quick else StormSpec()
    storm_runs: list[RunResult] = []
    baseline: list[TemporalAlone] = []
    with tempfile.TemporaryDirectory(prefix="bench-storm-") as tmp:
        for i in range(runs):
            storm_runs.append(await run_once(spec, Path(tmp)))
            baseline.append(await temporal_alone(storm_runs[-1].temporal_calls, spec, Path(tmp)))
            say(
                f"storm run {i + 1}: {storm_runs[-1].alerts_per_s} alerts/s, p99 {storm_runs[-1].p99_ms} ms; "
                f"Temporal alone {baseline[-1].seconds:.2f} s for {storm_runs[-1].temporal_calls}"
            )
    return StormResult(spec, summary(spec, storm_runs), baseline)


async def temporal_alone(calls: dict[str, int], spec: StormSpec, workdir: Path) -> TemporalAlone:
    """The storm's Temporal calls, straight: first every incident opened, then every join, each by
    one of `spec.clients` concurrent callers."""
    opens, joins = calls.get("join_or_open", 0), calls.get("join", 0)
    nodes = [f"gpu-{n:04d}" for n in range(opens)]
    latencies: list[float] = []
    runs: dict[str, str] = {}  # node -> the run opened, which the joins address as the hook's do
    with temporal_dev_server(workdir, TEMPORAL_DBS[spec.temporal_db]) as (_, address):
        client = await connect(Settings(TEMPORAL_ADDRESS=address), **CLIENT_OPTIONS)
        incidents = TemporalIncidents(client, "bench", RecoveryPolicy())

        async def drive(work: list[tuple[str, str, int]]) -> None:
            queue = iter(work)

            async def caller() -> None:
                for call, node, xid in queue:
                    alert = NodeFailureAlert(node=node, xid=xid, source="bench", actor="bench storm baseline")
                    started = time.perf_counter()
                    if call == "join_or_open":
                        runs[node] = await incidents.join_or_open(node, [alert])
                    else:
                        await incidents.join(node, [alert], runs[node])
                    latencies.append(time.perf_counter() - started)

            await asyncio.gather(*(caller() for _ in range(spec.clients)))

        started = time.perf_counter()
        await drive([("join_or_open", node, 79) for node in nodes])
        await drive([("join", nodes[i % len(nodes)], 74) for i in range(joins)])
        seconds = time.perf_counter() - started
    return TemporalAlone(seconds, percentile(latencies, 0.99) * 1000)
