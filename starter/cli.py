"""`recovery`: the operator's command line.

  recovery drill [--xid 79] [--node NODE] [--corrupt-latest-checkpoint] [--json]
  recovery inject --node NODE --xid N [--actor WHO] [--reason WHY]
  recovery status [NODE] [--json]
  recovery stack up|down|status

Exit codes: 0 done (for drill: recovered and verified), 1 the drill or incident did not verify,
2 bad input (nothing was changed), 3 the stack or a service could not be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import sys

from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus

from contracts.models import IncidentReport, NodeFailureAlert
from contracts.settings import Settings

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNAVAILABLE = 0, 1, 2, 3


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def _client(address: str, namespace: str) -> Client:
    from worker import connect

    settings = Settings(TEMPORAL_ADDRESS=address, TEMPORAL_NAMESPACE=namespace)
    return await connect(settings, attempts=10)


# --- drill -------------------------------------------------------------------------------------


async def cmd_drill(args: argparse.Namespace) -> int:
    from activities.xid_policy import XidPolicyTable
    from starter.drill import Drill, DrillOptions
    from starter.localstack import LocalStack

    opts = DrillOptions(xid=args.xid, node=args.node, corrupt_latest_checkpoint=args.corrupt_latest_checkpoint)
    settings = Settings()
    stack = LocalStack(task_queue=settings.task_queue, slurm_version=args.slurm_version)
    if stack.slurm_root is not None:  # the other generation's cluster has a worker of its own
        stack.task_queue = f"{settings.task_queue}-{stack.slurm_generation}"
    _err("starting what is missing of the local stack (Temporal dev server, Slurm cluster, worker)...")
    cluster = await asyncio.to_thread(stack.up)
    client = await _client(stack.temporal_address, "default")
    policy = settings.model_copy(update={"spare_nodes": cluster.get("SLURM_SPARE_NODES", "")}).policy()
    drill = Drill(client, stack, cluster, policy, XidPolicyTable(settings.xid_policy_file), say=_err)
    result = await drill.run(opts)
    if args.json:
        print(json.dumps(result.as_json(), indent=2))
    else:
        print(render_report(result.report))
        for check in result.checks:
            print(f"  [{'ok' if check.passed else 'FAILED'}] {check.name}: {check.detail}")
        print(f"Web UI: http://127.0.0.1:{stack.ui_port}/namespaces/default/workflows")
    return EXIT_OK if result.passed else EXIT_FAILED


def render_report(r: IncidentReport) -> str:
    def num(v, unit=""):
        return "-" if v is None else f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"

    lines = [
        f"incident {r.incident_id}: node {r.node}, XID {r.xid} ({r.fault_class.value}), action {r.action}",
        f"outcome: {r.outcome}",
        "",
        f"  {'phase':<20} {'start':>9} {'duration':>9}  result",
    ]
    for p in r.phases:
        start = (p.started_at - r.failure_at).total_seconds()
        dur = (p.ended_at - p.started_at).total_seconds() if p.ended_at else None
        lines.append(f"  {p.name:<20} {start:>8.1f}s {num(dur, 's'):>9}  {p.result[:90]}")
    lines += [
        "",
        f"  node replacement (failure -> spare {r.spare_node or '-'} in service): {num(r.replacement_seconds, ' s')}",
        f"  time to resume (failure -> training again):            {num(r.time_to_resume_seconds, ' s')}",
        f"  lost training progress: {num(r.lost_steps, ' steps')}, {num(r.lost_seconds, ' s')} of training"
        f" (resumed at step {num(r.resumed_step)}, latest complete checkpoint step {num(r.latest_complete_step)})",
    ]
    for s in r.skipped_checkpoints:
        lines.append(f"  skipped incomplete checkpoint {s.checkpoint_id}: {s.why}")
    for j in r.jobs:
        lines.append(f"  job {j.job_id}: restarts {j.restart_count}, {','.join(j.nodes_before)} -> "
                     f"{','.join(j.nodes_after) or '-'}, {'verified' if j.verified else 'NOT verified: ' + '; '.join(j.why_not)}")
    return "\n".join(lines)


# --- inject ------------------------------------------------------------------------------------


async def cmd_inject(args: argparse.Namespace) -> int:
    from starter.alerts import raise_alert

    alert = NodeFailureAlert(
        node=args.node, xid=args.xid, source="cli", actor=args.actor,
        reason=args.reason or f"XID {args.xid} reported from the CLI",
    )
    settings = Settings()
    client = await _client(settings.temporal_address, settings.temporal_namespace)
    handle = await raise_alert(client, alert, settings.task_queue, settings.policy())
    print(json.dumps({"workflow_id": handle.id, "run_id": handle.result_run_id, "node": alert.node, "xid": alert.xid}))
    return EXIT_OK


# --- status ------------------------------------------------------------------------------------


async def cmd_status(args: argparse.Namespace) -> int:
    from workflows.node_recovery import incident_workflow_id

    settings = Settings()
    client = await _client(settings.temporal_address, settings.temporal_namespace)
    query = "WorkflowType='NodeRecoveryWorkflow'"
    if args.node:
        NodeFailureAlert(node=args.node, xid=1, source="cli", actor="status")  # validates the name
        query += f" AND WorkflowId='{incident_workflow_id(args.node)}'"
    rows = []
    async for wf in client.list_workflows(query, limit=args.limit):
        handle = client.get_workflow_handle(wf.id, run_id=wf.run_id)
        row = {"workflow_id": wf.id, "run_id": wf.run_id, "status": wf.status.name if wf.status else "?",
               "started_at": wf.start_time.isoformat()}
        try:
            if wf.status == WorkflowExecutionStatus.RUNNING:
                status = await handle.query("status")
                row |= {"incident_id": status["incident_id"], "node": status["node"],
                        "phase": status["phase"], "xid": status["xid"]}
            elif wf.status == WorkflowExecutionStatus.COMPLETED:
                report = await handle.result()
                row |= {"incident_id": report["incident_id"], "node": report["node"], "phase": "done",
                        "xid": report["xid"], "outcome": report["outcome"]}
        except Exception as e:  # a run whose worker is gone still lists, with why it has no phase
            row["error"] = str(e)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r.get('incident_id', r['workflow_id']):<34} {r['status']:<11} phase={r.get('phase', '?'):<20}"
                  f" {r.get('outcome', '')}")
        if not rows:
            print("no incidents")
    return EXIT_OK


# --- stack -------------------------------------------------------------------------------------


async def cmd_stack(args: argparse.Namespace) -> int:
    from starter.localstack import LocalStack

    from starter.localstack import DEBIAN_RELEASE_OF_GENERATION

    stack = LocalStack(task_queue=Settings().task_queue, slurm_version=args.slurm_version)
    if args.action == "up":
        cluster = await asyncio.to_thread(stack.up)
        print(json.dumps({"temporal": stack.temporal_address, "ui": f"http://127.0.0.1:{stack.ui_port}",
                          "slurm_conf": cluster["SLURM_CONF"], "slurmrestd": cluster["SLURMRESTD_URL"]}))
    elif args.action == "down":
        # every generation's cluster and worker, then the dev server
        for version in DEBIAN_RELEASE_OF_GENERATION:
            other = LocalStack(state_dir=stack.state_dir, slurm_version=version)
            await asyncio.to_thread(other.stop_worker)
            await asyncio.to_thread(other.stop_slurm)
        await asyncio.to_thread(stack.down)
    else:
        status = await asyncio.to_thread(stack.status)
        print(json.dumps(status))
        return EXIT_OK if all(status.values()) else EXIT_FAILED
    return EXIT_OK


# --- hooks -------------------------------------------------------------------------------------


def cmd_hooks(args: argparse.Namespace):
    """Not async: it picks the event loop (uvloop) before main() starts one; returns the coroutine."""
    from starter.hooks.server import serve
    from starter.hooks.settings import HookSettings

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    return serve(Settings(), HookSettings(**overrides))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="recovery", description="GPU node failure recovery on Slurm, driven by Temporal")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("drill", help="run a recovery drill on the embedded local stack")
    d.add_argument("--xid", type=int, default=79)
    d.add_argument("--node", help="node to fail (default: one of the reference job's nodes)")
    d.add_argument("--corrupt-latest-checkpoint", action="store_true",
                   help="make the newest checkpoint incomplete before the failure")
    d.add_argument("--json", action="store_true", help="print the report as one JSON object")
    d.add_argument("--slurm-version", choices=["22.05", "24.11"],
                   help="the Slurm generation to drill on (default: the host's; the other runs from a Debian root)")
    d.set_defaults(run=cmd_drill)

    i = sub.add_parser("inject", help="send one failure alert to a running stack")
    i.add_argument("--node", required=True)
    i.add_argument("--xid", type=int, required=True)
    i.add_argument("--actor", default=f"{getpass.getuser()} via recovery inject")
    i.add_argument("--reason", default="")
    i.set_defaults(run=cmd_inject)

    s = sub.add_parser("status", help="the incidents and their phase")
    s.add_argument("node", nargs="?")
    s.add_argument("--json", action="store_true")
    s.add_argument("--limit", type=int, default=50)
    s.set_defaults(run=cmd_status)

    k = sub.add_parser("stack", help="start, stop or inspect the embedded local stack")
    k.add_argument("action", choices=["up", "down", "status"])
    k.add_argument("--slurm-version", choices=["22.05", "24.11"], help="the Slurm generation (default: the host's)")
    k.set_defaults(run=cmd_stack)

    h = sub.add_parser("hooks", help="serve the alert hooks (RECOVERY_HOOKS_* configure it; docs/alert-hooks.md)")
    h.add_argument("--host", help="listen address (default RECOVERY_HOOKS_HOST or 127.0.0.1)")
    h.add_argument("--port", type=int, help="listen port (default RECOVERY_HOOKS_PORT or 8910)")
    h.set_defaults(run=cmd_hooks)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        code = asyncio.run(args.run(args))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'input'}: {err['msg']}" for err in e.errors())
        _err(f"recovery: bad input, nothing was changed: {problems}")
        code = EXIT_BAD_INPUT
    except (RuntimeError, OSError) as e:
        _err(f"recovery: {e}")
        code = EXIT_UNAVAILABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: the SDK's threads can crash it (sdk-python#300)


if __name__ == "__main__":
    main()
