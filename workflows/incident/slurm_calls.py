"""How the incident calls Slurm for its fence, up to the first signal: each call first as a local
activity, within the incident's first workflow task (a worker that dies mid-task leaves the next
one to run it again: each call is idempotent), then, still failing, as an activity with ten
minutes of retries timed by the server (workflows/call_options.py says why)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.fencing import FencingActivities
    from contracts.budget import PartitionShare
    from workflows.call_options import SLURM_CALL, SLURM_QUICK_TRY, SLURM_RETRY, failed_for_good, failing_as_activity

T = TypeVar("T")


def fence_call(activity: Callable[..., Awaitable[T]], arg: object, summary: str, at_once: bool = False) -> Awaitable[T]:
    """A Slurm call of the fence. Scheduled when awaited, or `at_once` (to run alongside what follows)."""
    tried = workflow.start_local_activity_method(activity, arg, summary=summary, **SLURM_QUICK_TRY) if at_once else None
    work = _locally_first(activity, arg, summary, tried)
    return asyncio.ensure_future(work) if at_once else work


def read_partitions(node: str) -> Awaitable[list[PartitionShare]]:
    """The node's partitions and their sizes, read at once (alongside the jobs)."""
    return fence_call(
        FencingActivities.partition_shares, node, f"Read {node}'s Slurm partitions and their sizes", at_once=True
    )


async def _locally_first(
    activity: Callable[..., Awaitable[T]], arg: object, summary: str, tried: Awaitable[T] | None
) -> T:
    """The call as a local activity, as often as SLURM_QUICK_TRY allows. Still failing then (Slurm
    down or refusing), made again as an activity with SLURM_CALL; a failure for good (a node Slurm
    does not know) is not tried again."""
    try:
        return await failing_as_activity(
            activity.__name__,
            tried or workflow.execute_local_activity_method(activity, arg, summary=summary, **SLURM_QUICK_TRY),
        )
    except ActivityError as err:
        if failed_for_good(err, SLURM_RETRY):
            raise
    return await workflow.execute_activity_method(activity, arg, summary=summary, **SLURM_CALL)
