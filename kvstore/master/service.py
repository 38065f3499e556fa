"""The ``kvstore.v1.Master`` gRPC servicer: validates, asks the index store and membership,
answers. State lives in :class:`~kvstore.master.index.IndexStore` (the index, the node
registry) and :class:`~kvstore.master.membership.Membership` (leases); this module only
carries requests to them and keeps the counters.

Errors: every ``KVStoreError`` a handler raises is answered with a typed status
(:func:`status_for`): InvalidArgument -> INVALID_ARGUMENT, StaleEpoch ->
FAILED_PRECONDITION, Miss -> NOT_FOUND, CapacityError -> RESOURCE_EXHAUSTED, KVTimeout ->
DEADLINE_EXCEEDED, Closed and Unreachable (its index store out of reach) -> UNAVAILABLE;
anything else is INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from kvstore.control import wire
from kvstore.control.auth import AuthConfig
from kvstore.control.records import (
    ClusterEvent,
    ClusterEventKind,
    CommitBatch,
    NodeInfo,
    NodeRecord,
    Tier,
    WatchEvent,
)
from kvstore.core import routing
from kvstore.core.tenancy import TenantScope
from kvstore.dataplane.handshake import Ticket, ticket_root
from kvstore.dataplane.location import tier_of
from kvstore.errors import (
    CapacityError,
    Closed,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    Miss,
    NodeIdTaken,
    PermissionDenied,
    StaleEpoch,
    Unauthorized,
    Unreachable,
)
from kvstore.master.events import DEFAULT_CAPACITY, EventLog
from kvstore.master.index import IndexStore, Subscription
from kvstore.master.membership import Membership
from kvstore.master.watch import WatchView
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

__all__ = ["MasterCounters", "MasterService", "PoolState", "RpcObserver", "status_for"]

log = logging.getLogger(__name__)

RpcObserver = Callable[[str, float], None]
"""``observer(method, seconds)``, called after every RPC (Watch: time to SNAPSHOT_DONE)."""

_STATUS: tuple[tuple[type[KVStoreError], grpc.StatusCode], ...] = (
    (StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (Miss, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (KVTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Closed, grpc.StatusCode.UNAVAILABLE),
    (Unreachable, grpc.StatusCode.UNAVAILABLE),  # (its index store: Redis down)
    (NodeIdTaken, grpc.StatusCode.ALREADY_EXISTS),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unauthorized, grpc.StatusCode.UNAUTHENTICATED),
)


def _digest(session: bytes) -> bytes:
    """What the master keeps of a node's registration key (empty: none)."""
    return hashlib.sha256(session).digest() if session else b""


_SNAPSHOT_BATCH = 1024
"""Watch events per stream message while sending a snapshot."""
_LIVE_BATCH = 256
"""Most index events turned into one stream message while live."""
_EVENTS_KEEPALIVE_S = 10.0
"""An Events stream with nothing to say sends an empty message this often (so a consumer
can tell a quiet pool from a dead master)."""
_FEED_LINGER_S = 60.0
"""On a shared index store, how long the event log goes on following the store's stream
after the last Events stream ended (a router that reconnects meanwhile resumes exactly)."""
_FEED_JOIN_S = 10.0
"""How long an Events stream waits for the event log to join a shared store's stream."""
_FEED_RETRY_S = 1.0
"""Pause before the event log follows a shared store's stream again after losing it."""


def status_for(exc: KVStoreError) -> grpc.StatusCode:
    """The gRPC status code a handler answers ``exc`` with."""
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


@dataclass
class MasterCounters:
    """Plain counters of the master, for ``Stats()`` and for the metrics module to read.

    Hits and misses are counted in blocks by MatchPrefix (the client converts them to
    tokens; ``hit_tokens`` uses the request's ``block_tokens``) and per key by
    LookupObject.
    """

    lookups: int = 0
    lookup_blocks: int = 0
    prefix_lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    hit_tokens: int = 0
    """Matched blocks times the request's ``block_tokens`` (0 when a client omits it)."""
    miss_tokens: int = 0
    """Unmatched blocks of each request times its ``block_tokens``."""
    object_hits: int = 0
    object_misses: int = 0
    commits: int = 0
    commit_streams: int = 0
    """``CommitStream`` calls opened (a node opens one and keeps it)."""
    commit_links: int = 0
    """Connections to the commit port that sent a commit (a node keeps one)."""
    aborts: int = 0
    watches: int = 0
    watch_overflows: int = 0
    nodes_expired: int = 0

    def count_commit_link(self) -> None:
        """One more connection to the commit port sent its first commit."""
        self.commit_links += 1

    @property
    def hits(self) -> int:
        """Prefix blocks found plus objects found."""
        return self.hit_blocks + self.object_hits

    @property
    def misses(self) -> int:
        """Prefix blocks not found plus objects not found."""
        return self.miss_blocks + self.object_misses


@dataclass(frozen=True)
class PoolState:
    """The pool as the master sees it after a sweep: node counts by state (``alive``,
    ``suspect``: silent for half a lease, ``draining``: of the live ones, ``dead``: records
    kept a while) and the blocks in the index."""

    nodes: dict[str, int]
    blocks: int


_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Handler = Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]]


