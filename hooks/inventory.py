"""The cluster's nodes, as the hook checks alerts against them: an alert naming a node the cluster
does not have is refused (docs/alert-hooks.md, "Unknown nodes"), so a sender cannot open incidents,
or fill the hook's memory, with names that are no node.

SlurmInventory reads the node names through the project's Slurm client (read only: `scontrol show
node --json`, or 22.05's `sinfo --json`) and keeps them for a TTL; concurrent requests share one read.
When a read fails it keeps the names it had (logged); with none yet, the hook fails closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Protocol

log = logging.getLogger("training_recovery.hooks")


class InventoryUnavailable(Exception):
    """The cluster's nodes could not be read, and none are known from before."""


class NodeInventory(Protocol):
    async def unknown(self, nodes: Iterable[str]) -> list[str]:
        """The nodes the cluster does not have, in order, each once. Raises InventoryUnavailable."""


class EveryNode:
    """RECOVERY_HOOKS_INVENTORY=off: every well-formed node name is taken as a node."""

    async def unknown(self, nodes: Iterable[str]) -> list[str]:
        return []


class SlurmInventory:
    # After a failed read, the next one no sooner than this (or the TTL, if shorter): Slurm being
    # down must not cost a call per request, nor fail the hook closed for a whole TTL.
    RETRY_AFTER_FAILURE = 5.0

    def __init__(
        self,
        list_names: Callable[[], Awaitable[Collection[str]]],
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._list_names = list_names
        self._ttl = ttl
        self._clock = clock
        self._names: frozenset[str] | None = None
        self._failure: InventoryUnavailable | None = None  # the last read's, while no names are known
        self._next_read_at = float("-inf")  # clock()
        self._read: asyncio.Task[None] | None = None
        self.reads = 0  # reads of the cluster's nodes

    async def unknown(self, nodes: Iterable[str]) -> list[str]:
        if self._clock() >= self._next_read_at:
            if self._read is None:
                self._read = asyncio.create_task(self._refresh())
            await asyncio.shield(self._read)
        if self._names is None:
            assert self._failure is not None
            raise self._failure
        names = self._names
        return list(dict.fromkeys(n for n in nodes if n not in names))

    async def _refresh(self) -> None:
        try:
            self.reads += 1
            self._names, self._failure = frozenset(await self._list_names()), None
            self._next_read_at = self._clock() + self._ttl
        except Exception as e:
            log.warning(
                "the cluster's nodes could not be read (%s: %s): %s",
                type(e).__name__,
                e,
                "refusing every alert" if self._names is None else f"keeping the {len(self._names)} known",
            )
            if self._names is None:
                self._failure = InventoryUnavailable(f"the cluster's nodes could not be read ({type(e).__name__})")
            self._next_read_at = self._clock() + min(self._ttl, self.RETRY_AFTER_FAILURE)
        finally:
            self._read = None
