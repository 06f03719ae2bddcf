"""Expedited requeue (Slurm 25.11+): time to resume after XID 79 for the reference job submitted
--requeue=expedite, against the same job submitted --requeue, same drill, alternating, in the same
run, on the local stack's Slurm 26.05 (whose slurm.conf has
SlurmctldParameters=enable_expedited_requeue).

The incident is the same for both: drain, signal, requeue held, keep off the failed node, release.
What differs is Slurm's: a requeued job may not start again before requeue_delay (by default
AuthInfo's cred_expire: 10 s on the local stack, 120 s in Slurm's own default), unless it asked for
an expedited requeue, which makes it eligible at once and puts it at the top of the queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.resume import Recovery, drill_recovery
from bench.stack import BenchStack, say
from bench.table import Row, goal, median, row
from drills.drill import DrillOptions

XID = 79
# The generation the benchmark runs on: the newest the local stack has, which has expedited requeue.
SLURM_GENERATION = "26.05"


@dataclass
class ExpediteResult:
    expedited: list[Recovery]
    plain: list[Recovery]
    slurm_version: str

    def rows(self) -> list[Row]:
        return [
            row(
                f"time to resume after XID 79, job --requeue=expedite "
                f"(baseline: --requeue; Slurm {self.slurm_version})",
                median(r.time_to_resume for r in self.expedited),
                "s",
                median(r.time_to_resume for r in self.plain),
                goal("value <= baseline"),
                digits=1,
            ),
        ]

    def details(self) -> str:
        return "\n".join(
            [
                f"  {len(self.expedited)} run(s) each, alternating; Slurm {self.slurm_version}, requeue delay = "
                "cred_expire 10 s (local stack)",
                *(f"  expedite: {r.detail}" for r in self.expedited),
                *(f"  plain:    {r.detail}" for r in self.plain),
            ]
        )


async def run(bench: BenchStack, runs: int) -> ExpediteResult:
    result = ExpediteResult([], [], bench.cluster.get("SLURM_VERSION", "?"))
    for i in range(runs):
        result.plain.append(await drill_recovery(bench, DrillOptions(xid=XID)))
        say(f"expedite run {i + 1} plain --requeue: {result.plain[-1].detail}")
        result.expedited.append(await drill_recovery(bench, DrillOptions(xid=XID, expedited_requeue=True)))
        say(f"expedite run {i + 1} --requeue=expedite: {result.expedited[-1].detail}")
    return result
