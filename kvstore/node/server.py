"""The storage node: slots in memory tiers, the ``tcp://`` data port, commits to the master.

The node carries out what the pure :class:`~kvstore.core.slots.SlotTable` decides, through
the parts it composes: its :class:`~kvstore.node.tiers.Tiers` (host memory, and a GPU
tier with ``--gpu-mem``), its :class:`~kvstore.node.checks.ChunkChecks` and
:class:`~kvstore.node.scrub.Scrub`, its :class:`~kvstore.node.master_link.MasterLink`, and
:class:`~kvstore.node.puts.Puts`, the put path. The exchanges are those of
:mod:`kvstore.dataplane.messages`. Per put batch: allocate the batch's slots (REJECT when no
room), pin them, claim each chunk (or wait for the writer that is transferring it, or answer
it STORED/BUSY), receive the claimed chunks straight into slot memory, check each one
(header against the namespace, key, checksum), **commit the receipt to the master**, and
only then ack the writer. Reads pin the slots while their bytes are sent straight from slot
memory.

Tiers: puts over either transport start blocks in the fastest tier with free room
(``ucx://`` writes device memory one-sidedly; ``tcp://`` bounces through host memory), a
block lives in one tier, and blocks move between tiers outside requests (the mover:
:mod:`kvstore.node.tiers`).

Copies a chunk takes on a put over ``tcp://``: kernel socket buffer → slot (``recv_into``);
the check reads it as it arrives, from cache, and copies nothing (a block in the GPU tier:
kernel → host buffer → device). Get: slot → kernel (``sendall`` on a view of the slot; from
the GPU tier through one host copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvstore.control.client import MasterClient
from kvstore.control.records import BlockAdd, ObjectAdd
from kvstore.control.tls import data_context
from kvstore.core.codec import chunk_nbytes
from kvstore.core.hashing import Namespace
from kvstore.core.slots import Lease, ObjectStore, Slot, SlotKey
from kvstore.core.tenancy import TenantScope
from kvstore.dataplane.handshake import (
    OPEN,
    Peer,
    RoleForbidden,
    TicketSource,
    accept,
    check_allowed,
    ticket_root,
)
from kvstore.dataplane.messages import (
    MAX_KEY_LEN,
    REQUESTS,
    SEND,
    Ack,
    ChunkRef,
    Data,
    Error,
    Evict,
    Evicted,
    Found,
    Get,
    GetObject,
    Held,
    Hold,
    Leased,
    Message,
    NodeStats,
    Put,
    PutObject,
    Ready,
    Release,
    Removed,
    RemoveObject,
    Report,
    Reported,
    Stats,
    Unheld,
    Unhold,
    expect,
    parse_request,
)
from kvstore.dataplane.messages import (
    Lease as LeaseRequest,
)
from kvstore.errors import (
    CapacityError,
    ChunkError,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    MasterUnreachable,
    NodeIdTaken,
    PermissionDenied,
    ProtocolError,
    TransportError,
    Unreachable,
)
from kvstore.metrics import Metrics
from kvstore.node.checks import ChunkChecks, LandedChunk
from kvstore.node.config import NodeConfig
from kvstore.node.disk import DiskStore
from kvstore.node.disk_lz4 import MIN_PROBE_DISK, PROBE_BYTES, Lz4Policy, measure_decompress
from kvstore.node.disk_tier import DiskTier
from kvstore.node.master_link import MasterLink, NodeIdentity
from kvstore.node.migrate import Migration
from kvstore.node.puts import Puts
from kvstore.node.scrub import Scrub
from kvstore.node.tiers import Tiers, host_copy, tier_stats
from kvstore.transport import FrameLimits, listen
from kvstore.transport.base import Connection, Listener
from kvstore.transport.nixl import NixlAgent

__all__ = ["NodeConfig", "StorageNode"]

logger = logging.getLogger("kvstore.node")

_MAX_NAMESPACES = 1024
_UCX_OPS = frozenset({"reserve", "write", "lease"})
"""Requests of the ``ucx://`` exchanges (control over this port, bytes one-sided)."""
_MAX_HOLDS = 65536
_MAX_MOVES_PER_WAKE = 256


@dataclass
class _Hold:
    tenant: str
    """Whose hold it is: only that tenant's connections (or an admin's) may release it."""
    leases: list[Lease[Slot]] = field(default_factory=list)


