"""Writers of the same chunks at once, against a real master and node in this process: a
put is reported stored only when its chunks are landed and checked on the node, a crafted
chunk never shadows the honest one, and a chunk found bad after it was stored is dropped so
the next writer stores it again.

Each test reproduces a defect: a second writer was told "stored" for a chunk whose transfer
by a stalled writer never landed; a chunk encoded from another dtype was accepted (and the
honest writer skipped), after which every read of the prefix raised BadShape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import kvclient
from kvstore.core.codec import ChunkKey, chunk_nbytes, encode_blocks
from kvstore.dataplane import ChunkRef, NodeClient, PutChunk
from kvstore.dataplane.messages import Put
from kvstore.master import MasterServer
from kvstore.node import checks
from kvstore.node.server import StorageNode
from kvstore.transport.framing import encode_prefix
from tests import kvproc
from tests.cluster import TRANSPORTS, start_server
from tests.test_node import running

HERE = Path(__file__).parent

H, D, B = 4, 64, 16
NS = kvclient.Namespace(model="writers-test", revision="1", num_layers=2, num_kv_heads=H,
                        head_dim=D, dtype=torch.float16, block_tokens=B, quant="int8")  # fmt: skip
TIMEOUT = 10.0
IO_TIMEOUT_S = 1.0
"""The node's per-step deadline: how long a stalled writer may hold a chunk."""


@dataclass
class Pool:
    master: MasterServer
    node: StorageNode

    async def client(self, timeout_s: float = TIMEOUT) -> kvclient.KVClient:
        return await kvclient.KVClient.connect(self.master.address, NS, timeout_s=timeout_s)


@pytest.fixture(params=TRANSPORTS)
async def pool(request: pytest.FixtureRequest) -> AsyncIterator[Pool]:
    async with running(request.param, host_mem=16 * 2**20, io_timeout_s=IO_TIMEOUT_S) as rig:
        yield Pool(rig.master, rig.node)


def prompt(blocks: int) -> list[int]:
    """Token ids no other test uses."""
    base = uuid.uuid4().int % 100_000
    return [base + i for i in range(blocks * B)]


def kv(tokens: list[int], layer: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(tokens) * 31 + layer)
    return torch.randn(2, len(tokens), H, D, generator=g).to(dtype)


def reference(tokens: list[int], layer: int) -> torch.Tensor:
    """What a reader must get back for an honest put of ``kv(tokens, layer)``."""
    keys = [ChunkKey(h, layer, 0) for h in kvclient.block_hashes(NS, tokens)]
    chunks = encode_blocks(kv(tokens, layer), B, keys, NS.quant)
    return torch.cat([kvclient.decode_chunk(c) for c in chunks], dim=1)


@dataclass
class Stalled:
    """A writer's socket that sent a put frame's prefix and none of its chunks."""

    writer: asyncio.StreamWriter

    async def close(self) -> None:
        """Close it (as a process that dies does)."""
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def claim(node: StorageNode, tokens: list[int], layer: int) -> Stalled:
    """A writer that starts a put of ``layer`` over tcp:// — its frame's prefix announces
    every chunk — and then sends nothing: the node has claimed the chunks for it (its stats
    say so) and they are in flight until the node gives up."""
    hashes = kvclient.block_hashes(NS, tokens)
    nbytes = chunk_nbytes(B, H, D, NS.dtype, NS.quant)
    spec = tuple(PutChunk(h, hashes[i - 1] if i else None, layer, nbytes)
                 for i, h in enumerate(hashes))  # fmt: skip
    before = (await NodeClient(node.data_uri).stats())["inflight"]
    host, port = node.data_uri.removeprefix("tcp://").rsplit(":", 1)
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(encode_prefix(Put(NS.canonical_bytes(), spec).header(), [nbytes] * len(spec)))
    await writer.drain()
    for _ in range(200):
        if (await NodeClient(node.data_uri).stats())["inflight"] >= before + len(spec):
            return Stalled(writer)
        await asyncio.sleep(0.01)
    raise AssertionError("the node never claimed the stalled writer's chunks")


