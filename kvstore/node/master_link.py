"""The node's link to the master: registration, group commits and heartbeats.

The node is the only writer of its index entries. Every change — chunks landed, slots
evicted, objects stored or removed — reaches the master as a ``Commit`` carrying the node's
epoch and the next sequence number, so commits and evictions are applied in order.

Group commit: one Commit RPC is in flight at a time and the next carries every caller queued
meanwhile, so concurrent exchanges share RPCs instead of queueing for one each. Heartbeats
(:mod:`kvstore.control.heartbeat`) run on their own thread with their own gRPC channels, so
a busy event loop never costs the node its lease. A commit answered "stale epoch" (lease
lost, master restarted) makes the node register again, which re-reports everything it
holds.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvstore import __version__
from kvstore.control import wire
from kvstore.control.client import MasterClient
from kvstore.control.heartbeat import Heartbeats
from kvstore.control.records import BlockAdd, BlockRef, CommitBatch, ObjectAdd, Tier
from kvstore.core.slots import ObjectStore, SlotKey
from kvstore.errors import KVStoreError, KVTimeout, MasterUnreachable, StaleEpoch, TransportError
from kvstore.metrics import Metrics
from kvstore.node.tiers import Tiers
from kvstore.v1 import kvstore_pb2 as pb

__all__ = ["MasterLink", "NodeIdentity"]

logger = logging.getLogger("kvstore.node")


@dataclass(frozen=True)
class NodeIdentity:
    """What a node tells the master about itself when it registers."""

    node_id: str
    data_uri: str
    transport: str
    nixl_metadata: bytes
    host: str


@dataclass
class _Queued:
    """One caller's share of the next Commit RPC, and the future it waits on."""

    adds: list[BlockAdd]
    object_adds: list[ObjectAdd]
    object_removes: list[str]
    done: asyncio.Future[None]

    def object_keys(self) -> set[str]:
        return {a.key for a in self.object_adds} | set(self.object_removes)


