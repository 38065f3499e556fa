"""The storage node: slots in memory tiers, the ``tcp://`` data port, commits to the master.

The node carries out what the pure :class:`~kvstore.core.slots.SlotTable` decides. Per
put batch (see :mod:`kvstore.node.protocol`): allocate the batch's slots (REJECT when no
room), pin them, answer READY with the chunks to send, receive them straight into slot
memory, verify each chunk's header, key and checksum, **commit the receipt to the master**
(one RPC with epoch and sequence number, evictions first), and only then ack the writer.
Reads pin the slots while their bytes are sent straight from slot memory.

Tiers: host memory always; with ``--gpu-mem`` a GPU tier first, where ``ucx://`` puts land
(one-sided writes into device memory) and whose LRU victims move to host memory. A block
lives in one tier; ``tcp://`` puts start blocks in host memory (docs/decisions.md).

Copies a chunk takes on a put over ``tcp://``: kernel socket buffer → slot (``recv_into``);
the node's checksum pass reads it as it arrives, from cache, and copies nothing (a block
in the GPU tier: kernel → host buffer → device). Get: slot → kernel (``sendall`` on a view
of the slot; from the GPU tier through one host copy).

Heartbeats run on their own thread with their own gRPC channel, so a busy event loop never
costs the node its lease.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from kvstore import __version__
from kvstore.core.arena import Arena
from kvstore.core.codec import ChunkKey, ChunkSpec, ChunkVerifier, chunk_nbytes, verify_chunk
from kvstore.core.hashing import Namespace
from kvstore.core.slots import Lease, ObjectStore, Slot, SlotKey, SlotTable, TierStats
from kvstore.errors import (
    BadShape,
    CapacityError,
    ChunkError,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    ProtocolError,
    StaleEpoch,
    TransportError,
)
from kvstore.master import wire
from kvstore.master.client import MasterClient
from kvstore.master.records import BlockAdd, BlockRef, CommitBatch, ObjectAdd, Tier
from kvstore.metrics import Metrics
from kvstore.node.protocol import (
    BUSY,
    MAX_CHUNKS_PER_REQUEST,
    MAX_KEY_LEN,
    SEND,
    STORED,
    error_header,
    hex16,
    require,
)
from kvstore.transport import listen
from kvstore.transport.base import Connection, Listener
from kvstore.transport.nixl import NixlAgent, Registration
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

__all__ = ["NodeConfig", "StorageNode"]

logger = logging.getLogger("kvstore.node")

_MAX_NAMESPACES = 1024
_MAX_HOLDS = 65536
_MAX_VERIFY_THREADS = 4
_INLINE_VERIFY_BYTES = 32 * 2**20
"""``ucx://`` batches up to this size are verified on the loop (at most ~5 ms of it here):
measured faster than the verifier threads up to 32 MiB, slower at 256 MiB
(docs/decisions.md)."""


@dataclass(frozen=True)
class NodeConfig:
    """A storage node's settings (validated by :class:`StorageNode`)."""

    master: str
    host: str = "127.0.0.1"
    data_port: int = 50052
    node_id: str = ""
    host_mem: int = 512 * 2**20
    gpu_mem: int = 0
    """Bytes of the GPU tier (0: none): ``ucx://`` puts land there, in device memory."""
    gpu_device: str = "cuda"
    """The GPU tier's torch device (tests run the same code on ``"cpu"``)."""
    transport: str = "tcp"
    io_timeout_s: float = 30.0
    """Deadline of each step of a data-plane exchange (one header, one payload)."""
    max_object_bytes: int = 64 * 2**20
    max_hold_s: float = 600.0
    sweep_s: float = 0.5


@dataclass
class _Tier:
    """One memory tier of the node: its arena, its slots and its NIXL registration."""

    name: str
    arena: Arena
    table: SlotTable
    reg: Registration | None = None

    def owns(self, slot: Slot) -> bool:
        """Whether ``slot`` lives in this tier (quarantined or not)."""
        return self.table.holds(slot)

    def holds(self, view: torch.Tensor) -> bool:
        base, t = view.data_ptr(), self.arena.tensor
        return view.device == t.device and t.data_ptr() <= base < t.data_ptr() + t.numel()


@dataclass
class _Hold:
    leases: list[Lease[Slot]] = field(default_factory=list)


_Landed = tuple[int, bytes, int, torch.Tensor]
"""A chunk of a put to check: (request position, block hash, chunk index, slot view)."""


