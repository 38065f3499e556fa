"""The storage node in this process, against a real master: group commit, and verification
of landed chunks split over the verifier threads, over ``tcp://`` and ``ucx://``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import xxhash

from kvstore.core import headers
from kvstore.core.arena import Arena, populate
from kvstore.core.codec import ChunkKey, chunk_nbytes, encode_blocks
from kvstore.core.hashing import Namespace
from kvstore.dataplane import NodeClient
from kvstore.dataplane.messages import (
    Ack,
    ChunkRef,
    Found,
    Get,
    Landed,
    Put,
    PutChunk,
    Ready,
    expect,
)
from kvstore.errors import TransportError
from kvstore.master import BlockAdd, MasterClient, MasterConfig, MasterServer, ObjectAdd
from kvstore.node import checks, scrub
from kvstore.node.server import NodeConfig, StorageNode
from kvstore.node.tiers import Tiers
from kvstore.transport import Connection, connect
from tests import thp
from tests.cluster import TRANSPORTS

H, D, TOKENS = 8, 64, 64
"""Chunks of 128 KiB payload."""
NS = Namespace(model="node-test", revision="1", num_layers=2, num_kv_heads=H, head_dim=D,
               dtype=torch.bfloat16, block_tokens=TOKENS, quant="none")  # fmt: skip
TIMEOUT = 10.0
CHUNK_BYTES = chunk_nbytes(TOKENS, H, D, torch.bfloat16, "none")


@dataclass
class Rig:
    master: MasterServer
    node: StorageNode

    async def holders(self, blocks: list[bytes]) -> list[int]:
        """How many chunks of each block the master's index has."""
        found = await MasterClient.in_process(self.master.service).lookup(NS.id, blocks, 2)
        return [sum(bin(h.mask).count("1") for h in hs) for hs in found]


@asynccontextmanager
async def running(transport: str, **options: Any) -> AsyncIterator[Rig]:
    """A master and a node in this process (``options``: more NodeConfig fields); on exit
    no slot may stay pinned and every tier's table must validate."""
    master = MasterServer(MasterConfig(grpc_port=0))
    await master.start()
    config = NodeConfig(**{"master": master.address, "data_port": 0, "host_mem": 32 * 2**20,
                           "transport": transport, **options})  # fmt: skip
    node = StorageNode(config, master=MasterClient.in_process(master.service))
    await node.start()
    try:
        yield Rig(master, node)
    finally:
        await node.stop(grace=1.0)
        await master.stop(grace=0.5)
    assert node.pinned_slots == 0
    for tier in node.tiers:
        tier.table.validate()


@pytest.fixture(params=TRANSPORTS)
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    async with running(request.param) as rig:
        yield rig


