"""FleetBudgetWorkflow and its protocol, driven by stand-in incident workflows (defined here) that
follow the protocol of workflows/budget_lease.py: ask for a lease, wait for it, hold it a while,
return it.

Where timers matter (hold times, lease expiry, holder checks, the disrupted-jobs window, the lemon
window) the tests run on Temporal's time-skipping test server, and start every incident before
awaiting any result: awaiting a result lets the server skip time, and with no timer left anywhere
it skips ten years, to its default run timeout, which would end the budget (ClockAnchor keeps a
timer within the hour for the same reason). The storm, continue-as-new, the operator's updates, the
gauge and a notification that outlives its sender run on the real dev server: around those the
time-skipping server lost updates, skipped no more time, or skipped past what the test looks at.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import sys
import tempfile
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import pytest_asyncio
import uvicorn
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from temporalio import activity, workflow
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import (
    Client,
    Interceptor,
    OutboundInterceptor,
    StartWorkflowInput,
    WorkflowExecutionStatus,
    WorkflowHandle,
)
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from activities.audit import write_audit, write_audit_lines
from activities.budget import (
    BUDGET_PRIORITY,
    LEASE_UPDATE_WITHIN,
    BudgetActivities,
    ensure_fleet_budget,
    fleet_budget_status,
    give_budget_priority,
    release_quarantine,
)
from activities.notify import NotifyActivities
from activities.operators import OperatorActivities, OperatorKeys
from activities.telemetry import TelemetryActivities
from contracts.audit import configure_sink, remove_sink
from contracts.budget import (
    BudgetPolicy,
    BudgetState,
    BudgetStatus,
    FleetBudgetInput,
    LeaseRelease,
    LeaseRequest,
    LeaseState,
    LeaseStatus,
    Notification,
    NotificationKind,
    PartitionShare,
    QuarantineStatus,
    TimelineEvent,
    TimelineKind,
    WebhookTarget,
)
from drills.faults import local_activity_marker
from drills.localstack import LocalStack, wait_async
from observability.metrics import RecoveryMetrics
from tests.integration.test_telemetry import points
from workflows.budget_lease import LEASE_STATE_SIGNAL, BudgetLease, check_quarantine
from workflows.budget_ledger import FINISHED_KEPT, BudgetLedger
from workflows.fleet_budget import FleetBudgetWorkflow
from workflows.notify import NotificationWorkflow, notification_workflow_id, notify

# --- stand-in incidents -----------------------------------------------------------------------


class StandInPlan(BaseModel):
    incident_id: str
    node: str
    partitions: list[PartitionShare] = Field(default_factory=list)
    running_jobs: int = 0
    delay_seconds: float = Field(0.0, description="before asking: for incidents that arrive later")
    hold_seconds: float = Field(60.0, description="the lease, or until the `finish` signal")
    check_quarantine: bool = False

    @property
    def job_ids(self) -> list[int]:
        """Jobs of its own: no other stand-in's remediation disrupts them."""
        return [zlib.crc32(f"{self.incident_id}/{job}".encode()) for job in range(self.running_jobs)]


class StandInResult(BaseModel):
    answer: LeaseState = Field(description="the budget's answer to the request")
    held: LeaseState = Field(description="the lease once it stopped waiting")
    end: LeaseState | None = Field(description="the lease when the hold ended: granted, or expired meanwhile")
    heard: list[LeaseState] = Field(description="states signalled by the budget: answers and changes")
    quarantine: QuarantineStatus | None = None


@workflow.defn(sandboxed=False)
class StandInIncident:
    """An incident reduced to the budget protocol: request, wait, hold, release (in `finally`)."""

    def __init__(self) -> None:
        self._lease = BudgetLease()
        self._heard: list[LeaseState] = []
        self._finish = False

    @workflow.signal(name=LEASE_STATE_SIGNAL)
    def fleet_budget_lease_state(self, state: LeaseState) -> None:
        self._heard.append(state)
        self._lease.on_state(state)

    @workflow.signal
    def finish(self) -> None:
        self._finish = True

    @workflow.run
    async def run(self, plan: StandInPlan) -> StandInResult:
        if plan.delay_seconds:
            await workflow.sleep(plan.delay_seconds)
        try:
            answer = await self._lease.request(plan.incident_id, plan.node, plan.partitions, plan.job_ids)
            held = await self._lease.wait_granted()
            with suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._finish, timeout=plan.hold_seconds)
            quarantine = await check_quarantine(plan.node) if plan.check_quarantine else None
            return StandInResult(
                answer=answer, held=held, end=self._lease.state, heard=self._heard, quarantine=quarantine
            )
        finally:
            await self._lease.release("stand-in incident ended")


@workflow.defn(sandboxed=False)
class ClockAnchor:
    """Keeps a timer at most an hour ahead while a test runs: with every other workflow idle, the
    time-skipping server then skips an hour, not ten years to its default run timeout (which
    would end the budget, and leaves the server refusing to skip time after)."""

    def __init__(self) -> None:
        self._stop = False

    @workflow.signal
    def stop(self) -> None:
        self._stop = True

    @workflow.run
    async def run(self) -> None:
        while not self._stop:
            with suppress(TimeoutError):
                await workflow.wait_condition(lambda: self._stop, timeout=timedelta(hours=1))


@workflow.defn(sandboxed=False)
class NotifyingCaller:
    """Sends a notification and ends: the delivery must not hold it up."""

    @workflow.run
    async def run(self, notification: Notification) -> str:
        await notify(notification)
        return "done"


# --- the fleet under test ---------------------------------------------------------------------


