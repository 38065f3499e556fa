"""``ucx://`` under failure, with real processes: a master and a UCX node as subprocesses,
``kill -9`` in the middle of reads and writes, a writer process killed mid-put, a reader
whose lease expired. Every call ends within its deadline with data or a typed error."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvclient
from kvclient.errors import ChunkError, InvalidArgument, KVStoreError
from kvclient.ucx import nixl_available
from kvstore.core.codec import ChunkKey, chunk_nbytes, decode_chunk
from kvstore.core.kvgen import realistic_kv
from kvstore.dataplane import ChunkRef, NodeClient, PutChunk
from kvstore.dataplane.location import SlotLocation
from kvstore.dataplane.messages import Lease, Leased, Release, expect
from kvstore.transport import connect
from tests.cluster import Server, node_stats, rpc_count, start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="nixl-cu12 not installed"),
]

HERE = Path(__file__).parent
H, D = 8, 128
TIMEOUT_S = 3.0


def _ns(layers: int = 1) -> kvclient.Namespace:
    return kvclient.Namespace(
        model="ucx-test", revision="r", num_layers=layers, num_kv_heads=H, head_dim=D,
        dtype=torch.bfloat16, block_tokens=256,
    )  # fmt: skip


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 150_000 for i in range(n)]


@pytest.fixture
def master() -> Iterator[Server]:
    srv = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                       "--node-lease-s", "2")  # fmt: skip
    yield srv
    rc, out = srv.stop()
    assert rc == 0, out


def ucx_node(master: Server, host_mem: str = "256MiB") -> Server:
    return start_server("node", "--master", master.grpc, "--data-port", "0",
                        "--metrics-port", "0", "--host-mem", host_mem,
                        "--transport", "ucx")  # fmt: skip


async def _calls_until_node_dies(kv: kvclient.KVClient, node: Server, call) -> list[float]:
    """Run ``call(i)`` back to back; ``kill -9`` the node from a timer while one is in
    flight; return the durations of the calls that overlapped or followed the kill."""
    await call(0)
    loop = asyncio.get_running_loop()
    killed: list[float] = []
    started = time.monotonic()
    loop.call_later(0.05, lambda: (node.proc.send_signal(signal.SIGKILL),
                                   killed.append(time.monotonic())))  # fmt: skip
    after: list[float] = []
    for i in range(1, 10_000):
        t0 = time.monotonic()
        try:
            await call(i)
        except KVStoreError:
            pass  # typed: fine
        if killed and time.monotonic() >= killed[0]:
            after.append(time.monotonic() - t0)
            if time.monotonic() - killed[0] > 2 * TIMEOUT_S:
                break
        assert time.monotonic() - started < 60
    node.proc.wait(timeout=10)
    return after


async def test_node_killed_mid_get(master: Server) -> None:
    node = ucx_node(master)
    n = 64 * 256  # a 32 MiB int8 layer: each read takes a while
    tokens = _tokens(1, n)
    t = realistic_kv(n, H, D, torch.bfloat16, seed=1)
    async with await kvclient.KVClient.connect(master.grpc, _ns(), timeout_s=TIMEOUT_S) as kv:
        assert await kv.put_layer(tokens, 0, t) == n
        assert all(nd.ucx for nd in await kv._live_nodes(refresh=True))

        async def get(_: int) -> None:
            got = await kv.get_layer(tokens, 0)
            m = got.shape[1]
            assert m % 256 == 0
            if m:  # a short read is allowed; wrong bytes are not
                err = (got.float() - t[:, :m].float()).norm() / t[:, :m].float().norm()
                assert err < 0.02

        after = await _calls_until_node_dies(kv, node, get)
        print("AFTER", after)
    assert after and max(after) < TIMEOUT_S + 2, after


async def test_node_killed_mid_put(master: Server) -> None:
    node = ucx_node(master)
    n = 32 * 256
    t = realistic_kv(n, H, D, torch.bfloat16, seed=2)
    async with await kvclient.KVClient.connect(master.grpc, _ns(), timeout_s=TIMEOUT_S) as kv:

        async def put(i: int) -> None:
            stored = await kv.put_layer(_tokens(100 + i, n), 0, t)
            assert stored in range(0, n + 1, 256)

        after = await _calls_until_node_dies(kv, node, put)
    assert after and max(after) < TIMEOUT_S + 2, after


async def test_writer_killed_mid_put_leaks_no_pin(master: Server) -> None:
    node = ucx_node(master)
    try:
        writer = subprocess.Popen(
            [sys.executable, str(HERE / "kvproc.py"), "writer", master.grpc,
             "--tokens", "8192", "--layers", "32"],
            stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(HERE.parent)),
        )  # fmt: skip
        assert writer.stdout is not None
        for _ in range(4):  # let it get well into its puts
            writer.stdout.readline()
        writer.kill()
        writer.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (stats := await node_stats(node.data))["pinned_slots"]:
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.1)
        assert stats["leases"] == 0
        async with await kvclient.KVClient.connect(master.grpc, _ns()) as kv:  # still serving
            tokens = _tokens(7, 512)
            assert await kv.put_layer(tokens, 0, realistic_kv(512, H, D, torch.bfloat16)) == 512
            assert (await kv.get_layer(tokens, 0)).shape[1] == 512
    finally:
        rc, out = node.stop()
    assert rc == 0 and "pinned_slots=0" in out, out


async def test_reader_with_expired_lease_never_gets_another_blocks_bytes(master: Server) -> None:
    """Lease a chunk, let the lease expire, make the node reuse the memory for other
    blocks, then READ the old span anyway: what arrives is either rejected by the chunk's
    key and checksum or is exactly the leased block — never another block's KV."""
    node = ucx_node(master, host_mem="16MiB")
    ns = _ns()
    size = chunk_nbytes(256, H, D, torch.bfloat16, "int8")
    try:
        async with await kvclient.KVClient.connect(master.grpc, ns) as kv:
            tokens = _tokens(9, 256)
            t = realistic_kv(256, H, D, torch.bfloat16, seed=9)
            assert await kv.put_layer(tokens, 0, t) == 256
            block = kv.block_hashes(tokens)[0]
            ucx = kv._ucx
            node_info = (await kv._live_nodes(refresh=True))[0]
            peer = await ucx.peer(node_info.nixl_metadata, node_info.host)
            conn = await connect(node.data, timeout=5)
            await conn.send(Lease(ns.id, (ChunkRef(block, 0),), 0.3).header())
            leased = expect((await conn.recv_header(timeout=5)).header, Leased)
            assert leased.found == (1,)
            await asyncio.sleep(0.6)  # the lease expires; the node drops the connection
            with pytest.raises(KVStoreError):
                await conn.send(Release().header(), timeout=2)
                await conn.recv_header(timeout=2)
            await conn.close()
            for i in range(40):  # fill the 16 MiB pool: LRU eviction reuses the memory
                other = _tokens(1000 + i, 256)
                await kv.put_layer(other, 0, realistic_kv(256, H, D, torch.bfloat16, seed=i))
            async with ucx.staging(1, size) as rows:
                await ucx.read(peer, [list(s) for s in leased.spans], [rows[0]], 5.0)
                try:
                    got = decode_chunk(rows[0], expect_key=ChunkKey(block, 0, 0))
                except ChunkError as exc:
                    print("REJECTED", exc)  # rejected: a miss
                else:
                    ref = decode_chunk(kvclient.encode_chunk(t, key=ChunkKey(block, 0, 0)))
                    assert torch.equal(got, ref)
    finally:
        rc, out = node.stop()
    assert rc == 0, out


