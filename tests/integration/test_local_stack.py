"""Every Slurm generation on this one machine, side by side: the host's own Slurm and the others
from Debian roots (22.05 from bookworm, 24.11 from trixie, 26.05 from sid). Each runs the
reference training job with real checkpoints, restarts it after requeuehold + release, and serves
its own REST API versions; stopping them leaves no process and no mount behind."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from backends.slurm import SlurmCli
from drills.localstack import DEBIAN_RELEASE_OF_GENERATION, LocalStack
from tests.conftest import ports_below_the_ephemeral_range
from trainer import checkpoint as ckpt

pytestmark = [pytest.mark.slurm, pytest.mark.every_slurm_generation]

# A stack of its own, on ports apart from a drill's (16800 and 1000, 2000, 3000 above), the session
# clusters' (24800 to 28600), the CLI test's (23800) and the benchmarks' (18800 and above), and below
# the ephemeral range (the newest generation's cluster takes 3000 above the base, and its slurmd 100+).
STATE_DIR = Path("/tmp/training-recovery-stack-tests")
PORT_BASE = 29000
# The cloud-node cluster beside each generation's (CLOUD_PORT_OFFSET above it, 2 slurmd).
CLOUD_PORT_OFFSET = 500
PORTS_ABOVE_BASE = 3000 + CLOUD_PORT_OFFSET + 200
GENERATIONS = tuple(DEBIAN_RELEASE_OF_GENERATION)
# The REST API versions each generation serves (22.05: one plugin each; from 23.02: data parsers)
REST_VERSIONS = {
    "22.05": {"v0.0.36", "v0.0.37", "v0.0.38"},
    "24.11": {"v0.0.40", "v0.0.41", "v0.0.42"},
    "26.05": {"v0.0.42", "v0.0.43", "v0.0.44", "v0.0.45"},
}
SPARE_REASON = "recovery: hot spare standby"

T = TypeVar("T")


@dataclass
class Cluster:
    generation: str
    stack: LocalStack
    env: dict[str, str]  # from env.sh, for every Slurm command (PATH has the root's wrappers first)

    def run(self, *argv: str, cwd: Path | None = None) -> str:
        result = subprocess.run(argv, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{' '.join(argv)}: {result.stderr}"
        return result.stdout

    def job(self, job_id: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", "-o", job_id)))

    def nodes(self) -> dict[str, tuple[str, str]]:
        lines = self.run("sinfo", "-h", "-N", "-o", "%N|%T|%E").splitlines()
        return {name: (state, reason) for name, state, reason in (line.split("|") for line in lines)}


def poll(check: Callable[[], T], seconds: float, what: str) -> T:
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(0.2)


def processes_of(stack: LocalStack) -> list[str]:
    """Processes that mention the cluster's base (command line or environment, as SLURM_CONF
    does). Not every process in its Debian root: another cluster may share the root."""
    marks = [f"{stack.slurm_base}/".encode(), f"{stack.slurm_base.resolve()}/".encode()]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue  # gone meanwhile
        if any(m in cmdline or m in environ for m in marks):
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name}: {command}")
    return found


def mounts_under(root: Path) -> list[str]:
    """Mount points under root in the host's mount namespace. The nodes' private namespaces
    die with their processes (checked by processes_of); another cluster may share the root."""
    points = (line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines())
    return sorted(p for p in points if p == str(root) or p.startswith(f"{root}/"))


@pytest.fixture(scope="module")
def clusters():
    base = ports_below_the_ephemeral_range(PORT_BASE, PORTS_ABOVE_BASE, "test_local_stack's PORT_BASE")
    stacks = {
        g: LocalStack(state_dir=STATE_DIR, slurm_port_base=base, slurm_version=g, temporal_port=0, ui_port=0)
        for g in GENERATIONS
    }
    # one generation is the host's, the others run from roots
    assert [s.slurm_root is None for s in stacks.values()].count(True) == 1
    try:
        yield {g: Cluster(g, s, s.slurm_cli_env(s.start_slurm())) for g, s in stacks.items()}
    finally:
        for stack in stacks.values():
            stack.stop_slurm()
    for stack in stacks.values():
        assert processes_of(stack) == [], f"left running by Slurm {stack.slurm_generation}"
        if stack.slurm_root:
            assert mounts_under(stack.slurm_root) == []


@pytest.fixture(params=GENERATIONS)
def cluster(request, clusters) -> Cluster:
    return clusters[request.param]


def test_each_generation_runs_its_own_slurm(cluster):
    version = cluster.env["SLURM_VERSION"]
    assert version.startswith(cluster.generation + ".")
    assert cluster.run("scontrol", "--version").split() == ["slurm-wlm", version]
    # the root's clients are wrappers in SLURM_BIN_DIR; the host's are on PATH
    assert bool(cluster.env["SLURM_BIN_DIR"]) == (cluster.stack.slurm_root is not None)


def test_nodes_are_registered_and_idle_and_the_spare_is_drained(cluster):
    def nodes_ready():
        nodes = cluster.nodes()
        return nodes if all(nodes[f"gpu-{i}"][0] == "idle" for i in range(1, 5)) else None

    nodes = poll(nodes_ready, 30, "gpu-[1-4] to be idle")
    assert sorted(nodes) == [f"gpu-{i}" for i in range(1, 6)]
    assert nodes["gpu-5"] == ("drained", SPARE_REASON)
    assert cluster.env["SLURM_SPARE_NODES"] == "gpu-5"


def test_reference_job_checkpoints_and_restarts_after_requeuehold_and_release(cluster):
    stack = cluster.stack
    run_dir = stack.drills_dir / f"stack-test-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    job_id = (
        cluster.run(
            "sbatch",
            "--parsable",
            f"--comment=checkpoint_dir={run_dir}",
            f"--output={run_dir}/slurm-%j.out",
            f"--export=ALL,PYTHONPATH={stack.trainer_pythonpath},TRAINER_PYTHON={stack.trainer_python}",
            str(stack.trainer_script),
            "--run-dir",
            str(run_dir),
            "--step-seconds",
            "0.2",
            "--checkpoint-every",
            "10",
            cwd=run_dir,
        )
        .strip()
        .split(";")[0]
    )
    try:

        def complete_checkpoints():
            return [c for c in ckpt.list_checkpoints(run_dir) if c.complete]

        poll(complete_checkpoints, 60, f"a complete checkpoint in {run_dir}")
        job = cluster.job(job_id)
        assert job["JobState"] == "RUNNING" and job["NumNodes"] == "2"
        assert job["WorkDir"] == str(run_dir)

        cluster.run("scontrol", "requeuehold", job_id)
        held = poll(lambda: (j := cluster.job(job_id))["JobState"] == "PENDING" and j, 30, "the job to be held")
        assert held["Reason"] == "job_requeued_in_held_state" and held["Restarts"] == "1"
        cluster.run("scontrol", "release", job_id)

        def resumed():
            records = ckpt.read_resume_records(run_dir)
            return records if len(records) == 2 else None

        # Slurm waits cred_expire (10 s) before it starts a requeued job again
        first, second = poll(resumed, 60, "the restarted job's resume record")
        assert (first["restart_count"], first["resumed_step"]) == (0, None)
        assert second["restart_count"] == 1 and second["job_id"] == job_id
        completed_steps = {c.step for c in ckpt.list_checkpoints(run_dir) if c.complete}
        assert second["resumed_step"] in completed_steps and second["resumed_step"] >= 10
        assert cluster.job(job_id)["Restarts"] == "1"
    finally:
        subprocess.run(["scancel", job_id], env=cluster.env, capture_output=True, timeout=60)
    poll(lambda: cluster.job(job_id)["JobState"] not in ("RUNNING", "COMPLETING", "PENDING"), 30, "the job to end")


def test_slurmrestd_serves_the_generations_api_versions(cluster):
    response = httpx.get(
        f"{cluster.env['SLURMRESTD_URL']}/openapi/v3",
        timeout=30,
        headers={
            "X-SLURM-USER-NAME": cluster.env["SLURMRESTD_USER"],
            "X-SLURM-USER-TOKEN": Path(cluster.env["SLURMRESTD_TOKEN_FILE"]).read_text().strip(),
        },
    )
    response.raise_for_status()
    versions = {m.group(1) for path in response.json()["paths"] if (m := re.match(r"/slurm/(v0\.0\.\d+)/", path))}
    assert versions == REST_VERSIONS[cluster.generation]


def test_a_restart_leaves_a_spare_an_incident_brought_into_service_in_service(cluster):
    """Issue #29: `recovery stack up` on a running cluster (and a restart of it) drained every
    configured spare as standby, also one an incident had just brought into service."""
    cluster.run(
        "scontrol",
        "update",
        "NodeName=gpu-5",
        "Comment=recovery: spare for incident gpu-2-20261203T000000Z",
        "State=RESUME",
    )
    poll(lambda: cluster.nodes()["gpu-5"][0] == "idle", 30, "the claimed spare to be in service")
    try:
        cluster.stack.start_slurm()  # up again, on a running cluster
        assert cluster.nodes()["gpu-5"][0] == "idle"
        cluster.stack.stop_slurm()
        cluster.stack.start_slurm()  # a restart: slurmctld restores the node's state and comment
        assert poll(lambda: cluster.nodes()["gpu-5"][0] == "idle", 30, "the claimed spare back in service")
    finally:
        # the spare on standby again, as the other tests expect it
        cluster.run("scontrol", "update", "NodeName=gpu-5", "Comment=", "State=DRAIN", f"Reason={SPARE_REASON}")


async def test_cloud_nodes_are_listed_and_drained_and_set_down_without_a_slurmd(cluster):
    """SLURM_CLOUD_NODES (issue #26's fleet of thousands on one machine): nodes without a slurmd,
    powered down (State=CLOUD), which slurmctld lists (PrivateData=cloud) and the worker's backend
    drains and sets DOWN as any node; jobs still run on the nodes with a slurmd (the cloud nodes
    are in a partition of their own)."""
    stack = dataclasses.replace(
        cluster.stack,
        state_dir=STATE_DIR / "cloud",
        slurm_port_base=cluster.stack.slurm_port_base + CLOUD_PORT_OFFSET,
        slurm_nodes=2,
        slurm_spares=0,
        slurm_cloud_nodes=300,
    )
    try:
        env = stack.slurm_cli_env(stack.start_slurm(clean=True))
        cli = SlurmCli(slurm_conf=env["SLURM_CONF"], bin_dir=env.get("SLURM_BIN_DIR", ""))
        nodes = {n.name: n for n in await cli.list_nodes()}
        assert sorted(nodes, key=lambda name: int(name.split("-")[1])) == [f"gpu-{i}" for i in range(1, 303)]
        assert all(n.state == "idle" for n in nodes.values()), {n.state for n in nodes.values()}
        assert len(list((stack.slurm_base / "run").glob("node-*.pid"))) == 2  # a slurmd for gpu-1 and gpu-2 only
        await cli.update_node("gpu-300", "DRAIN", "recovery: XID 79 on a cloud node")
        drained = await cli.get_node("gpu-300")
        assert drained.drained and not drained.in_service and drained.reason == "recovery: XID 79 on a cloud node"
        await cli.update_node("gpu-300", "DOWN", "recovery: down")
        assert (await cli.get_node("gpu-300")).state == "down"
        job = cli_run(env, "sbatch", "--parsable", "--chdir=/tmp", "--output=/dev/null", "--wrap", "sleep 60").strip()
        running = poll(lambda: job_on(env, job), 30, f"job {job} to run")
        assert running in ("gpu-1", "gpu-2"), running
        cli_run(env, "scancel", job)
    finally:
        stack.stop_slurm()
    assert processes_of(stack) == []


def cli_run(env: dict[str, str], *argv: str) -> str:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True).stdout


def job_on(env: dict[str, str], job: str) -> str | None:
    """The node the job runs on, once it runs."""
    out = cli_run(env, "squeue", "-h", "-j", job, "-o", "%T %N").split()
    return out[1] if out and out[0] == "RUNNING" else None
