"""`recovery`: the operator's command line.

  recovery drill [--xid 79] [--node NODE] [--trainer reference|torch] [--corrupt-latest-checkpoint] [--dry-run]
                 [--k8s] [--json]
                 [--k8s-scaling-mode StatefulSet|DaemonSet] [--slurm-version V] [--save-history DIR]
  recovery drill --scenario NAME|all [--json] [--save-history DIR]      game day: SLOs scored
  recovery inject --node NODE --xid N [--actor WHO] [--reason WHY]
  recovery status [NODE] [--json]
  recovery list [--node N] [--xid N] [--phase P] [--outcome O] [--running] [--json]
  recovery describe INCIDENT [--json]          INCIDENT: a node name or an incident id
  recovery report INCIDENT [--output FILE] [--json]
  recovery approve|deny|abort INCIDENT --reason WHY [--actor WHO] [--json]
  recovery config [--json]
  recovery stack up|down|status [--slurm-version V]
  recovery hooks [--host H] [--port P]

Exit codes: 0 done (for drill: recovered and verified), 1 the drill or incident did not verify,
2 bad input (nothing was changed), 3 the stack or a service could not be reached.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import logging
import os
import re
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import quote

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from temporalio.client import Client, WorkflowExecution, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.runtime import LogForwardingConfig, LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter
from temporalio.service import RPCError, RPCStatusCode

from cli.report_html import write_report_html
from contracts import search_attributes as sa
from contracts.budget import BreakerReset, QuarantineRelease
from contracts.models import IncidentReport, IncidentStatus, NodeFailureAlert, OperatorDecision, Phase, _check_node_name
from contracts.settings import ConfigError, Settings, describe_config, load_settings, load_telemetry_settings

if TYPE_CHECKING:  # for the annotations: the commands that use them import them
    from drills.drill import DrillOptions
    from drills.localstack import LocalStack

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNAVAILABLE = 0, 1, 2, 3
# A checkout's, not the image's (deploy/image/Containerfile): the commands that run the local stack.
LOCAL_STACK_PACKAGES = ("drills", "kubesim")
# Outcomes after which nothing is left for a person to do.
SETTLED_OUTCOMES = ("recovered", "no_node_action")
# An incident id: the node, then when its incident started.
_INCIDENT_ID = re.compile(r"^(?P<node>.+)-\d{8}T\d{6}Z$")
# A value for a visibility query: no quotes, nothing the query language would read as syntax.
_QUERY_VALUE = re.compile(r"^[A-Za-z0-9_ .:-]{1,100}$")

app = typer.Typer(
    name="recovery",
    help="GPU node failure recovery on Slurm, driven by Temporal",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Piped output keeps whole table rows: scripts read --json, people may read a pipe.
stdout = Console(width=None if sys.stdout.isatty() else 200)
stderr = Console(stderr=True, soft_wrap=True, highlight=False)


class BadInput(Exception):
    """The operator asked for something that cannot be done; nothing was changed."""


class SlurmVersion(str, Enum):
    v22_05 = "22.05"
    v24_11 = "24.11"
    v26_05 = "26.05"


class TrainerChoice(str, Enum):
    reference = "reference"
    torch = "torch"


class ScalingModeChoice(str, Enum):
    stateful_set = "StatefulSet"
    daemon_set = "DaemonSet"


class StackAction(str, Enum):
    up = "up"
    down = "down"
    status = "status"


def _err(text: str) -> None:
    stderr.print(text, markup=False)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def _run(work: Coroutine[Any, Any, int]) -> NoReturn:
    raise typer.Exit(asyncio.run(work))


async def _client(address: str, namespace: str, **options) -> Client:
    from worker import connect

    settings = load_settings(TEMPORAL_ADDRESS=address, TEMPORAL_NAMESPACE=namespace)
    return await connect(settings, attempts=10, **options)


async def _configured_client() -> Client:
    settings = load_settings()
    return await _client(settings.temporal_address, settings.temporal_namespace)


JSON_OPTION = typer.Option(False, "--json", help="print the result as JSON")


# --- drill -------------------------------------------------------------------------------------


@app.command(help="run a recovery drill on the embedded local stack")
def drill(
    xid: int = typer.Option(79, help="the XID to inject (a degrading one such as 94 exercises the grace period)"),
    node: str | None = typer.Option(None, help="node to fail (default: one of the training job's nodes)"),
    trainer: TrainerChoice = typer.Option(
        TrainerChoice.reference,
        help="the training job: the reference trainer, or torch: a real distributed PyTorch job (gloo, DDP) "
        "with DCP checkpoints, on the host's Slurm generation (PyTorch installed: ./dev.sh drill --trainer torch)",
    ),
    corrupt_latest_checkpoint: bool = typer.Option(
        False,
        "--corrupt-latest-checkpoint",
        help="make the newest checkpoint incomplete before the failure (torch: a save cut off before .metadata)",
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="observe mode: the report lists the intended actions; nothing is changed"
    ),
    k8s: bool = typer.Option(
        False,
        "--k8s",
        help="Slurm on Kubernetes: the same cluster behind a simulated Slinky control plane "
        "(kubesim): the incident also fences the Node, evicts the slurmd pod and replaces it",
    ),
    k8s_scaling_mode: ScalingModeChoice | None = typer.Option(
        None,
        help="with --k8s, how the NodeSet scales (default StatefulSet, as Slinky's): StatefulSet recreates the "
        "slurmd pod on another Node; DaemonSet has one per Node, and the node lifecycle brings a new Node",
    ),
    as_json: bool = typer.Option(False, "--json", help="print the report as one JSON object"),
    slurm_version: SlurmVersion | None = typer.Option(
        None, help="the Slurm generation to drill on (default: the host's; the other runs from a Debian root)"
    ),
    scenario: str | None = typer.Option(
        None, help="a game day scenario, or all: inject, verify, print the SLO table (exit 1 on a miss)"
    ),
    save_history: Path | None = typer.Option(
        None,
        "--save-history",
        help="write each incident's Temporal history into this directory (replay fixtures: docs/upgrades.md)",
    ),
) -> None:
    from drills.drill import DrillOptions

    version = slurm_version.value if slurm_version else None
    if scenario is not None:
        from drills.gameday import scenario_names

        try:
            names = scenario_names(scenario)
        except KeyError as e:
            raise BadInput(e.args[0]) from None
        if (
            xid != 79
            or node
            or corrupt_latest_checkpoint
            or dry_run
            or k8s
            or k8s_scaling_mode
            or trainer.value != "reference"
        ):
            raise BadInput(
                "a scenario injects its own failure: --xid, --node, --trainer, --corrupt-latest-checkpoint, "
                "--dry-run, --k8s and --k8s-scaling-mode do not apply to --scenario"
            )
        _run(_gameday(names, scenario == "all", as_json, version, save_history))
    if k8s_scaling_mode is not None and not k8s:
        raise BadInput("--k8s-scaling-mode applies to a drill on Slurm on Kubernetes: add --k8s")
    if trainer is TrainerChoice.torch:
        _check_torch_drill(version)
    opts = DrillOptions(
        xid=xid,
        node=node,
        trainer=trainer.value,
        corrupt_latest_checkpoint=corrupt_latest_checkpoint,
        dry_run=dry_run,
        k8s=k8s,
        **({"k8s_scaling_mode": k8s_scaling_mode.value} if k8s_scaling_mode else {}),
    )
    _run(_drill(opts, as_json, version, save_history))


def _check_torch_drill(slurm_version: str | None) -> None:
    """The PyTorch job runs with the worker's own python, which must have PyTorch: on the host's
    Slurm generation only (a Debian root's python has none)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise BadInput(
            "--trainer torch runs a real PyTorch job: install PyTorch (pip install -e '.[torch]'; "
            "./dev.sh drill --trainer torch does)"
        )
    stack = _drill_stack(slurm_version)[1]
    if stack.slurm_root is not None:
        raise BadInput(
            f"--trainer torch runs on the host's Slurm generation only: the Debian root of {stack.slurm_generation} "
            "has no PyTorch (leave out --slurm-version)"
        )