async def test_get_reads_committed_slots_without_asking_the_node(master: Server) -> None:
    """A ``ucx://`` get READs each slot at the location the lookup gave, with no exchange
    with the node, and gets the same bytes a ``tcp://`` read does."""
    node = ucx_node(master)
    n = 4 * 256
    tokens = _tokens(11, n)
    try:
        async with await kvclient.KVClient.connect(master.grpc, _ns(layers=2)) as kv:
            for layer in range(2):
                t = realistic_kv(n, H, D, torch.bfloat16, seed=20 + layer)
                assert await kv.put_layer(tokens, layer, t) == n
            holders = await kv._master.lookup(kv.ns.id, kv.block_hashes(tokens), 2)
            assert all(SlotLocation.unpack(h.location) for block in holders for h in block)
            got = await kv.get_layer(tokens, 1)
            assert (kv._reads.stats.direct, kv._reads.stats.leased) == (4, 0)
            lookups = rpc_count(master, "Lookup")
            assert lookups >= 1  # the get_layer's
            streamed = [t async for _, t in kv.stream_layers(tokens, timeout=10)]
            assert kv._reads.stats.direct == 4 + 2 * 4 and kv._reads.stats.retried == 0
            # The watch said where: no lookup per layer.
            assert rpc_count(master, "Lookup") == lookups
        async with await kvclient.KVClient.connect(master.grpc, _ns(layers=2), ucx=False) as tcp:
            assert torch.equal(got, await tcp.get_layer(tokens, 1))
            assert torch.equal(streamed[0], await tcp.get_layer(tokens, 0))
            assert tcp._reads.stats.tcp == 8
    finally:
        rc, out = node.stop()
    assert rc == 0, out


