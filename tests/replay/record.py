"""Re-record the replay fixtures (tests/replay/histories) from real incidents on a local stack:

    .venv/bin/python -m tests.replay.record

Runs, one after the other, the game day scenarios and drills whose histories are kept (each with
`--save-history`; a history is written only when its drill verified), on a fresh local stack of
its own (state dir and ports below, or RECOVERY_STATE_DIR and RECOVERY_LOCAL_* as given), which it
takes down and removes afterwards: a fresh Temporal database keeps the fleet budget's history to
these incidents. Fixtures of the same names are overwritten: review the diff before committing,
and see docs/upgrades.md for when re-recording is right (never to make a replay failure go away for
a change that running incidents would meet).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.replay.replaying import REPLAY_BUILD_ID

HISTORIES = Path(__file__).parent / "histories"
RECOVERY = str(Path(sys.executable).parent / "recovery")
STACK = {
    "RECOVERY_STATE_DIR": "/tmp/training-recovery-replay-record",
    "RECOVERY_LOCAL_TEMPORAL_PORT": "7533",
    "RECOVERY_LOCAL_UI_PORT": "8533",
    "RECOVERY_LOCAL_SLURM_PORT_BASE": "19800",
    # The task queue the Replayer runs on: ids named after it, like the spare claims', replay as recorded.
    "RECOVERY_TASK_QUEUE": f"replay-{REPLAY_BUILD_ID}",
}
RECORDINGS = [
    ["--scenario", "xid79-fatal"],
    ["--scenario", "xid94-degrading"],
    ["--scenario", "xid13-application"],
    ["--scenario", "no-spare"],
    ["--scenario", "incomplete-checkpoint"],
    ["--dry-run"],
    ["--k8s"],
]


def main() -> int:
    env = {**os.environ, **{k: os.environ.get(k) or v for k, v in STACK.items()}}
    state = Path(env["RECOVERY_STATE_DIR"])

    def recovery(*args: str, **options) -> int:
        return subprocess.run([RECOVERY, *args], env=env, stdin=subprocess.DEVNULL, **options).returncode

    recovery("stack", "down", stdout=subprocess.DEVNULL)
    shutil.rmtree(state, ignore_errors=True)
    failed = []
    try:
        for args in RECORDINGS:
            print(f"recording: recovery drill {' '.join(args)}", file=sys.stderr, flush=True)
            if recovery("drill", *args, "--save-history", str(HISTORIES), stdout=subprocess.DEVNULL) != 0:
                failed.append(" ".join(args))
    finally:
        recovery("stack", "down", stdout=subprocess.DEVNULL)
        shutil.rmtree(state, ignore_errors=True)
    if failed:
        print(f"not verified, so not recorded: {'; '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
