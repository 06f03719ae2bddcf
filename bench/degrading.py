"""A degrading XID (94, contained ECC error): training lost with the grace checkpoint and without
(RecoveryPolicy.degrading_grace_seconds=0), same job, same drill, in the same run.

With the grace period the incident signals the job, waits for its new complete checkpoint, then
requeues it; without, it requeues at once after the signal. The reference job also writes a
checkpoint on SIGTERM (the requeue) when its step ends within KillWait: a job whose checkpoint
takes longer than KillWait has only the grace period.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.resume import Recovery, drill_recovery
from bench.stack import BenchStack, say
from bench.table import Row, goal, median, row
from drills.drill import DrillOptions

XID = 94


@dataclass
class DegradingResult:
    with_grace: list[Recovery]
    without_grace: list[Recovery]
    grace_seconds: float

    def rows(self) -> list[Row]:
        return [
            row(
                "degrading XID 94: steps lost with the grace checkpoint (baseline: without; real Slurm)",
                median(r.lost_steps for r in self.with_grace),
                "steps",
                median(r.lost_steps for r in self.without_grace),
                goal("value == 0"),
                digits=1,
            ),
            row(
                "degrading XID 94: time to resume with the grace checkpoint (baseline: without)",
                median(r.time_to_resume for r in self.with_grace),
                "s",
                median(r.time_to_resume for r in self.without_grace),
                digits=1,
            ),
        ]

    def details(self) -> str:
        return "\n".join(
            [
                f"  {len(self.with_grace)} run(s) each; baseline: degrading_grace_seconds=0",
                *(f"  grace {self.grace_seconds:.0f} s: {r.detail}" for r in self.with_grace),
                *(f"  no grace:  {r.detail}" for r in self.without_grace),
            ]
        )


async def run(bench: BenchStack, runs: int) -> DegradingResult:
    with_grace = bench.policy
    without_grace = with_grace.model_copy(update={"degrading_grace_seconds": 0.0})
    result = DegradingResult([], [], with_grace.degrading_grace_seconds)
    for i in range(runs):
        result.with_grace.append(await drill_recovery(bench, DrillOptions(xid=XID), with_grace))
        say(f"degrading run {i + 1} with grace: {result.with_grace[-1].detail}")
        result.without_grace.append(await drill_recovery(bench, DrillOptions(xid=XID), without_grace))
        say(f"degrading run {i + 1} without grace: {result.without_grace[-1].detail}")
    return result
