"""`recovery drill --k8s` end to end: the real local Slurm cluster, the in-repo Kubernetes API server
holding a simulated Slinky cluster that mirrors it (kubesim/slinky.py), a real Temporal dev server
and the reference training job with real checkpoints."""

from __future__ import annotations

import pytest

from contracts.kubernetes import SLURMD_PRE_STOP_REASON
from drills.drill import DrillOptions

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
    assert r.node in job.nodes_before and r.node not in job.nodes_after
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
    # The replacement: the cluster's hot spare, whose slurmd pod came up on a new Node.
    assert r.spare_node == "gpu-5" and 0 < r.replacement_seconds < r.time_to_resume_seconds
    wait = next(p for p in r.phases if p.name == "wait_for_spare")
    assert wait.result.startswith("gpu-5 on Node k8s-gpu-new-0: ")
    assert wait.result.endswith("; health check passed: gpu-5: slurmd answers, 8 GPUs present, no fault"), wait.result
    assert (await drill.slurm.get_node("gpu-5")).in_service
    # The evicted pod's preStop hook (Slinky's) set the failed node DOWN with the operator's reason
    # (what the return to service then makes of it: test_return_to_service.py).
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
