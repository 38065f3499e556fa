"""The master over real gRPC: a ``grpc.aio`` server on 127.0.0.1:0 in the test's loop and
:class:`MasterClient`; plus the pure membership and watch-view state."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.control import wire
from kvstore.control.records import ClusterEventKind, EventKind, Holding, IndexEvent
from kvstore.errors import (
    CapacityError,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    Miss,
    NodeIdTaken,
    PermissionDenied,
    TransportError,
    Unreachable,
)
from kvstore.master import (
    BlockAdd,
    BlockRef,
    CommitBatch,
    MasterClient,
    MasterConfig,
    MasterServer,
    Membership,
    MemoryIndexStore,
    ObjectAdd,
    StaleEpoch,
    Tier,
    WatchEvent,
    WatchKind,
)
from kvstore.master.watch import WatchView

NS = bytes(range(16))
CPB = 4  # chunks per block in these tests: 2 layers x 2 shards


def bh(i: int) -> bytes:
    return i.to_bytes(16, "big")


class FakeClock:
    """Monotonic time the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def running(
    config: MasterConfig | None = None,
    *,
    clock: FakeClock | None = None,
    store: MemoryIndexStore | None = None,
) -> AsyncIterator[tuple[MasterServer, MasterClient]]:
    kwargs = {"clock": clock} if clock is not None else {}
    server = MasterServer(config or MasterConfig(grpc_port=0), store, **kwargs)
    await server.start()
    client = MasterClient(server.address, timeout_s=5)
    try:
        yield server, client
        server.membership.validate()
        if isinstance(server.store, MemoryIndexStore):
            server.store.validate()
    finally:
        await client.close()
        await server.stop(grace=0.5)


@pytest.fixture
async def master() -> AsyncIterator[tuple[MasterServer, MasterClient]]:
    async with running() as pair:
        yield pair


async def register(client: MasterClient, node_id: str, **kw: object) -> int:
    reg = await client.register(node_id, f"tcp://127.0.0.1:{len(node_id) + 7000}", **kw)  # type: ignore[arg-type]
    return reg.epoch


def stall_apply(store: MemoryIndexStore) -> asyncio.Event:
    """Make ``store.apply`` wait for the returned event before it applies each batch."""
    gate, real_apply = asyncio.Event(), store.apply

    async def stalled(batch: CommitBatch) -> int:
        await gate.wait()
        return await real_apply(batch)

    store.apply = stalled  # type: ignore[method-assign]
    return gate


def commit(node: str, epoch: int, seq: int, *blocks: tuple[int, tuple[int, ...]]) -> CommitBatch:
    return CommitBatch(node, epoch, seq, tuple(BlockAdd(NS, bh(i), c) for i, c in blocks))


async def flat(batches: AsyncGenerator[list[WatchEvent], None]) -> AsyncGenerator[WatchEvent, None]:
    """One event at a time from the client's batches (and close the stream with us)."""
    try:
        async for batch in batches:
            assert batch, "the client never yields an empty batch"
            for event in batch:
                yield event
    finally:
        await batches.aclose()


async def next_event(events: AsyncIterator[WatchEvent]) -> WatchEvent:
    return await asyncio.wait_for(anext(events), 5)


async def until_snapshot_done(events: AsyncIterator[WatchEvent]) -> list[WatchEvent]:
    seen = []
    while (event := await next_event(events)).kind is not WatchKind.SNAPSHOT_DONE:
        seen.append(event)
    return seen


# -- the in-process client ----------------------------------------------------------------------


async def _outcomes(client: MasterClient, node: str) -> list[object]:
    """What a node's usual calls answer, errors included (as their types)."""

    async def outcome(call: Awaitable[object]) -> object:
        try:
            return await call
        except KVStoreError as exc:
            return type(exc)

    epoch = await register(client, node)
    return [
        await outcome(client.commit(commit(node, epoch, 1, (1, (0, 1)), (2, (0,))))),
        await outcome(client.commit(commit(node, epoch, 1, (1, (2,))))),  # duplicate seq
        await outcome(client.commit(commit(node, epoch + 9, 2, (3, (0,))))),
        await outcome(client.commit(commit(node, epoch, 0, (3, (0,))))),
        await outcome(client.register("", "tcp://127.0.0.1:1")),
        await outcome(client.drain("nobody")),
        [[h.node_id == node for h in hs] for hs in await client.lookup(NS, [bh(1), bh(2)], CPB)],
        (await client.match_prefix(NS, [bh(1), bh(2)], CPB)).blocks,
    ]


async def test_in_process_client_answers_like_grpc(
    master: tuple[MasterServer, MasterClient],
) -> None:
    server, over_grpc = master
    local = MasterClient.in_process(server.service, timeout_s=5)
    before = server.service.counters.commits
    expected = [1, 1, StaleEpoch, InvalidArgument, InvalidArgument, Miss, [[True], [True]], 0]
    assert await _outcomes(over_grpc, "over-grpc") == expected
    commits = server.service.counters.commits
    # The same calls on another node's blocks: the index now has two holders per block.
    expected[6] = [[True, False], [True, False]]
    got = await _outcomes(local, "in-process")
    assert sorted(got[6][0]) == [False, True] and sorted(got[6][1]) == [False, True]
    assert got[:6] + got[7:] == expected[:6] + expected[7:]
    assert server.service.counters.commits - commits == commits - before, "counted alike"
    with pytest.raises(InvalidArgument, match="gRPC channel"):
        await anext(local.watch(NS, [bh(1)], CPB))
    await local.close()
    await local.close()


