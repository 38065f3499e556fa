"""Conformance suite of :class:`kvstore.master.index.IndexStore`.

Every implementation runs every test here: add it to ``STORE_FACTORIES`` (a Redis store
would be one entry, skipped without ``KVSTORE_TEST_REDIS``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.control.records import (
    BlockAdd,
    BlockRef,
    CommitBatch,
    EventKind,
    Holding,
    IndexEvent,
    NodeRecord,
    ObjectAdd,
    Tier,
    mask_of,
)
from kvstore.errors import (
    CapacityError,
    Closed,
    InvalidArgument,
    KVTimeout,
    NodeIdTaken,
    StaleEpoch,
)
from kvstore.master.index import IndexStore, MemoryIndexStore, Subscription
from kvstore.master.redis_store import RedisIndexStore

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))


async def _memory() -> IndexStore:
    return MemoryIndexStore(epoch_base=1000, purge_step=3)


REDIS_URL = os.environ.get("KVSTORE_TEST_REDIS", "")
_redis_prefixes = (f"kvtest:{uuid.uuid4().hex[:12]}:{i}" for i in itertools.count())
_redis_used: list[str] = []


async def _redis() -> IndexStore:
    """A store under a fresh key prefix (deleted after the test by ``_redis_cleanup``)."""
    _redis_used.append(next(_redis_prefixes))
    return RedisIndexStore(REDIS_URL, namespace_prefix=_redis_used[-1], stream_maxlen=1000)


def delete_redis_keys(prefix: str) -> None:
    """Delete every key under ``prefix`` (sync client: also runs outside an event loop)."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.unlink(*keys[i : i + 500])
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _redis_cleanup() -> Iterator[None]:
    """Delete the keys of every Redis store the test made (after its fixtures closed them)."""
    yield
    while _redis_used:
        delete_redis_keys(_redis_used.pop())


STORE_FACTORIES: dict[str, Callable[[], Awaitable[IndexStore]]] = {
    "memory": _memory,
    "redis": _redis,
}
_NO_REDIS = pytest.mark.skipif(not REDIS_URL, reason="KVSTORE_TEST_REDIS (redis:// URL) unset")
STORE_MARKS = {"redis": (pytest.mark.redis, _NO_REDIS)}


@pytest.fixture(
    params=[pytest.param(n, marks=STORE_MARKS.get(n, ())) for n in sorted(STORE_FACTORIES)]
)
def store_factory(request: pytest.FixtureRequest) -> Callable[[], Awaitable[IndexStore]]:
    return STORE_FACTORIES[request.param]


@pytest.fixture
async def store(
    store_factory: Callable[[], Awaitable[IndexStore]],
) -> AsyncIterator[IndexStore]:
    s = await store_factory()
    try:
        yield s
        validate = getattr(s, "validate", None)
        if validate is not None:
            validate()
    finally:
        await s.close()


def bh(i: int) -> bytes:
    return i.to_bytes(16, "big")


async def reg(store: IndexStore, node_id: str = "a") -> int:
    rec = await store.register_node(NodeRecord(node_id, f"tcp://{node_id}:7"))
    return rec.epoch


def adds(*items: tuple[int, tuple[int, ...]], ns: bytes = NS) -> tuple[BlockAdd, ...]:
    return tuple(BlockAdd(ns, bh(i), chunks) for i, chunks in items)


async def read_one(sub: Subscription) -> IndexEvent:
    events = await sub.read(1, timeout=2)
    assert len(events) == 1
    return events[0]


# -- registry ---------------------------------------------------------------------------------


async def test_register_assigns_strictly_increasing_epochs(store: IndexStore) -> None:
    rec = NodeRecord(
        "b", "tcp://b:7", "ucx", b"agent-md", (Tier("host", 100, 5),), "0.1.0", "hostb"
    )
    first = await store.register_node(rec)
    e2 = await reg(store, "a")
    again = await store.register_node(rec)
    assert first.epoch < e2 < again.epoch
    assert again.alive and again.nixl_metadata == b"agent-md" and again.tiers == rec.tiers
    nodes = await store.nodes()
    assert [n.node_id for n in nodes] == ["a", "b"]
    assert nodes[1].epoch == again.epoch and nodes[1].transport == "ucx"