async def test_a_put_is_not_stored_while_another_writers_transfer_of_it_is_in_flight(
    pool: Pool,
) -> None:
    """Writer A claims the chunks and stalls. Writer B's put neither reports them stored
    (the defect: "already there") nor waits past its own deadline: with a deadline shorter
    than A's I/O timeout it reports nothing stored, and the index has nothing."""
    tokens = prompt(3)
    stalled = await claim(pool.node, tokens, 0)
    try:
        async with await pool.client(timeout_s=0.6) as kv_b:
            t0 = time.monotonic()
            assert await kv_b.put_layer(tokens, 0, kv(tokens, 0)) == 0
            assert time.monotonic() - t0 < IO_TIMEOUT_S
            assert await kv_b.match_prefix(tokens) == 0
            assert (await kv_b.get_layer(tokens, 0)).shape[1] == 0
    finally:
        await stalled.close()


async def test_a_second_writer_stores_the_chunks_a_stalled_writer_never_sent(pool: Pool) -> None:
    """Writer A claims the chunks and stalls; writer B (deadline past A's I/O timeout) waits
    for the node to give up on A, then stores the chunks itself: its reader gets them."""
    tokens = prompt(3)
    stalled = await claim(pool.node, tokens, 0)
    try:
        async with await pool.client() as kv_b:
            t0 = time.monotonic()
            assert await kv_b.put_layer(tokens, 0, kv(tokens, 0)) == len(tokens)
            assert time.monotonic() - t0 < TIMEOUT / 2
            got = await kv_b.get_layer(tokens, 0)
            assert torch.equal(got, reference(tokens, 0))
    finally:
        await stalled.close()


async def test_a_writer_killed_mid_transfer_leaves_its_chunks_to_the_next(pool: Pool) -> None:
    """Writer A claims the chunks and its connection dies (as a ``kill -9`` does): writer B,
    already waiting, stores them at once instead of waiting out A's I/O timeout."""
    tokens = prompt(2)
    dying = await claim(pool.node, tokens, 1)
    async with await pool.client() as kv_b:
        put_b = asyncio.ensure_future(kv_b.put_layer(tokens, 1, kv(tokens, 1)))
        await asyncio.sleep(0.2)
        assert not put_b.done(), "B must wait for A's transfer, not skip the chunks"
        t0 = time.monotonic()
        await dying.close()
        assert await put_b == len(tokens)
        assert time.monotonic() - t0 < IO_TIMEOUT_S
        assert torch.equal(await kv_b.get_layer(tokens, 1), reference(tokens, 1))


async def test_concurrent_writers_of_one_prefix_all_report_it_stored(pool: Pool) -> None:
    """Eight writers put the same layer at once: every one reports every block stored (by
    itself or by the writer it waited for), and the bytes read are one honest copy."""
    tokens = prompt(4)
    clients = [await pool.client() for _ in range(8)]
    try:
        stored = await asyncio.gather(*(c.put_layer(tokens, 0, kv(tokens, 0)) for c in clients))
        assert stored == [len(tokens)] * 8
        assert torch.equal(await clients[0].get_layer(tokens, 0), reference(tokens, 0))
    finally:
        for c in clients:
            await c.close()


async def test_a_chunk_of_another_dtype_is_refused_and_the_honest_writer_stores_it(
    pool: Pool,
) -> None:
    """A well-formed chunk with the right key but encoded from bfloat16, put first into this
    float16 namespace: the node refuses it (its header does not fit the namespace), so the
    honest writer's put stores the chunk and every read returns the honest bytes."""
    tokens = prompt(2)
    hashes = kvclient.block_hashes(NS, tokens)
    keys = [ChunkKey(h, 0, 0) for h in hashes]
    crafted = encode_blocks(kv(tokens, 0, torch.bfloat16), B, keys, NS.quant)
    assert crafted[0].numel() == chunk_nbytes(B, H, D, NS.dtype, NS.quant)
    spec = [PutChunk(h, hashes[i - 1] if i else None, 0, c.numel())
            for i, (h, c) in enumerate(zip(hashes, crafted, strict=True))]  # fmt: skip
    ack = await NodeClient(pool.node.data_uri).put(NS.canonical_bytes(), spec, crafted)
    assert (ack.stored, ack.failed) == (0, (0, 1))
    async with await pool.client() as honest:
        assert await honest.match_prefix(tokens) == 0
        assert await honest.put_layer(tokens, 0, kv(tokens, 0)) == len(tokens)
        assert torch.equal(await honest.get_layer(tokens, 0), reference(tokens, 0))


