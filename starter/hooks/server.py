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
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager

import uvicorn
import uvloop
from starlette.types import ASGIApp
from temporalio.client import Client

from contracts.settings import Settings
from starter.hooks.app import HookApp
from starter.hooks.intake import Intake, JobPeers
from starter.hooks.settings import HookSettings
from starter.hooks.temporal import TemporalIncidents
from worker import connect

log = logging.getLogger("training_recovery.hooks")


def build_app(settings: Settings, hook: HookSettings, client: Client, job_peers: JobPeers | None = None) -> HookApp:
    incidents = TemporalIncidents(client, settings.task_queue, settings.policy())
    return HookApp(hook, Intake(incidents, hook.intake_limits(), job_peers=job_peers))


def _config(asgi: ASGIApp, hook: HookSettings) -> uvicorn.Config:
    return uvicorn.Config(asgi, host=hook.host, port=hook.port, http="httptools", lifespan="off",
                          access_log=hook.access_log, log_level="info", timeout_graceful_shutdown=10)


def serve(settings: Settings, hook: HookSettings) -> Coroutine[None, None, int]:
    """The server as a coroutine to run with asyncio.run: serves until SIGTERM or SIGINT (uvicorn
    finishes the requests in flight), then returns 0.

    Called before the event loop exists, so that the loop is uvloop's: it costs the hook about a
    tenth less CPU per request than asyncio's own (measured under the storm benchmark's load)."""
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return _serve(settings, hook)


async def _serve(settings: Settings, hook: HookSettings) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    client = await connect(settings)
    app = build_app(settings, hook, client)
    log.info("alert hooks on http://%s:%d (auth: %s) -> Temporal %s/%s, task queue %s", hook.host, hook.port,
             ",".join(hook.auth), settings.temporal_address, settings.temporal_namespace, settings.task_queue)
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
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await task
