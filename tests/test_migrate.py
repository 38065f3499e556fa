"""A draining node's migration, with a master and two nodes in this process over real
loopback sockets: every chunk is copied node to node and checked on arrival; a chunk that
went bad in the draining node's memory is refused there, found bad here too, and dropped
(never copied, never served again); new layers that land during the drain are copied by a
later pass; a draining node grants no writer a slot; undrain stops the passes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch

from kvstore.control.client import MasterClient
from kvstore.control.records import Tier
from kvstore.dataplane import NodeClient
from kvstore.dataplane.messages import ChunkRef, PutChunk
from kvstore.master import MasterConfig, MasterServer
from kvstore.node.server import NodeConfig, StorageNode
from tests.test_node import NS, TIMEOUT, blocks, chunks


@pytest.fixture
async def pool() -> AsyncIterator[tuple[MasterServer, StorageNode, StorageNode]]:
    master = MasterServer(MasterConfig(grpc_port=0))
    await master.start()
    nodes = []
    for name in ("a-drains", "b-stays"):
        config = NodeConfig(master=master.address, data_port=0, host_mem=32 * 2**20,
                            node_id=name, sweep_s=0.1)  # fmt: skip
        node = StorageNode(config, master=MasterClient.in_process(master.service))
        await node.start()
        nodes.append(node)
    try:
        yield master, nodes[0], nodes[1]
    finally:
        for node in nodes:
            await node.stop(grace=1.0)
        await master.stop(grace=0.5)
    for node in nodes:
        assert node.pinned_slots == 0
        for tier in node.tiers:
            tier.table.validate()


async def _put(node: StorageNode, keys: list[bytes], rows: torch.Tensor, layer: int = 0) -> int:
    spec = [PutChunk(k, None, layer, rows.shape[1]) for k in keys]
    ack = await NodeClient(node.data_uri, timeout_s=TIMEOUT).put(
        NS.canonical_bytes(), spec, [r.numpy() for r in rows]
    )
    return ack.stored


async def _read(node: StorageNode, keys: list[bytes], layer: int = 0) -> list[torch.Tensor | None]:
    """Chunk ``layer`` of each block as ``node`` serves it (None: not there)."""
    bufs: dict[int, torch.Tensor] = {}

    def into(found: list[int]) -> list[object]:
        bufs.update((i, torch.empty(_CHUNK, dtype=torch.uint8)) for i in found)
        return [bufs[i].numpy() for i in found]

    refs = [ChunkRef(k, layer) for k in keys]
    await NodeClient(node.data_uri, timeout_s=TIMEOUT).get(NS.id, refs, into)
    return [bufs.get(i) for i in range(len(keys))]


_CHUNK = chunks(blocks(1)).shape[1]


async def _holders(master: MasterServer, keys: list[bytes]) -> list[set[str]]:
    found = await MasterClient.in_process(master.service).lookup(NS.id, keys)
    return [{h.node_id for h in block} for block in found]


async def test_migration_copies_every_good_chunk_and_drops_a_bad_one(
    pool: tuple[MasterServer, StorageNode, StorageNode],
) -> None:
    master, a, b = pool
    keys = blocks(6)
    rows = chunks(keys)
    assert await _put(a, keys, rows) == 6
    # Chunk 2 goes bad in a's memory after it was stored (a flipped payload bit).
    tier, slot = a.tiers.lookup((NS.id, keys[2]))  # type: ignore[misc]
    tier.table.chunk_view(slot, 0)[-1] ^= 0x01

    done = await a.drain_and_wait(10.0)
    assert done["drain_state"] == "done" and done["drain_left"] == 0, done
    assert (done["drain_moved_chunks"], done["drain_dropped"], done["drain_failed"]) == (5, 1, 0)
    assert done["drain_moved_bytes"] == 5 * _CHUNK
    got = await _read(b, keys)
    for i, chunk in enumerate(got):
        if i == 2:
            assert chunk is None  # refused by b, dropped by a: never copied
        else:
            assert chunk is not None and torch.equal(chunk, rows[i])
    assert (await _read(a, [keys[2]])) == [None]  # a no longer serves it either
    deadline = asyncio.get_running_loop().time() + 5
    while "a-drains" in (await _holders(master, [keys[2]]))[0]:  # the drop is committed
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    held = await _holders(master, keys)
    assert [("b-stays" in h) for h in held] == [i != 2 for i in range(6)]


async def test_chunks_landing_during_the_drain_are_copied_and_undrain_stops(
    pool: tuple[MasterServer, StorageNode, StorageNode],
) -> None:
    master, a, b = pool
    keys = blocks(3)
    rows0, rows1 = chunks(keys, 0), chunks(keys, 1)
    assert await _put(a, keys, rows0) == 3
    first = await a.drain_and_wait(10.0)
    assert first["drain_moved_chunks"] == 3
    assert not a.puts.granting  # no writer is granted a slot here while it drains
    # A writer still holding the old node list puts layer 1 of the same blocks on a; then
    # SIGTERM's drain (the node is draining and was "done" already) must copy it first.
    assert await _put(a, keys, rows1, layer=1) == 3
    again = await a.drain_and_wait(10.0)
    assert again["drain_state"] == "done" and again["drain_moved_chunks"] == 6, again
    assert all(
        c is not None and torch.equal(c, rows1[i]) for i, c in enumerate(await _read(b, keys, 1))
    )
    # Undrain: the passes stop; the copies made stay as extra copies.
    a._leaving = False
    a._on_draining(False)
    assert a.puts.granting and a.migration.counters()["drain_state"] == "idle"
    more = blocks(2)
    assert await _put(a, more, chunks(more)) == 2
    await asyncio.sleep(0.5)
    assert await _holders(master, more) == [{"a-drains"}, {"a-drains"}]
    assert all(h == {"a-drains", "b-stays"} for h in await _holders(master, keys))


async def test_a_node_never_copies_to_its_own_address(
    pool: tuple[MasterServer, StorageNode, StorageNode],
) -> None:
    """A restarted node's old record (another id, this node's data URI) may still be live
    at the master: copies sent there would land back here and leave with the node."""
    master, a, b = pool
    big = [Tier("host", 2**40, 0)]  # (ranks first for every block: the most free room)
    await MasterClient.in_process(master.service).register("ghost-of-a", a.data_uri, tiers=big)
    keys = blocks(8)
    assert await _put(a, keys, chunks(keys)) == 8
    done = await a.drain_and_wait(10.0)
    assert done["drain_state"] == "done" and done["drain_moved_chunks"] == 8, done
    assert all(c is not None for c in await _read(b, keys))  # every block went to b
