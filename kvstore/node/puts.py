"""The node's put path: who stores each chunk (claims), where it lands (slots, a buffer aside),
what is checked before the ack, and the commit that makes it readable.

A chunk another writer is transferring is neither stored nor free: the node holds one claim
per chunk in flight, and a second writer waits on it (up to the ``wait_s`` it sent) before
storing the chunk itself or being answered BUSY — reported not stored, never a lie. A
``ucx://`` writer that never says ``landed`` may still be writing: its slots are quarantined
for one I/O timeout. See docs/dataplane.md for the flows, their round trips and copies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.core.hashing import Namespace
from kvstore.core.slots import Lease, Slot, SlotKey
from kvstore.dataplane.messages import BUSY, SEND, STORED, Ack, Landed, Message, Put, Ready, expect
from kvstore.errors import BadShape, CapacityError, InvalidArgument, ProtocolError
from kvstore.metrics import Metrics
from kvstore.node.checks import ChunkChecks, LandedChunk
from kvstore.node.master_link import MasterLink
from kvstore.node.scrub import Scrub, ScrubBatch
from kvstore.node.tiers import MemoryTier, Tiers
from kvstore.transport.base import Connection

__all__ = ["GRANT_S", "MAX_ASIDE_BYTES", "MAX_GRANTS", "Puts"]

MAX_ASIDE_BYTES = 64 * 2**20
"""Host memory for ``tcp://`` chunks received while another writer transfers them."""

GRANT_S = 2.0
"""How long a grant lasts (``ucx://``): the chunk stays claimed for its writer, its slot
pinned, until the writer's ``write`` of it or this long after the ack that granted it."""

MAX_GRANTS = 65536
"""Grants a node holds at once; past this, acks grant nothing more."""

_Chunk = tuple[SlotKey, bytes | None, int]
"""A chunk a put names, resolved: (slot key, parent block hash, chunk index)."""


@dataclass(eq=False)
class _Grant:
    """A chunk claimed for one writer across exchanges: it WRITEs it at the slot's location,
    then says ``write``. ``lease`` pins the slot; ``claim`` is its entry in the claims."""

    writer: str
    slot: Slot
    lease: Lease[Slot]
    claim: asyncio.Future[None]
    expires: float
    """Loop time."""


