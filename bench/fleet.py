"""The fleet-scale cluster (issue #26): a real slurmctld holding FLEET_CLOUD_NODES nodes without a
slurmd (powered-down cloud nodes, which Slurm lists and lets you drain) beside FLEET_SLURMD_NODES
real slurmd, on this one machine. What it costs to start and to hold, and what reading its nodes
costs (time, bytes and slurmctld's RPCs, from sdiag), against the bench's 5-node cluster in the
same run. The reply sizes per node are what the scale harness needs to answer like a cluster of
N = 10,000.

The storms on it (100 and 1,000 simultaneous failures) are still to come: see issue #26.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from backends.slurm import SlurmCli
from backends.slurm.rest import ENDPOINTS, SlurmRest, TokenFile
from bench.stack import bench_local_stack, say
from bench.table import Row, median, row
from drills.localstack import LocalStack

FLEET_SLURMD_NODES = 64
FLEET_CLOUD_NODES = 2000
BASELINE_SLURMD_NODES = 5  # the local stack's size
# Above the bench's own cluster, within its generation's block of ports (slurmd at +100 + node).
BASELINE_PORT_OFFSET, FLEET_PORT_OFFSET = 300, 500
QUICK_CLOUD_NODES = 200
QUICK_SLURMD_NODES = 8
# `sdiag` (22.05 has no --json): "\tREQUEST_NODE_INFO  ( 2007) count:12  ave_time:1043  total_time:12516"
_SDIAG_RPC = re.compile(r"^\s+([A-Z_]+)\s+\(\s*\d+\)\s+count:(\d+)\s+ave_time:\d+\s+total_time:(\d+)", re.MULTILINE)
# The RPCs a node listing makes (sinfo and scontrol: the nodes and their partitions).
LISTING_RPCS = ("REQUEST_NODE_INFO", "REQUEST_NODE_INFO_SINGLE", "REQUEST_PARTITION_INFO")


def fleet_local_stack(name: str, slurmd_nodes: int, cloud_nodes: int, port_offset: int) -> LocalStack:
    """A cluster of its own beside the bench's (its state dir, `port_offset` above its ports): never
    the bench's own cluster, which a run may have found running and must leave as it was."""
    bench = bench_local_stack()
    return dataclasses.replace(
        bench,
        state_dir=bench.state_dir / name,
        slurm_port_base=bench.slurm_port_base + port_offset,
        slurm_nodes=slurmd_nodes,
        slurm_spares=0,
        slurm_cloud_nodes=cloud_nodes,
    )


class CountingCli(SlurmCli):
    """The Slurm CLI backend, counting the bytes its commands print."""

    printed = 0

    async def run(self, *argv: str) -> str:
        out = await super().run(*argv)
        self.printed += len(out.encode())
        return out


@dataclass
class Reads:
    """Reading every node of one cluster `runs` times: through the worker's CLI backend (the
    command, its JSON, the models), and as slurmrestd's raw GET /nodes of the newest version it
    serves (no parsing; the worker lists nodes over REST from v0.0.40 on, over the CLI on 22.05)."""

    nodes: int
    cli_seconds: list[float]
    cli_bytes: int  # one listing
    rest_seconds: list[float]
    rest_bytes: int
    rpcs_per_listing: dict[str, float]  # slurmctld's listing RPCs by type, per CLI listing (sdiag)
    slurmctld_us_per_listing: float  # those RPCs' time in slurmctld (sdiag's total_time), per listing


@dataclass
class ClusterCost:
    slurmd: int
    nodes: int
    start_seconds: float
    memory_mib: dict[str, float]  # proportional set size of the cluster's processes, by daemon