@dataclass
class _Queued:
    """One caller's share of the next Commit RPC, and the future it waits on."""

    adds: list[BlockAdd]
    object_adds: list[ObjectAdd]
    object_removes: list[str]
    done: asyncio.Future[None]

    def object_keys(self) -> set[str]:
        return {a.key for a in self.object_adds} | set(self.object_removes)


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
        self.config = config
        self.node_id = config.node_id or f"node-{uuid.uuid4().hex[:8]}"
        self.metrics = metrics or Metrics()
        self.arena = Arena(config.host_mem, device="cpu")
        self.table = SlotTable(self.arena)
        self.tiers = [_Tier("host", self.arena, self.table)]
        """Fastest first: ``[gpu, host]`` with ``--gpu-mem``, else ``[host]``."""
        if config.gpu_mem:
            gpu = Arena(config.gpu_mem, device=_gpu_device(config.gpu_device))
            self.tiers.insert(0, _Tier("gpu", gpu, SlotTable(gpu, demote=self._demote)))
        self.objects = ObjectStore(
            self.arena,
            max_object_bytes=config.max_object_bytes,
            make_room=self.table.evict_lru,
        )
        self._namespaces: dict[bytes, tuple[Namespace, int]] = {}
        self._ns_by_hex: dict[str, tuple[Namespace, int]] = {}
        self._specs: dict[bytes, ChunkSpec] = {}
        self._verify_threads = max(1, min(_MAX_VERIFY_THREADS, os.cpu_count() or 1))
        self._verifier = ThreadPoolExecutor(
            self._verify_threads, thread_name_prefix="kvstore-verify"
        )
        self._inflight: dict[tuple[SlotKey, int], asyncio.Future[None]] = {}
        """Chunks a put exchange is transferring now → resolved when that exchange ends."""
        self._unquarantine_at: dict[Slot, asyncio.TimerHandle] = {}
        self._unreported: list[tuple[str, SlotKey]] = []
        """Evictions (tier, key) not yet reported to the master."""
        self._holds: dict[str, _Hold] = {}
        self._hold_ids = itertools.count(1)
        self._master = master if master is not None else MasterClient(config.master)
        self._commit_lock = asyncio.Lock()
        self._queued: list[_Queued] = []
        self._flusher: asyncio.Task[None] | None = None
        self._epoch = 0
        self._seq = 0
        self._lease_s = 10.0
        self._listener: Listener | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._usage: list[Tier] = []
        self._reregister = asyncio.Event()
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nixl: NixlAgent | None = None
        self._nixl_metadata = b""
        self.data_uri = ""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the data port, register with the master, start heartbeats and the sweeper.

        Raises :class:`InvalidArgument` when the port cannot be bound and what the master
        client raises when the master does not answer.
        """
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._listener = listen(f"tcp://{cfg.host}:{cfg.data_port}", self._serve)
        await self._listener.start()
        self.data_uri = self._listener.address
        if cfg.transport == "ucx":
            await self._start_nixl()
        await self._register()
        self._refresh_usage()
        self._hb_thread = threading.Thread(
            target=self._heartbeat_loop, name=f"kvstore-heartbeat-{self.node_id}", daemon=True
        )
        self._hb_thread.start()
        self._tasks.append(asyncio.create_task(self._sweeper(), name="kvstore-node-sweeper"))

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
        if self._listener is not None:
            await self._listener.stop(grace)
        tasks = [*self._tasks, *([self._flusher] if self._flusher else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for timer in self._unquarantine_at.values():
            timer.cancel()
        self._unquarantine_at.clear()
        for hold in self._holds.values():
            for lease in hold.leases:
                lease.release()
        self._holds.clear()
        self._hb_stop.set()
        if self._hb_thread is not None:
            await asyncio.to_thread(self._hb_thread.join, 5.0)
        await self._master.close()
        if self._nixl is not None:
            await self._nixl.close()
        self._verifier.shutdown(wait=True)

    @property
    def pinned_slots(self) -> int:
        """Slots pinned right now (0 when idle: anything else is a leak)."""
        return sum(t.table.stats().pinned_slots for t in self.tiers)

    # ------------------------------------------------------------------ master

    def _tiers(self) -> list[Tier]:
        stats = [(t.name, t.table.stats()) for t in self.tiers]
        return [Tier(name, st.capacity_bytes, st.used_bytes) for name, st in stats]

    def _lookup(self, key: SlotKey) -> tuple[_Tier, Slot] | None:
        """The tier holding ``key``'s readable slot and the slot (None when absent or
        quarantined; a key lives in one tier at most)."""
        for tier in self.tiers:
            slot = tier.table.get(key)
            if slot is not None:
                return tier, slot
        return None

    def _holder(self, key: SlotKey) -> _Tier | None:
        """The tier holding ``key``'s slot, quarantined or not."""
        for tier in self.tiers:
            if tier.table.find(key) is not None:
                return tier
        return None

    def _owner(self, slot: Slot) -> _Tier | None:
        """The tier ``slot`` lives in (quarantined or not); None once it is gone."""
        return next((tier for tier in self.tiers if tier.owns(slot)), None)

    def _tier_of(self, slot: Slot) -> _Tier:
        if (tier := self._owner(slot)) is not None:
            return tier
        raise ProtocolError(f"slot {slot.key[1].hex()} is no longer held here")

    def _demote(self, victim: Slot) -> bool:
        """The GPU tier's LRU victim moves to host memory instead of leaving the node (one
        device → host copy of its landed chunks); False, dropping it, when host memory has
        no room or the copy fails. The master's entries stay as they are: the block is still
        on this node. Never raises (a :class:`SlotTable` demote hook)."""
        gpu, host = self.tiers[0], self.tiers[-1]
        if not victim.landed_mask:
            return False
        if host.table.find(victim.key) is not None:  # a key lives in one tier: a bug
            logger.error("slot %s is in both tiers; dropping the GPU copy", victim.key[1].hex())
            return False
        try:
            res = host.table.allocate(
                victim.key, victim.slot_bytes, victim.chunk_bytes, victim.num_chunks, victim.parent
            )
        except KVStoreError:
            return False
        self._unreported.extend((host.name, k) for k in res.evicted)
        try:
            host.table.slot_view(res.slot).copy_(gpu.table.slot_view(victim))
            for index in _bits(victim.landed_mask):
                host.table.mark_landed(res.slot, index)
        except Exception:
            logger.exception("moving slot %s to host memory failed", victim.key[1].hex())
            host.table.evict(victim.key)
            return False
        # (a dropped victim is journaled and counted with the other evictions it reports)
        self.metrics.evictions.labels(tier=gpu.name).inc()
        return True

    def _take_evictions(self) -> list[tuple[str, SlotKey]]:
        gone = [(t.name, k) for t in self.tiers for k in t.table.take_evictions()]
        gone, self._unreported = [*self._unreported, *gone], []
        return gone

    async def _register(self) -> None:
        async with self._commit_lock:
            reply = await self._master.register(
                self.node_id,
                self.data_uri,
                transport=self.config.transport,
                nixl_metadata=self._nixl_metadata,
                tiers=self._tiers(),
                version=__version__,
                host=self.config.host,
            )
            self._epoch, self._lease_s, self._seq = reply.epoch, reply.lease_s, 0
            # Entries of the old epoch are dead already; evictions need no report.
            self._take_evictions()
            logger.info(
                "registered %s epoch=%d lease=%.1fs", self.node_id, self._epoch, self._lease_s
            )
            # Re-report everything held (after a master restart or a lost lease).
            adds = [
                BlockAdd(s.key[0], s.key[1], tuple(_bits(s.landed_mask)))
                for t in self.tiers
                for s in t.table.slots()
                if s.landed_mask and not s.quarantined
            ]
            objs = [ObjectAdd(k, n) for k, n in self.objects.items()]
            if adds or objs:
                await self._commit_locked(adds, [], objs, [])

    async def _commit(
        self,
        adds: list[BlockAdd],
        object_adds: Iterable[ObjectAdd] = (),
        object_removes: Iterable[str] = (),
    ) -> None:
        """Commit ``adds`` (and every eviction not yet reported) to the master; returns once
        the master applied them, raises what the Commit RPC raised.

        Group commit: one RPC is in flight at a time and the next carries every caller
        queued meanwhile, so concurrent exchanges share RPCs instead of queueing for one
        each. A batch never names one object key twice (object changes keep their order).
        """
        done = asyncio.get_running_loop().create_future()
        # A caller cancelled meanwhile leaves its outcome unread: mark it read.
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._queued.append(_Queued(adds, list(object_adds), list(object_removes), done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_commits(), name="kvstore-commit")
        await asyncio.shield(done)

    async def _flush_commits(self) -> None:
        """Send queued commits, one RPC at a time, until none is queued."""
        while self._queued:
            batch, keys = [], set[str]()
            while self._queued and not (self._queued[0].object_keys() & keys):
                batch.append(self._queued.pop(0))
                keys |= batch[-1].object_keys()
            try:
                async with self._commit_lock:
                    gone = self._take_evictions()
                    for tier in {name for name, _ in gone}:
                        self.metrics.evictions.labels(tier=tier).inc(
                            sum(name == tier for name, _ in gone)
                        )
                    refs = [BlockRef(k[0], k[1]) for _, k in gone]
                    adds = [a for q in batch for a in q.adds]
                    obj_adds = [a for q in batch for a in q.object_adds]
                    obj_removes = [k for q in batch for k in q.object_removes]
                    if adds or refs or obj_adds or obj_removes:
                        await self._commit_locked(adds, refs, obj_adds, obj_removes)
            except Exception as exc:
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

    async def _commit_locked(
        self,
        adds: list[BlockAdd],
        evicts: list[BlockRef],
        object_adds: list[ObjectAdd],
        object_removes: list[str],
    ) -> None:
        self._seq += 1
        batch = CommitBatch(
            self.node_id,
            self._epoch,
            self._seq,
            tuple(adds),
            tuple(evicts),
            tuple(object_adds),
            tuple(object_removes),
        )
        try:
            await self._master.commit(batch)
        except StaleEpoch as exc:
            # The master declared this epoch dead (lease lost, master restarted): register
            # again; registration re-reports every slot and object held, these included.
            self._reregister.set()
            raise TransportError(f"node {self.node_id} is re-registering; retry") from exc

    def _heartbeat_loop(self) -> None:
        """Heartbeat every lease/3 on this thread; ask the loop to re-register when told."""
        with grpc.insecure_channel(self.config.master) as channel:
            stub = pb_grpc.MasterStub(channel)
            while not self._hb_stop.wait(self._lease_s / 3):
                try:
                    reply = stub.Heartbeat(
                        pb.HeartbeatRequest(
                            node_id=self.node_id,
                            epoch=self._epoch,
                            tiers=wire.tiers_to_pb(self._usage),
                        ),
                        timeout=max(1.0, self._lease_s / 3),
                    )
                except grpc.RpcError as exc:
                    logger.warning("heartbeat failed: %s", exc.code())
                    continue
                if reply.reregister and self._loop is not None:
                    self._loop.call_soon_threadsafe(self._reregister.set)

    async def _sweeper(self) -> None:
        """Expire leases and holds, report evictions, refresh gauges, re-register."""
        while True:
            try:
                await asyncio.wait_for(self._reregister.wait(), self.config.sweep_s)
            except TimeoutError:
                pass
            try:
                if self._reregister.is_set():
                    self._reregister.clear()
                    await self._register()
                now = time.monotonic()
                for tier in self.tiers:
                    tier.table.expire_leases(now)
                self.objects.expire_leases(now)
                for hid in [h for h, v in self._holds.items() if all(x.released for x in v.leases)]:
                    del self._holds[hid]
                await self._commit([])
                self._refresh_usage()
            except KVStoreError as exc:
                logger.warning("node sweep: %s", exc)

    def _refresh_usage(self) -> None:
        self._usage = self._tiers()
        g = self.metrics.pool_bytes
        blocks = 0
        for tier in self.tiers:
            st = tier.table.stats()
            g.labels(tier=tier.name, state="free").set(st.free_bytes)
            g.labels(tier=tier.name, state="used").set(st.used_bytes)
            g.labels(tier=tier.name, state="pinned").set(st.pinned_bytes)
            blocks += st.slots
        self.metrics.blocks.labels(role="node").set(blocks)

    # ------------------------------------------------------------------ data plane

    async def _serve(self, conn: Connection) -> None:
        """One client connection: exchanges one after another until it closes."""
        handlers = {
            "put": self._on_put,
            "reserve": self._on_put,
            "lease": self._on_lease,
            "get": self._on_get,
            "hold": self._on_hold,
            "unhold": self._on_unhold,
            "put_object": self._on_put_object,
            "get_object": self._on_get_object,
            "remove_object": self._on_remove_object,
            "stats": self._on_stats,
            "evict": self._on_evict,
            "report": self._on_report,
        }
        while not conn.closed:
            try:
                frame = await conn.recv_header(timeout=None)
            except TransportError:
                return
            op = frame.header.get("op")
            handler = handlers.get(op) if isinstance(op, str) else None
            try:
                if handler is None:
                    raise ProtocolError(f"unknown op {op!r}")
                if frame.sizes:
                    raise ProtocolError(f"op {op!r} carries no payload")
                await handler(conn, frame.header)
            except (InvalidArgument, CapacityError, ProtocolError, ChunkError) as exc:
                # The request was refused before any payload moved: the stream is intact.
                if conn.closed:
                    return
                await conn.discard_payload(self.config.io_timeout_s)
                await conn.send(error_header(exc), timeout=self.config.io_timeout_s)
            except (TransportError, KVTimeout) as exc:
                # Mid-exchange: the stream may be unframed, so the connection goes.
                logger.info("connection %s dropped: %s", conn.peer, exc)
                await conn.close()
                return

    def _namespace(self, canonical_hex: Any) -> tuple[Namespace, int]:
        """The namespace a put names and its chunk size (parsed once per namespace)."""
        if not isinstance(canonical_hex, str) or len(canonical_hex) > 8192:
            raise ProtocolError("field 'ns' must be the canonical namespace in hex")
        seen = self._ns_by_hex.get(canonical_hex)
        if seen is not None:
            return seen
        try:
            raw = bytes.fromhex(canonical_hex)
        except ValueError as exc:
            raise ProtocolError("field 'ns' is not hex") from exc
        ns = Namespace.from_canonical_bytes(raw)
        known = self._namespaces.get(ns.id)
        if known is None:
            if len(self._namespaces) >= _MAX_NAMESPACES:
                raise CapacityError(f"node serves at most {_MAX_NAMESPACES} namespaces")
            size = chunk_nbytes(ns.block_tokens, ns.num_kv_heads, ns.head_dim, ns.dtype, ns.quant)
            known = self._namespaces[ns.id] = (ns, size)
        self._ns_by_hex[canonical_hex] = known
        return known

    def _spec(self, ns: Namespace) -> ChunkSpec:
        """What every chunk of ``ns`` must look like (its header is checked against it)."""
        spec = self._specs.get(ns.id)
        if spec is None:
            spec = self._specs[ns.id] = ChunkSpec.of(ns)
        return spec

    def _chunk_list(self, header: dict[str, Any]) -> list[Any]:
        chunks = require(header, "chunks", list)
        if not chunks or len(chunks) > MAX_CHUNKS_PER_REQUEST:
            raise ProtocolError(f"a request names 1..{MAX_CHUNKS_PER_REQUEST} chunks")
        return chunks

    async def _on_put(self, conn: Connection, header: dict[str, Any]) -> None:
        ns, chunk_bytes = self._namespace(header.get("ns"))
        num_chunks = ns.num_layers * ns.tp_size
        wanted: list[tuple[SlotKey, bytes | None, int]] = []
        for item in self._chunk_list(header):
            if not isinstance(item, list) or len(item) != 4:
                raise ProtocolError("a put chunk is [block, parent, index, nbytes]")
            block, parent, index, nbytes = item
            if not isinstance(index, int) or not 0 <= index < num_chunks:
                raise BadShape(f"chunk index {index!r} outside [0, {num_chunks})")
            if nbytes != chunk_bytes:
                raise BadShape(
                    f"chunk of {nbytes!r} bytes; this namespace's chunks are {chunk_bytes}"
                )
            wanted.append(
                ((ns.id, hex16(block)), hex16(parent, "parent") if parent else None, index)
            )
        if len({(key, index) for key, _, index in wanted}) != len(wanted):
            raise InvalidArgument("a put names the same chunk twice")
        wait_s = header.get("wait_s", 0.0)
        if not isinstance(wait_s, int | float) or isinstance(wait_s, bool) or wait_s < 0:
            raise ProtocolError("field 'wait_s' must be a number >= 0")
        leases: list[Lease[Slot]] = []
        claims: dict[tuple[SlotKey, int], asyncio.Future[None]] = {}
        # ucx:// lands in the fastest tier (device memory, written one-sidedly); tcp:// in
        # host memory, where the socket delivers. A block already held stays where it is.
        tier = self.tiers[0] if header["op"] == "reserve" else self.tiers[-1]
        try:
            slots = self._allocate(wanted, chunk_bytes, num_chunks, leases, tier)
            wait = min(float(wait_s), self.config.io_timeout_s)
            accept = await self._claim(wanted, slots, claims, wait)
            picked = [i for i, a in enumerate(accept) if a == SEND]
            sent = [slot for i in picked if (slot := slots[i]) is not None]  # all of them
            views = [self._tier_of(slot).table.chunk_view(slot, wanted[i][2])
                     for i, slot in zip(picked, sent, strict=True)]  # fmt: skip
            items = [(i, wanted[i][0][1], wanted[i][2], views[k]) for k, i in enumerate(picked)]
            t0 = time.perf_counter()
            if header["op"] == "reserve":
                await self._land_by_ucx(conn, accept, views, sent)
                failed = await self._verify(conn.peer, ns, items)
                transport = "ucx"
            else:
                await conn.send({"op": "ready", "accept": accept}, timeout=self.config.io_timeout_s)
                failed = await self._receive_chunks(conn, ns, items, chunk_bytes)
                transport = "tcp"
            stored = await self._commit_landed(wanted, dict(zip(picked, sent, strict=True)), failed)
            self._settle(claims)  # landed and committed: writers waiting on these look again
            self._count("put", transport, len(views) * chunk_bytes, t0)
            busy = [i for i, a in enumerate(accept) if a == BUSY]
            ack = {"op": "ack", "stored": stored, "skipped": len(accept) - len(picked) - len(busy)}
            await conn.send(
                {**ack, "failed": failed, "busy": busy}, timeout=self.config.io_timeout_s
            )
        finally:
            self._settle(claims)
            for lease in leases:
                lease.release()

    async def _claim(
        self,
        wanted: list[tuple[SlotKey, bytes | None, int]],
        slots: list[Slot | None],
        claims: dict[tuple[SlotKey, int], asyncio.Future[None]],
        wait_s: float,
    ) -> list[int]:
        """Decide, chunk by chunk, who writes it: :data:`SEND` (this writer; the chunk is
        claimed in ``claims`` until its exchange ends), :data:`STORED` (landed and checked
        here already) or :data:`BUSY` (not stored, and this writer may not store it now).

        A chunk another writer is transferring is neither stored nor free: this writer
        waits up to ``wait_s`` for that exchange to end, then looks again — landed means
        stored, a failed or aborted transfer leaves the chunk to this writer. Past
        ``wait_s``, or when the block's slot is quarantined (a ``ucx://`` writer that may
        still be writing timed out), the chunk is BUSY: reported not stored, never a lie.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        accept = [BUSY] * len(wanted)
        todo = list(range(len(wanted)))
        while todo:
            waits: list[asyncio.Future[None]] = []
            later = []
            for i in todo:
                (key, _, index), slot = wanted[i], slots[i]
                if slot is None or slot.quarantined or not slot.alive:
                    continue
                if slot.landed_mask >> index & 1:
                    accept[i] = STORED
                elif (other := self._inflight.get((key, index))) is not None:
                    waits.append(other)
                    later.append(i)
                else:
                    accept[i] = SEND
                    claims[key, index] = self._inflight[key, index] = loop.create_future()
            todo = later
            left = deadline - loop.time()
            if not todo or left <= 0:
                break
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        return accept

    def _settle(self, claims: dict[tuple[SlotKey, int], asyncio.Future[None]]) -> None:
        """End an exchange's claims and wake the writers waiting on them (idempotent)."""
        for chunk, fut in claims.items():
            if self._inflight.get(chunk) is fut:
                del self._inflight[chunk]
            if not fut.done():
                fut.set_result(None)

    def _allocate(
        self,
        wanted: list[tuple[SlotKey, bytes | None, int]],
        chunk_bytes: int,
        num_chunks: int,
        leases: list[Lease[Slot]],
        tier: _Tier,
    ) -> list[Slot | None]:
        """Allocate and pin the batch's slots, new ones in ``tier``, blocks already held in
        the tier that holds them (REJECT = CapacityError before any payload). A block whose
        slot is quarantined gets None: its chunks cannot be stored now (BUSY)."""
        by_key: dict[SlotKey, Slot | None] = {}
        host = self.tiers[-1]
        for key, parent, _ in wanted:
            if key in by_key:
                continue
            # A quarantined slot counts as held, so a block is never started again in
            # another tier meanwhile.
            held = self._holder(key)
            if held is not None and held.table.get(key) is None:
                by_key[key] = None
                continue
            into = held or tier
            args = (key, chunk_bytes * num_chunks, chunk_bytes, num_chunks, parent)
            try:
                res = into.table.allocate(*args)
            except CapacityError:
                if held is not None or into is host:
                    raise
                into = host  # no room in the GPU tier (pinned, quarantined): host memory
                res = into.table.allocate(*args)
            by_key[key] = res.slot
            leases.append(into.table.pin(res.slot))
            self._unreported.extend((into.name, k) for k in res.evicted)
        return [by_key[key] for key, _, _ in wanted]

    async def _receive_chunks(
        self, conn: Connection, ns: Namespace, items: list[_Landed], chunk_bytes: int
    ) -> list[int]:
        """``tcp://``: the data frame's buffers land straight in the slots' chunk views, and
        each chunk is checked on the loop piece by piece as its bytes arrive, while they are
        still in this core's cache (measured: xxh3 of a just-received 128 KiB piece ~60
        GB/s, of a chunk read back from memory ~8.5 GB/s); the request positions that
        failed."""
        timeout = self.config.io_timeout_s
        frame = await conn.recv_header(timeout=timeout)
        if frame.header.get("op") != "data":
            raise ProtocolError(f"expected the data frame, got {frame.header.get('op')!r}")
        if frame.sizes != [chunk_bytes] * len(items):
            raise ProtocolError("data frame does not match the accepted chunks")
        # A block held in the GPU tier (put over ucx:// before) is received into host
        # memory, checked there and then copied to the device.
        in_host = self.tiers[-1].holds
        hosts = [v if in_host(v) else torch.empty_like(v, device="cpu") for *_, v in items]
        spec = self._spec(ns)
        checks = [
            ChunkVerifier(buf, ChunkKey(block, *divmod(index, ns.tp_size)), spec)
            for (_, block, index, _), buf in zip(items, hosts, strict=True)
        ]
        failed: list[int] = []

        def arrived(k: int, upto: int) -> None:
            checks[k].advance(upto)
            if upto == chunk_bytes:
                try:
                    checks[k].finish()
                except ChunkError as exc:
                    logger.warning("rejected chunk from %s: %s", conn.peer, exc)
                    failed.append(items[k][0])

        await conn.recv_payload_into([h.numpy() for h in hosts], timeout, arrived)
        for (i, *_, view), buf in zip(items, hosts, strict=True):
            if buf is not view and i not in failed:
                view.copy_(buf)
        return failed

    async def _land_by_ucx(
        self, conn: Connection, accept: list[int], views: list[torch.Tensor], slots: list[Slot]
    ) -> None:
        """``ucx://``: hand the writer the chunk views' spans, wait for its ``landed``.

        If the writer never says ``landed`` (timeout, disconnect, garbage), it may still be
        writing one-sidedly into those slots: they are quarantined for a while, unreadable
        and not reused, instead of being handed to someone else.
        """
        timeout = self.config.io_timeout_s
        spans = [self._span(v) for v in views]
        await conn.send({"op": "reserved", "accept": accept, "spans": spans}, timeout=timeout)
        try:
            frame = await conn.recv_header(timeout=timeout)
            if frame.header.get("op") != "landed" or frame.sizes:
                raise ProtocolError(f"expected 'landed', got {frame.header.get('op')!r}")
        except BaseException:
            self._quarantine(slots)
            raise

    def _span(self, view: torch.Tensor) -> list[int]:
        for tier in self.tiers:
            if tier.reg is not None and tier.holds(view):
                offset = view.data_ptr() - tier.arena.tensor.data_ptr()
                return tier.reg.span(offset, view.numel()).to_wire()  # type: ignore[no-any-return]
        raise InvalidArgument("this node does not serve ucx://")

    def _quarantine(self, slots: Iterable[Slot]) -> None:
        """Quarantine ``slots`` for one I/O timeout (a peer may still write into them)."""
        loop = asyncio.get_running_loop()
        for slot in set(slots):
            tier = self._owner(slot)
            if tier is None:
                continue
            tier.table.quarantine(slot)
            # One deadline per slot, the latest: a second writer of the same block that
            # times out later keeps it quarantined for its own full timeout.
            old = self._unquarantine_at.pop(slot, None)
            if old is not None:
                old.cancel()
            self._unquarantine_at[slot] = loop.call_later(
                self.config.io_timeout_s, self._unquarantine, tier, slot
            )

    def _unquarantine(self, tier: _Tier, slot: Slot) -> None:
        self._unquarantine_at.pop(slot, None)
        if slot.alive and slot.quarantined and tier.owns(slot):
            tier.table.unquarantine(slot)

    async def _verify(self, peer: str, ns: Namespace, items: list[_Landed]) -> list[int]:
        """``ucx://``: check every chunk a writer says it wrote (header, key, checksum: every
        byte is read, from memory: another process wrote it); the request positions that
        failed.

        A batch in host memory of at most :data:`_INLINE_VERIFY_BYTES` is checked on the
        loop, which costs less than handing it to threads and waiting for them; a larger
        one, or one in the GPU tier (each check waits for the device), off the loop, so
        other connections keep being served (its slots are pinned by this exchange), split
        over the verifier threads (xxh3 releases the GIL).
        """
        in_host = self.tiers[-1].holds
        size = sum(item[3].numel() for item in items)
        if size <= _INLINE_VERIFY_BYTES and all(in_host(item[3]) for item in items):
            return self._check_chunks(peer, ns, items)
        loop, n = asyncio.get_running_loop(), self._verify_threads
        parts = [items[k::n] for k in range(n) if items[k::n]]
        checked = await asyncio.gather(
            *(loop.run_in_executor(self._verifier, self._check_chunks, peer, ns, p) for p in parts)
        )
        return sorted(i for bad in checked for i in bad)

    def _check_chunks(self, peer: str, ns: Namespace, part: list[_Landed]) -> list[int]:
        """Verify header, key, the namespace's spec and checksum of landed chunks
        ``(position, block, index, view)``; the positions that failed. Runs on the loop or
        a verifier thread."""
        bad = []
        spec = self._spec(ns)
        for i, block, index, view in part:
            layer, shard = divmod(index, ns.tp_size)
            try:
                verify_chunk(view, ChunkKey(block, layer, shard), spec)
            except ChunkError as exc:
                logger.warning("rejected chunk from %s: %s", peer, exc)
                bad.append(i)
        return bad

    async def _commit_landed(
        self,
        wanted: list[tuple[SlotKey, bytes | None, int]],
        sent: dict[int, Slot],
        failed: list[int],
    ) -> int:
        """Mark the checked chunks landed and commit them to the master; chunks stored.
        ``sent``: request position → slot of each chunk the writer sent. Chunks whose slot
        was quarantined meanwhile are added to ``failed``."""
        landed: dict[SlotKey, list[int]] = {}
        rejected = set(failed)
        for i, slot in sent.items():
            key, _, index = wanted[i]
            if i in rejected:
                continue
            if slot.quarantined or not self._tier_of(slot).table.mark_landed(slot, index):
                # Quarantined by another exchange meanwhile (a writer of the same block
                # timed out): this chunk is not kept; the writer is told so and may retry.
                if slot.quarantined:
                    failed.append(i)
                continue
            landed.setdefault(key, []).append(index)
        failed.sort()
        await self._commit([BlockAdd(k[0], k[1], tuple(v)) for k, v in landed.items()])
        return len(sent) - len(failed)

    def _find(
        self, header: dict[str, Any], leases: list[Lease[Slot]], ttl_s: float | None = None
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Pin every requested chunk that is here; (found flags, their chunk views)."""
        ns_id = hex16(header.get("ns_id"), "ns_id")
        views: list[torch.Tensor] = []
        found: list[int] = []
        keys: dict[str, list[SlotKey]] = {}
        for item in self._chunk_list(header):
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], int):
                raise ProtocolError("a get chunk is [block, index]")
            key = (ns_id, hex16(item[0]))
            held = self._lookup(key)
            if (
                held is None
                or not 0 <= item[1] < held[1].num_chunks
                or not (held[1].landed_mask >> item[1] & 1)
            ):
                found.append(0)
                self.metrics.stale_misses.inc()
                continue
            tier, slot = held
            leases.append(tier.table.pin(slot, ttl_s=ttl_s))
            views.append(tier.table.chunk_view(slot, item[1]))
            found.append(1)
            keys.setdefault(tier.name, []).append(key)
        for tier in self.tiers:
            tier.table.touch(keys.get(tier.name, []))
        return found, views

    async def _on_get(self, conn: Connection, header: dict[str, Any]) -> None:
        leases: list[Lease[Slot]] = []
        try:
            found, views = self._find(header, leases)
            t0 = time.perf_counter()
            # The GPU tier goes out through a host copy (tcp:// sends host bytes only).
            host = self.tiers[-1]
            await conn.send(
                {"op": "data", "found": found},
                [(v if host.holds(v) else _host_copy(v)).numpy() for v in views],
                timeout=self.config.io_timeout_s,
            )
            self._count("get", "tcp", sum(v.numel() for v in views), t0)
        finally:
            for lease in leases:
                lease.release()

    async def _on_lease(self, conn: Connection, header: dict[str, Any]) -> None:
        """``ucx://`` get: pin the chunks for at most ``lease_s``, send their spans, wait
        for the reader's ``release``. The node never reuses a leased slot; a reader that
        dies lets its lease expire, one that reads late verifies key and checksum."""
        ttl = min(self.config.io_timeout_s, float(header.get("lease_s") or 10.0))
        leases: list[Lease[Slot]] = []
        try:
            found, views = self._find(header, leases, ttl_s=ttl)
            spans = [self._span(v) for v in views]
            t0 = time.perf_counter()
            await conn.send(
                {"op": "leased", "found": found, "spans": spans, "lease_s": ttl},
                timeout=self.config.io_timeout_s,
            )
            frame = await conn.recv_header(timeout=ttl)
            if frame.header.get("op") != "release" or frame.sizes:
                raise ProtocolError(f"expected 'release', got {frame.header.get('op')!r}")
            self._count("get", "ucx", sum(v.numel() for v in views), t0)
        finally:
            for lease in leases:
                lease.release()

    def _count(self, op: str, transport: str, nbytes: int, t0: float) -> None:
        self.metrics.transfer_bytes.labels(op=op, transport=transport).inc(nbytes)
        self.metrics.transfer_seconds.labels(op=op, transport=transport).observe(
            time.perf_counter() - t0
        )

    async def _on_hold(self, conn: Connection, header: dict[str, Any]) -> None:
        ns_id = hex16(header.get("ns_id"), "ns_id")
        ttl = header.get("ttl_s")
        if not isinstance(ttl, int | float) or not 0 < ttl <= self.config.max_hold_s:
            raise InvalidArgument(f"ttl_s must lie in (0, {self.config.max_hold_s}]")
        blocks = require(header, "blocks", list)
        if len(blocks) > MAX_CHUNKS_PER_REQUEST:
            raise ProtocolError("too many blocks in one hold")
        if len(self._holds) >= _MAX_HOLDS:
            raise CapacityError("too many holds on this node")
        hold = _Hold()
        for block in blocks:
            held = self._lookup((ns_id, hex16(block)))
            if held is None:
                break
            hold.leases.append(held[0].table.pin(held[1], ttl_s=float(ttl)))
        hold_id = f"h{next(self._hold_ids)}"
        if hold.leases:
            self._holds[hold_id] = hold
        await conn.send(
            {"op": "held", "hold_id": hold_id, "blocks": len(hold.leases)},
            timeout=self.config.io_timeout_s,
        )

    async def _on_unhold(self, conn: Connection, header: dict[str, Any]) -> None:
        hold = self._holds.pop(str(header.get("hold_id")), None)
        for lease in hold.leases if hold else []:
            lease.release()
        await conn.send(
            {"op": "ok", "released": hold is not None}, timeout=self.config.io_timeout_s
        )

    def _object_key(self, header: dict[str, Any]) -> str:
        key = require(header, "key", str)
        if not key or len(key.encode()) > MAX_KEY_LEN:
            raise InvalidArgument(f"object key must be 1..{MAX_KEY_LEN} bytes")
        return key

    async def _on_put_object(self, conn: Connection, header: dict[str, Any]) -> None:
        key = self._object_key(header)
        nbytes = require(header, "nbytes", int)
        timeout = self.config.io_timeout_s
        write = self.objects.put(key, nbytes)
        try:
            await conn.send({"op": "ready", "accept": [1]}, timeout=timeout)
            frame = await conn.recv_header(timeout=timeout)
            if frame.header.get("op") != "data" or frame.sizes != [nbytes]:
                raise ProtocolError("object data frame does not match the announced size")
            await conn.recv_payload_into([write.view.numpy()], timeout)
        except BaseException:
            write.abort()
            raise
        write.commit()
        await self._commit([], object_adds=[ObjectAdd(key, nbytes)])
        self.metrics.transfer_bytes.labels(op="put", transport="tcp").inc(nbytes)
        await conn.send({"op": "ack", "stored": 1}, timeout=timeout)

    async def _on_get_object(self, conn: Connection, header: dict[str, Any]) -> None:
        key = self._object_key(header)
        with self.objects.pinned(key) as view:
            bufs = [] if view is None else [view.numpy()]
            await conn.send(
                {"op": "data", "found": [1 if bufs else 0]}, bufs, timeout=self.config.io_timeout_s
            )
        self.metrics.transfer_bytes.labels(op="get", transport="tcp").inc(
            sum(b.nbytes for b in bufs)
        )

    async def _on_remove_object(self, conn: Connection, header: dict[str, Any]) -> None:
        key = self._object_key(header)
        removed = self.objects.remove(key)
        if removed:
            await self._commit([], object_removes=[key])
        await conn.send({"op": "ok", "removed": removed}, timeout=self.config.io_timeout_s)

    async def _on_evict(self, conn: Connection, header: dict[str, Any]) -> None:
        """An operator's eviction: the listed blocks of a namespace, or all of it. Pinned
        or quarantined slots stay (counted); the evictions are committed to the master
        before the answer, like every other change of this node's index entries."""
        ns_id = hex16(header.get("ns_id"), "ns_id")
        blocks = header.get("blocks")
        if blocks is None:
            candidates = [s.key for t in self.tiers for s in t.table.slots() if s.key[0] == ns_id]
        else:
            if not isinstance(blocks, list) or len(blocks) > MAX_CHUNKS_PER_REQUEST:
                raise ProtocolError(f"blocks must be a list of <= {MAX_CHUNKS_PER_REQUEST}")
            candidates = [(ns_id, hex16(b)) for b in blocks]
        present = [(held[0], key) for key in candidates if (held := self._lookup(key))]
        gone = [(tier.name, key) for tier, key in present if tier.table.evict(key)]
        self._unreported.extend(gone)
        await self._commit([])
        await conn.send(
            {"op": "evicted", "evicted": len(gone), "kept": len(present) - len(gone)},
            timeout=self.config.io_timeout_s,
        )

    async def _on_report(self, conn: Connection, header: dict[str, Any]) -> None:
        """A reader says chunks it got from here failed verification. The node checks each
        itself (a report alone never drops anything) and drops a bad one: the whole slot
        when no one has it pinned (reported to the master as an eviction), else just that
        chunk, so its next writer stores it again."""
        ns_id = hex16(header.get("ns_id"), "ns_id")
        known = self._namespaces.get(ns_id)
        dropped = 0
        for item in self._chunk_list(header):
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], int):
                raise ProtocolError("a reported chunk is [block, index]")
            key = (ns_id, hex16(item[0]))
            held = self._lookup(key)
            if known is None or held is None:
                continue
            (ns, _), (tier, slot) = known, held
            index = item[1]
            if not 0 <= index < slot.num_chunks or not slot.landed_mask >> index & 1:
                continue
            bad = self._check_chunks(
                conn.peer, ns, [(0, key[1], index, tier.table.chunk_view(slot, index))]
            )
            if not bad:
                continue
            dropped += 1
            if tier.table.evict(key):
                self._unreported.append((tier.name, key))
            else:
                tier.table.drop_chunk(slot, index)
        if dropped:
            await self._commit([])
        await conn.send({"op": "reported", "dropped": dropped}, timeout=self.config.io_timeout_s)

    async def _on_stats(self, conn: Connection, header: dict[str, Any]) -> None:
        stats = [(t.name, t.table.stats()) for t in self.tiers]
        await conn.send(
            {
                "op": "stats",
                "node_id": self.node_id,
                "epoch": self._epoch,
                "slots": sum(st.slots for _, st in stats),
                "pinned_slots": sum(st.pinned_slots for _, st in stats),
                "leases": sum(st.leases for _, st in stats),
                "holds": len(self._holds),
                "objects": len(self.objects),
                "capacity_bytes": sum(st.capacity_bytes for _, st in stats),
                "used_bytes": sum(st.used_bytes for _, st in stats),
                "tiers": [_tier_stats(name, st) for name, st in stats],
            },
            timeout=self.config.io_timeout_s,
        )


def _host_copy(view: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(view, device="cpu").copy_(view)


def _tier_stats(name: str, st: TierStats) -> dict[str, Any]:
    return {
        "name": name,
        "slots": st.slots,
        "pinned_slots": st.pinned_slots,
        "capacity_bytes": st.capacity_bytes,
        "used_bytes": st.used_bytes,
    }


def _gpu_device(name: str) -> torch.device:
    """The GPU tier's device; InvalidArgument when torch cannot use it."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(f"bad GPU tier device {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("--gpu-mem needs a CUDA device, and torch sees none")
    return device


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]
