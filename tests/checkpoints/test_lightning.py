"""Lightning checkpoints written by Lightning's own Trainer and ModelCheckpoint (a tiny model on
the CPU): the newest `epoch=…-step=….ckpt` is found and its step read; one cut short (a copy that
died midway: Lightning's own saves are atomic) is incomplete, as torch.load finds it too."""

from __future__ import annotations

from pathlib import Path

import lightning
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from backends.checkpoints import detect_format
from backends.checkpoints.lightning import LightningCheckpoints
from contracts.models import CheckpointFormat


class TinyModule(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def torch_loads(path: Path) -> bool:
    try:
        torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 (any failure to load is the answer)
        return False
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("lightning") / "run"
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    every_two = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=run / "checkpoints", every_n_train_steps=2, save_top_k=-1, save_last=True
    )
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=4,
        callbacks=[every_two],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=run,
    )
    trainer.fit(TinyModule(), DataLoader(data, batch_size=8))
    return run


async def test_the_newest_step_checkpoint_is_found_under_the_directory(saved, store):
    names = sorted(p.name for p in (saved / "checkpoints").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert detect_format(saved) is CheckpointFormat.LIGHTNING
    latest, skipped = await store.latest_complete(str(saved))
    assert latest is not None and skipped == []
    assert (latest.checkpoint_id, latest.step) == ("checkpoints/epoch=0-step=4.ckpt", 4)


def test_a_checkpoint_without_the_step_in_its_name_has_it_read_from_its_contents(saved):
    adapter = LightningCheckpoints()
    [last] = [c for c in adapter.candidates(saved) if c.path.name == "last.ckpt"]
    verdict = adapter.verify(last)
    assert last.step is None and verdict.complete and verdict.resolved_step == 4


async def test_a_checkpoint_cut_short_is_incomplete_as_torch_load_finds_it(saved, store, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for step in (2, 4):
        name = f"epoch=0-step={step}.ckpt"
        data = (saved / "checkpoints" / name).read_bytes()
        (run / "checkpoints" / name).write_bytes(data if step == 2 else data[: len(data) // 2])
    latest, [skip] = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "checkpoints/epoch=0-step=2.ckpt"
    assert skip.checkpoint_id == "checkpoints/epoch=0-step=4.ckpt"
    assert skip.why.startswith("epoch=0-step=4.ckpt is not a whole torch.save archive")
    assert not torch_loads(run / skip.checkpoint_id) and torch_loads(run / latest.checkpoint_id)


async def test_a_last_ckpt_ahead_of_every_named_checkpoint_is_the_latest(saved, store, tmp_path):
    """ModelCheckpoint with top-k on a metric keeps named checkpoints that may be older than last.ckpt."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):  # last.ckpt holds step 4
        (run / "checkpoints" / name).write_bytes((saved / "checkpoints" / name).read_bytes())
    latest, skipped = await store.latest_complete(str(run))
    assert latest is not None and (latest.checkpoint_id, latest.step) == ("checkpoints/last.ckpt", 4) and skipped == []
