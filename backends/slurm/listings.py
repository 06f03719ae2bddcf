"""One full listing of the cluster at a time, shared by every reader in the worker.

Slurm has no cheap read of one node on every generation and path (22.05's `sinfo --json` ignores
-n, slurmrestd's node read lists them all), and an incident reads nodes and jobs many times: a
storm of N incidents made N full listings at once, each the size of the cluster, on the single
slurmctld. Here a reader gets a listing that began after it asked, so it sees every write that had
ended by then (an incident reads back its own drain), and every reader who asks while one listing
runs shares the next: N readers at once cost two listings, not N.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedListing(Generic[T]):
    def __init__(self, fetch: Callable[[], Awaitable[list[T]]], clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._clock = clock
        self._running: asyncio.Future[list[T]] | None = None
        self._running_began = 0.0
        self.listings = 0  # listings made: what the benchmark and the tests count

    async def read(self) -> list[T]:
        """A listing that began no earlier than this call."""
        asked = self._clock()
        while True:
            running = self._running
            if running is None:
                running = self._begin()
            elif self._running_began < asked:
                # It began before this reader asked and may miss a write that ended since: wait it
                # out (whatever it came to) and share the next one.
                await asyncio.wait([running])
                continue
            # Shielded: a reader cancelled (its activity timed out) leaves the others their listing.
            return list(await asyncio.shield(running))

    def _begin(self) -> asyncio.Future[list[T]]:
        # Not begun until its task runs: a reader who asks before then may share it.
        self._running_began = math.inf
        self.listings += 1
        running = asyncio.ensure_future(self._list())
        self._running = running
        running.add_done_callback(self._ended)
        return running

    async def _list(self) -> list[T]:
        self._running_began = self._clock()
        return await self._fetch()

    def _ended(self, listing: asyncio.Future[list[T]]) -> None:
        if self._running is listing:
            self._running = None
        if not listing.cancelled():
            listing.exception()  # retrieved: a failure is its readers' to raise, not the loop's to log
