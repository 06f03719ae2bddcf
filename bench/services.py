"""The services a benchmark run needs, started fresh on 127.0.0.1 and always stopped."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU time the whole machine has spent busy (all processes), from /proc/stat."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it listened")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {seconds:.0f} s")


@contextmanager
def process(argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> Iterator[subprocess.Popen]:
    """A process logging to `log`, stopped on exit (SIGTERM, then SIGKILL after 20 s)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# sqlite in WAL mode with synchronous=NORMAL: a commit appends to the log instead of syncing the
# database and its rollback journal (sqlite's default), which costs the dev server twice the CPU per
# signal (measured by the storm). A commit survives a crash of any process; only an OS crash or a
# power loss can lose the last ones.
SQLITE_WAL = ("journal_mode=wal", "synchronous=normal")


@contextmanager
def temporal_dev_server(
    workdir: Path, sqlite_pragmas: tuple[str, ...] | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A fresh Temporal dev server; yields (process, address). In memory by default; with
    sqlite_pragmas (empty: sqlite's defaults), on a new sqlite file in workdir, as the local stack
    keeps its state."""
    port = free_port()
    argv = [
        str(BIN / "temporal"),
        "server",
        "start-dev",
        "--headless",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
    ]
    if sqlite_pragmas is not None:
        argv += ["--db-filename", str(workdir / f"temporal-{port}.db")]
        argv += [arg for pragma in sqlite_pragmas for arg in ("--sqlite-pragma", pragma)]
    with process(argv, dict(os.environ), workdir / "temporal.log") as proc:
        _wait_for_port(port, proc, "the Temporal dev server")
        yield proc, f"127.0.0.1:{port}"


@contextmanager
def hook_server(workdir: Path, temporal_address: str, token: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """`recovery hooks`, configured as documented, except that secondary alerts are not held: no
    worker runs here, so no incident ever finds its jobs and a held alert could only ever go to its
    own node's incident, where it goes at once (docs/alert-hooks.md, "Performance"). Yields
    (process, port)."""
    port = free_port()
    env = dict(os.environ) | {
        "TEMPORAL_ADDRESS": temporal_address,
        "RECOVERY_TASK_QUEUE": "bench",
        "RECOVERY_HOOKS_HOST": "127.0.0.1",
        "RECOVERY_HOOKS_PORT": str(port),
        "RECOVERY_HOOKS_TOKEN": token,
        "RECOVERY_HOOKS_CORRELATION_HOLD_SECONDS": os.environ.get("RECOVERY_HOOKS_CORRELATION_HOLD_SECONDS", "0"),
        # The storm's nodes are made up: no cluster has them, even where SLURM_CONF is exported.
        "RECOVERY_HOOKS_INVENTORY": os.environ.get("RECOVERY_HOOKS_INVENTORY", "off"),
    }
    with process([str(BIN / "recovery"), "hooks"], env, workdir / "hooks.log") as proc:
        _wait_for_port(port, proc, "recovery hooks")
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).raise_for_status()
        yield proc, port