async def test_in_process_client_deadline() -> None:
    store = MemoryIndexStore()
    server = MasterServer(MasterConfig(grpc_port=0), store)
    await server.start()
    try:
        local = MasterClient.in_process(server.service, timeout_s=5)
        gate = asyncio.Event()
        real_register = store.register_node

        async def stalled(rec: object) -> object:
            await gate.wait()
            return await real_register(rec)  # type: ignore[arg-type]

        store.register_node = stalled  # type: ignore[method-assign]
        with pytest.raises(KVTimeout):
            await local.register("slow", "tcp://127.0.0.1:1", timeout=0.05)
    finally:
        await server.stop(grace=0.5)


# -- membership and commits ---------------------------------------------------------------------


async def test_register_heartbeat_and_epochs(master: tuple[MasterServer, MasterClient]) -> None:
    server, client = master
    tiers = [Tier("host", 1 << 30, 1 << 20)]
    reg = await client.register(
        "a",
        "tcp://127.0.0.1:7001",
        transport="ucx",
        nixl_metadata=b"md",
        tiers=tiers,
        version="0.1",
    )
    assert reg.lease_s == server.config.node_lease_s
    again = await client.register("a", "tcp://127.0.0.1:7002")
    assert again.epoch > reg.epoch
    stale = await client.heartbeat("a", reg.epoch)
    assert (stale.ok, stale.reregister) == (False, True)
    unknown = await client.heartbeat("ghost", 1)
    assert unknown.reregister
    ok = await client.heartbeat(
        "a", again.epoch, tiers=[Tier("gpu", 100, 40)], counters={"evictions": 3}
    )
    assert (ok.ok, ok.reregister) == (True, False)
    assert server.service.node_counters["a"] == {"evictions": 3}
    (info,) = await client.nodes()
    assert (info.node_id, info.epoch, info.data_uri) == ("a", again.epoch, "tcp://127.0.0.1:7002")
    assert info.alive and not info.suspect and info.placeable
    assert info.tiers == (Tier("gpu", 100, 40),) and info.free_bytes == 60


async def test_commit_epoch_and_seq_rules(master: tuple[MasterServer, MasterClient]) -> None:
    _, client = master
    old = await register(client, "a")
    new = await register(client, "a")
    with pytest.raises(StaleEpoch):
        await client.commit(commit("a", old, 1, (1, (0,))))
    with pytest.raises(StaleEpoch):
        await client.commit(commit("ghost", 5, 1, (1, (0,))))
    assert await client.commit(commit("a", new, 1, (1, (0,)))) == 1
    assert await client.commit(commit("a", new, 1, (1, (1,)))) == 1, "duplicate seq is a no-op"
    assert await client.commit(commit("a", new, 2, (1, (1,)))) == 2
    with pytest.raises(InvalidArgument):
        await client.commit(commit("a", new, 0, (1, (2,))))
    ((holder,),) = await client.lookup(NS, [bh(1)], CPB)
    assert holder.chunks() == [0, 1] and holder.epoch == new


@pytest.mark.parametrize("commit_port", [None, 0], ids=["stream", "commit port"])
async def test_a_batch_sent_again_is_recorded_and_counted_once(commit_port: int | None) -> None:
    """A batch whose answer was lost comes again (its node's link or stream broke): the
    store applies it once, and so do the master's commit counter and its cluster events,
    whichever way each copy came in."""
    async with running(MasterConfig(grpc_port=0, commit_port=commit_port)) as (server, client):
        epoch = await register(client, "a")
        first = CommitBatch("a", epoch, 1, (BlockAdd(NS, bh(1), (0,)),), (BlockRef(NS, bh(7)),))
        assert await client.commit(first) == 1
        assert await client.commit(first) == 1  # (sent again on the link or stream)
        req = wire.commit_to_pb(first)
        req.session = client.session
        assert await server.service.commit_frame(req.SerializeToString()) == 1  # (and again)
        assert await client.commit(commit("a", epoch, 2, (2, (0,)))) == 2
        assert server.service.counters.commits == 2
        events, _, _ = server.service.events.since(0, b"", 100)
        kinds = [(e.kind, e.block_hash) for e in events if e.node_id == "a"]
        assert kinds == [
            (ClusterEventKind.REMOVED, bh(7)),
            (ClusterEventKind.STORED, bh(1)),
            (ClusterEventKind.STORED, bh(2)),
        ]


async def test_commits_share_one_stream_and_an_error_ends_it() -> None:
    """Where the master has no commit port, a node's commits go on one CommitStream,
    answered in order; a refused commit ends that stream with its typed error, and the
    next commit opens another."""
    async with running(MasterConfig(grpc_port=0, commit_port=None)) as (server, client):
        await _commits_share_one_stream(server, client)


async def _commits_share_one_stream(server: MasterServer, client: MasterClient) -> None:
    counters = server.service.counters
    epoch = await register(client, "a")
    for seq in range(1, 6):
        assert await client.commit(commit("a", epoch, seq, (seq, (0,)))) == seq
    assert (counters.commit_streams, counters.commits) == (1, 5)
    assert server.service.rpc_calls["Commit"] == 5  # (timed as Commit, whichever way in)
    with pytest.raises(StaleEpoch):
        await client.commit(commit("a", epoch + 7, 6, (6, (0,))))
    with pytest.raises(InvalidArgument):
        await client.commit(commit("a", epoch, 0, (6, (0,))))
    assert await client.commit(commit("a", epoch, 6, (6, (1,)))) == 6
    assert counters.commit_streams == 3 and counters.commits == 6  # (two ended by errors)
    holders = await client.lookup(NS, [bh(i) for i in range(1, 7)], CPB)
    assert [h.chunks() for (h,) in holders] == [[0]] * 5 + [[1]]


