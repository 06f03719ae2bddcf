"""The checkpoint library: atomic saves, every kind of incomplete checkpoint, the progress files."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from trainer.checkpoint import (
    BEING_WRITTEN,
    CheckpointError,
    Skipped,
    append_resume_record,
    find_latest_complete,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_progress,
    read_resume_records,
    save_checkpoint,
    verify_checkpoint,
    write_progress,
)

FILES = {
    "model.json": b'{"weights": [1.0, 2.0], "bias": 0.5}',
    "optimizer.json": b'{"velocity": [0.0]}',
}
T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)


def set_created_at(checkpoint_dir: Path, when: datetime) -> None:
    """Rewrite a manifest's created_at (the manifest is not among its own checksummed files)."""
    manifest_path = checkpoint_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["created_at"] = when.isoformat()
    manifest_path.write_text(json.dumps(manifest))


def set_mtime(path: Path, when: datetime) -> None:
    os.utime(path, (when.timestamp(), when.timestamp()))


def make_tmp_dir(run_dir: Path, step: int) -> Path:
    """A checkpoint caught mid-write: a temporary directory with part of its payload."""
    tmp = run_dir / f".tmp-step-{step:09d}-4242-abcd1234"
    tmp.mkdir(parents=True)
    (tmp / "model.json").write_bytes(b'{"weights": [')
    return tmp


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:10])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))


def drop_manifest_field(path: Path, field: str) -> None:
    manifest = json.loads(path.read_text())
    del manifest[field]
    path.write_text(json.dumps(manifest))


# --- saving and loading -----------------------------------------------------------------------


def test_save_writes_a_complete_checkpoint_with_its_manifest(tmp_path: Path) -> None:
    cp = save_checkpoint(tmp_path, 120, 24.1, FILES)

    assert cp.checkpoint_id == "step-000000120"
    assert cp.path == tmp_path / "step-000000120"
    assert (cp.step, cp.train_seconds) == (120, 24.1)
    assert cp.created_at.tzinfo is not None
    manifest = json.loads((cp.path / "manifest.json").read_text())
    assert manifest["format"] == 1
    assert manifest["checkpoint_id"] == "step-000000120"
    assert manifest["step"] == 120
    assert manifest["train_seconds"] == 24.1
    assert manifest["created_at"].endswith("+00:00")
    assert datetime.fromisoformat(manifest["created_at"]) == cp.created_at
    assert [(f["name"], f["size"]) for f in manifest["files"]] == [
        ("model.json", len(FILES["model.json"])),
        ("optimizer.json", len(FILES["optimizer.json"])),
    ]
    assert all(len(f["sha256"]) == 64 for f in manifest["files"])
    assert verify_checkpoint(cp.path) is None
    assert load_checkpoint(cp) == FILES
    # nothing left behind from the atomic write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000120"]


def test_save_is_idempotent_for_a_complete_checkpoint(tmp_path: Path) -> None:
    first = save_checkpoint(tmp_path, 10, 2.0, FILES)

    again = save_checkpoint(tmp_path, 10, 9.9, {"model.json": b"something else"})

    assert again == first
    assert load_checkpoint(again) == FILES


