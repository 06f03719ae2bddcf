"""The search every checkpoint adapter shares: newest first, stopping at the first complete one,
and never verifying a checkpoint twice while its files are unchanged (a poll of a directory of
multi-GB checkpoints reads none of them again). And how a job's format is chosen."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.checkpoints import CheckpointStore, detect_format
from contracts.models import CheckpointFormat, SlurmJob
from contracts.settings import ConfigError, load_settings
from trainer.checkpoint import save_checkpoint

FILES = {"model.bin": b"w" * 4096, "optimizer.bin": b"o" * 4096}


def run_with(tmp_path: Path, steps: range) -> Path:
    run = tmp_path / "run"
    for step in steps:
        save_checkpoint(run, step, step * 0.5, FILES)
    return run


async def test_only_the_newest_is_verified_and_only_once_while_unchanged(tmp_path):
    run = run_with(tmp_path, range(10, 310, 10))  # 30 checkpoints
    store = CheckpointStore()
    latest, _ = await store.latest_complete(str(run))
    assert latest is not None and (latest.checkpoint_id, latest.train_seconds) == ("step-000000300", 150.0)
    assert store.verifications == 1
    for _ in range(5):
        assert (await store.latest_complete(str(run)))[0] == latest
    assert store.verifications == 1


async def test_a_checkpoint_changed_since_it_was_verified_is_verified_again(tmp_path):
    run = run_with(tmp_path, range(10, 40, 10))
    store = CheckpointStore()
    await store.latest_complete(str(run))
    # same size, other bytes: only the hash tells, and the changed mtime sends it to be hashed again
    (run / "step-000000030" / "model.bin").write_bytes(b"x" * 4096)
    latest, [skip] = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "step-000000020"
    assert (skip.checkpoint_id, skip.why) == ("step-000000030", "model.bin checksum mismatch")
    assert store.verifications == 3


async def test_created_before_leaves_out_what_a_restarted_job_wrote(tmp_path):
    run = run_with(tmp_path, range(10, 30, 10))
    store = CheckpointStore()
    cutoff = (await store.latest_complete(str(run)))[0]
    assert cutoff is not None
    save_checkpoint(run, 30, 15.0, FILES)
    latest, _ = await store.latest_complete(str(run), created_before=cutoff.created_at)
    assert latest is not None and latest.checkpoint_id == "step-000000010"


def test_a_format_is_detected_from_names_alone(tmp_path):
    cases = {
        CheckpointFormat.REFERENCE: "step-000000010/manifest.json",
        CheckpointFormat.HF_TRAINER: "checkpoint-10/trainer_state.json",
        CheckpointFormat.LIGHTNING: "lightning_logs/version_0/checkpoints/epoch=0-step=10.ckpt",
        CheckpointFormat.MEGATRON: "iter_0000010/mp_rank_00/model_optim_rng.pt",
        CheckpointFormat.DCP: "step_10/__0_0.distcp",
    }
    for expected, file in cases.items():
        run = tmp_path / expected.value
        (run / file).parent.mkdir(parents=True)
        (run / file).write_bytes(b"")
        assert detect_format(run) is expected, file
    assert detect_format(tmp_path / "empty") is CheckpointFormat.REFERENCE


def test_a_job_names_its_format_in_its_comment_and_an_unknown_name_is_left_to_detection():
    def job(comment: str) -> SlurmJob:
        return SlurmJob(job_id=1, state="RUNNING", comment=comment)

    assert job("checkpoint_dir=/ckpt;checkpoint_format=dcp").checkpoint_format is CheckpointFormat.DCP
    assert job("checkpoint_format=hf_trainer").checkpoint_format is CheckpointFormat.HF_TRAINER
    assert job("checkpoint_dir=/ckpt;checkpoint_format=orbax").checkpoint_format is None
    assert job("checkpoint_dir=/ckpt").checkpoint_format is None


async def test_the_configured_format_applies_where_a_job_names_none(tmp_path):
    run = run_with(tmp_path, range(10, 30, 10))
    (run / "checkpoint-5").mkdir()  # a stray directory in Trainer's layout: detection would still say reference
    assert (await CheckpointStore().latest_complete(str(run)))[0] is not None
    configured = CheckpointStore(default_format=CheckpointFormat.HF_TRAINER)
    latest, [skip] = await configured.latest_complete(str(run))
    assert latest is None and skip.checkpoint_id == "checkpoint-5"
    named = await configured.latest_complete(str(run), fmt=CheckpointFormat.REFERENCE)
    assert named[0] is not None and named[0].checkpoint_id == "step-000000020"


def test_the_setting_takes_a_known_format_only(monkeypatch):
    monkeypatch.setenv("RECOVERY_CHECKPOINT_FORMAT", "dcp")
    assert load_settings().checkpoint_format is CheckpointFormat.DCP
    monkeypatch.setenv("RECOVERY_CHECKPOINT_FORMAT", "orbax")
    with pytest.raises(ConfigError, match="RECOVERY_CHECKPOINT_FORMAT"):
        load_settings()
