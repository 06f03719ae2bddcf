"""Deliberately changed copies of NodeRecoveryWorkflow, to show that the replay test fails on an
unpatched change and passes on the same change behind a patch. A module of their own: the
workflow sandbox re-imports a workflow's module, and passes the project's modules through."""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from contracts.models import IncidentReport, RecoveryRequest
    from workflows.node_recovery import NodeRecoveryWorkflow


@workflow.defn(name="NodeRecoveryWorkflow")
class NodeRecoveryWithAnExtraStep(NodeRecoveryWorkflow):
    """A careless change: one more activity before the incident's first step, not behind a patch."""

    @workflow.run
    async def run(self, req: RecoveryRequest) -> IncidentReport:
        await workflow.execute_activity(
            "record_incident_opened", req.node, start_to_close_timeout=timedelta(seconds=10)
        )
        return await super().run(req)


@workflow.defn(name="NodeRecoveryWorkflow")
class NodeRecoveryWithAPatchedStep(NodeRecoveryWorkflow):
    """The same change behind workflow.patched, as docs/upgrades.md says to make it."""

    @workflow.run
    async def run(self, req: RecoveryRequest) -> IncidentReport:
        if workflow.patched("record-incident-opened"):
            await workflow.execute_activity(
                "record_incident_opened", req.node, start_to_close_timeout=timedelta(seconds=10)
            )
        return await super().run(req)


@workflow.defn(name="NodeRecoveryWorkflow")
class NodeRecoveryReadingTheClock(NodeRecoveryWorkflow):
    """A forbidden call in workflow code: the machine's clock instead of workflow.now()."""

    @workflow.run
    async def run(self, req: RecoveryRequest) -> IncidentReport:
        workflow.logger.info("opened at %s", datetime.now())
        return await super().run(req)