async def test_a_chunk_damaged_at_rest_is_a_miss_and_is_stored_again(pool: Pool) -> None:
    """A stored chunk whose bytes flip in the node's memory: a read returns the blocks
    before it (a miss for that block, not an error for the call), the reader's report makes
    the node drop it, and the next put stores it again."""
    tokens = prompt(3)
    async with await pool.client() as kv_c:
        assert await kv_c.put_layer(tokens, 0, kv(tokens, 0)) == len(tokens)
        key = (NS.id, kvclient.block_hashes(NS, tokens)[1])
        tier, slot = next((t, s) for t in pool.node.tiers if (s := t.table.get(key)))
        tier.table.chunk_view(slot, 0)[-100] ^= 0xFF
        got = await kv_c.get_layer(tokens, 0)
        assert torch.equal(got, reference(tokens, 0)[:, :B])

        def held() -> bool:  # the chunk is landed there (a pinned slot loses just it)
            return any((s := t.table.get(key)) and s.landed_mask & 1 for t in pool.node.tiers)

        for _ in range(100):  # the report travels in the background
            if not held():
                break
            await asyncio.sleep(0.02)
        assert not held(), "the bad chunk is dropped"
        assert await kv_c.put_layer(tokens, 0, kv(tokens, 0)) == len(tokens)
        assert torch.equal(await kv_c.get_layer(tokens, 0), reference(tokens, 0))


async def test_a_report_of_a_good_chunk_drops_nothing(pool: Pool) -> None:
    """The node checks a reported chunk itself: a report about a chunk that is fine (or one
    it does not hold) changes nothing."""
    tokens = prompt(2)
    async with await pool.client() as kv_c:
        assert await kv_c.put_layer(tokens, 0, kv(tokens, 0)) == len(tokens)
    hashes = kvclient.block_hashes(NS, tokens)
    chunks = [ChunkRef(hashes[0], 0), ChunkRef(hashes[1], 1), ChunkRef(bytes(16), 0)]
    assert await NodeClient(pool.node.data_uri).report(NS.id, chunks) == 0
    async with await pool.client() as kv_c:
        assert torch.equal(await kv_c.get_layer(tokens, 0), reference(tokens, 0))


async def test_a_busy_chunk_is_answered_busy_and_the_rest_of_the_batch_is_stored(
    pool: Pool,
) -> None:
    """A put naming a chunk in flight elsewhere and a free one, with no time to wait: the
    first is BUSY (not stored; its bytes are read aside and dropped), the second stored."""
    tokens = prompt(2)
    hashes = kvclient.block_hashes(NS, tokens)
    stalled = await claim(pool.node, tokens[:B], 0)
    nbytes = chunk_nbytes(B, H, D, NS.dtype, NS.quant)
    keys = [ChunkKey(h, 0, 0) for h in hashes]
    rows = encode_blocks(kv(tokens, 0), B, keys, NS.quant)
    try:
        spec = (PutChunk(hashes[0], None, 0, nbytes), PutChunk(hashes[1], hashes[0], 0, nbytes))
        ack = await NodeClient(pool.node.data_uri).put(NS.canonical_bytes(), spec, rows, wait_s=0)
        assert (ack.stored, ack.skipped, ack.busy) == (1, 0, (0,))
    finally:
        await stalled.close()


async def test_a_stored_chunk_of_another_dtype_is_a_miss_for_its_block_only(pool: Pool) -> None:
    """A well-formed chunk with the right key and checksum but another dtype sits in a slot
    (written there behind the node's checks): a read returns the blocks before it instead
    of raising BadShape for the whole call (the defect), and the block is dropped."""
    tokens = prompt(3)
    hashes = kvclient.block_hashes(NS, tokens)
    async with await pool.client() as kv_c:
        assert await kv_c.put_layer(tokens, 0, kv(tokens, 0)) == len(tokens)
        crafted = encode_blocks(kv(tokens, 0, torch.bfloat16), B,
                                [ChunkKey(h, 0, 0) for h in hashes], NS.quant)  # fmt: skip
        key = (NS.id, hashes[2])
        tier, slot = next((t, s) for t in pool.node.tiers if (s := t.table.get(key)))
        tier.table.chunk_view(slot, 0).copy_(crafted[2])
        got = await kv_c.get_layer(tokens, 0)
        assert torch.equal(got, reference(tokens, 0)[:, : 2 * B])


# --------------------------------------------------------------------- separate processes


def _proc(role: str, master: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "kvproc.py"), role, master, *extra],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(HERE.parent)),
    )