@pytest.mark.parametrize("commit_port", [None, 0], ids=["stream", "commit port"])
async def test_a_commit_timed_out_or_cancelled_leaves_nothing_for_the_next(
    commit_port: int | None,
) -> None:
    """A stalled master: a commit past its deadline raises KVTimeout, a cancelled one
    CancelledError; each drops its stream (or its link to the commit port), and the
    commits after them get their own answers on a new one."""
    store = MemoryIndexStore()
    async with running(MasterConfig(grpc_port=0, commit_port=commit_port), store=store) as (
        server,
        client,
    ):
        epoch = await register(client, "a")
        gate = stall_apply(store)
        with pytest.raises(KVTimeout, match="Commit"):
            await client.commit(commit("a", epoch, 1, (1, (0,))), timeout=0.1)
        cancelled = asyncio.create_task(client.commit(commit("a", epoch, 2, (2, (0,)))))
        await asyncio.sleep(0.1)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        gate.set()
        assert await client.commit(commit("a", epoch, 3, (3, (0,)))) == 3
        assert await client.commit(commit("a", epoch, 4, (4, (0,)))) == 4
        holders = await client.lookup(NS, [bh(3), bh(4)], CPB)
        assert [h.node_id for (h,) in holders] == ["a", "a"]
        counters = server.service.counters
        ways = (counters.commit_streams, counters.commit_links)
        assert ways == ((3, 0) if commit_port is None else (0, 3))


async def test_a_commit_after_its_master_restarted_on_the_same_port_goes_through() -> None:
    """The stream to the old master process is broken: the commit is sent again (by the
    unary Commit; a seq already applied is a no-op) and the one after streams again."""
    store, clock = MemoryIndexStore(), FakeClock()
    first = MasterServer(MasterConfig(grpc_port=0, commit_port=None), store, clock=clock)
    await first.start()
    client = MasterClient(first.address, timeout_s=5)
    try:
        epoch = await register(client, "a")
        assert await client.commit(commit("a", epoch, 1, (1, (0,)))) == 1
        await first.stop(grace=0.1)
        second = MasterServer(
            MasterConfig(grpc_port=first.port, commit_port=None), store, clock=clock
        )
        await second.start()
        try:
            assert await client.commit(commit("a", epoch, 2, (2, (0,)))) == 2
            assert await client.commit(commit("a", epoch, 3, (3, (0,)))) == 3
            assert second.service.counters.commits == 2
            assert second.service.counters.commit_streams >= 1
            holders = await client.lookup(NS, [bh(1), bh(2), bh(3)], CPB)
            assert [h.node_id for (h,) in holders] == ["a"] * 3
        finally:
            await second.stop(grace=0.1)
    finally:
        await client.close()
    await store.close()


@contextlib.asynccontextmanager
async def two_masters(
    commit_port: int | None = 0,
) -> AsyncIterator[tuple[MasterServer, MasterServer, MasterClient]]:
    """Two masters sharing one store (and a clock), and a client listing both."""
    store, clock = MemoryIndexStore(), FakeClock()
    first = MasterServer(MasterConfig(grpc_port=0, commit_port=commit_port), store, clock=clock)
    second = MasterServer(MasterConfig(grpc_port=0, commit_port=commit_port), store, clock=clock)
    await first.start()
    await second.start()
    client = MasterClient(f"{first.address},{second.address}", timeout_s=5)
    try:
        yield first, second, client
    finally:
        await client.close()
        await first.stop(grace=0.1)
        await second.stop(grace=0.1)
        await store.close()


async def test_a_commit_streamed_to_a_master_that_died_fails_over_to_the_next() -> None:
    """Two masters on one store: the node's stream is to the first; it stops; the next
    commit goes to the second (by Commit, which fails over) and the one after streams."""
    async with two_masters(commit_port=None) as (first, second, client):
        epoch = await register(client, "a")
        assert await client.commit(commit("a", epoch, 1, (1, (0,)))) == 1
        assert first.service.counters.commit_streams == 1
        await first.stop(grace=0.1)
        assert await client.commit(commit("a", epoch, 2, (2, (0,)))) == 2
        assert await client.commit(commit("a", epoch, 3, (3, (0,)))) == 3
        assert second.service.counters.commits == 2
        assert second.service.counters.commit_streams == 1
        holders = await client.lookup(NS, [bh(1), bh(2), bh(3)], CPB)
        assert [h.node_id for (h,) in holders] == ["a"] * 3


async def test_a_master_stops_without_waiting_out_its_grace_for_commit_streams() -> None:
    """A node's commit stream stays open between its commits; a stopping master ends it
    (UNAVAILABLE) instead of holding its stop for the whole grace."""
    server = MasterServer(MasterConfig(grpc_port=0, commit_port=None))
    await server.start()
    client = MasterClient(server.address, timeout_s=5)
    try:
        epoch = await register(client, "a")
        assert await client.commit(commit("a", epoch, 1, (1, (0,)))) == 1
        assert server.service.counters.commit_streams == 1
        loop = asyncio.get_running_loop()
        began = loop.time()
        await server.stop(grace=30.0)
        assert loop.time() - began < 10.0, "stop waited out its grace for an open stream"
        with pytest.raises(Unreachable):
            await client.commit(commit("a", epoch, 2, (2, (0,))), timeout=2)
    finally:
        await client.close()
        await server.stop()


