"""Real DCP checkpoints for the adapter tests: a 2-rank gloo group (two processes, as a 2-node job
has) saves a small DDP model and its AdamW state with `dcp.save` and `dcp.async_save`.

Run as a script: `python -m tests.checkpoints.dcp_writer RUN_DIR INIT_FILE RANK SPEC...`, where each
SPEC is `sync:STEP`, `async:STEP` or `hang-async:STEP` (an async save whose coordinator never gets
to write `.metadata`: the process is killed with the save in flight)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel

WORLD_SIZE = 2
HANGING = "hanging"  # printed once the hanging save's shards are written


class _NeverFinishingWriter(dcp.FileSystemWriter):
    """Writes every shard, then stops before `.metadata`, as a save cut off by a crash does."""

    def finish(self, metadata, results) -> None:  # type: ignore[no-untyped-def]
        print(HANGING, flush=True)
        time.sleep(3600)


def state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optimizer_state, "step": torch.tensor(step)}


def main(run_dir: Path, init_file: str, rank: int, specs: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    for spec in specs:
        kind, step = spec.split(":")
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        target = str(run_dir / f"step_{step}")
        if kind == "sync":
            dcp.save(state(model, optimizer, int(step)), checkpoint_id=target)
        elif kind == "async":
            dcp.async_save(state(model, optimizer, int(step)), checkpoint_id=target).result()
        else:
            writer = _NeverFinishingWriter(target)
            dcp.async_save(state(model, optimizer, int(step)), storage_writer=writer).result()
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    # After an async_save, destroy_process_group or the interpreter's exit hung in 2 of 5 runs here
    # (torch 2.13, in native code, every file already written and synced): leave without them.
    sys.stdout.flush()
    os._exit(0)