async def test_reregistration_kills_the_old_epoch(store: IndexStore) -> None:
    old = await reg(store)
    await store.apply(
        CommitBatch(
            "a",
            old,
            1,
            adds(
                (1, (0, 1)),
            ),
        )
    )
    async with store.subscribe(NS, [bh(1)], 16) as sub:
        new = await reg(store)
        event = await read_one(sub)
    assert event.kind is EventKind.NODE_DEAD and (event.node_id, event.epoch) == ("a", old)
    assert await store.locate(NS, [bh(1)]) == [{}]
    with pytest.raises(StaleEpoch):
        await store.apply(
            CommitBatch(
                "a",
                old,
                2,
                adds(
                    (2, (0,)),
                ),
            )
        )
    assert (
        await store.apply(
            CommitBatch(
                "a",
                new,
                1,
                adds(
                    (2, (3,)),
                ),
            )
        )
        == 1
    )
    located = await store.locate(NS, [bh(1), bh(2)])
    assert located[0] == {} and located[1]["a"].epoch == new and located[1]["a"].mask == 0b1000


async def test_a_live_record_binds_its_id_to_its_session(store: IndexStore) -> None:
    """While a record is alive, only its session may register the id again; once it is
    dead (its lease ended, or it left), any may; a record without a session binds nothing."""
    a, b = b"\x01" * 32, b"\x02" * 32
    first = await store.register_node(NodeRecord("n", "tcp://n:7", session=a))
    with pytest.raises(NodeIdTaken, match="'n' is held by the live registration"):
        await store.register_node(NodeRecord("n", "tcp://evil:1", session=b))
    with pytest.raises(NodeIdTaken):
        await store.register_node(NodeRecord("n", "tcp://evil:1"))  # (no session at all)
    [rec] = await store.nodes()  # nothing changed
    assert (rec.epoch, rec.data_uri, rec.session, rec.alive) == (first.epoch, "tcp://n:7", a, True)
    again = await store.register_node(NodeRecord("n", "tcp://n:7", session=a))  # the owner
    assert again.epoch > first.epoch and again.session == a
    assert await store.drop_node("n", again.epoch, "lease expired")
    taken = await store.register_node(NodeRecord("n", "tcp://n2:7", session=b))  # freed
    assert taken.epoch > again.epoch and (await store.nodes())[0].session == b
    await store.register_node(NodeRecord("free", "tcp://f:7"))
    assert (await store.register_node(NodeRecord("free", "tcp://f2:7", session=a))).alive


async def test_update_node_tiers_and_draining(store: IndexStore) -> None:
    epoch = await reg(store)
    assert await store.update_node("a", epoch, tiers=[Tier("gpu", 10, 4)]) is False
    assert await store.update_node("a", epoch, draining=True) is True
    assert await store.update_node("a", epoch, tiers=[Tier("gpu", 10, 4)]) is True  # kept
    assert await store.update_node("a", epoch + 1, draining=False) is None
    assert await store.update_node("nobody", epoch, draining=True) is None
    (rec,) = await store.nodes()
    assert rec.tiers == (Tier("gpu", 10, 4),) and rec.draining
    await reg(store)
    (rec,) = await store.nodes()
    assert rec.draining, "the operator's draining mark survives re-registration"


async def test_drop_node_filters_its_entries_and_objects(store: IndexStore) -> None:
    ea, eb = await reg(store, "a"), await reg(store, "b")
    await store.apply(
        CommitBatch("a", ea, 1, adds((1, (0,)), (2, (0,))), object_adds=(ObjectAdd("k", 5),))
    )
    await store.apply(
        CommitBatch(
            "b",
            eb,
            1,
            adds(
                (1, (1,)),
            ),
            object_adds=(ObjectAdd("k", 5),),
        )
    )
    assert not await store.drop_node("a", ea + 100, "wrong epoch")
    assert await store.drop_node("a", ea, "lease expired")
    assert not await store.drop_node("a", ea, "twice")
    located = await store.locate(NS, [bh(1), bh(2)])
    assert list(located[0]) == ["b"] and located[1] == {}
    assert [h.node_id for h in await store.locate_object("k")] == ["b"]
    counts = await store.counts()
    assert (counts.blocks, counts.objects) == (1, 1)
    nodes = {n.node_id: n for n in await store.nodes()}
    assert not nodes["a"].alive and nodes["b"].alive
    with pytest.raises(StaleEpoch):
        await store.apply(
            CommitBatch(
                "a",
                ea,
                2,
                adds(
                    (3, (0,)),
                ),
            )
        )


# -- commits ------------------------------------------------------------------------------------


