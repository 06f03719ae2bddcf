"""What the crash tests share: an incident driven by local-stack worker processes, and the check
that each side effect was done once, as Slurm records it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus

from activities.xid_policy import XidPolicyTable
from contracts.settings import Settings
from drills.drill import Drill, DrillOptions, DrillResult, DrillRun, SimulatedKubernetes
from drills.faults import kill_worker
from drills.localstack import LocalStack


@dataclasses.dataclass
class Case:
    """One drill incident run by the stack's worker process (a subprocess), with the part of
    slurmctld's log written meanwhile."""

    stack: LocalStack
    cluster: dict[str, str]
    drill: Drill
    log_offset: int = 0
    run: DrillRun | None = None

    @classmethod
    def on(cls, client: Client, stack: LocalStack, cluster: dict[str, str], settings: Settings) -> Case:
        stack = dataclasses.replace(stack, task_queue=settings.task_queue)
        return cls(
            stack,
            cluster,
            Drill(client, stack, cluster, settings.policy(), XidPolicyTable(settings.xid_policy_file), say=print),
        )

    @property
    def ctld_log(self) -> Path:
        return self.stack.slurm_base / "log" / "slurmctld.log"

    def ctld_log_since_start(self) -> str:
        with open(self.ctld_log, errors="replace") as f:
            f.seek(self.log_offset)
            return f.read()

    async def start(
        self, workers: list[LocalStack] | None = None, kubernetes: SimulatedKubernetes | None = None
    ) -> DrillRun:
        """Start the worker processes (the stack's own by default), then the XID 79 drill (on
        Slurm on Kubernetes with `kubernetes`)."""
        self.log_offset = self.ctld_log.stat().st_size
        for worker in workers or [self.stack]:
            worker.start_worker(self.cluster)
        # one checkpoint before the failure is enough to check the resume, and saves seconds per case
        self.run = await self.drill.start(DrillOptions(xid=79, checkpoints_before_failure=1), kubernetes=kubernetes)
        return self.run

    async def end(self, workers: list[LocalStack] | None = None) -> None:
        """Stop the worker processes. An incident left open by a failed case is terminated:
        the next case's alert for the node would join it (one incident per node)."""
        for worker in workers or [self.stack]:
            worker.stop_worker()
        if self.run is not None and (await self.run.handle.describe()).status == WorkflowExecutionStatus.RUNNING:
            await self.run.handle.terminate(reason="crash test ended with the incident open")

    def restart_worker(self) -> tuple[int, int]:
        """SIGKILL the stack's worker and start another: their pids."""
        killed = kill_worker(self.stack)
        self.stack.start_worker(self.cluster)
        return killed, int(self.stack.worker_pidfile.read_text())


async def check_recovered_once(case: Case, run: DrillRun, result: DrillResult, where: str) -> None:
    """Recovered, with one requeue, one drain and one spare brought in, as Slurm records them
    (the job's restart count, slurmctld's log, the spare's claim comment) and as the report does."""
    r = result.report
    assert r.outcome == "recovered", f"{where}: {r.model_dump_json(indent=1)}"
    assert result.passed, (where, result.checks)
    job = await case.drill.slurm.get_job(result.job_id)
    assert job.restart_count == 1, f"{where}: requeued {job.restart_count} times"
    assert [a.action for a in r.actions].count("requeue_hold") == 1, where
    log = case.ctld_log_since_start()
    assert log.count(f"Requeuing JobId={result.job_id}\n") == 1, f"{where}:\n{log}"

    drains = re.findall(rf"node {re.escape(run.node)} state set to DRAIN", log)
    assert len(drains) == 1, f"{where}: slurmctld drained {run.node} {len(drains)} times:\n{log}"
    failed = await case.drill.slurm.get_node(run.node)
    assert failed.drained and f"incident {r.incident_id}" in failed.reason, (where, failed)
    assert [a.action for a in r.actions].count("drain_node") == 1, where

    claimed = [n.name for n in await case.drill.slurm.list_nodes() if n.comment.endswith(f"incident {r.incident_id}")]
    assert claimed == [r.spare_node], f"{where}: spares claimed by the incident: {claimed}, report: {r.spare_node}"
    # The report keeps the actions of each step's completed attempt: a claim made by an attempt
    # that failed afterwards (say, the resume refused by a restarting slurmctld) is found, not made
    # again, by the next one, and is in Slurm's records above but not in the report.
    assert [a.action for a in r.actions].count("claim_spare") <= 1, where
    # Brought into service once. A RESUME sent while slurmctld restarts, before the spare has
    # registered again, is refused ("Invalid node state specified") and yet takes effect on 24.11:
    # the spare registers undrained, with no "state set to IDLE" line. The report then says the
    # next attempt found it in service with this incident's claim.
    resumed = re.findall(rf"node {re.escape(r.spare_node)} state set to IDLE", log)
    assert len(resumed) <= 1, f"{where}: slurmctld resumed {r.spare_node} {len(resumed)} times:\n{log}"
    assert [a.action for a in r.actions].count("resume_spare") == 1, where
    assert not (await case.drill.slurm.get_node(r.spare_node)).drained, where
