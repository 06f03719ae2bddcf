"""Game day: named failure scenarios run on the embedded local stack through the drill, each
scored against its service level objectives (`recovery drill --scenario NAME|all`).

Every scenario injects a failure with the drill's machinery (drills/drill.py: the reference
training job, a fault marker, the alert as the hooks send it), follows the incident(s) to their end
and measures, from the incident report, from Slurm and from the Temporal history (never assumed):

  detect          alert observed -> incident started (its first phase)        <= 5 s  (storm 15 s)
  fence           alert observed -> node drained in Slurm                       <= 10 s (storm 30 s)
  resume          alert observed -> job training again off the node             <= 120 s (storm 180 s)
  lost_progress   steps lost vs the latest complete checkpoint                  <= steps since it + 1
  side_effects_once  Slurm's restart count +1 per job, one drain by the incident, at most one spare
                  claimed (the node's Slurm comment names the incident)         exactly once

The resume target is dominated by Slurm's own requeue delay (cred_expire, 10 s on the local
stack). Scenario-specific objectives: XID 13 leaves node and job alone below the threshold; a
degrading XID's grace period ends early on the emergency checkpoint; an incomplete newest
checkpoint is skipped; without a spare the outcome says no_replacement and the job still resumes;
a SIGKILLed worker changes no count; a storm opens one incident per node, each recovered or ended
with an explicit no_replacement, and (when the fleet budget gates incidents) never more nodes
under remediation at once than the budget allows.

A scenario passes when every objective is met; a scenario that could not run to its end reports
one objective, `completed`, missed.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import traceback
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from activities.xid_policy import XidPolicyTable
from contracts.models import IncidentReport, NodeFailureAlert, OutcomeKind, RecoveryPolicy, SlurmJob
from drills.drill import Drill, DrillOptions, DrillResult, DrillRun
from drills.faults import (
    activity_starts,
    job_recovery_started,
    kill_worker,
    wait_for_history_point,
    worker_identities,
)
from drills.localstack import LocalStack, StackError, wait_async
from starter.alerts import raise_alert
from workflows.job_recovery import job_recovery_workflow_id

Comparison = Literal["<=", "==", ">="]


class Slo(BaseModel):
    name: str
    target: str
    measured: float | int | str | None
    met: bool
    detail: str = ""


class ScenarioResult(BaseModel):
    scenario: str
    passed: bool
    slos: list[Slo]
    description: str = ""
    incidents: list[str] = Field(default_factory=list, description="the incident ids")
    seconds: float | None = Field(None, description="wall time of the scenario")


def score(
    name: str, measured: float | int | None, comparison: Comparison, limit: float, unit: str = "", detail: str = ""
) -> Slo:
    """One objective: a measured number against its limit; nothing measured is a miss."""
    if isinstance(measured, float):
        measured = round(measured, 3)
    met = (
        measured is not None
        and {
            "<=": lambda: measured <= limit,
            "==": lambda: measured == limit,
            ">=": lambda: measured >= limit,
        }[comparison]()
    )
    shown = f"{limit:g}" if isinstance(limit, float) else str(limit)
    return Slo(name=name, target=f"{comparison} {shown}{unit}", measured=measured, met=met, detail=detail)


def judged(name: str, target: str, measured: str, met: bool, detail: str = "") -> Slo:
    """An objective that is a verdict on what was observed (an outcome, counts of side effects)."""
    return Slo(name=name, target=target, measured=measured, met=met, detail=detail)


def result_of(
    scenario: Scenario, slos: list[Slo], incidents: list[str], seconds: float | None = None
) -> ScenarioResult:
    return ScenarioResult(
        scenario=scenario.name,
        passed=bool(slos) and all(s.met for s in slos),
        slos=slos,
        description=scenario.description,
        incidents=incidents,
        seconds=seconds,
    )


def exit_code(results: list[ScenarioResult]) -> int:
    """0 when every objective of every scenario was met, else 1."""
    return 0 if results and all(r.passed for r in results) else 1


@dataclass(frozen=True)
class Targets:
    detect_seconds: float = 5.0
    fence_seconds: float = 10.0
    resume_seconds: float = 120.0


# Twenty incidents at once on a 2-core machine: the worker takes up to a few seconds per task.
STORM_TARGETS = Targets(detect_seconds=15.0, fence_seconds=30.0, resume_seconds=180.0)
STORM_FAILURES = 20


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    injects: str
    play: Callable[[GameDay, Scenario], Awaitable[tuple[list[Slo], list[str]]]]
    targets: Targets = Targets()
    # the local cluster's size (deploy/local/slurm-cluster.sh SLURM_NODES, SLURM_SPARES)
    nodes: int = 4
    spares: int = 1


# --- measuring one incident --------------------------------------------------------------------


def seconds_after_failure(report: IncidentReport, at: datetime | None) -> float | None:
    return None if at is None else round((at - report.failure_at).total_seconds(), 3)


def detect_slo(reports: list[IncidentReport], targets: Targets) -> Slo:
    """Alert observed -> the incident's first phase began (the worker picked the incident up)."""
    waits = [seconds_after_failure(r, r.phases[0].started_at if r.phases else None) for r in reports]
    measured = None if None in waits or not waits else max(waits)
    return score(
        "detect", measured, "<=", targets.detect_seconds, " s", detail=f"alert -> first phase, slowest of {len(waits)}"
    )


