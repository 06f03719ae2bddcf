"""The suite's Slurm clusters listen below the kernel's ephemeral range (Linux's default starts at
32768), each on ports of its own: a port in that range may be held by any outgoing connection, and
the daemon that wants it dies ("Unable to bind socket: Address already in use"). CI once lost all
of test_local_stack so: its base of 30800 put a root's slurmrestd on 32820."""

from __future__ import annotations

from itertools import combinations

import pytest

from drills.localstack import DEBIAN_RELEASE_OF_GENERATION, OTHER_GENERATION_PORT_OFFSET
from tests import conftest
from tests.integration import test_budget_storm, test_failures_together, test_local_stack
from tests.security import test_one_request_drains_the_fleet

LINUX_EPHEMERAL_START = 32768
SESSION_BASE = 24800  # RECOVERY_TEST_SLURM_PORT_BASE's default
# Each fixed stack's first and last port (a cluster's slurmd ports start 100 above its base)
STACKS = {
    "session clusters": (SESSION_BASE, SESSION_BASE + conftest.PORTS_ABOVE_BASE),
    "game days": (SESSION_BASE + conftest.PORTS_ABOVE_BASE, SESSION_BASE + conftest.PORTS_ABOVE_BASE + 200),
    "test_local_stack": (test_local_stack.PORT_BASE, test_local_stack.PORT_BASE + test_local_stack.PORTS_ABOVE_BASE),
}


@pytest.mark.parametrize("name", STACKS)
def test_every_cluster_port_lies_below_the_ephemeral_range(name):
    first, last = STACKS[name]
    assert last < LINUX_EPHEMERAL_START
    assert conftest.ports_below_the_ephemeral_range(first, last - first, "base") == first


def test_no_two_stacks_share_a_port():
    for (a, (a_first, a_last)), (b, (b_first, b_last)) in combinations(STACKS.items(), 2):
        assert a_last <= b_first or b_last <= a_first, (a, b)


# The clusters of their own beside each generation's session cluster: offset above its base, nodes.
# A cluster takes its base + 17 (slurmctld) to its base + 100 + its nodes (slurmd).
CLUSTERS_OF_A_GENERATION = {
    "session cluster (4 nodes, 1 spare)": (0, 5),
    "three spares": (test_failures_together.THREE_SPARES_PORT_OFFSET, 6),
    "storm": (test_budget_storm.STORM_PORT_OFFSET, test_budget_storm.NODES),
    "one request": (test_one_request_drains_the_fleet.PORT_OFFSET, test_one_request_drains_the_fleet.NODES),
}


def test_the_clusters_of_a_generation_share_no_port_and_stay_in_its_block():
    spans = {name: (offset + 17, offset + 100 + nodes) for name, (offset, nodes) in CLUSTERS_OF_A_GENERATION.items()}
    for (a, (a_first, a_last)), (b, (b_first, b_last)) in combinations(spans.items(), 2):
        assert a_last < b_first or b_last < a_first, (a, b)
    # A generation's clusters listen OTHER_GENERATION_PORT_OFFSET above the one before.
    highest = max(last for _, last in spans.values())
    assert highest < OTHER_GENERATION_PORT_OFFSET
    assert len(DEBIAN_RELEASE_OF_GENERATION) * OTHER_GENERATION_PORT_OFFSET + highest < conftest.PORTS_ABOVE_BASE


def test_a_base_whose_ports_reach_the_ephemeral_range_stops_the_suite_with_the_way_out():
    with pytest.raises(pytest.exit.Exception, match=r"base=30800: .* choose a base below"):
        conftest.ports_below_the_ephemeral_range(30800, 3200, "base")