async def test_chunks_move_from_and_into_staging_on_the_kvs_own_device(master: Server) -> None:
    """The GPU-direct path on host tensors (the same code): a put's chunks are encoded
    straight into registered staging on the KV's device and WRITE'd from there, a get READs
    into staging on ``out``'s device; a put too big for one staging extent is encoded into
    new rows and copied through staging in parts, and still reads back byte for byte."""
    node = ucx_node(master)
    n = 4 * 256
    tokens, big = _tokens(13, n), _tokens(14, n)
    t = realistic_kv(n, H, D, torch.bfloat16, seed=31)
    try:
        async with await kvclient.KVClient.connect(master.grpc, _ns()) as kv:
            assert await kv.put_layer(tokens, 0, t) == n
            stats = kv._ucx.stats
            assert (stats.written_in_place, stats.written_copied) == (4, 0)
            out = torch.empty_like(t)
            got = await kv.get_layer(tokens, 0, out=out)
            assert got.shape[1] == n and stats.read == {"cpu": 4}
            assert kv._ucx.devices() == [torch.device("cpu")]
        small = 2 * 2**20  # half of it (1 MiB) holds one 534,600-byte chunk, not four
        async with await kvclient.KVClient.connect(master.grpc, _ns(), staging_bytes=small) as kv:
            assert await kv.put_layer(big, 0, t) == n
            assert (kv._ucx.stats.written_in_place, kv._ucx.stats.written_copied) == (0, 4)
        async with await kvclient.KVClient.connect(master.grpc, _ns(), ucx=False) as tcp:
            assert torch.equal(await tcp.get_layer(big, 0), await tcp.get_layer(tokens, 0))
            assert torch.equal(await tcp.get_layer(tokens, 0), out)
    finally:
        rc, out_ = node.stop()
    assert rc == 0, out_


async def test_a_stale_or_bogus_location_falls_back_to_the_node(master: Server) -> None:
    """A location from before an eviction (the slot since reused by other blocks), or one
    outside the node's memory, costs one more exchange — the leased read through the node
    — never a wrong tensor or a miss for a block the node holds."""
    node = ucx_node(master, host_mem="16MiB")
    ns = _ns()
    tokens = _tokens(12, 256)
    t = realistic_kv(256, H, D, torch.bfloat16, seed=12)
    try:
        async with await kvclient.KVClient.connect(master.grpc, ns) as kv:
            assert await kv.put_layer(tokens, 0, t) == 256
            hashes = kv.block_hashes(tokens)
            (old,) = (await kv._master.lookup(ns.id, hashes, 1))[0]
            evicted = await NodeClient(node.data, timeout_s=5).evict(ns.id, hashes)
            assert evicted.evicted == 1
            for i in range(40):  # fill the 16 MiB pool: the old slot's memory is reused
                other = _tokens(2000 + i, 256)
                await kv.put_layer(other, 0, realistic_kv(256, H, D, torch.bfloat16, seed=i))
            out = torch.zeros(2, 256, H, D, dtype=torch.bfloat16)
            assert await kv._fetch(hashes, 0, 0, {0: [old]}, kv._into(out)) == set()
            assert kv._reads.stats.retried == 1 and not out.any()  # another block's bytes: no
            assert await kv.put_layer(tokens, 0, t) == 256  # stored again
            want = (await kv.get_layer(tokens, 0)).clone()
            loc = SlotLocation.unpack(old.location)
            assert loc is not None
            bogus = dataclasses.replace(
                old, location=loc._replace(addr=loc.addr + (1 << 44)).pack()
            )  # not registered memory of the node: the READ itself fails
            assert await kv._fetch(hashes, 0, 0, {0: [bogus]}, kv._into(out)) == {0}
            assert kv._reads.stats.retried == 2 and torch.equal(out, want)
    finally:
        rc, out = node.stop()
    assert rc == 0, out