def drained_at(report: IncidentReport) -> datetime | None:
    drains = [a.at for a in report.actions if a.action == "drain_node"]
    return drains[0] if drains else None


async def fence_slo(drill: Drill, reports: list[IncidentReport], targets: Targets) -> Slo:
    """Alert observed -> the drain recorded by the incident, and Slurm still shows the node fenced."""
    times = [seconds_after_failure(r, drained_at(r)) for r in reports]
    nodes = [await drill.slurm.get_node(r.node) for r in reports]
    unfenced = [n.name for n in nodes if not (n.drained or n.state == "down")]
    measured = None if None in times or not times else max(times)
    return score(
        "fence",
        measured if not unfenced else None,
        "<=",
        targets.fence_seconds,
        " s",
        detail=f"alert -> drain, slowest of {len(times)}; not fenced in Slurm now: {unfenced or 'none'}",
    )


def resume_slo(report: IncidentReport, targets: Targets) -> Slo:
    """Alert observed -> the last of the node's jobs training again, verified off the node."""
    off_node = [j for j in report.jobs if j.verified and j.nodes_after and report.node not in j.nodes_after]
    measured = report.time_to_resume_seconds if report.jobs and len(off_node) == len(report.jobs) else None
    return score(
        "resume",
        measured,
        "<=",
        targets.resume_seconds,
        " s",
        detail="; ".join(
            f"job {j.job_id}: {','.join(j.nodes_before)} -> {','.join(j.nodes_after) or '-'}"
            f"{'' if j.verified else ' NOT verified: ' + '; '.join(j.why_not)}"
            for j in report.jobs
        )
        or "no job",
    )


def lost_progress_slo(report: IncidentReport) -> Slo:
    """Steps lost, against the steps the job had made since its latest complete checkpoint (+1:
    the step in flight when the GPU went)."""
    jobs = [
        j
        for j in report.jobs
        if j.lost_steps is not None and j.last_step_before_failure is not None and j.latest_complete_step is not None
    ]
    if not jobs or len(jobs) != len(report.jobs):
        return score("lost_progress", None, "<=", 0, " steps", detail="no resumed job to measure")
    allowed = sum(j.last_step_before_failure - j.latest_complete_step + 1 for j in jobs)
    return score(
        "lost_progress",
        sum(j.lost_steps for j in jobs),
        "<=",
        allowed,
        " steps",
        detail="; ".join(
            f"job {j.job_id}: last step {j.last_step_before_failure}, latest complete "
            f"checkpoint step {j.latest_complete_step}, resumed at {j.resumed_step}"
            for j in jobs
        ),
    )


@dataclass
class SideEffects:
    """What the incidents did, counted in Slurm and in their reports."""

    requeues: dict[int, int] = field(default_factory=dict)  # job -> Slurm's restart count
    drains: dict[str, int] = field(default_factory=dict)  # incident -> drains it recorded
    drain_reasons: dict[str, bool] = field(default_factory=dict)  # node -> its Slurm reason names the incident
    spare_claims: dict[str, int] = field(default_factory=dict)  # incident -> spares claimed (report)
    spare_comments: dict[str, int] = field(default_factory=dict)  # incident -> spares whose comment names it


