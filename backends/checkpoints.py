"""Read a job's checkpoints, progress and resume records from its checkpoint directory.

The files are written by the job through `trainer.checkpoint` (the library jobs use), so the
controller reads them with the same code. Blocking file I/O runs in a thread.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path

from contracts.models import CheckpointRef, JobProgress, ResumeRecord, SkippedCheckpoint
from trainer import checkpoint as ckpt


class CheckpointStore:
    async def latest_complete(
        self, run_dir: str, created_before: datetime | None = None
    ) -> tuple[CheckpointRef | None, list[SkippedCheckpoint]]:
        found, skipped = await asyncio.to_thread(ckpt.find_latest_complete, Path(run_dir), created_before)
        ref = None
        if found is not None:
            ref = CheckpointRef(
                checkpoint_id=found.checkpoint_id,
                step=found.step,
                train_seconds=found.train_seconds,
                created_at=found.created_at,
            )
        return ref, [SkippedCheckpoint(checkpoint_id=s.checkpoint_id, why=s.why) for s in skipped]

    async def progress(self, run_dir: str) -> JobProgress | None:
        raw = await asyncio.to_thread(ckpt.read_progress, Path(run_dir))
        return JobProgress.model_validate(raw) if raw else None

    async def resume_records(self, run_dir: str) -> list[ResumeRecord]:
        raws = await asyncio.to_thread(ckpt.read_resume_records, Path(run_dir))
        return [ResumeRecord.model_validate(r) for r in raws]
