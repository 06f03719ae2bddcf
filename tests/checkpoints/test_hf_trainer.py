"""Hugging Face Trainer checkpoints written by Trainer itself (a GPT-2 of one small layer, built from
a config: nothing downloaded): `checkpoint-<step>/` is complete with its trainer_state.json and
whole weights; a save cut off before trainer_state.json, or weights cut short, is not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from backends.checkpoints import detect_format
from contracts.models import CheckpointFormat


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(8) * (i + 1) % 32
        return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("hf") / "run"
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
    )
    transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens()).train()
    return run


def copy_of(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "run"))


async def test_the_newest_checkpoint_directory_is_complete_with_its_global_step(saved, store):
    assert sorted(p.name for p in saved.iterdir() if p.is_dir()) == ["checkpoint-2", "checkpoint-4"]
    assert {"trainer_state.json", "model.safetensors", "optimizer.pt"} <= {
        p.name for p in (saved / "checkpoint-4").iterdir()
    }
    assert detect_format(saved) is CheckpointFormat.HF_TRAINER
    latest, skipped = await store.latest_complete(str(saved))
    assert latest is not None and (latest.checkpoint_id, latest.step) == ("checkpoint-4", 4) and skipped == []


async def test_a_save_cut_off_before_trainer_state_resumes_from_the_one_before(saved, store, tmp_path):
    run = copy_of(saved, tmp_path)
    (run / "checkpoint-4" / "trainer_state.json").unlink()
    latest, [skip] = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "checkpoint-2"
    assert (skip.checkpoint_id, skip.why) == (
        "checkpoint-4",
        "no trainer_state.json: the save did not finish (Trainer writes it last)",
    )


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
async def test_weights_or_optimizer_state_cut_short_are_incomplete(saved, store, tmp_path, name):
    run = copy_of(saved, tmp_path)
    target = run / "checkpoint-4" / name
    with open(target, "r+b") as file:
        file.truncate(target.stat().st_size - 64)
    latest, [skip] = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "checkpoint-2"
    assert skip.checkpoint_id == "checkpoint-4" and skip.why.startswith(name)
    assert "truncated" in skip.why or "not a whole torch.save archive" in skip.why
