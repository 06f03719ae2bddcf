"""Safe upgrades: every recorded history of a real incident (tests/replay/histories, recorded from
drills and game days on the local stack: docs/upgrades.md) replays against the current workflow
code. A change that would make a running incident's next workflow task diverge from its history
(a step added, removed or reordered, a timer changed into an activity, ...) fails here, before a
worker with that change meets the incidents in flight.

The histories are replayed by Temporal's own Replayer with the project's pydantic data converter
and every workflow class the worker registers (found in the workflows package), in Temporal's full
sandbox: the worker passes the project's modules through it (worker.WORKFLOW_RUNNER), so this is
where a forbidden call in workflow code (datetime.now(), random, I/O) is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from temporalio.workflow import NondeterminismError

from tests.replay.replaying import REPLAY_BUILD_ID, replayer, workflow_classes
from tests.replay.variants import NodeRecoveryReadingTheClock, NodeRecoveryWithAnExtraStep, NodeRecoveryWithAPatchedStep
from workflows.node_recovery import NodeRecoveryWorkflow

HISTORIES = Path(__file__).parent / "histories"
FIXTURES = sorted(HISTORIES.glob("*.json"))


def load(path: Path) -> WorkflowHistory:
    # The workflow id is only a label for the Replayer's messages.
    return WorkflowHistory.from_json(path.stem, json.loads(path.read_text()))


def workflow_type(history: WorkflowHistory) -> str:
    return history.events[0].workflow_execution_started_event_attributes.workflow_type.name


def test_the_replayer_knows_every_workflow_the_worker_runs():
    """Each workflow class the worker module imports (to register it) is among those replayed."""
    import worker

    registered = {v for v in vars(worker).values() if isinstance(v, type) and workflow._Definition.from_class(v)}
    assert {c.__name__ for c in registered} >= {"NodeRecoveryWorkflow", "ReturnToServiceWorkflow"}
    assert registered <= set(workflow_classes())


def test_fixtures_cover_the_recorded_incidents():
    """The fixtures docs/upgrades.md lists are all there, each a real, complete incident."""
    names = {p.name for p in FIXTURES}
    for expected in (
        "xid79-fatal.NodeRecoveryWorkflow.json",
        "xid79-fatal.ReturnToServiceWorkflow.json",
        "xid94-degrading.NodeRecoveryWorkflow.json",
        "xid13-application.NodeRecoveryWorkflow.json",
        "no-spare.NodeRecoveryWorkflow.json",
        "drill-xid79-dry-run.NodeRecoveryWorkflow.json",
        "drill-xid79-k8s.NodeRecoveryWorkflow.json",
        "drill-xid79-k8s-readmit-moved-node.NodeRecoveryWorkflow.json",
        "drill-xid79-k8s-readmit-moved-node.JobRecoveryWorkflow.json",
        "xid79-fatal-one-platform-seam.NodeRecoveryWorkflow.json",
        "drill-xid79-k8s-one-platform-seam.NodeRecoveryWorkflow.json",
    ):
        assert expected in names, f"missing fixture {expected}: re-record (docs/upgrades.md)"
    for path in FIXTURES:
        if path.name.endswith(".NodeRecoveryWorkflow.json"):
            history = load(path)
            assert history.events[-1].HasField("workflow_execution_completed_event_attributes"), path.name


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
async def test_recorded_history_replays_on_the_current_code(path):
    history = load(path)
    # Raises (NondeterminismError or the workflow's own failure) when the code diverges.
    await replayer().replay_workflow(history)


# --- the check can fail --------------------------------------------------------------------------


def replaying(workflow_class: type) -> Replayer:
    """A Replayer of one class, on the fixtures' task queue (spare claims are named after it)."""
    return Replayer(workflows=[workflow_class], data_converter=pydantic_data_converter, build_id=REPLAY_BUILD_ID)


async def test_an_unpatched_change_fails_the_replay():
    path = HISTORIES / "xid79-fatal.NodeRecoveryWorkflow.json"
    replayer = replaying(NodeRecoveryWithAnExtraStep)
    with pytest.raises(NondeterminismError):
        await replayer.replay_workflow(load(path))
    # The same history replays on the real class: the failure is the change's, not the fixture's.
    await replaying(NodeRecoveryWorkflow).replay_workflow(load(path))


async def test_a_forbidden_call_in_workflow_code_fails_the_replay():
    path = HISTORIES / "xid79-fatal.NodeRecoveryWorkflow.json"
    replayer = replaying(NodeRecoveryReadingTheClock)
    # The replayer reports the workflow task's failure, the sandbox's RestrictedWorkflowAccessError.
    with pytest.raises(RuntimeError, match="Cannot access datetime.datetime.now.*RestrictedWorkflowAccessError"):
        await replayer.replay_workflow(load(path))


async def test_the_same_change_behind_a_patch_replays():
    path = HISTORIES / "xid79-fatal.NodeRecoveryWorkflow.json"
    replayer = replaying(NodeRecoveryWithAPatchedStep)
    await replayer.replay_workflow(load(path))
