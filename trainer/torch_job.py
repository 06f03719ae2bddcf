"""A real distributed PyTorch training job, as users write them, for the recovery drill:

    srun python -m trainer.torch_job --run-dir DIR [--step-seconds 0.2] [--checkpoint-every 10]
                                     [--keep 3] [--fault-dir DIR]

One process per node (srun), a gloo process group, a small MLP under DistributedDataParallel on
data made in the job, AdamW. Checkpoints are PyTorch Distributed Checkpoints (DCP) in
`DIR/step_<N>/`, every N steps, `dcp.async_save` on alternate ones; the job resumes with DCP's own
`dcp.load` from the newest checkpoint it can load, falling back past those it cannot. It imports
torch and the standard library only: nothing of the recovery controller. What the controller reads
is what any job can leave in three lines each (docs/checkpoints.md): a resume record at every
start (`resume-log.jsonl`) and, optionally, its progress (`progress.json`).

Signals, acted on at a step boundary that every rank agrees on (one all-reduce of flags a step):
SIGUSR1 saves a checkpoint and goes on; SIGTERM saves one and exits 143. Drill faults
(--fault-dir): a rank whose node's file says `"gpu_lost": true` stalls the job (no step can finish,
no checkpoint can be written) until SIGTERM; with `"crash": true` that rank dies at once (exit 1),
as a CUDA error ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_CRASHED = 1
METADATA = ".metadata"  # DCP's coordinator writes it last: without it a save did not finish
_TERMINATE, _CHECKPOINT, _LOST = range(3)


def log(rank: int, text: str) -> None:
    restart = os.environ.get("SLURM_RESTART_COUNT") or "0"
    print(f"[torch rank {rank} restart {restart}] {text}", flush=True)


def write_json_atomically(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


class Job:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_dir: Path = args.run_dir
        self.rank, self.world = int(os.environ.get("SLURM_PROCID", 0)), int(os.environ.get("SLURM_NTASKS", 1))
        self.job_id = os.environ.get("SLURM_JOB_ID", "local")
        self.restart = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.node = os.environ.get("SLURMD_NODENAME", "local")
        self.signalled = {"USR1": 0, "TERM": 0}
        self.saved_step: int | None = None  # the step of the last checkpoint this run wrote or loaded
        self.step, self.train_seconds = 0, 0.0
        self.save_seconds = 0.0  # this run's time blocked saving (an async save: its staging only)
        self.launched_at = datetime.now(timezone.utc).isoformat()
        self.pending: object | None = None  # the async save in flight

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # a rendezvous file of this run's own: the job's ranks share the run directory
        rendezvous = self.run_dir / f".rendezvous-{self.job_id}-{self.restart}"
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=self.rank, world_size=self.world)
        # checkpoints talk on a group of their own: an async_save's collectives run in a background
        # thread, and sharing the training's group with it hung the job at its first async save
        self.checkpoint_group = dist.new_group(backend="gloo")
        torch.manual_seed(0)
        self.model = DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.resume()
        signal.signal(signal.SIGUSR1, lambda *_: self.signalled.__setitem__("USR1", self.signalled["USR1"] + 1))
        signal.signal(signal.SIGTERM, lambda *_: self.signalled.__setitem__("TERM", self.signalled["TERM"] + 1))
        handled_usr1 = 0
        while True:
            if self.lost_gpu() and self.crashes():
                log(self.rank, f"CUDA error: GPU lost on {self.node}: the process crashes")
                return EXIT_CRASHED
            # counted, not flagged: a signal that arrives during the all-reduce counts at the next step
            usr1 = self.signalled["USR1"]
            agreed = torch.tensor(
                [float(self.signalled["TERM"] > 0), float(usr1 > handled_usr1), float(self.lost_gpu())]
            )
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank acts on the same step
            handled_usr1 = usr1
            if agreed[_LOST]:
                return self.stall()
            if agreed[_TERMINATE]:
                log(self.rank, f"SIGTERM: checkpoint at step {self.step}, then exit")
                self.save(wait=True)
                return EXIT_TERMINATED
            if agreed[_CHECKPOINT]:
                log(self.rank, f"SIGUSR1: checkpoint at step {self.step}")
                self.save(wait=True)
            self.train_step()
            if self.step % self.args.checkpoint_every == 0:
                self.save(wait=(self.step // self.args.checkpoint_every) % 2 == 1)

    def train_step(self) -> None:
        started = time.monotonic()
        data = torch.Generator().manual_seed(self.step * self.world + self.rank)
        x = torch.randn(16, 32, generator=data)
        loss = torch.nn.functional.mse_loss(self.model(x), x.sum(dim=1, keepdim=True))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        time.sleep(self.args.step_seconds)  # stands in for the GPU's work
        self.step += 1
        self.train_seconds += time.monotonic() - started
        self.progress("running")

    def state(self) -> dict:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {
            "model": model,
            "optim": optimizer,
            "progress": {"step": self.step, "train_seconds": self.train_seconds},
        }

    def save(self, wait: bool) -> None:
        """A DCP save of this step; `wait=False` leaves it to finish in the background (async_save)."""
        if self.saved_step == self.step:
            return  # decided in memory, alike on every rank: ranks looking at a shared file system may not agree
        started = time.monotonic()
        self.finish_pending()  # waiting for the previous async save blocks training too
        target = self.run_dir / f"step_{self.step}"
        if self.rank == 0 and target.exists():  # a save of this step that did not load: never write over it
            target.rename(target.with_name(f".unloadable-{target.name}-{time.time_ns()}"))
        dist.barrier(group=self.checkpoint_group)
        if wait:
            dcp.save(self.state(), checkpoint_id=str(target), process_group=self.checkpoint_group)
            self.prune()
        else:
            self.pending = dcp.async_save(self.state(), checkpoint_id=str(target), process_group=self.checkpoint_group)
        self.saved_step = self.step
        self.save_seconds += time.monotonic() - started

    def finish_pending(self) -> None:
        if self.pending is not None:
            self.pending.result()  # type: ignore[attr-defined]
            self.pending = None
            self.prune()

    def prune(self) -> None:
        """Only rank 0 deletes, and only complete checkpoints beyond the newest `keep`."""
        if self.rank != 0:
            return
        complete = sorted((d for d in self.checkpoints() if (d / METADATA).exists()), key=step_of)
        for old in complete[: -self.args.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def checkpoints(self) -> list[Path]:
        return [d for d in self.run_dir.glob("step_*") if d.is_dir() and d.name[5:].isdigit()]

    def resume(self) -> None:
        """DCP's own load of the newest checkpoint that loads; every rank tries the same ones in the
        same order, and a failed load fails on every rank (DCP gathers the ranks' errors)."""
        skipped, loaded = [], None
        # rank 0 looks at the directory and tells the others: on a shared file system with client
        # caches, ranks looking each for itself may see different checkpoints, and diverge
        listing = [[(d.name, (d / METADATA).exists()) for d in sorted(self.checkpoints(), key=step_of, reverse=True)]]
        dist.broadcast_object_list(listing, src=0, group=self.checkpoint_group)
        for name, finished in listing[0]:
            directory = self.run_dir / name
            if not finished:
                skipped.append({"checkpoint_id": name, "why": f"no {METADATA}: the save did not finish"})
                continue
            state = self.state()
            try:
                dcp.load(state, checkpoint_id=str(directory), process_group=self.checkpoint_group)
            except BaseException as error:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
                if isinstance(error, KeyboardInterrupt | SystemExit):
                    raise
                why = str(error).strip().splitlines()[-1][:300]
                skipped.append({"checkpoint_id": directory.name, "why": f"dcp.load failed: {why}"})
                continue
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            self.step, self.train_seconds = state["progress"]["step"], state["progress"]["train_seconds"]
            loaded, self.saved_step = name, self.step
            break
        for skip in skipped:
            log(self.rank, f"skipped checkpoint {skip['checkpoint_id']}: {skip['why']}")
        log(self.rank, f"resumed from {loaded} at step {self.step}" if loaded else "starting from scratch")
        if self.rank == 0:
            for earlier in self.run_dir.glob(".rendezvous-*"):  # earlier runs' (this run's is in use)
                if earlier.name != f".rendezvous-{self.job_id}-{self.restart}":
                    earlier.unlink(missing_ok=True)
            # the resume record: any job can write it in three lines (docs/checkpoints.md)
            with open(self.run_dir / "resume-log.jsonl", "a") as record:
                started = datetime.now(timezone.utc).isoformat()
                record.write(
                    json.dumps(
                        {
                            "job_id": self.job_id,
                            "restart_count": self.restart,
                            "checkpoint_id": loaded,
                            "resumed_step": self.step if loaded else None,
                            "started_at": started,
                            "launched_at": self.launched_at,  # optional: for goodput's resume time
                            "skipped_checkpoints": skipped,
                        }
                    )
                    + "\n"
                )
            self.progress("running")

    def progress(self, state: str) -> None:
        if self.rank == 0:
            record = {
                "job_id": self.job_id,
                "restart_count": self.restart,
                "step": self.step,
                "train_seconds": self.train_seconds,
                "updated_at": datetime.now(timezone.utc).isoformat(),
                "state": state,
                "save_seconds": self.save_seconds,
            }
            write_json_atomically(self.run_dir / "progress.json", record)

    def fault(self) -> dict:
        if self.args.fault_dir is None:
            return {}
        try:
            fault = json.loads((self.args.fault_dir / self.node).read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return fault if isinstance(fault, dict) else {}

    def lost_gpu(self) -> bool:
        return self.fault().get("gpu_lost") is True

    def crashes(self) -> bool:
        return self.fault().get("crash") is True

    def stall(self) -> int:
        """No step can finish on a lost GPU, and no checkpoint be written: wait for SIGTERM."""
        self.finish_pending()  # an async save in flight writes from host memory: it finishes
        log(self.rank, f"step {self.step + 1} is stuck: a GPU of the job is lost; no more progress or checkpoints")
        self.progress("stalled")
        while not self.signalled["TERM"]:
            time.sleep(0.05)
        log(self.rank, "SIGTERM: exiting without a checkpoint")
        return EXIT_TERMINATED


def step_of(directory: Path) -> int:
    return int(directory.name[5:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--fault-dir", type=Path)
    job = Job(parser.parse_args(argv))
    status = job.run()
    sys.stdout.flush()
    # destroy_process_group or the interpreter's exit hung after an async_save in 2 of 5 runs here
    # (torch 2.13, in native code): every checkpoint is written and synced by now, so leave at once
    os._exit(status)


if __name__ == "__main__":
    main()