async def side_effects(drill: Drill, reports: list[IncidentReport], job_ids: list[int]) -> SideEffects:
    """`job_ids`: the jobs the game day submitted (so restarted 0 times before the failure)."""
    found = SideEffects()
    for job_id in job_ids:
        found.requeues[job_id] = (await drill.slurm.get_job(job_id)).restart_count
    spares = [await drill.slurm.get_node(n) for n in drill.spare_nodes]
    for r in reports:
        found.drains[r.incident_id] = sum(a.action == "drain_node" for a in r.actions)
        node = await drill.slurm.get_node(r.node)
        found.drain_reasons[r.node] = f"incident {r.incident_id} " in node.reason
        found.spare_claims[r.incident_id] = sum(a.action == "claim_spare" for a in r.actions)
        found.spare_comments[r.incident_id] = sum(s.comment.endswith(f"incident {r.incident_id}") for s in spares)
    return found


def side_effects_slo(found: SideEffects, spares_expected: int) -> Slo:
    """Every job requeued exactly once (Slurm's own restart count), every node drained once by its
    incident (the reason in Slurm names it), `spares_expected` spares claimed per incident, each
    claim visible once in Slurm."""
    wrong = (
        [f"job {j} restarted {n}x" for j, n in found.requeues.items() if n != 1]
        + [f"{i} drained {n}x" for i, n in found.drains.items() if n != 1]
        + [f"{node}: reason does not name its incident" for node, ok in found.drain_reasons.items() if not ok]
        + [f"{i} claimed {n} spare(s)" for i, n in found.spare_claims.items() if n > spares_expected]
        + [
            f"{i}: {n} spare(s) carry its claim in Slurm"
            for i, n in found.spare_comments.items()
            if n != found.spare_claims.get(i)
        ]
    )
    total_spares = sum(found.spare_claims.values())
    measured = (
        f"requeues {sorted(set(found.requeues.values())) or '-'} per job, "
        f"drains {sorted(set(found.drains.values()))} per incident, spares claimed {total_spares}"
    )
    return judged(
        "side_effects_once",
        f"1 requeue per job, 1 drain per incident, <= {spares_expected} spare per incident",
        measured,
        not wrong,
        "; ".join(wrong) or "as expected",
    )


async def activity_attempts(handle: WorkflowHandle, activity_type: str) -> int:
    """How many times the workflow's history shows the activity started (retries included)."""
    return sum(started.attempt for started in await activity_starts(handle, activity_type))


def drill_check_slo(result: DrillResult, check: str, name: str, target: str) -> Slo:
    """One of the drill's own checks (drills/drill.py), as an objective."""
    found = next((c for c in result.checks if c.name == check), None)
    return judged(name, target, found.detail if found else "not checked", bool(found and found.passed))


async def recovery_slos(game: GameDay, scenario: Scenario, result: DrillResult, spare: bool = True) -> list[Slo]:
    """The objectives every recovering scenario has, and its outcome: recovered onto a spare, or
    (no `spare` on standby) an explicit no_replacement."""
    report = result.report
    found = await side_effects(game.drill, [report], [result.job_id])
    outcome = (
        judged("outcome", "recovered", report.outcome, report.outcome_kind == OutcomeKind.RECOVERED)
        if spare
        else judged(
            "outcome",
            "no_replacement, said explicitly",
            report.outcome,
            report.outcome_kind == OutcomeKind.NO_REPLACEMENT,
        )
    )
    return [
        detect_slo([report], scenario.targets),
        await fence_slo(game.drill, [report], scenario.targets),
        resume_slo(report, scenario.targets),
        lost_progress_slo(report),
        side_effects_slo(found, spares_expected=1 if spare else 0),
        outcome,
    ]


# --- the scenarios -----------------------------------------------------------------------------


async def play_fatal(game: GameDay, scenario: Scenario) -> tuple[list[Slo], list[str]]:
    run = await game.drill.start(DrillOptions(xid=79))
    result = await game.drill.finish(run, game.timeout)
    return await recovery_slos(game, scenario, result), [await game.record(run, result.report)]


