"""Nodes of one job fail together (issue #29, item 1): each node has its incident, and they share the
job's recovery (workflows/job_recovery.py), so the job is requeued once, kept off every failed
node and verified once, and every incident ends with its node DOWN and a report that names the
others. Before: the second incident took the job's restart count for its own earlier attempt and
retried ExcNodeList on the running job for ten minutes, then failed with its node never DOWN.
Real Slurm, the real reference training job, real dev server; the host's generation and the newest."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.jobs import JobActivities
from backends.checkpoints import CheckpointStore
from backends.slurm import SlurmClient
from contracts.models import ActionContext, IncidentReport, NodeFailureAlert, SignalRequest
from drills.drill import DrillOptions
from drills.faults import activity_starts, job_recovery_started
from drills.localstack import wait_async
from starter.alerts import raise_alert
from tests.integration.conftest import Fleet, cluster_of_its_own, fleet, status_if_answered

pytestmark = [pytest.mark.slurm, pytest.mark.host_and_newest_slurm_generation]

# Between the session cluster's ports (up to 105 above its base) and the storm's (417 above).
THREE_SPARES_PORT_OFFSET = 200


@pytest.fixture(scope="module")
def three_spares(local_stack):
    """A cluster of 3 compute nodes and 3 hot spares: a 3-node job that loses all its nodes can
    restart only on the spares the three incidents bring in."""
    with cluster_of_its_own(local_stack, "three-spares", 3, THREE_SPARES_PORT_OFFSET, spares=3) as stack_and_cluster:
        yield stack_and_cluster


async def fail(f: Fleet, node: str):
    """XID 79 on the node: its GPU is gone (the reference job stalls there) and the alert is sent."""
    f.drill.inject_fault(node, 79, gpu_lost=True)
    alert = NodeFailureAlert(node=node, xid=79, source="test", actor="pytest", reason=f"XID 79 on {node}")
    return await raise_alert(f.drill.client, alert, f.settings.task_queue, f.drill.policy)


def peers(report: IncidentReport) -> list[tuple[str, str]]:
    [job] = report.jobs
    return [(peer.node, peer.incident_id) for peer in job.failed_together]


async def reports_within(handles, seconds: float) -> list[IncidentReport]:
    """The incidents' reports; past the deadline, a failure that says where each one stands."""
    try:
        return await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), seconds)
    except TimeoutError:
        stands = [await status_if_answered(h) for h in handles]
        raise AssertionError(
            "; ".join(
                f"{s.node}: {s.phase}, phases {[(p.name, p.result) for p in s.phases][-3:]}" if s else "no answer"
                for s in stands
            )
        ) from None


async def assert_down(f: Fleet, report: IncidentReport) -> None:
    assert [a.action for a in report.actions if a.action == "down_node"] == ["down_node"], report.actions
    node = await f.drill.slurm.get_node(report.node)
    assert node.state == "down" and not node.in_service, node


@pytest.mark.parametrize("job_nodes", [2, 3])
async def test_two_nodes_of_one_job_fail_together_and_the_job_is_requeued_and_verified_once(
    temporal_env, local_stack, slurm_cluster, job_nodes
):
    """Both nodes of a 2-node job, or two of a 3-node job (the middle one and the last: its
    third node stays in the job); the cluster has room for the restart either way."""
    async with fleet(temporal_env, local_stack, slurm_cluster) as f:
        job, _ = await f.drill.start_training(DrillOptions(job_nodes=job_nodes))
        first, second = job.nodes[-2:]
        handles = await asyncio.gather(fail(f, first), fail(f, second))  # within milliseconds
        reports = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 300)

        after = await f.drill.slurm.get_job(job.job_id)
        assert after.state == "RUNNING" and after.restart_count == job.restart_count + 1, after  # requeued once
        assert not {first, second} & set(after.nodes) and {first, second} <= set(after.excluded_nodes), after
        assert len(after.nodes) == job_nodes, after
        for report, other in zip(reports, reversed(reports)):
            [job_report] = report.jobs
            assert job_report.verified and job_report.restart_count == after.restart_count, job_report
            assert peers(report) == [(other.node, other.incident_id)]
            await assert_down(f, report)
        # One spare on standby: one incident brought it in, the other found none, and the job runs on either way.
        assert sorted(r.outcome.split(":")[0] for r in reports) == ["no_replacement", "recovered"], [
            r.outcome for r in reports
        ]
        await f.drill.slurm.run("scancel", str(job.job_id))


async def test_every_node_of_a_3_node_job_fails_together_and_the_job_resumes_on_three_spares(
    temporal_env, three_spares
):
    """A switch or a PDU takes all three nodes of a job at once: three incidents, one requeue off all
    three, one spare brought in by each, and the job back on the spares from its newest complete
    checkpoint, verified once for all."""
    stack, cluster = three_spares
    async with fleet(temporal_env, stack, cluster) as f:
        job, _ = await f.drill.start_training(DrillOptions(job_nodes=3))
        assert sorted(job.nodes) == ["gpu-1", "gpu-2", "gpu-3"], job
        handles = await asyncio.gather(*(fail(f, node) for node in job.nodes))
        reports = await reports_within(handles, 180)

        after = await f.drill.slurm.get_job(job.job_id)
        assert after.state == "RUNNING" and after.restart_count == job.restart_count + 1, after  # requeued once
        assert sorted(after.nodes) == sorted(f.drill.spare_nodes) and set(job.nodes) <= set(after.excluded_nodes), after
        assert sorted(r.spare_node for r in reports) == sorted(f.drill.spare_nodes), [r.spare_node for r in reports]
        for report in reports:
            assert report.outcome == "recovered", report.outcome
            [job_report] = report.jobs
            assert job_report.verified and job_report.restart_count == after.restart_count, job_report
            others = sorted((r.node, r.incident_id) for r in reports if r is not report)
            assert sorted(peers(report)) == others, peers(report)
            await assert_down(f, report)
        recovery = await job_recovery_started(f.drill.client, f.settings.task_queue, job.job_id, 10)
        assert len(await activity_starts(recovery, "verify_restart")) == 1  # one verification, told to all three
        await f.drill.slurm.run("scancel", str(job.job_id))