async def test_apply_rejects_unknown_nodes_and_applies_nothing(store: IndexStore) -> None:
    with pytest.raises(StaleEpoch):
        await store.apply(
            CommitBatch(
                "ghost",
                1,
                1,
                adds(
                    (1, (0,)),
                ),
            )
        )
    epoch = await reg(store)
    with pytest.raises(StaleEpoch):
        await store.apply(
            CommitBatch(
                "a",
                epoch + 1,
                1,
                adds(
                    (1, (0,)),
                ),
            )
        )
    assert await store.locate(NS, [bh(1)]) == [{}]
    assert (await store.counts()).blocks == 0


async def test_seq_is_strictly_increasing_and_retries_are_idempotent(store: IndexStore) -> None:
    epoch = await reg(store)
    assert (
        await store.apply(
            CommitBatch(
                "a",
                epoch,
                1,
                adds(
                    (1, (0,)),
                ),
            )
        )
        == 1
    )
    assert (
        await store.apply(
            CommitBatch(
                "a",
                epoch,
                1,
                adds(
                    (1, (1,)),
                ),
            )
        )
        == 1
    )
    assert (
        await store.apply(
            CommitBatch(
                "a",
                epoch,
                3,
                adds(
                    (1, (2,)),
                ),
            )
        )
        == 3
    )
    assert (
        await store.apply(
            CommitBatch(
                "a",
                epoch,
                2,
                adds(
                    (1, (3,)),
                ),
            )
        )
        == 3
    )
    (located,) = await store.locate(NS, [bh(1)])
    assert located["a"].mask == 0b101


async def test_adds_merge_and_evicts_drop_the_whole_slot(store: IndexStore) -> None:
    epoch = await reg(store)
    await store.apply(CommitBatch("a", epoch, 1, adds((1, (0, 1)), (2, (5,)))))
    await store.apply(
        CommitBatch(
            "a",
            epoch,
            2,
            adds(
                (1, (2, 2)),
            ),
        )
    )
    (located,) = await store.locate(NS, [bh(1)])
    assert located["a"].chunks() == [0, 1, 2]
    await store.apply(CommitBatch("a", epoch, 3, evicts=(BlockRef(NS, bh(1)), BlockRef(NS, bh(9)))))
    assert await store.locate(NS, [bh(1), bh(2)]) == [{}, {"a": Holding(epoch, 1 << 5)}]
    assert (await store.counts()).blocks == 1


async def test_removals_apply_before_additions(store: IndexStore) -> None:
    epoch = await reg(store)
    await store.apply(
        CommitBatch(
            "a",
            epoch,
            1,
            adds(
                (1, (0, 1)),
            ),
            object_adds=(ObjectAdd("k", 3),),
        )
    )
    await store.apply(
        CommitBatch(
            "a",
            epoch,
            2,
            adds=adds((1, (7,))),
            evicts=(BlockRef(NS, bh(1)),),
            object_adds=(ObjectAdd("k", 9),),
            object_removes=("k",),
        )
    )
    (located,) = await store.locate(NS, [bh(1)])
    assert located["a"].chunks() == [7]
    (holder,) = await store.locate_object("k")
    assert (holder.node_id, holder.nbytes, holder.epoch) == ("a", 9, epoch)


async def test_locate_keeps_order_namespaces_and_holders_apart(store: IndexStore) -> None:
    ea, eb = await reg(store, "a"), await reg(store, "b")
    await store.apply(CommitBatch("a", ea, 1, adds((1, (0, 1)), (2, (0,)))))
    await store.apply(
        CommitBatch(
            "b",
            eb,
            1,
            adds(
                (1, (2, 3)),
            )
            + adds((2, (0,)), ns=OTHER_NS),
        )
    )
    located = await store.locate(NS, [bh(2), bh(1), bh(3)])
    assert list(located[0]) == ["a"]
    assert {n: h.mask for n, h in located[1].items()} == {"a": 0b0011, "b": 0b1100}
    assert located[2] == {}
    (other,) = await store.locate(OTHER_NS, [bh(2)])
    assert list(other) == ["b"]