def _unary(method: _Handler[_Req, _Resp]) -> _Handler[_Req, _Resp]:
    """Time the handler and answer our errors with typed statuses."""
    name = method.__name__

    @functools.wraps(method)
    async def handler(
        self: MasterService, request: _Req, context: grpc.aio.ServicerContext
    ) -> _Resp:
        start = time.perf_counter()
        try:
            response = await method(self, request, context)
        except KVStoreError as exc:
            # Observe before abort: abort sends the status, the caller may already see it.
            self._observe(name, time.perf_counter() - start)
            await context.abort(status_for(exc), str(exc))
            raise  # unreachable: abort raises
        except BaseException:
            self._observe(name, time.perf_counter() - start)
            raise
        self._observe(name, time.perf_counter() - start)
        return response

    return handler


class MasterService(pb_grpc.MasterServicer):
    """Servicer of ``kvstore.v1.Master``; every handler is ``async def`` and non-blocking.

    ``clock`` (monotonic seconds) drives leases; tests may pass their own. Watches buffer at
    most ``watch_queue`` events per subscriber and last at most ``watch_max_s`` seconds.
    """

    def __init__(
        self,
        store: IndexStore,
        membership: Membership,
        *,
        clock: Callable[[], float] = time.monotonic,
        watch_queue: int = 16384,
        watch_max_s: float = 3600.0,
        event_log: int = DEFAULT_CAPACITY,
        auth: AuthConfig | None = None,
    ) -> None:
        self.store = store
        self.auth = auth
        """With an auth file: the identities ``DataTicket`` issues tickets for."""
        self._ticket_root = ticket_root(auth.cluster_secret) if auth is not None else b""
        self.tenancy = TenantScope(auth.cluster_secret if auth is not None else None)
        """Scopes every namespace id and object key a tenant's caller names."""
        self.membership = membership
        self.counters = MasterCounters()
        self.node_counters: dict[str, dict[str, int]] = {}
        """Last counters each live node reported in its heartbeat."""
        self.node_tenants: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
        """Last (bytes held, LRU evictions) by tenant each live node reported."""
        self.quotas: dict[str, int] = dict(auth.quotas) if auth is not None else {}
        """Byte quotas on the pool, by tenant (the auth file's ``[[tenant]]`` tables)."""
        self.rpc_calls: dict[str, int] = {}
        self.rpc_seconds: dict[str, float] = {}
        self._observers: list[RpcObserver] = []
        self._pool_observers: list[Callable[[PoolState], None]] = []
        self._clock = clock
        self._watch_queue = watch_queue
        self._watch_max_s = watch_max_s
        self._records: dict[str, NodeRecord] = {}
        self._passed: dict[str, tuple[NodeRecord, bytes]] = {}
        """Per node: the record and the key that last passed :meth:`_check_session`."""
        self.events = EventLog(event_log)  # the cluster event stream (Events RPC)
        # On a shared store the log follows the store's stream while Events streams run.
        self._feed: asyncio.Task[None] | None = None
        self._feed_joined: asyncio.Future[None] | None = None
        self._feed_users = 0
        self._feed_idle: asyncio.TimerHandle | None = None
        # Tier usage from each node's last commit: node id -> (epoch, tiers).
        self._usage: dict[str, tuple[int, tuple[Tier, ...]]] = {}
        self._subs: set[Subscription] = set()
        self._commit_streams: dict[asyncio.Task[Any], bool] = {}
        """Each open CommitStream's task → whether it is applying a batch now."""
        self._closing = False
        self.commit_port = 0
        """The commit port nodes are told of (:mod:`kvstore.control.commit_port`); 0: none."""
        self._recorded: dict[str, tuple[int, int]] = {}
        """Each node's newest batch (epoch, seq) this master recorded in its events and
        counters."""

    # -- lifecycle ------------------------------------------------------------------------

    def add_rpc_observer(self, observer: RpcObserver) -> None:
        """Call ``observer(method, seconds)`` after every RPC (must not block or raise)."""
        self._observers.append(observer)

    def add_pool_observer(self, observer: Callable[[PoolState], None]) -> None:
        """Call ``observer(state)`` after every lease sweep with the pool as the master sees
        it (nodes by state, blocks in the index); it must not block or raise."""
        self._pool_observers.append(observer)

    async def restore(self) -> int:
        """Give every node the store knows as alive one full lease of grace (after a master
        restart); returns how many. Raises what the store raises."""
        now = self._clock()
        records = await self.store.nodes()
        self._records = {r.node_id: r for r in records}
        alive = [r for r in records if r.alive]
        for rec in alive:
            self.membership.restore(rec.node_id, rec.epoch, now)
        return len(alive)

    async def sweep(self) -> list[tuple[str, int]]:
        """Expire nodes silent for a lease: their epochs are dropped from the index (watchers
        get EVICT for the blocks they held). Returns the (node, epoch) pairs expired."""
        now = self._clock()
        for node_id, (epoch, age) in (await self.store.leases()).items():
            # Shared leases (masters on one Redis): a node heartbeating to another master
            # is alive here too, seen when the store says; a newer epoch replaces ours.
            status = self.membership.status(node_id, now)
            if status is None or status.epoch < epoch:
                self.membership.register(node_id, epoch, now - age)
            self.membership.heartbeat(node_id, epoch, now - age, remote=True)
        dead = self.membership.sweep(now)
        for node_id, epoch in dead:
            log.warning("node %s (epoch %d) missed its lease; dropping its entries", node_id, epoch)
            await self._drop(node_id, epoch, "lease expired")
        self.counters.nodes_expired += len(dead)
        if self._pool_observers:
            state = await self.pool_state()
            for observe in self._pool_observers:
                observe(state)
        return dead

    async def pool_state(self) -> PoolState:
        """Nodes by state and blocks in the index, now. Raises what the store raises."""
        nodes = dict.fromkeys(("alive", "suspect", "draining", "dead"), 0)
        for info in await self._node_infos():
            state = "dead" if not info.alive else "suspect" if info.suspect else "alive"
            nodes[state] += 1
            nodes["draining"] += int(info.alive and info.draining)
        return PoolState(nodes, (await self.store.counts()).blocks)

    def close_streams(self) -> None:
        """End every open stream, so that stopping does not wait out its grace for them:
        Watch and Events streams finish with UNAVAILABLE; a CommitStream waiting for its
        next batch is cancelled at once, one applying a batch ends once it has answered it
        (its node sends its next batch by Commit, to a master that answers). Never
        blocks."""
        self._closing = True
        self._stop_feed(force=True)
        self.events.wake()  # (each Events stream sees _closing and ends)
        for sub in list(self._subs):
            sub.close()
        for task, applying in list(self._commit_streams.items()):
            if not applying:
                task.cancel()

    # -- membership -------------------------------------------------------------------------

    @_unary
    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        """A node (re-)registers: new epoch, the old epoch's entries are dead."""
        old = self._records.get(request.node_id)
        record = replace(wire.record_from_register(request), session=_digest(request.session))
        rec = await self.store.register_node(record)  # (NodeIdTaken: another key holds it)
        if old is not None and old.alive and old.epoch < rec.epoch and self._own_events:
            self.events.node_dead(old.node_id, old.epoch, "re-registered")
        self.membership.register(rec.node_id, rec.epoch, self._clock())
        self._records[rec.node_id] = rec
        log.info("node %s registered: epoch %d, %s", rec.node_id, rec.epoch, rec.data_uri)
        return pb.RegisterResponse(
            epoch=rec.epoch, lease_s=self.membership.lease_s, commit_port=self.commit_port
        )

    @_unary
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        """Renew a lease; unknown node or epoch answers ``reregister``."""
        node_id = wire.check_node_id(request.node_id)
        tiers = wire.tiers_from_pb(request.tiers)
        counters = wire.check_counters(request.counters)
        now = self._clock()
        reg = await self._registration(node_id, request.epoch)
        self._check_session(reg, request.epoch, request.session)
        known = self.membership.heartbeat(node_id, request.epoch, now)
        if not known and not await self._adopt(node_id, request.epoch, now):
            return pb.HeartbeatResponse(ok=False, reregister=True)
        draining = await self.store.update_node(node_id, request.epoch, tiers=tiers)
        if draining is None:
            return pb.HeartbeatResponse(ok=False, reregister=True)
        rec = self._records.get(node_id)
        if rec is not None and rec.epoch == request.epoch:
            # (the store's mark: another master sharing it may have set it)
            self._records[node_id] = replace(rec, tiers=tiers, draining=draining)
        self._usage.pop(node_id, None)  # the heartbeat's usage is the newest now
        self.node_counters[node_id] = counters
        self.node_tenants[node_id] = (
            wire.check_counters(request.tenant_bytes),
            wire.check_counters(request.tenant_evictions),
        )
        return pb.HeartbeatResponse(
            ok=True,
            reregister=False,
            draining=draining,
            tenant_quotas=self._shares(node_id, tiers),
        )

    def _shares(self, node_id: str, tiers: Sequence[Tier]) -> dict[str, int]:
        """Node ``node_id``'s share of each tenant's pool quota: the quota times the node's
        part (its tiers ``tiers``) of the capacity of the live nodes that take blocks.
        Nodes place blocks by weighted rendezvous hashing, so each holds about its part of
        every tenant's blocks."""
        if not self.quotas:
            return {}
        mine = sum(t.capacity_bytes for t in tiers)
        pool = mine + sum(
            sum(t.capacity_bytes for t in rec.tiers)
            for rec in self._records.values()
            if rec.node_id != node_id
            and rec.alive
            and not rec.draining
            and self.membership.is_live(rec.node_id, rec.epoch)
        )
        return {t: q * mine // pool if pool else q for t, q in self.quotas.items()}

    @_unary
    async def Nodes(
        self, request: pb.NodesRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodesResponse:
        """Every known node with its liveness."""
        infos = await self._node_infos()
        return pb.NodesResponse(nodes=[wire.node_info_to_pb(i) for i in infos])

    @_unary
    async def Drain(
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainResponse:
        """Set or clear a node's draining mark; unknown node -> NOT_FOUND."""
        node_id = wire.check_node_id(request.node_id)
        rec = await self._record(node_id)
        if rec is None:
            raise Miss(f"unknown node {node_id!r}")
        who = self.auth.caller(context.invocation_metadata()) if self.auth is not None else None
        if who is not None and who.role == "node":  # a node drains itself, no other one
            if not rec.session:
                raise PermissionDenied(f"Drain of {node_id!r}: a node may drain only itself")
            self._check_session(rec, rec.epoch, request.session)
        draining = not request.undrain
        if await self.store.update_node(node_id, rec.epoch, draining=draining) is None:
            raise Miss(f"node {node_id!r} re-registered meanwhile; try again")
        self._records[node_id] = replace(rec, draining=draining)
        return pb.DrainResponse(draining=draining)

    @_unary
    async def ReportNode(
        self, request: pb.ReportNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportNodeResponse:
        """A client failed to read from a node: suspect at once (until it heartbeats)."""
        node_id = wire.check_node_id(request.node_id)
        reason = wire.check_text(request.reason, "reason")
        suspect = self.membership.report(node_id, request.epoch)
        if suspect:
            log.warning("node %s (epoch %d) reported by a reader: %s", node_id, request.epoch,
                        reason or "read failed")  # fmt: skip
        return pb.ReportNodeResponse(suspect=suspect)

    @_unary
    async def Deregister(
        self, request: pb.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeregisterResponse:
        """A node leaving: its epoch is dead and dropped from the index at once."""
        node_id = wire.check_node_id(request.node_id)
        reg = await self._registration(node_id, request.epoch)
        self._check_session(reg, request.epoch, request.session)
        if not self.membership.leave(node_id, request.epoch):
            return pb.DeregisterResponse(dropped=False)
        log.info("node %s (epoch %d) left", node_id, request.epoch)
        await self._drop(node_id, request.epoch, "node left")
        return pb.DeregisterResponse(dropped=True)

    async def _adopt(self, node_id: str, epoch: int, now: float) -> bool:
        """A node this master does not know under ``epoch`` heartbeats or commits: masters
        sharing one store accept it if the store says that epoch is alive (the node moved
        from another master: no new epoch, nothing re-reported). The caller has checked its
        key against that epoch's record already (:meth:`_registration`)."""
        rec = next((r for r in await self.store.nodes() if r.node_id == node_id), None)
        if rec is None or not rec.alive or rec.epoch != epoch:
            return False
        self.membership.register(node_id, epoch, now)
        self._records[node_id] = rec
        log.info("node %s (epoch %d) moved to this master", node_id, epoch)
        return True

    async def _registration(self, node_id: str, epoch: int) -> NodeRecord | None:
        """The record of ``epoch`` of ``node_id`` (its key is what a call for that epoch
        must carry): this master's copy, else the store's, where a node that registered
        through another master sharing it is recorded (then kept here). None if that epoch
        is not the node's current one. A (node, epoch)'s key never changes."""
        rec = self._records.get(node_id)
        if rec is not None and rec.epoch == epoch:
            return rec
        stored = next((r for r in await self.store.nodes() if r.node_id == node_id), None)
        if stored is not None and (rec is None or stored.epoch > rec.epoch):
            self._records[node_id] = stored
        return stored if stored is not None and stored.epoch == epoch else None

    def _check_session(self, rec: NodeRecord | None, epoch: int, session: bytes | None) -> None:
        """Refuse a call for ``epoch`` of a registration whose key is not ``session``
        (PermissionDenied): a process holding the cluster secret cannot heartbeat, commit
        for or deregister another's registration. None: this master's own process.

        The key that passed last against this same record passes again without its digest
        (SHA-256 on every commit: 9% of the in-process commit in a node's profile); the
        comparison stays constant-time."""
        if session is None or rec is None or rec.epoch != epoch or not rec.session:
            return
        passed = self._passed.get(rec.node_id)
        if passed is not None and passed[0] is rec and hmac.compare_digest(passed[1], session):
            return
        if not hmac.compare_digest(rec.session, _digest(session)):
            raise PermissionDenied(
                f"node {rec.node_id!r} epoch {epoch}: the registration key does not match "
                "(another process registered this id)"
            )
        self._passed[rec.node_id] = (rec, bytes(session))

    async def _drop(self, node_id: str, epoch: int, reason: str) -> None:
        """Drop a dead epoch's entries from the index and mark its record not alive."""
        await self.store.drop_node(node_id, epoch, reason)
        if self._own_events:
            self.events.node_dead(node_id, epoch, reason)
        rec = self._records.get(node_id)
        if rec is not None and rec.epoch == epoch:
            self._records[node_id] = replace(rec, alive=False)
        self.node_counters.pop(node_id, None)
        self._passed.pop(node_id, None)
        if self._recorded.get(node_id, (0, 0))[0] <= epoch:
            self._recorded.pop(node_id, None)
        self.node_tenants.pop(node_id, None)

    def _suspects(self, node_ids: Iterable[str]) -> set[str]:
        """Which of ``node_ids`` are suspect now (their copies are listed last)."""
        now = self._clock()
        return {n for n in node_ids if (st := self.membership.status(n, now)) and st.suspect}

    # -- index ------------------------------------------------------------------------------

    @_unary
    async def Commit(
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitResponse:
        """Apply a node's batch; stale epoch -> FAILED_PRECONDITION."""
        applied = await self._apply_commit(wire.commit_from_pb(request), request.session)
        return pb.CommitResponse(applied_seq=applied, commit_port=self.commit_port)

    async def CommitStream(
        self, requests: AsyncIterator[pb.CommitRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CommitResponse]:
        """:meth:`Commit` as one long-lived stream: each request applied as by ``Commit``,
        answered in order and timed as ``Commit`` (its latency metric covers both ways in);
        an error ends the stream with ``Commit``'s status."""
        self.counters.commit_streams += 1
        task = asyncio.current_task()
        if task is None or self._closing:
            return
        self._commit_streams[task] = False
        try:
            async for request in requests:
                self._commit_streams[task] = True  # (not cancelled by close_streams now)
                start = time.perf_counter()
                try:
                    applied = await self._apply_commit(
                        wire.commit_from_pb(request), request.session
                    )
                except KVStoreError as exc:
                    self._observe("Commit", time.perf_counter() - start)
                    await context.abort(status_for(exc), str(exc))
                    raise  # unreachable: abort raises
                self._observe("Commit", time.perf_counter() - start)
                yield pb.CommitResponse(applied_seq=applied, commit_port=self.commit_port)
                if self._closing:
                    return
                self._commit_streams[task] = False
        except asyncio.CancelledError:
            if not self._closing:
                raise
            # Cancelled by close_streams: answer a status, or gRPC would hold the call
            # (and the server's stop, for its whole grace) until the node hangs up.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the master is stopping")
        finally:
            self._commit_streams.pop(task, None)

    async def commit_frame(self, data: bytes | bytearray) -> int:
        """What ``Commit`` does, for a batch that came to the commit port
        (:mod:`kvstore.control.commit_port`) as a serialized CommitRequest: checked, applied
        and timed like the RPC. Returns the applied seq; raises as ``Commit`` answers
        (:class:`InvalidArgument` also for bytes that are not a CommitRequest)."""
        start = time.perf_counter()
        try:
            try:
                request = pb.CommitRequest.FromString(data)
            except DecodeError:
                raise InvalidArgument("a commit frame's buffer is not a CommitRequest") from None
            if self._closing:
                raise Closed("the master is stopping")  # (UNAVAILABLE: not a verdict)
            return await self._apply_commit(wire.commit_from_pb(request), request.session)
        finally:
            self._observe("Commit", time.perf_counter() - start)

    @property
    def commit_waits(self) -> bool:
        """Whether :meth:`commit_in_process` may suspend (its store's commit may wait)."""
        return self.store.commit_waits

    async def commit_in_process(self, batch: CommitBatch, session: bytes | None = None) -> int:
        """What ``Commit`` does, for the node of this same process (``kvstore serve``): the
        batch is handed over as records, without the protobuf round trip (measured: 135 µs
        of a 335 µs commit of 8 adds and 8 evictions here), checked and timed like the RPC.
        Returns the applied seq; raises :class:`StaleEpoch`, :class:`InvalidArgument` and
        (``session`` not the registration's key) :class:`PermissionDenied` like the RPC;
        ``session`` None: not checked."""
        start = time.perf_counter()
        try:
            return await self._apply_commit(wire.check_commit(batch), session)
        finally:
            self._observe("Commit", time.perf_counter() - start)

    async def _apply_commit(self, batch: CommitBatch, session: bytes | None) -> int:
        if session is not None:
            reg = await self._registration(batch.node_id, batch.epoch)
            self._check_session(reg, batch.epoch, session)
        live = self.membership.is_live(batch.node_id, batch.epoch)
        if not live and not await self._adopt(batch.node_id, batch.epoch, self._clock()):
            raise StaleEpoch(f"node {batch.node_id!r} epoch {batch.epoch} is not live; re-register")
        applied = await self.store.apply(batch)
        last = self._recorded.get(batch.node_id)
        if applied == batch.seq and (last is None or last < (batch.epoch, batch.seq)):
            # Applied now (or by a master before this process): a batch sent again after
            # its answer was lost (a broken link or stream) is recorded and counted once.
            self._recorded[batch.node_id] = (batch.epoch, batch.seq)
            if self._own_events:
                self.events.commit(batch.node_id, batch.epoch, batch.adds, batch.evicts)
            self.counters.commits += 1
        if batch.tiers:  # live usage for Stats and Nodes; the store keeps the heartbeat's
            self._usage[batch.node_id] = (batch.epoch, batch.tiers)
        self.membership.heartbeat(batch.node_id, batch.epoch, self._clock())
        return applied

    @_unary
    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        """Live holders of each block."""
        ns_id = self._pool_id(context, wire.check_ns_id(request.ns_id))
        hashes = wire.check_block_hashes(request.block_hashes)
        cpb = wire.check_chunks_per_block(request.chunks_per_block, required=False)
        located = await self.store.locate(ns_id, hashes)
        uris = await self._uris(n for holders in located for n in holders)
        self.counters.lookups += 1
        self.counters.lookup_blocks += len(hashes)
        last = self._suspects(uris)
        return pb.LookupResponse(
            blocks=[wire.block_holders_to_pb(h, uris, cpb, last) for h in located]
        )

    @_unary
    async def MatchPrefix(
        self, request: pb.MatchPrefixRequest, context: grpc.aio.ServicerContext
    ) -> pb.MatchPrefixResponse:
        """Leading blocks whose every chunk is present in the union of live holders."""
        ns_id = self._pool_id(context, wire.check_ns_id(request.ns_id))
        hashes = wire.check_block_hashes(request.block_hashes)
        cpb = wire.check_chunks_per_block(request.chunks_per_block, required=True)
        matched, located, uris = await self._match(ns_id, hashes, cpb, request.block_tokens)
        if request.skip_holders:
            return pb.MatchPrefixResponse(blocks=matched)
        last = self._suspects(uris)  # (once per call, not once per block)
        return pb.MatchPrefixResponse(
            blocks=matched,
            holders=[wire.block_holders_to_pb(h, uris, cpb, last) for h in located[:matched]],
        )

    @_unary
    async def LookupObject(
        self, request: pb.LookupObjectRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupObjectResponse:
        """Live holders of an object, those of the newest version first; none is a miss
        (empty list), not an error."""
        key = self.tenancy.object_key(self._tenant(context), wire.check_key(request.key))
        holders = await self.store.locate_object(key)
        uris = await self._uris(h.node_id for h in holders)
        found = [
            pb.ObjectHolder(
                node_id=h.node_id,
                data_uri=uris[h.node_id],
                nbytes=h.nbytes,
                epoch=h.epoch,
                version=h.version,
            )
            for h in sorted(holders, key=lambda h: (-h.version, h.node_id))
            if h.node_id in uris
        ]
        if found:
            self.counters.object_hits += 1
        else:
            self.counters.object_misses += 1
        return pb.LookupObjectResponse(holders=found)

    @_unary
    async def DataTicket(
        self, request: pb.DataTicketRequest, context: grpc.aio.ServicerContext
    ) -> pb.DataTicketResponse:
        """A data-port ticket for the caller's role and tenant; empty without an auth file
        (the auth interceptor has already refused a caller without a valid token)."""
        if self.auth is None:
            return pb.DataTicketResponse()
        who = self.auth.caller(context.invocation_metadata())
        if who is None:
            raise Unauthorized("DataTicket: no valid token")
        t = Ticket.issue(self._ticket_root, who.role, who.tenant)
        return pb.DataTicketResponse(
            ticket=t.claims, key=t.key, expires_unix=t.expires, role=t.role, tenant=t.tenant
        )

    @_unary
    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        """Pool totals (capacity and usage over live nodes)."""
        infos = await self._node_infos()
        live = [i for i in infos if i.alive]
        counts = await self.store.counts()
        return pb.StatsResponse(
            tenants=self._tenant_usage({i.node_id for i in live}, self._tenant(context)),
            nodes=len(infos),
            live_nodes=len(live),
            capacity_bytes=sum(t.capacity_bytes for i in live for t in i.tiers),
            used_bytes=sum(t.used_bytes for i in live for t in i.tiers),
            blocks=counts.blocks,
            objects=counts.objects,
            hits=self.counters.hits,
            misses=self.counters.misses,
        )

    def _tenant_usage(self, live: set[str], caller: str) -> list[pb.TenantUsage]:
        """Bytes, quota and evictions by tenant over the ``live`` nodes' last heartbeats;
        only ``caller``'s own when it speaks for a tenant."""
        used: Counter[str] = Counter()
        evictions: Counter[str] = Counter()
        for node_id, (held, evicted) in self.node_tenants.items():
            if node_id in live:
                used.update(held)
                evictions.update(evicted)
        names = sorted((set(used) | set(evictions) | set(self.quotas)) - {""})
        return [
            pb.TenantUsage(tenant=t, used_bytes=used.get(t, 0), quota_bytes=self.quotas.get(t, 0),
                           evictions=evictions.get(t, 0))
            for t in names
            if not caller or t == caller
        ]  # fmt: skip

    async def _match(
        self, ns_id: bytes, hashes: list[bytes], cpb: int, block_tokens: int
    ) -> tuple[int, list[Any], dict[str, str]]:
        """Leading blocks of ``hashes`` every chunk of which a live node holds (counted in
        the hit and miss counters), the holders located and the live nodes' URIs."""
        located = await self.store.locate(ns_id, hashes)
        uris = await self._uris(n for holders in located for n in holders)
        full = (1 << cpb) - 1
        matched = 0
        for holders in located:
            union = 0
            for node, holding in holders.items():
                if node in uris:
                    union |= holding.mask
            if union & full != full:
                break
            matched += 1
        self.counters.prefix_lookups += 1
        self.counters.hit_blocks += matched
        self.counters.hit_tokens += matched * block_tokens
        self.counters.miss_blocks += len(hashes) - matched
        self.counters.miss_tokens += (len(hashes) - matched) * block_tokens
        return matched, located, uris

    @_unary
    async def Route(
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext
    ) -> pb.RouteResponse:
        """The pool's prefix hit weighed against each instance's cache and load."""
        ns_id = self._pool_id(context, wire.check_ns_id(request.ns_id))
        hashes = wire.check_block_hashes(request.block_hashes)
        cpb = wire.check_chunks_per_block(request.chunks_per_block, required=True)
        instances = wire.route_instances_from_pb(request.instances)
        matched = (await self._match(ns_id, hashes, cpb, request.block_tokens))[0]
        weights = {
            f"{name}_weight": getattr(request, f"{name}_weight")
            for name in ("overlap", "transfer", "load")
            if request.HasField(f"{name}_weight")
        }
        pool = matched * request.block_tokens
        choice = routing.choose(max(request.prompt_tokens, pool), pool, instances, **weights)
        return wire.route_choice_to_pb(choice)

    # -- events -----------------------------------------------------------------------------

    @_unary
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        """Publish ABORT for the blocks to their watchers (the caller's tenant's only)."""
        ns_id = self._pool_id(context, wire.check_ns_id(request.ns_id))
        hashes = wire.check_block_hashes(request.block_hashes, allow_empty=False)
        reason = wire.check_text(request.reason, "reason")
        await self.store.abort(ns_id, hashes, reason or "writer aborted")
        self.counters.aborts += 1
        return pb.AbortResponse()

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchResponse]:
        """Snapshot as COMMIT events, SNAPSHOT_DONE, then live events, in batches."""
        try:
            async for batch in self._watch(request, self._tenant(context)):
                yield batch
        except KVStoreError as exc:
            if isinstance(exc, CapacityError):
                self.counters.watch_overflows += 1
            await context.abort(status_for(exc), str(exc))

    async def _watch(
        self, request: pb.WatchRequest, tenant: str
    ) -> AsyncIterator[pb.WatchResponse]:
        start = time.perf_counter()
        ns_id = self.tenancy.pool_id(tenant, wire.check_ns_id(request.ns_id))
        hashes = wire.check_block_hashes(request.block_hashes, allow_empty=False)
        cpb = wire.check_chunks_per_block(request.chunks_per_block, required=False)
        deadline = self._clock() + self._watch_max_s
        self.counters.watches += 1
        async with self.store.subscribe(ns_id, hashes, self._watch_queue) as sub:
            self._subs.add(sub)
            try:
                view = WatchView(hashes, cpb)
                events = view.snapshot(sub.snapshot)
                for i in range(0, len(events), _SNAPSHOT_BATCH):
                    yield _batch(events[i : i + _SNAPSHOT_BATCH])
                self._observe("Watch", time.perf_counter() - start)
                while True:
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        raise KVTimeout(f"watch ended after its {self._watch_max_s} s limit")
                    live = [
                        e for ev in await sub.read(_LIVE_BATCH, remaining) for e in view.apply(ev)
                    ]
                    if live:
                        yield _batch(live)
            finally:
                self._subs.discard(sub)

    async def Events(
        self, request: pb.EventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EventsResponse]:
        """Every store and removal from now (or after ``after_seq`` of ``log_id``), in
        order; CLEARED first when the events asked for are no longer kept, followed, when
        ``snapshot`` is asked for, by the index and SNAPSHOT_DONE."""
        try:
            async for batch in self._events(request, self._tenant(context)):
                yield batch
        except KVStoreError as exc:
            await context.abort(status_for(exc), str(exc))

    async def _events(
        self, request: pb.EventsRequest, tenant: str
    ) -> AsyncIterator[pb.EventsResponse]:
        """A tenant's caller sees its own namespaces' events only: one namespace's under the
        id it named; all of them under their pool ids (:mod:`kvstore.core.tenancy`)."""
        asked = wire.check_ns_id(request.ns_id) if request.ns_id else b""
        ns_id = self.tenancy.pool_id(tenant, asked) if asked else b""
        owns = None if ns_id or not tenant else functools.partial(self.tenancy.owns, tenant)
        log_id = wire.check_text(request.log_id, "log_id")
        deadline = self._clock() + self._watch_max_s
        self.counters.watches += 1
        async with self._following():
            log = self.events
            cursor, clear = log.start(request.after_seq, log_id)
            clear = clear or (request.snapshot and not log_id)
            yield pb.EventsResponse(log_id=log.log_id)  # the log id, at once
            while True:
                if clear:
                    async for out in self._rebuild(cursor, ns_id, asked, owns, request.snapshot):
                        yield pb.EventsResponse(log_id=log.log_id, events=out)
                    clear = False
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise KVTimeout(f"event stream ended after its {self._watch_max_s} s limit")
                news = await log.wait(cursor, min(remaining, _EVENTS_KEEPALIVE_S))
                if self._closing:
                    raise Unreachable("the master is stopping; another master serves events")
                if not news:
                    yield pb.EventsResponse(log_id=log.log_id)  # keep-alive: nothing new
                    continue
                events, new_cursor, lost = log.since(cursor, ns_id, _LIVE_BATCH, owns)
                if lost and request.snapshot:  # fell behind the log, or a gap: the index
                    cursor, clear = log.last_seq, True  # afresh, then what follows it
                    continue
                live = [log.cleared(events[0].seq - 1 if events else new_cursor)] if lost else []
                cursor = new_cursor  # (without a snapshot: CLEARED, then what is still kept)
                live += events if asked == ns_id else [_renamed(e, ns_id, asked) for e in events]
                if live:
                    yield pb.EventsResponse(
                        log_id=log.log_id, events=[wire.cluster_event_to_pb(e) for e in live]
                    )

    async def _rebuild(
        self,
        cursor: int,
        ns_id: bytes,
        asked: bytes,
        owns: Callable[[bytes], bool] | None,
        snapshot: bool,
    ) -> AsyncIterator[list[pb.ClusterEvent]]:
        """CLEARED numbered ``cursor`` and, with ``snapshot``, a STORED event per live
        holder of every block the index holds (as the stream's filter passes them, named
        as it names them), then SNAPSHOT_DONE. The index is read after ``cursor`` was
        taken: a change made meanwhile is in it, in the events after ``cursor``, or both;
        every event is one a reader may apply twice."""
        first = [wire.cluster_event_to_pb(self.events.cleared(cursor))]
        if not snapshot:
            yield first
            return
        out = first
        stored = ClusterEventKind.STORED
        chunk_lists: dict[int, tuple[int, ...]] = {}  # (masks repeat: a whole block's most)
        async for part in self.store.blocks(ns_id, _SNAPSHOT_BATCH):
            for ns, block_hash, holders in part:
                if owns is not None and not owns(ns):
                    continue
                name = asked if ns_id else ns
                for node_id, held in sorted(holders.items()):
                    chunks = chunk_lists.get(held.mask)
                    if chunks is None:
                        chunks = tuple(held.chunks())
                        if len(chunk_lists) < _SNAPSHOT_BATCH:
                            chunk_lists[held.mask] = chunks
                    event = ClusterEvent(cursor, stored, name, block_hash, node_id, held.epoch,
                                         chunks, tier_of(held.location))  # fmt: skip
                    out.append(wire.cluster_event_to_pb(event))
            if len(out) >= _SNAPSHOT_BATCH:
                yield out
                out = []
        out.append(wire.cluster_event_to_pb(self.events.snapshot_done(cursor)))
        yield out

    # -- the event log on a shared store ----------------------------------------------------

    @property
    def _own_events(self) -> bool:
        """Whether the event log records this master's own changes (its store is not shared;
        a shared store's are recorded from the store's stream, :meth:`_following`)."""
        return not self.store.shares_events

    @contextlib.asynccontextmanager
    async def _following(self) -> AsyncIterator[None]:
        """Around an Events stream: on a shared store, have the event log follow the
        store's stream of every master's changes. The first stream starts it and waits
        until it has joined (so what the stream's cursor leaves out, the store's index
        has); it stops :data:`_FEED_LINGER_S` after the last stream ended."""
        if self._own_events:
            yield
            return
        self._feed_users += 1
        if self._feed_idle is not None:
            self._feed_idle.cancel()
            self._feed_idle = None
        try:
            if self._feed is None or self._feed.done() or self._feed_joined is None:
                loop = asyncio.get_running_loop()
                self._feed_joined = loop.create_future()
                self._feed_joined.add_done_callback(_retrieved)
                self._feed = loop.create_task(self._follow_store(self._feed_joined),
                                              name="kvstore-master-event-log")  # fmt: skip
            try:
                async with asyncio.timeout(_FEED_JOIN_S):
                    await asyncio.shield(self._feed_joined)
            except TimeoutError as exc:
                raise Unreachable("the index store's stream was not joined in time") from exc
            yield
        finally:
            self._feed_users -= 1
            if not self._feed_users and self._feed is not None:
                loop = asyncio.get_running_loop()
                self._feed_idle = loop.call_later(_FEED_LINGER_S, self._stop_feed)

    def _stop_feed(self, force: bool = False) -> None:
        """Stop following the store's stream (when no Events stream runs, or ``force``)."""
        if self._feed_idle is not None:
            self._feed_idle.cancel()
            self._feed_idle = None
        if (force or not self._feed_users) and self._feed is not None:
            self._feed.cancel()
            self._feed = self._feed_joined = None

    async def _follow_store(self, joined: asyncio.Future[None]) -> None:
        """Record every change the shared store publishes in the event log. Each time it
        (re)joins the store's stream it marks a gap (readers from before it must clear);
        having lost it (events missed, the store unreachable), it joins again."""
        while True:
            try:
                async with self.store.subscribe_all(self.events.capacity) as sub:
                    self.events.gap()
                    if not joined.done():
                        joined.set_result(None)
                    while True:
                        self.events.record(await sub.read(4 * _LIVE_BATCH))
            except KVStoreError as exc:
                if not joined.done():
                    joined.set_exception(exc)
                    return
                log.warning("the event log lost the index store's stream (%s); joining again",
                            exc)  # fmt: skip
            await asyncio.sleep(_FEED_RETRY_S)

    # -- helpers ----------------------------------------------------------------------------

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The tenant of the call's token (``""``: none, a node's, or no auth file)."""
        if self.auth is None:
            return ""
        who = self.auth.caller(context.invocation_metadata())
        return who.tenant if who is not None and who.role != "node" else ""

    def _pool_id(self, context: grpc.aio.ServicerContext, ns_id: bytes) -> bytes:
        """The id the caller's tenant's namespace ``ns_id`` is indexed under."""
        return self.tenancy.pool_id(self._tenant(context), ns_id)

    def _observe(self, method: str, seconds: float) -> None:
        self.rpc_calls[method] = self.rpc_calls.get(method, 0) + 1
        self.rpc_seconds[method] = self.rpc_seconds.get(method, 0.0) + seconds
        for observer in self._observers:
            try:
                observer(method, seconds)
            except Exception:  # an observer's bug must not fail the RPC
                log.exception("rpc observer failed")

    async def _record(self, node_id: str) -> NodeRecord | None:
        rec = self._records.get(node_id)
        if rec is None:
            await self._refresh_records()
            rec = self._records.get(node_id)
        return rec

    async def _refresh_records(self) -> None:
        self._records = {r.node_id: r for r in await self.store.nodes()}

    def _tiers_of(self, rec: NodeRecord) -> tuple[Tier, ...]:
        """The node's tier usage: as of its last commit to this master since its last
        heartbeat, when of its current epoch; else its record's (the heartbeat's)."""
        epoch, tiers = self._usage.get(rec.node_id, (-1, ()))
        if epoch != rec.epoch:
            self._usage.pop(rec.node_id, None)
            return rec.tiers
        return tiers

    async def _uris(self, node_ids: Iterable[str]) -> dict[str, str]:
        """Data URI of each node id (refreshing the registry cache once on a miss)."""
        wanted = set(node_ids)
        if not wanted <= self._records.keys():
            await self._refresh_records()
        return {n: self._records[n].data_uri for n in wanted if n in self._records}

    async def _node_infos(self) -> list[NodeInfo]:
        await self._refresh_records()
        now = self._clock()
        infos = []
        for rec in self._records.values():
            status = self.membership.status(rec.node_id, now)
            current = status is not None and status.epoch == rec.epoch
            alive = rec.alive and (status is None or (current and status.alive))
            infos.append(
                NodeInfo(
                    node_id=rec.node_id,
                    alive=alive,
                    suspect=alive and status is not None and status.suspect,
                    draining=rec.draining,
                    lease_age_s=status.lease_age_s if status is not None and current else 0.0,
                    epoch=rec.epoch,
                    data_uri=rec.data_uri,
                    transport=rec.transport,
                    nixl_metadata=rec.nixl_metadata,
                    tiers=self._tiers_of(rec),
                    version=rec.version,
                    host=rec.host,
                    counters=dict(self.node_counters.get(rec.node_id, {})) if alive else {},
                )
            )
        return sorted(infos, key=lambda i: i.node_id)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark ``fut``'s exception seen (each waiter gets it; none may be left to wait)."""
    if not fut.cancelled():
        fut.exception()


def _renamed(event: ClusterEvent, pool_id: bytes, ns_id: bytes) -> ClusterEvent:
    """``event`` with the pool id the caller's namespace is indexed under shown as the id
    the caller named."""
    return replace(event, ns_id=ns_id) if event.ns_id == pool_id else event


def _batch(events: list[WatchEvent]) -> pb.WatchResponse:
    return pb.WatchResponse(events=[wire.watch_event_to_pb(e) for e in events])
