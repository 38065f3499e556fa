"""The cluster event stream: every store and removal the master applies, numbered, for
routers that keep their own index of who holds what.

The master appends to an :class:`EventLog` as it applies each node's commits (a STORED
event per block added, REMOVED per block evicted) and as node epochs die (one NODE_DEAD:
every block that epoch held is gone). Events carry a sequence number that grows by one
per event; the log keeps the last ``capacity`` of them in memory. A consumer that
reconnects asks for the events after the last sequence number it saw *of the same log*
(``log_id``, new each time a master starts): it gets exactly the ones it missed, or, when
those are no longer kept (or the log is another one), one CLEARED event first — drop your
index, it is rebuilt by what follows (vLLM's ``AllBlocksCleared``). A consumer that falls
more than ``capacity`` events behind while reading gets CLEARED the same way. The fields
follow vLLM's KV events where they fit (``BlockStored``/``BlockRemoved`` with ``medium``).

Pure state apart from an :class:`asyncio.Event` that wakes readers. Bounded: memory
is ``capacity`` events; a read returns at most ``max_events``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Sequence

from kvstore.control.records import BlockAdd, BlockRef, ClusterEvent, ClusterEventKind
from kvstore.dataplane.location import tier_of

__all__ = ["ClusterEvent", "ClusterEventKind", "EventLog"]

DEFAULT_CAPACITY = 262144
"""Events a master keeps for consumers that reconnect (~60 MB at worst)."""


def _medium(location: bytes) -> str:
    return tier_of(location)


class EventLog:
    """The last ``capacity`` cluster events, numbered from 1, and their readers."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.log_id = secrets.token_hex(8)
        self._ring: list[ClusterEvent | None] = [None] * capacity  # event s at (s - 1) % cap
        self._seq = 0
        self._changed = asyncio.Event()  # set (and replaced) at every append

    @property
    def last_seq(self) -> int:
        """The newest event's number (0 before the first)."""
        return self._seq

    @property
    def _oldest(self) -> int:
        """The oldest event still kept (``last_seq + 1`` when there is none)."""
        return max(1, self._seq - len(self._ring) + 1) if self._seq else 1

    def _append(self, kind: ClusterEventKind, **fields: object) -> None:
        self._seq += 1
        event = ClusterEvent(self._seq, kind, **fields)  # type: ignore[arg-type]
        self._ring[(self._seq - 1) % len(self._ring)] = event

    def commit(
        self, node_id: str, epoch: int, adds: Sequence[BlockAdd], evicts: Sequence[BlockRef]
    ) -> None:
        """Record one applied commit batch (removals first, as the store applies them)."""
        for e in evicts:
            self._append(ClusterEventKind.REMOVED, ns_id=e.ns_id, block_hash=e.block_hash,
                         node_id=node_id, epoch=epoch)  # fmt: skip
        for a in adds:
            self._append(ClusterEventKind.STORED, ns_id=a.ns_id, block_hash=a.block_hash,
                         node_id=node_id, epoch=epoch, chunks=tuple(a.chunks),
                         medium=_medium(a.location))  # fmt: skip
        if adds or evicts:
            self._wake()

    def node_dead(self, node_id: str, epoch: int, reason: str) -> None:
        """Record that ``node_id``'s ``epoch`` died (its blocks are gone)."""
        self._append(ClusterEventKind.NODE_DEAD, node_id=node_id, epoch=epoch, reason=reason)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def start(self, after_seq: int, log_id: str) -> tuple[int, bool]:
        """Where a consumer resuming after ``after_seq`` of log ``log_id`` starts: the
        cursor to read after, and whether it must first be sent CLEARED. A first connect
        (``log_id`` empty) starts at the head, with nothing to clear."""
        if not log_id:
            return self._seq, False
        if log_id != self.log_id or after_seq > self._seq or after_seq + 1 < self._oldest:
            return self._seq, True
        return after_seq, False

    def since(
        self,
        cursor: int,
        ns_id: bytes,
        max_events: int,
        owns: Callable[[bytes], bool] | None = None,
    ) -> tuple[list[ClusterEvent], int, bool]:
        """Up to ``max_events`` events after ``cursor`` (those of namespace ``ns_id`` and
        every NODE_DEAD, or, when ``ns_id`` is empty, of every namespace ``owns`` says
        yes to, default all), the new cursor, and whether events after ``cursor`` were
        already dropped (the reader fell behind)."""
        if cursor >= self._seq:
            return [], cursor, False
        oldest = self._oldest
        lost = cursor + 1 < oldest
        out: list[ClusterEvent] = []
        new_cursor = max(cursor, oldest - 1)
        cap = len(self._ring)
        for seq in range(new_cursor + 1, self._seq + 1):
            ev = self._ring[(seq - 1) % cap]
            assert ev is not None and ev.seq == seq
            new_cursor = seq
            if ev.kind is ClusterEventKind.NODE_DEAD or (
                ev.ns_id == ns_id if ns_id else owns is None or owns(ev.ns_id)
            ):
                out.append(ev)
                if len(out) >= max_events:
                    break
        return out, new_cursor, lost

    async def wait(self, cursor: int, timeout: float) -> bool:
        """Wait until an event after ``cursor`` exists or ``timeout`` passes; whether one
        does."""
        if self._seq > cursor:
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            return False
        return self._seq > cursor

    def cleared(self, seq: int) -> ClusterEvent:
        """The CLEARED event a consumer is sent first (numbered with the cursor it starts
        from, so resuming after it continues the log)."""
        return ClusterEvent(seq, ClusterEventKind.CLEARED, reason="events missed; rebuild")
