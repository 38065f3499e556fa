"""The node's scrub: the full check of every ``ucx://`` chunk, off the put's ack path.

A ``ucx://`` put is acked once each chunk's header, key and spec are checked (64 bytes a
chunk) and the receipt is committed; reading every byte for its checksum (~0.2 ms for a 4 MiB
layer from memory here, ~20 GB/s) is left to this scrub, which checks each landed chunk within a
bounded time: at most :data:`MAX_PENDING_BYTES` wait, checked on the event loop in slices of
at most :data:`SLICE_BYTES` while no exchange is being served, and regardless once the oldest
has waited :data:`MAX_AGE_S` or half the room is taken. Readers verify every chunk anyway, so
a chunk read before its scrub is never returned bad; a chunk that fails is dropped
(``on_bad``) so its next writer stores it again. When the scrub is full the put checks its
chunks itself, before the ack, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.core.hashing import Namespace
from kvstore.core.slots import Slot
from kvstore.node.checks import ChunkChecks, LandedChunk
from kvstore.node.tiers import Tiers

__all__ = ["MAX_AGE_S", "MAX_PENDING_BYTES", "SLICE_BYTES", "YIELD_S", "Scrub", "ScrubBatch"]

logger = logging.getLogger("kvstore.node")

MAX_PENDING_BYTES = 256 * 2**20
"""Most chunk bytes waiting for their scrub (~13 ms of checks at ~20 GB/s from memory)."""

SLICE_BYTES = 8 * 2**20
"""Most bytes checked in one turn of the event loop (~1 ms here)."""

MAX_AGE_S = 1.0
"""Longest a chunk waits for its scrub while the node is busy serving exchanges."""

YIELD_S = 0.001
"""How long the scrub steps aside, each time, for an exchange being served."""


@dataclass
class ScrubBatch:
    """One exchange's chunks for the scrub and the room it reserved for them."""

    chunks: list[tuple[Slot, LandedChunk]] = field(default_factory=list)
    reserved: int = 0


@dataclass(frozen=True)
class _Pending:
    ns: Namespace
    slot: Slot
    chunk: LandedChunk
    since: float
    """Loop time it was queued."""


class Scrub:
    """Checks landed chunks in the background; ``on_bad(slot, index)`` drops a bad one.

    :meth:`reserve` takes room for chunks (False when they do not fit: the caller checks
    them itself), :meth:`add` queues them once they are committed (never blocks; room not
    used is given back). :meth:`run` is the scrub's task; :meth:`idle` waits until nothing
    is pending.
    """

    def __init__(
        self,
        checks: ChunkChecks,
        tiers: Tiers,
        on_bad: Callable[[Slot, int], None],
        max_pending_bytes: int = MAX_PENDING_BYTES,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self._checks = checks
        self._tiers = tiers
        self._on_bad = on_bad
        self._max = max_pending_bytes
        self._busy = busy
        self._queue: deque[_Pending] = deque()
        self._slots: Counter[Slot] = Counter()
        """Chunks queued, by slot."""
        self._bytes = 0
        """Bytes queued or reserved."""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.scrubbed = 0
        """Chunks checked so far."""
        self.dropped = 0
        """Chunks that failed their scrub and were dropped."""
        self.cpu_s = 0.0
        """CPU seconds the scrub's checks took so far (the event loop's thread's time)."""

    @property
    def pending(self) -> int:
        """Chunks waiting for their scrub."""
        return len(self._queue)

    def holds(self, slot: Slot) -> bool:
        """Whether chunks of ``slot`` wait for their scrub (it must not move meanwhile: the
        scrub checks the slot it was given)."""
        return slot in self._slots

    def reserve(self, batch: ScrubBatch, chunks: list[LandedChunk]) -> bool:
        """Take room in ``batch`` for ``chunks``; False, taking nothing, when they do not
        fit."""
        size = sum(c.view.numel() for c in chunks)
        if self._bytes + size > self._max:
            return False
        self._bytes += size
        batch.reserved += size
        return True

    def add(self, ns: Namespace, batch: ScrubBatch) -> None:
        """Queue ``batch``'s chunks, committed now, for their full check, and give back the
        room it reserved beyond them (all of it for a batch without chunks)."""
        used = sum(c.view.numel() for _, c in batch.chunks)
        self._bytes -= batch.reserved - used
        batch.reserved = 0
        now = asyncio.get_running_loop().time()
        self._queue.extend(_Pending(ns, slot, c, now) for slot, c in batch.chunks)
        self._slots.update(slot for slot, _ in batch.chunks)
        if batch.chunks:
            self._idle.clear()
            self._wake.set()
        batch.chunks = []

    async def idle(self) -> None:
        """Wait until every chunk queued so far has been checked."""
        await self._idle.wait()

    async def run(self) -> None:
        """Check queued chunks, a slice per loop turn, until cancelled. While ``busy()``
        (an exchange is being served) the scrub gives way, unless its oldest chunk has
        waited :data:`MAX_AGE_S` or it holds more than half its room: it is background
        work, bounded in time either way."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                urgent = (
                    loop.time() - self._queue[0].since >= MAX_AGE_S or 2 * self._bytes > self._max
                )
                if self._busy() and not urgent:
                    await asyncio.sleep(YIELD_S)
                    continue
                self._slice()
                await asyncio.sleep(0)
            self._idle.set()

    def _slice(self) -> None:
        start = time.thread_time()
        try:
            self._check_slice()
        finally:
            self.cpu_s += time.thread_time() - start

    def _check_slice(self) -> None:
        """Check the next :data:`SLICE_BYTES` of queued chunks, those of one namespace in
        one call (:meth:`~kvstore.node.checks.ChunkChecks.check`)."""
        done = 0
        by_ns: dict[bytes, list[_Pending]] = {}
        while self._queue and done < SLICE_BYTES:
            item = self._queue.popleft()
            self._slots[item.slot] -= 1
            if not self._slots[item.slot]:
                del self._slots[item.slot]
            size = item.chunk.view.numel()
            self._bytes -= size
            done += size
            slot, index = item.slot, item.chunk.chunk
            tier = self._tiers.owner(slot)
            # Gone, quarantined or dropped meanwhile: nothing left to check.
            if tier is None or not slot.alive or slot.quarantined:
                continue
            if not slot.landed_mask >> index & 1:
                continue
            by_ns.setdefault(item.ns.id, []).append(item)
        for items in by_ns.values():
            self.scrubbed += len(items)
            # (positions renumbered: chunks of several puts may share one)
            chunks = [p.chunk._replace(position=k) for k, p in enumerate(items)]
            for k in self._checks.check("scrub", items[0].ns, chunks):
                self.dropped += 1
                self._on_bad(items[k].slot, items[k].chunk.chunk)