@pytest.mark.parametrize("commit_port", [None, 0], ids=["stream", "commit port"])
async def test_a_commit_to_a_stalled_master_fails_over_within_its_deadline(
    commit_port: int | None,
) -> None:
    """Two masters on one store, the first alive but not answering commits: its stream (or
    its commit port) gets its share of the deadline, then the batch goes to the second
    (by Commit, or on a stream to it) within the commit's deadline, and the next commit
    goes to the second."""
    gate = asyncio.Event()
    async with two_masters(commit_port=commit_port) as (first, second, client):
        try:
            epoch = await register(client, "a")
            assert await client.commit(commit("a", epoch, 1, (1, (0,)))) == 1
            real = first.service._apply_commit

            async def stalled(batch: CommitBatch, session: bytes | None) -> int:
                await gate.wait()
                return await real(batch, session)

            first.service._apply_commit = stalled  # type: ignore[method-assign]
            assert await client.commit(commit("a", epoch, 2, (2, (0,))), timeout=2.0) == 2
            assert second.service.counters.commits == 1
            assert client.target == second.address
            assert await client.commit(commit("a", epoch, 3, (3, (0,)))) == 3
            counters = second.service.counters
            assert (counters.commits, counters.commit_streams) == (2, 1)
            assert counters.commit_links == (0 if commit_port is None else 1)
        finally:
            gate.set()