@dataclass
class Fleet:
    client: Client
    task_queue: str
    budget_id: str
    metrics: InMemoryMetricReader
    activities: list[Callable]
    operators: LocalStack  # the operators' keys and the worker's list of them (nothing else of a stack)

    def worker(self, **options) -> Worker:
        """The worker with the budget's workflows and activities, and the stand-ins'."""
        return Worker(
            self.client,
            task_queue=self.task_queue,
            activities=self.activities,
            max_concurrent_activities=50,
            workflows=[FleetBudgetWorkflow, NotificationWorkflow, StandInIncident, NotifyingCaller, ClockAnchor],
            **options,
        )

    def plan(self, n: int, node: str | None = None, **fields) -> StandInPlan:
        node = node or f"gpu-{n}"
        return StandInPlan(incident_id=f"{node}-{self.budget_id}-{n}", node=node, **fields)

    async def start(self, plan: StandInPlan) -> WorkflowHandle:
        return await self.client.start_workflow(
            StandInIncident.run,
            plan,
            id=f"incident-{plan.incident_id}",
            task_queue=self.task_queue,
            result_type=StandInResult,
        )

    async def incident(self, plan: StandInPlan) -> StandInResult:
        """One incident, start to end (on the dev server: see the module's docstring)."""
        return await (await self.start(plan)).result()

    @property
    def budget(self) -> WorkflowHandle:
        return self.client.get_workflow_handle_for(FleetBudgetWorkflow.run, self.budget_id)

    async def end_budget(self) -> None:
        """The budget runs forever: end it with the test, so that nothing of it outlives its
        worker. Cancelled, not terminated: after a budget was terminated, the time-skipping server
        skipped no more time (a cancelled budget ends in a workflow task of its own)."""
        try:
            await self.budget.cancel()
        except RPCError:  # never started: the test asked for no lease
            return
        for _ in range(500):
            if (await self.budget.describe()).status != WorkflowExecutionStatus.RUNNING:
                return
            await asyncio.sleep(0.02)
        raise AssertionError("the budget did not end when cancelled")

    async def timeline(self) -> list[TimelineEvent]:
        return await self.budget.query(FleetBudgetWorkflow.timeline)

    async def wait_for(self, kind: TimelineKind, count: int = 1) -> list[TimelineEvent]:
        return [e for e in await self.wait_for_events(count, kind) if e.kind == kind]

    async def wait_for_events(self, count: int, kind: TimelineKind | None = None) -> list[TimelineEvent]:
        """The timeline, once it has `count` events (of `kind`, if given)."""
        for _ in range(500):
            with suppress(RPCError):  # the budget starts with the first request
                timeline = await self.timeline()
                if sum(kind is None or e.kind == kind for e in timeline) >= count:
                    return timeline
            await asyncio.sleep(0.02)
        raise AssertionError(f"no {count} {kind or ''} event(s) in the budget's timeline")


def new_fleet(
    env,
    policy: BudgetPolicy,
    webhook: WebhookTarget | None = None,
    request_lease: Callable[[BudgetActivities], Callable] | None = None,
) -> Fleet:
    """A task queue of its own, and a budget of its own (the id is the test's, not the
    namespace-wide `fleet-budget`). `request_lease` replaces that activity with one built around
    the real one."""
    task_queue = f"budget-{uuid.uuid4()}"
    budget_id = f"fleet-budget-{uuid.uuid4().hex[:8]}"
    budget = BudgetActivities(env.client, policy, task_queue, workflow_id=budget_id)
    notifier = NotifyActivities(webhook)
    reader = InMemoryMetricReader()
    metrics = RecoveryMetrics(MeterProvider(metric_readers=[reader]).get_meter("test"))
    activities = [
        request_lease(budget) if request_lease else budget.request_lease,
        budget.check_quarantine,
        budget.find_closed_holders,
        notifier.deliver_notification,
        write_audit,
        write_audit_lines,
        TelemetryActivities(metrics).record_budget_in_use,
    ]
    operators = LocalStack(state_dir=Path(tempfile.mkdtemp(prefix="budget-operators-")))
    operators.ensure_operator_key("bob")
    activities.append(OperatorActivities(OperatorKeys(operators.operator_keys_file)).verify_decision)
    return Fleet(env.client, task_queue, budget_id, reader, activities, operators)


@asynccontextmanager
async def fleet(
    env,
    policy: BudgetPolicy,
    webhook: WebhookTarget | None = None,
    request_lease: Callable[[BudgetActivities], Callable] | None = None,
):
    """new_fleet() with its worker polling, and a ClockAnchor."""
    under_test = new_fleet(env, policy, webhook, request_lease)
    async with under_test.worker():
        anchor = await env.client.start_workflow(
            ClockAnchor.run, id=f"clock-{under_test.budget_id}", task_queue=under_test.task_queue
        )
        try:
            yield under_test
        finally:  # after a failed test too: the budget and the anchor end with their worker
            try:
                await under_test.end_budget()
            finally:
                await anchor.signal(ClockAnchor.stop)
                await anchor.result()


@pytest_asyncio.fixture
async def audit_file(tmp_path: Path):
    path = tmp_path / "audit.jsonl"
    sink = configure_sink(path)
    yield path
    remove_sink(sink)


async def results_of(handles: list[WorkflowHandle]) -> list:
    """One after the other: the time-skipping server lets one client call at a time skip time."""
    return [await handle.result() for handle in handles]


async def failed_workflow_tasks(budget: WorkflowHandle) -> list:
    return [
        event
        async for event in budget.fetch_history_events()
        if event.HasField("workflow_task_failed_event_attributes")
    ]


def audit_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def concurrent_holders(timeline: list[TimelineEvent]) -> list[int]:
    """Leases held after each event, counted from grants and returns alone."""
    held, counts = 0, []
    for event in timeline:
        if event.kind == TimelineKind.GRANTED:
            held += 1
        elif event.kind in (TimelineKind.RELEASED, TimelineKind.EXPIRED, TimelineKind.RECLAIMED):
            held -= 1
        counts.append(held)
    return counts


# --- the storm --------------------------------------------------------------------------------


async def test_storm_of_100_failures_never_more_than_5_in_remediation(temporal_env, audit_file):
    # A short history limit: the budget continues as new several times during the storm.
    policy = BudgetPolicy(max_nodes=5, max_disrupted_jobs=1000, history_limit=600)
    async with fleet(temporal_env, policy) as f:
        plans = [f.plan(n, running_jobs=n % 3, hold_seconds=0.05 + (n % 7) * 0.05) for n in range(100)]
        handles = await asyncio.gather(*(f.start(p) for p in plans))
        results = await results_of(handles)
        timeline = await f.timeline()
        status = await fleet_budget_status(f.client, f.budget_id)

    assert len(results) == 100 and all(r.held.granted for r in results)
    counts = concurrent_holders(timeline)
    assert max(counts) == 5 and counts[-1] == 0
    assert all(e.holders <= 5 for e in timeline)
    per_kind = Counter(e.kind for e in timeline)
    assert per_kind[TimelineKind.GRANTED] == per_kind[TimelineKind.RELEASED] == 100
    assert per_kind[TimelineKind.QUEUED] >= 90  # a storm: nearly all had to wait
    assert not per_kind[TimelineKind.EXPIRED] and not per_kind[TimelineKind.RECLAIMED]
    assert sorted(e.incident_id for e in timeline if e.kind == TimelineKind.GRANTED) == sorted(
        p.incident_id for p in plans
    )
    # Every request was answered, in the update's reply or by one signal, and each incident that
    # had to wait heard of its grant later, once.
    for r in results:
        answer_heard = [s for s in r.heard if s.version == r.answer.version]
        assert len(answer_heard) <= 1, r.heard
        assert [s.version for s in r.heard] == sorted({s.version for s in r.heard}), r.heard
        assert len(r.heard) == len(answer_heard) + r.answer.waiting, r.heard
        assert r.heard[-1].granted if r.answer.waiting else r.answer.granted, r.heard
    assert status.holders == [] and status.waiting == [] and status.continued_as_new >= 1
    assert [e.seq for e in timeline] == list(range(1, len(timeline) + 1))  # nothing lost across runs
    granted_lines = {line["event_id"]: line for line in audit_lines(audit_file) if line["action"] == "lease_granted"}
    assert len(granted_lines) == 100
    assert {line["actor_kind"] for line in granted_lines.values()} == {"policy"}


