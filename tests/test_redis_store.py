"""Redis-only behaviour of :class:`kvstore.master.redis_store.RedisIndexStore`.

The conformance suite (``tests/test_index_store.py``) runs every IndexStore test on Redis
too; these cover what only a shared store has: two masters on one Redis, atomic rejection
in Lua, the bounded event stream, and Redis being unreachable or going away. Tests against
``KVSTORE_TEST_REDIS`` use a fresh key prefix each and delete their keys afterwards.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from kvstore.control.client import MasterClient
from kvstore.control.records import (
    BlockAdd,
    BlockRef,
    CommitBatch,
    EventKind,
    NodeRecord,
    ObjectAdd,
    Tier,
)
from kvstore.errors import (
    CapacityError,
    InvalidArgument,
    KVTimeout,
    PermissionDenied,
    StaleEpoch,
    TransportError,
    Unreachable,
)
from kvstore.master.index import MemoryIndexStore
from kvstore.master.membership import Membership
from kvstore.master.redis_store import RedisIndexStore
from kvstore.master.service import MasterService

pytestmark = pytest.mark.redis

REDIS_URL = os.environ.get("KVSTORE_TEST_REDIS", "")
needs_redis = pytest.mark.skipif(not REDIS_URL, reason="KVSTORE_TEST_REDIS (redis:// URL) unset")
NS = bytes(range(16))


def bh(i: int) -> bytes:
    return i.to_bytes(16, "big")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prefix() -> Iterator[str]:
    """A fresh key prefix; every key under it is deleted after the test."""
    name = f"kvtest:{uuid.uuid4().hex[:16]}"
    yield name
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=f"{name}:*", count=1000))
        if keys:
            client.unlink(*keys)
    finally:
        client.close()


@pytest.fixture
async def masters(prefix: str) -> AsyncIterator[tuple[RedisIndexStore, RedisIndexStore]]:
    """Two stores on the same Redis and prefix: what two masters would hold."""
    a = RedisIndexStore(REDIS_URL, namespace_prefix=prefix, timeout_s=2)
    b = RedisIndexStore(REDIS_URL, namespace_prefix=prefix, timeout_s=2)
    try:
        await a.start()
        await b.start()
        yield a, b
        a.validate()
    finally:
        await a.close()
        await b.close()


def events_len(prefix: str) -> int:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        return int(client.xlen(f"{prefix}:events"))
    finally:
        client.close()


@needs_redis
async def test_two_masters_share_commits_and_watch_events(
    masters: tuple[RedisIndexStore, RedisIndexStore],
) -> None:
    a, b = masters
    epoch = (await a.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
    async with b.subscribe(NS, [bh(1), bh(2)], 64) as sub:
        assert sub.snapshot == [{}, {}]
        await a.apply(CommitBatch("n1", epoch, 1, (BlockAdd(NS, bh(1), (0, 3)),)))
        (event,) = await sub.read(10, timeout=2)
        assert (event.kind, event.block_hash, event.chunks) == (EventKind.COMMIT, bh(1), (0, 3))
        (located,) = await b.locate(NS, [bh(1)])
        assert located["n1"].mask == 0b1001 and located["n1"].epoch == epoch
        assert await b.drop_node("n1", epoch, "lease expired")
        (dead,) = await sub.read(10, timeout=2)
        assert (dead.kind, dead.node_id, dead.reason) == (
            EventKind.NODE_DEAD,
            "n1",
            "lease expired",
        )
    assert await a.locate(NS, [bh(1)]) == [{}]
    assert [(n.node_id, n.alive) for n in await a.nodes()] == [("n1", False)]
    with pytest.raises(StaleEpoch):
        await a.apply(CommitBatch("n1", epoch, 2, (BlockAdd(NS, bh(2), (0,)),)))


@needs_redis
async def test_a_stale_epoch_batch_is_rejected_with_nothing_applied(
    masters: tuple[RedisIndexStore, RedisIndexStore], prefix: str
) -> None:
    a, b = masters
    old = (await a.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
    await a.apply(
        CommitBatch("n1", old, 1, (BlockAdd(NS, bh(1), (0,)),), object_adds=(ObjectAdd("k", 4),))
    )
    new = (await b.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch  # another master
    await b.apply(CommitBatch("n1", new, 1, (BlockAdd(NS, bh(1), (1,)),)))
    before = (await a.locate(NS, [bh(1), bh(2)]), await a.counts(), events_len(prefix))
    stale = CommitBatch(
        "n1",
        old,
        7,
        adds=(BlockAdd(NS, bh(2), (0, 1)),),
        evicts=(BlockRef(NS, bh(1)),),
        object_adds=(ObjectAdd("k2", 1),),
        object_removes=("k",),
    )
    with pytest.raises(StaleEpoch, match=f"at epoch {new}"):
        await a.apply(stale)
    assert (await a.locate(NS, [bh(1), bh(2)]), await a.counts(), events_len(prefix)) == before
    assert await a.apply(CommitBatch("n1", new, 2, (BlockAdd(NS, bh(2), (5,)),))) == 2


@needs_redis
async def test_two_masters_applying_one_seq_apply_it_once(
    masters: tuple[RedisIndexStore, RedisIndexStore], prefix: str
) -> None:
    a, b = masters
    epoch = (await a.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
    first = CommitBatch("n1", epoch, 1, (BlockAdd(NS, bh(1), (0,)),))
    retry = CommitBatch("n1", epoch, 1, (BlockAdd(NS, bh(1), (1,)),))
    start = events_len(prefix)
    assert await asyncio.gather(a.apply(first), b.apply(retry)) == [1, 1]
    (located,) = await b.locate(NS, [bh(1)])
    assert located["n1"].mask in (0b01, 0b10), "exactly one of the two batches applied"
    assert events_len(prefix) == start + 1


def write_blocking(prefix: str, writes: int, stream_maxlen: int) -> None:
    """Register n1 and commit ``writes`` one-add batches from another thread and event loop,
    blocking the caller's event loop meanwhile (its stream reader cannot run)."""

    async def write_many() -> None:
        w = RedisIndexStore(REDIS_URL, namespace_prefix=prefix, stream_maxlen=stream_maxlen)
        async with w:
            epoch = (await w.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
            for seq in range(1, writes + 1):
                await w.apply(CommitBatch("n1", epoch, seq, (BlockAdd(NS, bh(1), (seq % 8,)),)))

    writer = threading.Thread(target=asyncio.run, args=(write_many(),))
    writer.start()
    writer.join(timeout=60)
    assert not writer.is_alive()


async def reader_blocked() -> None:
    """Return once Redis has a client blocked (our reader's XREAD BLOCK)."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        for _ in range(500):
            if int(client.info("clients")["blocked_clients"]) > 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the stream reader never blocked in XREAD")
    finally:
        client.close()


@needs_redis
async def test_a_read_gets_every_event_committed_before_it(prefix: str) -> None:
    async with (
        RedisIndexStore(REDIS_URL, namespace_prefix=prefix) as watcher,
        watcher.subscribe(NS, [bh(1)], 1000) as sub,
    ):
        await reader_blocked()
        write_blocking(prefix, 50, 10_000)
        # The reader's pending XREAD holds only the first entry: without catching up to
        # the stream's head, a read would return just that one.
        events = await sub.read(1000, timeout=5)
    assert [e.chunks for e in events] == [(seq % 8,) for seq in range(1, 51)]


@needs_redis
async def test_the_event_stream_is_bounded_and_a_lagging_watcher_overflows(prefix: str) -> None:
    async with (
        RedisIndexStore(REDIS_URL, namespace_prefix=prefix) as watcher,
        watcher.subscribe(NS, [bh(1)], 100_000) as sub,
    ):
        write_blocking(prefix, 300, 10)
        assert events_len(prefix) < 300, "XADD MAXLEN ~ trimmed the stream"
        with pytest.raises(CapacityError):
            await sub.read(1000, timeout=5)
        watcher.validate()


@needs_redis
async def test_watchers_joining_mid_stream_get_each_later_commit_exactly_once(
    masters: tuple[RedisIndexStore, RedisIndexStore],
) -> None:
    """Every commit adds a new chunk: a watcher must never see a chunk both in its
    snapshot and in an event, nor twice, and must end with the final mask."""
    a, b = masters
    epoch = (await a.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
    writes = 120

    async def writer() -> None:
        for seq in range(1, writes + 1):
            await a.apply(CommitBatch("n1", epoch, seq, (BlockAdd(NS, bh(1), (seq,)),)))

    async def watcher(delay: int) -> list[int]:
        for _ in range(delay):
            await asyncio.sleep(0)
        async with b.subscribe(NS, [bh(1)], 1000) as sub:
            holding = sub.snapshot[0].get("n1")
            seen = holding.chunks() if holding is not None else []
            while len(seen) < writes:
                for event in await sub.read(1000, timeout=5):
                    assert set(event.chunks).isdisjoint(seen), "an event repeated the snapshot"
                    seen.extend(event.chunks)
            return seen

    views = await asyncio.gather(writer(), *(watcher(k * 7) for k in range(12)))
    for seen in views[1:]:
        assert seen is not None and sorted(seen) == list(range(1, writes + 1))


@needs_redis
async def test_a_large_dead_epoch_is_purged_in_steps(prefix: str) -> None:
    async with RedisIndexStore(REDIS_URL, namespace_prefix=prefix, purge_step=7) as store:
        epoch = (await store.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
        adds = tuple(BlockAdd(NS, bh(i), (0, 1)) for i in range(100))
        objects = tuple(ObjectAdd(f"obj:{i}", i) for i in range(20))
        await store.apply(CommitBatch("n1", epoch, 1, adds, object_adds=objects))
        assert (await store.counts()).blocks == 100
        assert await store.drop_node("n1", epoch, "lease expired")
        counts = await store.counts()
        assert (counts.blocks, counts.objects) == (0, 0)
        store.validate()


@needs_redis
async def test_records_round_trip_and_epochs_outlive_a_lost_counter(prefix: str) -> None:
    record = NodeRecord(
        "n1", "tcp://n1:7", "ucx", bytes(range(256)), (Tier("gpu", 1 << 40, 3),), "1.2", "h"
    )
    async with RedisIndexStore(REDIS_URL, namespace_prefix=prefix) as store:
        first = await store.register_node(record)
        assert first.epoch >= 1_000_000_000_000, "seeded from Redis TIME in milliseconds"
        (listed,) = await store.nodes()
        assert listed == first and listed.nixl_metadata == bytes(range(256))
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        try:
            client.delete(f"{prefix}:epoch")  # as if Redis had lost the counter
        finally:
            client.close()
        await asyncio.sleep(0.01)
        assert (await store.register_node(record)).epoch > first.epoch


@needs_redis
async def test_watches_recover_when_redis_loses_its_data(
    masters: tuple[RedisIndexStore, RedisIndexStore], prefix: str
) -> None:
    a, b = masters
    epoch = (await a.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
    async with b.subscribe(NS, [bh(1)], 64) as old:
        for seq in range(1, 6):
            await a.apply(CommitBatch("n1", epoch, seq, (BlockAdd(NS, bh(1), (seq,)),)))
        assert len(await old.read(64, timeout=2)) == 5
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        try:
            client.unlink(*client.scan_iter(match=f"{prefix}:*"))  # a restart without persistence
        finally:
            client.close()
        with pytest.raises(StaleEpoch):
            await a.apply(CommitBatch("n1", epoch, 6, (BlockAdd(NS, bh(1), (6,)),)))
        epoch = (await a.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
        async with b.subscribe(NS, [bh(1)], 64) as new:
            with pytest.raises(CapacityError):
                await old.read(64, timeout=2)
            await a.apply(CommitBatch("n1", epoch, 1, (BlockAdd(NS, bh(1), (7,)),)))
            (event,) = await new.read(64, timeout=2)
            assert (event.kind, event.chunks, event.epoch) == (EventKind.COMMIT, (7,), epoch)


@needs_redis
async def test_any_object_key_and_node_id_round_trip(prefix: str) -> None:
    key, node = "ключ: *?[x] 🙂 \\n", "nöde:1"
    async with (
        RedisIndexStore(REDIS_URL, namespace_prefix=prefix) as store,
        store.subscribe(NS, [bh(1)], 8) as sub,
    ):
        epoch = (await store.register_node(NodeRecord(node, "tcp://n:7"))).epoch
        adds = (BlockAdd(NS, bh(1), (0,)),)
        await store.apply(CommitBatch(node, epoch, 1, adds, object_adds=(ObjectAdd(key, 3),)))
        (holder,) = await store.locate_object(key)
        assert (holder.node_id, holder.nbytes) == (node, 3)
        assert list((await store.locate(NS, [bh(1)]))[0]) == [node]
        (event,) = await sub.read(8, timeout=2)
        assert event.node_id == node
        await store.apply(CommitBatch(node, epoch, 2, object_removes=(key,)))
        assert await store.locate_object(key) == []
        store.validate()


def test_bad_urls_and_options_are_invalid_arguments() -> None:
    with pytest.raises(InvalidArgument):
        RedisIndexStore("http://127.0.0.1:6379/0")
    with pytest.raises(InvalidArgument):
        RedisIndexStore("redis://127.0.0.1:6379/0", namespace_prefix="has space")
    with pytest.raises(InvalidArgument):
        RedisIndexStore("redis://127.0.0.1:6379/0", stream_maxlen=0)


async def test_nothing_listening_is_unreachable_not_a_hang() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    store = RedisIndexStore(url, timeout_s=1)
    try:
        with pytest.raises(Unreachable):
            await asyncio.wait_for(store.start(), 10)
        with pytest.raises(Unreachable):
            await asyncio.wait_for(store.locate(NS, [bh(1)]), 10)
        with pytest.raises(Unreachable):
            await asyncio.wait_for(store.apply(CommitBatch("n1", 1, 1)), 10)
        with pytest.raises(Unreachable):
            async with store.subscribe(NS, [bh(1)], 8):
                pass
    finally:
        await store.close()


@pytest.fixture
def own_redis() -> Iterator[str]:
    """A redis-server of our own (so the test can stop it); skipped if none is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_redis_going_away_fails_calls_and_watches(own_redis: str) -> None:
    async with RedisIndexStore(own_redis, timeout_s=0.5, block_s=0.2) as store:
        epoch = (await store.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
        async with store.subscribe(NS, [bh(1)], 8) as sub:
            with pytest.raises(KVTimeout):
                await sub.read(1, timeout=0.05)
            redis.Redis.from_url(own_redis).shutdown(nosave=True)
            with pytest.raises((TransportError, KVTimeout)):
                await asyncio.wait_for(sub.read(1, timeout=5), 10)
            with pytest.raises(Unreachable):
                await asyncio.wait_for(store.apply(CommitBatch("n1", epoch, 1)), 10)


@needs_redis
async def test_leases_are_shared_by_every_master_on_the_store(
    masters: tuple[RedisIndexStore, RedisIndexStore],
) -> None:
    """A registration or heartbeat through one master is a fresh lease for the other (by
    Redis TIME); a dropped epoch has none. A store of one master shares nothing."""
    a, b = masters
    epoch = (await a.register_node(NodeRecord("n1", "tcp://n1:7"))).epoch
    (got,) = (await b.leases()).items()
    assert got[0] == "n1" and got[1][0] == epoch and 0 <= got[1][1] < 1.0
    await asyncio.sleep(0.3)
    assert (await b.leases())["n1"][1] >= 0.25  # aging by the store's clock
    assert await b.update_node("n1", epoch, tiers=[]) is False  # a heartbeat through b
    assert (await a.leases())["n1"][1] < 0.25
    assert await a.drop_node("n1", epoch, "lease expired")
    assert await b.leases() == {} and await a.leases() == {}
    assert await MemoryIndexStore().leases() == {}


@needs_redis
async def test_a_node_registered_through_one_master_is_bound_at_the_other(
    masters: tuple[RedisIndexStore, RedisIndexStore],
) -> None:
    """Masters A and B share Redis; node n1 registers through B. Master A learns n1's live
    epoch from the shared leases (its sweep), not from a Register: a caller with another
    registration key still cannot heartbeat, commit for or deregister n1 through A, while
    n1's own key can heartbeat and commit through A."""
    sa, sb = masters
    a, b = MasterService(sa, Membership(10.0)), MasterService(sb, Membership(10.0))
    owner = MasterClient.in_process(b)
    owner.session = b"\x01" * 32
    epoch = (await owner.register("n1", "tcp://127.0.0.1:7001")).epoch
    await a.sweep()  # A now counts n1 alive, from the store's lease
    assert a.membership.is_live("n1", epoch)
    intruder = MasterClient.in_process(a)
    intruder.session = b"\x02" * 32
    with pytest.raises(PermissionDenied):
        await intruder.heartbeat("n1", epoch)
    with pytest.raises(PermissionDenied):
        await intruder.commit(CommitBatch("n1", epoch, 1, (BlockAdd(NS, bh(1), (0,)),)))
    with pytest.raises(PermissionDenied):
        await intruder.deregister("n1", epoch)
    [rec] = await sa.nodes()
    assert rec.alive and rec.epoch == epoch
    assert await sa.locate(NS, [bh(1)]) == [{}]
    mover = MasterClient.in_process(a)  # the node itself, moved to master A
    mover.session = owner.session
    assert (await mover.heartbeat("n1", epoch)).ok
    assert await mover.commit(CommitBatch("n1", epoch, 1, (BlockAdd(NS, bh(1), (0,)),))) == 1