async def test_an_old_master_turns_streams_off_for_itself_only() -> None:
    """Two masters on one store, the first of a version before CommitStream (it answers
    UNIMPLEMENTED): commits to it go by Commit, the stream asked for once only, and once it
    stops, the client's commits to the second stream again."""
    import types

    import grpc

    asked: list[int] = []

    async def unimplemented(
        self: object, requests: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[object]:
        asked.append(1)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield  # pragma: no cover

    store, clock = MemoryIndexStore(), FakeClock()
    config = MasterConfig(grpc_port=0, commit_port=None)
    old, new = MasterServer(config, store, clock=clock), MasterServer(config, store, clock=clock)
    old.service.CommitStream = types.MethodType(unimplemented, old.service)  # type: ignore[method-assign]
    await old.start()
    await new.start()
    client = MasterClient(f"{old.address},{new.address}", timeout_s=5)
    try:
        epoch = await register(client, "a")
        for seq in (1, 2):
            assert await client.commit(commit("a", epoch, seq, (seq, (0,)))) == seq
        assert asked == [1] and old.service.counters.commits == 2
        await old.stop(grace=0.1)
        for seq in (3, 4, 5):
            assert await client.commit(commit("a", epoch, seq, (seq, (0,)))) == seq
        assert (new.service.counters.commits, new.service.counters.commit_streams) == (3, 1)
    finally:
        await client.close()
        await old.stop(grace=0.1)
        await new.stop(grace=0.1)
        await store.close()


async def test_a_registration_key_binds_the_node_id(
    master: tuple[MasterServer, MasterClient],
) -> None:
    """Over real gRPC: while a registration lives, another process (another key) can
    neither register its id (NodeIdTaken) nor heartbeat, commit for or deregister it
    (PermissionDenied), even knowing its epoch; the owner can do all of that."""
    server, owner = master
    owner.session = b"\x11" * 32
    epoch = await register(owner, "a")
    intruder = MasterClient(server.address, timeout_s=5)
    try:
        for key in (b"\x22" * 32, b""):
            intruder.session = key
            with pytest.raises(NodeIdTaken, match="held by the live registration"):
                await intruder.register("a", "tcp://10.9.9.9:1")
            with pytest.raises(PermissionDenied, match="registration key does not match"):
                await intruder.heartbeat("a", epoch)
            with pytest.raises(PermissionDenied):
                await intruder.commit(commit("a", epoch, 1, (9, (0,))))
            with pytest.raises(PermissionDenied):
                await intruder.deregister("a", epoch)
        (info,) = await owner.nodes()  # nothing the intruder sent took effect
        assert (info.epoch, info.data_uri, info.alive) == (epoch, "tcp://127.0.0.1:7001", True)
        assert await owner.lookup(NS, [bh(9)], CPB) == [[]]
        assert (await owner.heartbeat("a", epoch)).ok
        assert await owner.commit(commit("a", epoch, 1, (9, (0,)))) == 1
        intruder.session = b"\x22" * 32  # (the owner's key passed last: still only its own)
        with pytest.raises(PermissionDenied):
            await intruder.commit(commit("a", epoch, 2, (8, (0,))))
        with pytest.raises(PermissionDenied):
            await intruder.heartbeat("a", epoch)
        assert await owner.commit(commit("a", epoch, 2, (8, (0,)))) == 2
        again = await register(owner, "a")  # the owner re-registers at will
        assert again > epoch
        assert await owner.deregister("a", again)
        intruder.session = b"\x22" * 32  # a dead registration frees the id
        assert (await intruder.register("a", "tcp://127.0.0.1:7001")).epoch > again
    finally:
        await intruder.close()


async def test_lookup_and_match_prefix_use_the_union_of_holders(
    master: tuple[MasterServer, MasterClient],
) -> None:
    server, client = master
    ea, eb = await register(client, "a"), await register(client, "b")
    await client.commit(commit("a", ea, 1, (0, (0, 1)), (1, (0, 1, 2, 3)), (3, (0, 1, 2, 3))))
    await client.commit(commit("b", eb, 1, (0, (2, 3)), (2, (0, 1, 2))))
    hashes = [bh(i) for i in range(4)]

    match = await client.match_prefix(NS, hashes, CPB, block_tokens=256)
    assert match.blocks == 2, "block 2 lacks chunk 3 everywhere, so block 3 does not count"
    blocks, holders = match
    assert (blocks, holders) == (match.blocks, match.holders)
    assert server.service.counters.hit_tokens == 512
    assert [sorted(h.node_id for h in hs) for hs in match.holders] == [["a", "b"], ["a"]]
    assert {h.node_id: h.mask for h in match.holders[0]} == {"a": 0b0011, "b": 0b1100}
    count_only = await client.match_prefix(NS, hashes, CPB, skip_holders=True)
    assert count_only.blocks == 2 and count_only.holders == []

    located = await client.lookup(NS, [*hashes, bh(9)], CPB)
    assert [[h.node_id for h in hs] for hs in located] == [["a", "b"], ["a"], ["b"], ["a"], []]
    assert located[2][0].chunks() == [0, 1, 2]
    assert located[2][0].has(2) and not located[2][0].has(3)
    assert located[2][0].data_uri.startswith("tcp://127.0.0.1:")
    assert (await client.match_prefix(NS, hashes, 3)).blocks == 4, "only chunks < 3 needed"
    assert (await client.match_prefix(NS, [bh(9)], CPB)).blocks == 0

    stats = await client.stats()
    assert (stats.hits, stats.misses) == (2 + 2 + 4 + 0, 2 + 2 + 0 + 1)
    assert server.service.counters.prefix_lookups == 4


async def test_wire_masks_are_little_endian_bytes(
    master: tuple[MasterServer, MasterClient],
) -> None:
    _, client = master
    epoch = await register(client, "a")
    await client.commit(commit("a", epoch, 1, (1, (0, 9, 17))))
    ((holder,),) = await client.lookup(NS, [bh(1)], 20)
    assert holder.mask.to_bytes(3, "little") == bytes([0b1, 0b10, 0b10])
    ((cut,),) = await client.lookup(NS, [bh(1)], 10)
    assert cut.chunks() == [0, 9]


async def test_objects_and_stats(master: tuple[MasterServer, MasterClient]) -> None:
    _, client = master
    ea, eb = await register(client, "a"), await register(client, "b")
    await client.heartbeat("a", ea, tiers=[Tier("host", 1000, 100)])
    await client.heartbeat("b", eb, tiers=[Tier("host", 500, 50), Tier("gpu", 10, 1)])
    await client.commit(
        CommitBatch(
            "a", ea, 1, adds=(BlockAdd(NS, bh(1), (0,)),), object_adds=(ObjectAdd("k", 12),)
        )
    )
    (holder,) = await client.lookup_object("k")
    assert (holder.node_id, holder.nbytes, holder.epoch) == ("a", 12, ea)
    assert holder.data_uri.startswith("tcp://")
    assert await client.lookup_object("nope") == []
    await client.commit(CommitBatch("a", ea, 2, object_removes=("k",)))
    assert await client.lookup_object("k") == []
    stats = await client.stats()
    assert (stats.nodes, stats.live_nodes, stats.blocks, stats.objects) == (2, 2, 1, 0)
    assert (stats.capacity_bytes, stats.used_bytes) == (1510, 151)
    assert (stats.hits, stats.misses) == (1, 2)


async def test_drain_marks_a_node(master: tuple[MasterServer, MasterClient]) -> None:
    _, client = master
    await register(client, "a")
    assert await client.drain("a") is True
    (info,) = await client.nodes()
    assert info.draining and info.alive and not info.placeable
    assert await client.drain("a", undrain=True) is False
    assert (await client.nodes())[0].placeable
    with pytest.raises(Miss):
        await client.drain("ghost")


# -- leases -------------------------------------------------------------------------------------


async def test_silent_node_turns_suspect_then_dead_and_its_blocks_evicted() -> None:
    clock = FakeClock()
    async with running(MasterConfig(grpc_port=0, node_lease_s=4.0), clock=clock) as (
        server,
        client,
    ):
        ea, eb = await register(client, "a"), await register(client, "b")
        await client.commit(commit("a", ea, 1, (0, (0, 1)), (1, (0, 1, 2, 3))))
        await client.commit(commit("b", eb, 1, (0, (2, 3))))
        async with contextlib.aclosing(flat(client.watch(NS, [bh(0), bh(1)], CPB))) as events:
            assert len(await until_snapshot_done(events)) == 3

            clock.now += 2.5  # past lease/2
            await client.heartbeat("b", eb)
            nodes = {n.node_id: n for n in await client.nodes()}
            assert nodes["a"].alive and nodes["a"].suspect and not nodes["a"].placeable
            assert nodes["b"].placeable and nodes["a"].lease_age_s == pytest.approx(2.5)
            assert await server.service.sweep() == []

            clock.now += 2.0  # a: 4.5 s silent (dead); b: 2.0 s (suspect, alive)
            assert await server.service.sweep() == [("a", ea)]
            evicts = [await next_event(events), await next_event(events)]
        assert {(e.kind, e.block_index, e.chunks, e.node_id) for e in evicts} == {
            (WatchKind.EVICT, 0, (0, 1), "a"),
            (WatchKind.EVICT, 1, (0, 1, 2, 3), "a"),
        }
        assert all(e.reason == "lease expired" for e in evicts)
        located = await client.lookup(NS, [bh(0), bh(1)], CPB)
        assert [[h.node_id for h in hs] for hs in located] == [["b"], []]
        assert (await client.match_prefix(NS, [bh(0)], CPB)).blocks == 0
        nodes = {n.node_id: n for n in await client.nodes()}
        assert not nodes["a"].alive and nodes["b"].alive
        assert (await client.heartbeat("a", ea)).reregister
        with pytest.raises(StaleEpoch):
            await client.commit(commit("a", ea, 2, (2, (0,))))
        stats = await client.stats()
        assert (stats.nodes, stats.live_nodes, stats.blocks) == (2, 1, 1)


async def test_sweeper_expires_a_node_with_a_short_lease() -> None:
    async with running(MasterConfig(grpc_port=0, node_lease_s=0.6)) as (_, client):
        epoch = await register(client, "a")
        await client.commit(commit("a", epoch, 1, (1, (0,))))
        for _ in range(100):  # the sweeper runs every lease/4
            if await client.lookup(NS, [bh(1)]) == [[]]:
                break
            await asyncio.sleep(0.05)
        assert await client.lookup(NS, [bh(1)]) == [[]]
        assert not (await client.nodes())[0].alive


async def test_restarted_master_gives_known_nodes_a_grace_lease() -> None:
    store = MemoryIndexStore()
    clock = FakeClock()
    async with running(clock=clock, store=store) as (_, client):
        epoch = await register(client, "a")
        await client.commit(commit("a", epoch, 1, (1, (0,))))
    clock.now += 100.0  # much longer than a lease while the master was down
    async with running(clock=clock, store=store) as (server, client):
        assert (await client.heartbeat("a", epoch)).ok, "known node keeps its epoch"
        assert await server.service.sweep() == []
        ((holder,),) = await client.lookup(NS, [bh(1)])
        assert holder.node_id == "a"
    async with running() as (_, client):
        assert (await client.heartbeat("a", epoch)).reregister, "memory index lost: re-register"
    await store.close()


# -- watches ------------------------------------------------------------------------------------


async def test_watch_snapshot_then_live_events(master: tuple[MasterServer, MasterClient]) -> None:
    _, client = master
    epoch = await register(client, "a")
    await client.commit(commit("a", epoch, 1, (0, (0, 1, 2, 3)), (1, (0,))))
    async with contextlib.aclosing(flat(client.watch(NS, [bh(0), bh(1), bh(2)], CPB))) as events:
        snapshot = await until_snapshot_done(events)
        assert {(e.block_index, e.chunks) for e in snapshot} == {(0, (0, 1, 2, 3)), (1, (0,))}
        assert all(e.kind is WatchKind.COMMIT and e.epoch == epoch for e in snapshot)

        await client.commit(commit("a", epoch, 2, (2, (1,)), (7, (0,))))
        event = await next_event(events)
        assert (event.kind, event.block_index, event.chunks, event.node_id) == (
            WatchKind.COMMIT, 2, (1,), "a"
        )  # fmt: skip
        await client.commit(CommitBatch("a", epoch, 3, evicts=(BlockRef(NS, bh(1)),)))
        event = await next_event(events)
        assert (event.kind, event.block_index, event.chunks) == (WatchKind.EVICT, 1, (0,))
        await client.abort(NS, [bh(2)], "put cancelled")
        event = await next_event(events)
        assert (event.kind, event.block_index, event.reason) == (
            WatchKind.ABORT,
            2,
            "put cancelled",
        )


async def test_commits_racing_a_watch_are_not_lost(
    master: tuple[MasterServer, MasterClient],
) -> None:
    _, client = master
    epoch = await register(client, "a")
    hashes = [bh(i) for i in range(40)]

    async def writer() -> None:
        for i in range(40):
            await client.commit(commit("a", epoch, i + 1, (i, (0, 1, 2, 3))))

    task = asyncio.create_task(writer())
    await asyncio.sleep(0.01)
    seen: set[int] = set()
    async with contextlib.aclosing(flat(client.watch(NS, hashes, CPB))) as events:
        while len(seen) < 40:
            event = await next_event(events)
            if event.kind is WatchKind.COMMIT:
                seen.add(event.block_index)
    await task
    assert seen == set(range(40))


async def test_watch_that_falls_behind_is_ended() -> None:
    config = MasterConfig(grpc_port=0, watch_queue=8)
    async with running(config) as (server, client):
        epoch = await register(client, "a")
        hashes = [bh(i) for i in range(64)]
        async with contextlib.aclosing(flat(client.watch(NS, hashes, CPB))) as events:
            await until_snapshot_done(events)
            await client.commit(commit("a", epoch, 1, *((i, (0,)) for i in range(64))))
            with pytest.raises(CapacityError):
                while True:
                    await next_event(events)
        assert server.service.counters.watch_overflows == 1
        assert (await client.stats()).blocks == 64, "the server keeps serving"


async def test_watch_total_timeout(master: tuple[MasterServer, MasterClient]) -> None:
    _, client = master
    async with contextlib.aclosing(flat(client.watch(NS, [bh(1)], timeout=0.3))) as events:
        assert (await next_event(events)).kind is WatchKind.SNAPSHOT_DONE
        with pytest.raises(KVTimeout):
            await next_event(events)


async def test_stopping_the_master_ends_watches() -> None:
    server = MasterServer(MasterConfig(grpc_port=0))
    await server.start()
    client = MasterClient(server.address, timeout_s=5)
    async with client, contextlib.aclosing(flat(client.watch(NS, [bh(1)]))) as events:
        await until_snapshot_done(events)
        await server.stop(grace=0.5)
        with pytest.raises(TransportError):
            await next_event(events)


# -- input bounds and robustness ----------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.lookup(NS, [bh(0)] * 65537),
        lambda c: c.lookup(NS, [b"short"]),
        lambda c: c.lookup(b"x" * 15, [bh(0)]),
        lambda c: c.lookup(NS, [bh(0)], 65536),
        lambda c: c.match_prefix(NS, [bh(0)], 0),
        lambda c: c.abort(NS, []),
        lambda c: anext(c.watch(NS, [])),
        lambda c: c.register("has space", "tcp://x:1"),
        lambda c: c.register("a", ""),
        lambda c: c.register("a", "tcp://x:1", nixl_metadata=b"m" * ((1 << 20) + 1)),
        lambda c: c.register("a", "tcp://x:1", tiers=[Tier(f"t{i}", 1) for i in range(17)]),
        lambda c: c.commit(commit("a", 1, 1, (0, (65536,)))),
        lambda c: c.commit(CommitBatch("a", 1, 1, object_adds=(ObjectAdd("k" * 1025, 1),))),
        lambda c: c.lookup_object(""),
        lambda c: c.heartbeat("a", 1, counters={f"c{i}": i for i in range(257)}),
    ],
)
async def test_bad_input_is_rejected(master: tuple[MasterServer, MasterClient], call) -> None:  # type: ignore[no-untyped-def]
    _, client = master
    with pytest.raises(InvalidArgument):
        await call(client)
    assert (await client.stats()).nodes == 0, "nothing was applied"


