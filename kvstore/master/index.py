"""The block index: one small async interface, :class:`IndexStore`, and its in-memory twin.

The index answers "which live node holds which chunks of which block". Entries are keyed
``(ns_id, block_hash) -> {node_id: Holding(epoch, mask, location)}``; a node's registry record
carries its current epoch. Liveness lives here: an entry counts only while its
``(node, epoch)`` is the node's current, alive epoch, so a node's death or
re-registration kills all its entries in one step (``drop_node`` / ``register_node``)
and every read filters them. *When* a node is dead is decided outside, by
:class:`kvstore.master.membership.Membership`; the store only records it.

Events (COMMIT, EVICT, ABORT, NODE_DEAD) go to bounded subscriptions. A subscription's
snapshot and its events are atomic: every change after the snapshot arrives as an event
and none before it does, so nothing is lost between "subscribe" and "read what is there".

A Redis implementation maps onto the same contract (docs/architecture.md, "Control plane"):
``kv:b:{ns}:{hash}`` hash node -> "epoch:mask[:location]", updated by one Lua call a batch;
``kv:n:{id}`` registry (epoch, applied seq, record); an ``INCR`` epoch counter;
``kv:ns:{ns}`` set of blocks; events on a Stream (``XADD MAXLEN ~``); ``subscribe`` reads
the snapshot and the stream's last id in one Lua call, then ``XREAD BLOCK`` from it.
Every implementation must pass ``tests/test_index_store.py``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from typing import ClassVar, TypeVar

from kvstore.control.records import (
    BlockAdd,
    BlockRef,
    CommitBatch,
    EventKind,
    Holding,
    IndexCounts,
    IndexEvent,
    NodeRecord,
    ObjectAdd,
    ObjectHolder,
    Tier,
    mask_of,
)
from kvstore.errors import (
    CapacityError,
    Closed,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    NodeIdTaken,
    StaleEpoch,
)

__all__ = ["BoundedSubscription", "IndexStore", "MemoryIndexStore", "Subscription", "id_taken"]

_BlockKey = tuple[bytes, bytes]
_K = TypeVar("_K")


def id_taken(held: NodeRecord) -> NodeIdTaken:
    """The refusal of a Register whose id ``held``, a live record, belongs to another key."""
    return NodeIdTaken(
        f"node id {held.node_id!r} is held by the live registration of another process "
        f"(epoch {held.epoch}, {held.data_uri}); it frees when that lease ends without a "
        "heartbeat — two live nodes need two ids"
    )


class Subscription(abc.ABC):
    """A bounded stream of :class:`IndexEvent` for some blocks of one namespace.

    ``snapshot[i]`` is the live holders of the i-th subscribed block at the moment the
    subscription started; :meth:`read` yields every later change to those blocks (COMMIT,
    EVICT, ABORT) plus every NODE_DEAD, in the order the store applied them.
    """

    snapshot: list[dict[str, Holding]]

    @abc.abstractmethod
    async def read(self, max_events: int = 256, timeout: float | None = None) -> list[IndexEvent]:
        """The next 1..``max_events`` events, in order. Blocks until at least one arrives
        or ``timeout`` seconds pass.

        Raises :class:`KVTimeout` on timeout, :class:`CapacityError` once the subscriber
        fell more than its ``maxlen`` events behind (the subscription is then over), and
        :class:`Closed` when the subscription or the store was closed.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """End the subscription early: a pending or later :meth:`read` raises Closed.
        Idempotent; never blocks."""


