"""A damaged or hostile file in a checkpoint gives that checkpoint a reason, never an exception:
the search goes on to the one before (an exception would fail the activity on every retry)."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import pytest

from backends.checkpoints import CheckpointStore, detect_format
from backends.checkpoints.formats import Candidate, VerdictCache
from backends.checkpoints.payload import safetensors_problem, torch_archive_problem
from backends.checkpoints.reference import ReferenceCheckpoints
from contracts.models import CheckpointFormat


def safetensors(path: Path, header: object, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    "header",
    [
        [1, 2],
        {"w": {"dtype": "F32"}},
        {"w": {"data_offsets": [0]}},
        {"w": {"data_offsets": ["0", "4"]}},
        {"w": 7},
    ],
)
def test_a_malformed_safetensors_header_is_a_reason(tmp_path, header):
    problem = safetensors_problem(safetensors(tmp_path / "model.safetensors", header))
    assert problem == "model.safetensors header unreadable (not a map of tensors with two integer data_offsets each)"


def test_a_whole_safetensors_file_passes_and_a_short_one_is_truncated(tmp_path):
    header = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    assert safetensors_problem(safetensors(tmp_path / "a.safetensors", header, b"x" * 8)) is None
    assert "truncated" in (safetensors_problem(safetensors(tmp_path / "b.safetensors", header, b"x" * 4)) or "")


async def test_a_checkpoint_whose_pickle_zipfile_cannot_read_is_a_reason(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"  # no step in the name: its data.pkl is read for it
    path.parent.mkdir()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x04K\x05.")
    data = bytearray(path.read_bytes())
    central = data.rfind(b"PK\x01\x02")
    data[central + 10 : central + 12] = struct.pack("<H", 99)  # compression method 99 (AES): unsupported
    path.write_bytes(bytes(data))
    assert torch_archive_problem(path) is None  # its directory is whole
    latest, [skip] = await CheckpointStore().latest_complete(str(tmp_path), fmt=CheckpointFormat.LIGHTNING)
    assert latest is None and skip.why.startswith("unreadable (NotImplementedError: ")


async def test_a_shard_index_naming_no_plain_file_is_a_reason_and_the_one_before_is_found(tmp_path):
    run = tmp_path / "run"
    for step, shards in ((10, ["model-1.safetensors"]), (20, [7])):
        checkpoint = run / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shards[0]}}))
        safetensors(checkpoint / "model-1.safetensors", {"w": {"data_offsets": [0, 4]}}, b"abcd")
    latest, [skip] = await CheckpointStore().latest_complete(str(run))
    assert latest is not None and latest.checkpoint_id == "checkpoint-10"
    assert skip.why == "model.safetensors.index.json names a shard that is not a plain file name"


def test_an_adapter_that_raises_gives_an_unreadable_verdict(tmp_path, monkeypatch):
    def explode(self, candidate):  # type: ignore[no-untyped-def]
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(ReferenceCheckpoints, "verify", explode)
    candidate = Candidate("step-000000010", tmp_path, 10, __import__("datetime").datetime.now())
    verdict = VerdictCache().verdict(ReferenceCheckpoints(), candidate)
    assert not verdict.complete and verdict.why == "unreadable (RecursionError: maximum recursion depth exceeded)"


def test_a_progress_record_does_not_make_a_dcp_directory_the_reference_format(tmp_path):
    (tmp_path / "step_10").mkdir()
    (tmp_path / "step_10" / "__0_0.distcp").write_bytes(b"")
    (tmp_path / "progress.json").write_text("{}")
    assert detect_format(tmp_path) is CheckpointFormat.DCP


def test_a_hidden_directory_is_no_dcp_checkpoint(tmp_path):
    """The PyTorch job sets a save that did not load aside as .unloadable-step_N-<time>: its digits
    must not make it the newest checkpoint."""
    from backends.checkpoints.dcp import DcpCheckpoints

    for name in ("step_10", ".unloadable-step_20-1796469358931393085"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"")
    assert [c.checkpoint_id for c in DcpCheckpoints().candidates(tmp_path)] == ["step_10"]