async def test_garbage_on_the_grpc_port_leaves_it_serving(
    master: tuple[MasterServer, MasterClient],
) -> None:
    server, client = master
    loop = asyncio.get_running_loop()
    for payload in (
        os.urandom(64 << 10),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(64 << 10),
    ):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            await loop.sock_sendall(sock, payload)
        await register(client, "a")  # serves while the garbage connection is open
        sock.close()
    assert (await client.stats()).live_nodes == 1


async def test_unreachable_master_and_busy_port(master: tuple[MasterServer, MasterClient]) -> None:
    server, _ = master
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    free_port = probe.getsockname()[1]
    probe.close()
    async with MasterClient(f"127.0.0.1:{free_port}", timeout_s=2) as nowhere:
        with pytest.raises(Unreachable):
            await nowhere.stats()
    with pytest.raises(TransportError):
        await MasterServer(MasterConfig(grpc_port=server.port)).start()


async def test_rpc_observer_sees_every_call(master: tuple[MasterServer, MasterClient]) -> None:
    server, client = master
    seen: list[str] = []
    server.service.add_rpc_observer(lambda method, seconds: seen.append(method))
    await client.stats()
    with pytest.raises(InvalidArgument):
        await client.lookup(NS, [b"bad"])
    assert seen == ["Stats", "Lookup"]
    assert server.service.rpc_calls["Stats"] == 1 and server.service.rpc_seconds["Stats"] >= 0


