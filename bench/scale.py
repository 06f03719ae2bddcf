"""Throughput and scale: N concurrent incidents (N = 10, 100, 1,000) through drain and signal, on
the scale harness (bench/harness.py: Slurm's answers from memory, with each call's latency as
measured on the real local cluster in the same run), the real workflow and activities in a real
worker process, and a fresh in-memory Temporal dev server per N.

Per N, once one more incident has warmed the worker up (its first imports and connections;
a worker in service is long-running): the N alerts are handed to Temporal (signal-with-start, 32
at a time) and the clock runs from the first hand-over until every node is drained and its job
signalled, by the harness's own call log: nodes/s = N / that time. The incidents then run to
their end (requeue, down, the spare, verify: the harness answers all of it) and are checked:
every one must end "recovered". The worker's peak RSS (VmHWM) and the CPU seconds per incident
(worker and Temporal server, from first hand-over to the last incident's end) come from /proc.

Baselines: for throughput, the same drain and signal calls issued straight to the harness by a
bare asyncio script, all N at once (what Slurm's latency alone allows); for RSS, the worker at
rest after the warm-up; for CPU per incident, the same figure at the smallest N of the run
(flat = the ratio stays near 1).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client

from bench import reaction
from bench.harness import OPERATIONS, ScaleSlurm, node_name, spare_name
from bench.profile import (
    HISTORY_KINDS,
    WorkflowTaskWaits,
    activity_timeline,
    history_counts,
    history_of,
    median_timeline,
    render_timeline,
)
from bench.services import cpu_seconds, machine_busy_seconds, process, temporal_dev_server
from bench.stack import BenchStack, say
from bench.table import Row, goal, median, percentile, row
from contracts.models import NodeFailureAlert, RecoveryPolicy
from contracts.search_attributes import outcome_label
from contracts.settings import Settings
from drills.localstack import REPO, StackError, wait_async
from starter.alerts import raise_alerts
from worker import build_slurm, connect
from workflows.fleet_budget import fleet_budget_workflow_id
from workflows.node_recovery import NodeRecoveryWorkflow, incident_workflow_id

TASK_QUEUE = "bench-scale"
HANDOVER_CONCURRENCY = 32
RESTART_DELAY_SECONDS = 2.0  # a released job runs again (the real local cluster: ~10 s, cred_expire)
LABEL = "(scale harness, not real Slurm)"
SAMPLED_TIMELINES = 5


# --- the latencies, measured on the real cluster ---------------------------------------------------


async def calibrate(bench: BenchStack, samples: int = 5) -> tuple[dict[str, float], dict[str, str]]:
    """Median seconds of each Slurm operation as the worker makes it (same routing, CLI or REST),
    on the real local cluster; and the path each took."""
    settings = Settings(
        TEMPORAL_ADDRESS=bench.settings.temporal_address,
        SLURM_CONF=bench.cluster["SLURM_CONF"],
        SLURM_BIN_DIR=bench.cluster.get("SLURM_BIN_DIR", ""),
        SLURMRESTD_URL=bench.cluster["SLURMRESTD_URL"],
        SLURMRESTD_USER=bench.cluster["SLURMRESTD_USER"],
        SLURMRESTD_TOKEN_FILE=bench.cluster["SLURMRESTD_TOKEN_FILE"],
    )
    timings: dict[str, list[float]] = {op: [] for op in OPERATIONS}

    async def timed(operation: str, call: Awaitable) -> None:
        started = time.perf_counter()
        await call
        timings[operation].append(time.perf_counter() - started)

    probes = await reaction.start_probes(bench, "calibration")
    wide, narrow = probes.job_ids
    other = next(n for n in (await bench.slurm.get_job(wide)).nodes if n != probes.node)
    async with AsyncExitStack() as stack:
        slurm = await build_slurm(settings, stack)
        for i in range(samples):
            await timed("get_node", slurm.get_node(probes.node))
            await timed("list_nodes", slurm.list_nodes())
            await timed("list_jobs", slurm.list_jobs())
            await timed("get_job", slurm.get_job(wide))
            await timed("update_node", slurm.update_node(probes.node, "DRAIN", "recovery: bench calibration"))
            await timed("update_node", slurm.update_node(probes.node, "RESUME", None))
            await timed("set_node_comment", slurm.set_node_comment(probes.node, f"bench calibration {i}"))
            await timed("signal_job", slurm.signal_job(wide, "USR1"))
        for job_id in probes.job_ids:
            await timed("requeue_hold", slurm.requeue_hold(job_id))
            await wait_async(lambda: _pending(bench, job_id), 30, f"job {job_id} to be requeued")  # noqa: B023 (awaited here)
            for _ in range(samples // 2 + 1):  # Slurm takes excluded nodes only while a job is pending
                await timed("set_excluded_nodes", slurm.set_excluded_nodes(job_id, [other]))
                await timed("set_required_nodes", slurm.set_required_nodes(job_id, []))
            await timed("release_job", slurm.release_job(job_id))
        await slurm.set_node_comment(probes.node, "")
        paths = {op: slurm.path_for(op) for op in OPERATIONS}
    await reaction.reset(bench)
    return {op: statistics.median(t) for op, t in timings.items()}, paths


async def _pending(bench: BenchStack, job_id: int) -> bool:
    return (await bench.slurm.get_job(job_id)).state == "PENDING"


# --- one N ---------------------------------------------------------------------------------------


@dataclass
class CpuSample:
    """CPU seconds so far: the worker, the Temporal server, this process, the whole machine."""

    worker: float
    temporal: float
    bench: float
    machine: float

    def others_since(self, before: CpuSample) -> float:
        """CPU seconds that other processes on the machine took meanwhile (other jobs skew the figures)."""
        ours = (self.worker - before.worker) + (self.temporal - before.temporal) + (self.bench - before.bench)
        return max(0.0, self.machine - before.machine - ours)


@dataclass
class ScaleRun:
    nodes: int
    seconds_to_drain_and_signal: float
    nodes_per_s: float
    bare_nodes_per_s: float
    handover_seconds: float
    incident_p50: float  # first hand-over -> this node drained and its job signalled
    incident_p99: float
    seconds_to_finish: float
    outcomes: dict[str, int]
    worker_cpu_per_incident: float  # first hand-over -> every incident ended
    temporal_cpu_per_incident: float
    worker_cpu_to_signal: float  # per incident, first hand-over -> every node drained and signalled
    temporal_cpu_to_signal: float
    other_cores: float  # what other processes on the machine used meanwhile
    worker_idle_rss_mib: float
    worker_peak_rss_mib: float
    timeline: list[tuple[str, float]] = field(default_factory=list)
    # per incident, from the histories of sampled incidents (median) and the fleet budget's (all runs / N)
    history: dict[str, float] = field(default_factory=dict)
    budget_tasks: WorkflowTaskWaits = field(default_factory=WorkflowTaskWaits)  # every run of the fleet budget

    def summary(self) -> str:
        return (
            f"N={self.nodes}: drained+signalled in {self.seconds_to_drain_and_signal:.2f} s "
            f"({self.nodes_per_s:.0f} nodes/s; bare script {self.bare_nodes_per_s:.0f}/s), hand-over "
            f"{self.handover_seconds:.2f} s, per incident p50 {self.incident_p50:.2f} s p99 "
            f"{self.incident_p99:.2f} s; all ended after {self.seconds_to_finish:.1f} s {self.outcomes}; "
            f"CPU per incident: worker {self.worker_cpu_per_incident * 1000:.1f} ms, Temporal "
            f"{self.temporal_cpu_per_incident * 1000:.1f} ms (until all signalled: "
            f"{self.worker_cpu_to_signal * 1000:.1f} + {self.temporal_cpu_to_signal * 1000:.1f} ms); "
            f"worker RSS {self.worker_idle_rss_mib:.0f} -> peak {self.worker_peak_rss_mib:.0f} MiB; "
            f"other processes {self.other_cores:.2f} cores; per incident: "
            + ", ".join(f"{v:g} {k}" for k, v in self.history.items())
            + f"; the fleet budget's workflow tasks: {self.budget_tasks.summary()}"
        )


async def run_once(nodes: int, latency: dict[str, float], workdir: Path) -> ScaleRun:
    bare = await bare_drain_and_signal(nodes, latency)
    call_log, ready, log = workdir / f"calls-{nodes}.log", workdir / f"ready-{nodes}", workdir / f"worker-{nodes}.log"
    ready.unlink(missing_ok=True)
    measured, warm_up = range(nodes), nodes  # one more node, whose incident warms the worker up
    with (
        temporal_dev_server(workdir) as (temporal, address),
        scale_worker(nodes + 1, latency, address, call_log, ready, log) as worker,
    ):
        await wait_async(lambda: _ready(ready, worker, log), 60, "the scale worker to poll")
        client = await connect(Settings(TEMPORAL_ADDRESS=address))
        await hand_over(client, [warm_up])
        await client.get_workflow_handle(incident_workflow_id(node_name(warm_up))).result()
        idle_rss = _rss_mib(worker.pid, "VmRSS")

        def cpu() -> CpuSample:
            return CpuSample(
                cpu_seconds(worker.pid), cpu_seconds(temporal.pid), time.process_time(), machine_busy_seconds()
            )

        cpu_before = cpu()
        started = time.time()
        handover_seconds = await hand_over(client, measured)
        done_at = await _drained_and_signalled(call_log, {node_name(i) for i in measured}, timeout=60 + nodes)
        cpu_at_signal = cpu()
        await _all_ended(client, nodes + 1, timeout=120 + nodes)
        finished = time.time()
        cpu_after = cpu()
        peak_rss = _rss_mib(worker.pid, "VmHWM")
        outcomes = await _outcomes(client, nodes)
        timeline = median_timeline(
            [
                await activity_timeline(
                    client.get_workflow_handle(incident_workflow_id(node_name(i))),
                    datetime.fromtimestamp(started, timezone.utc),
                    "signal_job",
                )
                for i in _sample(nodes)
            ]
        )
        budget = await _budget_histories(client)
        history = await _history_per_incident(client, nodes, budget)
        # Every incident waits on the budget's answers: a budget task that waits in a queue holds
        # up every incident that asked.
        budget_tasks = WorkflowTaskWaits()
        for events in budget:
            budget_tasks.add(events)
    per_incident = [t - started for t in done_at.values()]
    seconds = max(per_incident)
    return ScaleRun(
        nodes=nodes,
        seconds_to_drain_and_signal=seconds,
        nodes_per_s=nodes / seconds,
        bare_nodes_per_s=bare,
        handover_seconds=handover_seconds,
        incident_p50=percentile(per_incident, 0.5),
        incident_p99=percentile(per_incident, 0.99),
        seconds_to_finish=finished - started,
        outcomes=outcomes,
        worker_cpu_per_incident=(cpu_after.worker - cpu_before.worker) / nodes,
        temporal_cpu_per_incident=(cpu_after.temporal - cpu_before.temporal) / nodes,
        worker_cpu_to_signal=(cpu_at_signal.worker - cpu_before.worker) / nodes,
        temporal_cpu_to_signal=(cpu_at_signal.temporal - cpu_before.temporal) / nodes,
        other_cores=cpu_after.others_since(cpu_before) / (finished - started),
        worker_idle_rss_mib=idle_rss,
        worker_peak_rss_mib=peak_rss,
        timeline=timeline,
        history=history,
        budget_tasks=budget_tasks,
    )


async def bare_drain_and_signal(nodes: int, latency: dict[str, float]) -> float:
    """Nodes/s for the reaction's calls (drain, the node's jobs, signal each) issued straight to
    the harness, all nodes at once: the rate Slurm's latency alone allows."""
    harness = ScaleSlurm(nodes, latency)

    async def one(i: int) -> None:
        node = node_name(i)
        await harness.update_node(node, "DRAIN", "recovery: bench baseline")
        for job in await harness.jobs_on(node):
            await harness.signal_job(job.job_id, "USR1")

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(nodes)))
    return nodes / (time.perf_counter() - started)


