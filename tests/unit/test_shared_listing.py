"""One full listing at a time, shared by the worker's readers (backends/slurm/listings.py): N readers
at once cost two listings, not N, and none gets a listing that began before it asked (an incident
reads back its own drain)."""

from __future__ import annotations

import asyncio

import pytest

from backends.slurm.api import SlurmNotFound
from backends.slurm.client import SlurmClient
from backends.slurm.listings import SharedListing
from contracts.models import SlurmNode


class Cluster:
    """A listing that takes until `release` is set, and shows the state as it was when it began."""

    def __init__(self) -> None:
        self.state = 0
        self.began: list[int] = []
        self.release = asyncio.Event()
        self.release.set()
        self.fail = False

    async def fetch(self) -> list[int]:
        seen = self.state
        self.began.append(seen)
        await self.release.wait()
        if self.fail:
            raise RuntimeError("slurmctld did not answer")
        return [seen]


async def test_a_thousand_readers_at_once_share_one_listing():
    cluster = Cluster()
    shared = SharedListing(cluster.fetch)
    results = await asyncio.gather(*(shared.read() for _ in range(1000)))
    assert shared.listings == 1 and all(r == [0] for r in results)


async def test_a_reader_never_gets_a_listing_that_began_before_it_asked():
    cluster = Cluster()
    shared = SharedListing(cluster.fetch)
    cluster.release.clear()
    early = asyncio.ensure_future(shared.read())
    while not cluster.began:  # the listing has begun, before the write
        await asyncio.sleep(0)
    cluster.state = 1  # a drain, ended before the next readers ask
    late = [asyncio.ensure_future(shared.read()) for _ in range(500)]
    await asyncio.sleep(0)
    cluster.release.set()
    assert await early == [0]
    assert {tuple(await r) for r in late} == {(1,)}  # the next listing, shared by all 500
    assert shared.listings == 2 and cluster.began == [0, 1]


async def test_a_cancelled_reader_leaves_the_others_their_listing():
    cluster = Cluster()
    shared = SharedListing(cluster.fetch)
    cluster.release.clear()
    cancelled, kept = asyncio.ensure_future(shared.read()), asyncio.ensure_future(shared.read())
    await asyncio.sleep(0)
    cancelled.cancel()
    cluster.release.set()
    assert await kept == [0] and shared.listings == 1
    with pytest.raises(asyncio.CancelledError):
        await cancelled


async def test_a_failed_listing_fails_its_readers_and_the_next_read_lists_again():
    cluster = Cluster()
    shared = SharedListing(cluster.fetch)
    cluster.fail = True
    failed = await asyncio.gather(shared.read(), shared.read(), return_exceptions=True)
    assert [type(f) for f in failed] == [RuntimeError, RuntimeError] and shared.listings == 1
    cluster.fail = False
    assert await shared.read() == [0] and shared.listings == 2


async def test_a_listing_that_fails_after_a_reader_asked_is_its_answer_too():
    """A hung slurmctld is not waited out twice: the reader who asked while a listing ran gets its
    failure, not a second listing and a second time-out."""
    cluster = Cluster()
    shared = SharedListing(cluster.fetch)
    cluster.release.clear()
    early = asyncio.ensure_future(shared.read())
    while not cluster.began:
        await asyncio.sleep(0)
    late = asyncio.ensure_future(shared.read())
    await asyncio.sleep(0)
    cluster.fail = True
    cluster.release.set()
    for reader in (early, late):
        with pytest.raises(RuntimeError, match="did not answer"):
            await reader
    assert shared.listings == 1


class NodesBackend:
    """A backend whose every node read lists the cluster, counted."""

    path = "cli"
    dry_run = False

    def __init__(self) -> None:
        self.listings = 0

    def supports(self, operation: str) -> bool:
        return True

    async def list_nodes(self) -> list[SlurmNode]:
        self.listings += 1
        await asyncio.sleep(0.01)
        return [SlurmNode(name=f"gpu-{i}", state="idle") for i in range(1, 2001)]


async def test_the_clients_node_reads_and_its_dry_run_twins_share_the_listings():
    backend = NodesBackend()
    client = SlurmClient(backend)  # type: ignore[arg-type]
    twin = client.planning()
    nodes = await asyncio.gather(*(c.get_node(f"gpu-{i}") for i in range(1, 1001) for c in (client, twin)))
    assert [n.name for n in nodes[::2]] == [f"gpu-{i}" for i in range(1, 1001)]
    assert backend.listings == 1
    with pytest.raises(SlurmNotFound):
        await client.get_node("gpu-9999")
