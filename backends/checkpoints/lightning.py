"""Lightning: `*.ckpt` files (ModelCheckpoint's, such as `epoch=0-step=100.ckpt` and `last.ckpt`)
anywhere under the job's checkpoint directory (`lightning_logs/version_N/checkpoints/` by default).

Lightning writes a checkpoint whole and renames it into place (cloud_io._atomic_save, through an
fsspec transaction), so a `.ckpt` is either whole or left by something else; whole means a
`torch.save` archive whose entries all lie within the file. The step is the name's `step=N`, else
the `global_step` the checkpoint holds (read without PyTorch).
"""

from __future__ import annotations

import re
from pathlib import Path

from backends.checkpoints.formats import Candidate, Verdict, mtime
from backends.checkpoints.payload import ARCHIVE_ERRORS, torch_archive_object, torch_archive_problem
from contracts.models import CheckpointFormat

SUFFIX = ".ckpt"
_STEP = re.compile(r"step=(\d+)")
# how deep under the checkpoint directory to look: lightning_logs/version_N/checkpoints/x.ckpt
_DEPTH = 4


def _ckpt_files(run_dir: Path) -> list[Path]:
    found = []
    for depth in range(_DEPTH):
        found += [p for p in run_dir.glob("/".join(["*"] * depth + [f"*{SUFFIX}"])) if p.is_file()]
    return found


class LightningCheckpoints:
    name = CheckpointFormat.LIGHTNING

    def detect(self, run_dir: Path) -> bool:
        return bool(_ckpt_files(run_dir))

    def candidates(self, run_dir: Path) -> list[Candidate]:
        found = []
        for path in _ckpt_files(run_dir):
            named = _STEP.search(path.name)
            written_at = mtime(path)
            if written_at is not None:
                checkpoint_id = str(path.relative_to(run_dir))
                found.append(Candidate(checkpoint_id, path, int(named[1]) if named else None, written_at))
        return found

    def verify(self, candidate: Candidate) -> Verdict:
        problem = torch_archive_problem(candidate.path)
        if problem or candidate.step is not None:
            return Verdict(candidate, problem)
        try:
            held = torch_archive_object(candidate.path)
        except (*ARCHIVE_ERRORS, KeyError, StopIteration) as error:
            return Verdict(candidate, f"unreadable ({type(error).__name__}: {error})")
        step = held.get("global_step") if isinstance(held, dict) else None
        return Verdict(candidate, None, step=step if isinstance(step, int) else None)
