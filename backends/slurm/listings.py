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
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedListing(Generic[T]):
    def __init__(self, fetch: Callable[[], Awaitable[list[T]]]) -> None:
        self._fetch = fetch
        self._running: asyncio.Future[list[T]] | None = None
        # Listings are numbered as they begin (their task runs), not by a clock: "began after the
        # reader asked" must hold however coarse a clock would be.
        self._begun = 0
        self._running_number: int | None = None  # None: not begun yet, any reader may share it
        self.listings = 0  # listings made: what the benchmark and the tests count

    async def read(self) -> list[T]:
        """A listing that began after this call."""
        asked = self._begun
        while True:
            running = self._running
            if running is None:
                running = self._begin()
            elif self._running_number is not None and self._running_number <= asked:
                # It began before this reader asked and may miss a write that ended since: wait it
                # out and share the next one. If it failed, that failure came after the reader
                # asked: it is the reader's answer too (a hung slurmctld is not waited out twice).
                await asyncio.wait([running])
                if not running.cancelled() and (failure := running.exception()) is not None:
                    raise failure
                continue
            # Shielded: a reader cancelled (its activity timed out) leaves the others their listing.
            return list(await asyncio.shield(running))

    def _begin(self) -> asyncio.Future[list[T]]:
        self._running_number = None
        self.listings += 1
        running = asyncio.ensure_future(self._list())
        self._running = running
        running.add_done_callback(self._ended)
        return running

    async def _list(self) -> list[T]:
        self._begun += 1
        self._running_number = self._begun
        return await self._fetch()

    def _ended(self, listing: asyncio.Future[list[T]]) -> None:
        if self._running is listing:
            self._running = None
        if not listing.cancelled():
            listing.exception()  # retrieved: a failure is its readers' to raise, not the loop's to log
