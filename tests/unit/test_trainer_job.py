"""The reference training job, run as `python -m trainer.job` subprocesses (no Slurm needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from trainer.checkpoint import list_checkpoints, read_progress, read_resume_records
from trainer.job import FaultWatch, JobEnv, Log, expand_hostlist

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float = 10.0) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


class Job:
    """One trainer process, its run directory and its logs."""

    def __init__(self, proc: subprocess.Popen[bytes], run_dir: Path, stdout: Path, stderr: Path):
        self.proc = proc
        self.run_dir = run_dir
        self.stdout = stdout
        self.stderr = stderr

    def progress(self) -> dict[str, Any]:
        return read_progress(self.run_dir) or {}

    def wait_for_step(self, step: int) -> dict[str, Any]:
        return wait_for(f"step {step}", lambda: self.progress().get("step", -1) >= step)

    def wait_for_state(self, state: str) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            progress = self.progress()
            return progress if progress.get("state") == state else None

        return wait_for(f"state {state}", reached)

    def wait_exit(self, timeout: float = 10.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit within {timeout} s\n{self.logs()}") from None

    def complete_steps(self) -> list[int]:
        return [s.step for s in list_checkpoints(self.run_dir) if s.complete and s.step is not None]

    def logs(self) -> str:
        return f"stdout:\n{self.stdout.read_text()}\nstderr:\n{self.stderr.read_text()}"


class Jobs:
    """Starts trainer processes with a Slurm-like environment; kills what is left at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Job] = []

    def start(
        self,
        run_dir: Path,
        *args: str,
        restart_count: int | None = None,
        rank: int = 0,
        nodelist: str | None = None,
        node: str = "gpu-1",
    ) -> Job:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env.update(PYTHONPATH=str(REPO), SLURM_JOB_ID="4242", SLURMD_NODENAME=node)
        env["SLURM_PROCID"] = str(rank)
        if restart_count is not None:
            env["SLURM_RESTART_COUNT"] = str(restart_count)
        if nodelist is not None:
            env["SLURM_JOB_NODELIST"] = nodelist
        name = f"job-{len(self.started)}"
        stdout, stderr = self.tmp_path / f"{name}.out", self.tmp_path / f"{name}.err"
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.job", "--run-dir", str(run_dir), *args],
                env=env,
                cwd=REPO,
                stdout=out,
                stderr=err,
            )
        job = Job(proc, run_dir, stdout, stderr)
        self.started.append(job)
        return job

    def stop_all(self) -> None:
        for job in self.started:
            if job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait()


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    started = Jobs(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


# --- environment --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("gpu-1", ["gpu-1"]),
        ("gpu-[1-2,4]", ["gpu-1", "gpu-2", "gpu-4"]),
        ("a1,b[3-4]", ["a1", "b3", "b4"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
        ("gpu-[1-2],login", ["gpu-1", "gpu-2", "login"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["gpu-[1-2", "gpu-1]", "gpu-[a-b]"])
def test_expand_hostlist_rejects_malformed_lists(hostlist: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(hostlist)


def test_job_env_from_slurm_and_defaults() -> None:
    slurm = JobEnv.from_environ(
        {
            "SLURM_JOB_ID": "123",
            "SLURM_RESTART_COUNT": "2",
            "SLURM_PROCID": "1",
            "SLURMD_NODENAME": "gpu-2",
            "SLURM_JOB_NODELIST": "gpu-[1-2]",
        }
    )
    by_hand = JobEnv.from_environ({"SLURMD_NODENAME": "laptop"})

    assert slurm == JobEnv("123", 2, 1, "gpu-2", ["gpu-1", "gpu-2"])
    assert by_hand == JobEnv("local", 0, 0, "laptop", ["laptop"])


def test_fault_watch_reads_every_node_and_tolerates_a_half_written_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = JobEnv("123", 0, 0, "gpu-1", ["gpu-1", "gpu-2"])
    watch = FaultWatch(tmp_path, env.nodes, Log(env))
    (tmp_path / "gpu-1").write_text(json.dumps({"xid": 63, "gpu_lost": False}))
    (tmp_path / "gpu-2").write_text('{"xid": 79, "gpu_')

    assert watch.lost_gpu() is None
    assert watch.lost_gpu() is None
    (tmp_path / "gpu-2").write_text(json.dumps({"xid": 79, "gpu_lost": True}))
    lost = watch.lost_gpu()

    assert lost is not None and str(lost) == "GPU lost on gpu-2 (xid 79)"
    assert capsys.readouterr().err.count("fault file for gpu-2 unreadable") == 1
    assert FaultWatch(None, env.nodes, Log(env)).lost_gpu() is None


# --- the job ------------------------------------------------------------------------------------


def test_trains_checkpoints_prunes_and_finishes(jobs: Jobs, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ("--total-steps", "25", "--step-seconds", "0", "--checkpoint-every", "5", "--keep", "2")

    job = jobs.start(run_dir, *args)

    assert job.wait_exit() == 0, job.logs()
    assert job.complete_steps() == [20, 25]
    progress = job.progress()
    assert (progress["job_id"], progress["restart_count"], progress["step"]) == ("4242", 0, 25)
    assert progress["state"] == "exited"
    [record] = read_resume_records(run_dir)
    assert record["resumed_step"] is None and record["checkpoint_id"] is None
    assert record["previous_last_step"] is None and record["skipped_checkpoints"] == []
    assert (record["job_id"], record["restart_count"], record["host"]) == ("4242", 0, "gpu-1")
    assert "checkpoint step-000000025 (final" in job.stdout.read_text()


def test_other_ranks_train_but_write_nothing(jobs: Jobs, tmp_path: Path) -> None:
    job = jobs.start(tmp_path / "run", "--total-steps", "12", "--step-seconds", "0", rank=1)

    assert job.wait_exit() == 0, job.logs()
    assert not (tmp_path / "run").exists()


def test_sigusr1_adds_a_checkpoint_and_training_goes_on(jobs: Jobs, tmp_path: Path) -> None:
    # periodic checkpoints only every 1000 steps: any checkpoint before that is the emergency one
    job = jobs.start(tmp_path / "run", "--step-seconds", "0.02", "--checkpoint-every", "1000")
    job.wait_for_step(3)

    job.proc.send_signal(signal.SIGUSR1)

    [step] = wait_for("the emergency checkpoint", job.complete_steps)
    assert 3 <= step < 1000
    job.wait_for_step(step + 5)
    assert job.proc.poll() is None
    # repeated signals: harmless, one checkpoint per step boundary at most
    for _ in range(3):
        job.proc.send_signal(signal.SIGUSR1)
    wait_for("a second emergency checkpoint", lambda: len(job.complete_steps()) >= 2)
    job.wait_for_step(job.complete_steps()[-1] + 3)
    assert job.proc.poll() is None
    assert job.progress()["state"] == "running"
    assert "SIGUSR1: emergency checkpoint" in job.stdout.read_text()


def test_sigterm_checkpoints_then_exits_143(jobs: Jobs, tmp_path: Path) -> None:
    job = jobs.start(tmp_path / "run", "--step-seconds", "0.02", "--checkpoint-every", "1000")
    job.wait_for_step(3)

    job.proc.send_signal(signal.SIGTERM)
    job.proc.send_signal(signal.SIGTERM)

    assert job.wait_exit(5) == 143, job.logs()
    progress = job.progress()
    assert progress["state"] == "exited"
    assert job.complete_steps() == [progress["step"]]
    assert "SIGTERM: emergency checkpoint" in job.stdout.read_text()


def test_restart_resumes_from_the_latest_complete_checkpoint(jobs: Jobs, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ("--step-seconds", "0.01", "--checkpoint-every", "5")
    first = jobs.start(run_dir, *args)
    wait_for("two checkpoints", lambda: len(first.complete_steps()) >= 2)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait_exit() == 143, first.logs()
    last = first.progress()
    *_, resumable, newest = first.complete_steps()
    # the newest checkpoint broke after it was written, and a later one was never finished
    broken_model = run_dir / f"step-{newest:09d}" / "model.json"
    model_size = broken_model.stat().st_size
    broken_model.write_bytes(b"{}")
    unfinished = run_dir / f".tmp-step-{newest + 1:09d}-999-deadbeef"
    unfinished.mkdir()

    second = jobs.start(run_dir, *args, restart_count=1)

    wait_for("the restart's progress", lambda: second.progress().get("restart_count") == 1)
    records = read_resume_records(run_dir)
    assert [r["restart_count"] for r in records] == [0, 1]
    record = records[1]
    assert record["resumed_step"] == resumable
    assert record["checkpoint_id"] == f"step-{resumable:09d}"
    assert record["skipped_checkpoints"] == [
        {"checkpoint_id": unfinished.name, "why": "being written (temporary directory)"},
        {
            "checkpoint_id": f"step-{newest:09d}",
            "why": f"model.json truncated: 2 of {model_size} bytes",
        },
    ]
    assert record["previous_last_step"] == last["step"]
    assert record["previous_train_seconds"] == last["train_seconds"]
    assert 0 < record["resumed_train_seconds"] <= last["train_seconds"]
    assert (record["job_id"], record["host"]) == ("4242", "gpu-1")
    assert not unfinished.exists()
    second.wait_for_step(newest + 1)
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait_exit() == 143, second.logs()


def test_lost_gpu_stalls_the_job_and_term_exits_without_a_checkpoint(jobs: Jobs, tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "gpu-1").write_text(json.dumps({"xid": 63, "gpu_lost": False}))
    args = ("--step-seconds", "0.02", "--checkpoint-every", "5", "--fault-dir", str(faults))
    job = jobs.start(tmp_path / "run", *args, nodelist="gpu-[1-2]")
    # a fault that leaves the GPU working changes nothing
    job.wait_for_step(6)

    # the other node of the allocation loses its GPU (written whole, as a drill would)
    (faults / "gpu-2.new").write_text(json.dumps({"xid": 79, "gpu_lost": True}))
    os.rename(faults / "gpu-2.new", faults / "gpu-2")

    stalled = job.wait_for_state("stalled")
    checkpoints = job.complete_steps()
    job.proc.send_signal(signal.SIGUSR1)
    refusal = "SIGUSR1: cannot write an emergency checkpoint"
    wait_for("SIGUSR1 refused", lambda: refusal in job.stderr.read_text())
    assert job.complete_steps() == checkpoints
    assert job.progress() == stalled
    assert job.proc.poll() is None

    job.proc.send_signal(signal.SIGTERM)

    assert job.wait_exit(2) == 143, job.logs()
    assert job.complete_steps() == checkpoints
    assert job.progress()["step"] == stalled["step"]
    assert job.progress()["state"] == "exited"
    assert "GPU lost on gpu-2 (xid 79)" in job.stderr.read_text()
    assert "SIGTERM: exiting without a checkpoint" in job.stderr.read_text()


def test_resumed_run_follows_the_uninterrupted_trajectory(jobs: Jobs, tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    uninterrupted = jobs.start(straight, "--total-steps", "30", "--step-seconds", "0")
    interrupted = jobs.start(resumed, "--total-steps", "30", "--step-seconds", "0.05", "--checkpoint-every", "7")
    interrupted.wait_for_step(8)
    interrupted.proc.send_signal(signal.SIGTERM)
    assert interrupted.wait_exit() == 143, interrupted.logs()
    assert uninterrupted.wait_exit() == 0, uninterrupted.logs()

    restarted = jobs.start(resumed, "--total-steps", "30", "--step-seconds", "0", restart_count=1)

    assert restarted.wait_exit() == 0, restarted.logs()
    resumed_step = read_resume_records(resumed)[-1]["resumed_step"]
    assert 8 <= resumed_step < 30
    for name in ("model.json", "optimizer.json"):
        expected = (straight / "step-000000030" / name).read_bytes()
        assert (resumed / "step-000000030" / name).read_bytes() == expected


def test_a_crashing_lost_gpu_ends_the_rank_on_it_and_stalls_the_others(jobs: Jobs, tmp_path: Path) -> None:
    faults = tmp_path / "faults"
    faults.mkdir()
    args = ("--step-seconds", "0.02", "--checkpoint-every", "5", "--fault-dir", str(faults))
    rank0 = jobs.start(tmp_path / "run", *args, nodelist="gpu-[1-2]")
    rank1 = jobs.start(tmp_path / "run", *args, rank=1, nodelist="gpu-[1-2]", node="gpu-2")
    rank0.wait_for_step(6)
    (faults / "gpu-2.new").write_text(json.dumps({"xid": 79, "gpu_lost": True, "crash": True}))
    os.rename(faults / "gpu-2.new", faults / "gpu-2")

    assert rank1.wait_exit(5) == 1, rank1.logs()
    assert "CUDA error: GPU lost on gpu-2 (xid 79): the process crashes" in rank1.stderr.read_text()
    rank0.wait_for_state("stalled")
    assert rank0.proc.poll() is None