class Puts:
    """Serves puts for a node: its tiers, checks, scrub and master link, composed.
    ``io_timeout_s`` bounds each step and each quarantine. :meth:`close` cancels the
    quarantine timers."""

    def __init__(
        self,
        tiers: Tiers,
        checks: ChunkChecks,
        scrub: Scrub,
        link: MasterLink,
        metrics: Metrics,
        io_timeout_s: float,
    ) -> None:
        self.tiers = tiers
        self.checks = checks
        self.scrub = scrub
        self.link = link
        self.metrics = metrics
        self.io_timeout_s = io_timeout_s
        self._inflight: dict[tuple[SlotKey, int], asyncio.Future[None]] = {}
        """Chunks a put exchange is transferring now → resolved when that exchange ends."""
        self._aside_bytes = 0
        self._unquarantine_at: dict[Slot, asyncio.TimerHandle] = {}
        self._grants: dict[tuple[SlotKey, int], _Grant] = {}
        self.granting = True
        """False while the node drains: acks grant no slot here for a writer's next layer."""
        self.owner_of: Callable[[bytes], str] = lambda pool_id: ""
        """The tenant a pool id's new slots belong to (their quota owner)."""

    @property
    def inflight(self) -> int:
        """Chunks being transferred by a put now (grants included)."""
        return len(self._inflight)

    @property
    def grants(self) -> int:
        """Grants held now."""
        return len(self._grants)

    def close(self) -> None:
        """Cancel the quarantine timers and end every grant (the node stops)."""
        for timer in self._unquarantine_at.values():
            timer.cancel()
        self._unquarantine_at.clear()
        self._end_grants(list(self._grants), float("inf"))  # (their timers find none left)

    def quarantine(self, slots: Iterable[Slot]) -> None:
        """Quarantine ``slots`` for one I/O timeout (a peer may still write into them)."""
        self._quarantine(slots)

    async def _send(self, conn: Connection, message: Message, buffers: Any = ()) -> None:
        await conn.send(message.header(), buffers, timeout=self.io_timeout_s)

    async def serve(
        self, conn: Connection, put: Put, sizes: list[int], ns: Namespace, chunk_bytes: int
    ) -> None:
        """One put of chunks of ``ns`` (of ``chunk_bytes`` each): over ``tcp://`` one frame
        carries every chunk (one round trip), over ``ucx://`` the writer WRITEs the chunks
        it is told to into their slots. Raises before any payload moved for a bad request
        (the caller answers it), and what the connection raises mid-exchange."""
        num_chunks = ns.num_layers * ns.tp_size
        wanted: list[_Chunk] = []
        for c in put.chunks:
            if not 0 <= c.chunk < num_chunks:
                raise BadShape(f"chunk index {c.chunk!r} outside [0, {num_chunks})")
            if c.nbytes != chunk_bytes:
                raise BadShape(
                    f"chunk of {c.nbytes!r} bytes; this namespace's chunks are {chunk_bytes}"
                )
            wanted.append(((ns.id, c.block), c.parent, c.chunk))
        if len({(key, index) for key, _, index in wanted}) != len(wanted):
            raise InvalidArgument("a put names the same chunk twice")
        if not put.ucx and sizes != [chunk_bytes] * len(wanted):
            raise ProtocolError("a tcp:// put frame carries each chunk it names, in order")
        leases: list[Lease[Slot]] = []
        claims: dict[tuple[SlotKey, int], asyncio.Future[None]] = {}
        # New blocks start in the fastest tier with free room (ucx:// writes device memory
        # one-sidedly; tcp:// bounces through host memory into it), else in host memory
        # (Tiers.start_tier). A block already held stays where it is.
        wait = min(put.wait_s, self.io_timeout_s)
        scrub = ScrubBatch()
        try:
            t0 = time.perf_counter()
            if put.granted:
                slots, accept, sent = self._take_grants(put.writer, wanted, claims, leases)
                items = [self._landing(i, wanted[i], slot) for i, slot in sent.items()]
                bad = await self._check_written(conn, ns, items, sent, scrub)
                # A chunk without a live grant of this writer: failed (not stored).
                failed = sorted({*bad, *(i for i in range(len(wanted)) if i not in sent)})
            else:
                on_disk = self.tiers.on_disk(wanted)
                slots = self._allocate(wanted, chunk_bytes, num_chunks, leases, on_disk)
                if put.ucx:
                    accept, sent, failed = await self._put_ucx(
                        conn, ns, wanted, slots, claims, wait, scrub, put.writer, on_disk
                    )
                else:
                    accept, sent, failed = await self._put_tcp(
                        conn, ns, wanted, slots, claims, wait, chunk_bytes, on_disk
                    )
            stored = await self._commit_landed(wanted, sent, failed)
            # Scrubbed once committed: a drop then reaches the master after the add.
            self.scrub.add(ns, scrub)
            self._settle(claims)  # landed and committed: writers waiting on these look again
            self.metrics.count_transfer(
                "put", "ucx" if put.ucx else "tcp", len(sent) * chunk_bytes, t0
            )
            busy = tuple(i for i, a in enumerate(accept) if a == BUSY)
            if failed:
                self.metrics.transfer_errors.labels(
                    op=put.op, transport="ucx" if put.ucx else "tcp", reason="chunk"
                ).inc(len(failed))
            grants = self._grant(put, wanted, slots, num_chunks) if put.ucx else ()
            ack = Ack(stored, accept.count(STORED), tuple(failed), busy, grants, GRANT_S)
            await self._send(conn, ack)
        finally:
            self.scrub.add(ns, scrub)  # (gives back its room, when not queued already)
            self._settle(claims)
            for lease in leases:
                lease.release()
            self.tiers.allocated()  # its slots are movable now

    async def _put_ucx(
        self,
        conn: Connection,
        ns: Namespace,
        wanted: list[_Chunk],
        slots: list[Slot | None],
        claims: dict[tuple[SlotKey, int], asyncio.Future[None]],
        wait: float,
        scrub: ScrubBatch,
        writer: str,
        on_disk: frozenset[int] = frozenset(),
    ) -> tuple[list[int], dict[int, Slot], list[int]]:
        """Claim (waiting up to ``wait`` for other writers; chunks granted to ``writer``
        are its own already), hand the writer the spans of
        its chunks, wait for ``landed``, check them; (accept codes, position → slot of each
        chunk written, positions that failed a check). Chunks in host memory get their
        header checked now and are put in ``scrub`` for the rest (the caller hands them to
        the scrub once committed), when the scrub has room."""
        self._take_own_grants(writer, wanted, slots, claims)
        accept = await self._claim(wanted, slots, claims, wait, range(len(wanted)), on_disk)
        sent = {i: slot for i, a in enumerate(accept) if a == SEND and (slot := slots[i])}
        items = [self._landing(i, wanted[i], slot) for i, slot in sent.items()]
        await self._land_by_ucx(conn, accept, items, list(sent.values()))
        return accept, sent, await self._check_written(conn, ns, items, sent, scrub)

    async def _check_written(
        self,
        conn: Connection,
        ns: Namespace,
        items: list[LandedChunk],
        sent: dict[int, Slot],
        scrub: ScrubBatch,
    ) -> list[int]:
        """Check chunks a writer WROTE one-sidedly; the positions that failed. In host
        memory: headers now, every byte in the scrub (unless it is full); the GPU tier:
        every byte now, off the loop."""
        in_host = self.tiers.host.holds
        if all(in_host(it.view) for it in items) and self.scrub.reserve(scrub, items):
            failed = self.checks.headers(conn.peer, ns, items)
            bad = set(failed)
            scrub.chunks = [(sent[it.position], it) for it in items if it.position not in bad]
            return failed
        return await self.checks.written(conn.peer, ns, items, in_host)

    # -- grants ----------------------------------------------------------------------------

    def _grant(
        self, put: Put, wanted: list[_Chunk], slots: list[Slot | None], num_chunks: int
    ) -> tuple[tuple[int, int, bytes], ...]:
        """Claim the chunk indices ``put.grant`` of the put's blocks for its writer, each for
        :data:`GRANT_S` with its slot pinned: ``(position, index, location)`` per grant.
        Only free chunks (not landed, not claimed) of live slots in registered memory,
        within :data:`MAX_GRANTS`; none while the node drains."""
        if not put.writer or not put.grant or not self.granting:
            return ()
        loop = asyncio.get_running_loop()
        expires = loop.time() + GRANT_S
        out: list[tuple[int, int, bytes]] = []
        keys: list[tuple[SlotKey, int]] = []
        seen: set[SlotKey] = set()
        for position, ((key, _, _), slot) in enumerate(zip(wanted, slots, strict=True)):
            if slot is None or key in seen or not slot.alive or slot.quarantined:
                continue
            seen.add(key)
            tier = self.tiers.owner(slot)
            if tier is None or tier.reg is None:  # (nothing to WRITE one-sidedly into)
                continue
            location = self.tiers.location(slot, tier)
            if not location:
                continue
            for index in dict.fromkeys(put.grant):
                chunk = (key, index)
                free = 0 <= index < num_chunks and not slot.landed_mask >> index & 1
                if not free or chunk in self._inflight or len(self._grants) >= MAX_GRANTS:
                    continue
                claim = self._inflight[chunk] = loop.create_future()
                lease = tier.table.pin(slot)  # type: ignore[union-attr]
                self._grants[chunk] = _Grant(put.writer, slot, lease, claim, expires)
                keys.append(chunk)
                out.append((position, index, location))
        if keys:
            loop.call_later(GRANT_S, lambda: self._end_grants(keys, loop.time()))
        return tuple(out)

    def _take_own_grants(
        self,
        writer: str,
        wanted: list[_Chunk],
        slots: list[Slot | None],
        claims: dict[tuple[SlotKey, int], asyncio.Future[None]],
    ) -> None:
        """A ``reserve`` of chunks granted to its own writer takes those grants over (their
        claims move into ``claims``; the reserve pinned the slots itself), so the writer
        never waits on itself."""
        if not writer or not self._grants:
            return
        for (key, _, index), slot in zip(wanted, slots, strict=True):
            grant = self._grants.get((key, index))
            if grant is not None and grant.writer == writer and grant.slot is slot:
                del self._grants[key, index]
                claims[key, index] = grant.claim
                grant.lease.release()

    def _take_grants(
        self,
        writer: str,
        wanted: list[_Chunk],
        claims: dict[tuple[SlotKey, int], asyncio.Future[None]],
        leases: list[Lease[Slot]],
    ) -> tuple[list[Slot | None], list[int], dict[int, Slot]]:
        """A ``write``: each chunk's live grant of ``writer`` moves into this exchange (its
        claim into ``claims``, its pin into ``leases``): (slot per position, accept codes,
        position → slot of each granted chunk). Every chunk counts as sent: one without such
        a grant is then reported failed, not busy (this writer has written it already)."""
        now = asyncio.get_running_loop().time()
        slots: list[Slot | None] = [None] * len(wanted)
        accept = [SEND] * len(wanted)
        sent: dict[int, Slot] = {}
        for i, (key, _, index) in enumerate(wanted):
            grant = self._grants.get((key, index))
            if grant is None or grant.writer != writer or grant.expires <= now:
                continue
            del self._grants[key, index]
            claims[key, index], slots[i] = grant.claim, grant.slot
            leases.append(grant.lease)
            if grant.slot.alive and not grant.slot.quarantined:
                sent[i] = grant.slot
        return slots, accept, sent

    def _end_grants(self, keys: list[tuple[SlotKey, int]], now: float) -> None:
        """End the grants of ``keys`` that are due by ``now`` and not taken by a ``write``:
        claims end (writers waiting on them look again), pins are released."""
        for chunk in keys:
            grant = self._grants.get(chunk)
            if grant is None or grant.expires > now:
                continue
            del self._grants[chunk]
            self._settle({chunk: grant.claim})
            grant.lease.release()

    async def _put_tcp(
        self,
        conn: Connection,
        ns: Namespace,
        wanted: list[_Chunk],
        slots: list[Slot | None],
        claims: dict[tuple[SlotKey, int], asyncio.Future[None]],
        wait: float,
        chunk_bytes: int,
        on_disk: frozenset[int] = frozenset(),
    ) -> tuple[list[int], dict[int, Slot], list[int]]:
        """Receive the frame's chunks: each claimed one straight into its slot, each one
        another writer is transferring into a host buffer aside (within
        :data:`MAX_ASIDE_BYTES` for the node), the rest (stored, quarantined) discarded;
        all are checked as they arrive. Then wait up to ``wait`` for those other writers: a
        chunk they did not land is stored from its buffer (one more copy, only then).
        Returns as :meth:`_put_ucx`."""
        accept = await self._claim(wanted, slots, claims, 0.0, range(len(wanted)), on_disk)
        sent = {i: slot for i, a in enumerate(accept) if a == SEND and (slot := slots[i])}
        targets: list[LandedChunk | None] = [None] * len(wanted)
        for i, slot in sent.items():
            targets[i] = self._landing(i, wanted[i], slot)
        room = max(0, MAX_ASIDE_BYTES - self._aside_bytes) // chunk_bytes
        elsewhere = [i for i, a in enumerate(accept) if a == BUSY and self._in_flight(wanted[i])]
        aside = elsewhere[:room]
        held = len(aside) * chunk_bytes
        self._aside_bytes += held
        try:
            for i in aside:
                (_, block), _, index = wanted[i]
                buf = torch.empty(chunk_bytes, dtype=torch.uint8)
                targets[i] = LandedChunk(i, block, index, buf)
            timeout = self.io_timeout_s
            failed = await self.checks.receive(
                conn, ns, targets, chunk_bytes, timeout, self.tiers.in_gpu
            )
            kept = [i for i in aside if i not in failed]
            later = await self._claim(wanted, slots, claims, wait, kept)
            for i in kept:
                accept[i] = later[i]
                slot, target = slots[i], targets[i]
                if later[i] == SEND and slot is not None and target is not None:
                    self._landing(i, wanted[i], slot).view.copy_(target.view)
                    sent[i] = slot
            return accept, sent, failed
        finally:
            self._aside_bytes -= held

    def _landing(self, position: int, chunk: _Chunk, slot: Slot) -> LandedChunk:
        """Where chunk ``position`` of a put lands: its view in ``slot``."""
        (_, block), _, index = chunk
        return LandedChunk(
            position, block, index, self.tiers.tier_of(slot).table.chunk_view(slot, index)
        )

    async def _claim(
        self,
        wanted: list[_Chunk],
        slots: list[Slot | None],
        claims: dict[tuple[SlotKey, int], asyncio.Future[None]],
        wait_s: float,
        positions: Iterable[int],
        on_disk: frozenset[int] = frozenset(),
    ) -> list[int]:
        """Decide who writes each chunk at ``positions``: :data:`SEND` (this writer; the
        chunk is claimed in ``claims`` until its exchange ends), :data:`STORED` (landed and
        checked here already) or :data:`BUSY` (not stored, and this writer may not store it
        now); one code per chunk of ``wanted`` (BUSY for those not asked about).

        A chunk another writer is transferring is neither stored nor free: this writer
        waits up to ``wait_s`` for that exchange to end, then looks again — landed means
        stored, a failed or aborted transfer leaves the chunk to this writer. Past
        ``wait_s``, or when the block's slot is quarantined (a ``ucx://`` writer that may
        still be writing timed out), the chunk is BUSY: reported not stored, never a lie.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        accept = [BUSY] * len(wanted)
        todo = list(positions)
        for i in on_disk.intersection(todo):  # (held only on the node's disk: stored)
            accept[i] = STORED
        todo = [i for i in todo if i not in on_disk]
        while todo:
            waits: list[asyncio.Future[None]] = []
            later = []
            for i in todo:
                (key, _, index), slot = wanted[i], slots[i]
                if slot is None or slot.quarantined or not slot.alive:
                    continue
                if slot.landed_mask >> index & 1:
                    accept[i] = STORED
                elif (own := claims.get((key, index))) is not None and not own.done():
                    accept[i] = SEND  # claimed by this exchange already (a grant taken over)
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

    def _in_flight(self, chunk: _Chunk) -> bool:
        """Whether another exchange is transferring ``chunk`` now."""
        key, _, index = chunk
        return (key, index) in self._inflight

    def _settle(self, claims: dict[tuple[SlotKey, int], asyncio.Future[None]]) -> None:
        """End an exchange's claims and wake the writers waiting on them (idempotent)."""
        for chunk, fut in claims.items():
            if self._inflight.get(chunk) is fut:
                del self._inflight[chunk]
            if not fut.done():
                fut.set_result(None)

    def _allocate(
        self,
        wanted: list[_Chunk],
        chunk_bytes: int,
        num_chunks: int,
        leases: list[Lease[Slot]],
        on_disk: frozenset[int] = frozenset(),
    ) -> list[Slot | None]:
        """Allocate and pin the batch's slots, new ones in the tier
        :meth:`~kvstore.node.tiers.Tiers.start_tier` names while it has free room (the GPU
        tier never evicts for a put: its mover makes room between requests) and in host
        memory otherwise, blocks already held in the tier that holds them. When the first
        block cannot get a slot the put is refused (CapacityError before any payload); when
        a later one cannot (memory holds fewer new blocks than the put names), it and every
        block after it that is not held already get None: not stored (BUSY), the blocks
        before them are. A block whose slot is quarantined gets None: its chunks cannot be
        stored now (BUSY); so does a block whose every chunk named here is held on the
        node's disk (``on_disk``: positions, STORED)."""
        by_key: dict[SlotKey, Slot | None] = {}
        host, slot_bytes = self.tiers.host, chunk_bytes * num_chunks
        owners: dict[bytes, str] = {}
        skip: set[SlotKey] = set()
        full = False
        if on_disk:
            rest = {k for i, (k, _, _) in enumerate(wanted) if i not in on_disk}
            skip = {k for k, _, _ in wanted} - rest
        for key, parent, _ in wanted:
            if key in by_key:
                continue
            if key in skip:
                by_key[key] = None
                continue
            # A quarantined slot counts as held, so a block is never started again in
            # another tier meanwhile.
            held = self.tiers.holder(key)
            if (held is not None and held.table.get(key) is None) or (full and held is None):
                by_key[key] = None
                continue
            into = held or self.tiers.start_tier(key[0], parent)
            if (owner := owners.get(key[0])) is None:
                owner = owners[key[0]] = self.owner_of(key[0])
            args = (key, slot_bytes, chunk_bytes, num_chunks, parent, owner)
            try:
                try:
                    res = into.table.allocate(*args, evict=into is host)
                except CapacityError:
                    if held is not None or into is host:
                        raise
                    into = host  # no free room in the GPU tier: host memory, and the mover
                    self.tiers.wake()  # makes room for the next put
                    res = into.table.allocate(*args)
            except CapacityError:
                if not leases:  # (no block of this put has a slot: it is refused)
                    raise
                # No room beside the put's blocks before it (pinned now): not stored, as
                # are the blocks after it. A prompt larger than memory keeps its prefix.
                by_key[key] = None
                full = True
                continue
            by_key[key] = res.slot
            leases.append(into.table.pin(res.slot))
            if res.evicted:
                self.tiers.evicted(into, res.evicted)
        self.tiers.allocated(slot_bytes)
        return [by_key[key] for key, _, _ in wanted]

    async def _land_by_ucx(
        self, conn: Connection, accept: list[int], items: list[LandedChunk], slots: list[Slot]
    ) -> None:
        """``ucx://``: hand the writer the chunk views' spans, wait for its ``landed``.

        If the writer never says ``landed`` (timeout, disconnect, garbage), it may still be
        writing one-sidedly into those slots: they are quarantined for a while, unreadable
        and not reused, instead of being handed to someone else.
        """
        spans = tuple(tuple(self.tiers.span(it.view)) for it in items)
        await self._send(conn, Ready(tuple(accept), spans))
        try:
            frame = await conn.recv_header(timeout=self.io_timeout_s)
            if frame.sizes:
                raise ProtocolError("'landed' carries no payload")
            expect(frame.header, Landed)
        except BaseException:
            self._quarantine(slots)
            raise

    def _quarantine(self, slots: Iterable[Slot]) -> None:
        """Quarantine ``slots`` for one I/O timeout (a peer may still write into them)."""
        loop = asyncio.get_running_loop()
        for slot in set(slots):
            tier = self.tiers.owner(slot)
            if tier is None:
                continue
            tier.table.quarantine(slot)
            # One deadline per slot, the latest: a second writer of the same block that
            # times out later keeps it quarantined for its own full timeout.
            old = self._unquarantine_at.pop(slot, None)
            if old is not None:
                old.cancel()
            self._unquarantine_at[slot] = loop.call_later(
                self.io_timeout_s, self._unquarantine, tier, slot
            )

    def _unquarantine(self, tier: MemoryTier, slot: Slot) -> None:
        self._unquarantine_at.pop(slot, None)
        if slot.alive and slot.quarantined and tier.owns(slot):
            tier.table.unquarantine(slot)

    async def _commit_landed(
        self, wanted: list[_Chunk], sent: dict[int, Slot], failed: list[int]
    ) -> int:
        """Mark the checked chunks landed and commit them to the master; chunks stored.
        ``sent``: request position → slot of each chunk the writer sent. Chunks whose slot
        was quarantined meanwhile are added to ``failed``."""
        landed: dict[SlotKey, tuple[Slot, MemoryTier, list[int]]] = {}
        rejected = set(failed)
        stored = 0
        for i, slot in sent.items():
            key, _, index = wanted[i]
            if i in rejected:
                continue
            if slot.quarantined:
                # Quarantined by another exchange meanwhile (a writer of the same block
                # timed out): this chunk is not kept; the writer is told so and may retry.
                failed.append(i)
                continue
            stored += 1
            tier = self.tiers.tier_of(slot)
            if tier.table.mark_landed(slot, index):
                landed.setdefault(key, (slot, tier, []))[2].append(index)
        failed.sort()
        await self.link.commit(
            [self.tiers.add_of(s, tuple(v), tier) for s, tier, v in landed.values()]
        )
        self.tiers.stored([s for s, tier, _ in landed.values() if tier is self.tiers.host])
        return stored