async def test_a_job_another_incident_has_requeued_is_not_signalled(drill):
    """A late incident of a job whose other node's incident requeued it first: the job is pending,
    or already running again from its checkpoint (the trainer's handler may not be in yet, and
    SIGUSR1 would end it). Its snapshot's run is over: no signal, and no retry (Slurm refused the
    pending job's signal, retried for 10 minutes; a restarted job was signalled)."""
    job, _ = await drill.start_training(DrillOptions())
    jobs = JobActivities(SlurmClient(drill.slurm), CheckpointStore())
    ctx = ActionContext(incident_id="t", owner="recovery", actor="pytest", reason="XID 79", xid=79)
    found = SignalRequest(job_id=job.job_id, signal="USR1", ctx=ctx, node=job.nodes[0], restart_count=job.restart_count)
    assert (await ActivityEnvironment().run(jobs.signal_job, found)).action == "signal_job"  # as found: signalled

    await drill.slurm.requeue_hold(job.job_id)  # another incident's requeue
    for moved_on in ("PENDING", "RUNNING"):
        if moved_on == "PENDING":
            await wait_async(lambda: in_state(drill, job, "PENDING"), 60, "the job to be pending")
        else:
            await drill.slurm.release_job(job.job_id)
            await wait_async(lambda: in_state(drill, job, "RUNNING"), 60, "the job to run again")
        with pytest.raises(ApplicationError, match=f"not signalled: it is {moved_on}") as refused:
            await ActivityEnvironment().run(jobs.signal_job, found)
        assert refused.value.type == "JobMovedOn" and refused.value.non_retryable
    await drill.slurm.run("scancel", str(job.job_id))


async def in_state(drill, job, state: str) -> bool:
    """The job, requeued once since `job`, is in `state`."""
    now = await drill.slurm.get_job(job.job_id)
    return now.state == state and now.restart_count == job.restart_count + 1


async def test_a_node_that_fails_while_the_first_incident_verifies_gets_the_job_requeued_off_both(
    temporal_env, local_stack, slurm_cluster
):
    """The job is requeued off its first failed node and restarts on its other node and the spare,
    where it stalls: that node's GPU was failing too, its alert is late. The first incident's
    verification waits for training progress; the late alert's incident joins, the job is requeued
    again off both nodes and the one verification is of that restart."""
    async with fleet(temporal_env, local_stack, slurm_cluster) as f:
        job, run_dir = await f.drill.start_training(DrillOptions())
        late, first = job.nodes
        # Only the job's other node and the spare are free to run it after the first requeue.
        others = [
            n.name
            for n in await f.drill.slurm.list_nodes()
            if n.name not in job.nodes and n.name not in f.drill.spare_nodes
        ]
        for node in others:
            await f.drill.slurm.update_node(node, "DRAIN", "maintenance: the test keeps the job off it")
        f.drill.inject_fault(late, 79, gpu_lost=True)  # failing already, not yet reported
        first_incident = await fail(f, first)

        async def verifying_a_stalled_restart():
            status = await status_if_answered(first_incident)
            restarted = await f.drill.slurm.get_job(job.job_id)
            # The restarted trainer logged its resume: its signal handlers are in (a SIGUSR1 before
            # them, the late incident's call to checkpoint, would kill it: the job would end FAILED).
            resumed = [
                r
                for r in await CheckpointStore().resume_records(str(run_dir))
                if r.restart_count == job.restart_count + 1
            ]
            return (
                status is not None
                and status.phase == "verify"
                and restarted.state == "RUNNING"
                and late in restarted.nodes
                and resumed
            )

        await wait_async(verifying_a_stalled_restart, 180, f"the first incident to verify the job restarted on {late}")
        late_incident = await fail(f, late)
        for node in others:
            await f.drill.slurm.update_node(node, "RESUME", None)
        reports = await asyncio.wait_for(asyncio.gather(first_incident.result(), late_incident.result()), 300)

        after = await f.drill.slurm.get_job(job.job_id)
        assert after.state == "RUNNING" and after.restart_count == job.restart_count + 2, after  # once per node
        assert not {first, late} & set(after.nodes) and {first, late} <= set(after.excluded_nodes), after
        for report, other in zip(reports, reversed(reports)):
            [job_report] = report.jobs
            assert job_report.verified and job_report.restart_count == after.restart_count, job_report
            assert peers(report) == [(other.node, other.incident_id)]
            await assert_down(f, report)
        assert reports[0].outcome == "recovered" and reports[1].outcome.startswith("no_replacement"), [
            r.outcome for r in reports
        ]
        await f.drill.slurm.run("scancel", str(job.job_id))