@pytest.fixture(params=TRANSPORTS)
async def strict(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    """A node that checks every byte of a ucx:// put before its ack (no scrub)."""
    async with running(request.param, scrub_bytes=0) as rig:
        yield rig


def blocks(n: int) -> list[bytes]:
    tag = uuid.uuid4().hex
    return [xxhash.xxh3_128_digest(f"{tag}/{i}".encode()) for i in range(n)]


def chunks(keys: list[bytes], layer: int = 0) -> torch.Tensor:
    """``[len(keys), chunk_bytes]`` encoded chunks of ``layer`` for these blocks."""
    kv = torch.randn(2, len(keys) * TOKENS, H, D).bfloat16()
    out = encode_blocks(kv, TOKENS, [ChunkKey(k, layer, 0) for k in keys], "none")
    return torch.stack(out)


async def put(
    conn: Connection,
    node: StorageNode,
    keys: list[bytes],
    rows: torch.Tensor,
    op: str | None = None,
    layer: int = 0,
) -> Ack:
    """One put exchange of ``layer``'s chunks; ``op`` "put" (tcp://) or "reserve" (ucx://),
    by default the one of ``node``'s transport; the node's ack."""
    spec = tuple(PutChunk(k, None, layer, rows.shape[1]) for k in keys)
    ucx = (op or ("reserve" if node.config.transport == "ucx" else "put")) == "reserve"
    request = Put(NS.canonical_bytes(), spec, ucx=ucx).header()
    if not ucx:  # one frame: the request and every chunk
        await conn.send(request, [r.numpy() for r in rows], timeout=TIMEOUT)
        return expect((await conn.recv_header(TIMEOUT)).header, Ack)
    await conn.send(request, timeout=TIMEOUT)
    ready = expect((await conn.recv_header(TIMEOUT)).header, Ready, "reserved")
    assert ready.sending() == list(range(len(keys)))
    await write_by_ucx(node, list(ready.spans or ()), rows)
    await conn.send(Landed().header(), timeout=TIMEOUT)
    return expect((await conn.recv_header(TIMEOUT)).header, Ack)


async def write_by_ucx(node: StorageNode, spans: list[Any], rows: torch.Tensor) -> None:
    from kvstore.transport.nixl import NixlAgent, Span

    async with NixlAgent(f"test-writer-{uuid.uuid4().hex[:8]}") as agent:
        await agent.register(rows)
        peer = await agent.add_peer(node._nixl_metadata)
        remote = [Span.from_wire(s) for s in spans]
        await agent.write(peer, remote, list(rows.unbind(0)), timeout=TIMEOUT)


async def get(
    conn: Connection, keys: list[bytes], index: int = 0
) -> tuple[list[int], list[torch.Tensor]]:
    """One tcp:// get of chunk ``index`` of ``keys``: found flags, the chunks found."""
    spec = tuple(ChunkRef(k, index) for k in keys)
    await conn.send(Get(NS.id, spec).header(), timeout=TIMEOUT)
    frame = await conn.recv_header(TIMEOUT)
    found = list(expect(frame.header, Found).found)
    bufs = [torch.empty(n, dtype=torch.uint8) for n in frame.sizes]
    await conn.recv_payload_into([b.numpy() for b in bufs], TIMEOUT)
    return found, bufs


async def test_bad_chunks_in_a_split_batch_are_refused_one_by_one(
    strict: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 chunks (2.5 MiB), every byte checked before the ack (no scrub): over ucx:// split
    over the verifier threads (past the inline size set here); each bad one is refused on
    its own."""
    rig = strict
    monkeypatch.setattr(checks, "INLINE_VERIFY_BYTES", 256 * 2**10)
    keys = blocks(20)
    rows = chunks(keys)
    good = rows.clone()
    rows[3, -1] ^= 0xFF  # the checksum no longer matches
    rows[5] = chunks([keys[4]])[0]  # another block's chunk: wrong key in its header
    rows[17, 10] ^= 0x01  # a flipped bit in the header
    expected = [0 if i in (3, 5, 17) else 1 for i in range(20)]
    conn = await connect(rig.node.data_uri, timeout=TIMEOUT)
    try:
        ack = await put(conn, rig.node, keys, rows)
        assert (ack.stored, ack.skipped, ack.failed) == (17, 0, (3, 5, 17))
        assert await rig.holders(keys) == expected
        found, bufs = await get(conn, keys)
        assert found == expected
        kept = [i for i in range(20) if found[i]]
        assert all(torch.equal(b, good[i]) for b, i in zip(bufs, kept, strict=True))
        # A one-chunk batch is verified inline, with the same verdict.
        bad = good[[3]].clone()
        bad[0, 100] ^= 1
        ack = await put(conn, rig.node, [keys[3]], bad)
        assert (ack.stored, ack.failed) == (0, (0,))
        # The refused chunks can be put again, correctly this time.
        ack = await put(conn, rig.node, [keys[3], keys[5], keys[17]], good[[3, 5, 17]])
        assert (ack.stored, ack.failed) == (3, ())
        assert await rig.holders(keys) == [1] * 20
    finally:
        await conn.close()


SMALL = Namespace(model="node-test-small", revision="1", num_layers=1, num_kv_heads=2,
                  head_dim=16, dtype=torch.bfloat16, block_tokens=16, quant="int8")  # fmt: skip


async def test_small_tcp_chunks_of_a_known_form_are_still_checked_in_full(rig: Rig) -> None:
    """tcp:// chunks of ~1.3 KB: once a header form passed the full check, later chunks of
    it are compared and hashed only, and every kind of damage is still refused."""
    if rig.node.config.transport != "tcp":
        pytest.skip("a tcp:// put")
    keys = blocks(12)
    kv = torch.randn(2, 12 * 16, 2, 16).bfloat16()
    good = torch.stack(encode_blocks(kv, 16, [ChunkKey(k, 0, 0) for k in keys], "int8"))
    rows = good.clone()
    rows[7, 200] ^= 0x04  # payload
    rows[8, -2] ^= 0x80  # stored checksum
    rows[9] = good[3]  # another block's chunk: wrong key
    rows[10, 30] ^= 0x01  # header (its check no longer matches)
    size = rows.shape[1]

    async def put_small(idx: list[int]) -> Ack:
        spec = tuple(PutChunk(keys[i], None, 0, size) for i in idx)
        request = Put(SMALL.canonical_bytes(), spec).header()
        await conn.send(request, [rows[i].numpy() for i in idx], timeout=TIMEOUT)
        return expect((await conn.recv_header(TIMEOUT)).header, Ack)

    conn = await connect(rig.node.data_uri, timeout=TIMEOUT)
    try:
        ack = await put_small([0, 1, 2])  # the form passes the full check here
        assert (ack.stored, ack.failed) == (3, ())
        ack = await put_small(list(range(3, 12)))
        assert (ack.stored, ack.failed) == (5, (4, 5, 6, 7))  # positions of 7, 8, 9, 10
        spec = tuple(ChunkRef(k, 0) for k in keys)
        await conn.send(Get(SMALL.id, spec).header(), timeout=TIMEOUT)
        frame = await conn.recv_header(TIMEOUT)
        found = list(expect(frame.header, Found).found)
        assert found == [0 if i in (7, 8, 9, 10) else 1 for i in range(12)]
        bufs = [torch.empty(n, dtype=torch.uint8) for n in frame.sizes]
        await conn.recv_payload_into([b.numpy() for b in bufs], TIMEOUT)
        kept = [i for i in range(12) if found[i]]
        assert all(torch.equal(b, good[i]) for b, i in zip(bufs, kept, strict=True))
    finally:
        await conn.close()


async def test_concurrent_puts_share_commits(rig: Rig) -> None:
    """Exchanges on four connections at once: every chunk is committed, in fewer Commit
    RPCs than exchanges once they overlap, never more."""
    conns = [await connect(rig.node.data_uri, timeout=TIMEOUT) for _ in range(4)]
    try:
        batches = [blocks(1 + k % 2) for k in range(12)]
        before = rig.master.service.counters.commits

        async def writer(k: int) -> None:
            for keys in batches[k::4]:
                ack = await put(conns[k], rig.node, keys, chunks(keys))
                assert (ack.stored, ack.failed) == (len(keys), ())

        await asyncio.gather(*(writer(k) for k in range(4)))
        assert rig.master.service.counters.commits - before <= 12
        assert await rig.holders([b for keys in batches for b in keys]) == [1] * 18
    finally:
        for conn in conns:
            await conn.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_put_of_more_blocks_than_memory_holds_stores_those_that_fit(
    transport: str,
) -> None:
    """A put naming more new blocks than the node's memory holds stores its leading blocks
    (the rest answered busy: not stored), commits them and leaves no empty slot behind.
    It was refused whole, after evicting every other block for slots it left empty."""
    async with running(transport, host_mem=4 * 2**20) as rig:
        conn = await connect(rig.node.data_uri, timeout=TIMEOUT)
        try:
            old = blocks(2)
            assert (await put(conn, rig.node, old, chunks(old))).stored == 2
            keys = blocks(24)
            rows = chunks(keys)
            spec = tuple(PutChunk(k, None, 0, rows.shape[1]) for k in keys)
            client = NodeClient(rig.node.data_uri, timeout_s=TIMEOUT)
            if transport == "ucx":

                async def write(ready: Ready) -> None:
                    sent = ready.sending()
                    spans = list(ready.spans or ())
                    await write_by_ucx(rig.node, spans, rows[sent].contiguous())

                ack = await client.reserve(NS.canonical_bytes(), spec, write)
            else:
                ack = await client.put(NS.canonical_bytes(), spec, [r.numpy() for r in rows])
            fit = ack.stored
            assert 4 <= fit < len(keys) and not ack.failed
            assert ack.busy == tuple(range(fit, len(keys)))
            assert await rig.holders(keys) == [1] * fit + [0] * (len(keys) - fit)
            host = rig.node.tiers.host.table
            assert len(host) == fit + sum(await rig.holders(old))  # (no slot left empty)
            found, got = await get(conn, keys[:fit])
            assert found == [1] * fit
            assert all(torch.equal(g, r) for g, r in zip(got, rows[:fit], strict=True))
        finally:
            await conn.close()


async def test_a_registration_re_reports_in_bounded_commits(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node rejoining re-reports every block it holds in Commits of at most
    REPORT_BATCH entries (one Commit may carry at most MAX_COMMIT_ITEMS), all of them."""
    keys = blocks(20)
    conn = await connect(rig.node.data_uri, timeout=TIMEOUT)
    try:
        ack = await put(conn, rig.node, keys, chunks(keys))
        assert ack.stored == 20
    finally:
        await conn.close()
    monkeypatch.setattr(type(rig.node.link), "REPORT_BATCH", 8)
    link, before = rig.node.link, rig.master.service.counters.commits
    epoch = link.epoch
    link.reregister.set()  # what a master that lost the node asks for
    async with asyncio.timeout(TIMEOUT):
        while link.epoch == epoch or rig.master.service.counters.commits - before < 3:
            await asyncio.sleep(0.02)
    assert rig.master.service.counters.commits - before == 3  # 8 + 8 + 4, under the new epoch
    assert await rig.holders(keys) == [1] * 20


async def test_group_commit_one_rpc_for_callers_queued_together(rig: Rig) -> None:
    node, keys = rig.node, blocks(8)
    before = rig.master.service.counters.commits
    await asyncio.gather(*(node.link.commit([BlockAdd(NS.id, k, (0,))]) for k in keys))
    assert rig.master.service.counters.commits - before == 1
    assert await rig.holders(keys) == [1] * 8


async def test_group_commit_keeps_object_changes_in_order(rig: Rig) -> None:
    node, lookup = rig.node, MasterClient.in_process(rig.master.service)
    before = rig.master.service.counters.commits
    await asyncio.gather(
        node.link.commit([], object_adds=[ObjectAdd("k", 3)]),
        node.link.commit([], object_removes=["k"]),
        node.link.commit([], object_adds=[ObjectAdd("k", 5)]),
        node.link.commit([], object_adds=[ObjectAdd("other", 1)]),
    )
    assert rig.master.service.counters.commits - before == 3, "one RPC per change of 'k'"
    assert [h.nbytes for h in await lookup.lookup_object("k")] == [5]
    await asyncio.gather(node.link.commit([], object_removes=["k"]), node.link.commit([]))
    assert await lookup.lookup_object("k") == []
    assert len(await lookup.lookup_object("other")) == 1


async def test_group_commit_failure_reaches_every_caller(rig: Rig) -> None:
    node = rig.node
    # A new registration with this node's key (as after a lost lease; another key is
    # refused while this one lives): the node's epoch is dead for the master.
    again = MasterClient.in_process(rig.master.service)
    again.session = node.link.master.session
    await again.register(node.node_id, "tcp://x:1")
    results = await asyncio.gather(
        *(node.link.commit([BlockAdd(NS.id, k, (0,))]) for k in blocks(3)), return_exceptions=True
    )
    assert all(isinstance(r, TransportError) for r in results), results


async def test_a_ucx_chunk_is_acked_on_its_header_and_scrubbed_for_the_rest(rig: Rig) -> None:
    """Over ucx:// the ack waits for each chunk's header, key and spec, not its checksum: a
    chunk with a flipped payload bit is acked stored, then the scrub (within its bound)
    drops it and the next commit takes it out of the index, so the next writer stores it.
    A bad header is refused before the ack over both transports."""
    keys = blocks(4)
    rows = chunks(keys)
    good = rows.clone()
    rows[1, -100] ^= 0x04  # payload: only the checksum can tell
    rows[2, 10] ^= 0x01  # header
    conn = await connect(rig.node.data_uri, timeout=TIMEOUT)
    try:
        ack = await put(conn, rig.node, keys, rows)
        by_ucx = rig.node.config.transport == "ucx"
        assert (ack.stored, ack.failed) == ((3, (2,)) if by_ucx else (2, (1, 2)))
        await asyncio.wait_for(rig.node.scrub.idle(), TIMEOUT)
        stats = await NodeClient(rig.node.data_uri).stats()
        assert (stats["scrub_pending"], stats["scrub_dropped"]) == (0, 1 if by_ucx else 0)
        assert (stats["scrub_cpu_us"] > 0) == by_ucx  # (tcp:// chunks are checked on arrival)
        for _ in range(100):  # the sweeper's next commit (every 0.5 s) reports the drop
            if await rig.holders(keys) == [1, 0, 0, 1]:
                break
            await asyncio.sleep(0.05)
        assert await rig.holders(keys) == [1, 0, 0, 1]
        found, bufs = await get(conn, keys)
        assert found == [1, 0, 0, 1]
        assert torch.equal(bufs[0], good[0]) and torch.equal(bufs[1], good[3])
        ack = await put(conn, rig.node, keys[1:3], good[1:3])
        assert (ack.stored, ack.failed) == (2, ())
        assert await rig.holders(keys) == [1] * 4
    finally:
        await conn.close()


def test_header_checks_of_a_known_form_still_refuse_another_key_or_spec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once a namespace's header form passed, later headers of that form are compared, not
    parsed again: a chunk of that form under another key, a chunk of another dtype and a
    corrupted header are still refused, each alone; honest chunks pass."""
    tiers = Tiers(8 * 2**20)
    keys = blocks(5)
    slots = [tiers.host.table.allocate((NS.id, k), 2 * CHUNK_BYTES, CHUNK_BYTES, 2, None).slot
             for k in keys]  # fmt: skip
    views = [tiers.host.table.chunk_view(s, 0) for s in slots]
    rows = chunks(keys)
    for view, row in zip(views, rows, strict=True):
        view.copy_(row)
    views[1].copy_(chunks([keys[0]])[0])  # an honest chunk of another block, in block 1's slot
    kv = torch.randn(2, TOKENS, H, D)
    views[2].copy_(encode_blocks(kv.half(), TOKENS, [ChunkKey(keys[2], 0, 0)], "none")[0])
    views[3][24] ^= 0x01  # the header's layer field: its check no longer holds
    items = [
        checks.LandedChunk(i, k, 0, v) for i, (k, v) in enumerate(zip(keys, views, strict=True))
    ]
    parsed: list[int] = []
    full_check = headers.check_header_bytes
    monkeypatch.setattr(
        headers, "check_header_bytes", lambda v, *a: parsed.append(1) or full_check(v, *a)
    )
    checks_ = checks.ChunkChecks(threads=1)
    try:
        assert checks_.headers("test", NS, items[:1]) == []  # the form is known from here
        assert checks_.headers("test", NS, items) == [1, 2, 3]
        assert checks_.headers("test", NS, items[4:]) == []
        assert len(parsed) == 4, "the first chunk and the three refused ones are parsed"
    finally:
        checks_.close()


async def test_the_scrub_gives_way_to_exchanges_but_not_past_its_age_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the node serves an exchange the scrub waits; once its oldest chunk has waited
    MAX_AGE_S it checks anyway, and drops a bad chunk through its callback."""
    monkeypatch.setattr(scrub, "MAX_AGE_S", 1.0)
    tiers = Tiers(8 * 2**20)
    key = (NS.id, blocks(1)[0])
    res = tiers.host.table.allocate(key, 2 * CHUNK_BYTES, CHUNK_BYTES, 2, None)
    view = tiers.host.table.chunk_view(res.slot, 0)
    view.copy_(chunks([key[1]])[0])
    view[-100] ^= 0x04  # only the checksum can tell
    tiers.host.table.mark_landed(res.slot, 0)
    dropped: list[int] = []
    checks_ = checks.ChunkChecks(threads=1)
    s = scrub.Scrub(checks_, tiers, lambda slot, i: dropped.append(i), busy=lambda: True)
    runner = asyncio.ensure_future(s.run())
    try:
        batch = scrub.ScrubBatch()
        item = checks.LandedChunk(0, key[1], 0, view)
        assert s.reserve(batch, [item])
        batch.chunks = [(res.slot, item)]
        s.add(NS, batch)
        await asyncio.sleep(0.2)
        assert (s.pending, dropped) == (1, []), "busy: the scrub waits"
        await asyncio.wait_for(s.idle(), 5)
        assert (s.pending, s.scrubbed, dropped) == (0, 1, [0])
        assert s.cpu_s > 0
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        checks_.close()


async def test_the_scrub_checks_chunks_of_several_puts_together_and_drops_the_bad_ones() -> None:
    """The scrub checks what several puts queued in one call per namespace; each put's
    chunks count their positions from 0, so a bad chunk must be dropped by its own slot and
    index: here the second chunk of one put and the first of the other."""
    tiers = Tiers(8 * 2**20)
    keys = blocks(4)
    slots = [tiers.host.table.allocate((NS.id, k), 2 * CHUNK_BYTES, CHUNK_BYTES, 2, None).slot
             for k in keys]  # fmt: skip
    checks_ = checks.ChunkChecks(threads=1)
    dropped: list[tuple[bytes, int]] = []
    s = scrub.Scrub(checks_, tiers, lambda slot, i: dropped.append((slot.key[1], i)))
    batches = []
    for put, layer in ((keys[:2], 0), (keys[2:], 1)):
        batch, items = scrub.ScrubBatch(), []
        for position, (k, row) in enumerate(zip(put, chunks(put, layer), strict=True)):
            slot = slots[keys.index(k)]
            view = tiers.host.table.chunk_view(slot, layer)
            view.copy_(row)
            tiers.host.table.mark_landed(slot, layer)
            items.append((slot, checks.LandedChunk(position, k, layer, view)))
        assert s.reserve(batch, [c for _, c in items])
        batch.chunks = items
        batches.append(batch)
    tiers.host.table.chunk_view(slots[1], 0)[-100] ^= 0x04  # (payloads: only the checksum
    tiers.host.table.chunk_view(slots[2], 1)[-100] ^= 0x04  # can tell)
    runner = asyncio.ensure_future(s.run())
    try:
        for batch in batches:  # (both queued before the scrub's task runs)
            s.add(NS, batch)
        await asyncio.wait_for(s.idle(), 5)
        assert (s.scrubbed, s.dropped) == (4, 2)
        assert sorted(dropped) == sorted([(keys[1], 0), (keys[2], 1)])
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        checks_.close()


_HOST_MAPPING = [("tcp", True, "mapped"), ("tcp", False, "off"),
                 pytest.param("ucx", True, "mapped", marks=TRANSPORTS[1].marks),
                 pytest.param("ucx", False, "off", marks=TRANSPORTS[1].marks)]  # fmt: skip


async def _when_mapping_ends(rig: Rig) -> tuple[dict[str, Any], list[str]]:
    """The node's stats once its start-up mapping ended (polled for at most 10 s), and each
    ``host_mapping`` they said meanwhile."""
    node, seen = NodeClient(rig.node.data_uri), []
    for _ in range(400):  # (32 MiB maps in well under a second)
        stats = await node.stats()
        seen.append(stats["host_mapping"])
        if seen[-1] != "mapping":
            break
        await asyncio.sleep(0.025)
    return stats, seen


@pytest.mark.parametrize(("transport", "prefault", "ends"), _HOST_MAPPING)
async def test_stats_say_whether_host_memory_is_mapped(
    transport: str, prefault: bool, ends: str
) -> None:
    """A node's stats say ``mapping`` while it maps its host memory at start, then
    ``mapped`` with every byte of it (over ``ucx://`` too: its registration maps pages
    only where a NIC pins them); ``off`` (nothing mapped up front) when told not to."""
    if ends == "mapped" and populate(Arena(4 * 2**20).tensor) == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    fallbacks = thp.fallbacks()
    async with running(transport, prefault_memory=prefault) as rig:
        stats, seen = await _when_mapping_ends(rig)
        assert seen[-1] == ends and set(seen) <= {"mapping", ends}, seen
        mapped, size = stats["host_mapped_bytes"], rig.node.tiers.host.arena.capacity_bytes
        assert (size - 4096 <= mapped <= size) if ends == "mapped" else mapped == 0
        # Huge pages: counted once the mapping ended (0 when it did not), and only where the
        # memory was advised for them (pinned host memory is CUDA's, on 4 KiB pages).
        huge, arena = stats["host_huge_bytes"], rig.node.tiers.host.arena
        assert 0 <= huge <= size
        if ends != "mapped" or not arena.huge_pages or not thp.usable():
            assert huge == 0
        elif huge == 0 and thp.fallbacks() > fallbacks:
            pytest.skip("the kernel had no free 2 MiB page for this node (thp_fault_fallback)")
        else:
            assert huge > 0


async def test_a_node_told_no_huge_pages_keeps_its_host_memory_on_4_kib_pages() -> None:
    """``huge_pages=False`` reaches the host tier: its memory is advised against huge pages
    (not eligible for them whatever the kernel's mode) and the stats count none."""
    async with running("tcp", huge_pages=False) as rig:
        arena = rig.node.tiers.host.arena
        assert not arena.huge_pages
        if thp.usable() and not arena.pinned:
            assert thp.smaps_field(arena.tensor, "THPeligible") in (0, None)
        stats, _ = await _when_mapping_ends(rig)
        assert stats["host_huge_bytes"] == 0 and arena.huge_page_bytes() == 0