def _drill_stack(slurm_version: str | None) -> tuple[Settings, LocalStack]:
    """The configuration, and the local stack a drill or game day runs on."""
    from drills.localstack import LocalStack

    settings = load_settings()
    stack = LocalStack(task_queue=settings.task_queue, slurm_version=slurm_version)
    if stack.slurm_root is not None:  # the other generation's cluster has a worker of its own
        stack.task_queue = f"{settings.task_queue}-{stack.slurm_generation}"
    return settings, stack


async def _stack_client(stack: LocalStack) -> Client:
    # The local stack's dev server speaks plain gRPC, whatever RECOVERY_TEMPORAL_TLS* say.
    return await _client(stack.temporal_address, "default", tls=False, api_key=None)


async def _drill(opts: DrillOptions, as_json: bool, slurm_version: str | None, save_history: Path | None) -> int:
    from activities.xid_policy import XidPolicyTable
    from drills.drill import Drill
    from drills.gameday import save_histories
    from workflows.node_recovery import incident_workflow_id

    settings, stack = _drill_stack(slurm_version)
    with LiveProgress(stderr) as progress:
        progress.say("starting what is missing of the local stack (Temporal dev server, Slurm cluster, worker)...")
        cluster = await asyncio.to_thread(stack.up)
        client = await _stack_client(stack)
        policy = settings.model_copy(update={"spare_nodes": cluster.get("SLURM_SPARE_NODES", "")}).policy()
        drill = Drill(client, stack, cluster, policy, XidPolicyTable(settings.xid_policy_file), say=progress.say)
        result = await drill.run(opts)
        if save_history is not None and result.passed:  # only verified incidents become fixtures
            label = "-".join(
                [
                    f"drill-xid{opts.xid}",
                    *(["torch"] if opts.trainer == "torch" else []),
                    *(["dry-run"] if opts.dry_run else []),
                    *(["k8s"] if opts.k8s else []),
                    *(["corrupt"] if opts.corrupt_latest_checkpoint else []),
                ]
            )
            incident = client.get_workflow_handle(incident_workflow_id(result.report.node))
            for path in await save_histories(client, label, incident, result.report, save_history):
                progress.say(f"history saved: {path}")
        elif save_history is not None:
            progress.say("history not saved: the drill did not verify")
    html = write_report_html(result.report, stack.state_dir / "reports" / f"{result.report.incident_id}.html")
    if as_json:
        _print_json({**result.as_json(), "report_html": str(html)})
    else:
        print(render_report(result.report))
        print(f"  Slurm {result.slurm_version or 'unknown'}, slurmrestd {result.slurmrestd_version or 'not used'}")
        for check in result.checks:
            print(f"  [{'ok' if check.passed else 'FAILED'}] {check.name}: {check.detail}")
        print(f"HTML report: {html}")
        node_query = quote(f'RecoveryNode="{result.report.node}"')
        print(f"Web UI: http://127.0.0.1:{stack.ui_port}/namespaces/default/workflows?query={node_query}")
    return EXIT_OK if result.passed else EXIT_FAILED