def test_save_replaces_an_incomplete_checkpoint_of_the_same_step(tmp_path: Path) -> None:
    broken = save_checkpoint(tmp_path, 10, 2.0, FILES)
    truncate(broken.path / "model.json")

    replaced = save_checkpoint(tmp_path, 10, 3.0, FILES)

    assert replaced.train_seconds == 3.0
    assert verify_checkpoint(replaced.path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000010"]


@pytest.mark.parametrize("name", ["", "manifest.json", "../escape", "sub/file", "."])
def test_save_rejects_file_names_that_are_not_plain(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="file name"):
        save_checkpoint(tmp_path, 1, 0.0, {name: b"x"})
    assert list(tmp_path.iterdir()) == []


def test_load_fails_clearly_when_the_checkpoint_broke_after_it_was_found(tmp_path: Path) -> None:
    cp = save_checkpoint(tmp_path, 30, 6.0, FILES)
    flip_a_byte(cp.path / "optimizer.json")

    with pytest.raises(CheckpointError, match="step-000000030 .* optimizer.json checksum mismatch"):
        load_checkpoint(cp)


# --- what makes a checkpoint incomplete ---------------------------------------------------------


MODEL_SIZE = len(FILES["model.json"])


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda cp: (cp / "manifest.json").unlink(), "no manifest"),
        (lambda cp: truncate(cp / "model.json"), f"model.json truncated: 10 of {MODEL_SIZE} bytes"),
        (lambda cp: flip_a_byte(cp / "model.json"), "model.json checksum mismatch"),
        (lambda cp: (cp / "optimizer.json").unlink(), "manifest names missing file optimizer.json"),
        (
            lambda cp: (cp / "model.json").write_bytes(FILES["model.json"] + b" "),
            f"model.json too long: {MODEL_SIZE + 1} bytes, manifest says {MODEL_SIZE}",
        ),
        (
            lambda cp: (cp / "manifest.json").write_text('{"format": 1, "step'),
            "manifest unreadable: Unterminated string",
        ),
        (
            lambda cp: (cp / "manifest.json").write_text("[]"),
            "manifest unreadable: not a JSON object",
        ),
        (lambda cp: drop_manifest_field(cp / "manifest.json", "files"), "manifest lacks files"),
    ],
    ids=[
        "no-manifest",
        "truncated",
        "checksum",
        "missing-file",
        "too-long",
        "manifest-not-json",
        "manifest-not-object",
        "manifest-missing-field",
    ],
)
def test_damaged_checkpoints_are_incomplete_with_a_reason(
    tmp_path: Path, damage: Callable[[Path], object], why: str
) -> None:
    cp = save_checkpoint(tmp_path, 40, 8.0, FILES)

    damage(cp.path)

    assert verify_checkpoint(cp.path).startswith(why)
    [status] = list_checkpoints(tmp_path)
    assert (status.checkpoint_id, status.step, status.complete) == ("step-000000040", 40, False)
    assert status.why.startswith(why)
    with pytest.raises(CheckpointError, match="step-000000040"):
        load_checkpoint(cp)


def test_a_manifest_for_another_step_is_not_trusted(tmp_path: Path) -> None:
    cp = save_checkpoint(tmp_path, 40, 8.0, FILES)
    os.rename(cp.path, tmp_path / "step-000000050")

    assert verify_checkpoint(tmp_path / "step-000000050") == (
        "manifest describes step-000000040 (step 40), not step-000000050"
    )


def test_a_temporary_directory_is_never_complete(tmp_path: Path) -> None:
    tmp = make_tmp_dir(tmp_path, 50)

    assert verify_checkpoint(tmp) == BEING_WRITTEN
    [status] = list_checkpoints(tmp_path)
    assert (status.checkpoint_id, status.path, status.step) == (tmp.name, tmp, 50)
    assert (status.complete, status.why) == (False, "being written (temporary directory)")


def test_list_orders_by_step_and_ignores_other_entries(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 20, 4.0, FILES)
    save_checkpoint(tmp_path, 3, 0.6, FILES)
    make_tmp_dir(tmp_path, 30)
    (tmp_path / ".tmp-unnamed").mkdir()
    (tmp_path / "step-notanumber").mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    write_progress(tmp_path, {"step": 1})

    statuses = list_checkpoints(tmp_path)

    assert [(s.checkpoint_id, s.step, s.complete) for s in statuses] == [
        ("step-000000003", 3, True),
        ("step-000000020", 20, True),
        (".tmp-step-000000030-4242-abcd1234", 30, False),
        (".tmp-unnamed", None, False),
    ]


def test_list_of_a_missing_run_dir_is_empty(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path / "nothing here") == []
    assert find_latest_complete(tmp_path / "nothing here") == (None, [])


# --- finding the checkpoint to resume from ------------------------------------------------------


def test_latest_complete_skips_newer_incomplete_ones_and_lists_why(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 10, 2.0, FILES)
    older_broken = save_checkpoint(tmp_path, 5, 1.0, FILES)
    (older_broken.path / "manifest.json").unlink()
    latest = save_checkpoint(tmp_path, 20, 4.0, FILES)
    truncate(save_checkpoint(tmp_path, 30, 6.0, FILES).path / "model.json")
    (save_checkpoint(tmp_path, 40, 8.0, FILES).path / "manifest.json").unlink()
    tmp = make_tmp_dir(tmp_path, 15)  # a temporary directory is skipped whatever its step

    found, skipped = find_latest_complete(tmp_path)

    assert found == latest
    assert skipped == [
        Skipped("step-000000040", "no manifest"),
        Skipped("step-000000030", f"model.json truncated: 10 of {MODEL_SIZE} bytes"),
        Skipped(tmp.name, BEING_WRITTEN),
    ]


def test_latest_complete_is_none_when_nothing_is_complete(tmp_path: Path) -> None:
    (save_checkpoint(tmp_path, 10, 2.0, FILES).path / "manifest.json").unlink()
    tmp = make_tmp_dir(tmp_path, 20)

    found, skipped = find_latest_complete(tmp_path)

    assert found is None
    assert skipped == [Skipped(tmp.name, BEING_WRITTEN), Skipped("step-000000010", "no manifest")]


