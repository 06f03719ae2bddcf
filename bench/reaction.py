"""Reaction: from an alert's acceptance to its node drained in Slurm and every job on the node
signalled, on the real local Slurm cluster, against the same calls issued by a bare script.

Each run puts two probe jobs on the node to fail (a 2-node job, its last node being that node, and
a 1-node job there). A probe job records, in its own file, the moment each SIGUSR1 reaches it: so
"signalled" is the job's own observation, not the sender's.

  ours      the alert is handed to Temporal as the drill sends it (signal-with-start); the clock
            starts when that call returns (the alert is accepted: durable in Temporal). "Drained"
            is the incident's drain action, recorded once the activity read the node back from
            Slurm as drained. The incident is aborted once measured, as an operator would (its
            requeue and the rest are not part of the reaction; it returns its lease from the fleet
            disruption budget as it ends, which a terminated run cannot), and the cluster reset.
  baseline  a bare bash script issues the calls an operator's script would: `scontrol update
            NodeName=N State=DRAIN Reason=...`, `squeue -w N` for the jobs, `scancel
            --signal=USR1 --full` for each; the clock starts when it is spawned. "Drained" is
            when its scontrol returned.

reaction = max(drained, last signal received) - start. Each of our runs is also broken down
from the incident's Temporal history (bench/profile.py). A first incident warms the worker up and
is not counted.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench.profile import activity_timeline, median_timeline, render_timeline
from bench.stack import BenchStack, say
from bench.table import Row, goal, median, percentile, row
from contracts.models import NodeFailureAlert
from drills.localstack import StackError, wait_async
from starter.alerts import raise_alert
from starter.decisions import decide
from workflows.node_recovery import NodeRecoveryWorkflow

PROBE_JOB_NAME = "bench-probe"
# A job that records when SIGUSR1 reaches it ($EPOCHREALTIME: no fork); `wait` returns at once
# when a trapped signal arrives, so the trap runs without waiting for the sleep.
PROBE_SCRIPT = """#!/bin/bash
signals=$1/signals-$SLURM_JOB_ID
trap 'echo "$EPOCHREALTIME" >> "$signals"' USR1
trap 'exit 143' TERM
touch "$1/ready-$SLURM_JOB_ID"
while true; do sleep 60 & wait $!; done
"""
BASELINE_SCRIPT = """
scontrol update NodeName="$1" State=DRAIN Reason="$2" || exit 1
echo "drained $EPOCHREALTIME"
for job in $(squeue -h -w "$1" -t RUNNING -o %A); do scancel --signal=USR1 --full "$job" || exit 1; done
"""
REACTION_GOAL = goal("value <= 0.5", "ratio <= 1.5", note="NVSentinel: 1.8 s")
TIMEOUT_SECONDS = 30.0


@dataclass
class Reaction:
    seconds: float  # start -> drained and every job signalled (the jobs' own record)
    drained_after: float
    signalled_after: list[float]
    by_actions: float | None = None  # ours: the same end from the incident's action records
    timeline: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class ReactionResult:
    warm_up: Reaction  # ours, the first incident the worker runs: not counted
    ours: list[Reaction]
    baseline: list[Reaction]

    def rows(self) -> list[Row]:
        ours = [r.seconds for r in self.ours]
        base = [r.seconds for r in self.baseline]
        return [
            row(
                "reaction p50: alert accepted -> drained + jobs signalled (real Slurm)",
                median(ours),
                "s",
                median(base),
                REACTION_GOAL,
            ),
            row("reaction p90 (real Slurm)", percentile(ours, 0.9), "s", percentile(base, 0.9)),
        ]

    def details(self) -> str:
        def ms(values) -> str:
            return ", ".join(f"{v * 1000:.0f}" for v in values)

        lines = [
            f"  {len(self.ours)} runs each; baseline: the same scontrol/squeue/scancel calls from a bare bash "
            "script; ours from the alert's hand-over to Temporal; 2 probe jobs on the node",
            f"  ours:     {ms(r.seconds for r in self.ours)} ms (by the incident's action records: "
            f"{ms(r.by_actions or 0 for r in self.ours)} ms)",
            f"  baseline: {ms(r.seconds for r in self.baseline)} ms",
            f"  not counted: the worker's first incident, {self.warm_up.seconds * 1000:.0f} ms (its first "
            "imports and connections; a worker in service is long-running)",
            "  where our reaction goes (median per segment, from the incident's Temporal history):",
            render_timeline(median_timeline([r.timeline for r in self.ours])),
            f"    against a median reaction of {median([r.seconds for r in self.ours]) * 1000:.0f} ms: "
            f"the history does not show the rest (a local activity's marker keeps the workflow's clock, "
            "which starts when the server hands the first workflow task over, not when the worker's code "
            "takes it up), nor the signal's way to the jobs",
        ]
        return "\n".join(lines)


@dataclass
class Probes:
    run_dir: Path
    node: str
    job_ids: list[int]

    def signal_times(self) -> dict[int, float]:
        """Each job's first SIGUSR1, as the job recorded it (epoch seconds)."""
        times = {}
        for job_id in self.job_ids:
            path = self.run_dir / f"signals-{job_id}"
            if path.exists() and (text := path.read_text().split()):
                times[job_id] = float(text[0])
        return times


async def warm_up(bench: BenchStack) -> Reaction:
    """One incident, not counted: the worker's first pays for its first imports and
    connections, which a worker in service (long-running) has behind it."""
    reaction = await react_ours(bench, await start_probes(bench, "warm-up"))
    say(f"warm-up incident (not counted): reaction {reaction.seconds * 1000:.0f} ms")
    return reaction