async def _gameday(
    names: list[str], as_list: bool, as_json: bool, slurm_version: str | None, save_history: Path | None
) -> int:
    from activities.xid_policy import XidPolicyTable
    from drills.gameday import GameDay, exit_code

    settings, stack = _drill_stack(slurm_version)
    with LiveProgress(stderr) as progress:
        progress.say(
            "starting what is missing of the local stack (Temporal dev server; each scenario starts "
            "the Slurm cluster at its size, and a worker)..."
        )
        await asyncio.to_thread(stack.start_temporal)
        client = await _stack_client(stack)
        game = GameDay(
            client,
            stack,
            settings.policy(),
            XidPolicyTable(settings.xid_policy_file),
            say=progress.say,
            save_history=save_history,
        )
        results = await game.run(names)
    if as_json:
        found = [r.model_dump(mode="json") for r in results]
        _print_json(found if as_list else found[0])
    else:
        for r in results:
            table = Table(
                "SLO",
                "target",
                "measured",
                "met",
                "detail",
                title=escape(f"{r.scenario}: {'passed' if r.passed else 'MISSED'} ({r.description})"),
            )
            for slo in r.slos:
                table.add_row(
                    escape(slo.name),
                    escape(slo.target),
                    "-" if slo.measured is None else escape(str(slo.measured)),
                    "yes" if slo.met else "[bold red]NO[/]",
                    escape(slo.detail[:160]),
                )
            stdout.print(table)
    return exit_code(results)


class LiveProgress:
    """A drill's progress on stderr: each step as a line and, on a terminal, a spinner on the
    step in progress."""

    def __init__(self, console: Console):
        self.console = console
        self._spinner = console.status("starting") if console.is_terminal else None

    def __enter__(self) -> LiveProgress:
        if self._spinner is not None:
            self._spinner.start()
        return self

    def __exit__(self, *_) -> None:
        if self._spinner is not None:
            self._spinner.stop()

    def say(self, text: str) -> None:
        self.console.print(text, markup=False)
        if self._spinner is not None:
            self._spinner.update(text)


# --- rendering an incident ---------------------------------------------------------------------


def render_report(r: IncidentReport) -> str:
    lines = [
        f"incident {r.incident_id}: node {r.node}, XID {r.xid} ({r.fault_class.value}), action {r.action}",
        f"outcome: {r.outcome}",
        "",
        *render_timeline(r.phases, r.failure_at),
        "",
        f"  node replacement (failure -> spare {r.spare_node or '-'} in service): {_num(r.replacement_seconds, ' s')}",
        f"  time to resume (failure -> training again):            {_num(r.time_to_resume_seconds, ' s')}",
        f"  lost training progress: {_num(r.lost_steps, ' steps')}, {_num(r.lost_seconds, ' s')} of training"
        f" (resumed at step {_num(r.resumed_step)}, latest complete checkpoint step {_num(r.latest_complete_step)})",
    ]
    if (g := r.goodput) is not None:
        ratio = "-" if g.goodput is None else f"{g.goodput:.3f}"
        lines.append(
            f"  goodput (CRE): {ratio} = (t_w {g.wall_seconds} s - lost work {g.lost_work_seconds} s"
            f" - resume {g.resume_seconds} s - reschedule {g.reschedule_seconds} s"
            f" - saves {g.checkpoint_save_seconds} s) / (t_w - reschedule)"
        )
    for s in r.skipped_checkpoints:
        lines.append(f"  skipped incomplete checkpoint {s.checkpoint_id}: {s.why}")
    for j in r.jobs:
        lines.append(
            f"  job {j.job_id}: restarts {j.restart_count}, {','.join(j.nodes_before)} -> "
            f"{','.join(j.nodes_after) or '-'}, {'verified' if j.verified else 'NOT verified: ' + '; '.join(j.why_not)}"
        )
    return "\n".join(lines)


def render_status(s: IncidentStatus) -> str:
    origin = s.alerts[0].observed_at if s.alerts else (s.phases[0].started_at if s.phases else None)
    fault = f" ({s.fault_class.value})" if s.fault_class else ""
    lines = [
        f"incident {s.incident_id}: node {s.node}, XID {_num(s.xid)}{fault}",
        f"phase: {s.phase}" + (f", outcome: {s.outcome}" if s.outcome else ""),
        "",
    ]
    if origin is not None:
        lines += render_timeline(s.phases, origin)
    lines += [
        f"  alert from {a.source} by {a.actor} at {a.observed_at:%H:%M:%S}: XID {a.xid}, {a.reason}" for a in s.alerts
    ]
    return "\n".join(lines)


