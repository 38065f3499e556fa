"""KV-aware routing and the cluster event stream: the cost function and the event log as
pure logic, then the Route RPC, the Events stream (resumed after a disconnect, CLEARED when
it cannot be) and a router's own index against a real ``kvstore serve``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator

import pytest
import redis

import kvclient
from kvclient import Instance, PoolIndex
from kvstore.control.client import MasterClient
from kvstore.control.records import BlockAdd, BlockRef, EventKind, IndexEvent
from kvstore.core.routing import choose
from kvstore.dataplane import NodeClient
from kvstore.dataplane.location import SlotLocation, tier_mark, with_disk
from kvstore.errors import InvalidArgument, Unreachable
from kvstore.master.events import ClusterEventKind, EventLog
from kvstore.master.server import MasterConfig, MasterServer
from tests.cluster import Server, serving, start_server
from tests.kvproc import layer_kv, namespace, prompt
from tests.test_master import bh, commit, register

NS = bytes(16)


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


# ----------------------------------------------------------------------------- pure


def test_cost_weighs_reuse_transfer_and_load() -> None:
    insts = [Instance("a"), Instance("b", active_tokens=100, cached_tokens=512),
             Instance("c", active_tokens=5000, cached_tokens=2048)]  # fmt: skip
    got = choose(2048, 1024, insts)
    a, b, c = got.scores
    assert (a.prefill_tokens, a.loaded_tokens, a.cost) == (1024, 1024, 1024 + 102.4)
    assert (b.prefill_tokens, b.loaded_tokens, b.cost) == (1024, 512, 1024 + 51.2 + 100)
    assert (c.prefill_tokens, c.loaded_tokens, c.cost) == (0, 0, 5000)
    assert got.choice == "a" and got.pool_tokens == 1024
    # With load not counted, the instance holding the whole prompt wins.
    assert choose(2048, 1024, insts, load_weight=0).choice == "c"
    # Ties go to the less loaded instance, then to the first named.
    assert choose(10, 0, [Instance("x", 5), Instance("y", 0)], load_weight=0).choice == "y"
    assert choose(10, 0, [Instance("x"), Instance("y")]).choice == "x"


@pytest.mark.parametrize(
    "bad",
    [[], [Instance("a"), Instance("a")], [Instance("a", active_tokens=-1)]],
)
def test_bad_routing_input_is_refused(bad: list[Instance]) -> None:
    with pytest.raises(InvalidArgument):
        choose(10, 0, bad)
    with pytest.raises(InvalidArgument):
        choose(10, 0, [Instance("a")], overlap_weight=-1)


def test_event_log_numbers_resumes_and_clears() -> None:
    log = EventLog(capacity=4)
    assert log.start(0, "") == (0, False)  # a first connect starts at the head
    log.commit("n1", 1, [BlockAdd(NS, _h(1), (0, 1))], [])
    log.commit("n1", 1, [BlockAdd(_h(9), _h(2), (0,))], [BlockRef(NS, _h(1))])
    events, cursor, lost = log.since(0, b"", 10)
    assert [(e.seq, e.kind) for e in events] == [
        (1, ClusterEventKind.STORED), (2, ClusterEventKind.REMOVED), (3, ClusterEventKind.STORED)
    ]  # fmt: skip
    assert cursor == 3 and not lost and events[0].chunks == (0, 1)
    assert [e.seq for e in log.since(0, NS, 10)[0]] == [1, 2]  # one namespace only
    assert log.start(2, log.log_id) == (2, False)  # resume: exactly what was missed
    assert log.start(2, "another-log") == (3, True)  # another master's numbers: clear
    log.node_dead("n1", 1, "lease expired")
    for i in range(3):
        log.commit("n2", 1, [BlockAdd(NS, _h(10 + i), (0,))], [])
    assert log.last_seq == 7
    assert log.start(1, log.log_id)[1]  # events 2.. are no longer kept
    events, cursor, lost = log.since(1, b"", 10)
    assert lost and [e.seq for e in events] == [4, 5, 6, 7] and cursor == 7
    assert events[0].kind is ClusterEventKind.NODE_DEAD
    assert log.since(7, b"", 10) == ([], 7, False)
    assert [e.seq for e in log.since(3, b"", 2)[0]] == [4, 5]  # at most max_events


def test_event_log_records_a_shared_stores_changes_and_clears_across_a_gap() -> None:
    """A log that follows a shared store's stream records its changes as events (an ABORT
    is none); after a gap every position before it, and every reader there, must clear."""
    log = EventLog(capacity=8)
    loc = SlotLocation(4096, 1024, 2).pack()
    log.record([
        IndexEvent(EventKind.COMMIT, NS, _h(1), "n1", 3, (0, 2), "", loc),
        IndexEvent(EventKind.ABORT, NS, _h(2), "", 0, (), "writer aborted"),
        IndexEvent(EventKind.EVICT, NS, _h(1), "n1", 3, (0, 2)),
        IndexEvent(EventKind.NODE_DEAD, b"", b"", "n1", 3, (), "lease expired"),
    ])  # fmt: skip
    events, cursor, lost = log.since(0, b"", 10)
    assert [(e.seq, e.kind, e.chunks, e.medium) for e in events] == [
        (1, ClusterEventKind.STORED, (0, 2), "host"),
        (2, ClusterEventKind.REMOVED, (), ""),
        (3, ClusterEventKind.NODE_DEAD, (), ""),
    ]
    assert cursor == 3 and not lost and events[2].reason == "lease expired"
    log.gap()  # (the store's stream was not followed for a while)
    log.record([IndexEvent(EventKind.COMMIT, NS, _h(5), "n2", 4, (1,))])
    assert log.last_seq == 5
    assert log.start(3, log.log_id) == (5, True)  # caught up before the gap: clears anyway
    assert log.start(0, "") == (5, False)
    events, cursor, lost = log.since(3, b"", 10)  # a reader open across the gap
    assert lost and [e.seq for e in events] == [5] and cursor == 5
    assert log.since(4, b"", 10) == ([events[0]], 5, False)  # (4: the gap's own number)
    assert log.snapshot_done(4).kind is ClusterEventKind.SNAPSHOT_DONE


def test_event_log_says_where_each_stored_block_is() -> None:
    # A STORED event's medium is the tier the committed location names, whatever its form
    # (the log reads it off the location once a reader passes the event).
    host = SlotLocation(4096, 1024, 2).pack()
    gpu = SlotLocation(4096, 1024, 2, mem=1).pack()
    forms = [(host, "host"), (with_disk(host, True), "host+disk"), (gpu, "gpu"),
             (tier_mark("disk"), "disk"), (tier_mark("host+disk"), "host+disk"),
             (b"", "")]  # fmt: skip
    log = EventLog()
    log.commit("n1", 1, [BlockAdd(NS, _h(i), (0,), loc) for i, (loc, _) in enumerate(forms)], [])
    log.commit("n1", 1, [], [BlockRef(NS, _h(0))])
    events = log.since(0, b"", 10)[0]
    assert [e.medium for e in events] == [medium for _, medium in forms] + [""]
    assert log.since(0, b"", 10)[0] == events  # (read twice: the same events)


# ----------------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serving("256MiB") as srv:
        yield srv


async def _next_events(stream: object, want: int) -> tuple[str, list]:
    got: list = []
    log_id = ""
    async with asyncio.timeout(20):
        while True:  # at least one message
            log_id, events = await anext(stream)  # type: ignore[call-overload]
            got += events
            if len(got) >= want:
                return log_id, got


async def test_event_stream_resumes_after_a_disconnect(server: Server) -> None:
    ns = namespace(layers=1)
    kv = await kvclient.KVClient.connect(server.grpc, ns)
    async with kv:
        stream = kv.events()
        log_id, first = await _next_events(stream, 0)  # the head; the log's id
        assert log_id and first == []
        a, b = prompt(512, 501), prompt(512, 502)
        await kv.put_layer(a, 0, layer_kv(512, 0, 501))
        await kv.put_layer(b, 0, layer_kv(512, 0, 502))
        _, events = await _next_events(stream, 4)
        stored = {(e.block_hash, e.kind) for e in events}
        want = {(h, ClusterEventKind.STORED) for h in kv.block_hashes(a) + kv.block_hashes(b)}
        assert stored == want and all(e.ns_id == ns.id and e.node_id for e in events)
        seqs = [e.seq for e in events]
        assert seqs == list(range(seqs[0], seqs[0] + 4))
        await stream.aclose()  # disconnect; the pool changes meanwhile
        c = prompt(512, 503)
        await kv.put_layer(c, 0, layer_kv(512, 0, 503))
        gone = kv.block_hashes(a)[1:]
        assert (await NodeClient(server.data, timeout_s=5).evict(ns.id, gone)).evicted >= 1
        resumed = kv.events(seqs[-1], log_id)
        _, missed = await _next_events(resumed, 3)
        assert [e.seq for e in missed] == list(range(seqs[-1] + 1, seqs[-1] + 4))
        assert [e.kind for e in missed] == [ClusterEventKind.STORED] * 2 + [
            ClusterEventKind.REMOVED
        ]
        assert missed[-1].block_hash == gone[0]
        await resumed.aclose()
        stale = kv.events(seqs[-1], "not-this-log")
        _, again = await _next_events(stale, 1)
        assert again[0].kind is ClusterEventKind.CLEARED
        await stale.aclose()


async def test_a_routers_index_follows_the_pool_and_route_weighs_it(server: Server) -> None:
    ns = namespace(layers=2)
    kv = await kvclient.KVClient.connect(server.grpc, ns)
    async with kv:
        index = PoolIndex()
        follower = asyncio.create_task(index.follow(kv, timeout=60))
        try:
            tokens = prompt(1024 + 100, 601)
            for layer in range(2):
                await kv.put_layer(tokens[:768], layer, layer_kv(768, layer, 601))
            hashes = kv.block_hashes(tokens)
            async with asyncio.timeout(20):
                while index.prefix_blocks(ns.id, hashes, 2) < 3:
                    await asyncio.sleep(0.05)
            assert index.prefix_blocks(ns.id, hashes, 2) * 256 == await kv.match_prefix(tokens)
            insts = [Instance("cold"), Instance("warm", active_tokens=50, cached_tokens=1024),
                     Instance("busy", active_tokens=100_000)]  # fmt: skip
            got = await kv.route(tokens, insts)
            assert got.pool_tokens == 768
            assert got == choose(len(tokens), 768, insts)  # the RPC is the cost function
            assert got.choice == "warm"
            assert (await kv.route(tokens, insts, load_weight=0, transfer_weight=0)).choice in (
                "warm", "busy")  # fmt: skip
            with pytest.raises(InvalidArgument):
                await kv.route(tokens, [Instance("x"), Instance("x")])
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower


async def _until_done(stream: object) -> list:
    """The events of ``stream`` up to and including its SNAPSHOT_DONE."""
    got: list = []
    async with asyncio.timeout(20):
        while not got or got[-1].kind is not ClusterEventKind.SNAPSHOT_DONE:
            got += (await anext(stream))[1]  # type: ignore[call-overload]
    return got


async def _holds(index: PoolIndex, ns_id: bytes, hashes: list[bytes], cpb: int, n: int) -> None:
    async with asyncio.timeout(30):
        while index.prefix_blocks(ns_id, hashes, cpb) < n:
            await asyncio.sleep(0.05)


async def test_a_router_started_after_the_puts_learns_what_the_pool_holds(
    server: Server,
) -> None:
    """A stream asked for a snapshot starts with CLEARED, a STORED event per block held
    (with the chunks held), SNAPSHOT_DONE numbered as the CLEARED, then the live events; a
    router's index starting with nothing asks for one, so it knows blocks stored before it
    started."""
    ns = dataclasses.replace(namespace(layers=2), model="itest-snapshot")  # (its own blocks)
    kv = await kvclient.KVClient.connect(server.grpc, ns)
    async with kv:
        tokens = prompt(768, 701)
        await kv.put_layer(tokens, 0, layer_kv(768, 0, 701))
        hashes = kv.block_hashes(tokens)
        stream = kv.events(snapshot=True)
        got = await _until_done(stream)
        assert got[0].kind is ClusterEventKind.CLEARED and got[-1].seq == got[0].seq
        assert {e.block_hash: e.chunks for e in got[1:-1]} == {h: (0,) for h in hashes}
        assert all(e.kind is ClusterEventKind.STORED and e.node_id for e in got[1:-1])
        await kv.put_layer(tokens, 1, layer_kv(768, 1, 701))
        _, live = await _next_events(stream, 3)
        assert {(e.block_hash, e.chunks) for e in live} == {(h, (1,)) for h in hashes}
        assert all(e.seq > got[0].seq for e in live)
        await stream.aclose()
        plain = kv.events()  # a first connect without a snapshot: from the head, as before
        assert (await _next_events(plain, 0))[1] == []
        await plain.aclose()
        index = PoolIndex()
        follower = asyncio.create_task(index.follow(kv, timeout=60))
        try:
            await _holds(index, ns.id, hashes, 2, 3)
            assert index.prefix_blocks(ns.id, hashes, 2) * 256 == await kv.match_prefix(tokens)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower


@pytest.mark.skipif(not os.environ.get("KVSTORE_TEST_REDIS"), reason="KVSTORE_TEST_REDIS unset")
async def test_a_routers_index_is_the_pools_whatever_master_it_follows() -> None:
    """Masters on one Redis: a router following the master its node does not commit
    through learns every block (each master's stream carries the whole pool's events), and
    a router whose master is killed moves to the other and is rebuilt there (CLEARED, the
    blocks held, SNAPSHOT_DONE), blocks stored before and after the kill included."""
    url = os.environ["KVSTORE_TEST_REDIS"].rsplit("/", 1)[0] + "/11"
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        r.flushdb()
    masters = [start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                            "--redis", url) for _ in range(2)]  # fmt: skip
    both = f"{masters[0].grpc},{masters[1].grpc}"
    node = start_server("node", "--master", both, "--data-port", "0", "--metrics-port", "0",
                        "--host-mem", "64MiB")  # fmt: skip
    ns = namespace(layers=1)
    tasks: list[asyncio.Task[None]] = []
    try:
        kv = await kvclient.KVClient.connect(both, ns)  # puts commit through masters[0]
        other = await kvclient.KVClient.connect(masters[1].grpc, ns)
        moving = await kvclient.KVClient.connect(both, ns)
        async with kv, other, moving:
            a, b, c = prompt(512, 801), prompt(512, 802), prompt(512, 803)
            await kv.put_layer(a, 0, layer_kv(512, 0, 801))
            watcher, mover = PoolIndex(), PoolIndex()
            tasks = [
                asyncio.create_task(watcher.follow(other, timeout=120, retry_s=0.2)),
                asyncio.create_task(mover.follow(moving, timeout=120, retry_s=0.2)),
            ]
            for index in (watcher, mover):
                await _holds(index, ns.id, kv.block_hashes(a), 1, 2)  # stored before it
            await kv.put_layer(b, 0, layer_kv(512, 0, 802))
            for index in (watcher, mover):
                await _holds(index, ns.id, kv.block_hashes(b), 1, 2)  # live, through the other
            cleared = mover.cleared
            masters[0].kill()
            await kv.put_layer(c, 0, layer_kv(512, 0, 803))  # now through masters[1]
            await _holds(mover, ns.id, kv.block_hashes(c), 1, 2)
            assert mover.cleared == cleared + 1  # it moved, and was rebuilt:
            for tokens in (a, b):
                assert mover.prefix_blocks(ns.id, kv.block_hashes(tokens), 1) == 2
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        rc, out = node.stop()
        for m in masters:
            m.stop()
    assert rc == 0, out


async def test_a_master_stops_without_waiting_out_its_grace_for_an_event_stream() -> None:
    """A master that stops ends its open event streams at once (the router moves to
    another master) rather than holding its stop for their sake."""
    server = MasterServer(MasterConfig(grpc_port=0))
    await server.start()
    client = MasterClient(server.address, timeout_s=5)
    try:
        stream = client.events(b"", snapshot=True, timeout=60)
        assert [e.kind for e in (await anext(stream))[1]] == []  # (the log's id)
        assert [e.kind for e in (await anext(stream))[1]] == [
            ClusterEventKind.CLEARED, ClusterEventKind.SNAPSHOT_DONE]  # fmt: skip
        began = time.monotonic()
        stopping = asyncio.create_task(server.stop(grace=30.0))
        with pytest.raises(Unreachable, match="stopping"):
            async with asyncio.timeout(20):
                await anext(stream)
        await asyncio.wait_for(stopping, 20)
        assert time.monotonic() - began < 5.0, "stop waited out its grace for an event stream"
    finally:
        await client.close()
        await server.stop()


async def test_a_reader_behind_the_log_gets_the_index_again_or_what_is_kept() -> None:
    """A reader the log has left behind (more events came at once than it keeps) is sent
    CLEARED and, having asked for a snapshot, the index again and SNAPSHOT_DONE, then the
    live events; one that did not ask gets CLEARED and the events the log still keeps."""
    server = MasterServer(MasterConfig(grpc_port=0))
    server.service.events = EventLog(capacity=4)  # (a log that keeps four events)
    await server.start()
    client = MasterClient(server.address, timeout_s=5)
    try:
        epoch = await register(client, "n")
        fresh = client.events(b"", snapshot=True, timeout=60)
        plain = client.events(b"", timeout=60)
        for stream in (fresh, plain):
            await anext(stream)  # (the log's id: open)
        assert [e.kind for e in (await anext(fresh))[1]] == [
            ClusterEventKind.CLEARED, ClusterEventKind.SNAPSHOT_DONE]  # fmt: skip
        await client.commit(commit("n", epoch, 1, *((i, (0,)) for i in range(10))))
        got: list = []
        async with asyncio.timeout(20):
            while not got or got[-1].kind is not ClusterEventKind.SNAPSHOT_DONE:
                got += (await anext(fresh))[1]
        assert got[0].kind is ClusterEventKind.CLEARED
        assert {e.block_hash for e in got[1:-1]} == {bh(i) for i in range(10)}
        _, kept = await _next_events(plain, 5)
        assert [e.kind for e in kept] == [ClusterEventKind.CLEARED] + [ClusterEventKind.STORED] * 4
        assert [e.block_hash for e in kept[1:]] == [bh(i) for i in range(6, 10)]
        await client.commit(commit("n", epoch, 2, (11, (0,))))
        (live,) = (await anext(fresh))[1]
        assert live.block_hash == bh(11) and live.seq > got[0].seq
        for stream in (fresh, plain):
            await stream.aclose()
    finally:
        await client.close()
        await server.stop()
