"""`python -m bench [BENCHMARK] [--json] [--runs N] [--quick]`: benchmarks on this machine, each
figure next to its baseline measured in the same run.

  (none)     every benchmark below, one table
  reaction   alert accepted -> node drained and every job on it signalled (real Slurm)
  resume     time to resume and lost progress after XID 79, against Slurm's own node-failure
             handling at its default SlurmdTimeout (300 s: over five minutes a run)
  degrading  a degrading XID: training lost with the grace checkpoint and without
  expedite   time to resume for a job submitted --requeue=expedite against --requeue (Slurm 26.05)
  scale      N = 10, 100, 1,000 concurrent incidents through drain and signal (scale harness)
  storm      the alert storm against the hooks (its own options and output, bench/storm.py)
  checkpoints  polls for the latest complete checkpoint of many large ones: the checkpoint store
             against verifying every one on every poll (files only)
  fleet      a real slurmctld with 2,000 cloud nodes and 64 slurmd: its start, memory, and one
             full node listing (time, bytes, slurmctld RPCs) against a 5-node cluster

The real-Slurm benchmarks run on the bench's own local stack (bench/stack.py: its own state dir
and ports; what it starts, it stops). Each prints the machine's facts (cores, load, versions) and
medians over --runs runs (defaults: reaction 5, resume 1, degrading 3, expedite 3, scale 3, storm 3,
checkpoints 3, fleet 3);
--quick is a short smoke run (fewer runs, N up to 100, a 50-node storm, 20 checkpoints of 2 MB, a
fleet of 8 slurmd and 200 cloud nodes, and the resume baseline at the local stack's SlurmdTimeout of
10 s instead of Slurm's default).

Output: the table and, below it, each benchmark's runs and profile; with --json, the list of rows
(name, value, unit, baseline, ratio, goal, met) on stdout and everything else on stderr.
Exit status: 0 when every benchmark ran to the end, whether or not its goals were met (`met`
says); 1 when one could not be run or measured (the others still are, and their rows printed).

`python -m bench storm [--json]` keeps its own output: one JSON object (the storm's figures and
every run); exit 1 when a run did not make exactly one incident per node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from bench import checkpoints, degrading, expedite, fleet, reaction, resume, scale, storm_table
from bench.stack import SLURM_DEFAULT_SLURMD_TIMEOUT, bench_stack, say
from bench.storm import StormSpec, run_once, summary
from bench.table import Row, machine, render

REAL_SLURM = ("reaction", "resume", "degrading")
ALL = (*REAL_SLURM, "expedite", "scale", "storm", "checkpoints", "fleet")
DEFAULT_RUNS = {
    "reaction": 5,
    "resume": 1,
    "degrading": 3,
    "expedite": 3,
    "scale": 3,
    "storm": 3,
    "checkpoints": 3,
    "fleet": 3,
}
QUICK_RUNS = dict.fromkeys(DEFAULT_RUNS, 1) | {"reaction": 2}
SCALE_SIZES, QUICK_SCALE_SIZES = [10, 100, 1000], [10, 100]


# --- the storm, as it always was ---------------------------------------------------------------


async def storm(args: argparse.Namespace) -> int:
    spec = StormSpec(nodes=args.nodes, copies=args.copies, clients=args.clients, seed=args.seed)
    facts = machine()
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else print
    say(f"machine: {json.dumps(facts)}")
    say(
        f"storm: {spec.alerts} alerts over {spec.nodes} nodes ({spec.nodes * spec.distinct_per_node} distinct, "
        f"each payload sent {spec.copies} times, shuffled) from {spec.clients} clients; {args.runs} runs"
    )
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-storm-") as tmp:
        for i in range(args.runs):
            run = await run_once(spec, Path(tmp))
            runs.append(run)
            say(
                f"run {i + 1}: {run.alerts_per_s} alerts/s ({run.requests_per_s} requests/s), p50 {run.p50_ms} ms, "
                f"p99 {run.p99_ms} ms, max {run.max_ms} ms; by kind {run.latency_by_kind}; "
                f"incidents {run.incidents}/{run.nodes}; "
                f"outcomes {run.outcomes}; errors {run.errors}; Temporal calls {run.temporal_calls}; "
                f"CPU cores used {run.cpu_cores}"
            )
    result = {
        "benchmark": "storm",
        "command": "python -m bench storm" + (" --json" if args.json else ""),
        "machine": facts,
    } | summary(spec, runs)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"median of {args.runs}: {result['alerts_per_s']} alerts/s, p50 {result['p50_ms']} ms, "
            f"p99 {result['p99_ms']} ms; incidents {result['incidents']} for {spec.nodes} nodes; "
            f"{'ok' if result['ok'] else 'NOT ok'}"
        )
    return 0 if result["ok"] else 1


# --- the table -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one benchmark gave: its rows and its details (runs, profile), or why it has none."""

    name: str
    rows: list[Row]
    details: str
    failed: str | None = None