# --- how a request travels: update, or signal ---------------------------------------------------


async def test_a_lease_granted_at_once_is_the_requests_reply_and_no_signal_is_sent(temporal_env):
    """The answer is the update's reply: the incident acts on it within the workflow task that
    asked, instead of waiting for a signal and a workflow task to hear it."""
    policy = BudgetPolicy(max_nodes=1)
    async with fleet(temporal_env, policy) as f:
        await ensure_fleet_budget(f.client, policy, f.task_queue, f.budget_id)  # as the worker does at start-up
        result = await f.incident(f.plan(1, hold_seconds=0.05))
        requests = await requests_received(f.budget)

    assert result.answer.granted and result.heard == []
    assert requests == ["update ask_lease"]


def dev_server_of_its_own(*dynamic_config: str) -> Awaitable[WorkflowEnvironment]:
    return WorkflowEnvironment.start_local(
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        dev_server_log_level="error",
        dev_server_extra_args=[arg for value in dynamic_config for arg in ("--dynamic-config-value", value)],
        data_converter=pydantic_data_converter,
    )


@pytest_asyncio.fixture
async def temporal_env_refusing_updates():
    """A dev server of its own that refuses every update (frontend.enableUpdateWorkflowExecution
    off), as a busy budget refuses those beyond its 10 in flight."""
    async with await dev_server_of_its_own("frontend.enableUpdateWorkflowExecution=false") as env:
        yield env


@pytest_asyncio.fixture
async def temporal_env_one_partition():
    """A dev server of its own whose task queues have one partition (the default is four, and a
    task's priority orders it within its partition): there the order is exact."""
    async with await dev_server_of_its_own(
        "matching.numTaskqueueReadPartitions=1", "matching.numTaskqueueWritePartitions=1"
    ) as env:
        yield env


async def test_a_request_refused_as_an_update_goes_as_a_signal_and_is_answered_by_one(temporal_env_refusing_updates):
    async with fleet(temporal_env_refusing_updates, BudgetPolicy(max_nodes=1)) as f:
        # The first request finds no budget running, and starts it with its signal.
        first = await f.incident(f.plan(1, hold_seconds=0.05))
        second = await f.incident(f.plan(2, hold_seconds=0.05))
        requests = await requests_received(f.budget)

    assert first.answer.granted and first.heard == [first.answer]
    assert second.answer.granted and second.heard == [second.answer]
    assert requests == ["signal request_lease", "signal request_lease"]


@workflow.defn(name="FleetBudgetWorkflow", sandboxed=False)
class BudgetOnOlderCode:
    """The budget as it was before `ask_lease`: it takes requests by signal only."""

    def __init__(self) -> None:
        self._requests: list[str] = []

    @workflow.signal
    def request_lease(self, req: LeaseRequest) -> None:
        self._requests.append(req.incident_id)

    @workflow.query
    def requests(self) -> list[str]:
        return self._requests

    @workflow.run
    async def run(self, inp: FleetBudgetInput) -> None:
        await workflow.wait_condition(lambda: False)


@workflow.defn(name="FleetBudgetWorkflow", sandboxed=False)
class BudgetTooBusyToAnswer(BudgetOnOlderCode):
    """A budget that takes the lease update and does not answer it in time."""

    @workflow.update
    async def ask_lease(self, req: LeaseRequest) -> LeaseState:
        await workflow.wait_condition(lambda: False)
        raise AssertionError("never answers")

    @workflow.run
    async def run(self, inp: FleetBudgetInput) -> None:
        await super().run(inp)


async def test_a_request_to_a_budget_on_older_code_goes_as_a_signal(temporal_env):
    """During a rolling upgrade the budget may still run on a worker without `ask_lease`: the
    update is rejected, and the request is sent again as the signal that budget knows."""
    answer, received, _ = await request_lease_of(temporal_env, BudgetOnOlderCode)
    assert answer is None  # its answer comes by signal
    assert received == ["gpu-1"]


async def test_a_lease_update_not_answered_in_time_goes_as_a_signal(temporal_env):
    """The update holds the incident's first workflow task open: a budget too busy to answer
    within LEASE_UPDATE_WITHIN gets the request as a signal, and answers it that way."""
    answer, received, waited = await request_lease_of(temporal_env, BudgetTooBusyToAnswer)
    assert answer is None
    assert received == ["gpu-1"]
    assert LEASE_UPDATE_WITHIN <= waited < LEASE_UPDATE_WITHIN + 10


async def test_a_request_that_loses_the_race_to_start_the_budget_reaches_it_by_signal(temporal_env):
    """Two incidents' first requests with no budget running both go as signal-with-start; Temporal's
    test server answered the slower one 'already started' (2 in 200 such starts, 10 at a time), and
    its request_lease failed: in CI, a test's budget then did not end when cancelled."""
    f = new_fleet(temporal_env, BudgetPolicy())
    client = Client(**{**temporal_env.client.config(), "interceptors": [LosingTheRaceToStartTheBudget()]})
    budget = BudgetActivities(client, BudgetPolicy(), f.task_queue, workflow_id=f.budget_id)
    req = LeaseRequest(
        incident_id=f"gpu-1-{f.budget_id}",
        node="gpu-1",
        workflow_id="incident-gpu-1",
        run_id=str(uuid.uuid4()),
        partitions=[],
        running_jobs=0,
    )
    async with f.worker():
        try:
            answer = await asyncio.wait_for(ActivityEnvironment().run(budget.request_lease, req), 30)
            granted = await f.wait_for(TimelineKind.GRANTED)
        finally:
            await f.end_budget()
    assert answer is None  # its answer comes by signal
    assert [e.incident_id for e in granted] == [req.incident_id]