async def test_objects_are_located_per_holder(store: IndexStore) -> None:
    ea, eb = await reg(store, "a"), await reg(store, "b")
    assert await store.locate_object("k") == []
    await store.apply(CommitBatch("b", eb, 1, object_adds=(ObjectAdd("k", 4),)))
    await store.apply(CommitBatch("a", ea, 1, object_adds=(ObjectAdd("k", 4),)))
    assert [h.node_id for h in await store.locate_object("k")] == ["a", "b"]
    await store.apply(CommitBatch("a", ea, 2, object_removes=("k", "unknown")))
    assert [h.node_id for h in await store.locate_object("k")] == ["b"]
    assert (await store.counts()).objects == 1
    version = 1_764_900_000_123_456_789  # (a writer's clock in ns: past a double's precision)
    await store.apply(CommitBatch("a", ea, 3, object_adds=(ObjectAdd("k", 6, version),)))
    got = {h.node_id: (h.nbytes, h.version) for h in await store.locate_object("k")}
    assert got == {"a": (6, version), "b": (4, 0)}


# -- subscriptions ------------------------------------------------------------------------------


async def test_slot_locations_are_kept_replaced_and_published(store: IndexStore) -> None:
    """An add's location is kept with the holder (an add without one keeps the old one),
    a later add with another replaces it (a slot moved), an evict drops it, and COMMIT
    events carry the holder's location after the add: readers READ from what it says."""
    epoch = await reg(store)
    here, there = bytes(range(20)), bytes(range(1, 21))
    await store.apply(CommitBatch("a", epoch, 1, (BlockAdd(NS, bh(1), (0,), here),)))
    async with store.subscribe(NS, [bh(1)], 64) as sub:
        assert sub.snapshot[0]["a"] == Holding(epoch, 0b1, here)
        await store.apply(CommitBatch("a", epoch, 2, (BlockAdd(NS, bh(1), (1,)),)))
        assert (await store.locate(NS, [bh(1)]))[0]["a"] == Holding(epoch, 0b11, here)
        await store.apply(CommitBatch("a", epoch, 3, (BlockAdd(NS, bh(1), (2,), there),)))
        assert (await store.locate(NS, [bh(1)]))[0]["a"] == Holding(epoch, 0b111, there)
        await store.apply(
            CommitBatch("a", epoch, 4, (BlockAdd(NS, bh(1), (3,)),), evicts=(BlockRef(NS, bh(1)),))
        )
        assert (await store.locate(NS, [bh(1)]))[0]["a"] == Holding(epoch, 0b1000)
        events = await sub.read(100, timeout=2)
    commits = [(e.chunks, e.location) for e in events if e.kind is EventKind.COMMIT]
    assert commits == [((1,), here), ((2,), there), ((3,), b"")]


async def test_subscription_snapshot_then_events(store: IndexStore) -> None:
    epoch = await reg(store)
    await store.apply(
        CommitBatch(
            "a",
            epoch,
            1,
            adds(
                (1, (0, 1)),
            ),
        )
    )
    async with store.subscribe(NS, [bh(1), bh(2)], 64) as sub:
        assert [set(s) for s in sub.snapshot] == [{"a"}, set()]
        assert sub.snapshot[0]["a"].mask == 0b11
        await store.apply(CommitBatch("a", epoch, 2, adds((3, (0,)), (2, (4, 3)))))
        await store.apply(CommitBatch("a", epoch, 3, evicts=(BlockRef(NS, bh(1)),)))
        await store.apply(CommitBatch("a", epoch, 4, adds((2, (0,)), ns=OTHER_NS)))
        await store.abort(NS, [bh(2), bh(5)], "client closed")
        await store.drop_node("a", epoch, "lease expired")
        events = await sub.read(100, timeout=2)
    kinds = [(e.kind, e.block_hash, e.chunks) for e in events]
    assert kinds == [
        (EventKind.COMMIT, bh(2), (3, 4)),
        (EventKind.EVICT, bh(1), (0, 1)),
        (EventKind.ABORT, bh(2), ()),
        (EventKind.NODE_DEAD, b"", ()),
    ]
    assert events[2].reason == "client closed" and events[3].reason == "lease expired"
    assert all(e.node_id == "a" and e.epoch == epoch for e in events if e.kind != EventKind.ABORT)


async def test_subscription_overflow_ends_it(store: IndexStore) -> None:
    epoch = await reg(store)
    async with store.subscribe(NS, [bh(1)], 3) as sub:
        for seq in range(1, 6):
            await store.apply(
                CommitBatch(
                    "a",
                    epoch,
                    seq,
                    adds(
                        (1, (seq,)),
                    ),
                )
            )
        with pytest.raises(CapacityError):
            await sub.read(10, timeout=1)
        with pytest.raises(CapacityError):
            await sub.read(10, timeout=1)