class IndexStore(abc.ABC):
    """Where blocks, objects and nodes are recorded. Every method is a coroutine; none blocks
    the event loop for long. Ids are raw bytes (16-byte ``ns_id`` and block hashes), node
    ids are strings. After :meth:`close` every method raises :class:`Closed`.
    """

    commit_waits: ClassVar[bool] = True
    """Whether what a commit calls (:meth:`apply`, :meth:`nodes`) may suspend: False for a
    store whose commit never waits, which a deadline could then never interrupt."""

    shares_events: ClassVar[bool] = False
    """Whether other masters change this index too (a shared store): a master's cluster
    event stream then follows :meth:`subscribe_all` rather than the commits it applies."""

    @abc.abstractmethod
    async def register_node(self, record: NodeRecord) -> NodeRecord:
        """Record a (re-)registration and return the record with its new epoch.

        The epoch is strictly greater than any this store handed out before (for any node).
        If the node had a live epoch, it is dead from now on: its entries vanish from reads
        and one NODE_DEAD event is published. ``record.epoch``/``alive`` are ignored;
        ``draining`` is kept from the previous record if there is one. Raises
        :class:`NodeIdTaken` (changing nothing) when the id's record is alive and holds
        another ``session`` than ``record``'s (a record without one may be taken over).
        """

    @abc.abstractmethod
    async def update_node(
        self,
        node_id: str,
        epoch: int,
        *,
        tiers: Sequence[Tier] | None = None,
        draining: bool | None = None,
    ) -> bool | None:
        """Update usage and/or the draining mark of ``node_id`` if ``epoch`` is its current
        epoch (alive or dead); returns the node's draining mark after the update (what its
        heartbeat answers), or None (changing nothing) when ``epoch`` is not current."""

    @abc.abstractmethod
    async def drop_node(self, node_id: str, epoch: int, reason: str) -> bool:
        """Mark ``epoch`` of ``node_id`` dead: its entries vanish from reads at once and one
        NODE_DEAD event is published. Returns False if that epoch is not the node's live
        one (already dead, re-registered, unknown). The record stays listed as not alive
        for a while (a bounded number of dead records is kept)."""

    @abc.abstractmethod
    async def nodes(self) -> list[NodeRecord]:
        """Every known node record, alive or recently dead, sorted by node id."""

    async def leases(self) -> dict[str, tuple[int, float]]:
        """Live node id -> (epoch, seconds since its last register or ``update_node``), by
        the store's own clock, where several masters share the store (each serves the
        heartbeats of its own nodes, so none can tell from its own memory whether another
        master's node is alive); ``{}`` for a store only one master uses, whose own leases
        are the whole truth."""
        return {}

    @abc.abstractmethod
    async def apply(self, batch: CommitBatch) -> int:
        """Apply one node's commit batch atomically; return the node's applied seq.

        Raises :class:`StaleEpoch` (nothing applied) unless ``batch.epoch`` is the node's
        current live epoch. A ``seq`` at or below the applied one is not applied again
        (idempotent retry) and returns the applied seq. Removals (evicts, object removes)
        go before additions. An add ORs its chunks into the node's mask for the block; an
        evict drops the node's whole entry. Publishes COMMIT per add and EVICT per evict of
        an entry the node held.
        """

    @abc.abstractmethod
    async def locate(self, ns_id: bytes, block_hashes: Sequence[bytes]) -> list[dict[str, Holding]]:
        """Live holders of each block, one dict (node id -> Holding) per hash, in order; a
        block nobody holds gives an empty dict (a miss is data, not an error)."""

    @abc.abstractmethod
    async def locate_object(self, key: str) -> list[ObjectHolder]:
        """Live holders of object ``key`` (sorted by node id); empty if none."""

    @abc.abstractmethod
    async def counts(self) -> IndexCounts:
        """Distinct blocks and objects with at least one holder. Entries of a just-dropped
        epoch may be counted until the store has purged them."""

    @abc.abstractmethod
    async def abort(self, ns_id: bytes, block_hashes: Sequence[bytes], reason: str) -> None:
        """Publish an ABORT event for each block (a writer gave up); changes no entry."""

    @abc.abstractmethod
    def subscribe(
        self, ns_id: bytes, block_hashes: Sequence[bytes], maxlen: int
    ) -> AbstractAsyncContextManager[Subscription]:
        """``async with store.subscribe(ns, hashes, maxlen) as sub:`` -- a
        :class:`Subscription` to those blocks whose snapshot is taken atomically with its
        start. At most ``maxlen`` undelivered events are buffered. Raises :class:`Closed`
        on a closed store."""

    @abc.abstractmethod
    def blocks(
        self, ns_id: bytes, batch: int
    ) -> AsyncIterator[list[tuple[bytes, bytes, dict[str, Holding]]]]:
        """Every block with a live holder, of namespace ``ns_id`` (empty: of every
        namespace), in lists of at most ``batch``: ``(ns id, block hash, node id ->
        holding)``. Not atomic: a block stored or removed while it runs may be in it or not
        (a reader follows it with the changes made since it started). A block may come
        twice."""

    def subscribe_all(self, maxlen: int) -> AbstractAsyncContextManager[Subscription]:
        """``async with store.subscribe_all(maxlen) as sub:`` -- every change published
        from the moment it starts, by any master (COMMIT, EVICT, NODE_DEAD, ABORT), in
        order; missed changes end it (:class:`CapacityError`). Stores that
        :attr:`shares_events` have it."""
        raise InvalidArgument(f"{type(self).__name__} does not share its events")

    @abc.abstractmethod
    async def close(self) -> None:
        """Release resources and end every open subscription (their ``read`` raises
        :class:`Closed`). Idempotent."""