def test_config_is_validated() -> None:
    with pytest.raises(InvalidArgument):
        MasterConfig(node_lease_s=0)
    with pytest.raises(InvalidArgument):
        MasterConfig(grpc_port=70000)


# -- pure state ---------------------------------------------------------------------------------


def test_membership_leases() -> None:
    m = Membership(lease_s=10.0)
    assert m.sweep_interval_s == 1.0 and Membership(2.0).sweep_interval_s == 0.5
    m.register("a", 5, now=0.0)
    m.register("b", 6, now=0.0)
    assert not m.status("a", 4.9).suspect  # type: ignore[union-attr]
    assert m.status("a", 5.0).suspect  # type: ignore[union-attr]
    assert m.heartbeat("b", 6, now=8.0) and not m.heartbeat("b", 5, now=8.0)
    assert m.sweep(9.9) == []
    assert m.sweep(10.0) == [("a", 5)]
    assert m.sweep(11.0) == [], "a death is reported once"
    status = m.status("a", 11.0)
    assert status is not None and not status.alive and status.lease_age_s == 11.0
    assert not m.heartbeat("a", 5, now=11.0) and not m.is_live("a", 5)
    m.register("a", 7, now=11.0)
    assert m.is_live("a", 7) and m.live_nodes() == {"a": 7, "b": 6}
    m.restore("c", 8, now=11.0)
    assert m.sweep(17.9) == [] and m.sweep(18.0) == [("b", 6)]
    assert m.sweep(20.9) == [] and m.sweep(21.0) == [("a", 7), ("c", 8)]
    m.validate()
    with pytest.raises(InvalidArgument):
        Membership(0)


def test_a_node_seen_through_the_shared_store_is_suspect_a_sweep_later() -> None:
    """Another master serves its heartbeats; this one learns of them once per sweep, so it
    waits a sweep interval longer before calling the node suspect, never longer to expire."""
    m = Membership(lease_s=10.0)
    m.register("a", 5, now=0.0)
    assert m.heartbeat("a", 5, now=3.0, remote=True)
    assert not m.status("a", 3.0 + 5.5).suspect  # type: ignore[union-attr]  (local: 5.0)
    assert m.status("a", 3.0 + 6.0).suspect  # type: ignore[union-attr]
    assert m.heartbeat("a", 5, now=2.0)  # older than what it knows: ignored
    assert m.status("a", 9.0).suspect  # type: ignore[union-attr]
    assert m.heartbeat("a", 5, now=9.0) and m.status("a", 14.5).suspect  # type: ignore[union-attr]
    assert m.sweep(19.0) == [("a", 5)]