async def play_degrading(game: GameDay, scenario: Scenario) -> tuple[list[Slo], list[str]]:
    # A long grace period that must end early: the job checkpoints on SIGUSR1 within a step.
    game.drill.policy = game.drill.policy.model_copy(update={"degrading_grace_seconds": 120.0})
    run = await game.drill.start(DrillOptions(xid=94))
    result = await game.drill.finish(run, game.timeout)
    grace = next((p for p in result.report.phases if p.name == "grace"), None)
    waited = (grace.ended_at - grace.started_at).total_seconds() if grace and grace.ended_at else None
    early = grace is not None and grace.result.endswith("checkpointed within the grace period")
    return [
        *await recovery_slos(game, scenario, result),
        score(
            "grace_checkpoint",
            waited if early else None,
            "<=",
            10.0,
            " s",
            detail=f"of 120 s: {grace.result if grace else 'no grace phase'}",
        ),
    ], [await game.record(run, result.report)]


async def play_application(game: GameDay, scenario: Scenario) -> tuple[list[Slo], list[str]]:
    # Only this game day's XIDs count toward the threshold: earlier game days on the same GPU
    # must not turn this one into an escalation.
    game.drill.policy = game.drill.policy.model_copy(update={"application_xid_window_seconds": 60.0})
    run = await game.drill.start(DrillOptions(xid=13))
    result = await game.drill.finish(run, game.timeout)
    report = result.report
    counted = next((p.result for p in report.phases if p.name == "count_application_xids"), "not counted")
    return [
        detect_slo([report], scenario.targets),
        drill_check_slo(
            result,
            "no node action",
            "no_node_action",
            f"below {game.policy.application_xid_threshold} XIDs: outcome no_node_action, node in service",
        ),
        drill_check_slo(result, "job kept running", "job_untouched", "RUNNING, 0 restarts"),
        score("side_effects", len(report.actions), "==", 0, " actions", detail=counted),
    ], [await game.record(run, result.report)]


async def play_worker_crash(game: GameDay, scenario: Scenario) -> tuple[list[Slo], list[str]]:
    run = await game.drill.start(DrillOptions(xid=79))
    # The requeue runs in the job's recovery (workflows/job_recovery.py), which the incident joins.
    job_recovery = await job_recovery_started(game.drill.client, game.drill.stack.task_queue, run.job_id, 60)
    await wait_for_history_point(job_recovery, "requeue_job", "started", timeout=60)
    killed = await asyncio.to_thread(kill_worker, game.stack)
    game.say(f"SIGKILLed worker {killed} with the requeue in flight; starting a new one")
    game.stack.start_worker(game.cluster)
    successor = int(game.stack.worker_pidfile.read_text())
    result = await game.drill.finish(run, game.timeout)
    attempts = await activity_attempts(job_recovery, "requeue_job")
    identities = await worker_identities(run.handle)
    finished_by_successor = any(i.startswith(f"{successor}@") for i in identities)
    return [
        *await recovery_slos(game, scenario, result),
        judged(
            "taken_over",
            f"worker {successor} finished what worker {killed} began",
            "yes" if finished_by_successor else "no",
            finished_by_successor,
            detail=f"workers in the history: {', '.join(sorted(identities))}; requeue_job started {attempts}x",
        ),
    ], [await game.record(run, result.report)]


async def play_incomplete_checkpoint(game: GameDay, scenario: Scenario) -> tuple[list[Slo], list[str]]:
    run = await game.drill.start(DrillOptions(xid=79, corrupt_latest_checkpoint=True))
    result = await game.drill.finish(run, game.timeout)
    return [
        *await recovery_slos(game, scenario, result),
        drill_check_slo(
            result,
            "incomplete checkpoint skipped",
            "resumed_from_complete",
            "the newest COMPLETE checkpoint, the incomplete one skipped",
        ),
    ], [await game.record(run, result.report)]


SPARE_UNAVAILABLE_REASON = "game day: spare under maintenance"


async def play_no_spare(game: GameDay, scenario: Scenario) -> tuple[list[Slo], list[str]]:
    async def spares_away(job: SlurmJob, node: str) -> None:
        # Drained for another reason, a spare is no longer on standby: the pool must not take it.
        for spare in game.drill.spare_nodes:
            await game.drill.slurm.update_node(spare, "DRAIN", SPARE_UNAVAILABLE_REASON)

    run = await game.drill.start(DrillOptions(xid=79), before_fault=spares_away)
    result = await game.drill.finish(run, game.timeout)
    return await recovery_slos(game, scenario, result, spare=False), [await game.record(run, result.report)]


