"""Checkpoint faults at the moment of a failure, as the drill makes them (drills/drill.py
corrupt_latest_checkpoint): the newest checkpoint without its manifest, truncated, with a wrong
checksum, its manifest naming a missing file, a newer one being written, or every one broken.
The library, the controller's view of it (backends/checkpoints.py) and the reference job
(trainer/job.py) must agree on where to resume, and say which checkpoints were skipped and why."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from backends.checkpoints import CheckpointStore
from drills.drill import corrupt_latest_checkpoint
from drills.localstack import StackError
from tests.unit.test_trainer_job import Jobs, jobs, wait_for  # noqa: F401 (the jobs fixture)
from trainer.checkpoint import BEING_WRITTEN, find_latest_complete, read_resume_records, save_checkpoint

FILES = {"model.json": b'{"weights": [1.0, 2.0], "bias": 0.5}', "optimizer.json": b'{"velocity": [0.0]}'}
STEPS = (10, 20, 30)

# kind -> why the broken checkpoint is incomplete (its start: the library adds sizes)
WHY = {
    "truncated": "model.json truncated: ",
    "checksum": "model.json checksum mismatch",
    "no_manifest": "no manifest",
    "missing_file": "manifest names missing file model.json",
    "being_written": BEING_WRITTEN,
    "all": "model.json truncated: ",
}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for step in STEPS:
        save_checkpoint(run, step, step * 0.2, FILES)
    return run


@pytest.mark.parametrize("kind", [k for k in WHY if k != "all"])
async def test_the_newest_checkpoint_broken_resumes_from_the_one_before(run_dir: Path, kind: str) -> None:
    broken = corrupt_latest_checkpoint(run_dir, kind)

    found, skipped = find_latest_complete(run_dir)
    ref, reported = await CheckpointStore().latest_complete(str(run_dir))

    # The newest checkpoint is left alone when a newer one is caught mid-write.
    expected = "step-000000030" if kind == "being_written" else "step-000000020"
    assert found is not None and found.checkpoint_id == expected
    assert ref is not None and (ref.checkpoint_id, ref.step) == (expected, found.step)
    [skip] = skipped
    assert skip.checkpoint_id == broken and skip.why.startswith(WHY[kind])
    assert [(s.checkpoint_id, s.why) for s in reported] == [(skip.checkpoint_id, skip.why)]
    if kind == "being_written":
        assert broken.startswith(".tmp-step-000000031-")
        assert [p.name for p in (run_dir / broken).iterdir()] == ["model.json"]  # data, no manifest yet
    else:
        assert broken == "step-000000030"


async def test_every_checkpoint_broken_leaves_nothing_to_resume_from_and_says_so(run_dir: Path) -> None:
    broken = corrupt_latest_checkpoint(run_dir, "all")

    found, skipped = find_latest_complete(run_dir)
    ref, reported = await CheckpointStore().latest_complete(str(run_dir))

    assert broken == "step-000000030"
    assert found is None and ref is None
    assert [s.checkpoint_id for s in skipped] == ["step-000000030", "step-000000020", "step-000000010"]
    assert all(s.why.startswith(WHY["all"]) for s in skipped)
    assert [s.checkpoint_id for s in reported] == [s.checkpoint_id for s in skipped]


def test_only_a_checkpoint_can_be_broken(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="no complete checkpoint to corrupt"):
        corrupt_latest_checkpoint(tmp_path, "checksum")


@pytest.mark.parametrize("kind", list(WHY))
def test_the_reference_job_never_resumes_from_an_incomplete_checkpoint(
    jobs: Jobs,
    tmp_path: Path,  # noqa: F811
    kind: str,
) -> None:
    """A job stopped by SIGTERM (its emergency checkpoint is the newest), its checkpoints broken
    as the drill breaks them, then restarted as Slurm restarts a requeued job."""
    run_dir = tmp_path / "run"
    args = ("--step-seconds", "0.01", "--checkpoint-every", "5")
    first = jobs.start(run_dir, *args)
    wait_for("three checkpoints", lambda: len(first.complete_steps()) >= 3)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait_exit() == 143, first.logs()
    complete = first.complete_steps()
    *_, before_newest, newest = complete
    broken = corrupt_latest_checkpoint(run_dir, kind)

    second = jobs.start(run_dir, *args, restart_count=1)
    wait_for("the restart's progress", lambda: second.progress().get("restart_count") == 1)
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait_exit() == 143, second.logs()

    record = read_resume_records(run_dir)[1]
    skipped = {s["checkpoint_id"]: s["why"] for s in record["skipped_checkpoints"]}
    assert skipped[broken].startswith(WHY[kind]), skipped
    if kind == "all":
        # Nothing complete was left: the job started from scratch, and its record says so.
        assert (record["resumed_step"], record["checkpoint_id"]) == (None, None)
        assert {f"step-{step:09d}" for step in complete} <= skipped.keys()
        assert "starting from scratch (restart 1)" in second.logs()
        return
    resumed = newest if kind == "being_written" else before_newest
    assert (record["resumed_step"], record["checkpoint_id"]) == (resumed, f"step-{resumed:09d}")
    assert f"skipped checkpoint {broken}: " in second.logs()
    assert f"resumed from step-{resumed:09d} (restart 1)" in second.logs()
    if kind == "being_written":
        assert not (run_dir / broken).exists()  # on record now, and cleared away
