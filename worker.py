"""The Temporal worker: runs NodeRecoveryWorkflow and its activities.

Configured from the environment (see contracts/settings.py and the README); stops cleanly on
SIGTERM or SIGINT, finishing the activities in flight.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from contextlib import AsyncExitStack
from datetime import timedelta

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from activities.fencing import FencingActivities
from activities.jobs import JobActivities
from activities.replacement import ReplacementActivities
from activities.xid_policy import ClassifyActivities, XidPolicyTable
from backends.checkpoints import CheckpointStore
from backends.health import HealthCheck
from backends.replacement import HotSparePool
from backends.slurm import SlurmCli, SlurmClient, SlurmRest, SlurmUnavailable, Unsupported
from contracts.settings import Settings
from workflows.node_recovery import NodeRecoveryWorkflow

log = logging.getLogger("training_recovery.worker")


async def connect(settings: Settings, attempts: int = 50) -> Client:
    """Connect to Temporal, retrying the first dial (the SDK does not) while a server starts."""
    for attempt in range(1, attempts + 1):
        try:
            return await Client.connect(
                settings.temporal_address, namespace=settings.temporal_namespace,
                data_converter=pydantic_data_converter,
            )
        except RuntimeError:
            if attempt == attempts:
                raise
            await asyncio.sleep(0.2)
    raise AssertionError("unreachable")


async def build_slurm(settings: Settings, stack: AsyncExitStack) -> SlurmClient:
    cli = SlurmCli(slurm_conf=settings.slurm_conf, bin_dir=settings.slurm_bin_dir)
    if not (settings.slurmrestd_url and settings.slurmrestd_token):
        return SlurmClient(cli)
    rest = SlurmRest(settings.slurmrestd_url, settings.slurmrestd_user, settings.slurmrestd_token.get_secret_value())
    stack.push_async_callback(rest.aclose)
    try:
        version = await rest.discover()
    except (SlurmUnavailable, Unsupported) as e:
        log.warning("slurmrestd at %s not usable (%s): every Slurm call goes through the CLI",
                    settings.slurmrestd_url, e)
        return SlurmClient(cli)
    log.info("slurmrestd %s at %s; node updates and requeue go through the CLI", version, settings.slurmrestd_url)
    return SlurmClient(cli, rest)


def activities_for(settings: Settings, slurm: SlurmClient) -> list:
    checkpoints = CheckpointStore()
    classify = ClassifyActivities(XidPolicyTable(settings.xid_policy_file))
    fencing = FencingActivities(slurm)
    jobs = JobActivities(slurm, checkpoints)
    replacement = ReplacementActivities(slurm, HotSparePool(slurm), HealthCheck(settings.health_check_argv()))
    return [
        classify.classify_fault,
        fencing.drain_node,
        fencing.mark_node_down,
        jobs.find_jobs,
        jobs.signal_job,
        jobs.wait_for_checkpoint,
        jobs.requeue_job,
        jobs.verify_restart,
        replacement.request_replacement,
        replacement.wait_for_spare,
    ]


def build_worker(client: Client, task_queue: str, activities: list, **options) -> Worker:
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[NodeRecoveryWorkflow],
        activities=activities,
        # After a crash the next workflow task would wait this long on the dead worker's sticky queue.
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=2),
        graceful_shutdown_timeout=timedelta(seconds=10),
        **options,
    )


async def main() -> None:
    logging.basicConfig(level=os.environ.get("RECOVERY_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with AsyncExitStack() as stack:
        client = await connect(settings)
        slurm = await build_slurm(settings, stack)
        async with build_worker(client, settings.task_queue, activities_for(settings, slurm)):
            log.info("worker polling %s on %s/%s", settings.task_queue, settings.temporal_address,
                     settings.temporal_namespace)
            await stop.wait()
            log.info("stopping: finishing activities in flight")
    log.info("stopped")


if __name__ == "__main__":
    asyncio.run(main())
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the SDK's Rust threads can crash it (sdk-python#300).
    os._exit(0)
