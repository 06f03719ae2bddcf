"""`recovery drill --k8s` end to end: the real local Slurm cluster, the in-repo Kubernetes API server
holding a simulated Slinky cluster that mirrors it (kubesim/slinky.py), a real Temporal dev server
and the reference training job with real checkpoints."""

from __future__ import annotations

import asyncio

import pytest

from contracts.kubernetes import SLURMD_PRE_STOP_REASON
from drills.drill import DrillOptions, SimulatedKubernetes
from workflows.return_to_service import ReturnToServiceWorkflow

pytestmark = pytest.mark.slurm

KUBERNETES_CHECKS = [
    "slurmd pod evicted after the drain and the requeue",
    "failed Node cordoned and tainted",
    "replacement Node in service",
]


async def test_xid79_on_slurm_on_kubernetes_evicts_the_slurmd_pod_after_the_drain_and_resumes_the_job(drill):
    result = await drill.run(DrillOptions(xid=79, k8s=True))
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert [c.name for c in result.checks][-3:] == KUBERNETES_CHECKS
    [job] = r.jobs
    assert job.restart_count == 1 and job.verified
    # It may run on the failed Slurm node again: that name serves from a new Node now (below).
    assert r.node in job.nodes_before and len(job.nodes_after) == 2
    assert r.resumed_step == r.latest_complete_step and r.resumed_step >= 10
    # The platform's steps, each where the workflow must take it: the pod goes only once Slurm
    # has let go of the node.
    assert [p.name for p in r.phases] == [
        "classify",
        "breaker",
        "drain",
        "fence_node",
        "find_jobs",
        "budget",
        "signal",
        "grace",
        "requeue",
        "mark_down",
        "release_node",
        "request_replacement",
        "wait_for_spare",
        "readmit_node",
        "verify",
        "return_to_service",
    ]
    fence = next(p for p in r.phases if p.name == "fence_node")
    assert fence.result.startswith(f"slurm/{r.node} on Node k8s-{r.node}: "), fence.result
    at = {a.action: a.at for a in r.actions}
    assert (
        at["drain_node"]
        < at["fence_k8s_node"]
        < at["requeue_hold"]
        < at["release_job"]
        < at["down_node"]
        < at["evict_slurmd_pod"]
    )
    eviction = next(a for a in r.actions if a.action == "evict_slurmd_pod")
    assert eviction.command.startswith(f"POST /api/v1/namespaces/slurm/pods/{r.node}/eviction ")
    assert f"Slurm: {r.node} down+DRAIN" in eviction.detail
    assert next(p for p in r.phases if p.name == "release_node").result.endswith("; terminated")
    # The replacement (Slinky's default StatefulSet mode): the NodeSet recreated the slurmd pod, the
    # same Slurm node, on a new Node, and the operator set it IDLE there.
    assert r.spare_node == r.node and 0 < r.replacement_seconds < r.time_to_resume_seconds
    request = next(p for p in r.phases if p.name == "request_replacement")
    assert f"recreates slurmd pod {r.node}, Slurm node and all, on another Node" in request.result, request.result
    wait = next(p for p in r.phases if p.name == "wait_for_spare")
    assert wait.result.startswith(f"{r.node} on Node k8s-gpu-new-0: ")
    health = f"; health check passed: {r.node}: slurmd answers, 8 GPUs present, no fault"
    assert wait.result.endswith(health), wait.result
    assert (await drill.slurm.get_node(r.node)).in_service


async def test_a_job_that_needs_every_node_runs_again_on_the_failed_slurm_node_once_it_moved(drill):
    """StatefulSet mode, a job on all four compute nodes: requeued off gpu-2, it can start only
    once gpu-2 serves again, from a new Node. The incident takes gpu-2 out of its exclusions then
    (before, the job stayed pending, kept off a node that now runs on healthy hardware)."""
    result = await drill.run(DrillOptions(xid=79, k8s=True, job_nodes=4))
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    assert result.passed, [c for c in result.checks if not c.passed]
    [job] = r.jobs
    assert job.verified and job.restart_count == 1 and sorted(job.nodes_after) == sorted(job.nodes_before)
    [readmitted] = [a for a in r.actions if a.action == "readmit_node"]
    assert readmitted.target == f"job {job.job_id}" and readmitted.executed
    assert readmitted.detail.startswith(f"ExcNodeList=(none): {r.node} serves from new hardware (")
    assert "k8s-gpu-new-0" in readmitted.detail
    at = {a.action: a.at for a in r.actions}
    assert at["exclude_nodes"] < at["readmit_node"]
    assert (await drill.slurm.get_job(job.job_id)).excluded_nodes == []