def test_a_reported_node_is_suspect_until_it_heartbeats() -> None:
    m = Membership(lease_s=10.0)
    m.register("a", 5, now=0.0)
    assert not m.report("a", 4) and not m.report("b", 1)  # another epoch, unknown: no
    assert m.report("a", 5)
    status = m.status("a", 1.0)
    assert status is not None and status.alive and status.suspect
    assert m.heartbeat("a", 5, now=2.0) and not m.status("a", 2.0).suspect  # type: ignore[union-attr]
    assert m.sweep(12.0) == [("a", 5)] and not m.report("a", 5)  # dead: nothing to mark


def test_watch_view_turns_node_death_into_evicts() -> None:
    view = WatchView([bh(0), bh(1), bh(2)], chunks_per_block=4)
    events = view.snapshot([{"a": Holding(3, 0b10011)}, {"b": Holding(4, 0b1)}, {}])
    assert [(e.kind, e.block_index, e.chunks) for e in events] == [
        (WatchKind.COMMIT, 0, (0, 1)),
        (WatchKind.COMMIT, 1, (0,)),
        (WatchKind.SNAPSHOT_DONE, 0, ()),
    ]
    (commit_event,) = view.apply(IndexEvent(EventKind.COMMIT, NS, bh(2), "a", 3, (2, 9)))
    assert commit_event.chunks == (2,), "chunks beyond chunks_per_block are left out"
    assert view.apply(IndexEvent(EventKind.COMMIT, NS, bh(7), "a", 3, (0,))) == []
    dead = view.apply(IndexEvent(EventKind.NODE_DEAD, node_id="a", epoch=3, reason="gone"))
    assert [(e.kind, e.block_index, e.chunks, e.reason) for e in dead] == [
        (WatchKind.EVICT, 0, (0, 1), "gone"),
        (WatchKind.EVICT, 2, (2,), "gone"),
    ]
    assert view.apply(IndexEvent(EventKind.NODE_DEAD, node_id="b", epoch=2)) == []


_add = st.builds(
    BlockAdd,
    st.just(NS),
    st.sampled_from([bh(1), bh(2)]),
    st.lists(st.integers(0, 65535) | st.just(True), max_size=3).map(tuple),
    st.sampled_from([b"", b"\x02\x00", bytes(20), bytes(32)]),
)
_batch = st.builds(
    CommitBatch,
    st.just("a"),
    st.integers(1, 3),
    st.integers(1, 3),
    st.lists(_add, min_size=1, max_size=3).map(tuple),
    st.lists(st.builds(BlockRef, st.just(NS), st.just(bh(3))), max_size=2).map(tuple),
    tiers=st.lists(st.builds(Tier, st.just("host"), st.just(1)), max_size=2).map(tuple),
)


def _first_add(batch: CommitBatch, **fields: object) -> CommitBatch:
    first = replace(batch.adds[0], **fields)  # type: ignore[arg-type]
    return replace(batch, adds=(first, *batch.adds[1:]))


_CORRUPTIONS = [  # one field of a valid batch made invalid, or of another type
    lambda b: b,
    lambda b: replace(b, node_id="has space"),
    lambda b: replace(b, seq=0),
    lambda b: _first_add(b, ns_id=NS[:15]),
    lambda b: _first_add(b, ns_id=bytearray(NS)),
    lambda b: _first_add(b, block_hash=b"short"),
    lambda b: _first_add(b, chunks=(0, 65536)),
    lambda b: _first_add(b, chunks=(-1,)),
    lambda b: _first_add(b, chunks=[0]),
    lambda b: _first_add(b, location=bytes(33)),
    lambda b: _first_add(b, location=bytearray(2)),
    lambda b: replace(b, adds=list(b.adds)),
    lambda b: replace(b, evicts=(*b.evicts, BlockRef(NS, b"y"))),
    lambda b: replace(b, evicts=(*b.evicts, BlockRef(b"x", bh(3)))),
    lambda b: replace(b, object_adds=(ObjectAdd("k", 1),)),
    lambda b: replace(b, object_adds=(ObjectAdd("", 1),)),
    lambda b: replace(b, object_removes=("",)),
    lambda b: replace(b, object_adds=[]),  # (empty, but not the tuple a rebuild makes)
    lambda b: replace(b, object_removes=[]),
    lambda b: replace(b, tiers=(Tier("t" * 257, 1),)),
]


@pytest.mark.parametrize("corrupt", _CORRUPTIONS)
@settings(max_examples=25, deadline=None)
@given(batch=_batch)
def test_check_commit_passes_a_plain_batch_as_the_full_check_would(
    corrupt: Callable[[CommitBatch], CommitBatch], batch: CommitBatch
) -> None:
    """A batch of exact records and tuples skips the rebuild; the answer is the full
    check's (lists instead of tuples take that one): an equal batch or the same error."""

    def outcome(b: CommitBatch) -> str:
        try:
            return repr(wire.check_commit(b))  # (repr: bytes and bytearray compare equal)
        except InvalidArgument as exc:
            return str(exc)

    batch = corrupt(batch)
    lists = {"adds": list(batch.adds), "evicts": list(batch.evicts), "tiers": list(batch.tiers)}
    full = replace(batch, **lists)  # type: ignore[arg-type]
    assert outcome(batch) == outcome(full)
