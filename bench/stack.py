"""The benchmarks' own local stack: the drill's embedded stack (Temporal dev server with its sqlite
file, the real Slurm cluster, a worker process), in a state dir and on ports of its own, so a
benchmark never touches a drill's stack (7233, 8233, 16800) or the tests' clusters.

Set RECOVERY_BENCH_STATE_DIR, RECOVERY_BENCH_TEMPORAL_PORT, RECOVERY_BENCH_UI_PORT and
RECOVERY_BENCH_SLURM_PORT_BASE to move it. Whatever the benchmark started is stopped after it;
what was already running there is left as it was.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from temporalio.client import Client

from activities.xid_policy import XidPolicyTable
from backends.slurm import SlurmCli
from contracts.models import RecoveryPolicy
from contracts.settings import Settings
from drills.drill import Drill
from drills.localstack import LocalStack, StackError, _terminate
from worker import connect

# Slurm's own default (slurm.conf(5)); the local stack sets 10 s so that its tests are quick.
SLURM_DEFAULT_SLURMD_TIMEOUT = 300


def say(text: str) -> None:
    """Progress, on stderr: stdout carries only the results."""
    print(text, file=sys.stderr, flush=True)


def bench_local_stack(slurm_version: str | None = None) -> LocalStack:
    """The bench's stack on the host's Slurm, or on `slurm_version` (from its Debian root, with a
    worker on a task queue of its own)."""
    env = os.environ.get
    return LocalStack(
        state_dir=Path(env("RECOVERY_BENCH_STATE_DIR") or "/tmp/training-recovery-bench"),
        temporal_port=int(env("RECOVERY_BENCH_TEMPORAL_PORT") or 7433),
        ui_port=int(env("RECOVERY_BENCH_UI_PORT") or 8433),
        slurm_port_base=int(env("RECOVERY_BENCH_SLURM_PORT_BASE") or 18800),
        slurm_version=slurm_version,
        task_queue="training-recovery" + (f"-{slurm_version}" if slurm_version else ""),
    )


@dataclass
class BenchStack:
    stack: LocalStack
    cluster: dict[str, str]
    client: Client
    settings: Settings
    slurmd_timeout: int  # seconds, as slurmctld reports it

    @functools.cached_property
    def slurm(self) -> SlurmCli:
        """The cluster's CLI, for setting scenes and reading Slurm's view (not the worker's client)."""
        return SlurmCli(slurm_conf=self.cluster["SLURM_CONF"], bin_dir=self.cluster.get("SLURM_BIN_DIR", ""))

    @property
    def policy(self) -> RecoveryPolicy:
        """What the drill passes with each alert on this stack."""
        return self.settings.model_copy(update={"spare_nodes": self.cluster.get("SLURM_SPARE_NODES", "")}).policy()

    def drill(self, policy: RecoveryPolicy | None = None, log: Callable[[str], None] = say) -> Drill:
        return Drill(
            self.client,
            self.stack,
            self.cluster,
            policy or self.policy,
            XidPolicyTable(self.settings.xid_policy_file),
            say=log,
        )

    def slurm_env(self) -> dict[str, str]:
        return self.stack.slurm_cli_env(self.cluster)

    async def bring_nodes_back(self) -> None:
        """A node killed by a benchmark boots again (the cluster script restarts what is missing)."""
        self.cluster = await asyncio.to_thread(self.stack.start_slurm)
        if self.slurmd_timeout != await asyncio.to_thread(slurmd_timeout_of, self.slurm_env()):
            # starting rewrote slurm.conf with the stack's own timeout
            await asyncio.to_thread(use_slurmd_timeout, self.slurm_env(), self.slurmd_timeout)


@asynccontextmanager
async def bench_stack(slurmd_timeout: int | None, slurm_version: str | None = None) -> AsyncIterator[BenchStack]:
    """The stack, up; slurmd_timeout (seconds) overrides the cluster's SlurmdTimeout, None keeps it."""
    stack = bench_local_stack(slurm_version)
    was_running = await asyncio.to_thread(stack.status)
    say(
        f"bench stack in {stack.state_dir} (Temporal 127.0.0.1:{stack.temporal_port}, Slurm ports from "
        f"{stack.slurm_port_base}); already running: {[k for k, v in was_running.items() if v] or 'nothing'}"
    )
    env = original_timeout = None
    if not was_running["temporal"]:
        # A fresh fleet budget for every run: one that remembers the last run's disrupted jobs
        # (their window is an hour) would hold this run's incidents back over budget.
        for name in ("temporal.db", "temporal.db-wal", "temporal.db-shm"):
            (stack.state_dir / name).unlink(missing_ok=True)
    try:
        await asyncio.to_thread(stack.start_temporal)
        cluster = await asyncio.to_thread(stack.start_slurm)
        env = stack.slurm_cli_env(cluster)
        original_timeout = await asyncio.to_thread(slurmd_timeout_of, env)
        if slurmd_timeout is not None and slurmd_timeout != original_timeout:
            await asyncio.to_thread(use_slurmd_timeout, env, slurmd_timeout)
        await asyncio.to_thread(stack.start_worker, cluster)
        settings = Settings(TEMPORAL_ADDRESS=stack.temporal_address, task_queue=stack.task_queue)
        client = await connect(settings)
        yield BenchStack(stack, cluster, client, settings, slurmd_timeout or original_timeout)
    finally:
        if not was_running["worker"]:
            stack.stop_worker()
        if not was_running["temporal"]:
            _terminate(stack.state_dir / "temporal.pid")
        if not was_running["slurm"]:
            stack.stop_slurm()
        elif env is not None and original_timeout not in (None, slurmd_timeout_of(env)):
            use_slurmd_timeout(env, original_timeout)  # a cluster we found is left as we found it


def slurmd_timeout_of(env: dict[str, str]) -> int:
    """SlurmdTimeout as the running slurmctld has it."""
    out = subprocess.run(["scontrol", "show", "config"], env=env, capture_output=True, text=True, check=True).stdout
    found = re.search(r"^SlurmdTimeout\s*=\s*(\d+)", out, re.MULTILINE)
    if not found:
        raise StackError("scontrol show config has no SlurmdTimeout")
    return int(found.group(1))


def use_slurmd_timeout(env: dict[str, str], seconds: int) -> None:
    """Set the running cluster's SlurmdTimeout (slurm.conf, then `scontrol reconfigure`).

    Stands in for a knob of deploy/local/slurm-cluster.sh (SLURM_SLURMD_TIMEOUT, proposed): the
    script writes SlurmdTimeout=10 for the tests, and Slurm alone must be measured at its default."""
    conf = Path(env["SLURM_CONF"])
    text, count = re.subn(r"^SlurmdTimeout=\d+$", f"SlurmdTimeout={seconds}", conf.read_text(), flags=re.MULTILINE)
    if count != 1:
        raise StackError(f"{conf} has no single SlurmdTimeout line to set")
    conf.write_text(text)
    subprocess.run(["scontrol", "reconfigure"], env=env, capture_output=True, text=True, check=True)
    if slurmd_timeout_of(env) != seconds:
        raise StackError(f"slurmctld did not take SlurmdTimeout={seconds} from {conf}")