class StorageNode:
    """One storage node. ``await start()`` opens the data port and registers; ``stop()``
    drains. Owned by one event loop; heartbeats run on a thread of their own."""

    def __init__(
        self,
        config: NodeConfig,
        metrics: Metrics | None = None,
        *,
        master: MasterClient | None = None,
    ) -> None:
        if config.transport not in ("tcp", "ucx"):
            raise InvalidArgument(f"transport must be 'tcp' or 'ucx', got {config.transport!r}")
        if config.host_mem <= 0:
            raise InvalidArgument("--host-mem must be positive")
        if config.gpu_mem < 0:
            raise InvalidArgument("--gpu-mem must not be negative")
        if config.scrub_bytes < 0:
            raise InvalidArgument("scrub_bytes must not be negative")
        if config.disk_path and config.disk_size <= 0:
            raise InvalidArgument("--disk-path needs --disk-size (the bytes the tier may use)")
        self.config = config
        on_disk = DiskStore.owner_of(config.disk_path) if config.disk_path else None
        self.node_id = config.node_id or on_disk or f"node-{uuid.uuid4().hex[:8]}"
        """With a disk tier and no ``node_id``, the id the disk was written by: a node
        restarted on its disk is the same node."""
        self.metrics = metrics or Metrics()
        self.tiers = Tiers(
            config.host_mem,
            config.gpu_mem,
            config.gpu_device,
            self.metrics,
            huge_pages=config.huge_pages,
        )
        """Fastest first: ``[gpu, host]`` with ``--gpu-mem``, else ``[host]``."""
        self._prefault_stop = threading.Event()
        self._prefault = threading.Thread(
            target=self._populate_host, name="kvstore-node-prefault", daemon=True
        )
        self.host_mapping = "off"
        """``mapping`` while the node maps its host memory at start (``prefault_memory``;
        over ``ucx`` once its NIXL agent registered the memory), ``mapped`` once it did,
        ``off`` where it does not (an old kernel; ``--prefault-memory false``): pages are
        then mapped as puts first write them."""
        self.host_mapped_bytes = 0
        """Host memory mapped so far by that start-up mapping."""
        self.host_huge_bytes = 0
        """Host memory on huge pages once that mapping ended (``huge_pages``)."""
        self.objects = ObjectStore(
            self.tiers.host.arena,
            max_object_bytes=config.max_object_bytes,
            make_room=self.tiers.host.table.evict_lru,
        )
        self.checks = ChunkChecks()
        self.scrub = Scrub(
            self.checks, self.tiers, self._drop, config.scrub_bytes, busy=lambda: self._serving > 0
        )
        self.link = MasterLink(
            master
            if master is not None
            else MasterClient(config.master, token=config.token, tls=config.tls),
            config.master,
            self.tiers,
            self.objects,
            self.metrics,
        )
        self._namespaces: dict[bytes, tuple[Namespace, int]] = {}
        """Pool id (:mod:`kvstore.core.tenancy`) -> the namespace, its id the pool id, and
        its chunk size."""
        self._ns_by_raw: dict[tuple[bytes, str], tuple[Namespace, int]] = {}
        self.tenancy = TenantScope(config.token or None)
        self._tenant_of: dict[bytes, str] = {}
        """Pool id -> its tenant (what a drain's copies say they store for)."""
        self.puts = Puts(
            self.tiers, self.checks, self.scrub, self.link, self.metrics, config.io_timeout_s
        )
        self.migration = Migration(
            self.node_id, self.tiers, self.link.master, self._namespaces.get, self.checks,
            self._drop, config.io_timeout_s, tenant_of=self._tenant_of_pool,
        )  # fmt: skip
        self.puts.owner_of = self._tenant_of_pool
        self.link.on_draining = self._on_draining
        self.link.on_quotas = self._on_quotas
        self._quotas: dict[str, int] = {}
        """This node's byte quota by tenant, as the master's last heartbeat answer said."""
        self._evictions_seen: dict[str, int] = {}
        self._tenant_labels: set[str] = set()
        self._leaving = False
        """Set by :meth:`drain_and_wait` (SIGTERM with ``--drain-on-exit``): the drain goes
        on whatever an older heartbeat answer says."""
        self._serving = 0
        """Exchanges being served now (the scrub gives way to them)."""
        self._readds: list[BlockAdd] = []
        """What is left of blocks a dropped chunk was taken from, for the next commit."""
        self._holds: dict[str, _Hold] = {}
        self._hold_ids = itertools.count(1)
        self._listener: Listener | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._move_wanted = asyncio.Event()
        self.disk: DiskTier | None = None
        self._closing = False
        self._nixl: NixlAgent | None = None
        self.notifications = 0
        """NIXL notifications peers sent, read and let go by the sweep (a client's warm-up
        sends one: see :meth:`_drain_notifications`)."""
        self._nixl_metadata = b""
        self.data_uri = ""
        self._ticket_root = ticket_root(config.token) if config.token else None
        if config.token:
            self.migration.tickets = TicketSource.of_secret(config.token)
        self.migration.ssl_context = data_context(config.tls)

    # ------------------------------------------------------------------ lifecycle

    def _populate_host(self) -> None:
        """Thread: map host memory's pages now, off the puts' path (``Arena.populate``), at
        the lowest CPU priority: on a busy machine the heartbeats and the first exchanges
        come first (a node whose heartbeats wait past half a lease is suspect)."""
        with contextlib.suppress(OSError, AttributeError):  # (not Linux: no thread nice)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        t0 = time.perf_counter()
        try:
            done = self.tiers.host.arena.populate(self._prefault_stop, self._mapped)
        except OSError as exc:
            self.host_mapping = "off"
            logger.warning("host memory is mapped as puts first write it: %s", exc)
            return
        mapped = done and not self._prefault_stop.is_set()
        self.host_huge_bytes = self.tiers.host.arena.huge_page_bytes()  # (before "mapped")
        self.host_mapping = "mapped" if mapped else "off"
        logger.info(
            "host memory: %d MiB mapped in %.2f s, %d MiB of it on huge pages",
            done >> 20,
            time.perf_counter() - t0,
            self.host_huge_bytes >> 20,
        )

    def _mapped(self, done: int) -> None:
        self.host_mapped_bytes = done

    async def start(self) -> None:
        """Open the data port, register with the master, start heartbeats and the sweeper.

        Raises :class:`InvalidArgument` when the port cannot be bound and what the master
        client raises when the master does not answer.
        """
        cfg = self.config
        if cfg.prefault_memory and cfg.transport != "ucx":
            self.host_mapping = "mapping"
            self._prefault.start()
        scheme, tls_opts = ("tls", {"ssl_context": cfg.data_tls}) if cfg.data_tls else ("tcp", {})
        self._listener = listen(
            f"{scheme}://{cfg.host}:{cfg.data_port}",
            self._serve,
            limits=FrameLimits(max_header_bytes=cfg.max_header_bytes),
            max_connections=cfg.max_connections,
            idle_timeout=cfg.idle_timeout_s,
            header_timeout=cfg.header_timeout_s,
            refusal=lambda exc: Error.of(exc).header(),
            **tls_opts,
        )
        await self._listener.start()
        self.data_uri = self.migration.own_uri = self._listener.address
        if cfg.transport == "ucx":
            await self._start_nixl()
            if cfg.prefault_memory:
                # Only now: UCX hooks the process's memory calls as it starts (a madvise
                # beside its start crashed once). Its registration maps the pages only where
                # it pins them for a NIC; over shared memory or TCP a writer's first WRITE
                # into each page faulted it in (docs/decisions.md).
                self.host_mapping = "mapping"
                self._prefault.start()
        await self._when_master_answers(self._check_master_authenticates)
        if cfg.disk_path:
            await self._open_disk()
        await self._when_master_answers(self._first_registration)
        self._refresh_usage()
        self.link.start_heartbeats(self.node_id, asyncio.get_running_loop())
        self._tasks.append(asyncio.create_task(self._sweeper(), name="kvstore-node-sweeper"))
        self._tasks.append(asyncio.create_task(self.scrub.run(), name="kvstore-node-scrub"))
        self._tasks.append(asyncio.create_task(self.migration.run(), name="kvstore-node-drain"))
        if len(self.tiers) > 1 or self.disk is not None:
            self.tiers.movable = lambda slot: not self.scrub.holds(slot)
        if len(self.tiers) > 1:
            self.tiers.wake = self._move_wanted.set
            self._tasks.append(asyncio.create_task(self._mover(), name="kvstore-node-mover"))
        if self.disk is not None:
            self._tasks.append(asyncio.create_task(self.disk.run(), name="kvstore-node-disk"))

    async def _open_disk(self) -> None:
        """Open the disk tier (on a thread: it scans what an earlier run left), adopting
        every intact block; the registration that follows reports them."""
        cfg = self.config
        t0 = time.perf_counter()
        store = await asyncio.to_thread(
            DiskStore.open, cfg.disk_path, cfg.disk_size, node_id=self.node_id,
            secret=cfg.token, direct=cfg.disk_direct,
        )  # fmt: skip
        lz4 = await asyncio.to_thread(self._lz4_policy, store)
        self.disk = DiskTier(store, self.tiers, self.metrics, lz4)
        for raw, tenant in list(store.namespaces.values()):
            try:
                self._namespace(raw, tenant)
            except KVStoreError as exc:  # (one the node cannot parse: learnt from puts again)
                logger.warning("disk tier: a saved namespace is unusable: %s", exc)
        logger.info(
            "disk tier %s: %d blocks in %d segments adopted in %.2f s (O_DIRECT %s, %d torn "
            "bytes dropped; lz4 %s)", cfg.disk_path, len(store), store.segments,
            time.perf_counter() - t0, "on" if store.direct else "off", store.dropped_tail_bytes,
            lz4.describe(),
        )  # fmt: skip

    def _lz4_policy(self, store: DiskStore) -> Lz4Policy:
        """Worker thread: the disk tier's lz4 policy, with the measurements ``auto`` rests
        on (a disk too small for the read probe is not measured: nothing is packed)."""
        mode = self.config.disk_compress
        if mode != "auto" or store.capacity < MIN_PROBE_DISK:
            return Lz4Policy(mode)
        try:
            disk = store.measure_read(PROBE_BYTES)
        except OSError as exc:
            logger.warning("disk tier: cannot measure the disk's read speed (%s); no lz4", exc)
            return Lz4Policy(mode)
        return Lz4Policy(mode, disk, measure_decompress())

    async def _check_master_authenticates(self) -> None:
        """A node with the cluster secret authenticates its data port, so its clients need
        tickets: refuse (InvalidArgument) a master that issues none, which has no auth file
        (the node role may not ask an auth-file master for one: PermissionDenied, fine)."""
        if self._ticket_root is None:
            return
        try:
            ticket = await self.link.master.data_ticket()
        except (PermissionDenied, ProtocolError):  # (secured; or too old to say)
            return
        if ticket is None:
            raise InvalidArgument(
                "this node has a cluster secret (--auth-file) but its master has no auth "
                "file: clients would get no tickets and this node would refuse every data "
                "connection; give the master the same --auth-file"
            )

    async def _first_registration(self) -> None:
        await self.link.register(self._identity())

    async def _when_master_answers(self, step: Callable[[], Awaitable[None]]) -> None:
        """Run ``step`` (a call to the master), again while the master does not answer (it
        starts after this node, or is restarting) or while another process's live
        registration holds this node id (this node restarted within its old lease), for at
        most ``register_wait_s``; then its error is raised. Said once in the log for each
        reason."""
        deadline = time.monotonic() + self.config.register_wait_s
        warned: set[type[Exception]] = set()
        while True:
            try:
                await step()
                return
            except (NodeIdTaken, Unreachable, KVTimeout) as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if type(exc) not in warned:
                    logger.warning("%s; waiting up to %.0f s more", exc, left)
                    warned.add(type(exc))
                await asyncio.sleep(min(0.5, left))

    def _identity(self) -> NodeIdentity:
        cfg = self.config
        return NodeIdentity(
            self.node_id, self.data_uri, cfg.transport, self._nixl_metadata, cfg.host
        )

    async def _start_nixl(self) -> None:
        """Create the node's NIXL agent (event-driven progress thread: a target must make
        progress or peers cannot connect) and register every tier's arena once (host
        memory as DRAM, the GPU tier as VRAM)."""
        self._nixl = NixlAgent(
            f"{self.node_id}-{uuid.uuid4().hex[:8]}", host=self.config.host, progress_thread=True
        )
        await self._nixl.start()
        for tier in self.tiers:
            tier.reg = await self._nixl.register(tier.arena.tensor)
        self._nixl_metadata = await self._nixl.metadata()

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, let exchanges in flight finish within ``grace``, release holds."""
        if self._closing:
            return
        self._closing = True
        self._prefault_stop.set()
        if self._prefault.is_alive():
            await asyncio.to_thread(self._prefault.join, 5.0)
        if self._listener is not None:
            await self._listener.stop(grace)
        if self.disk is not None:  # blocks waiting for the disk: kept across the restart
            await self.disk.flush(grace)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.puts.close()
        await self.link.deregister()
        if self.disk is not None:
            await asyncio.to_thread(self.disk.close)
        for hold in self._holds.values():
            for lease in hold.leases:
                lease.release()
        self._holds.clear()
        await self.link.close()
        if self._nixl is not None:
            await self._nixl.close()
        self.checks.close()

    def _on_draining(self, draining: bool) -> None:
        """The master's draining mark (from a heartbeat's answer): copy blocks away while
        set, and grant no writer a slot for its next layer here."""
        if self._leaving and not draining:
            return
        self.migration.set_draining(draining)
        self.puts.granting = not draining
        self.tiers.promoting = not draining

    async def drain_and_wait(self, timeout_s: float) -> dict[str, int | str]:
        """Mark this node draining at the master, copy every block away (at most
        ``timeout_s``) and return the progress counters (``drain_state`` ``done`` when
        nothing was left). What the node does on SIGTERM with ``--drain-on-exit``; the
        caller then stops it."""
        self._leaving = True
        try:
            await self.link.master.drain(self.node_id, timeout=self.config.io_timeout_s)
        except KVStoreError as exc:  # copy anyway: the writers' next snapshot may lag
            logger.warning("drain mark not set at the master: %s", exc)
        self._on_draining(True)
        await self.migration.settled(timeout_s)
        return self.migration.counters()

    @property
    def pinned_slots(self) -> int:
        """Slots pinned right now (0 when idle: anything else is a leak)."""
        return sum(t.table.stats().pinned_slots for t in self.tiers)

    async def _sweeper(self) -> None:
        """Expire leases and holds, report evictions, refresh gauges, re-register."""
        reregister = self.link.reregister
        while True:
            try:
                await asyncio.wait_for(reregister.wait(), self.config.sweep_s)
            except TimeoutError:
                pass
            try:
                if reregister.is_set():
                    reregister.clear()
                    await self.link.register(self._identity())
                now = time.monotonic()
                for tier in self.tiers:
                    tier.table.expire_leases(now)
                self.objects.expire_leases(now)
                for hid in [h for h, v in self._holds.items() if all(x.released for x in v.leases)]:
                    del self._holds[hid]
                await self.link.commit(self._take_readds())
                self._refresh_usage()
                await self._drain_notifications()
            except KVStoreError as exc:
                logger.warning("node sweep: %s", exc)

    async def _drain_notifications(self) -> None:
        """Read and let go of the NIXL notifications peers sent. A client's warm-up sends
        one to each ``ucx`` node, so that UCX sets its endpoint up before the first
        transfer; nothing here waits for them, and NIXL keeps each until it is read."""
        if self._nixl is not None:
            got = await self._nixl.poll_notifs()
            self.notifications += sum(len(v) for v in got.values())

    async def _mover(self) -> None:
        """Move blocks between the tiers (:meth:`Tiers.move_one`) between requests: woken
        when a put leaves the GPU tier short of free room or a read hits host memory, and
        every sweep period in any case; yields to the loop after each move."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._move_wanted.wait(), self.config.sweep_s)
            self._move_wanted.clear()
            for _ in range(_MAX_MOVES_PER_WAKE):  # bounded: the next wake goes on
                try:
                    if not self.tiers.move_one():
                        break
                except Exception:  # a bug must not end the moves for good: log, go on
                    logger.exception("moving a block between tiers failed")
                    break
                await asyncio.sleep(0)

    def _on_quotas(self, quotas: dict[str, int]) -> None:
        if quotas != self._quotas:
            self._quotas = quotas
            self.tiers.set_quotas(quotas)
            for tenant, quota in quotas.items():
                self.metrics.tenant_quota_bytes.labels(tenant=tenant).set(quota)

    def _refresh_tenants(self) -> None:
        """Per-tenant bytes and evictions: for the next heartbeat and the metrics."""
        held, evicted = self.tiers.tenant_bytes(), self.tiers.tenant_evictions()
        held.pop("", None), evicted.pop("", None)
        self.link.tenant_bytes, self.link.tenant_evictions = held, evicted
        for tenant in set(held) | self._tenant_labels:  # (a tenant gone to 0 says 0)
            self.metrics.tenant_bytes.labels(tenant=tenant).set(held.get(tenant, 0))
        self._tenant_labels |= set(held)
        for tenant, n in evicted.items():
            new = n - self._evictions_seen.get(tenant, 0)
            if new > 0:
                self.metrics.tenant_evictions.labels(tenant=tenant).inc(new)
        self._evictions_seen = {**self._evictions_seen, **evicted}

    def _refresh_usage(self) -> None:
        self._refresh_tenants()
        self.link.usage = self.tiers.usage()
        self.link.counters = {
            k: v
            for k, v in self._stats().counters.items()
            if type(v) is int and v >= 0 and k != "epoch"
        }
        g = self.metrics.pool_bytes
        blocks = 0
        for tier in self.tiers:
            st = tier.table.stats()
            g.labels(tier=tier.name, state="free").set(st.free_bytes)
            g.labels(tier=tier.name, state="used").set(st.used_bytes)
            g.labels(tier=tier.name, state="pinned").set(st.pinned_bytes)
            blocks += st.slots
        if self.disk is not None:
            store = self.disk.store
            g.labels(tier="disk", state="used").set(store.live_bytes)
            g.labels(tier="disk", state="free").set(store.capacity - store.live_bytes)
        self.metrics.blocks.labels(role="node").set(blocks)

    # ------------------------------------------------------------------ data plane

    async def _serve(self, conn: Connection) -> None:
        """One client connection: the handshake (with a cluster secret), then exchanges one
        after another until it closes."""
        peer = OPEN
        if self._ticket_root is not None:
            try:
                peer = await accept(conn, self._ticket_root, self.config.io_timeout_s)
            except (KVStoreError, OSError) as exc:
                self._count_error({}, "unauthorized")
                logger.info("connection %s refused: %s", conn.peer, exc)
                await conn.close()
                return
        while not conn.closed:
            try:
                frame = await conn.recv_header(timeout=None)
            except TransportError:
                return
            try:
                request = parse_request(frame.header)
                check_allowed(peer, frame.header["op"])
                if frame.sizes and not (isinstance(request, Put) and not request.ucx):
                    raise ProtocolError(f"op {frame.header.get('op')!r} carries no payload")
                self._serving += 1
                try:
                    await self._handle(conn, self._scoped(peer, request), frame.sizes, peer)
                finally:
                    self._serving -= 1
            except (
                InvalidArgument,
                CapacityError,
                ProtocolError,
                ChunkError,
                RoleForbidden,
                MasterUnreachable,
            ) as exc:
                # The request was refused before any payload moved, or its commit failed
                # after all of it had: the stream is intact.
                self._count_error(frame.header, Error.of(exc).code)
                if conn.closed:
                    return
                await conn.discard_payload(self.config.io_timeout_s)
                await self._send(conn, Error.of(exc))
            except (TransportError, KVTimeout) as exc:
                # Mid-exchange: the stream may be unframed, so the connection goes.
                reason = "timeout" if isinstance(exc, KVTimeout) else "dropped"
                self._count_error(frame.header, reason)
                logger.info("connection %s dropped: %s", conn.peer, exc)
                await conn.close()
                return

    def _count_error(self, header: dict[str, Any], reason: str) -> None:
        """Count an exchange that failed, by its op (``other`` for an unknown one)."""
        op = header.get("op")
        op = op if isinstance(op, str) and op in REQUESTS else "other"
        transport = "ucx" if op in _UCX_OPS else "tcp"
        self.metrics.transfer_errors.labels(op=op, transport=transport, reason=reason).inc()

    def _tenant_of_pool(self, pool_id: bytes) -> str:
        """The tenant whose namespace ``pool_id`` is (``""``: none)."""
        return self._tenant_of.get(pool_id, "")

    def _scoped(self, peer: Peer, request: Message) -> Message:
        """``request`` with the names it carries scoped by the connection's tenant (namespace
        ids to pool ids, object keys to the tenant's; :mod:`kvstore.core.tenancy`). A node or
        an admin may name the tenant (a drain's copies, ``kvctl evict --tenant``); a client
        that names another than its own is refused (RoleForbidden), and so is a request
        that names a tenant where the pool has none (InvalidArgument)."""
        tenancy = self.tenancy
        named = getattr(request, "tenant", "")
        if not tenancy.enabled:
            if named:  # (else it would act on the untenanted namespace of that id)
                raise InvalidArgument(
                    f"{request.OP} names tenant {named!r}, but this pool has no tenants "
                    "(its nodes run without an auth file)"
                )
            return request
        tenant = peer.tenant
        if named and named != tenant:
            if peer.role == "client":
                raise RoleForbidden(f"{request.OP}: a client names no tenant but its own")
            tenant = named
        match request:
            case Put():
                return replace(request, tenant=tenant)
            case Get() | LeaseRequest() | Hold() | Report() | Evict():
                return replace(request, ns_id=tenancy.pool_id(tenant, request.ns_id))
            case PutObject() | GetObject() | RemoveObject():
                key = tenancy.object_key(tenant, request.key)
                if len(key.encode()) > MAX_KEY_LEN:  # (the master refuses longer keys)
                    room = MAX_KEY_LEN - len(tenancy.object_key(tenant, "").encode())
                    raise InvalidArgument(f"a tenant's object key is at most {room} bytes")
                return replace(request, key=key)
        return request

    async def _handle(
        self, conn: Connection, request: Message, sizes: list[int], peer: Peer = OPEN
    ) -> None:
        match request:
            case Put():
                known = self._namespace(request.ns, request.tenant)
                await self.puts.serve(conn, request, sizes, *known)
            case Get():
                await self._on_get(conn, request)
            case LeaseRequest():
                await self._on_lease(conn, request)
            case Hold():
                await self._send(conn, self._on_hold(request, peer.tenant))
            case Unhold():
                hold = self._holds.get(request.hold_id)
                if hold is not None and peer.role == "client" and hold.tenant != peer.tenant:
                    hold = None  # another tenant's hold: as if there were none
                if hold is not None:
                    del self._holds[request.hold_id]
                for lease in hold.leases if hold else []:
                    lease.release()
                await self._send(conn, Unheld(hold is not None))
            case PutObject():
                await self._on_put_object(conn, request)
            case GetObject():
                await self._on_get_object(conn, request)
            case RemoveObject():
                await self._send(conn, await self._on_remove_object(request))
            case Evict():
                await self._send(conn, await self._on_evict(request))
            case Report():
                await self._send(conn, await self._on_report(conn.peer, request))
            case Stats():
                await self._send(conn, self._stats(peer))
            case _:  # a request type REQUESTS names but no case here serves: a bug
                raise ProtocolError(f"op {request.OP!r} is not served here")

    async def _send(self, conn: Connection, message: Message, buffers: Any = ()) -> None:
        await conn.send(message.header(), buffers, timeout=self.config.io_timeout_s)

    def _namespace(self, raw: bytes, tenant: str) -> tuple[Namespace, int]:
        """The namespace a put of ``tenant`` names, under its pool id, and its chunk size
        (parsed once per namespace and tenant)."""
        seen = self._ns_by_raw.get((raw, tenant))
        if seen is not None:
            return seen
        ns = Namespace.from_canonical_bytes(raw)
        pool_id = self.tenancy.pool_id(tenant, ns.id)
        known = self._namespaces.get(pool_id)
        if known is None:
            if len(self._namespaces) >= _MAX_NAMESPACES:
                raise CapacityError(f"node serves at most {_MAX_NAMESPACES} namespaces")
            size = chunk_nbytes(ns.block_tokens, ns.num_kv_heads, ns.head_dim, ns.dtype, ns.quant)
            known = self._namespaces[pool_id] = (ns.with_id(pool_id), size)
            if tenant:
                self._tenant_of[pool_id] = tenant
            if self.disk is not None:
                self.disk.note_namespace(pool_id, raw, tenant)
        self._ns_by_raw[(raw, tenant)] = known
        return known

    # ------------------------------------------------------------------ put

    # ------------------------------------------------------------------ reads

    async def _stage(
        self, ns_id: bytes, chunks: tuple[ChunkRef, ...], leases: list[Lease[Slot]]
    ) -> set[SlotKey]:
        """Bring the requested blocks held only on disk into host memory (pinned: their
        leases join ``leases``); the keys staged cold, which the read must not touch."""
        if self.disk is None:
            return set()
        staged, cold = await self.disk.stage([(ns_id, ref.block) for ref in chunks])
        leases.extend(staged)
        return cold

    def _find(
        self,
        ns_id: bytes,
        chunks: tuple[ChunkRef, ...],
        leases: list[Lease[Slot]],
        ttl_s: float | None = None,
        cold: AbstractSet[SlotKey] = frozenset(),
    ) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        """Pin every requested chunk that is here; (found flags, their chunk views). Keys
        in ``cold`` (staged up from disk for this read) are not marked used."""
        views: list[torch.Tensor] = []
        found: list[int] = []
        keys: dict[str, list[SlotKey]] = {}
        for ref in chunks:
            key = (ns_id, ref.block)
            held = self.tiers.lookup(key)
            if (
                held is None
                or not 0 <= ref.chunk < held[1].num_chunks
                or not (held[1].landed_mask >> ref.chunk & 1)
            ):
                found.append(0)
                self.metrics.stale_misses.inc()
                continue
            tier, slot = held
            leases.append(tier.table.pin(slot, ttl_s=ttl_s))
            views.append(tier.table.chunk_view(slot, ref.chunk))
            found.append(1)
            if key not in cold:
                keys.setdefault(tier.name, []).append(key)
        for tier in self.tiers:
            tier.table.touch(keys.get(tier.name, []))
        self.tiers.hit(keys.get(self.tiers.host.name, []))
        return tuple(found), views

    async def _on_get(self, conn: Connection, get: Get) -> None:
        leases: list[Lease[Slot]] = []
        try:
            cold = await self._stage(get.ns_id, get.chunks, leases)
            found, views = self._find(get.ns_id, get.chunks, leases, cold=cold)
            t0 = time.perf_counter()
            # The GPU tier goes out through a host copy (tcp:// sends host bytes only).
            host = self.tiers.host
            bufs = [(v if host.holds(v) else host_copy(v)).numpy() for v in views]
            await self._send(conn, Found(found), bufs)
            self.metrics.count_transfer("get", "tcp", sum(v.numel() for v in views), t0)
        finally:
            for lease in leases:
                lease.release()
            self.tiers.nudge()

    async def _on_lease(self, conn: Connection, request: LeaseRequest) -> None:
        """``ucx://`` get: pin the chunks for at most ``lease_s``, send their spans, wait
        for the reader's ``release``. The node never reuses a leased slot; a reader that
        dies lets its lease expire, one that reads late verifies key and checksum."""
        ttl = min(self.config.io_timeout_s, request.lease_s or 10.0)
        leases: list[Lease[Slot]] = []
        try:
            cold = await self._stage(request.ns_id, request.chunks, leases)
            found, views = self._find(request.ns_id, request.chunks, leases, ttl, cold)
            spans = tuple(tuple(self.tiers.span(v)) for v in views)
            t0 = time.perf_counter()
            await self._send(conn, Leased(found, spans, ttl))
            frame = await conn.recv_header(timeout=ttl)
            if frame.sizes:
                raise ProtocolError("'release' carries no payload")
            expect(frame.header, Release)
            self.metrics.count_transfer("get", "ucx", sum(v.numel() for v in views), t0)
        finally:
            for lease in leases:
                lease.release()
            self.tiers.nudge()

    def _on_hold(self, hold: Hold, tenant: str) -> Held:
        if not 0 < hold.ttl_s <= self.config.max_hold_s:
            raise InvalidArgument(f"ttl_s must lie in (0, {self.config.max_hold_s}]")
        if len(self._holds) >= _MAX_HOLDS:
            raise CapacityError("too many holds on this node")
        held = _Hold(tenant)
        for block in hold.blocks:
            found = self.tiers.lookup((hold.ns_id, block))
            if found is None:
                break
            held.leases.append(found[0].table.pin(found[1], ttl_s=hold.ttl_s))
        hold_id = f"h{next(self._hold_ids)}"
        if held.leases:
            self._holds[hold_id] = held
        return Held(hold_id, len(held.leases))

    # ------------------------------------------------------------------ objects

    async def _on_put_object(self, conn: Connection, request: PutObject) -> None:
        key, nbytes, version = request.key, request.nbytes, request.version
        timeout = self.config.io_timeout_s
        write = self.objects.put(key, nbytes, version)
        try:
            await self._send(conn, Ready((SEND,)))
            frame = await conn.recv_header(timeout=timeout)
            expect(frame.header, Data)
            if frame.sizes != [nbytes]:
                raise ProtocolError("object data frame does not match the announced size")
            await conn.recv_payload_into([write.view.numpy()], timeout)
        except BaseException:
            write.abort()
            raise
        if write.commit():  # (else a newer value of the key stands, committed already)
            await self.link.commit([], object_adds=[ObjectAdd(key, nbytes, version)])
        self.metrics.transfer_bytes.labels(op="put", transport="tcp").inc(nbytes)
        await self._send(conn, Ack(1))

    async def _on_get_object(self, conn: Connection, request: GetObject) -> None:
        with self.objects.pinned(request.key) as view:
            bufs = [] if view is None else [view.numpy()]
            await self._send(conn, Found((1 if bufs else 0,)), bufs)
        self.metrics.transfer_bytes.labels(op="get", transport="tcp").inc(
            sum(b.nbytes for b in bufs)
        )

    async def _on_remove_object(self, request: RemoveObject) -> Removed:
        removed = self.objects.remove(request.key)
        if removed:
            await self.link.commit([], object_removes=[request.key])
        return Removed(removed)

    # ------------------------------------------------------------------ operations

    async def _on_evict(self, request: Evict) -> Evicted:
        """An operator's eviction: the listed blocks of a namespace, or all of it. Pinned
        or quarantined slots stay (counted); the evictions are committed to the master
        before the answer, like every other change of this node's index entries."""
        ns_id = request.ns_id
        if request.blocks is None:
            candidates = [s.key for t in self.tiers for s in t.table.slots() if s.key[0] == ns_id]
        else:
            candidates = [(ns_id, b) for b in request.blocks]
        present = [(held[0], key) for key in candidates if (held := self.tiers.lookup(key))]
        gone = [(tier, key) for tier, key in present if tier.table.evict(key)]
        for tier, key in gone:
            self.tiers.evicted(tier, [key])
        kept = len(present) - len(gone)
        if self.disk is not None:  # a block kept in memory (pinned) keeps its disk copy
            stay = {key for _, key in present} - {key for _, key in gone}
            if request.blocks is None:
                candidates = self.disk.keys_of(ns_id)
            on_disk = [k for k in candidates if k not in stay and k in self.disk.store]
            self.disk.remove(on_disk)
            only_disk = [k for k in on_disk if k not in {key for _, key in gone}]
            self.tiers.evicted_from(self.disk.name, only_disk)
            gone += [(self.tiers.host, k) for k in only_disk]
        await self.link.commit([])
        return Evicted(len(gone), kept)

    async def _on_report(self, peer: str, report: Report) -> Reported:
        """A reader says chunks it got from here failed verification. The node checks each
        itself (a report alone never drops anything) and drops a bad one: the whole slot
        when no one has it pinned (reported to the master as an eviction), else just that
        chunk, so its next writer stores it again."""
        known = self._namespaces.get(report.ns_id)
        dropped = 0
        for ref in report.chunks:
            key = (report.ns_id, ref.block)
            held = self.tiers.lookup(key)
            if known is None or held is None:
                continue
            (ns, _), (tier, slot) = known, held
            if not 0 <= ref.chunk < slot.num_chunks or not slot.landed_mask >> ref.chunk & 1:
                continue
            view = tier.table.chunk_view(slot, ref.chunk)
            if not self.checks.check(peer, ns, [LandedChunk(0, ref.block, ref.chunk, view)]):
                continue
            dropped += 1
            self._drop(slot, ref.chunk)
        if dropped:
            await self.link.commit(self._take_readds())
        return Reported(dropped)

    def _drop(self, slot: Slot, index: int) -> None:
        """Drop chunk ``index`` of ``slot``, found bad after it was stored: the whole slot
        when nobody has it pinned (reported with the next commit), else that chunk, so its
        next writer stores it again."""
        tier = self.tiers.owner(slot)
        if tier is None or not slot.alive or slot.quarantined:
            return
        if self.disk is not None:  # its disk copy came from the same bytes
            self.disk.remove([slot.key])
        if not tier.table.evict(slot.key):
            # Pinned: keep the slot, drop the chunk. The index learns by the block's removal
            # and the re-add of what is left, in that order (a commit applies removals first).
            tier.table.drop_chunk(slot, index)
            self._readds.append(self.tiers.add_of(slot, tier=tier))
        self.tiers.evicted(tier, [slot.key])

    def _tenant_stats(self, peer: Peer) -> list[dict[str, Any]]:
        held, evicted = self.tiers.tenant_bytes(), self.tiers.tenant_evictions()
        names = sorted((set(held) | set(evicted) | set(self._quotas)) - {""})
        if peer.role == "client":
            names = [t for t in names if t == peer.tenant]
        return [
            {"tenant": t, "used_bytes": held.get(t, 0), "quota_bytes": self._quotas.get(t, 0),
             "evictions": evicted.get(t, 0)}
            for t in names
        ]  # fmt: skip

    def _take_readds(self) -> list[BlockAdd]:
        readds, self._readds = self._readds, []
        return [a for a in readds if a.chunks]

    def _stats(self, peer: Peer = OPEN) -> NodeStats:
        """The node's counters; a client's connection sees its own tenant's usage only."""
        stats = [(t.name, t.table.stats()) for t in self.tiers]
        return NodeStats(
            {
                "node_id": self.node_id,
                "epoch": self.link.epoch,
                "slots": sum(st.slots for _, st in stats),
                "pinned_slots": sum(st.pinned_slots for _, st in stats),
                "leases": sum(st.leases for _, st in stats),
                "holds": len(self._holds),
                "inflight": self.puts.inflight,
                "grants": self.puts.grants,
                "scrub_pending": self.scrub.pending,
                "scrubbed": self.scrub.scrubbed,
                "scrub_dropped": self.scrub.dropped,
                "scrub_cpu_us": round(self.scrub.cpu_s * 1e6),
                "notifications": self.notifications,
                "objects": len(self.objects),
                "capacity_bytes": sum(st.capacity_bytes for _, st in stats),
                "used_bytes": sum(st.used_bytes for _, st in stats),
                "host_mapping": self.host_mapping,
                "host_mapped_bytes": self.host_mapped_bytes,
                "host_huge_bytes": self.host_huge_bytes,
                "tiers": [tier_stats(name, st) for name, st in stats]
                + ([self.disk.stats()] if self.disk is not None else []),
                "tenants": self._tenant_stats(peer),
                **self.migration.counters(),
            }
        )