def _discard(index: dict[str, set[_K]], node: str, key: _K) -> None:
    """Remove ``key`` from ``index[node]``, dropping the set when it empties."""
    keys = index.get(node)
    if keys is not None:
        keys.discard(key)
        if not keys:
            del index[node]


class BoundedSubscription(Subscription):
    """A bounded queue of ``(position, event)`` and a wake-up, shared by the stores.

    Overflow ends the subscription (:class:`CapacityError`) rather than growing; a store
    that can no longer feed it ends it with :meth:`fail`. ``position`` orders events for
    stores that need it (a stream offset); others pass 0.
    """

    def __init__(self, maxlen: int, snapshot: list[dict[str, Holding]] | None = None) -> None:
        self.snapshot = snapshot if snapshot is not None else []
        self._maxlen = maxlen
        self._queue: deque[tuple[int, IndexEvent]] = deque()
        self._wakeup = asyncio.Event()
        self._overflowed = False
        self._closed = False
        self._error: KVStoreError | None = None

    @property
    def done(self) -> bool:
        """True once nothing more will be queued (closed, overflowed or failed)."""
        return self._closed or self._overflowed or self._error is not None

    def _enqueue(self, position: int, event: IndexEvent) -> None:
        """Queue without blocking; past ``maxlen`` drop everything and mark overflow."""
        if self.done:
            return
        if len(self._queue) >= self._maxlen:
            self.overflow()
        else:
            self._queue.append((position, event))
            self._wakeup.set()

    def overflow(self) -> None:
        """End the subscription with :class:`CapacityError` (events were lost)."""
        self._overflowed = True
        self._queue.clear()
        self._wakeup.set()

    def fail(self, error: KVStoreError) -> None:
        """End the subscription with ``error`` (its events can no longer be read)."""
        if self._error is None:
            self._error = error
        self._wakeup.set()

    def close(self) -> None:
        """See :meth:`Subscription.close`."""
        self._closed = True
        self._wakeup.set()

    async def _take(
        self, max_events: int, deadline: float | None, timeout: float | None
    ) -> list[IndexEvent]:
        """Queued events (at most ``max_events``), waiting until ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        while True:
            if self._overflowed:
                raise CapacityError(f"subscriber fell more than {self._maxlen} events behind")
            if self._queue:
                count = min(max(1, max_events), len(self._queue))
                return [self._queue.popleft()[1] for _ in range(count)]
            if self._error is not None:
                raise type(self._error)(*self._error.args) from self._error
            if self._closed:
                raise Closed("subscription closed")
            self._wakeup.clear()
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError as exc:
                raise KVTimeout(f"no index event within {timeout} s") from exc


class _MemorySubscription(BoundedSubscription):
    """Fed synchronously by the memory store as changes are applied."""

    def push(self, event: IndexEvent) -> None:
        """Queue ``event`` (see :meth:`BoundedSubscription._enqueue`)."""
        self._enqueue(0, event)

    async def read(self, max_events: int = 256, timeout: float | None = None) -> list[IndexEvent]:
        """See :meth:`Subscription.read`."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        return await self._take(max_events, deadline, timeout)


