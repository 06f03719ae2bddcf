"""The fleet benchmark reads what it says: slurmctld's RPC counts by type from sdiag's text (22.05
has no --json), and the memory of every process under the cluster's pid files."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import fleet

# sdiag of a 22.05.8 cluster of the local stack (abridged): RPCs by type, then by user.
SDIAG = """*******************************************************
sdiag output at Sat Dec 05 14:52:40 2026 (1765039960)
Server thread count:  3
Agent queue size:     0

Remote Procedure Call statistics by message type
\tREQUEST_PING                            ( 1008) count:2      ave_time:306    total_time:612
\tREQUEST_PARTITION_INFO                  ( 2009) count:2      ave_time:700    total_time:1401
\tREQUEST_NODE_INFO                       ( 2007) count:12     ave_time:1067   total_time:2135
\tMESSAGE_NODE_REGISTRATION_STATUS        ( 1002) count:2      ave_time:139    total_time:279

Remote Procedure Call statistics by user
\troot            (       0) count:10     ave_time:593    total_time:5934

Pending RPC statistics
\tNo pending RPCs
"""


class Sdiag:
    async def run(self, *argv: str) -> str:
        assert argv == ("sdiag",)
        return SDIAG


async def test_sdiag_gives_rpcs_by_message_type_not_by_user_with_their_time():
    assert await fleet.sdiag_rpcs(Sdiag()) == {  # type: ignore[arg-type]
        "REQUEST_PING": (2, 612),
        "REQUEST_PARTITION_INFO": (2, 1401),
        "REQUEST_NODE_INFO": (12, 2135),
        "MESSAGE_NODE_REGISTRATION_STATUS": (2, 279),
    }


def test_memory_counts_every_process_under_each_pid_file(tmp_path):
    """A node's pid file names its unshare; its slurmd runs below it, and is counted."""
    run = tmp_path / "run"
    run.mkdir()
    grandchild = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    node = subprocess.Popen([sys.executable, "-c", grandchild])
    try:
        (run / "node-gpu-1.pid").write_text(f"{node.pid}\n")
        (run / "slurmctld.pid").write_text(f"{os.getpid()}\n")
        (run / "gone.pid").write_text("999999999\n")
        children = Path(f"/proc/{node.pid}/task/{node.pid}/children")
        deadline = time.monotonic() + 30
        while not children.read_text().split() or fleet._pss_kib(int(children.read_text().split()[0])) == 0:
            assert time.monotonic() < deadline, "the node's child did not start"
            time.sleep(0.05)
        [child] = map(int, children.read_text().split())

        memory = fleet.cluster_memory_mib(tmp_path)
        assert memory["slurmctld"] > 1 and memory["gone"] == 0
        both = (fleet._pss_kib(node.pid) + fleet._pss_kib(child)) / 1024
        assert (
            memory["slurmd"] == pytest.approx(both, abs=1.0) and memory["slurmd"] > fleet._pss_kib(node.pid) / 1024 + 1
        )
    finally:
        node.kill()
        node.wait()
