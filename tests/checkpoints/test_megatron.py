"""Megatron-style layouts, as Megatron-LM documents and writes them (Megatron itself needs CUDA and
does not install here): `iter_NNNNNNN/` beside `latest_checkpointed_iteration.txt`, each iteration
either a `torch.save` archive per model-parallel rank or a distributed checkpoint (`torch_dist`,
written here by DCP itself). The tracker is written last: an iteration newer than it is not done."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from backends.checkpoints import CheckpointStore, detect_format
from backends.checkpoints.megatron import TRACKER
from contracts.models import CheckpointFormat
from tests.checkpoints.conftest import write_dcp


def legacy_iteration(run: Path, iteration: int, ranks: int = 2) -> Path:
    directory = run / f"iter_{iteration:07d}"
    for rank in range(ranks):
        (directory / f"mp_rank_{rank:02d}").mkdir(parents=True)
        torch.save(
            {"iteration": iteration, "model": torch.nn.Linear(4, 4).state_dict()},
            directory / f"mp_rank_{rank:02d}" / "model_optim_rng.pt",
        )
    return directory


def track(run: Path, iteration: int) -> None:
    (run / TRACKER).write_text(f"{iteration}\n")


async def test_the_tracked_iteration_is_complete_and_a_newer_one_waits_for_the_tracker(tmp_path):
    run = tmp_path / "run"
    for iteration in (100, 200, 300):
        legacy_iteration(run, iteration)
    track(run, 200)
    store = CheckpointStore()
    assert detect_format(run) is CheckpointFormat.MEGATRON
    latest, [skip] = await store.latest_complete(str(run))
    assert latest is not None and (latest.checkpoint_id, latest.step) == ("iter_0000200", 200)
    assert (skip.checkpoint_id, skip.why) == (
        "iter_0000300",
        f"newer than {TRACKER} (200): the save did not finish",
    )
    # the save finishes: the tracker moves on, and the cached verdict on iter_0000300 with it
    track(run, 300)
    latest, skipped = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "iter_0000300" and skipped == []


async def test_a_rank_file_cut_short_or_no_tracker_at_all_is_incomplete(tmp_path, store):
    run = tmp_path / "run"
    legacy_iteration(run, 100)
    newest = legacy_iteration(run, 200)
    rank_file = newest / "mp_rank_01" / "model_optim_rng.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:300])
    assert (await store.latest_complete(str(run)))[0] is None  # no tracker: nothing finished
    track(run, 200)
    latest, [skip] = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "iter_0000100"
    assert skip.why.startswith("mp_rank_01/model_optim_rng.pt is not a whole torch.save archive")


async def test_a_distributed_iteration_follows_dcp_rules(tmp_path, store):
    dcp_run = tmp_path / "dcp"
    write_dcp(dcp_run, "sync:1")
    run = tmp_path / "run"
    for iteration in (100, 200):
        shutil.copytree(dcp_run / "step_1", run / f"iter_{iteration:07d}")
    track(run, 200)
    assert detect_format(run) is CheckpointFormat.MEGATRON
    latest, _ = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "iter_0000200"
    (run / "iter_0000200" / ".metadata").unlink()
    latest, [skip] = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "iter_0000100"
    assert skip.why.startswith("no .metadata: the save did not finish")
