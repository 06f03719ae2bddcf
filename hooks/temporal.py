"""The intake's Temporal side: the node's NodeRecoveryWorkflow, through raise_alerts.

The first hand-over to a node is a signal-with-start with REJECT_DUPLICATE: it joins the running
incident or opens the node's first one, and the server refuses it, atomically, when the node's last
incident has ended. Later hand-overs to that incident are plain signals to its run (a quarter
cheaper for the server, measured), which fail the same way once that run has ended. Only then does
the intake read the node's last end (describe) and open a new incident with the alerts observed
after it (or join one opened meanwhile by someone else). So an alert replayed after its incident
ended can never start another recovery, and the common case costs one call.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from temporalio.client import Client
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import GrpcCompression, RPCError, RPCStatusCode

from contracts.models import AlertDigest, NodeFailureAlert, RecoveryPolicy
from hooks.intake import IncidentEnded
from starter.alerts import raise_alerts
from workflows.node_recovery import NodeRecoveryWorkflow, incident_workflow_id

# The hook's Temporal client. No gRPC compression (the SDK gzips by default): a hand-over is a few
# alerts, a few hundred bytes to a few KB, so gzip saves no bandwidth worth having and costs CPU at
# both ends, per call ~20% of the hook's client side and ~9% of the server's (the storm's calls,
# measured against the dev server).
CLIENT_OPTIONS = {"grpc_compression": GrpcCompression.NONE}


class TemporalIncidents:
    def __init__(self, client: Client, task_queue: str, policy: RecoveryPolicy) -> None:
        self._client = client
        self._task_queue = task_queue
        self._policy = policy

    async def join_or_open(self, node: str, alerts: list[NodeFailureAlert]) -> str:
        try:
            handle = await raise_alerts(
                self._client,
                alerts,
                self._task_queue,
                self._policy,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            )
        except WorkflowAlreadyStartedError as e:
            raise IncidentEnded(node) from e
        return handle.result_run_id or ""

    async def join(self, node: str, alerts: list[NodeFailureAlert], run_id: str | None) -> None:
        # Addressed to its run when known: the server then need not look up the current run (~7%
        # of its CPU per signal, measured), and an incident opened since by someone else is found
        # by the describe that follows IncidentEnded, as after any end.
        await self._signal(node, run_id, NodeRecoveryWorkflow.alerts, alerts)

    async def join_digest(self, node: str, digest: AlertDigest, run_id: str) -> None:
        await self._signal(node, run_id, NodeRecoveryWorkflow.alert_digest, digest)

    async def _signal(self, node: str, run_id: str | None, signal: Any, arg: object) -> None:
        handle = self._client.get_workflow_handle(incident_workflow_id(node), run_id=run_id)
        try:
            await handle.signal(signal, arg)
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