async def run(bench: BenchStack, runs: int) -> ReactionResult:
    result = ReactionResult(await warm_up(bench), [], [])
    for i in range(runs):
        # alternate which goes first, so that neither always meets a cluster fresh from a reset
        for kind in ("ours", "baseline") if i % 2 == 0 else ("baseline", "ours"):
            probes = await start_probes(bench, f"{kind}-{i + 1}")
            if kind == "ours":
                reaction = await react_ours(bench, probes)
                result.ours.append(reaction)
            else:
                reaction = await react_baseline(bench, probes)
                result.baseline.append(reaction)
            say(
                f"reaction run {i + 1} {kind}: {reaction.seconds * 1000:.0f} ms (drained after "
                f"{reaction.drained_after * 1000:.0f} ms, jobs signalled after "
                f"{', '.join(f'{s * 1000:.0f}' for s in reaction.signalled_after)} ms)"
            )
    await reset(bench)
    return result


async def reset(bench: BenchStack) -> None:
    await bench.slurm.run("scancel", f"--name={PROBE_JOB_NAME}")
    await bench.drill(log=lambda _: None).reset_cluster()


async def start_probes(bench: BenchStack, label: str) -> Probes:
    await reset(bench)
    run_dir = bench.stack.slurm_base / "bench" / f"reaction-{datetime.now(timezone.utc):%Y%m%dT%H%M%S%f}-{label}"
    run_dir.mkdir(parents=True)
    script = run_dir / "probe.sbatch"
    script.write_text(PROBE_SCRIPT)
    common = [
        "sbatch",
        "--parsable",
        f"--job-name={PROBE_JOB_NAME}",
        "--ntasks-per-node=1",
        f"--chdir={run_dir}",
        f"--output={run_dir}/slurm-%j.out",
    ]
    wide = int((await bench.slurm.run(*common, "--nodes=2", str(script), str(run_dir))).split(";")[0])
    job = await wait_async(lambda: _running(bench, wide), 60, f"probe job {wide} to run")
    node = job.nodes[-1]
    narrow = int(
        (await bench.slurm.run(*common, "--nodes=1", f"--nodelist={node}", str(script), str(run_dir))).split(";")[0]
    )
    probes = Probes(run_dir, node, [wide, narrow])

    async def ready() -> bool:
        return all((run_dir / f"ready-{j}").exists() for j in probes.job_ids)

    await wait_async(ready, 60, "the probe jobs to trap SIGUSR1")
    return probes


async def _running(bench: BenchStack, job_id: int):
    job = await bench.slurm.get_job(job_id)
    return job if job.state == "RUNNING" else None


async def _all_signalled(probes: Probes) -> dict[int, float]:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while len(times := probes.signal_times()) < len(probes.job_ids):
        if time.monotonic() > deadline:
            raise StackError(f"jobs {probes.job_ids} on {probes.node} not all signalled within {TIMEOUT_SECONDS:.0f} s")
        await asyncio.sleep(0.005)
    return times


async def react_ours(bench: BenchStack, probes: Probes) -> Reaction:
    alert = NodeFailureAlert(
        node=probes.node, xid=79, source="bench", actor="bench reaction", reason=f"benchmark: XID 79 on {probes.node}"
    )
    handle = await raise_alert(bench.client, alert, bench.stack.task_queue, bench.policy)
    accepted = time.time()
    received = await _all_signalled(probes)

    async def actions_recorded():
        status = await handle.query(NodeRecoveryWorkflow.status)
        signals = [a for a in status.actions if a.action == "signal_job"]
        return status.actions if len(signals) >= len(probes.job_ids) else None

    actions = await wait_async(actions_recorded, TIMEOUT_SECONDS, "the incident's signal actions", interval=0.05)
    await decide(handle, "abort", bench.stack.operator_signer(), "benchmark: reaction measured")
    await handle.result()  # ended, and its lease returned to the budget before the next run's incident
    drained = next(a.at.timestamp() for a in actions if a.action == "drain_node")
    signal_actions = [a.at.timestamp() for a in actions if a.action == "signal_job"]
    node = await bench.slurm.get_node(probes.node)
    if not (node.drained and node.reason.startswith(f"{bench.policy.owner}:")):
        raise StackError(f"{probes.node} is not drained by the incident: {node.state} {node.flags} {node.reason!r}")
    timeline = await activity_timeline(
        handle, datetime.fromtimestamp(accepted, timezone.utc), "signal_job", occurrences=len(probes.job_ids)
    )
    return Reaction(
        seconds=max(drained, *received.values()) - accepted,
        drained_after=drained - accepted,
        signalled_after=[t - accepted for t in received.values()],
        by_actions=max(drained, *signal_actions) - accepted,
        timeline=timeline,
    )


async def react_baseline(bench: BenchStack, probes: Probes) -> Reaction:
    reason = f"{bench.policy.owner}: bench baseline XID 79"
    started = time.time()
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        BASELINE_SCRIPT,
        "baseline",
        probes.node,
        reason,
        env=bench.slurm_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise StackError(f"the baseline script failed: {err.decode().strip()}")
    drained = float(out.decode().split()[1])
    received = await _all_signalled(probes)
    return Reaction(
        seconds=max(drained, *received.values()) - started,
        drained_after=drained - started,
        signalled_after=[t - started for t in received.values()],
    )
