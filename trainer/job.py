"""The reference training job: deterministic, resumable, and answering the recovery signals.

    python -m trainer.job --run-dir DIR [--total-steps 0 (forever)] [--step-seconds 0.2]
                          [--checkpoint-every 10] [--keep 5] [--fault-dir DIR]

It fits a linear model by SGD with momentum. Step N draws its batch from a RNG seeded with N,
so a run resumed from a checkpoint follows exactly the trajectory of an uninterrupted one.

Rank 0 (SLURM_PROCID) owns the run directory: it resumes from the latest complete checkpoint,
logs the resume, writes progress.json every step and a checkpoint every --checkpoint-every
steps. Other ranks train the same way and write nothing.

Signals, acted on at the next step boundary (the handlers only set flags):
  SIGUSR1  write an emergency checkpoint and keep training;
  SIGTERM  write an emergency checkpoint, mark progress "exited" and exit 143.

Drill faults (--fault-dir): before each step the job reads ``<fault-dir>/<node>`` for every
node of its allocation, e.g. ``{"xid": 79, "gpu_lost": true}``. A lost GPU anywhere means the
step can never complete (as a collective on a dead GPU): progress turns "stalled", SIGUSR1 can
no longer checkpoint, and SIGTERM exits 143 at once without a checkpoint. With ``"crash": true``
the rank on that node exits 1 at once instead, as a CUDA error ends a real one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from trainer.checkpoint import (
    TMP_PREFIX,
    Checkpoint,
    CheckpointError,
    Skipped,
    append_resume_record,
    find_latest_complete,
    load_checkpoint,
    prune_checkpoints,
    read_progress,
    save_checkpoint,
    utc_now_iso,
    write_progress,
)

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, what Slurm and shells report for a TERM'd task
EXIT_CRASHED = 1  # the rank on a lost GPU, when the drill's fault crashes it
# how often a stalled rank looks at its signal flags
_STALL_POLL_SECONDS = 0.05

# The problem: y = w·x + b + noise, fitted from zero by SGD with momentum.
_TRUE_WEIGHTS = (1.5, -2.0, 0.5, 3.0)
_TRUE_BIAS = -0.7
_NOISE = 0.1
_BATCH_SIZE = 8
_LEARNING_RATE = 0.05
_MOMENTUM = 0.9


# --- the model ---------------------------------------------------------------------------------


@dataclass
class Model:
    weights: list[float]
    bias: float
    # momentum of weights then bias: optimizer state, so it is checkpointed too
    velocity: list[float]

    @classmethod
    def initial(cls) -> Model:
        return cls([0.0] * len(_TRUE_WEIGHTS), 0.0, [0.0] * (len(_TRUE_WEIGHTS) + 1))

    def train_step(self, step: int) -> float:
        """One SGD step on step ``step``'s batch; returns the batch's mean squared error."""
        rng = random.Random(step)
        gradient = [0.0] * len(self.velocity)
        loss = 0.0
        for _ in range(_BATCH_SIZE):
            x = [rng.uniform(-1.0, 1.0) for _ in _TRUE_WEIGHTS]
            y = sum(w * xi for w, xi in zip(_TRUE_WEIGHTS, x)) + _TRUE_BIAS + rng.gauss(0.0, _NOISE)
            error = sum(w * xi for w, xi in zip(self.weights, x)) + self.bias - y
            loss += error * error
            for i, xi in enumerate([*x, 1.0]):
                gradient[i] += 2.0 * error * xi / _BATCH_SIZE
        self.velocity = [_MOMENTUM * v + g for v, g in zip(self.velocity, gradient)]
        params = [p - _LEARNING_RATE * v for p, v in zip([*self.weights, self.bias], self.velocity)]
        self.weights, self.bias = params[:-1], params[-1]
        return loss / _BATCH_SIZE

    def to_files(self) -> dict[str, bytes]:
        # json writes floats in their shortest exact form, so a reload restores them bit for bit
        model = {"weights": self.weights, "bias": self.bias}
        optimizer = {
            "learning_rate": _LEARNING_RATE,
            "momentum": _MOMENTUM,
            "velocity": self.velocity,
        }
        return {
            "model.json": json.dumps(model).encode(),
            "optimizer.json": json.dumps(optimizer).encode(),
        }

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> Model:
        model = json.loads(files["model.json"])
        optimizer = json.loads(files["optimizer.json"])
        return cls(list(model["weights"]), model["bias"], list(optimizer["velocity"]))


# --- where the job runs ------------------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list: "gpu-[1-2,4]" -> gpu-1 gpu-2 gpu-4; "a1,b[3-4]" -> a1 b3 b4.

    Handles several bracket groups per name ("r[1-2]n[01-02]") and keeps zero padding.
    """
    hosts = []
    depth, start = 0, 0
    for i, char in enumerate(hostlist + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            if hostlist[start:i]:
                hosts.extend(_expand_host(hostlist[start:i]))
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in host list {hostlist!r}")
    return hosts


def _expand_host(pattern: str) -> list[str]:
    opening = pattern.find("[")
    if opening < 0:
        return [pattern]
    closing = pattern.find("]", opening)
    if closing < 0:
        raise ValueError(f"unbalanced brackets in host list entry {pattern!r}")
    prefix, ranges, rest = pattern[:opening], pattern[opening + 1 : closing], pattern[closing + 1 :]
    tails = _expand_host(rest)
    return [prefix + number + tail for number in _expand_ranges(ranges) for tail in tails]


def _expand_ranges(ranges: str) -> list[str]:
    numbers = []
    for part in ranges.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"invalid host list range {part!r}")
        if not dash:
            numbers.append(low)
            continue
        # "01-10" keeps two digits, as Slurm does
        numbers.extend(f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return numbers


@dataclass(frozen=True)
class JobEnv:
    """What Slurm tells a task about its job (with defaults for running it by hand)."""

    job_id: str
    restart_count: int
    rank: int
    node: str
    nodes: list[str]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> JobEnv:
        node = environ.get("SLURMD_NODENAME") or socket.gethostname()
        nodelist = environ.get("SLURM_JOB_NODELIST", "")
        return cls(
            job_id=environ.get("SLURM_JOB_ID") or "local",
            restart_count=int(environ.get("SLURM_RESTART_COUNT") or 0),
            rank=int(environ.get("SLURM_PROCID") or 0),
            node=node,
            nodes=expand_hostlist(nodelist) if nodelist else [node],
        )


# --- logging, signals and faults ---------------------------------------------------------------


class Log:
    """One line per event, flushed at once (srun relays task output as it comes)."""

    def __init__(self, env: JobEnv) -> None:
        self.prefix = f"[trainer job {env.job_id} rank {env.rank} on {env.node}]"

    def info(self, message: str) -> None:
        print(f"{self.prefix} {message}", flush=True)

    def problem(self, message: str) -> None:
        print(f"{self.prefix} {message}", file=sys.stderr, flush=True)


class Signals:
    """Flags set by the signal handlers, acted on by the training loop at step boundaries."""

    def __init__(self) -> None:
        self.checkpoint_requested = False
        self.terminate_requested = False

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.signal(signal.SIGTERM, self._on_term)

    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        self.checkpoint_requested = True

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        self.terminate_requested = True


@dataclass
class LostGpu:
    node: str
    fault: dict[str, Any]

    def __str__(self) -> str:
        return f"GPU lost on {self.node} (xid {self.fault.get('xid', '?')})"

    def crashes(self, node: str) -> bool:
        """Whether the rank on `node` dies of it (the one on the lost GPU, when the fault says so)."""
        return node == self.node and self.fault.get("crash") is True


class FaultWatch:
    """Reads the drill's fault files for every node of the allocation."""

    def __init__(self, fault_dir: Path | None, nodes: list[str], log: Log) -> None:
        self.fault_dir = fault_dir
        self.nodes = nodes
        self.log = log
        self._warned: set[str] = set()

    def lost_gpu(self) -> LostGpu | None:
        if self.fault_dir is None:
            return None
        for node in self.nodes:
            try:
                fault = json.loads((self.fault_dir / node).read_bytes())
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as error:
                # maybe caught mid-write: read it again next step, and say so once
                if node not in self._warned:
                    self._warned.add(node)
                    self.log.problem(f"fault file for {node} unreadable, ignored for now: {error}")
                continue
            if isinstance(fault, dict) and fault.get("gpu_lost") is True:
                return LostGpu(node, fault)
        return None


# --- the job -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    run_dir: Path
    total_steps: int
    step_seconds: float
    checkpoint_every: int
    keep: int
    fault_dir: Path | None


class TrainingJob:
    def __init__(self, options: Options, env: JobEnv, signals: Signals) -> None:
        self.options = options
        self.run_dir = options.run_dir
        self.env = env
        self.signals = signals
        self.log = Log(env)
        self.faults = FaultWatch(options.fault_dir, env.nodes, self.log)
        # only rank 0 writes to the run directory
        self.writer = env.rank == 0
        self.model = Model.initial()
        self.step = 0
        self.train_seconds = 0.0
        self.save_seconds = 0.0  # this run's time spent saving checkpoints
        self.launched_at = utc_now_iso()

    def run(self) -> int:
        self._resume()
        while True:
            # a step boundary: the one place signals are acted on
            if self.signals.terminate_requested:
                self.log.info(f"SIGTERM: emergency checkpoint at step {self.step}, then exit")
                self._checkpoint("SIGTERM")
                self._write_progress("exited")
                return EXIT_TERMINATED
            if self.signals.checkpoint_requested:
                self.signals.checkpoint_requested = False
                self.log.info(f"SIGUSR1: emergency checkpoint at step {self.step}")
                self._checkpoint("SIGUSR1")
            if self.options.total_steps and self.step >= self.options.total_steps:
                self._checkpoint("final")
                self._write_progress("exited")
                self.log.info(f"finished {self.step} steps")
                return 0
            lost = self.faults.lost_gpu()
            if lost and lost.crashes(self.env.node):
                self.log.problem(f"CUDA error: {lost}: the process crashes")
                return EXIT_CRASHED
            if lost:
                return self._stall(lost)
            started = time.monotonic()
            self.model.train_step(self.step + 1)
            time.sleep(self.options.step_seconds)  # stands in for the GPU's work
            self.train_seconds += time.monotonic() - started
            self.step += 1
            self._write_progress("running")
            if self.step % self.options.checkpoint_every == 0:
                self._checkpoint("periodic")

    def _resume(self) -> None:
        if not self.writer:
            checkpoint, _ = self._load_latest()
            self._log_resumed(checkpoint)
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # progress as the previous run left it: read before this run overwrites it
        previous = read_progress(self.run_dir)
        checkpoint, skipped = self._load_latest()
        append_resume_record(
            self.run_dir,
            {
                "job_id": self.env.job_id,
                "restart_count": self.env.restart_count,
                "resumed_step": checkpoint.step if checkpoint else None,
                "checkpoint_id": checkpoint.checkpoint_id if checkpoint else None,
                "skipped_checkpoints": [{"checkpoint_id": s.checkpoint_id, "why": s.why} for s in skipped],
                "previous_last_step": previous.get("step") if previous else None,
                "previous_train_seconds": previous.get("train_seconds") if previous else None,
                "resumed_train_seconds": self.train_seconds,
                "started_at": utc_now_iso(),
                "launched_at": self.launched_at,
                "host": self.env.node,
            },
        )
        for s in skipped:
            self.log.problem(f"skipped checkpoint {s.checkpoint_id}: {s.why}")
            if s.checkpoint_id.startswith(TMP_PREFIX):
                # an earlier run died writing it; now that it is on record, clear it away
                shutil.rmtree(self.run_dir / s.checkpoint_id, ignore_errors=True)
        self._log_resumed(checkpoint)
        self._write_progress("running")

    def _load_latest(self) -> tuple[Checkpoint | None, list[Skipped]]:
        # a checkpoint can break between finding and loading it; then the next search skips it
        while True:
            checkpoint, skipped = find_latest_complete(self.run_dir)
            if checkpoint is None:
                return None, skipped
            try:
                self.model = Model.from_files(load_checkpoint(checkpoint))
            except CheckpointError as error:
                self.log.problem(str(error))
                continue
            self.step = checkpoint.step
            self.train_seconds = checkpoint.train_seconds
            return checkpoint, skipped

    def _log_resumed(self, checkpoint: Checkpoint | None) -> None:
        restart = f"restart {self.env.restart_count}"
        if checkpoint:
            self.log.info(f"resumed from {checkpoint.checkpoint_id} ({restart})")
        else:
            self.log.info(f"starting from scratch ({restart})")

    def _stall(self, lost: LostGpu) -> int:
        """The next step can never complete: wait, unable to checkpoint, until SIGTERM."""
        stuck = f"step {self.step + 1} is stuck, {lost}"
        self.log.problem(f"{stuck}: stalled, no more progress or checkpoints")
        self._write_progress("stalled")
        while not self.signals.terminate_requested:
            if self.signals.checkpoint_requested:
                self.signals.checkpoint_requested = False
                self.log.problem(f"SIGUSR1: cannot write an emergency checkpoint: {stuck}")
            time.sleep(_STALL_POLL_SECONDS)
        self.log.problem(f"SIGTERM: exiting without a checkpoint: {stuck}")
        self._write_progress("exited")
        return EXIT_TERMINATED

    def _checkpoint(self, reason: str) -> None:
        if not self.writer:
            return
        started = time.monotonic()
        checkpoint = save_checkpoint(self.run_dir, self.step, self.train_seconds, self.model.to_files())
        self.save_seconds += time.monotonic() - started
        self.log.info(
            f"checkpoint {checkpoint.checkpoint_id} ({reason}, step {checkpoint.step}, "
            f"{checkpoint.train_seconds:.1f} s trained)"
        )
        for path in prune_checkpoints(self.run_dir, self.options.keep):
            self.log.info(f"pruned {path.name}")

    def _write_progress(self, state: str) -> None:
        if not self.writer:
            return
        write_progress(
            self.run_dir,
            {
                "job_id": self.env.job_id,
                "restart_count": self.env.restart_count,
                "step": self.step,
                "train_seconds": self.train_seconds,
                "updated_at": utc_now_iso(),
                "state": state,
                "save_seconds": self.save_seconds,
            },
        )


def parse_options(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m trainer.job", description="The reference training job.")
    add = parser.add_argument
    add("--run-dir", type=Path, required=True, help="checkpoints and progress files")
    add("--total-steps", type=int, default=0, help="stop after this step (0: never)")
    add("--step-seconds", type=float, default=0.2, help="simulated time per step")
    add("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    add("--keep", type=int, default=5, help="complete checkpoints to keep")
    add("--fault-dir", type=Path, help="drill fault files, one per node")
    args = parser.parse_args(argv)
    if args.total_steps < 0 or args.step_seconds < 0 or args.checkpoint_every < 1 or args.keep < 1:
        parser.error("need --total-steps >= 0, --step-seconds >= 0, --checkpoint-every >= 1, --keep >= 1")
    return Options(
        run_dir=args.run_dir,
        total_steps=args.total_steps,
        step_seconds=args.step_seconds,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        fault_dir=args.fault_dir,
    )


def main(argv: list[str] | None = None) -> int:
    # first of all: until the handlers are in, SIGUSR1's default action would kill the job
    signals = Signals()
    signals.install()
    options = parse_options(argv)
    return TrainingJob(options, JobEnv.from_environ(os.environ), signals).run()


if __name__ == "__main__":
    sys.exit(main())
