"""Slurm's JSON, as 22.05 and as 23.02+ shape it, becomes the same contracts."""

from datetime import datetime, timezone

from backends.slurm.parse import expand_nodes, job_from_json, node_from_json


def test_node_22_05_shape():
    node = node_from_json(
        {
            "name": "gpu-5",
            "state": "idle",
            "state_flags": ["DRAIN"],
            "reason": "recovery: hot spare standby",
            "comment": "",
        }
    )
    assert (node.state, node.flags, node.drained, node.in_service) == ("idle", ["DRAIN"], True, False)


def test_node_newer_shape_with_flags_in_the_state_list():
    node = node_from_json({"name": "gpu-2", "state": ["IDLE", "DRAIN"], "reason": "x"})
    assert (node.state, node.flags, node.drained) == ("idle", ["DRAIN"], True)
    down = node_from_json({"name": "gpu-2", "state": ["DOWN", "NOT_RESPONDING"]})
    assert (down.state, down.responding, down.in_service) == ("down", False, False)


def test_node_not_responding_is_not_in_service():
    node = node_from_json({"name": "gpu-5", "state": "idle", "state_flags": ["NOT_RESPONDING"]})
    assert not node.in_service


def test_job_22_05_shape():
    job = job_from_json(
        {
            "job_id": 12,
            "job_state": "RUNNING",
            "nodes": "gpu-[1-2]",
            "restart_cnt": 1,
            "comment": "checkpoint_dir=/x",
            "excluded_nodes": "gpu-3",
            "priority": 0,
            "state_reason": "None",
            "requeue": True,
            "name": "train",
        }
    )
    assert job.nodes == ["gpu-1", "gpu-2"]
    assert (job.restart_count, job.excluded_nodes, job.checkpoint_dir) == (1, ["gpu-3"], "/x")
    assert job.required_nodes == []
    pinned = job_from_json({"job_id": 13, "job_state": "RUNNING", "nodes": "gpu-[1-2]", "required_nodes": "gpu-[1-2]"})
    assert pinned.required_nodes == ["gpu-1", "gpu-2"]


def test_job_newer_shape_with_wrapped_numbers():
    job = job_from_json(
        {
            "job_id": 12,
            "job_state": ["PENDING", "REQUEUED"],
            "nodes": "",
            "restart_cnt": 2,
            "priority": {"set": True, "number": 0},
            "state_reason": "job_requeued_in_held_state",
        }
    )
    assert (job.state, job.held, job.nodes, job.restart_count) == ("PENDING", True, [], 2)


def test_requeued_job_still_completing_is_not_pending_yet():
    job = job_from_json(
        {
            "job_id": 12,
            "job_state": ["PENDING", "COMPLETING"],
            "state_reason": "JobHeldUser",
            "priority": {"set": True, "number": 0},
        }
    )
    assert job.state == "COMPLETING" and not job.held
    job = job_from_json(
        {"job_id": 12, "job_state": ["PENDING"], "state_reason": "JobHeldUser", "priority": {"set": True, "number": 0}}
    )
    assert job.state == "PENDING" and job.held


def test_host_lists_expand():
    assert expand_nodes("gpu-[1-2,4],login1") == ["gpu-1", "gpu-2", "gpu-4", "login1"]
    assert expand_nodes(None) == [] and expand_nodes("") == []


def test_a_job_that_asked_for_expedited_requeue_says_so():
    # 26.05.5's JSON of a job submitted --requeue=expedite, after its node failed (abridged)
    expedited = job_from_json(
        {
            "job_id": 3,
            "job_state": ["PENDING", "EXPEDITING"],
            "flags": ["JOB_WAS_RUNNING", "PARTITION_ASSIGNED", "EXPEDITED_REQUEUE"],
            "restart_cnt": 1,
        }
    )
    assert (expedited.state, expedited.expedited_requeue, expedited.restart_count) == ("PENDING", True, 1)
    plain = job_from_json({"job_id": 4, "job_state": ["RUNNING"], "flags": ["JOB_WAS_RUNNING"]})
    assert not plain.expedited_requeue
    assert not job_from_json({"job_id": 5, "job_state": "RUNNING"}).expedited_requeue  # 22.05: no such flag


def test_a_finished_jobs_end_time_in_both_shapes_and_none_before_it_ended():
    ended = datetime(2026, 12, 5, 7, 46, 55, tzinfo=timezone.utc)
    epoch = int(ended.timestamp())
    assert job_from_json({"job_id": 1, "job_state": "FAILED", "end_time": epoch}).end_time == ended
    wrapped = {"job_id": 1, "job_state": ["FAILED"], "end_time": {"set": True, "number": epoch}}
    assert job_from_json(wrapped).end_time == ended
    # A running job's end_time is when its time limit would end it: not an end.
    assert job_from_json({"job_id": 1, "job_state": "RUNNING", "end_time": epoch + 3600}).end_time is None
    assert job_from_json({"job_id": 1, "job_state": "FAILED", "end_time": 0}).end_time is None