def _first_event(proc: subprocess.Popen[str], timeout: float = 60) -> dict:
    """The first JSON line ``proc`` prints (it keeps running)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout), f"{proc.args} printed nothing within {timeout} s"
    return json.loads(proc.stdout.readline())


def _events(proc: subprocess.Popen[str], timeout: float = 120) -> list[dict]:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_honest_readers_get_honest_bytes_from_stalled_killed_crafted_and_honest_writers() -> None:
    """One prefix, five writers in their own processes: a crafted one (float16 chunks with
    the right keys into the bfloat16 namespace) first, then one that stalls after starting
    its put of layer 0, one that is ``kill -9``ed halfway through its data for layer 1, and
    two honest ones. Both honest writers report every layer stored, and both readers get
    exactly the honest bytes of every layer within their deadlines."""
    layers, tokens = 2, 512
    args = ["--tokens", str(tokens), "--layers", str(layers), "--timeout", "30"]
    server = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port",
                          "0", "--io-timeout-s", "2")  # fmt: skip
    procs: list[subprocess.Popen[str]] = []
    try:
        crafted = _events(_proc("crafted", server.grpc, *args, "--layer", "0"))
        assert crafted[0]["crafted"]["stored"] == 0, crafted
        readers = [_proc("reader", server.grpc, *args) for _ in range(2)]
        procs += readers
        assert all(_first_event(r)["ready"] for r in readers)
        stalled = _proc("stall", server.grpc, *args, "--layer", "0")
        killed = _proc("partial", server.grpc, *args, "--layer", "1")
        procs += [stalled, killed]
        assert _first_event(stalled)["claimed"] == 2
        assert _first_event(killed)["partial"] == 2
        writers = [_proc("writer", server.grpc, *args[:4]) for _ in range(2)]
        procs += writers
        time.sleep(0.3)
        killed.kill()
        for w in writers:
            done = [e for e in _events(w) if e.get("phase") == "done"]
            assert [(e["put"], e["stored"]) for e in done] == [(i, tokens) for i in range(layers)]
        want = {layer: _honest_digest(tokens, layer, layers) for layer in range(layers)}
        for r in readers:
            got = {e["got"]: e["digest"] for e in _events(r) if "got" in e}
            assert got == want
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)
        assert server.stop()[0] == 0


def _honest_digest(tokens: int, layer: int, layers: int) -> str:
    """What a reader must get for an honest writer's ``layer`` (see tests/kvproc.py)."""
    ns = kvproc.namespace(layers)
    hashes = kvclient.block_hashes(ns, kvproc.prompt(tokens, 1))
    keys = [ChunkKey(h, layer, 0) for h in hashes]
    t = kvproc.layer_kv(tokens, layer, 1)[:, : len(hashes) * ns.block_tokens]
    chunks = encode_blocks(t, ns.block_tokens, keys, ns.quant)
    return kvproc.digest(torch.cat([kvclient.decode_chunk(c) for c in chunks], dim=1))


async def test_small_chunks_received_together_are_each_checked(pool: Pool) -> None:
    """Chunks this small are received into one buffer and checked as bytes: a flipped
    payload bit, a wrong key and a bad header are each refused on their own, the rest of the
    batch is stored, and what is read back is exactly what was sent."""
    tokens = prompt(5)
    hashes = kvclient.block_hashes(NS, tokens)
    rows = encode_blocks(kv(tokens, 0), B, [ChunkKey(h, 0, 0) for h in hashes], NS.quant)
    assert rows[0].numel() <= checks.SMALL_CHUNK_BYTES
    bad = [r.clone() for r in rows]
    bad[1][-200] ^= 0x10  # payload: only the checksum can tell
    bad[2] = rows[3].clone()  # another block's chunk
    bad[4][12] ^= 0x01  # header
    spec = [PutChunk(h, hashes[i - 1] if i else None, 0, r.numel())
            for i, (h, r) in enumerate(zip(hashes, rows, strict=True))]  # fmt: skip
    ack = await NodeClient(pool.node.data_uri).put(NS.canonical_bytes(), spec, bad)
    assert (ack.stored, ack.failed) == (2, (1, 2, 4))
    async with await pool.client() as kv_c:
        assert torch.equal(await kv_c.get_layer(tokens, 0), reference(tokens, 0)[:, :B])
        assert await kv_c.put_layer(tokens, 0, kv(tokens, 0)) == len(tokens)
        assert torch.equal(await kv_c.get_layer(tokens, 0), reference(tokens, 0))
