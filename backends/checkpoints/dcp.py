"""PyTorch Distributed Checkpoint (torch.distributed.checkpoint, `save` and `async_save` with the
file system writer): one directory per checkpoint, named with its step (step_100, step-100, 100),
holding every rank's shards (`__<rank>_<n>.distcp`) and `.metadata`.

The coordinator writes `.metadata` last, once every rank has written its shards (FileSystemWriter
.finish, through `.metadata.tmp` renamed into place), so a save that died midway has shards and no
`.metadata`. `.metadata` maps every saved item to a shard file, an offset and a length: each file
it names must exist and reach the end of the last item in it. Read without PyTorch (pickled.py).
"""

from __future__ import annotations

from pathlib import Path

from backends.checkpoints import pickled
from backends.checkpoints.formats import Candidate, Verdict, mtime, step_in_name, subdirectories
from contracts.models import CheckpointFormat

METADATA = ".metadata"
SHARD_SUFFIX = ".distcp"


def is_dcp_dir(directory: Path) -> bool:
    try:
        return any(p.name == METADATA or p.name.endswith(SHARD_SUFFIX) for p in directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False


def shard_sizes_needed(metadata: bytes) -> dict[str, int]:
    """Each shard file `.metadata` names, and the size it must have at least."""
    tree = pickled.load(metadata)
    storage = tree.field("storage_data") if isinstance(tree, pickled.Stub) else None
    if not isinstance(storage, dict):
        raise ValueError("no storage_data: not a DCP checkpoint's metadata")
    needed: dict[str, int] = {}
    for info in storage.values():
        path, offset, length = (info.field(k) if isinstance(info, pickled.Stub) else None for k in _STORAGE_INFO)
        if not isinstance(path, str) or not isinstance(offset, int) or not isinstance(length, int):
            raise ValueError(f"a storage entry ({type(info).__name__}) without relative_path, offset and length")
        needed[path] = max(needed.get(path, 0), offset + length)
    return needed


_STORAGE_INFO = ("relative_path", "offset", "length")


def why_incomplete(directory: Path) -> str | None:
    """None when the DCP checkpoint in `directory` is whole, else why it is not."""
    try:
        metadata = (directory / METADATA).read_bytes()
    except FileNotFoundError:
        shards = sorted(p.name for p in directory.glob(f"*{SHARD_SUFFIX}"))
        return (
            f"no {METADATA}: the save did not finish (the coordinator writes it last; "
            f"{len(shards)} shard file(s) written)"
        )
    try:
        needed = shard_sizes_needed(metadata)
    except ValueError as error:
        return f"{METADATA} unreadable: {error}"
    for name, size in sorted(needed.items()):
        try:
            actual = (directory / name).stat().st_size
        except FileNotFoundError:
            return f"{METADATA} names missing shard {name}"
        if actual < size:
            return f"shard {name} truncated: {actual} bytes, {METADATA} needs {size}"
    return None


class DcpCheckpoints:
    name = CheckpointFormat.DCP

    def detect(self, run_dir: Path) -> bool:
        return any(is_dcp_dir(d) for d in subdirectories(run_dir) if not d.name.startswith("."))

    def candidates(self, run_dir: Path) -> list[Candidate]:
        found = []
        for directory in subdirectories(run_dir):
            if directory.name.startswith(".") or not is_dcp_dir(directory):
                continue  # a hidden directory is no checkpoint (a job's own set-aside, say)
            written_at = mtime(directory / METADATA) or mtime(directory)
            if written_at is not None:
                found.append(Candidate(directory.name, directory, step_in_name(directory.name), written_at))
        return found

    def verify(self, candidate: Candidate) -> Verdict:
        return Verdict(candidate, why_incomplete(candidate.path))