async def test_subscription_read_times_out_and_close_wakes_readers(store: IndexStore) -> None:
    async with store.subscribe(NS, [bh(1)], 8) as sub:
        with pytest.raises(KVTimeout):
            await sub.read(1, timeout=0.05)
        reader = asyncio.create_task(sub.read(1, timeout=5))
        await asyncio.sleep(0.01)
        sub.close()
        with pytest.raises(Closed):
            await reader


async def test_closed_store_refuses_calls_and_ends_subscriptions(
    store_factory: Callable[[], Awaitable[IndexStore]],
) -> None:
    store = await store_factory()
    async with store.subscribe(NS, [bh(1)], 8) as sub:
        reader = asyncio.create_task(sub.read(1, timeout=5))
        await asyncio.sleep(0.01)
        await store.close()
        with pytest.raises(Closed):
            await reader
    with pytest.raises(Closed):
        await store.locate(NS, [bh(1)])
    await store.close()


async def test_subscribe_races_commits_without_losing_any(store: IndexStore) -> None:
    """Snapshot + events always reconstruct the final state, whenever the subscription
    starts relative to a stream of commits and evictions."""
    epoch = await reg(store)
    hashes = [bh(i) for i in range(8)]
    rng = random.Random(7)

    async def writer() -> None:
        for seq in range(1, 200):
            i = rng.randrange(8)
            if rng.random() < 0.3:
                batch = CommitBatch("a", epoch, seq, evicts=(BlockRef(NS, hashes[i]),))
            else:
                batch = CommitBatch(
                    "a",
                    epoch,
                    seq,
                    adds(
                        (i, (rng.randrange(6),)),
                    ),
                )
            await store.apply(batch)
            await asyncio.sleep(0)

    async def reader(delay_steps: int) -> dict[int, int]:
        for _ in range(delay_steps):
            await asyncio.sleep(0)
        async with store.subscribe(NS, hashes, 10_000) as sub:
            view = {i: s["a"].mask for i, s in enumerate(sub.snapshot) if "a" in s}
            while True:
                try:
                    events = await sub.read(1000, timeout=0.05)
                except KVTimeout:
                    if task.done():
                        return view
                    continue
                for e in events:
                    i = hashes.index(e.block_hash)
                    if e.kind is EventKind.COMMIT:
                        view[i] = view.get(i, 0) | mask_of(e.chunks)
                    elif e.kind is EventKind.EVICT:
                        view.pop(i, None)

    task = asyncio.create_task(writer())
    views = await asyncio.gather(*(reader(k * 37) for k in range(6)))
    await task
    final = await store.locate(NS, hashes)
    expected = {i: s["a"].mask for i, s in enumerate(final) if "a" in s}
    assert expected, "the writer left something to compare"
    for view in views:
        assert view == expected


# -- a model check ------------------------------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("register"), st.sampled_from("ab")),
        st.tuples(st.just("drop"), st.sampled_from("ab")),
        st.tuples(
            st.just("commit"),
            st.sampled_from("ab"),
            st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=4),
            st.lists(st.integers(0, 3), max_size=2),
        ),
    ),
    max_size=25,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_ops)
def test_store_matches_a_simple_model(
    store_factory: Callable[[], Awaitable[IndexStore]], ops: list[tuple]
) -> None:
    asyncio.run(_run_model(store_factory, ops))


async def _run_model(factory: Callable[[], Awaitable[IndexStore]], ops: list[tuple]) -> None:
    store = await factory()
    epochs: dict[str, int] = {}
    alive: set[str] = set()
    seqs: dict[str, int] = {}
    model: dict[int, dict[str, int]] = {}
    try:
        for op in ops:
            node = op[1]
            if op[0] == "register":
                epochs[node], seqs[node] = await reg(store, node), 0
                alive.add(node)
                for holders in model.values():
                    holders.pop(node, None)
            elif op[0] == "drop":
                assert await store.drop_node(node, epochs.get(node, 0), "x") == (node in alive)
                alive.discard(node)
                for holders in model.values():
                    holders.pop(node, None)
            else:
                batch = CommitBatch(
                    node,
                    epochs.get(node, 0),
                    seqs.get(node, 0) + 1,
                    adds=adds(*((b, (c,)) for b, c in op[2])),
                    evicts=tuple(BlockRef(NS, bh(b)) for b in op[3]),
                )
                if node not in alive:
                    with pytest.raises(StaleEpoch):
                        await store.apply(batch)
                    continue
                seqs[node] = await store.apply(batch)
                for b in op[3]:
                    model.get(b, {}).pop(node, None)
                for b, c in op[2]:
                    model.setdefault(b, {})[node] = model.get(b, {}).get(node, 0) | 1 << c
            located = await store.locate(NS, [bh(b) for b in range(4)])
            got = {b: {n: h.mask for n, h in s.items()} for b, s in enumerate(located) if s}
            assert got == {b: h for b, h in model.items() if h}
            assert (await store.counts()).blocks == len(got)
        validate = getattr(store, "validate", None)
        if validate is not None:
            validate()
    finally:
        await store.close()


