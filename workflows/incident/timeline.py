"""The incident's timeline: its phases, each with when it started, when it ended and what it came
to. Pure and deterministic: the workflow passes the times in (workflow.now(), and the times its
activities stamped on their work), so the report's timeline is tested without a server.

A phase ends when its work was done, as the work recorded it (a Slurm write's stamp, a spare in
service, a job back by its own resume record), never before the phase began nor after the
workflow heard of it. When the workflow hears late (a worker died in between, and another took
over), the absence shows as a gap before the next phase, not as time spent in this one.
"""

from __future__ import annotations

from datetime import datetime

from contracts.models import ActionRecord, Phase

NOT_STARTED = "starting"
DONE = "done"


class Timeline:
    def __init__(self) -> None:
        self.phases: list[Phase] = []
        self.current = NOT_STARTED  # the phase under way, as status queries and outcomes name it

    def begin(self, name: str, at: datetime) -> Phase:
        phase = Phase(name=name, started_at=at)
        self.phases.append(phase)
        self.current = name
        return phase

    @staticmethod
    def end(phase: Phase, heard_at: datetime, done_at: datetime | None = None) -> None:
        """`heard_at`: when the workflow heard the phase's work end; `done_at`: when the work says it
        was done, if it says."""
        phase.ended_at = heard_at if done_at is None else min(heard_at, max(phase.started_at, done_at))

    def note(self, result: str) -> None:
        """What the latest phase came to."""
        self.phases[-1].result = result

    def skip(self, name: str, why: str, at: datetime) -> None:
        self.phases.append(Phase(name=name, started_at=at, ended_at=at, result=f"skipped: {why}"))

    def finish(self) -> None:
        self.current = DONE


def last_action_at(actions: list[ActionRecord]) -> datetime | None:
    """When the last of a step's side effects was done, as its activity stamped it."""
    return max((action.at for action in actions), default=None)
