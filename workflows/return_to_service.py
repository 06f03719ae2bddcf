"""ReturnToServiceWorkflow: after a recovery, the failed node comes back only once it is repaired.

Started by the incident that fenced the node (and outliving it), it looks at the node every
`poll_seconds` on a durable timer: when the fence is still that incident's, slurmd answers and the
health check hook passes, it resumes the node; a node fenced by someone else meanwhile is left as
found. It gives up at `give_up_at`, leaving the node out of service, and says so. On Kubernetes
it first undoes the incident's fence of the Node, once the health check passes. A node the fleet
budget has quarantined as a lemon is never returned: it waits (and is looked at again) until an
operator runs `recovery release-quarantine NODE`; the budget is asked at each look only about a
node the incident's lease found quarantined (`lemon`). The budget never holds up a return otherwise.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.fencing import FencingActivities
    from activities.kubernetes import KubernetesActivities
    from activities.platform import PlatformActivities
    from contracts.kubernetes import K8sNodeRequest
    from contracts.models import NodeRequest, ReturnToServiceRequest, ReturnToServiceResult
    from workflows.budget_lease import check_quarantine
    from workflows.call_options import K8S_CALL, SLURM_CALL

# Checks per run before continuing as new, to keep the history short over days of waiting.
CHECKS_PER_RUN = 500


def return_to_service_workflow_id(incident_id: str) -> str:
    """One per incident: when a node fails again, the older watcher finds the newer incident's
    fence, leaves the node as found and ends; the newer one takes over."""
    return f"return-to-service-{incident_id}"


@workflow.defn
class ReturnToServiceWorkflow:
    @workflow.run
    async def run(self, req: ReturnToServiceRequest) -> ReturnToServiceResult:
        for _ in range(CHECKS_PER_RUN):
            # Not per look for every node: a thousand watchers querying the one budget at once
            # overflow its query buffer and hold up the incidents still waiting for their lease.
            quarantine = await check_quarantine(req.node) if req.fleet_budget and req.lemon is not False else None
            if quarantine is not None and quarantine.quarantined:
                req.checks += 1
                waiting_for = f"quarantined as a lemon; `recovery release-quarantine {req.node}` lets it return"
            else:
                if req.kubernetes_node is not None and not req.kubernetes_unfenced:
                    await self._unfence_when_healthy(req, req.kubernetes_node)
                check = await workflow.execute_activity_method(
                    FencingActivities.return_to_service,
                    NodeRequest(node=req.node, ctx=req.ctx),
                    summary=f"Is {req.node} repaired? Resume it if healthy and still fenced by incident "
                    f"{req.ctx.incident_id}",
                    **SLURM_CALL,
                )
                req.checks += 1
                if check.action is not None:
                    req.actions.append(check.action)
                if check.final:
                    return ReturnToServiceResult(
                        node=req.node,
                        returned=check.returned,
                        outcome=check.detail,
                        checks=req.checks,
                        actions=req.actions,
                    )
                waiting_for = check.detail
            if workflow.now() >= req.give_up_at:
                return ReturnToServiceResult(
                    node=req.node,
                    returned=False,
                    checks=req.checks,
                    actions=req.actions,
                    outcome=f"not returned by {req.give_up_at:%Y-%m-%d %H:%M} UTC ({waiting_for}): left out of service",
                )
            workflow.set_current_details(f"Waiting for {req.node} to be repaired: {waiting_for}")
            await workflow.sleep(timedelta(seconds=req.poll_seconds))
        workflow.continue_as_new(req)

    async def _unfence_when_healthy(self, req: ReturnToServiceRequest, kubernetes_node: str) -> None:
        """Slurm on Kubernetes: once the health check passes, undo the incident's fence of the
        Node (its prior cordon, taints and condition come back), so slurmd can run there again."""
        health = await workflow.execute_activity_method(
            PlatformActivities.check_node_health,
            req.node,
            summary=f"Run the health check hook on {req.node}",
            **SLURM_CALL,
        )
        if not health.healthy:
            return
        unfenced = await workflow.execute_activity_method(
            KubernetesActivities.unfence_k8s_node,
            K8sNodeRequest(node=kubernetes_node, ctx=req.ctx, slurm_node=req.node),
            summary=f"Undo incident {req.ctx.incident_id}'s fence of Node {kubernetes_node}",
            **K8S_CALL,
        )
        req.actions.extend(unfenced.actions)
        req.kubernetes_unfenced = True
