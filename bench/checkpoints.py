"""Reading a job's checkpoints as the controller polls them: the latest complete checkpoint of a run
directory of many large checkpoints, by the checkpoint store (newest first, each verdict kept while
the checkpoint's files are unchanged), against the search it replaced (trainer.checkpoint's
find_latest_complete, which verifies every checkpoint, hashes and all, on every poll), same
directory, same run. No service: files only (the page cache holds them, so the baseline is
hashing, not disk).
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from backends.checkpoints import CheckpointStore
from bench.table import Row, goal, median, row
from trainer.checkpoint import find_latest_complete, save_checkpoint


@dataclass
class CheckpointsResult:
    count: int
    megabytes: int
    baseline: list[float]  # seconds per poll, find_latest_complete
    first: list[float]  # the store's first poll (the newest checkpoint verified)
    steady: list[float]  # the store's later polls (nothing changed: from its verdicts)
    verifications: int  # checkpoints the store verified over every poll

    def rows(self) -> list[Row]:
        what = f"latest complete checkpoint of {self.count} checkpoints x {self.megabytes} MB"
        baseline = (median(self.baseline) or 0.0) * 1000
        polls = (
            ("first poll", self.first, "ratio <= 0.1", "10x faster", 1),
            ("a later poll, nothing changed", self.steady, "ratio <= 0.01", "100x faster", 2),
        )
        return [
            row(
                f"{what}: {poll} (baseline: verify every one)",
                (median(times) or 0.0) * 1000,
                "ms",
                baseline,
                goal(bound, note=note),
                digits=digits,
            )
            for poll, times, bound, note, digits in polls
        ]

    def details(self) -> str:
        return (
            f"  {len(self.baseline)} poll(s) each; the store verified {self.verifications} checkpoint(s) in all\n"
            f"  baseline (s): {[round(s, 3) for s in self.baseline]}\n"
            f"  first (s): {[round(s, 4) for s in self.first]}; later (s): {[round(s, 5) for s in self.steady]}"
        )


async def run(runs: int, quick: bool) -> CheckpointsResult:
    count, megabytes = (20, 2) if quick else (50, 8)
    with tempfile.TemporaryDirectory(prefix="bench-checkpoints-") as tmp:
        run_dir = Path(tmp)
        for step in range(1, count + 1):
            save_checkpoint(run_dir, step * 10, step * 1.0, {"model.bin": secrets.token_bytes(megabytes << 20)})
        result = CheckpointsResult(count, megabytes, [], [], [], 0)
        for _ in range(runs):
            result.baseline.append(await asyncio.to_thread(_timed, lambda: find_latest_complete(run_dir)))
            store = CheckpointStore()
            result.first.append(await _timed_async(store, run_dir))
            result.steady.extend([await _timed_async(store, run_dir) for _ in range(5)])
            result.verifications += store.verifications
        return result


def _timed(work) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


async def _timed_async(store: CheckpointStore, run_dir: Path) -> float:
    started = time.perf_counter()
    latest, _ = await store.latest_complete(str(run_dir))
    elapsed = time.perf_counter() - started
    assert latest is not None, "the benchmark's checkpoints are all complete"
    return elapsed