async def hand_over(client: Client, nodes: Iterable[int]) -> float:
    """One XID 79 alert per node, each node with its own hot spare; seconds the hand-overs took."""
    gate = asyncio.Semaphore(HANDOVER_CONCURRENCY)

    async def one(i: int) -> None:
        alert = NodeFailureAlert(
            node=node_name(i),
            xid=79,
            source="bench",
            actor="bench scale",
            reason=f"benchmark: XID 79 on {node_name(i)}",
        )
        policy = RecoveryPolicy(spare_nodes=[spare_name(i)], spare_wait_seconds=120, verify_deadline_seconds=300)
        async with gate:
            await raise_alerts(client, [alert], TASK_QUEUE, policy)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in nodes))
    return time.perf_counter() - started


@contextmanager
def scale_worker(
    nodes: int, latency: dict[str, float], address: str, call_log: Path, ready: Path, log: Path
) -> Iterator[subprocess.Popen]:
    """The worker process on the harness; stopped (SIGTERM, then SIGKILL) on exit."""
    argv = [
        sys.executable,
        "-m",
        "bench.scale_worker",
        "--nodes",
        str(nodes),
        "--latency",
        json.dumps(latency),
        "--restart-delay",
        str(RESTART_DELAY_SECONDS),
        "--call-log",
        str(call_log),
        "--ready",
        str(ready),
    ]
    # The fleet budget and its fence circuit breaker run (their cost is part of each incident) with
    # room for every node at once.
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": address,
        "RECOVERY_TASK_QUEUE": TASK_QUEUE,
        "RECOVERY_HEALTH_CHECK": "",
        "RECOVERY_LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(REPO),
        "RECOVERY_BUDGET_MAX_NODES": str(nodes),
        "RECOVERY_BUDGET_PARTITION_FRACTION": "1",
        "RECOVERY_BUDGET_MAX_DISRUPTED_JOBS": str(nodes),
        "RECOVERY_BREAKER_MAX_FENCES": str(nodes),
        "RECOVERY_BREAKER_FLEET_FRACTION": "1",
        "RECOVERY_BREAKER_PARTITION_FRACTION": "1",
        # Each incident names its own spare (one per node of the harness): a drill worker's setting.
        "RECOVERY_ACCEPT_STARTER_POLICY": "true",
    }
    with process(argv, env, log, cwd=REPO) as proc:
        yield proc