def render_timeline(phases: list[Phase], origin: datetime) -> list[str]:
    """The phases as a table: when each started after the failure, how long it took, its result."""
    lines = [f"  {'phase':<20} {'start':>9} {'duration':>9}  result"]
    for p in phases:
        start = (p.started_at - origin).total_seconds()
        duration = (p.ended_at - p.started_at).total_seconds() if p.ended_at else None
        lines.append(f"  {p.name:<20} {start:>8.1f}s {_num(duration, 's'):>9}  {p.result[:90]}")
    return lines


def _num(v, unit: str = "") -> str:
    return "-" if v is None else f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def timeline_json(phases: list[Phase], origin: datetime) -> list[dict]:
    return [
        {
            "phase": p.name,
            "started_at": p.started_at.isoformat(),
            "ended_at": p.ended_at.isoformat() if p.ended_at else None,
            "start_seconds": round((p.started_at - origin).total_seconds(), 3),
            "duration_seconds": round((p.ended_at - p.started_at).total_seconds(), 3) if p.ended_at else None,
            "result": p.result,
        }
        for p in phases
    ]


# --- finding incidents -------------------------------------------------------------------------


@dataclass
class Incident:
    """One run of a node's incident workflow, with what can be read of it."""

    run: WorkflowExecution
    report: IncidentReport | None = None  # when it completed
    status: IncidentStatus | None = None  # otherwise, if a worker answered the query

    @property
    def incident_id(self) -> str | None:
        found = self.report or self.status
        return found.incident_id if found else None

    @property
    def run_status(self) -> str:
        return self.run.status.name if self.run.status else "UNKNOWN"

    @property
    def settled(self) -> bool:
        """False when it ended and a person still has something to do."""
        if self.run.status == WorkflowExecutionStatus.RUNNING:
            return True
        return self.report is not None and self.report.outcome in SETTLED_OUTCOMES


async def load_incident(client: Client, run: WorkflowExecution) -> Incident:
    from workflows.node_recovery import NodeRecoveryWorkflow

    incident = Incident(run)
    handle = client.get_workflow_handle_for(NodeRecoveryWorkflow.run, run.id, run_id=run.run_id)
    if run.status == WorkflowExecutionStatus.COMPLETED:
        incident.report = await handle.result()
        return incident
    try:
        incident.status = await handle.query(NodeRecoveryWorkflow.status, rpc_timeout=timedelta(seconds=10))
    except Exception:  # no worker to answer (or the run failed before it had a state): it still lists
        pass
    return incident


def parse_incident_ref(ref: str) -> tuple[str, str | None]:
    """(node, incident id or None) from a node name or an incident id."""
    match = _INCIDENT_ID.match(ref)
    return checked_node(match.group("node") if match else ref), (ref if match else None)


def checked_node(name: str) -> str:
    try:
        return _check_node_name(name)
    except ValueError as e:
        raise BadInput(str(e)) from None


async def find_incident(client: Client, node: str, incident_id: str | None) -> Incident:
    """The node's latest incident, or the one with that incident id."""
    from workflows.node_recovery import incident_workflow_id

    runs = [run async for run in client.list_workflows(f"WorkflowId = '{incident_workflow_id(node)}'", limit=200)]
    for run in sorted(runs, key=lambda r: r.start_time, reverse=True):
        incident = await load_incident(client, run)
        if incident_id is None or incident.incident_id == incident_id:
            return incident
    raise BadInput(f"no incident {incident_id or node} in namespace {client.namespace}")


# --- inject, status, list ----------------------------------------------------------------------


@app.command(help="send one failure alert to a running stack (prints the workflow id)")
def inject(
    node: str = typer.Option(..., help="the failed node"),
    xid: int = typer.Option(..., help="the XID reported"),
    actor: str = typer.Option(f"{getpass.getuser()} via recovery inject", help="who asks"),
    reason: str = typer.Option("", help="why (default: the XID)"),
) -> None:
    _run(_inject(node, xid, actor, reason))


async def _inject(node: str, xid: int, actor: str, reason: str) -> int:
    from starter.alerts import raise_alert

    alert = NodeFailureAlert(
        node=node, xid=xid, source="cli", actor=actor, reason=reason or f"XID {xid} reported from the CLI"
    )
    settings = load_settings()
    client = await _client(settings.temporal_address, settings.temporal_namespace)
    handle = await raise_alert(client, alert, settings.task_queue, settings.policy())
    print(json.dumps({"workflow_id": handle.id, "run_id": handle.result_run_id, "node": alert.node, "xid": alert.xid}))
    return EXIT_OK


@app.command(help="the incidents and their phase (or outcome)")
def status(
    node: str | None = typer.Argument(None, help="only this node's incidents"),
    as_json: bool = JSON_OPTION,
    limit: int = typer.Option(50, help="at most this many"),
) -> None:
    _run(_status(node, as_json, limit))