# -- memory-only --------------------------------------------------------------------------------


async def test_memory_store_purges_a_large_dead_epoch_in_steps() -> None:
    store = MemoryIndexStore(epoch_base=0, purge_step=7)
    epoch = await reg(store)
    await store.apply(CommitBatch("a", epoch, 1, adds(*((i, (0, 1)) for i in range(100)))))
    assert (await store.counts()).blocks == 100
    assert await store.drop_node("a", epoch, "lease expired")
    assert (await store.counts()).blocks == 0
    store.validate()
    await store.close()


async def _all_blocks(store: IndexStore, ns_id: bytes, batch: int) -> list[tuple]:
    parts = [part async for part in store.blocks(ns_id, batch)]
    assert all(0 < len(part) <= batch for part in parts)
    return sorted((ns, h, sorted(held.items())) for part in parts for ns, h, held in part)


async def test_blocks_lists_every_live_holder_of_every_block(store: IndexStore) -> None:
    """``blocks`` (what a snapshot of the event stream is built from): each block with its
    live holders' epochs and masks, one namespace or all, in bounded parts; a dead epoch's
    entries and evicted blocks are not in it."""
    a, b = await reg(store, "a"), await reg(store, "b")
    loc = b"\x01" * 21
    await store.apply(CommitBatch("a", a, 1, tuple(BlockAdd(NS, bh(i), (0, 2), loc)
                                                   for i in range(5))))  # fmt: skip
    await store.apply(CommitBatch("b", b, 1, (BlockAdd(NS, bh(0), (1,)),
                                              BlockAdd(OTHER_NS, bh(9), (0,)))))  # fmt: skip
    await store.apply(CommitBatch("a", a, 2, (), (BlockRef(NS, bh(4)),)))
    got = await _all_blocks(store, NS, 2)
    assert got == sorted(
        [(NS, bh(0), [("a", Holding(a, 0b101, loc)), ("b", Holding(b, 0b10))])]
        + [(NS, bh(i), [("a", Holding(a, 0b101, loc))]) for i in (1, 2, 3)]
    )
    every = await _all_blocks(store, b"", 1000)
    assert [(ns, h) for ns, h, _ in every] == sorted(
        [(NS, bh(i)) for i in range(4)] + [(OTHER_NS, bh(9))]
    )
    assert await store.drop_node("b", b, "lease expired")
    got = await _all_blocks(store, b"", 3)
    assert [(h, [n for n, _ in held]) for _, h, held in got] == [(bh(i), ["a"]) for i in range(4)]
    assert await _all_blocks(store, bytes(16), 8) == []


@_NO_REDIS
async def test_subscribe_all_gets_every_masters_changes_in_order() -> None:
    """Two stores on one Redis prefix (two masters): ``subscribe_all`` on one gets the
    other's commits, evictions and node deaths, in the order they were applied."""
    one = await _redis()
    other = RedisIndexStore(REDIS_URL, namespace_prefix=_redis_used[-1], stream_maxlen=1000)
    try:
        async with one.subscribe_all(100) as sub:
            epoch = await reg(other, "n")
            await other.apply(CommitBatch("n", epoch, 1, (BlockAdd(NS, bh(1), (0,)),)))
            await other.apply(CommitBatch("n", epoch, 2, (BlockAdd(NS, bh(2), (1,)),),
                                          (BlockRef(NS, bh(1)),)))  # fmt: skip
            assert await other.drop_node("n", epoch, "lease expired")
            got: list = []
            async with asyncio.timeout(10):
                while len(got) < 4:
                    got += await sub.read(10, timeout=5)
            assert [(e.kind, e.block_hash, e.chunks) for e in got] == [
                (EventKind.COMMIT, bh(1), (0,)),
                (EventKind.EVICT, bh(1), (0,)),
                (EventKind.COMMIT, bh(2), (1,)),
                (EventKind.NODE_DEAD, b"", ()),
            ]
    finally:
        await one.close()
        await other.close()
    with pytest.raises(InvalidArgument):
        MemoryIndexStore().subscribe_all(10)
