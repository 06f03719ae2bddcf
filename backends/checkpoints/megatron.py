"""Megatron-LM (and NeMo's Megatron-style saves): `iter_NNNNNNN/` directories beside
`latest_checkpointed_iteration.txt`.

Megatron writes the tracker file last, after every rank has saved (for an async save, when the
save is finalized), so an iteration newer than the tracker's is incomplete whatever it holds. An
iteration holds either a distributed checkpoint (`torch_dist`: DCP's `.metadata` and shards, see
dcp.py) or the legacy layout, a `torch.save` archive per model-parallel rank
(`mp_rank_XX[_YYY]/model_optim_rng.pt`); each must be whole.
"""

from __future__ import annotations

import re
from pathlib import Path

from backends.checkpoints import dcp
from backends.checkpoints.formats import Candidate, Verdict, mtime, subdirectories
from backends.checkpoints.payload import torch_archive_problem
from contracts.models import CheckpointFormat

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
_ITERATION = re.compile(r"iter_(\d+)")


def tracked_iteration(run_dir: Path) -> int | str | None:
    """The tracker's iteration; "release" for a released model; None when there is no tracker."""
    try:
        text = (run_dir / TRACKER).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else text


def _layout_problem(directory: Path) -> str | None:
    if dcp.is_dcp_dir(directory):
        return dcp.why_incomplete(directory)
    ranks = sorted(directory.glob(f"mp_rank_*/{RANK_FILE}"))
    if not ranks:
        return f"neither a distributed checkpoint (.metadata) nor mp_rank_*/{RANK_FILE}"
    return next((f"{p.parent.name}/{problem}" for p in ranks if (problem := torch_archive_problem(p))), None)


class MegatronCheckpoints:
    name = CheckpointFormat.MEGATRON

    def detect(self, run_dir: Path) -> bool:
        return (run_dir / TRACKER).exists() or any(_ITERATION.fullmatch(d.name) for d in subdirectories(run_dir))

    def candidates(self, run_dir: Path) -> list[Candidate]:
        found = []
        for directory in subdirectories(run_dir):
            named = _ITERATION.fullmatch(directory.name)
            # its files' newest time: rewriting a rank's file in place leaves the directory's as it was
            times = [
                t for f in [directory / dcp.METADATA, *directory.glob(f"mp_rank_*/{RANK_FILE}")] if (t := mtime(f))
            ]
            written_at = max(times, default=None) or mtime(directory)
            if named and written_at is not None:
                found.append(
                    Candidate(directory.name, directory, int(named[1]), written_at, judged_with=(run_dir / TRACKER,))
                )
        return found

    def verify(self, candidate: Candidate) -> Verdict:
        tracked = tracked_iteration(candidate.path.parent)
        if tracked is None:
            return Verdict(candidate, f"no {TRACKER}: no save has finished (Megatron writes it last)")
        if not isinstance(tracked, int):
            return Verdict(candidate, f"{TRACKER} says {tracked!r}, not an iteration")
        if candidate.step is not None and candidate.step > tracked:
            return Verdict(candidate, f"newer than {TRACKER} ({tracked}): the save did not finish")
        return Verdict(candidate, _layout_problem(candidate.path))