async def test_a_budget_cancelled_while_it_tells_an_incident_ends_with_its_decisions_written(temporal_env, audit_file):
    """An operator may cancel the budget (the next request or worker starts a new one). Cancelled
    as it signalled an incident, the budget's workflow tasks failed from then on, in 5 of 6 tries
    ("Invalid transition in state machine": the signal's result and the cancellation came in one
    workflow task), and it never ended. Three tries here, each cancelled as soon as it granted."""
    f = new_fleet(temporal_env, BudgetPolicy())
    async with f.worker():
        for attempt in range(3):
            req = LeaseRequest(
                incident_id=f"gpu-1-{f.budget_id}-{attempt}",
                node="gpu-1",
                workflow_id=f"incident-gone-{uuid.uuid4()}",
                run_id=str(uuid.uuid4()),
                running_jobs=0,
            )
            budget = await f.client.start_workflow(
                FleetBudgetWorkflow.run,
                FleetBudgetInput(policy=BudgetPolicy()),
                id=f.budget_id,
                task_queue=f.task_queue,
                start_signal="request_lease",
                start_signal_args=[req],
            )
            await f.wait_for(TimelineKind.GRANTED)
            await f.end_budget()
            failed_tasks = await failed_workflow_tasks(budget)
            assert (await budget.describe()).status == WorkflowExecutionStatus.CANCELED
            assert not failed_tasks, failed_tasks
            granted = [line for line in audit_lines(audit_file) if line["action"] == "lease_granted"]
            assert [line["incident"] for line in granted][-1] == req.incident_id


async def test_a_request_naming_a_malformed_run_is_dropped_and_the_budget_answers_the_next(temporal_env):
    """Sent by hand (`temporal workflow signal`), a request whose run id is no UUID was granted, and
    telling that run of it failed every workflow task of the budget after: Temporal refuses the
    signal's command (BadSignalWorkflowExecutionAttributes). The contract refuses it now, and the
    budget drops the signal."""
    f = new_fleet(temporal_env, BudgetPolicy())
    good = LeaseRequest(
        incident_id=f"gpu-2-{f.budget_id}",
        node="gpu-2",
        workflow_id=f"incident-gone-{uuid.uuid4()}",
        run_id=str(uuid.uuid4()),
        running_jobs=0,
    )
    malformed = {**good.model_dump(mode="json"), "incident_id": f"gpu-1-{f.budget_id}", "node": "gpu-1", "run_id": "r1"}
    with pytest.raises(ValueError, match="run_id"):
        LeaseRequest.model_validate(malformed)
    async with f.worker():
        budget = await f.client.start_workflow(
            FleetBudgetWorkflow.run,
            FleetBudgetInput(policy=BudgetPolicy()),
            id=f.budget_id,
            task_queue=f.task_queue,
            start_signal="request_lease",
            start_signal_args=[malformed],
        )
        try:
            await budget.signal(FleetBudgetWorkflow.request_lease, good)
            granted = await f.wait_for(TimelineKind.GRANTED)
            failed_tasks = await failed_workflow_tasks(budget)
        finally:
            await f.end_budget()
    assert [e.incident_id for e in granted] == [good.incident_id]
    assert not failed_tasks, failed_tasks


class LosingTheRaceToStartTheBudget(Interceptor):
    """A client whose signal-with-start loses a race to start the budget, as Temporal's test server
    tells it: the other request has started the budget (for real, here), and this one hears
    'already started'."""

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _LosingTheRace(next)


class _LosingTheRace(OutboundInterceptor):
    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle:
        if input.start_signal is None:
            return await super().start_workflow(input)
        await super().start_workflow(dataclasses.replace(input, start_signal=None, start_signal_args=[]))
        raise WorkflowAlreadyStartedError(input.id, "FleetBudgetWorkflow")


async def request_lease_of(env, budget_class) -> tuple[LeaseState | None, list[str], float]:
    """The real activity `request_lease` against a stand-in budget: its answer, the requests the
    budget took by signal (their nodes), and the seconds the activity took."""
    task_queue, budget_id = f"budget-{uuid.uuid4()}", f"fleet-budget-{uuid.uuid4().hex[:8]}"
    budget = BudgetActivities(env.client, BudgetPolicy(), task_queue, workflow_id=budget_id)
    req = LeaseRequest(
        incident_id=f"gpu-1-{budget_id}",
        node="gpu-1",
        workflow_id="incident-gpu-1",
        run_id=str(uuid.uuid4()),
        partitions=[],
        running_jobs=0,
    )
    async with Worker(env.client, task_queue=task_queue, workflows=[budget_class]):
        stand_in = await env.client.start_workflow(
            budget_class.run, FleetBudgetInput(policy=BudgetPolicy()), id=budget_id, task_queue=task_queue
        )
        started = time.monotonic()
        # Bounded, so that a request that is never answered fails the test instead of hanging it.
        answer = await asyncio.wait_for(ActivityEnvironment().run(budget.request_lease, req), LEASE_UPDATE_WITHIN + 30)
        waited = time.monotonic() - started
        received = await wait_async(lambda: _received(stand_in), 10, "the stand-in budget to take the request")
        await stand_in.terminate("test over")
    return answer, [incident.removesuffix(f"-{budget_id}") for incident in received], waited


async def _received(budget: WorkflowHandle) -> list[str] | None:
    return await budget.query(BudgetOnOlderCode.requests) or None


async def requests_received(budget: WorkflowHandle) -> list[str]:
    """The lease requests in the budget's history, as they came: 'update ask_lease' or 'signal request_lease'."""
    received = []
    async for event in budget.fetch_history_events():
        if event.HasField("workflow_execution_update_accepted_event_attributes"):
            received.append(
                f"update {event.workflow_execution_update_accepted_event_attributes.accepted_request.input.name}"
            )
        elif event.HasField("workflow_execution_signaled_event_attributes"):
            received.append(f"signal {event.workflow_execution_signaled_event_attributes.signal_name}")
    return [r for r in received if r.endswith(("ask_lease", "request_lease"))]


# --- the budget's priority on the task queue ---------------------------------------------------