async def play_storm(game: GameDay, scenario: Scenario) -> tuple[list[Slo], list[str]]:
    """Two running reference jobs (2 nodes each; Slurm may pack both onto the same two nodes):
    the last node of each, then idle nodes, 20 of 24 compute nodes in all, fail at once. Two hot
    spares for twenty incidents: the ones with a job on their node claim one each (the idle nodes'
    incidents keep the spares on standby unless RECOVERY_SPARE_FOR_IDLE_NODE), the others end
    recovered without one or with an explicit no_replacement; every job resumes on what is left."""
    drill, opts = game.drill, DrillOptions(xid=79)
    await drill.reset_cluster()
    started = datetime.now(timezone.utc)
    run_dirs = {}
    for index in range(2):
        run_dir = drill.stack.drills_dir / f"{started:%Y%m%dT%H%M%S%fZ}-storm-{index}"
        run_dirs[await drill.submit_training_job(run_dir, opts)] = run_dir
    jobs = [await wait_async(lambda j=j: drill._running(j), 60, f"job {j} to run") for j in run_dirs]
    for run_dir in run_dirs.values():
        await wait_async(
            lambda d=run_dir: drill._complete_checkpoints(d, opts.checkpoints_before_failure),
            120,
            f"complete checkpoints in {run_dir}",
        )
    busy = {n for j in jobs for n in j.nodes}
    idle = [n.name for n in await drill.slurm.list_nodes() if n.name not in busy and n.name not in drill.spare_nodes]
    # Slurm may pack both jobs onto the same nodes: one failing node per distinct set of nodes.
    failing = list(dict.fromkeys(j.nodes[-1] for j in jobs)) + sorted(idle, key=lambda n: int(n.rsplit("-", 1)[1]))
    failing = failing[:STORM_FAILURES]
    if len(failing) < STORM_FAILURES:
        raise StackError(f"only {len(failing)} nodes to fail: the storm needs {STORM_FAILURES}")
    for node in failing:
        drill.inject_fault(node, opts.xid, gpu_lost=True)
    for run_dir in run_dirs.values():
        await wait_async(lambda d=run_dir: drill._stalled(d), 30, "the jobs to stall on their lost GPUs")
    game.say(
        f"storm: XID 79 on {len(failing)} nodes at once ({', '.join(failing)}); jobs {', '.join(map(str, run_dirs))}"
    )
    alerts = [
        NodeFailureAlert(
            node=node,
            xid=opts.xid,
            source="drill",
            actor=f"game day by {getpass.getuser()}",
            reason=f"storm: injected XID {opts.xid} on {node}",
            message="NVRM: Xid (game day)",
        )
        for node in failing
    ]
    handles = await asyncio.gather(*(raise_alert(game.client, a, drill.stack.task_queue, drill.policy) for a in alerts))
    breaker = await operate_breaker(game, handles) if drill.policy.fleet_budget else None
    reports = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), game.timeout)
    for job_id in run_dirs:
        await drill.slurm.run("scancel", str(job_id))

    query = (
        f"WorkflowType = 'NodeRecoveryWorkflow' AND TaskQueue = '{drill.stack.task_queue}' "
        f"AND StartTime >= '{started:%Y-%m-%dT%H:%M:%SZ}'"
    )
    opened = [wf.id async for wf in game.client.list_workflows(query)]
    handled = [r for r in reports if r.outcome_kind in (OutcomeKind.RECOVERED, OutcomeKind.NO_REPLACEMENT)]
    with_jobs = [r for r in reports if r.jobs]
    claimants = reports if drill.policy.spare_for_idle_node else with_jobs
    resumed = {j.job_id for r in with_jobs for j in r.jobs if j.verified}
    found = await side_effects(drill, reports, list(run_dirs))
    slos = [
        judged(
            "incidents",
            f"{len(failing)}, one per node",
            str(len(opened)),
            sorted(opened) == sorted(h.id for h in handles) and len(set(opened)) == len(failing),
            detail=f"NodeRecoveryWorkflow runs started since the storm began: {len(opened)}",
        ),
        judged(
            "handled",
            f"each of {len(failing)} recovered or no_replacement",
            str(len(handled)),
            len(handled) == len(failing),
            detail="; ".join(f"{r.node}: {r.outcome}" for r in reports if r not in handled)
            or f"{sum(r.outcome_kind == OutcomeKind.RECOVERED for r in reports)} recovered, "
            f"{sum(r.outcome_kind == OutcomeKind.NO_REPLACEMENT for r in reports)} no_replacement",
        ),
        detect_slo(reports, scenario.targets),
        await fence_slo(drill, reports, scenario.targets),
        *[resume_slo(r, scenario.targets).model_copy(update={"name": f"resume {r.node}"}) for r in with_jobs],
        *[lost_progress_slo(r).model_copy(update={"name": f"lost_progress {r.node}"}) for r in with_jobs],
        judged(
            "jobs_resumed",
            f"all {len(run_dirs)}, verified off their failed node",
            str(len(resumed & set(run_dirs))),
            set(run_dirs) <= resumed,
            detail=f"jobs {sorted(run_dirs)} on {', '.join(sorted({n for j in jobs for n in j.nodes}))}",
        ),
        side_effects_slo(found, spares_expected=1),
        score(
            "spares_claimed",
            sum(found.spare_claims.values()),
            "==",
            min(len(drill.spare_nodes), len(claimants)),
            detail="each hot spare claimed by exactly one incident with a job on its node"
            + (" or none" if drill.policy.spare_for_idle_node else "; the idle nodes' incidents keep them"),
        ),
    ]
    if any(p.name == "budget" for r in reports for p in r.phases):
        slos.append(await budget_slo(game, started))
    if breaker is not None:
        slos.append(breaker)
    return slos, [r.incident_id for r in reports]


