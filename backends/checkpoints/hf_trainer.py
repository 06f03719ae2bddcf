"""Hugging Face Trainer: `checkpoint-<step>/` directories in the output directory.

Trainer._save_checkpoint writes the model (model.safetensors, or shards with their index), then the
optimizer, scheduler, scaler and RNG states (torch.save archives), and trainer_state.json last; so
a checkpoint is complete when trainer_state.json parses with its global_step and every weights
file it needs is whole. `tmp-checkpoint-<step>` (written then renamed by some releases) is being
written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from backends.checkpoints.formats import Candidate, Verdict, mtime, subdirectories
from backends.checkpoints.payload import safetensors_problem, torch_archive_problem
from contracts.models import CheckpointFormat

TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"(tmp-)?checkpoint-(\d+)")
# the weights, by the name Trainer.save_model gives them (a PEFT adapter's, the model's, sharded or not)
_SINGLE_WEIGHTS = ("adapter_model.safetensors", "model.safetensors", "adapter_model.bin", "pytorch_model.bin")
_SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_STATES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth")


def _file_problem(path: Path) -> str | None:
    return safetensors_problem(path) if path.suffix == ".safetensors" else torch_archive_problem(path)


def _weights_problem(directory: Path) -> str | None:
    for index_name in _SHARD_INDEXES:
        index = directory / index_name
        if index.exists():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError, TypeError) as error:
                return f"{index_name} unreadable ({error})"
            if not all(isinstance(s, str) and s and "/" not in s for s in shards):
                return f"{index_name} names a shard that is not a plain file name"
            return next((p for p in (_file_problem(directory / s) for s in shards) if p), None)
    for name in _SINGLE_WEIGHTS:
        if (directory / name).exists():
            return _file_problem(directory / name)
    return f"no model weights ({' or '.join(_SINGLE_WEIGHTS[1::2])})"


class HfTrainerCheckpoints:
    name = CheckpointFormat.HF_TRAINER

    def detect(self, run_dir: Path) -> bool:
        return any(_CHECKPOINT.fullmatch(d.name) for d in subdirectories(run_dir))

    def candidates(self, run_dir: Path) -> list[Candidate]:
        found = []
        for directory in subdirectories(run_dir):
            named = _CHECKPOINT.fullmatch(directory.name)
            written_at = mtime(directory / TRAINER_STATE) or mtime(directory)
            if named and written_at is not None:
                found.append(
                    Candidate(directory.name, directory, int(named[2]), written_at, being_written=bool(named[1]))
                )
        return found

    def verify(self, candidate: Candidate) -> Verdict:
        directory = candidate.path
        try:
            state = json.loads((directory / TRAINER_STATE).read_text())
        except FileNotFoundError:
            return Verdict(candidate, f"no {TRAINER_STATE}: the save did not finish (Trainer writes it last)")
        except (OSError, ValueError) as error:
            return Verdict(candidate, f"{TRAINER_STATE} unreadable ({error})")
        step = state.get("global_step") if isinstance(state, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            return Verdict(candidate, f"{TRAINER_STATE} has no global_step")
        problem = _weights_problem(directory) or next(
            (p for p in (torch_archive_problem(directory / s) for s in _STATES if (directory / s).exists()) if p),
            None,
        )
        return Verdict(candidate, problem, step=step)
