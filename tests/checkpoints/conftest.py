from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.checkpoints import CheckpointStore
from tests.checkpoints.dcp_writer import HANGING, WORLD_SIZE

REPO = Path(__file__).resolve().parents[2]
DEADLINE_SECONDS = 120


def write_dcp(run_dir: Path, *specs: str) -> None:
    """Both ranks of a real 2-process gloo group save `specs` (see dcp_writer); a `hang-async`
    save last is cut off as a crash would: both processes are killed once its shards are written."""
    init_file = run_dir.parent / f".init-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.checkpoints.dcp_writer", str(run_dir), str(init_file), str(rank), *specs],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    try:
        if specs[-1].startswith("hang-async:"):
            line = ranks[0].stdout.readline() if ranks[0].stdout else ""
            assert line.strip() == HANGING, ranks[0].stderr.read() if ranks[0].stderr else line
            for rank in ranks:
                os.killpg(rank.pid, signal.SIGKILL)
        for rank in ranks:
            rank.wait(timeout=DEADLINE_SECONDS)
            if not specs[-1].startswith("hang-async:"):
                assert rank.returncode == 0, rank.stderr.read() if rank.stderr else rank.returncode
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)
                rank.wait()


@pytest.fixture
def store() -> CheckpointStore:
    return CheckpointStore()