class MasterLink:
    """Registers the node, commits its changes, heartbeats. Owned by the node's event loop;
    the heartbeat thread only reads the latest usage and asks the loop to re-register."""

    REPORT_BATCH = 4096
    """Entries per Commit when a registration re-reports what the node holds."""

    def __init__(
        self,
        master: MasterClient,
        address: str,
        tiers: Tiers,
        objects: ObjectStore,
        metrics: Metrics,
    ) -> None:
        self.master = master
        if not master.session:
            # This process's registration key: only it may heartbeat, commit for or
            # re-register its id while that registration lives.
            master.session = os.urandom(32)
        self.address = address
        """The master's gRPC ``host:port`` (the heartbeat thread dials it)."""
        self.tiers = tiers
        self.objects = objects
        self.metrics = metrics
        self.epoch = 0
        self.lease_s = 10.0
        self.reregister = asyncio.Event()
        """Set when the master asks for (or a commit needs) a new registration."""
        self.usage: list[Tier] = []
        """The tiers' latest usage, sent with each heartbeat."""
        self.counters: dict[str, int] = {}
        """The node's latest counters (slots, pins, claims, scrub ...), sent likewise."""
        self._seq = 0
        self._me: NodeIdentity | None = None
        self._lock = asyncio.Lock()
        self._queued: list[_Queued] = []
        self._flusher: asyncio.Task[None] | None = None
        self.on_draining: Callable[[bool], None] | None = None
        """Called on the loop with the draining mark each heartbeat's answer carries."""
        self.tenant_bytes: dict[str, int] = {}
        """Bytes held by tenant, for the next heartbeat (set by the node's loop)."""
        self.tenant_evictions: dict[str, int] = {}
        """LRU evictions so far by tenant, for the next heartbeat."""
        self.on_quotas: Callable[[dict[str, int]], None] | None = None
        """Called on the node's loop with this node's tenant quotas from each heartbeat
        answer."""
        self._heartbeats: Heartbeats | None = None

    async def register(self, me: NodeIdentity) -> None:
        """Register (again) and re-report every landed slot and object held. Raises what
        the master client raises when the master does not answer."""
        self._me = me
        async with self._lock:
            reply = await self.master.register(
                me.node_id,
                me.data_uri,
                transport=me.transport,
                nixl_metadata=me.nixl_metadata,
                tiers=self.tiers.usage(),
                version=__version__,
                host=me.host,
            )
            self.epoch, self.lease_s, self._seq = reply.epoch, reply.lease_s, 0
            # Entries of the old epoch are dead already; evictions need no report.
            self.tiers.take_evictions()
            logger.info("registered %s epoch=%d lease=%.1fs", me.node_id, self.epoch, self.lease_s)
            self.tiers.take_moves()  # re-reported below, with every slot
            adds = [
                self.tiers.add_of(s)
                for t in self.tiers
                for s in t.table.slots()
                if s.landed_mask and not s.quarantined
            ]
            if self.tiers.disk is not None:
                adds += self.tiers.disk.adds()
            objs = [ObjectAdd(k, n, v) for k, n, v in self.objects.items()]
            # Streamed in bounded batches: a node holding more entries than one Commit may
            # carry (MAX_COMMIT_ITEMS) must still be able to rejoin.
            step = self.REPORT_BATCH
            for i in range(0, max(len(adds), len(objs)), step):
                await self._send(adds[i : i + step], [], objs[i : i + step], [])

    async def commit(
        self,
        adds: list[BlockAdd],
        object_adds: Iterable[ObjectAdd] = (),
        object_removes: Iterable[str] = (),
    ) -> None:
        """Commit ``adds`` (and every eviction not yet reported); returns once the master
        applied them. Raises :class:`MasterUnreachable` when the Commit RPC failed (the
        master unreachable or too slow, or the node re-registering), else what it raised.
        A batch never names one object key twice (object changes keep their order)."""
        done = asyncio.get_running_loop().create_future()
        # A caller cancelled meanwhile leaves its outcome unread: mark it read.
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._queued.append(_Queued(adds, list(object_adds), list(object_removes), done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="kvstore-commit")
        try:
            await asyncio.shield(done)
        except (TransportError, KVTimeout) as exc:
            if isinstance(exc, MasterUnreachable):
                raise
            raise MasterUnreachable(
                f"not known stored: the master did not confirm this node's commit ({exc})"
            ) from exc

    async def _flush(self) -> None:
        """Send queued commits, one RPC at a time, until none is queued."""
        while self._queued:
            batch, keys = [], set[str]()
            while self._queued and not (self._queued[0].object_keys() & keys):
                batch.append(self._queued.pop(0))
                keys |= batch[-1].object_keys()
            gone: list[tuple[str, SlotKey]] = []
            try:
                async with self._lock:
                    gone = self.tiers.take_evictions()
                    refs = [BlockRef(k[0], k[1]) for _, k in gone]
                    adds = [*self.tiers.take_moves(), *(a for q in batch for a in q.adds)]
                    obj_adds = [a for q in batch for a in q.object_adds]
                    obj_removes = [k for q in batch for k in q.object_removes]
                    if adds or refs or obj_adds or obj_removes:
                        await self._send(adds, refs, obj_adds, obj_removes)
                    for tier in {name for name, _ in gone}:
                        self.metrics.evictions.labels(tier=tier).inc(
                            sum(name == tier for name, _ in gone)
                        )
            except Exception as exc:
                # Evictions and moves the master did not take are not lost: they go with
                # the next commit (a registration meanwhile re-reports and drops them).
                self.tiers.put_back(gone)
                for q in batch:
                    q.done.set_exception(exc)
            except BaseException:  # cancelled (the node stops): nobody waits in vain
                for q in [*batch, *self._queued]:
                    q.done.cancel()
                self._queued.clear()
                raise
            else:  # (a caller cancelled meanwhile is shielded from its future)
                for q in batch:
                    q.done.set_result(None)

    async def _send(
        self,
        adds: list[BlockAdd],
        evicts: list[BlockRef],
        object_adds: list[ObjectAdd],
        object_removes: list[str],
    ) -> None:
        node_id = self._me.node_id if self._me else ""
        self._seq += 1
        batch = CommitBatch(node_id, self.epoch, self._seq, tuple(adds), tuple(evicts),
                            tuple(object_adds), tuple(object_removes),
                            tuple(self.tiers.usage()))  # fmt: skip
        try:
            await self.master.commit(batch)
        except StaleEpoch as exc:
            # The master declared this epoch dead (lease lost, master restarted): register
            # again; registration re-reports every slot and object held, these included.
            self.reregister.set()
            raise TransportError(f"node {node_id} is re-registering; retry") from exc

    def start_heartbeats(self, node_id: str, loop: asyncio.AbstractEventLoop) -> None:
        """Heartbeat every lease/3 (:class:`~kvstore.control.heartbeat.Heartbeats`) until
        :meth:`close`; their answers are handled on ``loop``."""
        call_soon = loop.call_soon_threadsafe
        sent = [0]  # (the epoch of the beat last sent: beats and answers share one thread)

        def beat() -> pb.HeartbeatRequest:  # (heartbeat thread: reads what the loop set)
            sent[0] = self.epoch
            return pb.HeartbeatRequest(
                node_id=node_id,
                epoch=sent[0],
                tiers=wire.tiers_to_pb(self.usage),
                counters=self.counters,
                tenant_bytes=self.tenant_bytes,
                tenant_evictions=self.tenant_evictions,
            )

        def answered(reply: pb.HeartbeatResponse) -> None:
            if reply.reregister:
                call_soon(self._reregister_for, sent[0])
                return
            if self.on_draining is not None:
                call_soon(self.on_draining, reply.draining)
            if self.on_quotas is not None:
                call_soon(self.on_quotas, dict(reply.tenant_quotas))

        self._heartbeats = Heartbeats(
            self.master, self.address, lambda: self.lease_s / 3, beat, answered,
            name=f"kvstore-heartbeat-{node_id}",
        )  # fmt: skip
        self._heartbeats.start()

    def _reregister_for(self, epoch: int) -> None:
        """A heartbeat of ``epoch`` was answered "register again": so it is, unless the
        node registered anew while that beat was in flight (it would re-report all it
        holds a second time for nothing)."""
        if epoch == self.epoch:
            self.reregister.set()

    async def deregister(self, timeout: float = 2.0) -> None:
        """Tell the master this node leaves (its entries go at once, not a lease later);
        best effort: a master that does not answer expires the node as usual."""
        if self._me is None or not self.epoch:
            return
        try:
            await self.master.deregister(self._me.node_id, self.epoch, timeout=timeout)
        except KVStoreError as exc:
            logger.warning("deregistration not delivered: %s", exc)

    async def close(self) -> None:
        """Cancel the commit in flight, stop heartbeats, close the master client."""
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._heartbeats is not None:
            await asyncio.to_thread(self._heartbeats.stop, 5.0)
        await self.master.close()
