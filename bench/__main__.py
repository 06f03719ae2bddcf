"""`python -m bench storm [--json]`: the alert storm benchmark (bench/storm.py).

Prints the machine's facts, each run, and the medians over the runs; with --json, one JSON object
on stdout (progress on stderr). Exit status 0 when every run made exactly one incident per node
with no failed request, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from bench.services import BIN
from bench.storm import StormSpec, run_once, summary


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    temporal = subprocess.run([str(BIN / "temporal"), "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)), "cpu": model,
        "load_average_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(),
        "temporal_cli": temporal, **{p: version(p) for p in ("temporalio", "starlette", "uvicorn", "pydantic")},
    }


async def storm(args: argparse.Namespace) -> int:
    spec = StormSpec(nodes=args.nodes, copies=args.copies, clients=args.clients, seed=args.seed)
    facts = machine()
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if args.json else print
    say(f"machine: {json.dumps(facts)}")
    say(f"storm: {spec.alerts} alerts over {spec.nodes} nodes ({spec.nodes * spec.distinct_per_node} distinct, "
        f"each payload sent {spec.copies} times, shuffled) from {spec.clients} clients; {args.runs} runs")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-storm-") as tmp:
        for i in range(args.runs):
            run = await run_once(spec, Path(tmp))
            runs.append(run)
            say(f"run {i + 1}: {run.alerts_per_s} alerts/s ({run.requests_per_s} requests/s), p50 {run.p50_ms} ms, "
                f"p99 {run.p99_ms} ms, max {run.max_ms} ms; by kind {run.latency_by_kind}; "
                f"incidents {run.incidents}/{run.nodes}; "
                f"outcomes {run.outcomes}; errors {run.errors}; Temporal calls {run.temporal_calls}; "
                f"CPU cores used {run.cpu_cores}")
    result = {"benchmark": "storm", "command": "python -m bench storm" + (" --json" if args.json else ""),
              "machine": facts} | summary(spec, runs)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"median of {args.runs}: {result['alerts_per_s']} alerts/s, p50 {result['p50_ms']} ms, "
              f"p99 {result['p99_ms']} ms; incidents {result['incidents']} for {spec.nodes} nodes; "
              f"{'ok' if result['ok'] else 'NOT ok'}")
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="benchmark", required=True)
    s = sub.add_parser("storm", help="an alert storm against the hook server (bench/storm.py)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--runs", type=int, default=3, help="repeat and report medians (default 3)")
    s.add_argument("--nodes", type=int, default=500)
    s.add_argument("--copies", type=int, default=4, help="deliveries of every payload (default 4)")
    s.add_argument("--clients", type=int, default=8, help="concurrent connections (default 8)")
    s.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    return asyncio.run(storm(args))


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: the Temporal SDK's threads can crash it (sdk-python#300)