@dataclass
class FleetResult:
    cost: ClusterCost
    small_cost: ClusterCost
    fleet: Reads
    small: Reads

    def rows(self) -> list[Row]:
        big, small = self.fleet, self.small
        what = f"{big.nodes:,} nodes (baseline: {small.nodes})"
        return [
            row(
                f"fleet cluster: start, {self.cost.slurmd} slurmd + {self.cost.nodes - self.cost.slurmd:,} cloud nodes "
                f"(baseline: {self.small_cost.slurmd} slurmd)",
                self.cost.start_seconds,
                "s",
                self.small_cost.start_seconds,
                digits=1,
            ),
            row(
                f"fleet cluster: memory of its daemons (baseline: {self.small_cost.slurmd} slurmd)",
                sum(self.cost.memory_mib.values()),
                "MiB",
                sum(self.small_cost.memory_mib.values()),
                digits=0,
            ),
            *(
                row(f"full node listing, {path}{measure}, {what}", ours, unit, baseline, digits=digits)
                for path, (big_seconds, big_bytes), (small_seconds, small_bytes) in (
                    ("CLI backend", (big.cli_seconds, big.cli_bytes), (small.cli_seconds, small.cli_bytes)),
                    ("raw GET /nodes", (big.rest_seconds, big.rest_bytes), (small.rest_seconds, small.rest_bytes)),
                )
                for measure, ours, baseline, unit, digits in (
                    ("", (median(big_seconds) or 0) * 1000, (median(small_seconds) or 0) * 1000, "ms", 1),
                    (" bytes", big_bytes / 1024, small_bytes / 1024, "KiB", 0),
                )
            ),
            row(
                f"slurmctld RPCs per node listing, {what}",
                sum(big.rpcs_per_listing.values()),
                "",
                sum(small.rpcs_per_listing.values()),
                digits=1,
            ),
            row(
                f"slurmctld time per node listing (sdiag), {what}",
                big.slurmctld_us_per_listing / 1000,
                "ms",
                small.slurmctld_us_per_listing / 1000,
                digits=2,
            ),
        ]

    def details(self) -> str:
        lines = []
        for name, cost, reads in (("fleet", self.cost, self.fleet), ("baseline", self.small_cost, self.small)):
            per_node = reads.rest_bytes / reads.nodes if reads.nodes else 0
            lines.append(
                f"  {name}: {reads.nodes} nodes ({cost.slurmd} slurmd), started in {cost.start_seconds:.1f} s; "
                f"memory (MiB, PSS) {cost.memory_mib}; CLI listing {reads.cli_bytes:,} B, REST {reads.rest_bytes:,} B "
                f"({per_node:,.0f} B per node); RPCs per listing {reads.rpcs_per_listing}, "
                f"{reads.slurmctld_us_per_listing:,.0f} µs in slurmctld; "
                f"CLI (s) {[round(s, 3) for s in reads.cli_seconds]}, "
                f"REST (s) {[round(s, 3) for s in reads.rest_seconds]}"
            )
        return "\n".join(lines)


async def run(runs: int, quick: bool) -> FleetResult:
    slurmd, cloud = (QUICK_SLURMD_NODES, QUICK_CLOUD_NODES) if quick else (FLEET_SLURMD_NODES, FLEET_CLOUD_NODES)
    small_cost, small = await _measure(
        fleet_local_stack("fleet-baseline", BASELINE_SLURMD_NODES, 0, BASELINE_PORT_OFFSET), runs
    )
    cost, fleet = await _measure(fleet_local_stack("fleet", slurmd, cloud, FLEET_PORT_OFFSET), runs)
    return FleetResult(cost, small_cost, fleet, small)