async def operate_breaker(game: GameDay, handles: list[WorkflowHandle]) -> Slo:
    """The game day's operator at the fence circuit breaker: more nodes fail at once than it lets
    be fenced, so it trips (sooner when earlier scenarios' fences are still in its window); once
    every incident is either past the breaker or held at it, none of the held drained, the operator
    resets it, again as long as it trips again with incidents held, and the held incidents go on."""
    from activities.budget import reset_breaker
    from contracts.budget import PartitionShare
    from workflows.fleet_budget import FleetBudgetWorkflow, fleet_budget_workflow_id
    from workflows.node_recovery import NodeRecoveryWorkflow

    budget_id = fleet_budget_workflow_id(game.stack.task_queue)
    budget = game.client.get_workflow_handle_for(FleetBudgetWorkflow.run, budget_id)
    size = len(await game.drill.slurm.list_nodes())
    policy = (await budget.query(FleetBudgetWorkflow.status)).policy
    limit = min(policy.fence_limits([PartitionShare(name=LOCAL_PARTITION, size=size)], size).values())

    async def each_weighed() -> list[str] | None:
        """The nodes held at the breaker, once no incident is still on its way to it."""
        statuses = [await h.query(NodeRecoveryWorkflow.status) for h in handles]
        held = [s.node for s in statuses if s.awaiting_approval is not None and s.awaiting_approval.gate == "breaker"]
        weighing = [s.node for s in statuses if s.phase in ("starting", "classify", "breaker") and s.node not in held]
        return None if weighing else held

    held = await wait_async(each_weighed, 60, "every incident to pass the fence circuit breaker or be held at it")
    if not held:
        return judged("breaker", f"not tripped: {len(handles)} fences within its limit of {limit}", "not tripped", True)
    status = await budget.query(FleetBudgetWorkflow.status)
    nodes = {n.name: n for n in await game.drill.slurm.list_nodes()}
    drained = [node for node in held if nodes[node].drained or nodes[node].state == "down"]
    counted, reason, resets = len(status.fenced_in_window), status.breaker.reason if status.breaker else "", 0
    while status.breaker is not None and status.fence_held and resets < 5:
        # A reset lets `limit` more be fenced: a storm past twice the limit trips it again.
        status = await reset_breaker(
            game.client,
            game.stack.operator_signer(),
            f"storm drill: {len(handles)} injected failures, all real",
            workflow_id=budget_id,
        )
        resets += 1
    game.say(
        f"breaker: tripped at {counted} of {limit} nodes fenced in its window, held {len(held)} "
        f"({len(drained)} drained); reset {resets} time(s)"
    )
    return judged(
        "breaker_held",
        f"held past its limit of {limit} nodes fenced, none drained, until reset",
        f"{len(held)} held, {len(drained)} drained",
        counted <= limit and not drained and status.breaker is None,
        detail=reason,
    )


