"""The scale harness answers the project's Slurm backend protocol, as Slurm would."""

import inspect

import pytest

from backends.replacement import SPARE_STANDBY_REASON
from backends.slurm import SlurmBackend, SlurmClient, SlurmCommandError, SlurmNotFound
from bench.harness import OPERATIONS, ScaleSlurm, node_name, spare_name

NO_LATENCY: dict[str, float] = {}


def protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(SlurmBackend).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def test_every_protocol_method_with_the_same_signature():
    for name, signature in protocol_methods().items():
        ours = getattr(ScaleSlurm, name)
        assert inspect.signature(ours) == signature, name
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(getattr(SlurmBackend, name)), name


def test_the_protocol_attributes():
    for attribute in SlurmBackend.__annotations__:
        assert hasattr(ScaleSlurm, attribute), attribute


def test_latencies_are_asked_for_every_operation_the_protocol_calls():
    calls = {name for name in protocol_methods() if name != "supports"}
    assert calls == set(OPERATIONS)


async def test_a_recovery_through_the_client():
    harness = ScaleSlurm(3, NO_LATENCY, restart_delay=0.0)
    slurm = SlurmClient(harness)
    node = node_name(1)

    call = await slurm.update_node(node, "DRAIN", "recovery: XID 79")
    assert call.executed and call.path == "cli"
    assert (await slurm.get_node(node)).drained
    jobs = await slurm.jobs_on_node(node)
    assert [j.job_id for j in jobs] == [2]
    await slurm.signal_job(2, "USR1")

    await slurm.requeue_hold(2)
    held = await slurm.get_job(2)
    assert held.state == "PENDING" and held.held and held.restart_count == 1 and held.nodes == []
    await slurm.set_excluded_nodes(2, [node])
    await slurm.release_job(2)
    assert (await slurm.get_job(2)).state == "PENDING"  # its spare is not in service yet

    await slurm.update_node(node, "DOWN", "recovery: XID 79")
    assert (await slurm.get_node(node)).state == "down"
    spare = await slurm.get_node(spare_name(1))
    assert spare.drained and spare.reason.endswith(SPARE_STANDBY_REASON) and not spare.comment
    await slurm.set_node_comment(spare.name, "recovery: spare for incident x")
    await slurm.update_node(spare.name, "RESUME", None)
    assert (await slurm.get_node(spare.name)).in_service

    restarted = await slurm.get_job(2)
    assert restarted.state == "RUNNING" and restarted.nodes == [spare_name(1)]
    assert restarted.excluded_nodes == [node] and restarted.restart_count == 1
    assert (await slurm.get_job(1)).state == "RUNNING"  # the other nodes' jobs are untouched


async def test_dry_run_changes_nothing():
    harness = ScaleSlurm(1, NO_LATENCY)
    planning = SlurmClient(harness).planning()
    call = await planning.update_node(node_name(0), "DRAIN", "recovery: XID 79")
    await planning.requeue_hold(1)
    assert not call.executed
    assert not (await planning.get_node(node_name(0))).drained
    assert (await planning.get_job(1)).state == "RUNNING"


async def test_refusals_as_slurm_makes_them():
    harness = ScaleSlurm(1, NO_LATENCY)
    with pytest.raises(SlurmNotFound):
        await harness.get_node("gpu-404")
    with pytest.raises(SlurmNotFound):
        await harness.get_job(404)
    with pytest.raises(SlurmCommandError):
        await harness.update_node(node_name(0), "DRAIN", None)  # a drain needs a reason
    await harness.requeue_hold(1)
    with pytest.raises(SlurmCommandError):
        await harness.signal_job(1, "USR1")  # a pending job cannot be signalled


async def test_the_call_log_says_when_each_node_was_drained_and_each_job_signalled(tmp_path):
    with open(tmp_path / "calls.log", "w") as log:
        harness = ScaleSlurm(2, NO_LATENCY, log)
        await harness.update_node(node_name(0), "DRAIN", "recovery: XID 79")
        await harness.signal_job(1, "USR1")
    lines = [line.split() for line in (tmp_path / "calls.log").read_text().splitlines()]
    assert [line[1:] for line in lines] == [["update_node", node_name(0), "DRAIN"], ["signal_job", "1", "USR1"]]
    assert all(float(line[0]) > 0 for line in lines)
