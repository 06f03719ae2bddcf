"""The suite's Slurm clusters listen below the kernel's ephemeral range (Linux's default starts at
32768): a port in it may be held by any outgoing connection, and the daemon that wants it dies
("Unable to bind socket: Address already in use"). CI once lost all of test_local_stack so: its
base of 30800 put a root's slurmrestd on 32820."""

from __future__ import annotations

import pytest

from tests import conftest
from tests.integration import test_local_stack

LINUX_EPHEMERAL_START = 32768


@pytest.mark.parametrize(
    ("base", "above_base"),
    [
        (24800, conftest.PORTS_ABOVE_BASE),  # the session's clusters, by default
        (test_local_stack.PORT_BASE, test_local_stack.PORTS_ABOVE_BASE),
    ],
    ids=["session clusters", "test_local_stack"],
)
def test_every_cluster_port_lies_below_the_ephemeral_range(base, above_base):
    assert base + above_base < LINUX_EPHEMERAL_START
    assert conftest.ports_below_the_ephemeral_range(base, above_base, "base") == base


def test_a_base_whose_ports_reach_the_ephemeral_range_stops_the_suite_with_the_way_out():
    with pytest.raises(pytest.exit.Exception, match=r"base=30800: .* choose a base below"):
        conftest.ports_below_the_ephemeral_range(30800, 3200, "base")
