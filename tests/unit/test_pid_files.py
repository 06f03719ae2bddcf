"""A stale pid file names a process no more: after a reboot or once pids wrap around, its pid may
belong to an unrelated process, which the local stack must neither count as its own nor kill.
A process started after its pid file was written is not the one the file names."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from drills.localstack import SLURM_SCRIPT, _alive, _terminate


@pytest.fixture
def bystander() -> Iterator[int]:
    """The pid of an unrelated process (not this one's child: nothing here reaps it), killed after the test."""
    pid = int(
        subprocess.run(
            ["bash", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
        ).stdout
    )
    try:
        yield pid
    finally:
        if runs(pid):
            os.kill(pid, signal.SIGKILL)


def runs(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def ended(pid: int, within: float = 15) -> bool:
    deadline = time.monotonic() + within
    while runs(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def write_pid_file(path: Path, pid: int, age_seconds: float = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(pid))
    written = time.time() - age_seconds
    os.utime(path, (written, written))
    return path


def test_the_stack_counts_and_stops_the_process_its_pid_file_names(tmp_path, bystander):
    pidfile = write_pid_file(tmp_path / "worker.pid", bystander)
    assert _alive(pidfile)
    _terminate(pidfile)
    assert ended(bystander)
    assert not pidfile.exists()


def test_the_stack_leaves_alone_a_process_that_took_a_stale_pid_files_pid(tmp_path, bystander):
    pidfile = write_pid_file(tmp_path / "worker.pid", bystander, age_seconds=3600)
    assert not _alive(pidfile)
    _terminate(pidfile)
    assert runs(bystander), "an unrelated process was killed"
    assert not pidfile.exists()


def slurm_cluster(command: str, base: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_BASE": str(base), "SLURM_NODES": "1", "SLURM_SPARES": "0", "SLURM_ROOT": ""}
    return subprocess.run(["bash", str(SLURM_SCRIPT), command], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("age_seconds, counted", [(0, True), (3600, False)])
def test_the_slurm_cluster_script_counts_and_stops_only_its_own_processes(tmp_path, bystander, age_seconds, counted):
    write_pid_file(tmp_path / "run" / "munged.pid", bystander, age_seconds)
    assert ("munged: running" in slurm_cluster("status", tmp_path).stdout) is counted
    stopped = slurm_cluster("stop", tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    if counted:
        assert ended(bystander)
    else:
        assert runs(bystander), "an unrelated process was killed"
