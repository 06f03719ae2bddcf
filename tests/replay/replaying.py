"""Replaying histories on the current workflow code: the recorded fixtures (test_replay.py) and
the incidents a real-stack test has just run (`assert_every_run_replays`)."""

from __future__ import annotations

import importlib
import pkgutil

from temporalio import workflow
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

import workflows

# The Replayer runs workflows on the task queue `replay-<build_id>`, and an incident names its
# spare claims after its task queue: fixtures are recorded on `replay-fixtures` (record.py), and a
# live run to replay is on a task queue named `replay-...`, so that those ids replay as recorded.
REPLAY_BUILD_ID = "fixtures"
REPLAYABLE_PREFIX = "replay-"


def workflow_classes() -> list[type]:
    """Every @workflow.defn class of the workflows package: whatever the worker registers is
    defined there, and a class it does not register is harmless to the Replayer."""
    found = {}
    for module in pkgutil.iter_modules(workflows.__path__):
        loaded = importlib.import_module(f"workflows.{module.name}")
        for value in vars(loaded).values():
            if isinstance(value, type) and workflow._Definition.from_class(value) is not None:
                found[value.__qualname__] = value
    return list(found.values())


def replayer(build_id: str = REPLAY_BUILD_ID) -> Replayer:
    return Replayer(workflows=workflow_classes(), data_converter=pydantic_data_converter, build_id=build_id)


async def assert_every_run_replays(client: Client, task_queue: str) -> int:
    """Each workflow run on `task_queue`, finished or not, replays on the current code from its
    history as the server holds it now: what a worker that lost its cache (a restart, an
    eviction) does with it. Returns how many were replayed."""
    assert task_queue.startswith(REPLAYABLE_PREFIX), task_queue
    seen: list[str] = []

    async def histories():
        async for history in client.list_workflows(f'TaskQueue = "{task_queue}"').map_histories():
            seen.append(history.workflow_id)
            yield history

    results = await replayer(task_queue.removeprefix(REPLAYABLE_PREFIX)).replay_workflows(
        histories(), raise_on_replay_failure=False
    )
    failed = {run_id: str(failure)[:300] for run_id, failure in results.replay_failures.items()}
    assert not failed, f"runs that do not replay on the current code: {failed}"
    return len(seen)