async def _measure(stack: LocalStack, runs: int) -> tuple[ClusterCost, Reads]:
    """Start the stack's cluster from a clean state, read it, stop it."""
    await asyncio.to_thread(stack.stop_slurm)
    started = time.monotonic()
    cluster = await asyncio.to_thread(stack.start_slurm, True)
    start_seconds = time.monotonic() - started
    try:
        memory = cluster_memory_mib(stack.slurm_base)
        cli = CountingCli(slurm_conf=cluster["SLURM_CONF"], bin_dir=cluster.get("SLURM_BIN_DIR", ""), timeout=120)
        slurmd = len(list((stack.slurm_base / "run").glob("node-*.pid")))
        reads = await _read_nodes(cli, cluster, runs)
        say(f"{stack.slurm_base}: {reads.nodes} nodes, {slurmd} slurmd, up in {start_seconds:.1f} s")
        return ClusterCost(slurmd, reads.nodes, start_seconds, memory), reads
    finally:
        await asyncio.to_thread(stack.stop_slurm)


async def _read_nodes(cli: CountingCli, cluster: dict[str, str], runs: int) -> Reads:
    rest = SlurmRest(
        cluster["SLURMRESTD_URL"],
        cluster["SLURMRESTD_USER"],
        TokenFile(Path(cluster["SLURMRESTD_TOKEN_FILE"])),
        timeout=120,
    )
    try:
        version = await rest.discover()
        await cli.version()  # asked once per client: not inside the first timed listing
        before = await sdiag_rpcs(cli)
        cli_seconds, printed = [], 0
        for _ in range(runs):
            cli.printed = 0
            started = time.monotonic()
            nodes = await cli.list_nodes()
            cli_seconds.append(time.monotonic() - started)
            printed = cli.printed
        after = await sdiag_rpcs(cli)
        counts = {k: (after[k][0] - before.get(k, (0, 0))[0]) / runs for k in LISTING_RPCS if k in after}
        counts = {k: v for k, v in counts.items() if v > 0}
        slurmctld_us = sum(after[k][1] - before.get(k, (0, 0))[1] for k in LISTING_RPCS if k in after) / runs
        rest_seconds, rest_bytes = [], 0
        _, path, _, _ = ENDPOINTS["list_nodes"]
        token = TokenFile(Path(cluster["SLURMRESTD_TOKEN_FILE"]))
        headers = {"X-SLURM-USER-NAME": cluster["SLURMRESTD_USER"]}
        async with httpx.AsyncClient(base_url=cluster["SLURMRESTD_URL"], timeout=120) as http:
            for _ in range(runs):
                started = time.monotonic()
                response = await http.get(f"/slurm/{version}{path}", headers={**headers, "X-SLURM-USER-TOKEN": token()})
                response.raise_for_status()
                rest_seconds.append(time.monotonic() - started)
                rest_bytes = len(response.content)
        return Reads(len(nodes), cli_seconds, printed, rest_seconds, rest_bytes, counts, slurmctld_us)
    finally:
        await rest.aclose()


async def sdiag_rpcs(cli: SlurmCli) -> dict[str, tuple[int, int]]:
    """slurmctld's RPCs by message type since its start (or the last `sdiag -r`): their count and
    their total time in slurmctld (microseconds)."""
    text = await cli.run("sdiag")
    by_type = text.split("Remote Procedure Call statistics by user")[0]
    return {name: (int(count), int(total)) for name, count, total in _SDIAG_RPC.findall(by_type)}


def cluster_memory_mib(slurm_base: Path) -> dict[str, float]:
    """The proportional set size (MiB) of the cluster's processes, by daemon: every process under
    a pid file of its run dir (a node's: unshare, its init and its slurmd)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    by_daemon: dict[str, float] = {}
    for pidfile in sorted((slurm_base / "run").glob("*.pid")):
        daemon = "slurmd" if pidfile.name.startswith("node-") else pidfile.stem
        try:
            tree = [int(pidfile.read_text().strip())]
        except (OSError, ValueError):
            continue
        for pid in tree:
            tree.extend(children.get(pid, []))
        by_daemon[daemon] = round(by_daemon.get(daemon, 0.0) + sum(_pss_kib(pid) for pid in tree) / 1024, 1)
    return by_daemon


def _pss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    found = re.search(r"^Pss:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else 0
