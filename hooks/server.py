"""Running the hook server: `recovery hooks`, and in-process for the tests.

uvicorn with httptools and uvloop: a small, well-kept ASGI server whose HTTP parser and event loop
are C; one process, one event loop, because the work per alert is small and the Temporal client multiplexes every
hand-over over one connection (docs/alert-hooks.md, "Why this stack").
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from datetime import timedelta

import uvicorn
import uvloop
from temporalio.client import Client

from activities.xid_policy import XidPolicyTable
from backends.slurm.cli import SlurmCli
from backends.slurm.rest import SlurmRest
from contracts.models import FaultClass
from contracts.settings import ConfigError, Settings
from hooks.app import ASGIApp, HookApp
from hooks.correlation import RunningIncidents
from hooks.intake import Intake
from hooks.inventory import EveryNode, NodeInventory, SlurmInventory
from hooks.protocol import ConnectionLimits, guarded_protocol
from hooks.settings import HookSettings
from hooks.temporal import CLIENT_OPTIONS, TemporalIncidents
from worker import connect, slurmrestd_token

log = logging.getLogger("training_recovery.hooks")


def check_secondary_xids(settings: Settings, hook: HookSettings) -> None:
    """Raise ConfigError when a secondary XID is one the XID policy classes fatal or degrading: a
    node's own failure must never join another node's incident."""
    table = XidPolicyTable(settings.xid_policy_file)
    primary = sorted(
        x for x in hook.secondary_xids if table.classify(x).fault_class in (FaultClass.FATAL, FaultClass.DEGRADING)
    )
    if primary:
        raise ConfigError(
            f"RECOVERY_HOOKS_SECONDARY_XIDS: XID {', '.join(map(str, primary))} is fatal or degrading "
            f"in {table.path}: a node's own failure, never joined to another node's incident"
        )


def node_inventory(settings: Settings, hook: HookSettings) -> NodeInventory:
    """The cluster's nodes as RECOVERY_HOOKS_INVENTORY says; unset, Slurm's when SLURM_CONF (or, with
    RECOVERY_SLURM_CLI=false, slurmrestd) says where Slurm is. Off by default otherwise: a hook on a
    host with no Slurm configuration would fail closed and refuse every alert."""
    knows_slurm = settings.slurm_conf or not settings.slurm_cli
    if (hook.inventory or ("slurm" if knows_slurm else "off")) == "off":
        if hook.inventory is None:
            log.warning(
                "no SLURM_CONF and RECOVERY_HOOKS_INVENTORY unset: alerts on nodes the cluster does not "
                "have are not refused"
            )
        return EveryNode()
    if settings.slurm_cli:
        cli = SlurmCli(slurm_conf=settings.slurm_conf, bin_dir=settings.slurm_bin_dir)

        async def node_names() -> list[str]:
            return [node.name for node in await cli.list_nodes()]

    else:
        # Settings checked that slurmrestd is configured; its version is found at the first read.
        rest = SlurmRest(settings.slurmrestd_url or "", settings.slurmrestd_user, slurmrestd_token(settings) or "")

        async def node_names() -> list[str]:
            if rest.version is None:
                await rest.discover()
            return [node.name for node in await rest.list_nodes()]

    return SlurmInventory(node_names, hook.inventory_ttl_seconds)


def build_app(settings: Settings, hook: HookSettings, client: Client) -> HookApp:
    """The hook on this Temporal client (its configuration checked first)."""
    check_secondary_xids(settings, hook)
    incidents = TemporalIncidents(client, settings.task_queue, settings.policy())
    calls: Counter[str] = Counter()
    directory = RunningIncidents(client, timedelta(seconds=hook.correlation_refresh_seconds), calls)
    return HookApp(
        hook,
        Intake(incidents, hook.intake_limits(), directory=directory, temporal_calls=calls),
        node_inventory(settings, hook),
    )


def _config(asgi: ASGIApp, hook: HookSettings) -> uvicorn.Config:
    # proxy_headers off: the hook uses no client address, so X-Forwarded-* need no parsing per request.
    limits = ConnectionLimits(
        max_header_bytes=hook.max_header_bytes,
        header_timeout=hook.header_timeout_seconds,
        max_connections=hook.max_connections,
    )
    return uvicorn.Config(
        asgi,
        host=hook.host,
        port=hook.port,
        http=guarded_protocol(limits),
        lifespan="off",
        proxy_headers=False,
        access_log=hook.access_log,
        log_level="info",
        timeout_graceful_shutdown=10,
        ssl_certfile=hook.tls_cert_file,
        ssl_keyfile=hook.tls_key_file,
    )


def serve(settings: Settings, hook: HookSettings) -> Coroutine[None, None, int]:
    """The server as a coroutine to run with asyncio.run: serves until SIGTERM or SIGINT (uvicorn
    finishes the requests in flight), then returns 0.

    Called before the event loop exists, so that the loop is uvloop's: it costs the hook about a
    tenth less CPU per request than asyncio's own (measured under the storm benchmark's load)."""
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return _serve(settings, hook)


async def _serve(settings: Settings, hook: HookSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_secondary_xids(settings, hook)  # a bad configuration is refused before anything is dialled
    client = await connect(settings, **CLIENT_OPTIONS)
    app = build_app(settings, hook, client)
    log.info(
        "alert hooks on %s://%s:%d (auth: %s) -> Temporal %s/%s, task queue %s",
        "https" if hook.tls_cert_file else "http",
        hook.host,
        hook.port,
        ",".join(hook.auth),
        settings.temporal_address,
        settings.temporal_namespace,
        settings.task_queue,
    )
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again for the handler
    # that was there before; that one is this no-op, so the command ends with 0, like the worker.
    before = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        await uvicorn.Server(_config(app.asgi(), hook)).serve()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    log.info("alert hooks stopped")
    return 0


@asynccontextmanager
async def listening(asgi: ASGIApp, hook: HookSettings, start_timeout: float = 10.0) -> AsyncIterator[str]:
    """Serve in this event loop while the block runs; yields the base URL (port 0 picks a free one)."""
    server = uvicorn.Server(_config(asgi, hook))
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start
            raise RuntimeError("the hook server stopped before it started")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the hook server did not start within {start_timeout} s")
        await asyncio.sleep(0.01)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"{'https' if hook.tls_cert_file else 'http'}://{host}:{port}"
    finally:
        server.should_exit = True
        await task