async def budget_slo(game: GameDay, since: datetime) -> Slo:
    """With the fleet disruption budget gating incidents: the most nodes it had under remediation
    at once since `since` (its own timeline: holders after each event), against its limit for the
    local cluster (K nodes, and the share of its one partition)."""
    from workflows.fleet_budget import FleetBudgetWorkflow, fleet_budget_workflow_id

    budget = game.client.get_workflow_handle_for(
        FleetBudgetWorkflow.run, fleet_budget_workflow_id(game.stack.task_queue)
    )
    policy = (await budget.query(FleetBudgetWorkflow.status)).policy
    events = [e for e in await budget.query(FleetBudgetWorkflow.timeline) if e.at >= since]
    size = len(await game.drill.slurm.list_nodes())
    limit = min(policy.max_nodes, policy.partition_share(LOCAL_PARTITION, size))
    granted = sum(e.kind == "granted" for e in events)
    return score(
        "budget_respected",
        max((e.holders for e in events), default=0),
        "<=",
        limit,
        " nodes",
        detail=f"K={policy.max_nodes}, partition {LOCAL_PARTITION}: {limit} of {size}; "
        f"{granted} lease(s) granted, {sum(e.kind == 'queued' for e in events)} queued",
    )


# deploy/local/slurm-cluster.sh puts every node in one partition.
LOCAL_PARTITION = "gpu"


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "xid79-fatal",
            "a GPU falls off the bus under a training job: recovered onto a hot spare",
            "XID 79 (GPU lost) on a node of the 2-node reference job",
            play_fatal,
        ),
        Scenario(
            "xid94-degrading",
            "a degrading GPU: the job checkpoints in the grace period, then moves",
            "XID 94 (contained ECC error) with a 120 s grace period",
            play_degrading,
        ),
        Scenario(
            "xid13-application",
            "an application fault below the threshold: node and job left alone",
            "XID 13 (graphics engine exception) once",
            play_application,
        ),
        Scenario(
            "worker-crash",
            "the worker is SIGKILLed mid-incident: a new one finishes it, nothing twice",
            "XID 79, then SIGKILL of the worker once requeue_job has started",
            play_worker_crash,
        ),
        Scenario(
            "incomplete-checkpoint",
            "the newest checkpoint is incomplete: resume from the one before",
            "XID 79 after truncating a file of the newest complete checkpoint",
            play_incomplete_checkpoint,
        ),
        Scenario(
            "no-spare",
            "no hot spare on standby: explicit no_replacement, the job still resumes elsewhere",
            "XID 79 with every spare drained for maintenance",
            play_no_spare,
        ),
        Scenario(
            "storm-20",
            f"{STORM_FAILURES} nodes fail at once: one incident each, every one recovered or "
            "explicitly without replacement",
            f"XID 79 on {STORM_FAILURES} of 24 compute nodes (2 running jobs), 2 hot spares",
            play_storm,
            targets=STORM_TARGETS,
            nodes=24,
            spares=2,
        ),
    ]
}


def scenario_names(name: str) -> list[str]:
    """The scenarios `name` selects ("all": every one, the storm last); KeyError if unknown."""
    if name == "all":
        return list(SCENARIOS)
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)} or all")
    return [name]


# --- running scenarios -------------------------------------------------------------------------