def test_created_before_ignores_everything_made_at_or_after_it(tmp_path: Path) -> None:
    for step, minutes in [(10, 0), (20, 1), (30, 2), (40, 3)]:
        cp = save_checkpoint(tmp_path, step, step / 5, FILES)
        set_created_at(cp.path, T0 + timedelta(minutes=minutes))
    broken = save_checkpoint(tmp_path, 25, 5.0, FILES)
    set_created_at(broken.path, T0 + timedelta(minutes=1, seconds=30))
    (broken.path / "model.json").unlink()
    set_mtime(broken.path, T0 + timedelta(minutes=1, seconds=30))
    set_mtime(make_tmp_dir(tmp_path, 35), T0 + timedelta(minutes=2, seconds=30))

    at_two, skipped_at_two = find_latest_complete(tmp_path, T0 + timedelta(minutes=2))
    before_two, skipped_before_two = find_latest_complete(tmp_path, T0 + timedelta(seconds=105))
    latest, skipped = find_latest_complete(tmp_path)

    # step 30 was made exactly at the cut-off: ignored like everything after it
    assert at_two.step == 20
    assert skipped_at_two == [Skipped("step-000000025", "manifest names missing file model.json")]
    assert before_two.step == 20
    assert skipped_before_two == skipped_at_two
    assert latest.step == 40
    assert [s.checkpoint_id for s in skipped] == [".tmp-step-000000035-4242-abcd1234"]
    assert find_latest_complete(tmp_path, created_before=T0) == (None, [])


# --- pruning ------------------------------------------------------------------------------------


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    for step in range(1, 8):
        save_checkpoint(tmp_path, step, float(step), FILES)
    (save_checkpoint(tmp_path, 9, 9.0, FILES).path / "manifest.json").unlink()
    tmp = make_tmp_dir(tmp_path, 10)

    removed = prune_checkpoints(tmp_path, keep=3)

    assert [p.name for p in removed] == [f"step-{n:09d}" for n in range(1, 5)]
    remaining = [(s.step, s.complete) for s in list_checkpoints(tmp_path)]
    assert remaining == [(5, True), (6, True), (7, True), (9, False), (10, False)]
    assert tmp.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".deleting-")]


def test_prune_never_deletes_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, 1.0, FILES)
    newest = save_checkpoint(tmp_path, 2, 2.0, FILES)

    prune_checkpoints(tmp_path, keep=0)

    assert find_latest_complete(tmp_path) == (newest, [])
    assert [s.step for s in list_checkpoints(tmp_path)] == [2]


def test_prune_clears_leftovers_of_an_interrupted_deletion(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, 1.0, FILES)
    leftover = tmp_path / ".deleting-step-000000000-0badf00d"
    leftover.mkdir()
    (leftover / "model.json").write_bytes(b"half deleted")

    assert prune_checkpoints(tmp_path, keep=1) == []
    assert not leftover.exists()


# --- progress and the resume log ----------------------------------------------------------------


def test_progress_round_trips_and_is_replaced_whole(tmp_path: Path) -> None:
    assert read_progress(tmp_path) is None
    first = {"job_id": "123", "restart_count": 0, "step": 56, "state": "running"}
    second = {"job_id": "123", "restart_count": 0, "step": 57, "state": "stalled"}

    write_progress(tmp_path, first)
    write_progress(tmp_path, second)

    assert read_progress(tmp_path) == second
    assert [p.name for p in tmp_path.iterdir()] == ["progress.json"]


def test_unreadable_progress_reads_as_none(tmp_path: Path) -> None:
    (tmp_path / "progress.json").write_text('{"step": 5')
    assert read_progress(tmp_path) is None


def test_resume_records_append_and_survive_a_torn_line(tmp_path: Path) -> None:
    assert read_resume_records(tmp_path) == []
    first = {"job_id": "123", "restart_count": 0, "resumed_step": None}
    second = {"job_id": "123", "restart_count": 1, "resumed_step": 40}
    append_resume_record(tmp_path, first)
    # a crash in the middle of an append
    with open(tmp_path / "resume-log.jsonl", "a") as log:
        log.write('{"job_id": "123", "restart_co')

    append_resume_record(tmp_path, second)

    assert read_resume_records(tmp_path) == [first, second]
    lines = (tmp_path / "resume-log.jsonl").read_text().splitlines()
    assert [json.loads(lines[0]), json.loads(lines[2])] == [first, second]