async def test_layers_after_the_first_are_written_in_one_round_trip(master: Server) -> None:
    """A ``ucx://`` put's ack grants the writer the next layer's chunk of each block: its
    put of that layer is a WRITE and one ``write`` exchange. A second writer of the same
    prefix waits for the grant (it is a claim) and then finds the chunk stored, or stores
    it itself once the grant ends; a ``write`` without a grant of one's own stores nothing."""
    node = ucx_node(master)
    ns, n = _ns(layers=3), 4 * 256
    tokens = _tokens(13, n)
    kv_of = [realistic_kv(n, H, D, torch.bfloat16, seed=40 + layer) for layer in range(3)]
    try:
        async with (
            await kvclient.KVClient.connect(master.grpc, ns) as a,
            await kvclient.KVClient.connect(master.grpc, ns) as b,
        ):
            assert await a.put_layer(tokens, 0, kv_of[0]) == n
            assert len(a._writes.grants) == 4 and (await node_stats(node.data))["grants"] == 4
            assert await a.put_layer(tokens, 1, kv_of[1]) == n  # WRITE + write: grants used
            assert (await node_stats(node.data))["grants"] == 4  # ... and layer 2's granted
            assert await b.put_layer(tokens, 2, kv_of[2]) == n  # waits out a's grant
            stats = await node_stats(node.data)
            assert (stats["grants"], stats["inflight"]) == (0, 0)
            await asyncio.sleep(1.1)  # a's grants are no longer good to it: it reserves
            assert await a.put_layer(tokens, 2, kv_of[2]) == n
            spec = [
                PutChunk(h, None, 1, chunk_nbytes(256, H, D, torch.bfloat16, "int8"))
                for h in a.block_hashes(tokens)
            ]
            forged = await NodeClient(node.data, timeout_s=5).write(ns.canonical_bytes(), spec, "x")
            assert forged.stored == 0 and forged.failed == (0, 1, 2, 3)
        async with await kvclient.KVClient.connect(master.grpc, ns, write_layers=range(1)) as pp:
            assert await pp.put_layer(_tokens(14, n), 0, kv_of[0]) == n  # a PP rank: layer 0
            assert len(pp._writes.grants) == 0 and (await node_stats(node.data))["grants"] == 0
        async with await kvclient.KVClient.connect(master.grpc, ns, ucx=False) as tcp:
            for layer in range(3):
                got = await tcp.get_layer(tokens, layer)
                err = (got.float() - kv_of[layer].float()).norm() / kv_of[layer].float().norm()
                assert got.shape[1] == n and err < 0.02, (layer, err)
    finally:
        rc, out = node.stop()
    assert rc == 0 and "pinned_slots=0" in out, out


async def test_a_first_use_that_fails_midway_fails_the_same_way_next_time() -> None:
    """The first ``ucx://`` call starts the client's agent and registers its host staging;
    when that fails after the agent started (here: a staging size no arena can have), the
    agent is closed and the next call starts afresh and says why again — it never finds an
    agent without staging and answers "client is closed", as every later call once did."""
    ucx = kvclient.ucx.UcxPath(staging_bytes=0)
    try:
        for _ in range(2):
            with pytest.raises(InvalidArgument, match="smaller than one page"):
                async with ucx.staging(1, 4096):
                    pass
    finally:
        await ucx.close()


async def test_a_device_whose_memory_cannot_be_registered_uses_host_staging() -> None:
    """Staging on a device whose memory NIXL cannot register (here the ``meta`` device,
    which has no memory at all; on a GPU: no room, UCX without CUDA, a second GPU on one
    agent) falls back to the host's registered staging, tried once: a transfer for that
    device still gets registered memory instead of failing."""
    ucx = kvclient.ucx.UcxPath(staging_bytes=4 * 2**20)
    meta = torch.device("meta")
    try:
        for _ in range(2):  # the second time without trying again
            arena = await ucx._arena(meta)
            assert arena.device == torch.device("cpu") and ucx.devices() == [arena.device]
            assert meta in ucx._no_staging
        async with ucx.staging(1, 4096) as rows:
            assert ucx.holds(rows[0])
    finally:
        await ucx.close()