async def test_the_budgets_tasks_go_ahead_of_a_backlog_of_incidents_tasks(temporal_env_one_partition):
    """Every incident waits for the budget's answer before its first signal, so the budget's tasks
    must not queue behind a storm's incidents' tasks (behind 1,000, one waited two minutes)."""
    policy = BudgetPolicy(max_nodes=20)
    f = new_fleet(temporal_env_one_partition, policy)
    incidents = [await f.start(f.plan(n, hold_seconds=0.05)) for n in range(20)]  # nobody polls yet
    ensuring = asyncio.create_task(ensure_fleet_budget(f.client, policy, f.task_queue, f.budget_id))
    try:
        await wait_async(
            lambda: workflow_tasks_queued(f.client, f.task_queue, 21),
            10,
            "the incidents' and the budget's first tasks to be queued",
        )
        async with f.worker(max_concurrent_workflow_tasks=2):
            await asyncio.wait_for(ensuring, 30)
            results = await asyncio.wait_for(results_of(incidents), 60)
            first_tasks = {handle.id: await first_task_started(handle) for handle in [f.budget, *incidents]}
            await f.end_budget()
    finally:
        ensuring.cancel()

    assert all(r.held.granted for r in results)
    # Two pollers take the first two tasks at once: the budget's is one of them (without its key:
    # the last).
    assert sorted(first_tasks, key=first_tasks.__getitem__).index(f.budget_id) < 2


async def workflow_tasks_queued(client: Client, task_queue: str, count: int) -> bool:
    reply = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW,
            report_stats=True,
        )
    )
    return reply.stats.approximate_backlog_count >= count


async def test_a_budget_started_before_priorities_gets_its_priority_when_a_worker_starts(temporal_env):
    policy = BudgetPolicy()
    async with fleet(temporal_env, policy) as f:
        # As a version before BUDGET_PRIORITY started it: with the default key, kept across continue-as-new.
        await f.client.start_workflow(
            FleetBudgetWorkflow.run, FleetBudgetInput(policy=policy), id=f.budget_id, task_queue=f.task_queue
        )
        assert await priority_key_of(f.budget) == 0  # unset: the server's default, 3
        await ensure_fleet_budget(f.client, policy, f.task_queue, f.budget_id)
        assert await priority_key_of(f.budget) == BUDGET_PRIORITY.priority_key


async def test_a_server_that_will_not_change_the_budgets_priority_leaves_it_with_a_warning(time_skipping_env, caplog):
    """The key only speeds the budget up: a server that refuses to set it (here the time-skipping
    test server, which lacks the call) must not stop a worker from starting."""
    f = new_fleet(time_skipping_env, BudgetPolicy())
    await f.client.start_workflow(
        FleetBudgetWorkflow.run, FleetBudgetInput(policy=BudgetPolicy()), id=f.budget_id, task_queue=f.task_queue
    )  # no worker needed: the server ends with the test
    with caplog.at_level(logging.WARNING, logger="activities.budget"):
        await give_budget_priority(f.client, f.budget_id)
    assert f"the fleet budget {f.budget_id} keeps its task-queue priority" in caplog.text
    assert "UNIMPLEMENTED" in caplog.text


async def priority_key_of(handle: WorkflowHandle) -> int:
    return (await handle.describe()).raw_description.workflow_execution_info.priority.priority_key


async def first_task_started(handle: WorkflowHandle) -> datetime:
    async for event in handle.fetch_history_events():
        if event.HasField("workflow_task_started_event_attributes"):
            return event.event_time.ToDatetime()
    raise AssertionError(f"{handle.id} never started a workflow task")


# --- the budget's other limits ----------------------------------------------------------------


async def test_a_partition_fraction_limits_its_nodes(time_skipping_env):
    policy = BudgetPolicy(max_nodes=10, partition_fraction=0.25)
    async with fleet(time_skipping_env, policy) as f:
        gpu = [PartitionShare(name="gpu", size=8)]  # 0.25 of 8: 2 nodes at once
        plans = [f.plan(n, partitions=gpu, hold_seconds=600) for n in range(3)]
        plans.append(f.plan(3, partitions=[PartitionShare(name="cpu", size=8)], hold_seconds=60))
        handles = []
        for arrived, plan in enumerate(plans, start=1):
            handles.append(await f.start(plan))
            await f.wait_for_events(arrived)  # in this order
        results = await results_of(handles)
        timeline = await f.timeline()

    assert [r.answer.status for r in results] == ["granted", "granted", "waiting", "granted"]
    assert results[2].answer.reason == "partition gpu: 2 of its 2 node(s) under remediation (of 8 nodes)"
    assert results[2].held.granted_at - results[0].held.granted_at >= timedelta(seconds=600)
    gpu_incidents = {p.incident_id for p in plans[:3]}
    assert max(concurrent_holders([e for e in timeline if e.incident_id in gpu_incidents])) == 2


async def test_the_budget_gauge_follows_the_nodes_in_use(temporal_env):
    """recovery.budget.in_use: what operators chart; fed by the budget as leases come and go.
    Each incident holds its lease until told to finish: on the time-skipping server, awaiting the
    first incident's end could skip time on past the second's hold, and the gauge never read 1."""
    async with fleet(temporal_env, BudgetPolicy(max_nodes=5)) as f:
        handles = [await f.start(f.plan(n, hold_seconds=3600)) for n in (1, 2)]

        async def gauge_reads(nodes: int) -> bool:
            found = {p.attributes["budget"]: p.value for p in points(f.metrics).get("recovery.budget.in_use", [])}
            return found.get(f.budget_id) == nodes

        await wait_async(lambda: gauge_reads(2), 30, "the gauge to read 2 nodes in use")
        for handle, left in zip(handles, (1, 0)):
            await handle.signal(StandInIncident.finish)
            await handle.result()
            await wait_async(
                lambda: gauge_reads(left),  # noqa: B023 (awaited here)
                30,
                f"the gauge to read {left} once a lease is returned",
            )


async def test_disrupted_jobs_per_window_hold_the_next_incident_until_the_window_passes(time_skipping_env):
    policy = BudgetPolicy(max_nodes=10, max_disrupted_jobs=5, disruption_window_seconds=3600)
    async with fleet(time_skipping_env, policy) as f:
        handles = [
            await f.start(f.plan(1, running_jobs=3, hold_seconds=60)),
            await f.start(f.plan(2, running_jobs=3, hold_seconds=60, delay_seconds=10)),
        ]
        first, second = await results_of(handles)

    assert second.answer.waiting and second.answer.reason.startswith("3 running jobs disrupted in the last 3600 s")
    # Granted by the budget's own timer once the first disruption left the window, an hour later.
    assert second.held.granted_at - first.held.granted_at >= timedelta(hours=1)
    assert second.heard[-1].granted