async def test_the_return_to_service_leaves_the_failed_node_fenced_once_its_slurm_node_moved(drill):
    """StatefulSet mode: the failed Slurm node serves again from a new Node. Its health says nothing
    of the Node it left, which must stay fenced (before: the return to service found the Slurm node
    healthy and uncordoned the broken Node)."""
    async with SimulatedKubernetes(drill) as kubernetes:
        run = await drill.start(DrillOptions(xid=79), kubernetes=kubernetes)
        report = await drill.follow(run.handle, 300)
        watcher = drill.client.get_workflow_handle_for(ReturnToServiceWorkflow.run, report.return_to_service)
        returned = await asyncio.wait_for(watcher.result(), 60)
        result = await drill.finish(run, 60)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert returned.returned, returned
    [left] = [a for a in returned.actions if a.action == "unfence_k8s_node"]
    failed_node = f"k8s-{report.node}"
    assert left.detail.startswith(f"left fenced: Slurm node {report.node} now runs on Node k8s-gpu-new-0"), left
    assert left.target == failed_node and left.path == "none"
    assert "failed Node cordoned and tainted" in {c.name for c in result.checks if c.passed}


async def test_xid79_with_a_daemonset_mode_nodeset_gets_a_new_node_from_the_node_lifecycle(drill):
    """DaemonSet mode: the fenced Node gets no slurmd pod again; the node lifecycle brings a new
    Node, whose pod is a new Slurm node (the cluster's spare); the failed one stays down."""
    result = await drill.run(DrillOptions(xid=79, k8s=True, k8s_scaling_mode="DaemonSet"))
    r = result.report
    assert r.outcome == "recovered", r.model_dump_json(indent=1)
    assert result.passed, [c for c in result.checks if not c.passed]
    [job] = r.jobs
    assert job.restart_count == 1 and job.verified and r.node not in job.nodes_after
    [eviction] = [a for a in r.actions if a.action == "evict_slurmd_pod"]
    assert eviction.target.startswith("pod slurm/gpu-") and eviction.target != f"pod slurm/{r.node}"
    [handed] = [a for a in r.actions if a.action == "hand_node_to_lifecycle"]
    assert handed.target == f"k8s-{r.node}" and handed.detail.startswith("labelled recovery.gpu/replace=true")
    assert r.spare_node == "gpu-5"
    wait = next(p for p in r.phases if p.name == "wait_for_spare")
    assert wait.result.startswith("gpu-5 on Node k8s-gpu-new-0: "), wait.result
    failed = await drill.slurm.get_node(r.node)
    assert (failed.state, failed.reason) == ("down", SLURMD_PRE_STOP_REASON), failed


async def test_k8s_dry_run_describes_the_kubernetes_steps_and_writes_nothing(drill):
    result = await drill.run(DrillOptions(xid=79, k8s=True, dry_run=True))
    r = result.report
    assert result.passed, [c for c in result.checks if not c.passed]
    assert {"Slurm saw no write", "Kubernetes saw no write"} <= {c.name for c in result.checks}
    assert r.dry_run and r.outcome.startswith("dry_run")
    intended = {a.action: a.command for a in r.intended_actions}
    assert intended["fence_k8s_node"].startswith(f"PUT /api/v1/nodes/k8s-{r.node} ")
    assert intended["set_k8s_node_condition"].startswith(f"PUT /api/v1/nodes/k8s-{r.node}/status ")
    assert intended["evict_slurmd_pod"].startswith(f"POST /api/v1/namespaces/slurm/pods/{r.node}/eviction ")