class Runner:
    def __init__(self, selected: tuple[str, ...], runs: int | None, quick: bool) -> None:
        self.selected, self.quick = selected, quick
        self.runs = {name: runs or (QUICK_RUNS if quick else DEFAULT_RUNS)[name] for name in ALL}
        self.outcomes: dict[str, Outcome] = {}
        # the scale harness's latency per Slurm call and each call's path, measured on the real cluster
        self.calibration: tuple[dict[str, float], dict[str, str]] | None = None

    async def measure(self, name: str, work: Callable[[], Awaitable]) -> object | None:
        """Run one benchmark; a failure is recorded (and printed) and the others go on."""
        try:
            return await work()
        except Exception as e:  # noqa: BLE001 - any failure of one benchmark is reported, not fatal
            say(f"{name}: FAILED: {e}\n{traceback.format_exc()}")
            self.outcomes[name] = Outcome(name, [], "", failed=f"{type(e).__name__}: {e}")
            return None

    def keep(self, name: str, result) -> None:
        if result is not None:
            self.outcomes[name] = Outcome(name, result.rows(), result.details())

    async def run(self) -> None:
        if any(n in self.selected for n in (*REAL_SLURM, "scale")):
            await self.measure("stack", self._on_real_slurm)
        if "expedite" in self.selected:
            await self.measure("expedite", self._on_newest_slurm)
        if "scale" in self.selected and self.calibration is not None:
            latency, paths = self.calibration
            sizes = QUICK_SCALE_SIZES if self.quick else SCALE_SIZES
            self.keep(
                "scale", await self.measure("scale", lambda: scale.run(latency, paths, sizes, self.runs["scale"]))
            )
        if "storm" in self.selected:
            self.keep("storm", await self.measure("storm", lambda: storm_table.run(self.runs["storm"], self.quick)))
        if "checkpoints" in self.selected:
            runs = self.runs["checkpoints"]
            self.keep("checkpoints", await self.measure("checkpoints", lambda: checkpoints.run(runs, self.quick)))
        if "fleet" in self.selected:
            runs = self.runs["fleet"]
            self.keep("fleet", await self.measure("fleet", lambda: fleet.run(runs, self.quick)))

    async def _on_real_slurm(self) -> None:
        # Slurm alone is measured at Slurm's default SlurmdTimeout; --quick keeps the stack's 10 s.
        timeout = None if self.quick or "resume" not in self.selected else SLURM_DEFAULT_SLURMD_TIMEOUT
        async with bench_stack(timeout) as bench:
            say(f"Slurm {bench.cluster.get('SLURM_VERSION', '?')}, SlurmdTimeout {bench.slurmd_timeout} s")
            if "reaction" in self.selected:
                self.keep(
                    "reaction", await self.measure("reaction", lambda: reaction.run(bench, self.runs["reaction"]))
                )
            elif any(n in self.selected for n in REAL_SLURM):
                await self.measure("warm-up", lambda: reaction.warm_up(bench))
            if "degrading" in self.selected:
                self.keep(
                    "degrading", await self.measure("degrading", lambda: degrading.run(bench, self.runs["degrading"]))
                )
            if "scale" in self.selected:
                self.calibration = await self.measure("scale", lambda: scale.calibrate(bench))
            if "resume" in self.selected:
                runs = self.runs["resume"]
                self.keep("resume", await self.measure("resume", lambda: resume.run(bench, runs, runs, self.quick)))

    async def _on_newest_slurm(self) -> None:
        async with bench_stack(None, expedite.SLURM_GENERATION) as bench:
            say(f"Slurm {bench.cluster.get('SLURM_VERSION', '?')} (Debian root) for the expedited requeue")
            self.keep("expedite", await expedite.run(bench, self.runs["expedite"]))

    def ordered(self) -> list[Outcome]:
        return [self.outcomes[n] for n in (*ALL, "stack", "warm-up") if n in self.outcomes]

    @property
    def completed(self) -> bool:
        return all(o.failed is None for o in self.outcomes.values())


