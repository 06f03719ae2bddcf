"""`python -m bench.scale_worker`: the worker (worker.py's workflow and activities, unchanged) with
the scale harness (bench/harness.py) as its Slurm, in a process of its own so that the benchmark
can read its memory and CPU from /proc. Temporal from TEMPORAL_ADDRESS and RECOVERY_TASK_QUEUE;
stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from backends.slurm import SlurmClient
from bench.harness import ScaleSlurm
from contracts.settings import Settings
from worker import activities_for, build_worker, connect, register_search_attributes


async def serve(args: argparse.Namespace) -> None:
    settings = Settings()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client = await connect(settings)
    await register_search_attributes(client, settings.temporal_namespace)
    with open(args.call_log, "w") as call_log:
        harness = ScaleSlurm(args.nodes, json.loads(args.latency), call_log, args.restart_delay)
        async with build_worker(
            client,
            settings.task_queue,
            activities_for(settings, SlurmClient(harness), client),
            max_concurrent_workflow_tasks=settings.workflow_task_slots,
        ):
            Path(args.ready).touch()
            await stop.wait()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.scale_worker", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--latency", required=True, help="JSON: seconds per Slurm operation")
    p.add_argument("--restart-delay", type=float, default=2.0, help="a released job runs again after this")
    p.add_argument("--call-log", required=True, help="every Slurm call, one line each")
    p.add_argument("--ready", required=True, help="touched once the worker polls")
    asyncio.run(serve(p.parse_args()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: the SDK's threads can crash it (sdk-python#300)


if __name__ == "__main__":
    main()
