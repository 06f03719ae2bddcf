"""SpareClaimWorkflow: at most one claim of a given hot spare at a time, across every worker.

Slurm has no compare-and-set for a node's comment, and a worker's lock covers only its own
incidents: two incidents on two workers could both read a spare as on standby, both write their
claim (the last write stays) and both take the spare. So each try of one spare runs as a child
workflow whose id names the spare (`spare_claim_workflow_id`): Temporal runs one workflow per id
at a time, so a second incident that tries the spare meanwhile is refused at once, tries its
next spare, and comes back to this one once the first claim has ended (by then the spare is in
service, no longer on standby, or free again). The claim itself is the `request_replacement`
activity, given this one spare.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.platform import PlatformActivities
    from contracts.models import ReplacementRequest, ReplacementResult
    from workflows.call_options import SLURM_CALL


def spare_claim_workflow_id(task_queue: str, spare: str) -> str:
    """One per spare of the fleet (the workers of one task queue)."""
    return f"spare-claim-{task_queue}-{spare}"


@workflow.defn
class SpareClaimWorkflow:
    @workflow.run
    async def run(self, req: ReplacementRequest) -> ReplacementResult:
        return await workflow.execute_activity_method(
            PlatformActivities.request_replacement,
            req,
            summary=f"Claim and resume hot spare {', '.join(req.spare_nodes)} for {req.failed_node}",
            **SLURM_CALL,
        )