async def _status(node: str | None, as_json: bool, limit: int) -> int:
    from workflows.node_recovery import incident_workflow_id

    client = await _configured_client()
    query = "WorkflowType='NodeRecoveryWorkflow'"
    if node:
        NodeFailureAlert(node=node, xid=1, source="cli", actor="status")  # validates the name
        query += f" AND WorkflowId='{incident_workflow_id(node)}'"
    rows = []
    async for wf in client.list_workflows(query, limit=limit):
        handle = client.get_workflow_handle(wf.id, run_id=wf.run_id)
        row = {
            "workflow_id": wf.id,
            "run_id": wf.run_id,
            "status": wf.status.name if wf.status else "?",
            "started_at": wf.start_time.isoformat(),
        }
        try:
            if wf.status == WorkflowExecutionStatus.RUNNING:
                current = await handle.query("status")
                row |= {
                    "incident_id": current["incident_id"],
                    "node": current["node"],
                    "phase": current["phase"],
                    "xid": current["xid"],
                }
            elif wf.status == WorkflowExecutionStatus.COMPLETED:
                report = await handle.result()
                row |= {
                    "incident_id": report["incident_id"],
                    "node": report["node"],
                    "phase": "done",
                    "xid": report["xid"],
                    "outcome": report["outcome"],
                }
        except Exception as e:  # a run whose worker is gone still lists, with why it has no phase
            row["error"] = str(e)
        rows.append(row)
    if as_json:
        _print_json(rows)
    else:
        for r in rows:
            print(
                f"{r.get('incident_id', r['workflow_id']):<34} {r['status']:<11} phase={r.get('phase', '?'):<20}"
                f" {r.get('outcome', '')}"
            )
        if not rows:
            print("no incidents")
    return EXIT_OK


@app.command("list", help="the incidents, newest first, filtered by their search attributes")
def list_incidents(
    node: str | None = typer.Option(None, help="only this node's incidents"),
    xid: int | None = typer.Option(None, help="only incidents opened by this XID"),
    phase: str | None = typer.Option(None, help="only incidents in this phase (done: ended)"),
    outcome: str | None = typer.Option(None, help="only incidents with this outcome (recovered, escalated, ...)"),
    running: bool = typer.Option(False, "--running", help="only incidents still running"),
    limit: int = typer.Option(50, help="at most this many"),
    as_json: bool = JSON_OPTION,
) -> None:
    _run(_list(node, xid, phase, outcome, running, limit, as_json))


def incident_query(node: str | None, xid: int | None, phase: str | None, outcome: str | None, running: bool) -> str:
    """The visibility query for `recovery list` (values checked: they are pasted into the query)."""
    terms = ["WorkflowType = 'NodeRecoveryWorkflow'"]
    if node is not None:
        checked_node(node)
        terms.append(f"{sa.NODE.name} = '{node}'")
    if xid is not None:
        terms.append(f"{sa.XID.name} = {int(xid)}")
    for key, value in ((sa.PHASE, phase), (sa.OUTCOME, outcome)):
        if value is not None:
            if not _QUERY_VALUE.match(value):
                raise BadInput(f"{value!r}: use letters, digits, spaces and . _ : -")
            terms.append(f"{key.name} = '{value}'")
    if running:
        terms.append("ExecutionStatus = 'Running'")
    return " AND ".join(terms)


async def _list(
    node: str | None, xid: int | None, phase: str | None, outcome: str | None, running: bool, limit: int, as_json: bool
) -> int:
    query = incident_query(node, xid, phase, outcome, running)
    client = await _configured_client()
    runs = [run async for run in client.list_workflows(query, limit=limit)]
    # The incident id is the workflow's own state: read each run's, a few at a time.
    gate = asyncio.Semaphore(8)

    async def read(run: WorkflowExecution) -> Incident:
        async with gate:
            return await load_incident(client, run)

    incidents = await asyncio.gather(*(read(run) for run in runs))
    rows = [_list_row(i) for i in incidents]
    if as_json:
        _print_json(rows)
        return EXIT_OK
    table = Table("incident", "node", "XID", "phase", "outcome", "jobs", "started", "run", box=None)
    for row in rows:
        table.add_row(
            row["incident_id"] or row["workflow_id"],
            row["node"],
            _num(row["xid"]),
            row["phase"],
            row["outcome"] or "",
            ",".join(row["job_ids"]),
            row["started_at"][:19],
            row["status"],
        )
    stdout.print(table if rows else "no incidents")
    return EXIT_OK


def _list_row(incident: Incident) -> dict:
    run, attributes = incident.run, incident.run.typed_search_attributes
    return {
        "incident_id": incident.incident_id,
        "workflow_id": run.id,
        "run_id": run.run_id,
        "status": incident.run_status,
        "node": attributes.get(sa.NODE),
        "xid": attributes.get(sa.XID),
        "phase": attributes.get(sa.PHASE),
        "outcome": attributes.get(sa.OUTCOME),
        "job_ids": attributes.get(sa.JOB_IDS) or [],
        "peer_nodes": attributes.get(sa.PEER_NODES) or [],
        "started_at": run.start_time.isoformat(),
        "closed_at": run.close_time.isoformat() if run.close_time else None,
    }


# --- describe and report -----------------------------------------------------------------------