async def _ready(path: Path, proc: subprocess.Popen, log: Path) -> bool:
    if proc.poll() is not None:
        raise StackError(f"the scale worker exited with {proc.returncode}: {log.read_text()[-2000:]}")
    return path.exists()


def _rss_mib(pid: int, field_name: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    raise StackError(f"no {field_name} for process {pid}")


async def _drained_and_signalled(call_log: Path, nodes: set[str], timeout: float) -> dict[str, float]:
    """When each of `nodes` was drained and its job signalled (the later of the two), from the
    call log."""
    drained: dict[str, float] = {}
    signalled: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    unfinished = ""  # a line the worker is still writing
    with call_log.open() as log:
        while len(drained) < len(nodes) or len(signalled) < len(nodes):
            *lines, unfinished = (unfinished + log.read()).split("\n")
            for line in lines:
                at, operation, target, *detail = line.split()
                if operation == "update_node" and detail == ["DRAIN"] and target in nodes:
                    drained.setdefault(target, float(at))
                elif operation == "signal_job" and node_name(int(target) - 1) in nodes:
                    signalled.setdefault(node_name(int(target) - 1), float(at))
            if time.monotonic() > deadline:
                raise StackError(
                    f"after {timeout:.0f} s: {len(drained)} of {len(nodes)} nodes drained, "
                    f"{len(signalled)} jobs signalled"
                )
            await asyncio.sleep(0.05)
    return {node: max(drained[node], signalled[node]) for node in drained}


async def _all_ended(client: Client, nodes: int, timeout: float) -> None:
    async def ended() -> bool:
        running = await client.count_workflows("WorkflowType='NodeRecoveryWorkflow' AND ExecutionStatus='Running'")
        total = await client.count_workflows("WorkflowType='NodeRecoveryWorkflow'")
        return total.count == nodes and running.count == 0

    await wait_async(ended, timeout, f"all {nodes} incidents to end", interval=0.5)


async def _outcomes(client: Client, nodes: int) -> dict[str, int]:
    gate = asyncio.Semaphore(16)
    counts: dict[str, int] = {}

    async def one(i: int) -> None:
        async with gate:
            report = await client.get_workflow_handle_for(
                NodeRecoveryWorkflow.run, incident_workflow_id(node_name(i))
            ).result()
        outcome = outcome_label(report.outcome)
        counts[outcome] = counts.get(outcome, 0) + 1

    await asyncio.gather(*(one(i) for i in range(nodes)))
    return counts


async def _history_per_incident(client: Client, nodes: int, budget: list[list[HistoryEvent]]) -> dict[str, float]:
    """What an incident asks of the server, counted: the median over sampled incidents of each
    kind of history event, and the fleet budget's events (every run of it) per incident."""
    counts = [
        history_counts(await history_of(client.get_workflow_handle(incident_workflow_id(node_name(i)))))
        for i in _sample(nodes)
    ]
    history = {kind: median(c[kind] for c in counts) or 0 for kind in ["events", *HISTORY_KINDS]}
    history["fleet budget events"] = round(sum(map(len, budget)) / (nodes + 1), 1)  # + the warm-up incident
    return history


async def _budget_histories(client: Client) -> list[list[HistoryEvent]]:
    """Every run of the fleet budget's history."""
    return [
        await history_of(client.get_workflow_handle(run.id, run_id=run.run_id))
        async for run in client.list_workflows(f"WorkflowId = '{fleet_budget_workflow_id(TASK_QUEUE)}'")
    ]


def _sample(nodes: int) -> list[int]:
    return sorted({round(k * (nodes - 1) / (SAMPLED_TIMELINES - 1)) for k in range(SAMPLED_TIMELINES)})


# --- all Ns ----------------------------------------------------------------------------------------


@dataclass
class ScaleResult:
    runs: dict[int, list[ScaleRun]]
    latency: dict[str, float]
    paths: dict[str, str]

    def median_of(self, nodes: int, name: str) -> float:
        return median(getattr(r, name) for r in self.runs[nodes]) or 0.0

    def rows(self) -> list[Row]:
        sizes = sorted(self.runs)
        smallest, largest = sizes[0], sizes[-1]
        rows = []
        for n in sizes:
            rows.append(
                row(
                    f"scale N={n:,}: drain+signal throughput {LABEL}",
                    self.median_of(n, "nodes_per_s"),
                    "nodes/s",
                    self.median_of(n, "bare_nodes_per_s"),
                    goal("value >= 50"),
                    digits=1,
                )
            )
        for n in sizes:
            rows.append(
                row(
                    f"scale N={n:,}: worker CPU per incident {LABEL}",
                    self.median_of(n, "worker_cpu_per_incident") * 1000,
                    "ms",
                    self.median_of(smallest, "worker_cpu_per_incident") * 1000,
                    goal("ratio <= 1.5", note="flat") if n != smallest else None,
                    digits=1,
                )
            )
        rows.append(
            row(
                f"scale N={largest:,}: worker peak RSS {LABEL}",
                self.median_of(largest, "worker_peak_rss_mib"),
                "MiB",
                self.median_of(largest, "worker_idle_rss_mib"),
                goal("value <= 1024"),
                digits=0,
            )
        )
        return rows

    def details(self) -> str:
        runs = {n: len(r) for n, r in self.runs.items()}
        lines = [
            f"  runs per N {runs}; baselines: throughput, the same calls from a bare script straight to the "
            f"harness; CPU, the smallest N; RSS, the worker at rest",
            "  latency per call (median, real local cluster, this run): "
            + ", ".join(f"{op} {s * 1000:.1f} ms ({self.paths[op]})" for op, s in self.latency.items()),
        ]
        for n in sorted(self.runs):
            lines += [f"  {r.summary()}" for r in self.runs[n]]
            lines.append(
                f"  N={n}: where an incident's time to signal goes (median of {SAMPLED_TIMELINES} sampled "
                "incidents, from the first hand-over):"
            )
            lines.append(render_timeline(median_timeline([r.timeline for r in self.runs[n]])))
        return "\n".join(lines)


async def run(
    latency: dict[str, float], paths: dict[str, str], sizes: list[int], runs: int, progress: Callable[[str], None] = say
) -> ScaleResult:
    result = ScaleResult({}, latency, paths)
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for n in sizes:
            result.runs[n] = []
            for i in range(runs):
                scale_run = await run_once(n, latency, Path(tmp))
                if scale_run.outcomes.get("recovered") != n:
                    raise StackError(f"scale N={n}: not every incident recovered: {scale_run.outcomes}")
                result.runs[n].append(scale_run)
                progress(f"scale run {i + 1} {scale_run.summary()}")
    return result