# --- leases that are not returned -------------------------------------------------------------


async def test_a_crashed_holders_lease_is_reclaimed_and_the_next_incident_proceeds(time_skipping_env):
    policy = BudgetPolicy(max_nodes=1, holder_check_seconds=60, lease_max_seconds=24 * 3600)
    async with fleet(time_skipping_env, policy) as f:
        crashed = await f.start(f.plan(1, hold_seconds=7 * 24 * 3600))
        await f.wait_for(TimelineKind.GRANTED)
        waiting = await f.start(f.plan(2, hold_seconds=60))
        await f.wait_for(TimelineKind.QUEUED)
        await crashed.terminate("node's incident crashed")  # never returns its lease
        result = await waiting.result()
        timeline = await f.timeline()

    assert result.answer.waiting and result.held.granted
    reclaimed = next(e for e in timeline if e.kind == TimelineKind.RECLAIMED)
    assert reclaimed.incident_id == f.plan(1).incident_id
    assert reclaimed.detail == "its incident's workflow closed without returning it"
    assert max(concurrent_holders(timeline)) == 1


async def test_a_lease_held_too_long_expires_and_its_incident_hears_of_it(time_skipping_env):
    policy = BudgetPolicy(max_nodes=1, lease_max_seconds=3600)
    async with fleet(time_skipping_env, policy) as f:
        stuck = await f.start(f.plan(1, hold_seconds=5 * 3600))
        await f.wait_for(TimelineKind.GRANTED)
        next_one = await f.start(f.plan(2, hold_seconds=60))
        stuck_result, next_result = await stuck.result(), await next_one.result()

    assert stuck_result.end.status == LeaseStatus.EXPIRED
    assert stuck_result.end.reason == "held longer than 3600 s"
    assert (
        timedelta(hours=1) <= next_result.held.granted_at - stuck_result.held.granted_at < timedelta(hours=1, minutes=1)
    )


async def test_a_request_repeated_after_a_crash_gets_the_same_lease(time_skipping_env):
    sent: list[LeaseRequest] = []

    def crashing_after_sending(budget: BudgetActivities):
        @activity.defn(name="request_lease")
        async def request_lease(req: LeaseRequest) -> LeaseState | None:
            # The budget has the request; the worker then "dies" before reporting it done.
            answer = await budget.request_lease(req)
            sent.append(req)
            if activity.info().attempt == 1:
                raise RuntimeError("worker lost after the request was sent")
            return answer

        return request_lease

    policy = BudgetPolicy(max_nodes=1)
    async with fleet(time_skipping_env, policy, request_lease=crashing_after_sending) as f:
        first, second = await results_of([await f.start(f.plan(n, hold_seconds=60)) for n in (1, 2)])
        timeline = await f.timeline()

    assert Counter(req.incident_id for req in sent) == {first.answer.incident_id: 2, second.answer.incident_id: 2}
    granted = Counter(e.incident_id for e in timeline if e.kind == TimelineKind.GRANTED)
    assert granted == {first.answer.incident_id: 1, second.answer.incident_id: 1}
    assert max(concurrent_holders(timeline)) == 1
    # However often it was told (in replies, or by signals: answers to requests in the same
    # workflow task are sent once), one lease.
    told = [first.answer, *first.heard]
    assert {(s.version, s.granted_at) for s in told if s.granted} == {(first.held.version, first.held.granted_at)}


async def test_a_request_left_unanswered_is_asked_again_after_twice_the_wait_each_time(time_skipping_env):
    """A budget slow to answer is a busy one: the incident asks again after 1, 2, then 4 minutes,
    not every minute (1,000 incidents at once asked twice, and each ask is more work for it)."""
    asked: list[datetime] = []

    def lost_three_times(budget: BudgetActivities):
        @activity.defn(name="request_lease")
        async def request_lease(req: LeaseRequest) -> LeaseState | None:
            asked.append(activity.info().scheduled_time)
            return await budget.request_lease(req) if len(asked) > 3 else None

        return request_lease

    async with fleet(time_skipping_env, BudgetPolicy(max_nodes=1), request_lease=lost_three_times) as f:
        result = await f.incident(f.plan(1, hold_seconds=1))

    assert result.answer.granted
    assert [round((later - earlier).total_seconds() / 60, 1) for earlier, later in zip(asked, asked[1:])] == [1, 2, 4]


# --- lemons -----------------------------------------------------------------------------------


async def test_three_incidents_in_the_window_quarantine_a_node_until_an_operator_releases_it(temporal_env, audit_file):
    # On the dev server: the time-skipping server sometimes loses an operator's update ("update not found").
    policy = BudgetPolicy(lemon_incidents=3, lemon_window_seconds=7 * 24 * 3600)
    async with fleet(temporal_env, policy) as f:
        bob = f.operators.operator_signer("bob")
        with pytest.raises(ValueError, match=r"node gpu-7 is not quarantined \(no fleet budget is running\)"):
            await release_quarantine(f.client, "gpu-7", bob, "nothing yet", workflow_id=f.budget_id)
        results = [await f.incident(f.plan(n, node="gpu-7", hold_seconds=0.1, check_quarantine=True)) for n in range(3)]
        with pytest.raises(ValueError, match="^node gpu-8 is not quarantined$"):
            await release_quarantine(f.client, "gpu-8", bob, "typo", workflow_id=f.budget_id)
        released = await release_quarantine(f.client, "gpu-7", bob, "GPU board replaced", workflow_id=f.budget_id)
        after = await f.incident(f.plan(3, node="gpu-7", hold_seconds=0.1, check_quarantine=True))
        timeline = await f.timeline()

    assert [r.answer.quarantined for r in results] == [False, False, True]
    assert results[2].quarantine.quarantined and len(results[2].quarantine.incidents_in_window) == 3
    assert not released.quarantined
    assert (released.last_release.released_by, released.last_release.release_reason) == ("bob", "GPU board replaced")
    assert not after.answer.quarantined and not after.quarantine.quarantined  # counting starts again
    assert [(e.kind, e.actor, e.actor_kind) for e in timeline if "quarantine" in e.kind] == [
        (TimelineKind.QUARANTINED, "policy", "policy"),
        (TimelineKind.QUARANTINE_RELEASED, "bob", "operator"),
    ]
    lines = {line["action"]: line for line in audit_lines(audit_file)}
    assert lines["node_quarantined"]["node"] == "gpu-7"
    assert (
        lines["quarantine_released"]["actor"],
        lines["quarantine_released"]["actor_kind"],
        lines["quarantine_released"]["reason"],
    ) == ("bob", "operator", "GPU board replaced")