@app.command(help="one incident's timeline: phase, start, duration, result (exit 1: it ended unrecovered)")
def describe(
    incident: str = typer.Argument(..., help="a node name (its latest incident) or an incident id"),
    as_json: bool = JSON_OPTION,
) -> None:
    _run(_describe(incident, as_json))


async def _describe(ref: str, as_json: bool) -> int:
    node, incident_id = parse_incident_ref(ref)
    client = await _configured_client()
    incident = await find_incident(client, node, incident_id)
    run = incident.run
    if as_json:
        found = incident.report or incident.status
        origin = incident.report.failure_at if incident.report else _status_origin(incident.status)
        _print_json(
            {
                "incident_id": incident.incident_id,
                "workflow_id": run.id,
                "run_id": run.run_id,
                "status": incident.run_status,
                "settled": incident.settled,
                "phase": "done" if incident.report else (incident.status.phase if incident.status else None),
                "outcome": found.outcome if found else None,
                "timeline": timeline_json(found.phases, origin) if found and origin else [],
                "report": incident.report.model_dump(mode="json") if incident.report else None,
                "incident": incident.status.model_dump(mode="json") if incident.status else None,
            }
        )
    else:
        print(f"workflow {run.id}, run {run.run_id}: {incident.run_status}")
        if incident.report:
            print(render_report(incident.report))
        elif incident.status:
            print(render_status(incident.status))
        else:
            print("no worker answered for its state (is a worker running?)")
    return EXIT_OK if incident.settled else EXIT_FAILED


def _status_origin(status: IncidentStatus | None) -> datetime | None:
    if status is None:
        return None
    if status.alerts:
        return status.alerts[0].observed_at
    return status.phases[0].started_at if status.phases else None


@app.command(help="write an ended incident's report as a self-contained HTML page (prints its path)")
def report(
    incident: str = typer.Argument(..., help="a node name (its latest incident) or an incident id"),
    output: Path | None = typer.Option(None, "--output", "-o", help="the file (default: ./INCIDENT.html)"),
    as_json: bool = JSON_OPTION,
) -> None:
    _run(_report(incident, output, as_json))


async def _report(ref: str, output: Path | None, as_json: bool) -> int:
    node, incident_id = parse_incident_ref(ref)
    client = await _configured_client()
    incident = await find_incident(client, node, incident_id)
    if incident.report is None:
        raise BadInput(
            f"incident {incident.incident_id or ref} has no report yet ({incident.run_status}"
            + (f", phase {incident.status.phase}" if incident.status else "")
            + ")"
        )
    path = write_report_html(incident.report, output or Path(f"{incident.report.incident_id}.html"))
    if as_json:
        _print_json({"incident_id": incident.report.incident_id, "report_html": str(path.resolve())})
    else:
        print(path.resolve())
    return EXIT_OK


# --- operator decisions ------------------------------------------------------------------------


ACTOR_OPTION = typer.Option(
    None, help="who decides: a name in the worker's operator list (default RECOVERY_OPERATOR, else the login name)"
)


def _signer(actor: str | None, settings=None):
    """The operator's name and key; BadInput (exit 2) without a usable key."""
    from starter.operator_key import operator_signer

    settings = settings or load_settings()
    try:
        return operator_signer(settings.operator_key_file, actor or settings.operator or getpass.getuser())
    except ValueError as e:
        raise BadInput(str(e)) from None


def _decision_command(name: str, what: str) -> None:
    @app.command(
        name, help=f"{what} (only when the incident awaits a decision); signed with RECOVERY_OPERATOR_KEY_FILE"
    )
    def decide(
        incident: str = typer.Argument(..., help="a node name (its latest incident) or an incident id"),
        reason: str = typer.Option(..., help="why: recorded with the decision"),
        actor: str | None = ACTOR_OPTION,
        as_json: bool = JSON_OPTION,
    ) -> None:
        OperatorDecision(
            actor="unnamed" if actor is None else actor, reason=reason
        )  # a bad reason or actor: exit 2 before anything
        _run(_decide(name, incident, actor, reason, as_json))


_decision_command("approve", "let the incident go on with the step that awaits approval")
_decision_command("deny", "refuse the step that awaits approval")
_decision_command("abort", "stop the incident where it is")


async def _decide(name: str, ref: str, actor: str | None, reason: str, as_json: bool) -> int:
    from starter.decisions import NothingAwaitsApproval, decide

    node, incident_id = parse_incident_ref(ref)
    client = await _configured_client()
    incident = await find_incident(client, node, incident_id)
    label = incident.incident_id or ref
    if incident.run.status != WorkflowExecutionStatus.RUNNING:
        raise BadInput(f"incident {label} has ended ({incident.run_status}): nothing awaits a decision")
    signer = _signer(actor)
    handle = client.get_workflow_handle(incident.run.id, run_id=incident.run.run_id)
    try:
        status = await decide(handle, name, signer, reason)
    except NothingAwaitsApproval as e:
        raise BadInput(f"incident {label} refused {name}: {e}") from None
    except WorkflowUpdateFailedError as e:
        raise BadInput(f"incident {label} refused {name}: {e.cause.message if e.cause else e}") from None
    if as_json:
        _print_json(status.model_dump(mode="json"))
    else:
        print(f"incident {status.incident_id}: {name} accepted from {signer.actor}; phase {status.phase}")
    return EXIT_OK


