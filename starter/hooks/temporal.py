"""The intake's Temporal side: the node's NodeRecoveryWorkflow, through raise_alerts.

The first hand-over to a node is a signal-with-start with REJECT_DUPLICATE: it joins the running
incident or opens the node's first one, and the server refuses it, atomically, when the node's last
incident has ended. Later hand-overs to that incident are plain signals (a quarter cheaper for the
server, measured), which fail the same way once the incident has ended. Only then does the intake
read that incident's end (describe) and open a new incident with the alerts observed after it. So
an alert replayed after its incident ended can never start another recovery, and the common case
costs one call.
"""

from __future__ import annotations

from datetime import datetime

from temporalio.client import Client
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from contracts.models import NodeFailureAlert, RecoveryPolicy
from starter.alerts import raise_alerts
from starter.hooks.intake import IncidentEnded
from workflows.node_recovery import NodeRecoveryWorkflow, incident_workflow_id


class TemporalIncidents:
    def __init__(self, client: Client, task_queue: str, policy: RecoveryPolicy) -> None:
        self._client = client
        self._task_queue = task_queue
        self._policy = policy

    async def join_or_open(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        try:
            handle = await raise_alerts(self._client, alerts, self._task_queue, self._policy,
                                        id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE)
        except WorkflowAlreadyStartedError as e:
            raise IncidentEnded(node) from e
        return handle.result_run_id or ""

    async def join(self, node: str, alerts: list[NodeFailureAlert]) -> None:
        handle = self._client.get_workflow_handle(incident_workflow_id(node))
        try:
            await handle.signal(NodeRecoveryWorkflow.alerts, alerts)
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:  # "workflow execution already completed"
                raise IncidentEnded(node) from e
            raise

    async def ended_at(self, node: str) -> datetime | None:
        try:
            description = await self._client.get_workflow_handle(incident_workflow_id(node)).describe()
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:  # none at all (or past the namespace's retention)
                return None
            raise
        return description.close_time

    async def open_after_end(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        handle = await raise_alerts(self._client, alerts, self._task_queue, self._policy)
        return handle.result_run_id or ""