async def table(args: argparse.Namespace, selected: tuple[str, ...]) -> int:
    as_json = getattr(args, "json", False)
    runner = Runner(selected, getattr(args, "runs", None), getattr(args, "quick", False))
    command = " ".join(["python -m bench", *sys.argv[1:]])
    say(f"{command}: {', '.join(selected)}; runs {json.dumps({n: runner.runs[n] for n in selected})}")
    facts = machine()
    await runner.run()
    facts_after = machine()
    rows = [r for o in runner.ordered() for r in o.rows]
    notes = [
        f"machine: {json.dumps(facts)}",
        f"load average at the end: {facts_after['load_average_1m']} (1 min), {facts_after['load_average_5m']} (5 min)",
    ]
    for outcome in runner.ordered():
        notes.append(
            f"{outcome.name}: FAILED: {outcome.failed}" if outcome.failed else f"{outcome.name}:\n{outcome.details}"
        )
    if as_json:
        say("\n".join(notes))
        print(json.dumps([r.as_json() for r in rows]))
    else:
        print(f"$ {command}")
        print(render(rows))
        print()
        print("\n".join(notes))
    return 0 if runner.completed else 1


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="the rows as a JSON list on stdout; everything else on stderr",
    )
    common.add_argument(
        "--runs",
        type=int,
        default=argparse.SUPPRESS,
        help="runs per benchmark, medians reported (defaults in the module docstring)",
    )
    common.add_argument("--quick", action="store_true", default=argparse.SUPPRESS, help="a short smoke run")
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="benchmark")
    for name, what in (
        ("reaction", "alert accepted -> drained and signalled (real Slurm)"),
        ("resume", "time to resume after XID 79 vs Slurm alone (real Slurm; 5+ minutes)"),
        ("degrading", "lost steps with and without the grace checkpoint (real Slurm)"),
        ("expedite", "time to resume, --requeue=expedite vs --requeue (real Slurm 26.05)"),
        ("scale", "10, 100, 1,000 concurrent incidents (scale harness)"),
        ("checkpoints", "the latest complete checkpoint of many large ones, polled (files only)"),
        ("fleet", "a real slurmctld with 2,000 cloud nodes and 64 slurmd: start, memory, node listings"),
    ):
        sub.add_parser(name, help=what, parents=[common])
    s = sub.add_parser("storm", help="an alert storm against the hook server (bench/storm.py)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--runs", type=int, default=3, help="repeat and report medians (default 3)")
    s.add_argument("--nodes", type=int, default=500)
    s.add_argument("--copies", type=int, default=4, help="deliveries of every payload (default 4)")
    s.add_argument("--clients", type=int, default=8, help="concurrent connections (default 8)")
    s.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.benchmark == "storm":
        return asyncio.run(storm(args))
    return asyncio.run(table(args, ALL if args.benchmark is None else (args.benchmark,)))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: the Temporal SDK's threads can crash it (sdk-python#300)