# --- fleet budget and lemon nodes -------------------------------------------------------------


@app.command(
    "release-quarantine",
    help="let a quarantined lemon node return to service automatically again; signed with RECOVERY_OPERATOR_KEY_FILE",
)
def release_quarantine_command(
    node: str = typer.Argument(..., help="the quarantined node"),
    reason: str = typer.Option(..., help="why (e.g. the repair ticket): recorded with the release"),
    actor: str | None = ACTOR_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    _run(_release_quarantine(checked_node(node), actor, reason, as_json))


async def _release_quarantine(node: str, actor: str | None, reason: str, as_json: bool) -> int:
    from activities.budget import release_quarantine
    from workflows.fleet_budget import fleet_budget_workflow_id

    try:
        QuarantineRelease(node=node, actor="unnamed" if actor is None else actor, reason=reason)
    except ValidationError as e:
        raise BadInput(f"release-quarantine: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None
    settings = load_settings()
    signer = _signer(actor, settings)
    client = await _client(settings.temporal_address, settings.temporal_namespace)
    try:
        status = await release_quarantine(
            client, node, signer, reason, workflow_id=fleet_budget_workflow_id(settings.task_queue)
        )
    except ValueError as e:
        raise BadInput(str(e)) from None
    if as_json:
        _print_json(status.model_dump(mode="json"))
    else:
        print(f"{node} released from quarantine by {signer.actor}: it may return to service once repaired and healthy")
    return EXIT_OK


@app.command(
    "reset-breaker",
    help="reset the tripped fence circuit breaker: held incidents are weighed again; "
    "signed with RECOVERY_OPERATOR_KEY_FILE",
)
def reset_breaker_command(
    reason: str = typer.Option(..., help="why (what was found and fixed): recorded with the reset"),
    actor: str | None = ACTOR_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    _run(_reset_breaker(actor, reason, as_json))


async def _reset_breaker(actor: str | None, reason: str, as_json: bool) -> int:
    from activities.budget import reset_breaker
    from workflows.fleet_budget import fleet_budget_workflow_id

    try:
        BreakerReset(actor="unnamed" if actor is None else actor, reason=reason)
    except ValidationError as e:
        raise BadInput(f"reset-breaker: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None
    settings = load_settings()
    signer = _signer(actor, settings)
    client = await _client(settings.temporal_address, settings.temporal_namespace)
    try:
        status = await reset_breaker(client, signer, reason, workflow_id=fleet_budget_workflow_id(settings.task_queue))
    except ValueError as e:
        raise BadInput(str(e)) from None
    if as_json:
        _print_json(status.model_dump(mode="json"))
    else:
        print(
            f"fence circuit breaker reset by {signer.actor}; "
            + (f"tripped again: {status.breaker.reason}" if status.breaker else "closed")
            + f"; {len(status.fence_held)} incident(s) still held"
        )
    return EXIT_OK


@app.command(help="the fleet disruption budget: leases held and waiting, quarantined lemon nodes, the breaker")
def budget(as_json: bool = JSON_OPTION) -> None:
    _run(_budget(as_json))


async def _budget(as_json: bool) -> int:
    from activities.budget import fleet_budget_status
    from workflows.fleet_budget import fleet_budget_workflow_id

    settings = load_settings()
    client = await _client(settings.temporal_address, settings.temporal_namespace)
    try:
        status = await fleet_budget_status(client, fleet_budget_workflow_id(settings.task_queue))
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise
        raise BadInput(
            f"no fleet budget runs for task queue {settings.task_queue} (it starts with the first "
            "incident, or with the worker)"
        ) from None
    if as_json:
        _print_json(status.model_dump(mode="json"))
        return EXIT_OK
    p = status.policy
    print(
        f"{len(status.holders)} of {p.max_nodes} nodes under remediation; {len(status.waiting)} waiting; "
        f"{status.disrupted_jobs_in_window} of {p.max_disrupted_jobs} jobs disrupted in the last "
        f"{p.disruption_window_seconds:.0f} s"
    )
    print(
        f"fence circuit breaker: {len(status.fenced_in_window)} node(s) fenced in the last "
        f"{p.breaker_window_seconds:.0f} s (at most {p.breaker_max_fences}, {p.breaker_fleet_fraction:g} of the "
        f"fleet, {p.breaker_partition_fraction:g} of a partition); "
        + (
            f"TRIPPED at {status.breaker.at:%Y-%m-%d %H:%M:%S} by {status.breaker.node}: {status.breaker.reason}; "
            f"{len(status.fence_held)} incident(s) held. Reset with `recovery reset-breaker --reason ...`"
            if status.breaker
            else "closed"
        )
    )
    table = Table("node", "incident", "lease", "since", "why", box=None)
    for lease in status.holders + status.waiting + status.fence_held:
        table.add_row(
            lease.node,
            lease.incident_id,
            lease.status.value,
            f"{lease.granted_at or lease.requested_at:%Y-%m-%d %H:%M:%S}",
            lease.reason,
        )
    for q in status.quarantined:
        table.add_row(
            q.node,
            "",
            "quarantined",
            f"{q.since:%Y-%m-%d %H:%M:%S}" if q.since else "",
            f"{len(q.incidents_in_window)} incident(s) in the window",
        )
    stdout.print(table)
    return EXIT_OK


# --- config ------------------------------------------------------------------------------------


@app.command(help="the configuration in effect (environment, RECOVERY_CONFIG_FILE, defaults), secrets masked")
def config(as_json: bool = JSON_OPTION) -> None:
    entries = describe_config(load_settings(), load_telemetry_settings())
    if as_json:
        _print_json([e.model_dump() for e in entries])
    else:
        table = Table("variable", "value", "from", box=None)
        for e in entries:
            table.add_row(e.variable, "" if e.value is None else str(e.value), e.source)
        stdout.print(table)
    raise typer.Exit(EXIT_OK)


# --- stack -------------------------------------------------------------------------------------


@app.command(help="start, stop or inspect the embedded local stack")
def stack(
    action: StackAction = typer.Argument(..., help="up, down or status"),
    slurm_version: SlurmVersion | None = typer.Option(None, help="the Slurm generation (default: the host's)"),
) -> None:
    _run(_stack(action, slurm_version.value if slurm_version else None))


async def _stack(action: StackAction, slurm_version: str | None) -> int:
    from drills.localstack import DEBIAN_RELEASE_OF_GENERATION, LocalStack

    local = LocalStack(task_queue=load_settings().task_queue, slurm_version=slurm_version)
    if action == StackAction.up:
        cluster = await asyncio.to_thread(local.up)
        print(
            json.dumps(
                {
                    "temporal": local.temporal_address,
                    "ui": f"http://127.0.0.1:{local.ui_port}",
                    "slurm_conf": cluster["SLURM_CONF"],
                    "slurmrestd": cluster["SLURMRESTD_URL"],
                    "operator_key_file": str(local.operator_key_file),
                }
            )
        )
    elif action == StackAction.down:
        # every generation's cluster and worker, then the dev server
        for version in DEBIAN_RELEASE_OF_GENERATION:
            other = LocalStack(state_dir=local.state_dir, slurm_version=version)
            await asyncio.to_thread(other.stop_worker)
            await asyncio.to_thread(other.stop_slurm)
        await asyncio.to_thread(local.down)
    else:
        current = await asyncio.to_thread(local.status)
        print(json.dumps(current))
        return EXIT_OK if all(current.values()) else EXIT_FAILED
    return EXIT_OK


# --- hooks -------------------------------------------------------------------------------------


@app.command(help="serve the alert hooks (RECOVERY_HOOKS_* configure it; docs/alert-hooks.md)")
def hooks(
    host: str | None = typer.Option(None, help="listen address (default RECOVERY_HOOKS_HOST or 127.0.0.1)"),
    port: int | None = typer.Option(None, help="listen port (default RECOVERY_HOOKS_PORT or 8910)"),
) -> None:
    from hooks.server import serve
    from hooks.settings import HookSettings

    overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    # serve() picks the event loop (uvloop) before one exists: the coroutine runs after it.
    _run(serve(load_settings(), HookSettings(**overrides)))


# --- main --------------------------------------------------------------------------------------


def _core_logs_to_stderr() -> None:
    """The Temporal SDK core's own log lines (say, a warning from a drill's in-process worker) go
    through Python's logging, to stderr: printed by the core, one landed on stdout before the JSON
    of `recovery drill --k8s --json`, and a script reading that JSON failed."""
    forwarded = LoggingConfig(
        filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
        forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
    )
    Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=forwarded)), error_if_already_set=False)


def main(argv: list[str] | None = None) -> None:
    _core_logs_to_stderr()
    try:
        app(args=argv, prog_name="recovery")
        code = EXIT_OK
    except SystemExit as e:  # typer.Exit from a command, or a usage error (2)
        code = e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'input'}: {err['msg']}" for err in e.errors())
        _err(f"recovery: bad input, nothing was changed: {problems}")
        code = EXIT_BAD_INPUT
    except (BadInput, ConfigError) as e:
        _err(f"recovery: bad input, nothing was changed: {e}")
        code = EXIT_BAD_INPUT
    except RPCError as e:
        refused = e.status in (
            RPCStatusCode.INVALID_ARGUMENT,
            RPCStatusCode.NOT_FOUND,
            RPCStatusCode.FAILED_PRECONDITION,
        )
        _err(f"recovery: {'bad input, nothing was changed' if refused else 'Temporal did not answer'}: {e}")
        code = EXIT_BAD_INPUT if refused else EXIT_UNAVAILABLE
    except (RuntimeError, OSError) as e:
        _err(f"recovery: {e}")
        code = EXIT_UNAVAILABLE
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in LOCAL_STACK_PACKAGES:
            raise
        command = next((arg for arg in (sys.argv[1:] if argv is None else argv) if not arg.startswith("-")), "")
        _err(
            f"recovery {command} needs the local stack (drills/), which this installation does not have "
            "(the image runs the worker and the hooks): run it from a checkout, after ./dev.sh setup"
        )
        code = EXIT_UNAVAILABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: the SDK's threads can crash it (sdk-python#300)


if __name__ == "__main__":
    main()
