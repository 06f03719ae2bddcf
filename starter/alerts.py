"""Hand a node failure alert to Temporal: exactly one incident per node.

Signal-with-start: the first alert for a node starts its NodeRecoveryWorkflow; later alerts for
the same node join the running incident as signals instead of starting another.
"""

from __future__ import annotations

from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

from contracts.models import IncidentReport, NodeFailureAlert, RecoveryPolicy, RecoveryRequest
from workflows.node_recovery import NodeRecoveryWorkflow, incident_workflow_id


async def raise_alert(
    client: Client, alert: NodeFailureAlert, task_queue: str, policy: RecoveryPolicy
) -> WorkflowHandle[NodeRecoveryWorkflow, IncidentReport]:
    return await raise_alerts(client, [alert], task_queue, policy)


async def raise_alerts(
    client: Client,
    alerts: list[NodeFailureAlert],
    task_queue: str,
    policy: RecoveryPolicy,
    *,
    id_reuse_policy: WorkflowIDReusePolicy = WorkflowIDReusePolicy.ALLOW_DUPLICATE,
) -> WorkflowHandle[NodeRecoveryWorkflow, IncidentReport]:
    """Alerts for one node, in one durable hand-over: when this returns, Temporal has them.

    With ``id_reuse_policy=REJECT_DUPLICATE`` the alerts join a running incident or open the
    node's first one, and WorkflowAlreadyStartedError says that an earlier incident has ended
    (the alert hooks then decide whether the alerts are newer than that end).
    """
    nodes = {a.node for a in alerts}
    if len(nodes) != 1:
        raise ValueError(f"alerts for one node at a time, got {sorted(nodes)}")
    node = nodes.pop()
    return await client.start_workflow(
        NodeRecoveryWorkflow.run,
        RecoveryRequest(node=node, policy=policy),
        id=incident_workflow_id(node),
        task_queue=task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        id_reuse_policy=id_reuse_policy,
        start_signal="alerts",
        start_signal_args=[alerts],
        static_summary=f"Recover {node} after XID {alerts[0].xid} ({alerts[0].source})",
        static_details=f"Opened by {alerts[0].actor}: {alerts[0].reason}",
    )
