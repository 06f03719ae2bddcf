"""The incident's steps: each one a phase of its timeline, shown as the run's search attributes
(RecoveryPhase, ...) in the Web UI and `recovery list`, and raced against an operator's abort."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TypeVar

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate

with workflow.unsafe.imports_passed_through():
    from contracts import search_attributes as sa
    from workflows.incident.timeline import Timeline

T = TypeVar("T")


class IncidentAborted(Exception):
    """An operator aborted the incident (update `abort`): it stops before its next step."""


class SearchIndex:
    """The run's search attributes. Each upsert is a command, a history event and a visibility
    write: updates may be kept and sent with the next one."""

    def __init__(self) -> None:
        self.enabled = True  # the policy's search_attributes
        self._kept: dict[str, SearchAttributeUpdate] = {}

    def update(self, updates: list[SearchAttributeUpdate], now: bool = True) -> None:
        """Upserts `updates` with those kept since the last upsert; now=False keeps them for the next one."""
        if not self.enabled:
            return
        self._kept.update((update.key.name, update) for update in updates)
        if now:
            workflow.upsert_search_attributes(list(self._kept.values()))
            self._kept = {}


class Steps:
    def __init__(self, timeline: Timeline, index: SearchIndex, aborted: Callable[[], bool]) -> None:
        self.timeline = timeline
        self._index = index
        self._aborted = aborted

    async def run(
        self,
        name: str,
        work: Awaitable[T],
        *,
        abortable: bool = True,
        index_now: bool = True,
        done_at: Callable[[T], datetime | None] | None = None,
    ) -> T:
        """One phase. `index_now=False` for a step that ends within the workflow task it starts in
        (a local activity): its phase goes with the next step's upsert. `done_at`: when the step's
        work was done as the work recorded it (a Slurm write, a spare in service, a job back): the
        phase ends then, not when the workflow heard of it (workflows/incident/timeline.py)."""
        phase = self.timeline.begin(name, workflow.now())
        self._index.update([sa.PHASE.value_set(name)], now=index_now)
        try:
            result = await (self._unless_aborted(work) if abortable else work)
        except BaseException:
            self.timeline.end(phase, workflow.now())
            raise
        self.timeline.end(phase, workflow.now(), done_at(result) if done_at is not None else None)
        return result

    async def _unless_aborted(self, work: Awaitable[T]) -> T:
        """The step's result, or IncidentAborted as soon as an operator aborts (the step's
        activity is cancelled; a call already sent to Slurm may still complete)."""
        if self._aborted():
            raise IncidentAborted()
        task = asyncio.ensure_future(work)
        await workflow.wait_condition(lambda: task.done() or self._aborted())
        if not task.done():
            task.cancel()
            raise IncidentAborted()
        return task.result()

    def note(self, result: str) -> None:
        """What the latest phase came to."""
        self.timeline.note(result)

    def skip(self, name: str, why: str) -> None:
        self.timeline.skip(name, why, workflow.now())