async def test_incidents_further_apart_than_the_window_do_not_make_a_lemon(time_skipping_env):
    policy = BudgetPolicy(lemon_incidents=3, lemon_window_seconds=7 * 24 * 3600, holder_check_seconds=24 * 3600)
    async with fleet(time_skipping_env, policy) as f:
        # Four days apart: never three in a week.
        results = await results_of(
            [
                await f.start(
                    f.plan(n, node="gpu-7", delay_seconds=n * 4 * 24 * 3600, hold_seconds=3600, check_quarantine=True)
                )
                for n in range(3)
            ]
        )

    assert not any(r.answer.quarantined or r.quarantine.quarantined for r in results)
    assert len(results[2].quarantine.incidents_in_window) == 2


# --- continue-as-new --------------------------------------------------------------------------


async def test_continue_as_new_keeps_holders_waiters_lemons_and_the_timeline(temporal_env):
    policy = BudgetPolicy(max_nodes=1, lemon_incidents=2, history_limit=50)
    async with fleet(temporal_env, policy) as f:
        holder = await f.start(f.plan(0, hold_seconds=3600))
        await f.wait_for(TimelineKind.GRANTED)
        first_run = (await f.budget.describe()).run_id
        waiter = await f.start(f.plan(1, hold_seconds=0.1))
        # Two incidents of gpu-9 (a lemon), each waiting for the holder.
        lemons = [await f.start(f.plan(n, node="gpu-9", hold_seconds=0.1)) for n in (2, 3)]
        await f.wait_for(TimelineKind.QUEUED, 3)
        for _ in range(100):
            status = await fleet_budget_status(f.client, f.budget_id)
            if status.continued_as_new:
                break
            # Returns of leases it does not know: each changes nothing but adds to the history.
            await f.budget.signal(FleetBudgetWorkflow.release_lease, LeaseRelease(incident_id="unknown"))
        assert (await f.budget.describe()).run_id != first_run
        assert await priority_key_of(f.budget) == BUDGET_PRIORITY.priority_key
        assert [h.incident_id for h in status.holders] == [f.plan(0).incident_id]
        assert sorted(w.incident_id for w in status.waiting) == sorted(
            [f.plan(1).incident_id] + [f.plan(n, node="gpu-9").incident_id for n in (2, 3)]
        )
        assert [q.node for q in status.quarantined] == ["gpu-9"]
        await holder.signal(StandInIncident.finish)  # the waiters are granted by the new run
        results = await results_of([holder, waiter, *lemons])
        timeline = await f.timeline()
        first_history = await f.client.get_workflow_handle(f.budget_id, run_id=first_run).fetch_history()

    assert all(r.held.granted for r in results)
    # The run that continued as new replays to the same decisions (no non-determinism).
    await Replayer(workflows=[FleetBudgetWorkflow], data_converter=pydantic_data_converter).replay_workflow(
        first_history
    )
    assert [e.seq for e in timeline] == list(range(1, len(timeline) + 1))
    assert max(concurrent_holders(timeline)) == 1


# --- notifications ----------------------------------------------------------------------------


