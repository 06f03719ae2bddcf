"""PyTorch DCP checkpoints written by torch.distributed.checkpoint itself (2 ranks, `save` and
`async_save`): the adapter calls complete exactly what DCP's own `load` can read, and says why
for the rest: a save cut off before `.metadata` (also with an `async_save` in flight), a shard
truncated after it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from backends.checkpoints import detect_format
from backends.checkpoints.dcp import why_incomplete
from contracts.models import CheckpointFormat
from tests.checkpoints.conftest import write_dcp
from tests.checkpoints.dcp_writer import state


def dcp_loads(directory: Path) -> bool:
    """Whether DCP's own load (one process, no group) reads the whole checkpoint back."""
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    try:
        dcp.load(state(model, optimizer, 0), checkpoint_id=str(directory))
    except (Exception, CheckpointException):  # any failure of DCP's load is the answer (CheckpointException
        return False  # is a BaseException)
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("dcp") / "run"
    write_dcp(run, "sync:10", "async:20")
    return run


def copy_of(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "run"))


async def test_the_newest_of_a_sync_and_an_async_save_is_complete_and_detected(saved, store):
    assert sorted(p.name for p in (saved / "step_20").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert detect_format(saved) is CheckpointFormat.DCP
    latest, skipped = await store.latest_complete(str(saved))
    assert latest is not None and (latest.checkpoint_id, latest.step, latest.checkpoint_format) == (
        "step_20",
        20,
        CheckpointFormat.DCP,
    )
    assert skipped == [] and dcp_loads(saved / "step_20") and dcp_loads(saved / "step_10")


async def test_a_save_cut_off_before_its_metadata_resumes_from_the_one_before(saved, store, tmp_path):
    run = copy_of(saved, tmp_path)
    (run / "step_20" / ".metadata").unlink()
    latest, [skip] = await store.latest_complete(str(run), fmt=CheckpointFormat.DCP)
    assert latest is not None and latest.checkpoint_id == "step_10"
    assert (skip.checkpoint_id, skip.why) == (
        "step_20",
        "no .metadata: the save did not finish (the coordinator writes it last; 2 shard file(s) written)",
    )
    assert not dcp_loads(run / "step_20")


async def test_a_shard_truncated_after_the_metadata_is_incomplete(saved, store, tmp_path):
    run = copy_of(saved, tmp_path)
    shard = run / "step_20" / "__1_0.distcp"
    whole = shard.stat().st_size
    with open(shard, "r+b") as file:
        file.truncate(whole - 100)
    latest, [skip] = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "step_10"
    assert skip.why == f"shard __1_0.distcp truncated: {whole - 100} bytes, .metadata needs {whole}"
    assert not dcp_loads(run / "step_20")


async def test_a_crash_with_an_async_save_in_flight_leaves_shards_without_metadata(store, tmp_path):
    run = tmp_path / "run"
    write_dcp(run, "sync:10", "hang-async:20")
    assert sorted(p.name for p in (run / "step_20").iterdir()) == ["__0_0.distcp", "__1_0.distcp"]
    latest, [skip] = await store.latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "step_10"
    assert skip.checkpoint_id == "step_20" and skip.why.startswith("no .metadata: the save did not finish")
    assert not dcp_loads(run / "step_20") and dcp_loads(run / "step_10")


def test_metadata_that_is_not_dcp_or_not_whole_is_named_unreadable(saved, tmp_path):
    run = copy_of(saved, tmp_path)
    metadata = run / "step_20" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:200])
    assert (why_incomplete(run / "step_20") or "").startswith(".metadata unreadable: not a readable pickle")
    metadata.write_bytes(b"\x80\x04K\x05.")  # the pickle of 5
    assert why_incomplete(run / "step_20") == ".metadata unreadable: no storage_data: not a DCP checkpoint's metadata"