async def test_a_reader_whose_first_peer_is_on_another_host_reads_from_it() -> None:
    """A client's first ``ucx://`` call may name a node on another host (a decode engine
    reads first; RDMA makes ``prefer_ucx`` choose ``ucx`` for a remote node). The node's
    address then belongs to no interface here, so it cannot pick the client's UCX
    interfaces: the agent takes them all and the READ goes through. (The client's agent
    once raised InvalidArgument "no local network interface has address ..." there.)"""
    from kvstore.transport.nixl import NixlAgent

    region = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    async with NixlAgent("remote-node", progress_thread=True) as node:
        reg = await node.register(region)
        metadata = await node.metadata()
        ucx = kvclient.ucx.UcxPath(staging_bytes=4 * 2**20)
        try:
            peer = await ucx.peer(metadata, "192.0.2.10")  # (TEST-NET-1: never a local address)
            async with ucx.staging(1, 4096) as rows:
                moved = await ucx.read(peer, [reg.span(4096, 4096).to_wire()], [rows[0]], 5.0)
                assert moved == 4096 and torch.equal(rows[0], region[4096:8192])
        finally:
            await ucx.close()


async def test_a_warmed_up_client_has_its_agent_peers_and_staging_before_its_first_put(
    master: Server,
) -> None:
    """``warm_up`` pays a client's one-time costs before its first request: the NIXL agent
    (UCX's start), its host staging registered and every page of it mapped, each ``ucx``
    node loaded as a peer and greeted (the node reads the greeting and lets it go), a data
    connection to each node dialled. The first put then finds all of it in place and the
    bytes read back; a ``tcp``-only client warms its connections alone; a device that is
    not one is refused before anything starts. (A client's first ``put_layer`` once took
    ~0.5 s for it.)"""
    from tests import thp

    node = ucx_node(master)
    staging = 16 * 2**20
    n, tokens = 2 * 256, _tokens(21, 2 * 256)
    t = realistic_kv(n, H, D, torch.bfloat16, seed=41)
    try:
        async with await kvclient.KVClient.connect(master.grpc, _ns(), staging_bytes=staging) as kv:
            ucx = kv._ucx
            assert ucx._agent is None and not ucx.devices()  # nothing until first use
            for bad in ("no-such-device", *(() if torch.cuda.is_available() else ("cuda",))):
                with pytest.raises(InvalidArgument, match="warm_up: no device"):
                    await kv.warm_up(bad)
            assert ucx._agent is None
            assert await kv.warm_up() == [node.data]
            agent, arena = ucx._agent, ucx._arenas[torch.device("cpu")]
            assert agent is not None and ucx.devices() == [torch.device("cpu")]
            assert list(ucx._peers.values()) == list(agent.peers)  # the node, loaded
            rss = thp.smaps_field(arena.tensor, "Rss")
            assert rss is None or rss * 1024 >= staging  # every staging page mapped
            assert len(kv._pool._idle[node.data]) == 1  # a connection kept
            assert await kv.warm_up() == [node.data]  # (again: nothing new)
            assert ucx._agent is agent and len(agent.peers) == 1
            # Each warm-up greeted the node (a NIXL notification, so UCX set its endpoint
            # up); the node's sweep read both and let them go.
            deadline = time.monotonic() + 10
            while (await node_stats(node.data))["notifications"] < 2:
                assert time.monotonic() < deadline, "the node never read the greetings"
                await asyncio.sleep(0.1)
            assert await kv.put_layer(tokens, 0, t) == n
            assert ucx._agent is agent and ucx.stats.written_in_place == 2
            back = await kv.get_layer(tokens, 0)
            error = (back.float() - t.float()).norm() / t.float().norm()
            assert back.shape == t.shape and error < 0.05  # (INT8: close, not equal)
        async with await kvclient.KVClient.connect(master.grpc, _ns(), ucx=False) as tcp:
            assert await tcp.warm_up() == []
            assert tcp._ucx._agent is None and len(tcp._pool._idle[node.data]) == 1
            assert torch.equal(await tcp.get_layer(tokens, 0), back)
    finally:
        rc, out = node.stop()
    assert rc == 0 and "pinned_slots=0" in out, out