@asynccontextmanager
async def webhook_server():
    """A local webhook that answers 500 until `healthy` is set."""
    received: list[tuple[dict[str, str], bytes]] = []
    healthy = asyncio.Event()

    async def hook(request: Request) -> Response:
        received.append((dict(request.headers), await request.body()))
        return Response(status_code=200 if healthy.is_set() else 500)

    server = uvicorn.Server(
        uvicorn.Config(
            Starlette(routes=[Route("/hook", hook, methods=["POST"])]),
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="off",
        )
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/hook", received, healthy
    finally:
        server.should_exit = True
        await serving


async def test_notifications_are_retried_until_delivered_without_holding_up_the_sender(temporal_env):
    # On the dev server: the sender ends before its notification is delivered, and the time-skipping
    # server, when a child outlives its parent, stops skipping time.
    async with webhook_server() as (url, received, healthy):
        target = WebhookTarget(url=f"{url}?token=query-secret", bearer_token="bearer-secret", hmac_secret="hmac-secret")
        async with fleet(temporal_env, BudgetPolicy(), webhook=target) as f:
            notification = Notification(
                kind=NotificationKind.APPROVAL_NEEDED,
                incident_id=f"gpu-3-{f.budget_id}",
                node="gpu-3",
                at="2026-12-01T00:00:00Z",
                summary="over budget, waiting",
            )
            caller = await f.client.execute_workflow(
                NotifyingCaller.run, notification, id=f"caller-{uuid.uuid4()}", task_queue=f.task_queue
            )
            delivery = f.client.get_workflow_handle_for(
                NotificationWorkflow.run, notification_workflow_id(notification)
            )
            assert caller == "done"
            while len(received) < 2:  # the webhook fails, the sender is long done
                await asyncio.sleep(0.05)
            assert (await delivery.describe()).status == WorkflowExecutionStatus.RUNNING
            healthy.set()
            result = await delivery.result()

    assert result.delivered and result.status_code == 200 and result.attempt == len(received) >= 3
    assert "query-secret" not in result.detail
    for headers, body in received:
        assert headers["idempotency-key"] == f"gpu-3-{f.budget_id}/approval_needed"
        assert headers["authorization"] == "Bearer bearer-secret"
        signed = headers["x-recovery-timestamp"].encode() + b"." + body
        assert (
            headers["x-recovery-signature"] == "sha256=" + hmac.new(b"hmac-secret", signed, hashlib.sha256).hexdigest()
        )
        assert Notification.model_validate_json(body) == notification


async def test_a_quarantine_is_notified_when_notifications_are_on(time_skipping_env):
    async with webhook_server() as (url, received, healthy):
        healthy.set()
        policy = BudgetPolicy(lemon_incidents=2, notifications=True)
        async with fleet(time_skipping_env, policy, webhook=WebhookTarget(url=url)) as f:
            await results_of([await f.start(f.plan(n, node="gpu-4", hold_seconds=60)) for n in range(2)])
            quarantined = await f.wait_for(TimelineKind.QUARANTINED)
            delivery = f.client.get_workflow_handle_for(
                NotificationWorkflow.run, f"notify-{quarantined[0].incident_id}-quarantined"
            )
            result = await delivery.result()

    assert result.delivered
    [(headers, body)] = received
    sent = Notification.model_validate_json(body)
    assert (sent.kind, sent.node) == (NotificationKind.QUARANTINED, "gpu-4")
    assert "recovery release-quarantine gpu-4" in sent.summary


async def test_an_answer_owed_for_a_lease_the_ledger_has_forgotten_is_skipped(temporal_env, audit_file):
    """A repeated request is answered once the loop runs; if by then so many leases ended that the
    ledger forgot this one (it keeps the last FINISHED_KEPT), there is nothing left to tell. At
    N = 1,000 this failed every workflow task of the budget. Here all of it lands in the budget's
    first workflow task: the signals are sent before its worker starts."""
    task_queue, budget_id = f"budget-{uuid.uuid4()}", f"fleet-budget-{uuid.uuid4().hex[:8]}"
    policy = BudgetPolicy(max_nodes=FINISHED_KEPT + 1, max_disrupted_jobs=1000)
    requests = [
        LeaseRequest(
            incident_id=f"gpu-{n}-incident",
            node=f"gpu-{n}",
            workflow_id=f"gone-{n}",
            run_id=str(uuid.uuid4()),
            partitions=[],
            running_jobs=0,
        )
        for n in range(FINISHED_KEPT + 1)
    ]
    book = BudgetLedger(BudgetState(policy=policy), budget_id, "first-run")
    for req in requests:
        book.request(req, datetime.now(timezone.utc))
    assert len(book.holders()) == FINISHED_KEPT + 1
    budget = await temporal_env.client.start_workflow(
        FleetBudgetWorkflow.run, FleetBudgetInput(policy=policy, state=book.state), id=budget_id, task_queue=task_queue
    )
    await budget.signal(FleetBudgetWorkflow.request_lease, requests[0])  # the answer is owed from here
    for req in requests:  # the first ends first, and is the one forgotten
        await budget.signal(FleetBudgetWorkflow.release_lease, LeaseRelease(incident_id=req.incident_id))
    async with budget_alone(temporal_env.client, task_queue, policy, budget_id):
        status = await wait_async(all_returned(budget), 30, "the budget to take every lease back")
        forgotten = await budget.query(FleetBudgetWorkflow.lease, requests[0].incident_id)
        failed = await failed_workflow_tasks(budget)
        await budget.cancel()
    assert status.holders == [] and forgotten is None and not failed, failed


async def test_a_workflow_tasks_decisions_are_written_together_once_its_answers_are_out(temporal_env, audit_file):
    """30 requests in the budget's first workflow task: its commands are the 30 answers and no
    audit line, and each task's lines are written by one local activity. With a local activity per
    line, a task waited for all of them before its answers went out: 5 to 13 s at N = 1,000."""
    task_queue, budget_id = f"budget-{uuid.uuid4()}", f"fleet-budget-{uuid.uuid4().hex[:8]}"
    policy = BudgetPolicy(max_nodes=2, max_disrupted_jobs=1000)
    budget = await temporal_env.client.start_workflow(
        FleetBudgetWorkflow.run, FleetBudgetInput(policy=policy), id=budget_id, task_queue=task_queue
    )
    requests = [
        LeaseRequest(
            incident_id=f"gpu-{n}-incident",
            node=f"gpu-{n}",
            workflow_id=f"gone-{n}",
            run_id=str(uuid.uuid4()),
            partitions=[],
            running_jobs=0,
        )
        for n in range(30)
    ]
    for req in requests:  # before the worker starts: all in the first workflow task
        await budget.signal(FleetBudgetWorkflow.request_lease, req)
    async with budget_alone(temporal_env.client, task_queue, policy, budget_id):
        # The incidents are gone: each answer finds none, and its lease is reclaimed.
        await wait_async(all_returned(budget, waiting_too=True), 30, "the budget to reclaim every lease")
        timeline = await budget.query(FleetBudgetWorkflow.timeline)
        history = [event async for event in budget.fetch_history_events()]
        await budget.cancel()

    tasks = workflow_tasks(history)
    first_answers = next(
        commands
        for commands in tasks
        if any(e.HasField("signal_external_workflow_execution_initiated_event_attributes") for e in commands)
    )
    assert sum(e.HasField("signal_external_workflow_execution_initiated_event_attributes") for e in first_answers) == 30
    assert not [name for name in local_activities(first_answers) if name.startswith("write_audit")]
    per_task = [local_activities(commands).count("write_audit_lines") for commands in tasks]
    assert max(per_task) == 1 and "write_audit" not in local_activities(history), per_task
    ended = {e.incident_id for e in timeline if e.kind in (TimelineKind.RECLAIMED, TimelineKind.WITHDRAWN)}
    assert ended == {req.incident_id for req in requests}
    lines = [line for line in audit_lines(audit_file) if line["event_id"].startswith(budget_id)]
    assert len(lines) == len(timeline) == len({line["event_id"] for line in lines})
    assert [line["parameters"]["seq"] for line in lines] == [e.seq for e in timeline]


@asynccontextmanager
async def budget_alone(client: Client, task_queue: str, policy: BudgetPolicy, budget_id: str):
    """A worker with the budget workflow and the activities it calls itself."""
    budget_activities = BudgetActivities(client, policy, task_queue, workflow_id=budget_id)
    metrics = RecoveryMetrics(MeterProvider(metric_readers=[InMemoryMetricReader()]).get_meter("test"))
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[FleetBudgetWorkflow],
        activities=[
            budget_activities.find_closed_holders,
            write_audit,
            write_audit_lines,
            TelemetryActivities(metrics).record_budget_in_use,
        ],
    ):
        yield


def all_returned(budget: WorkflowHandle, waiting_too: bool = False) -> Callable:
    async def returned() -> BudgetStatus | None:
        status = await budget.query(FleetBudgetWorkflow.status)
        return status if not status.holders and not (waiting_too and status.waiting) else None

    return returned


def workflow_tasks(history: list) -> list[list]:
    """The commands of each completed workflow task: the events after its completion, up to the
    next task's scheduling."""
    tasks, current = [], None
    for event in history:
        if event.HasField("workflow_task_completed_event_attributes"):
            current = []
            tasks.append(current)
        elif event.HasField("workflow_task_scheduled_event_attributes"):
            current = None
        elif current is not None:
            current.append(event)
    return tasks


def local_activities(events: list) -> list[str]:
    """The activity type of each local activity's marker among the events."""
    return [marker["activity_type"] for marker in map(local_activity_marker, events) if marker is not None]
