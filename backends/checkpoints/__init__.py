"""Read a job's checkpoints, progress and resume records from its checkpoint directory.

Checkpoints come in the layouts the frameworks write (one adapter each: the reference trainer's,
PyTorch DCP, Hugging Face Trainer, Lightning, Megatron); the job's comment names its format
(`checkpoint_format=dcp`), else it is detected from the directory. Progress and resume records are
the small JSON files of `trainer.checkpoint`, which any job can write without this project's code
(docs/checkpoints.md). Blocking file I/O runs in a thread.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError

from backends.checkpoints.dcp import DcpCheckpoints
from backends.checkpoints.formats import (
    Adapter,
    Verdict,
    VerdictCache,
    complete_written,
    newest_complete,
)
from backends.checkpoints.hf_trainer import HfTrainerCheckpoints
from backends.checkpoints.lightning import LightningCheckpoints
from backends.checkpoints.megatron import MegatronCheckpoints
from backends.checkpoints.reference import ReferenceCheckpoints
from contracts.models import CheckpointFormat, CheckpointRef, JobProgress, ResumeRecord, SkippedCheckpoint
from trainer import checkpoint as ckpt

# In the order detection tries them: a Megatron directory holds DCP shards, so Megatron goes first
ADAPTERS: dict[CheckpointFormat, Adapter] = {
    a.name: a
    for a in (
        ReferenceCheckpoints(),
        MegatronCheckpoints(),
        HfTrainerCheckpoints(),
        LightningCheckpoints(),
        DcpCheckpoints(),
    )
}


def detect_format(run_dir: Path) -> CheckpointFormat:
    """The format of the checkpoints in `run_dir`; the reference trainer's when none is recognised."""
    return next((name for name, adapter in ADAPTERS.items() if adapter.detect(run_dir)), CheckpointFormat.REFERENCE)


class CheckpointStore:
    def __init__(self, default_format: CheckpointFormat | None = None) -> None:
        """`default_format`: the format of a job whose comment names none (else it is detected)."""
        self._verdicts = VerdictCache()
        self._default_format = default_format

    def format_of(self, run_dir: Path, fmt: CheckpointFormat | None) -> CheckpointFormat:
        return fmt or self._default_format or detect_format(run_dir)

    @property
    def verifications(self) -> int:
        """How many checkpoints were verified (not answered from the cache) since the store began."""
        return self._verdicts.verified

    async def latest_complete(
        self, run_dir: str, created_before: datetime | None = None, fmt: CheckpointFormat | None = None
    ) -> tuple[CheckpointRef | None, list[SkippedCheckpoint]]:
        return await asyncio.to_thread(self._latest_complete, Path(run_dir), created_before, fmt)

    def _latest_complete(
        self, run_dir: Path, created_before: datetime | None, fmt: CheckpointFormat | None
    ) -> tuple[CheckpointRef | None, list[SkippedCheckpoint]]:
        name = self.format_of(run_dir, fmt)
        found, skipped = newest_complete(ADAPTERS[name], run_dir, self._verdicts, created_before)
        return (
            _ref(found, name) if found else None,
            [SkippedCheckpoint(checkpoint_id=s.candidate.checkpoint_id, why=s.why or "") for s in skipped],
        )

    async def written_after(
        self, run_dir: str, after: datetime, fmt: CheckpointFormat | None = None
    ) -> list[CheckpointRef]:
        """The complete checkpoints written after `after`, newest first: what a restarted job wrote."""
        return await self._complete(run_dir, fmt, after=after)

    async def complete_before(
        self, run_dir: str, before: datetime, fmt: CheckpointFormat | None = None
    ) -> list[CheckpointRef]:
        """Every complete checkpoint written before `before`, newest first (each verified once)."""
        return await self._complete(run_dir, fmt, before=before)

    async def _complete(self, run_dir: str, fmt: CheckpointFormat | None, **bounds: datetime) -> list[CheckpointRef]:
        def listed() -> list[CheckpointRef]:
            name = self.format_of(Path(run_dir), fmt)
            return [_ref(v, name) for v in complete_written(ADAPTERS[name], Path(run_dir), self._verdicts, **bounds)]

        return await asyncio.to_thread(listed)

    async def progress(self, run_dir: str) -> JobProgress | None:
        """The job's progress record; None when it has none or it does not read as one."""
        raw = await asyncio.to_thread(ckpt.read_progress, Path(run_dir))
        try:
            return JobProgress.model_validate(raw) if raw else None
        except ValidationError:
            return None

    async def resume_records(self, run_dir: str) -> list[ResumeRecord]:
        """The job's resume records, oldest first; a line that does not read as one is left out, as a
        torn line is (a job's own typo must not stop its verification: it is then judged without it)."""
        raws = await asyncio.to_thread(ckpt.read_resume_records, Path(run_dir))
        records = []
        for raw in raws:
            try:
                records.append(ResumeRecord.model_validate(raw))
            except ValidationError:
                continue
        return records


def _ref(verdict: Verdict, fmt: CheckpointFormat) -> CheckpointRef:
    assert verdict.resolved_step is not None  # a complete verdict has its step
    return CheckpointRef(
        checkpoint_id=verdict.candidate.checkpoint_id,
        step=verdict.resolved_step,
        train_seconds=verdict.train_seconds,
        created_at=verdict.resolved_written_at,
        checkpoint_format=fmt,
    )
