"""What every checkpoint adapter answers, and the one search they all share.

An adapter lists a run directory's checkpoints cheaply (names, steps, times, and each one's
fingerprint: the name, size and mtime of every file in it) and verifies one checkpoint at a time,
saying why when it is incomplete. The search verifies the newest first and stops at the first
complete one; a verdict is kept for as long as the checkpoint's fingerprint is unchanged, so a
poll never re-reads a multi-GB checkpoint it has already judged.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from contracts.models import CheckpointFormat
from trainer.checkpoint import BEING_WRITTEN

# A file's name (relative to the checkpoint), size, mtime, ctime and inode; sorted. ctime moves
# whenever a file is written or its times are set (a copy that keeps size and mtime changes it).
Fingerprint = tuple[tuple[str, int, int, int, int], ...]
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")


@dataclass(frozen=True)
class Candidate:
    """A checkpoint as listed, not yet verified."""

    checkpoint_id: str
    path: Path
    step: int | None
    written_at: datetime
    being_written: bool = False  # a temporary name: incomplete whatever it holds
    judged_with: tuple[Path, ...] = ()  # files outside it its verdict reads (a tracker file)


@dataclass(frozen=True)
class Verdict:
    candidate: Candidate
    why_incomplete: str | None  # None: complete
    step: int | None = None  # what the checkpoint itself says, where it says (else the listing's)
    train_seconds: float | None = None
    written_at: datetime | None = None  # a better time than the listing's, where the checkpoint keeps one

    @property
    def complete(self) -> bool:
        return self.why_incomplete is None and self.resolved_step is not None

    @property
    def resolved_step(self) -> int | None:
        return self.step if self.step is not None else self.candidate.step

    @property
    def resolved_written_at(self) -> datetime:
        return self.written_at or self.candidate.written_at

    @property
    def why(self) -> str | None:
        if self.why_incomplete is None and self.resolved_step is None:
            return "no step in its name or contents"
        return self.why_incomplete


class Adapter(Protocol):
    name: CheckpointFormat

    def detect(self, run_dir: Path) -> bool:
        """Whether the directory holds checkpoints of this format (a cheap look at names only)."""
        ...

    def candidates(self, run_dir: Path) -> list[Candidate]:
        """Every checkpoint in the directory, complete or not, without reading their contents."""
        ...

    def verify(self, candidate: Candidate) -> Verdict:
        """Whether the checkpoint is complete (and why not), without hashing its payload."""
        ...


class VerdictCache:
    """Verdicts by checkpoint path, valid while the checkpoint's files are as they were (LRU-bounded)."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._verdicts: OrderedDict[tuple[str, str], tuple[Fingerprint, Verdict]] = OrderedDict()
        self.verified = 0  # how many verifications ran (the rest came from the cache)

    def verdict(self, adapter: Adapter, candidate: Candidate) -> Verdict:
        key = (adapter.name.value, str(candidate.path))
        now = fingerprint(candidate.path) + tuple(f for p in candidate.judged_with for f in fingerprint(p))
        kept = self._verdicts.get(key)
        if kept is not None and kept[0] == now and kept[1].candidate == candidate:
            self._verdicts.move_to_end(key)
            return kept[1]
        try:
            verdict = adapter.verify(candidate)
        except Exception as error:  # noqa: BLE001 (a file no adapter foresaw is an unreadable checkpoint)
            verdict = Verdict(candidate, f"unreadable ({type(error).__name__}: {error})"[:500])
        self.verified += 1
        self._verdicts[key] = (now, verdict)
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > self._size:
            self._verdicts.popitem(last=False)
        return verdict


def newest_complete(
    adapter: Adapter, run_dir: Path, cache: VerdictCache, created_before: datetime | None = None
) -> tuple[Verdict | None, list[Verdict]]:
    """The newest complete checkpoint, and the incomplete ones newer than it (newest first).

    Checkpoints being written count as newer whatever their step. With ``created_before``, a
    checkpoint written at or after it is left out (the listing's time: its last file's).
    """
    listed = [c for c in adapter.candidates(run_dir) if created_before is None or c.written_at < created_before]
    writing = [c for c in listed if c.being_written]
    skipped = [
        Verdict(c, BEING_WRITTEN) for c in sorted(writing, key=lambda c: (c.step or 0, c.written_at), reverse=True)
    ]
    for candidate in _newest_first([c for c in listed if not c.being_written], adapter, cache):
        verdict = cache.verdict(adapter, candidate)
        if created_before is not None and verdict.resolved_written_at >= created_before:
            continue
        if verdict.complete:
            return verdict, skipped
        skipped.append(verdict)
    return None, skipped


def complete_written(
    adapter: Adapter,
    run_dir: Path,
    cache: VerdictCache,
    after: datetime | None = None,
    before: datetime | None = None,
) -> list[Verdict]:
    """The complete checkpoints written after `after` and before `before` (either open), newest first."""

    def within(at: datetime) -> bool:
        return (after is None or at > after) and (before is None or at < before)

    listed = [c for c in adapter.candidates(run_dir) if not c.being_written and within(c.written_at)]
    verdicts = [cache.verdict(adapter, c) for c in _newest_first(listed, adapter, cache)]
    return [v for v in verdicts if v.complete and within(v.resolved_written_at)]


def _newest_first(candidates: list[Candidate], adapter: Adapter, cache: VerdictCache) -> list[Candidate]:
    """By step, highest first. A checkpoint whose name has no step (Lightning's last.ckpt) is read
    for it first (its verdict is kept); at an equal step, the one named with its step comes first
    (last.ckpt is rewritten in place), then the newer."""

    def order(c: Candidate) -> tuple[bool, int, bool, datetime]:
        step = c.step if c.step is not None else cache.verdict(adapter, c).resolved_step
        return (step is not None, step or 0, c.step is not None, c.written_at)

    return sorted(candidates, key=order, reverse=True)


# --- helpers the adapters share -----------------------------------------------------------------


def fingerprint(path: Path) -> Fingerprint:
    """Every file under `path` (or `path` itself, a file) with its size and mtime: stat only."""
    try:
        if not path.is_dir():
            st = path.stat()
            return ((path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino),)
    except FileNotFoundError:
        return ()
    found = []
    for folder, _, files in os.walk(path):
        for name in files:
            file = Path(folder, name)
            try:
                st = file.stat()
            except FileNotFoundError:
                continue
            found.append((str(file.relative_to(path)), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(sorted(found))


def mtime(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    except FileNotFoundError:
        return None


def step_in_name(name: str) -> int | None:
    """The last number in a checkpoint's name: step_100, checkpoint-100, iter_0000100, 100."""
    found = _LAST_NUMBER.search(name)
    return int(found[1]) if found else None


def subdirectories(run_dir: Path) -> list[Path]:
    try:
        return [child for child in run_dir.iterdir() if child.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
