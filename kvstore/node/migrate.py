"""Drain with migration: a draining node copies its blocks to the nodes placement would
choose next, so that it can then leave with nothing lost.

The operator's mark (``kvctl drain NODE``, the master's ``Drain``) reaches the node in the
answer to its next heartbeat (within a third of a lease); ``kvstore node --drain-on-exit S``
sets it itself on SIGTERM. While the mark is set, :class:`Migration` runs passes: each takes
every landed chunk not yet copied (most recently used blocks first, so that a pool short of
room keeps the hot ones), asks the master who else holds those blocks and which nodes take
new blocks, and puts the chunks, node to node, over the ``tcp://`` data plane, in batches of
at most :data:`BATCH_CHUNKS` chunks and :data:`BATCH_BYTES` bytes, :data:`IN_FLIGHT` at a
time. The receiving node checks every chunk as it arrives (header against the namespace,
key, checksum) and commits it to the master, exactly as for a writer's put.

Where a block goes: the first node, in the block's rendezvous order over the nodes that
take new blocks (:func:`~kvstore.core.placement.rank_nodes`, weighted by each node's room:
its free disk where it has one, else its free memory, :attr:`NodeInfo.room_bytes`; a writer
weighs free memory), that does not already hold those chunks — so a block keeps as many
copies as it had (with ``replicas=2``, its other copy is not counted twice). A chunk the
receiver refuses as bad is checked here; if it is bad here too it is dropped (it was
poison, not worth keeping), else it is tried again in a later pass, at most
:data:`MAX_TRIES` times. A receiver that fails an exchange is left out for
:data:`BENCH_S`. Chunks that land during the drain (another layer of a block, from a writer
whose grant predates the mark) are copied by the next pass. A block's copied chunks are
counted per block, not per slot: one that left memory and was staged again is not copied
again.

Progress (:meth:`Migration.counters`, in the node's ``stats`` and heartbeats): ``state`` is
``idle`` (not draining), ``moving``, ``waiting`` (no node takes new blocks: ``reason``
says why) or ``done`` (nothing left to copy); ``kvctl drain --wait`` waits for ``done``.
Copies a chunk takes: slot → kernel (``sendall`` of a view; from the GPU tier through one
host copy) → the receiver's slot.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.control.client import MasterClient
from kvstore.control.records import NodeInfo
from kvstore.core.hashing import Namespace
from kvstore.core.placement import Candidate, rank_nodes, unplaceable_reason, weight_for_free
from kvstore.core.slots import Lease, Slot, SlotKey
from kvstore.dataplane.client import Dial, NodeClient
from kvstore.dataplane.handshake import TicketSource
from kvstore.dataplane.messages import MAX_CHUNKS_PER_REQUEST, PutChunk
from kvstore.errors import KVStoreError, KVTimeout, Miss
from kvstore.node.checks import ChunkChecks, LandedChunk
from kvstore.node.tiers import Tiers, host_copy, landed_bits

__all__ = ["BATCH_BYTES", "BATCH_CHUNKS", "BENCH_S", "IN_FLIGHT", "MAX_TRIES", "Migration"]

logger = logging.getLogger("kvstore.node")

BATCH_CHUNKS = 1024
"""Most chunks one node-to-node put carries (within a request's 4096)."""
assert BATCH_CHUNKS <= MAX_CHUNKS_PER_REQUEST
BATCH_BYTES = 16 * 2**20
"""Most chunk bytes one node-to-node put carries."""
IN_FLIGHT = 2
"""Node-to-node puts in flight at once (the node keeps serving its readers meanwhile)."""
MAX_TRIES = 5
"""Passes that may try one chunk before it counts as failed (not copied)."""
BENCH_S = 5.0
"""How long a receiver whose exchange failed is left out of the passes."""
PAUSE_S = 0.5
"""Pause between passes while something is left (receivers busy, chunks landing)."""
LOOKUP_BLOCKS = 4096
"""Blocks per master Lookup while planning a pass."""
DISK_BLOCKS = 64
"""Blocks held only on disk that one pass reads up to copy (staged cold: they leave host
memory again at no cost once copied)."""

_NamespaceOf = Callable[[bytes], tuple[Namespace, int] | None]


@dataclass
class _Batch:
    target: NodeInfo
    ns: Namespace
    size: int
    items: list[tuple[Slot, int]] = field(default_factory=list)
    """(slot, chunk index) of each chunk to copy, in request order."""


class Migration:
    """The copy of a draining node's blocks. Owned by the node's event loop: :meth:`run`
    is its task; :meth:`set_draining` follows the master's mark."""

    def __init__(
        self,
        node_id: str,
        tiers: Tiers,
        master: MasterClient,
        namespace_of: _NamespaceOf,
        checks: ChunkChecks,
        drop: Callable[[Slot, int], None],
        io_timeout_s: float,
        tenant_of: Callable[[bytes], str] = lambda pool_id: "",
    ) -> None:
        self.node_id = node_id
        self.tiers = tiers
        self.master = master
        self.namespace_of = namespace_of
        self.checks = checks
        self.drop = drop
        self.io_timeout_s = io_timeout_s
        self.tenant_of = tenant_of
        """The tenant a pool id's slots belong to: its copies are stored for that tenant."""
        self.ssl_context: ssl.SSLContext | None = None
        """Verifies receivers that serve ``tls://`` (the node's TLS files)."""
        self.tickets: TicketSource | None = None
        """The node's own data-port tickets (with a cluster secret): the receivers
        authenticate each copy's connection."""
        self.own_uri = ""
        """This node's data URI (set once its port is open): never a target, whatever the
        id of the record that names it (a restarted node's old record may still be live)."""
        self.draining = False
        self.state = "idle"
        self.reason = ""
        self.passes = 0
        self.moved_chunks = 0
        self.moved_bytes = 0
        self.left = 0
        self.failed = 0
        self.dropped = 0
        self._copied: dict[SlotKey, int] = {}
        """Per block: the mask of its chunks copied away."""
        self._disk_done: set[SlotKey] = set()
        """Blocks held only on disk whose every chunk was copied away (or given up)."""
        self._tries: dict[tuple[SlotKey, int], int] = {}
        self._benched: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()

    def set_draining(self, draining: bool) -> None:
        """Follow the draining mark: set, passes start (counters from zero); cleared, they
        stop (copies made so far stay, as extra copies)."""
        if draining == self.draining:
            return
        self.draining = draining
        if draining:
            self.passes = self.moved_chunks = self.moved_bytes = self.failed = self.dropped = 0
            self._copied.clear()
            self._disk_done.clear()
            self._tries.clear()
            self.state, self.reason = "moving", ""
            self._settled.clear()
        else:
            self.state, self.reason, self.left = "idle", "", 0
        self._wake.set()

    def counters(self) -> dict[str, int | str]:
        """Progress, for the node's ``stats`` (strings stay out of heartbeats)."""
        return {
            "draining": int(self.draining),
            "drain_state": self.state,
            "drain_reason": self.reason,
            "drain_passes": self.passes,
            "drain_moved_chunks": self.moved_chunks,
            "drain_moved_bytes": self.moved_bytes,
            "drain_left": self.left,
            "drain_failed": self.failed,
            "drain_dropped": self.dropped,
        }

    async def settled(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until a pass that starts after this call finds
        nothing left to copy; whether one did (``--drain-on-exit``). An earlier pass's
        "done" does not count: chunks may have landed since."""
        self._settled.clear()
        self._wake.set()
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def run(self) -> None:
        """Passes while draining, until cancelled (the node stops)."""
        while True:
            if not self.draining:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self.one_pass()
            except KVStoreError as exc:  # the master did not answer: try again later
                self.reason = f"{type(exc).__name__}: {exc}"
                logger.warning("drain pass: %s", self.reason)
            except Exception as exc:  # a bug: say so, and keep draining what can be
                self.reason = f"{type(exc).__name__}: {exc}"
                logger.exception("drain pass failed")
            self._wake.clear()
            pause = PAUSE_S if self.left or self.state != "done" else 2 * PAUSE_S
            try:
                await asyncio.wait_for(self._wake.wait(), pause)
            except TimeoutError:
                pass

    async def one_pass(self) -> None:
        """Copy what is left once; updates the progress counters."""
        self.passes += 1
        self._settled.clear()  # (a waiter counts only a pass that starts after it)
        staged = await self._stage_from_disk()
        try:
            await self._pass()
        finally:
            for lease in staged:
                lease.release()

    async def _stage_from_disk(self) -> list[Lease[Slot]]:
        """Read up to :data:`DISK_BLOCKS` blocks held only on disk into host memory for
        this pass (the most recently written first); their leases."""
        disk = self.tiers.disk
        if disk is None:
            return []
        keys = self._disk_only()[:DISK_BLOCKS]
        if not keys:
            return []
        leases, _ = await disk.stage(keys)
        return leases

    def _disk_only(self) -> list[SlotKey]:
        """Blocks of known namespaces held only on disk and not yet copied, newest first."""
        disk = self.tiers.disk
        if disk is None:
            return []
        index, known, holder = disk.store.index, self.namespace_of, self.tiers.holder
        copied = self._copied  # (a block copied from memory before it left for the disk)
        keys = [k for k in disk.store if k not in self._disk_done
                and (k not in index or index[k].mask & ~copied.get(k, 0))]  # fmt: skip
        keys = [k for k in keys if known(k[0]) is not None and holder(k) is None]
        keys.sort(key=lambda k: -index[k].seq if k in index else 0)
        return keys

    def _disk_chunks(self, keys: list[SlotKey]) -> int:
        index = self.tiers.disk.store.index if self.tiers.disk is not None else {}
        return sum(index[k].mask.bit_count() for k in keys if k in index)

    def _done_if_copied(self, key: SlotKey) -> None:
        """``key``'s disk-only block is done once every chunk is copied or given up."""
        held = self.tiers.lookup(key)
        if held is None:
            return
        left = landed_bits(held[1].landed_mask & ~self._copied_mask(held[1]))
        if all(self._tries.get((key, c), 0) >= MAX_TRIES for c in left):
            self._disk_done.add(key)

    async def _pass(self) -> None:
        todo = self._todo()
        on_disk = self._disk_only()
        if not todo and not on_disk:
            self.left, self.state, self.reason = 0, "done", ""
            self._settled.set()
            return
        self.left = sum(len(c) for _, c in todo) + self._disk_chunks(on_disk)
        if not todo:  # (the blocks staged for this pass went meanwhile: the next reads them)
            return
        infos = await self.master.nodes(timeout=self.io_timeout_s)
        now = time.monotonic()
        targets = {
            n.node_id: n
            for n in infos
            if n.placeable
            and n.node_id != self.node_id
            and n.data_uri != self.own_uri
            and self._benched.get(n.node_id, 0) < now
        }
        if not targets:
            others = [n for n in infos if n.node_id != self.node_id]
            benched = [n for n in others if n.placeable]
            self.state = "waiting"
            self.reason = (
                f"every node that takes blocks failed an exchange; retrying ({len(benched)})"
                if benched
                else unplaceable_reason(infos) + "; add a node, or undrain one"
            )
            return
        self.state, self.reason = "moving", ""
        batches = await self._plan(todo, targets)
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def send(batch: _Batch) -> None:
            async with gate:
                await self._send(batch)

        await asyncio.gather(*(send(b) for b in batches))
        for slot, _ in todo:
            if self.tiers.disk is not None and slot.key in self.tiers.disk.store:
                self._done_if_copied(slot.key)
        left = self._todo()
        self.left = sum(len(c) for _, c in left) + self._disk_chunks(self._disk_only())
        if not self.draining:  # undrained during the pass
            self.state, self.reason, self.left = "idle", "", 0

    def _todo(self) -> list[tuple[Slot, list[int]]]:
        """Every readable block with chunks not yet copied (nor given up), most recently
        used first."""
        out = []
        failed = 0
        for tier in self.tiers:
            for slot in tier.table.slots():
                if slot.quarantined or not slot.landed_mask:
                    continue
                if self.namespace_of(slot.key[0]) is None:
                    continue
                chunks = []
                for c in landed_bits(slot.landed_mask & ~self._copied_mask(slot)):
                    if self._tries.get((slot.key, c), 0) < MAX_TRIES:
                        chunks.append(c)
                    else:
                        failed += 1  # given up, and still here: it leaves with the node
                if chunks:
                    out.append((slot, chunks))
        self.failed = failed
        out.sort(key=lambda item: item[0].stamp, reverse=True)
        return out

    async def _plan(
        self, todo: list[tuple[Slot, list[int]]], targets: dict[str, NodeInfo]
    ) -> list[_Batch]:
        # (room, not free memory: a copy onto a node whose disk is full would push that
        # node's own blocks out of the pool while another node had room for it)
        cands = [Candidate(n.node_id, weight_for_free(n.room_bytes)) for n in targets.values()]
        by_ns: dict[bytes, list[tuple[Slot, list[int]]]] = {}
        for item in todo:
            by_ns.setdefault(item[0].key[0], []).append(item)
        batches: dict[tuple[str, bytes], list[_Batch]] = {}
        for ns_id, items in by_ns.items():
            known = self.namespace_of(ns_id)
            if known is None:
                continue
            ns, size = known
            for i in range(0, len(items), LOOKUP_BLOCKS):
                part = items[i : i + LOOKUP_BLOCKS]
                holders = await self.master.lookup(
                    ns_id, [s.key[1] for s, _ in part], timeout=self.io_timeout_s
                )
                for (slot, chunks), held in zip(part, holders, strict=True):
                    masks = {h.node_id: h.mask for h in held}
                    for target in rank_nodes(slot.key[1], cands, len(cands)):
                        missing = [c for c in chunks if not masks.get(target, 0) >> c & 1]
                        if missing:
                            break
                    else:  # every node that takes blocks has them: nothing to copy
                        self._mark_copied(slot, chunks)
                        continue
                    rows = batches.setdefault((target, ns_id), [])
                    if (
                        not rows
                        or len(rows[-1].items) + len(missing) > BATCH_CHUNKS
                        or (len(rows[-1].items) + len(missing)) * size > BATCH_BYTES
                    ):
                        rows.append(_Batch(targets[target], ns, size))
                    rows[-1].items.extend((slot, c) for c in missing)
        return [b for rows in batches.values() for b in rows]

    def _copied_mask(self, slot: Slot) -> int:
        """The chunks of ``slot``'s block copied away, from whichever slot held them (a
        key names the same bytes: a block that left memory and was staged again into
        another slot is not copied again)."""
        return self._copied.get(slot.key, 0)

    def _mark_copied(self, slot: Slot, chunks: Sequence[int]) -> None:
        mask = self._copied_mask(slot)
        for c in chunks:
            mask |= 1 << c
        self._copied[slot.key] = mask

    async def _send(self, batch: _Batch) -> None:
        """One node-to-node put of ``batch``; counts what was copied."""
        leases: list[Lease[Slot]] = []
        chunks: list[PutChunk] = []
        sent: list[tuple[Slot, int]] = []
        bufs = []
        host = self.tiers.host
        try:
            pinned: set[SlotKey] = set()
            for slot, c in batch.items:
                tier = self.tiers.owner(slot)
                if tier is None or not slot.alive or slot.quarantined:
                    continue  # evicted meanwhile: nothing to copy
                if not slot.landed_mask >> c & 1:
                    continue
                if slot.key not in pinned:
                    leases.append(tier.table.pin(slot))
                    pinned.add(slot.key)
                view = tier.table.chunk_view(slot, c)[: batch.size]
                bufs.append((view if host.holds(view) else host_copy(view)).numpy())
                chunks.append(PutChunk(slot.key[1], slot.parent, c, batch.size))
                sent.append((slot, c))
            if not chunks:
                return
            node = NodeClient(
                batch.target.data_uri,
                Dial(self.tickets, self.ssl_context),
                timeout_s=self.io_timeout_s,
            )
            ack = await node.put(
                batch.ns.canonical_bytes(), chunks, bufs, wait_s=self.io_timeout_s / 4,
                tenant=self.tenant_of(batch.ns.id),
            )  # fmt: skip
        except Miss:  # a slot went between the checks and the pin: the next pass sees
            return
        except (KVStoreError, OSError) as exc:
            self._benched[batch.target.node_id] = time.monotonic() + BENCH_S
            self._count_tries(sent)
            kind = "timed out" if isinstance(exc, KVTimeout) else f"failed: {exc}"
            logger.warning("drain: put to %s %s", batch.target.node_id, kind)
            return
        finally:
            for lease in leases:
                lease.release()
        busy, failed = set(ack.busy), set(ack.failed)
        for pos, (slot, c) in enumerate(sent):
            if pos in busy:  # another writer is storing it there: a later pass sees
                self._count_tries([(slot, c)])
                continue
            if pos in failed:
                self._refused(batch, slot, c)
                continue
            self._mark_copied(slot, [c])
            self.moved_chunks += 1
            self.moved_bytes += batch.size

    def _count_tries(self, sent: list[tuple[Slot, int]]) -> None:
        for slot, c in sent:
            key = (slot.key, c)
            self._tries[key] = self._tries.get(key, 0) + 1

    def _refused(self, batch: _Batch, slot: Slot, c: int) -> None:
        """The receiver found the chunk bad: check it here; bad here too, drop it."""
        tier = self.tiers.owner(slot)
        if tier is None or not slot.alive or slot.quarantined:
            return
        view = tier.table.chunk_view(slot, c)
        if self.checks.check("drain", batch.ns, [LandedChunk(0, slot.key[1], c, view)]):
            self.dropped += 1
            self.drop(slot, c)
        else:
            self._count_tries([(slot, c)])