@contextmanager
def cluster_size(nodes: int, spares: int) -> Iterator[None]:
    """The local cluster's knobs for deploy/local/slurm-cluster.sh, for starting it at this size."""
    saved = {k: os.environ.get(k) for k in ("SLURM_NODES", "SLURM_SPARES")}
    os.environ.update(SLURM_NODES=str(nodes), SLURM_SPARES=str(spares))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class GameDay:
    """Runs scenarios on a local stack whose Temporal dev server is up (the cluster and worker are
    (re)started at each scenario's size); `save_history` keeps each incident's history."""

    def __init__(
        self,
        client: Client,
        stack: LocalStack,
        policy: RecoveryPolicy,
        xid_table: XidPolicyTable,
        say: Callable[[str], None] = lambda _: None,
        timeout: float = 600.0,
        save_history: Path | None = None,
    ):
        self.client, self.stack, self.policy, self.xid_table = client, stack, policy, xid_table
        self.say, self.timeout, self.save_history = say, timeout, save_history
        self.cluster: dict[str, str] = {}
        self.drill: Drill | None = None
        self._recorded: list[tuple[WorkflowHandle, IncidentReport]] = []

    async def run(self, names: list[str]) -> list[ScenarioResult]:
        return [await self.play(SCENARIOS[name]) for name in names]

    async def play(self, scenario: Scenario) -> ScenarioResult:
        self._recorded = []
        self.say(f"game day: {scenario.name}: {scenario.injects}")
        loop = asyncio.get_running_loop()
        began = loop.time()
        try:
            await self._prepare(scenario)
            slos, incidents = await scenario.play(self, scenario)
        except Exception as e:  # one scenario that cannot finish does not stop the others
            self.say(traceback.format_exc())
            slos, incidents = (
                [judged("completed", "the scenario runs to its end", f"{type(e).__name__}: {e}", False)],
                [],
            )
        result = result_of(scenario, slos, incidents, round(loop.time() - began, 1))
        self.say(f"game day: {scenario.name}: {'passed' if result.passed else 'MISSED'}")
        if self.save_history is not None and result.passed:  # only verified incidents become fixtures
            for handle, report in self._recorded:
                for path in await save_histories(self.client, scenario.name, handle, report, self.save_history):
                    self.say(f"history saved: {path}")
        elif self.save_history is not None:
            self.say(f"history not saved: {scenario.name} missed an objective")
        return result

    async def _prepare(self, scenario: Scenario) -> None:
        """The cluster at the scenario's size and a worker configured for it; a fresh drill."""
        try:
            before = self.stack.cluster_env()
        except StackError:  # no cluster yet
            before = {}
        with cluster_size(scenario.nodes, scenario.spares):
            cluster = await asyncio.to_thread(self.stack.start_slurm)
        if cluster != before:
            # A restarted cluster has a new slurmrestd token and other spares: a worker that knew
            # the old one goes.
            await asyncio.to_thread(self.stack.stop_worker)
        self.cluster = cluster
        self.stack.start_worker(cluster)
        policy = self.policy.model_copy(
            update={"spare_nodes": [n for n in cluster["SLURM_SPARE_NODES"].split(",") if n]}
        )
        self.drill = Drill(self.client, self.stack, cluster, policy, self.xid_table, say=self.say)

    async def record(self, run: DrillRun, report: IncidentReport) -> str:
        """The incident's id; its history is saved once the scenario passed (save_history)."""
        self._recorded.append((run.handle, report))
        return report.incident_id


async def save_histories(
    client: Client, label: str, incident: WorkflowHandle, report: IncidentReport, directory: Path
) -> list[Path]:
    """Write the incident's history, its return-to-service watcher's if it started one and, if
    it took a lease, the fleet budget's, as `<label>.<WorkflowType>.json` (Temporal's JSON history,
    as `temporal workflow show -o json` prints it): the fixtures tests/replay replays against the
    current workflow code."""
    directory.mkdir(parents=True, exist_ok=True)
    handles = [incident] + ([client.get_workflow_handle(report.return_to_service)] if report.return_to_service else [])
    handles += [client.get_workflow_handle(budget) for budget in await signalled_workflows(incident)]
    task_queue = (await incident.describe()).task_queue
    handles += [client.get_workflow_handle(job_recovery_workflow_id(task_queue, job.job_id)) for job in report.jobs]
    written = []
    for handle in handles:
        try:
            description = await handle.describe()
        except RPCError as err:  # a job requeued by its incident alone (a dry run, or a run begun before)
            if err.status == RPCStatusCode.NOT_FOUND:
                continue
            raise
        path = directory / f"{label}.{description.workflow_type}.json"
        path.write_text(json.dumps((await handle.fetch_history()).to_json_dict(), indent=1) + "\n")
        written.append(path)
    return written


async def signalled_workflows(handle: WorkflowHandle) -> list[str]:
    """The workflows the run signalled (the fleet budget, returning its lease), by its history."""
    found = []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            found.append(
                event.signal_external_workflow_execution_initiated_event_attributes.workflow_execution.workflow_id
            )
    return list(dict.fromkeys(found))
