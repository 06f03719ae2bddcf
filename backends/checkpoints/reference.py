"""The reference trainer's checkpoints (trainer.checkpoint): step-NNNNNNNNN/ directories, each
complete once its manifest.json, written last, parses and lists every file with its size and
sha256; .tmp-step-… directories are being written. The payload's hashes are checked once per
checkpoint (the verdict cache keeps the result while no file changes)."""

from __future__ import annotations

from pathlib import Path

from backends.checkpoints.formats import Candidate, Verdict, mtime, subdirectories
from contracts.models import CheckpointFormat
from trainer import checkpoint as ckpt


class ReferenceCheckpoints:
    name = CheckpointFormat.REFERENCE

    def detect(self, run_dir: Path) -> bool:
        # by its directories only: progress.json is a record any job may keep
        return any(ckpt.name_step(d.name) for d in subdirectories(run_dir))

    def candidates(self, run_dir: Path) -> list[Candidate]:
        found = []
        for directory in subdirectories(run_dir):
            named = ckpt.name_step(directory.name)
            written_at = mtime(directory / ckpt.MANIFEST_NAME) or mtime(directory)
            if named is not None and written_at is not None:
                found.append(Candidate(directory.name, directory, named[0], written_at, being_written=named[1]))
        return found

    def verify(self, candidate: Candidate) -> Verdict:
        checked = ckpt.checked_checkpoint(candidate.path)
        if isinstance(checked, str):
            return Verdict(candidate, checked)
        return Verdict(
            candidate, None, step=checked.step, train_seconds=checked.train_seconds, written_at=checked.created_at
        )
