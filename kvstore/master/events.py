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
more than ``capacity`` events behind while reading gets CLEARED the same way. A consumer
that asks for a snapshot gets, after CLEARED (and on a first connect), a STORED event for
every block the index holds, numbered as the CLEARED, then SNAPSHOT_DONE: its index is then
whole, and the live events follow (the master builds them, :mod:`kvstore.master.service`).
The fields follow vLLM's KV events where they fit (``BlockStored``/``BlockRemoved`` with
``medium``).

Where several masters share one index (Redis) a master's log follows the store's stream of
every master's changes, not the commits it applies itself (:meth:`EventLog.record`); when
it starts following, or follows again after losing its place, :meth:`EventLog.gap` makes
every position before it one that must clear.

Pure state apart from an :class:`asyncio.Event` that wakes readers. Bounded: memory
is ``capacity`` events; a read returns at most ``max_events``. The log is appended to on
every commit's path and read by few (routers), so it keeps each event as a plain tuple of
the :class:`ClusterEvent` fields and makes the event the first time a read passes it:
building 16 events of a commit of 8 adds and 8 evictions was a fifth of what the commit
cost the master (``bench/commit_path.py``). A row holds its kind as the kind's number, so
that it holds no object the garbage collector tracks and the collector stops visiting it
(a full ring is a quarter of a million rows).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Sequence

from kvstore.control.records import (
    BlockAdd,
    BlockRef,
    ClusterEvent,
    ClusterEventKind,
    EventKind,
    IndexEvent,
)
from kvstore.dataplane.location import tier_of

__all__ = ["ClusterEvent", "ClusterEventKind", "EventLog"]

DEFAULT_CAPACITY = 262144
"""Events a master keeps for consumers that reconnect (~60 MB at worst)."""


_Row = tuple[int, int, bytes, bytes, str, int, tuple[int, ...], bytes, str]
"""An event not read yet: the fields of its :class:`ClusterEvent` in order, the kind as
its number and the medium as the committed location it is read from (``tier_of``, once
a read makes the event: 7% of a commit's apply in a node's profile)."""
_STORED, _REMOVED = ClusterEventKind.STORED.value, ClusterEventKind.REMOVED.value
_NODE_DEAD = ClusterEventKind.NODE_DEAD.value
_KINDS = {kind.value: kind for kind in ClusterEventKind}


def _event(row: _Row) -> ClusterEvent:
    """The event ``row`` stands for."""
    seq, kind, ns_id, block_hash, node_id, epoch, chunks, location, reason = row
    return ClusterEvent(
        seq, _KINDS[kind], ns_id, block_hash, node_id, epoch, chunks, tier_of(location), reason
    )


class EventLog:
    """The last ``capacity`` cluster events, numbered from 1, and their readers."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.log_id = secrets.token_hex(8)
        # Event s at (s - 1) % capacity: a row until a read makes it the event.
        self._ring: list[ClusterEvent | _Row | None] = [None] * capacity
        self._seq = 0
        self._floor = 1  # the oldest event that may be read (past a gap: see gap())
        self._changed = asyncio.Event()  # set (and replaced) at every append

    @property
    def capacity(self) -> int:
        """The most events kept."""
        return len(self._ring)

    @property
    def last_seq(self) -> int:
        """The newest event's number (0 before the first)."""
        return self._seq

    @property
    def _oldest(self) -> int:
        """The oldest event still kept (``last_seq + 1`` when there is none)."""
        return max(self._floor, self._seq - len(self._ring) + 1)

    def commit(
        self, node_id: str, epoch: int, adds: Sequence[BlockAdd], evicts: Sequence[BlockRef]
    ) -> None:
        """Record one applied commit batch (removals first, as the store applies them)."""
        ring, cap = self._ring, len(self._ring)
        for e in evicts:
            seq = self._seq = self._seq + 1
            ring[(seq - 1) % cap] = (seq, _REMOVED, e.ns_id, e.block_hash, node_id, epoch,
                                     (), b"", "")  # fmt: skip
        for a in adds:
            seq = self._seq = self._seq + 1
            ring[(seq - 1) % cap] = (seq, _STORED, a.ns_id, a.block_hash, node_id, epoch,
                                     tuple(a.chunks), a.location, "")  # fmt: skip
        if adds or evicts:
            self.wake()

    def node_dead(self, node_id: str, epoch: int, reason: str) -> None:
        """Record that ``node_id``'s ``epoch`` died (its blocks are gone)."""
        seq = self._seq = self._seq + 1
        self._ring[(seq - 1) % len(self._ring)] = (
            seq, _NODE_DEAD, b"", b"", node_id, epoch, (), b"", reason,
        )  # fmt: skip
        self.wake()

    def record(self, events: Sequence[IndexEvent]) -> None:
        """Record changes of a shared index in the order its stream gave them (COMMIT as
        STORED, EVICT as REMOVED, NODE_DEAD; ABORT is no change of who holds what)."""
        ring, cap, seq = self._ring, len(self._ring), self._seq
        for e in events:
            if e.kind is EventKind.COMMIT:
                row: _Row = (seq + 1, _STORED, e.ns_id, e.block_hash, e.node_id, e.epoch,
                             e.chunks, e.location, "")  # fmt: skip
            elif e.kind is EventKind.EVICT:
                row = (seq + 1, _REMOVED, e.ns_id, e.block_hash, e.node_id, e.epoch, (), b"", "")
            elif e.kind is EventKind.NODE_DEAD:
                row = (seq + 1, _NODE_DEAD, b"", b"", e.node_id, e.epoch, (), b"", e.reason)
            else:
                continue
            seq += 1
            ring[(seq - 1) % cap] = row
        if seq != self._seq:
            self._seq = seq
            self.wake()

    def gap(self) -> None:
        """Changes from here back to the last event recorded may be missing (a shared
        index's stream was not followed meanwhile): every reader and every position before
        here must clear. Takes one number, which no event carries."""
        self._seq += 1
        self._floor = self._seq + 1
        self._ring[(self._seq - 1) % len(self._ring)] = None
        self.wake()

    def wake(self) -> None:
        """Wake every reader waiting in :meth:`wait` (it returns whether an event exists)."""
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
        ring = self._ring
        for seq in range(new_cursor + 1, self._seq + 1):
            ev = ring[(seq - 1) % cap]
            if type(ev) is tuple:  # (made once, whoever reads it first)
                ev = ring[(seq - 1) % cap] = _event(ev)
            assert isinstance(ev, ClusterEvent) and ev.seq == seq
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

    @staticmethod
    def snapshot_done(seq: int) -> ClusterEvent:
        """The event that ends a snapshot sent after the CLEARED numbered ``seq``."""
        return ClusterEvent(seq, ClusterEventKind.SNAPSHOT_DONE)