class MemoryIndexStore(IndexStore):
    """:class:`IndexStore` in process memory (the default; lost on restart).

    ``epoch_base`` seeds the epoch counter; by default the wall clock in milliseconds, so
    epochs keep increasing across master restarts. Purging a dead epoch's entries yields
    to the event loop every ``purge_step`` entries.
    """

    MAX_DEAD_RECORDS = 1024
    commit_waits = False  # (apply and nodes never await)

    def __init__(self, *, epoch_base: int | None = None, purge_step: int = 4096) -> None:
        self._epoch = int(time.time() * 1000) if epoch_base is None else epoch_base
        self._purge_step = max(1, purge_step)
        self._nodes: dict[str, NodeRecord] = {}
        self._applied: dict[str, int] = {}
        self._dead: OrderedDict[str, None] = OrderedDict()
        self._blocks: dict[_BlockKey, dict[str, Holding]] = {}
        self._node_blocks: dict[str, set[_BlockKey]] = {}
        self._objects: dict[str, dict[str, ObjectHolder]] = {}
        self._node_objects: dict[str, set[str]] = {}
        self._watchers: dict[_BlockKey, set[_MemorySubscription]] = {}
        self._subs: set[_MemorySubscription] = set()
        self._closed = False

    # -- registry -----------------------------------------------------------------------

    async def register_node(self, record: NodeRecord) -> NodeRecord:
        """See :meth:`IndexStore.register_node`."""
        self._check_open()
        old = self._nodes.get(record.node_id)
        if old is not None and old.alive and old.session and old.session != record.session:
            raise id_taken(old)
        self._epoch += 1
        draining = old.draining if old is not None else record.draining
        new = replace(record, epoch=self._epoch, alive=True, draining=draining)
        self._nodes[record.node_id] = new
        self._applied[record.node_id] = 0
        self._dead.pop(record.node_id, None)
        if old is not None:
            if old.alive:
                self._publish_all(
                    IndexEvent(
                        EventKind.NODE_DEAD,
                        node_id=old.node_id,
                        epoch=old.epoch,
                        reason="re-registered",
                    )
                )
            await self._purge(old.node_id, old.epoch)
        return new

    async def update_node(
        self,
        node_id: str,
        epoch: int,
        *,
        tiers: Sequence[Tier] | None = None,
        draining: bool | None = None,
    ) -> bool | None:
        """See :meth:`IndexStore.update_node`."""
        self._check_open()
        rec = self._nodes.get(node_id)
        if rec is None or rec.epoch != epoch:
            return None
        if tiers is not None:
            rec = replace(rec, tiers=tuple(tiers))
        if draining is not None:
            rec = replace(rec, draining=draining)
        self._nodes[node_id] = rec
        return rec.draining

    async def drop_node(self, node_id: str, epoch: int, reason: str) -> bool:
        """See :meth:`IndexStore.drop_node`."""
        self._check_open()
        rec = self._nodes.get(node_id)
        if rec is None or not rec.alive or rec.epoch != epoch:
            return False
        self._nodes[node_id] = replace(rec, alive=False)
        self._dead[node_id] = None
        while len(self._dead) > self.MAX_DEAD_RECORDS:
            forgotten, _ = self._dead.popitem(last=False)
            self._nodes.pop(forgotten, None)
            self._applied.pop(forgotten, None)
        self._publish_all(
            IndexEvent(EventKind.NODE_DEAD, node_id=node_id, epoch=epoch, reason=reason)
        )
        await self._purge(node_id, epoch)
        return True

    async def nodes(self) -> list[NodeRecord]:
        """See :meth:`IndexStore.nodes`."""
        self._check_open()
        return [self._nodes[k] for k in sorted(self._nodes)]

    # -- index ----------------------------------------------------------------------------

    async def apply(self, batch: CommitBatch) -> int:
        """See :meth:`IndexStore.apply`."""
        self._check_open()
        node = batch.node_id
        if not self._is_live(node, batch.epoch):
            rec = self._nodes.get(node)
            state = "unknown" if rec is None else f"at epoch {rec.epoch}, alive={rec.alive}"
            raise StaleEpoch(f"node {node!r} epoch {batch.epoch} is not live (node {state})")
        applied = self._applied.get(node, 0)
        if batch.seq <= applied:
            return applied
        self._evict_blocks(node, batch.epoch, batch.evicts)
        self._add_blocks(node, batch.epoch, batch.adds)
        for key in batch.object_removes:
            self._remove_object(node, key)
        for obj in batch.object_adds:
            self._add_object(node, batch.epoch, obj)
        self._applied[node] = batch.seq
        return batch.seq

    async def locate(self, ns_id: bytes, block_hashes: Sequence[bytes]) -> list[dict[str, Holding]]:
        """See :meth:`IndexStore.locate`."""
        self._check_open()
        return self._locate_now(ns_id, block_hashes)

    async def blocks(
        self, ns_id: bytes, batch: int
    ) -> AsyncIterator[list[tuple[bytes, bytes, dict[str, Holding]]]]:
        """See :meth:`IndexStore.blocks`: the keys held when it starts, then each part of
        them as it is then, yielding to the loop between parts."""
        self._check_open()
        keys = [k for k in self._blocks if not ns_id or k[0] == ns_id]
        for i in range(0, len(keys), max(1, batch)):
            part = keys[i : i + max(1, batch)]
            held = self._locate_now_keys(part)
            out = [(ns, h, live) for (ns, h), live in zip(part, held, strict=True) if live]
            if out:
                yield out
            await asyncio.sleep(0)

    async def locate_object(self, key: str) -> list[ObjectHolder]:
        """See :meth:`IndexStore.locate_object`."""
        self._check_open()
        holders = self._objects.get(key, {})
        return [h for n, h in sorted(holders.items()) if self._is_live(n, h.epoch)]

    async def counts(self) -> IndexCounts:
        """See :meth:`IndexStore.counts`."""
        self._check_open()
        return IndexCounts(blocks=len(self._blocks), objects=len(self._objects))

    # -- events ---------------------------------------------------------------------------

    async def abort(self, ns_id: bytes, block_hashes: Sequence[bytes], reason: str) -> None:
        """See :meth:`IndexStore.abort`."""
        self._check_open()
        for block_hash in block_hashes:
            self._publish(IndexEvent(EventKind.ABORT, ns_id, block_hash, reason=reason))

    @contextlib.asynccontextmanager
    async def subscribe(
        self, ns_id: bytes, block_hashes: Sequence[bytes], maxlen: int
    ) -> AsyncIterator[Subscription]:
        """See :meth:`IndexStore.subscribe`. Snapshot and registration happen with no
        ``await`` in between, which is what makes them atomic here."""
        self._check_open()
        sub = _MemorySubscription(max(1, maxlen), self._locate_now(ns_id, block_hashes))
        keys = {(ns_id, h) for h in block_hashes}
        for key in keys:
            self._watchers.setdefault(key, set()).add(sub)
        self._subs.add(sub)
        try:
            yield sub
        finally:
            sub.close()
            self._subs.discard(sub)
            for key in keys:
                watchers = self._watchers.get(key)
                if watchers is not None:
                    watchers.discard(sub)
                    if not watchers:
                        del self._watchers[key]

    async def close(self) -> None:
        """See :meth:`IndexStore.close`."""
        self._closed = True
        for sub in list(self._subs):
            sub.close()

    # -- test support -----------------------------------------------------------------------

    def validate(self) -> None:
        """Check internal consistency; raises AssertionError naming the broken invariant."""
        for key, holders in self._blocks.items():
            if not holders:
                raise AssertionError(f"empty holder dict for block {key}")
            for node in holders:
                if key not in self._node_blocks.get(node, set()):
                    raise AssertionError(f"block {key} of {node!r} missing from node_blocks")
        for node, keys in self._node_blocks.items():
            for key in keys:
                if node not in self._blocks.get(key, {}):
                    raise AssertionError(f"node_blocks of {node!r} lists unheld block {key}")
        for obj_key, obj_holders in self._objects.items():
            if not obj_holders or any(
                obj_key not in self._node_objects.get(n, ()) for n in obj_holders
            ):
                raise AssertionError(f"object {obj_key!r} inconsistent with node_objects")
        for key, watchers in self._watchers.items():
            if not watchers or not watchers <= self._subs:
                raise AssertionError(f"watchers of {key} inconsistent with subscriptions")
        if len(self._dead) > self.MAX_DEAD_RECORDS:
            raise AssertionError("too many dead records kept")

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise Closed("index store is closed")

    def _is_live(self, node_id: str, epoch: int) -> bool:
        rec = self._nodes.get(node_id)
        return rec is not None and rec.alive and rec.epoch == epoch

    def _locate_now(self, ns_id: bytes, block_hashes: Sequence[bytes]) -> list[dict[str, Holding]]:
        return self._locate_now_keys([(ns_id, h) for h in block_hashes])

    def _locate_now_keys(self, keys: Sequence[_BlockKey]) -> list[dict[str, Holding]]:
        out: list[dict[str, Holding]] = []
        for key in keys:
            holders = self._blocks.get(key)
            if not holders:
                out.append({})
                continue
            out.append({n: h for n, h in holders.items() if self._is_live(n, h.epoch)})
        return out

    # (_add_blocks and _evict_blocks run once per commit, for every block of it: the lookups
    # they share are made once a batch, and an event is built only for a block watched.)

    def _add_blocks(self, node: str, epoch: int, adds: Sequence[BlockAdd]) -> None:
        """OR each add's chunks into ``node``'s entry for its block (an entry of an older
        epoch is replaced); COMMIT to the block's watchers."""
        if not adds:
            return
        blocks, watchers = self._blocks, self._watchers
        keys = self._node_blocks.get(node)
        if keys is None:
            keys = self._node_blocks[node] = set()
        for add in adds:
            key = (add.ns_id, add.block_hash)
            holders = blocks.get(key)
            if holders is None:
                holders = blocks[key] = {}
            old = holders.get(node)
            mask, location = mask_of(add.chunks), add.location
            if old is not None and old.epoch == epoch:
                mask |= old.mask
                location = location or old.location
            holders[node] = Holding(epoch, mask, location)
            keys.add(key)
            subs = watchers.get(key)
            if subs:
                chunks = tuple(sorted(set(add.chunks)))
                event = IndexEvent(
                    EventKind.COMMIT, add.ns_id, add.block_hash, node, epoch, chunks, "", location
                )
                for sub in subs:
                    sub.push(event)

    def _evict_blocks(self, node: str, epoch: int, refs: Sequence[BlockRef]) -> None:
        """Drop ``node``'s entries of these blocks; EVICT to a block's watchers when the
        entry dropped was live. ``epoch`` is the node's live epoch (:meth:`apply` checked
        it, and nothing changes it while this runs), so an entry is live iff of it."""
        if not refs:
            return
        blocks, watchers = self._blocks, self._watchers
        keys = self._node_blocks.get(node)
        for ref in refs:
            key = (ref.ns_id, ref.block_hash)
            holders = blocks.get(key)
            old = holders.pop(node, None) if holders is not None else None
            if old is None:
                continue
            if not holders:
                del blocks[key]
            if keys is not None:
                keys.discard(key)
            subs = watchers.get(key)
            if subs and old.epoch == epoch:
                event = IndexEvent(
                    EventKind.EVICT, ref.ns_id, ref.block_hash, node, old.epoch, tuple(old.chunks())
                )
                for sub in subs:
                    sub.push(event)
        if keys is not None and not keys:
            del self._node_blocks[node]

    def _add_object(self, node: str, epoch: int, obj: ObjectAdd) -> None:
        held = ObjectHolder(node, epoch, obj.nbytes, version=obj.version)
        self._objects.setdefault(obj.key, {})[node] = held
        self._node_objects.setdefault(node, set()).add(obj.key)

    def _remove_object(self, node: str, key: str) -> None:
        holders = self._objects.get(key)
        if holders is None or holders.pop(node, None) is None:
            return
        if not holders:
            del self._objects[key]
        _discard(self._node_objects, node, key)

    async def _purge(self, node: str, epoch: int) -> None:
        """Delete the node's entries of ``epoch`` or older, yielding now and then. Reads
        already ignore them; this only frees memory and fixes counts."""
        for i, key in enumerate(list(self._node_blocks.get(node, ()))):
            holders = self._blocks.get(key)
            old = holders.get(node) if holders is not None else None
            if holders is not None and old is not None and old.epoch <= epoch:
                del holders[node]
                if not holders:
                    del self._blocks[key]
                _discard(self._node_blocks, node, key)
            if i % self._purge_step == self._purge_step - 1:
                await asyncio.sleep(0)
        for obj_key in list(self._node_objects.get(node, ())):
            held = self._objects.get(obj_key, {}).get(node)
            if held is not None and held.epoch <= epoch:
                self._remove_object(node, obj_key)

    def _publish(self, event: IndexEvent) -> None:
        for sub in self._watchers.get((event.ns_id, event.block_hash), ()):
            sub.push(event)

    def _publish_all(self, event: IndexEvent) -> None:
        for sub in self._subs:
            sub.push(event)
