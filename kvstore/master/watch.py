"""Turning index events into one watcher's ``Watch`` events (pure state, no I/O).

A watcher names blocks by position (``block_index`` into the hashes it asked for). The
index store publishes per-block COMMIT/EVICT/ABORT and one NODE_DEAD per dead epoch; a
:class:`WatchView` remembers which node holds which chunks of the watched blocks, so a
NODE_DEAD becomes an EVICT, carrying the chunks it held, for exactly the watched blocks
that node held, and an EVICT always says what was lost.

Events may repeat what the watcher knows (a COMMIT of chunks already announced) -- a
consumer keeps the union of COMMIT chunks per holder and drops the holder on EVICT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvstore.control.records import (
    EventKind,
    Holding,
    IndexEvent,
    WatchEvent,
    WatchKind,
    chunks_of,
    mask_of,
)

__all__ = ["WatchView"]


class WatchView:
    """What one watcher has been told: per watched block, node -> (epoch, mask).

    ``chunks_per_block > 0`` leaves chunk indices at or above it out of every event.
    """

    def __init__(self, block_hashes: Sequence[bytes], chunks_per_block: int = 0) -> None:
        self._limit = chunks_per_block
        self._index_of: dict[bytes, list[int]] = {}
        for i, block_hash in enumerate(block_hashes):
            self._index_of.setdefault(block_hash, []).append(i)
        self._held: list[dict[str, Holding]] = [{} for _ in block_hashes]

    def snapshot(self, snapshot: Sequence[Mapping[str, Holding]]) -> list[WatchEvent]:
        """COMMIT events for the holders in ``snapshot`` (one dict per watched block), then
        SNAPSHOT_DONE."""
        events: list[WatchEvent] = []
        for i, holders in enumerate(snapshot):
            for node, holding in sorted(holders.items()):
                self._held[i][node] = holding
                chunks = tuple(holding.chunks(self._limit))
                if chunks:
                    events.append(
                        WatchEvent(
                            WatchKind.COMMIT, i, chunks, node, holding.epoch, "", holding.location
                        )
                    )
        events.append(WatchEvent(WatchKind.SNAPSHOT_DONE))
        return events

    def apply(self, event: IndexEvent) -> list[WatchEvent]:
        """The watch events ``event`` means for this watcher (possibly none)."""
        if event.kind is EventKind.NODE_DEAD:
            return self._node_dead(event)
        out: list[WatchEvent] = []
        for i in self._index_of.get(event.block_hash, ()):
            if event.kind is EventKind.COMMIT:
                out.extend(self._commit(i, event))
            elif event.kind is EventKind.EVICT:
                out.extend(self._evict(i, event.node_id, event.epoch, "evicted", event.chunks))
            elif event.kind is EventKind.ABORT:
                out.append(WatchEvent(WatchKind.ABORT, i, reason=event.reason))
        return out

    def _commit(self, i: int, event: IndexEvent) -> list[WatchEvent]:
        old = self._held[i].get(event.node_id)
        mask = mask_of(event.chunks)
        if old is not None and old.epoch == event.epoch:
            mask |= old.mask
        location = event.location or (old.location if old is not None else b"")
        self._held[i][event.node_id] = Holding(event.epoch, mask, location)
        chunks = tuple(chunks_of(mask_of(event.chunks), self._limit))
        if not chunks:
            return []
        return [WatchEvent(WatchKind.COMMIT, i, chunks, event.node_id, event.epoch, "", location)]

    def _evict(
        self, i: int, node: str, epoch: int, reason: str, fallback: Sequence[int] = ()
    ) -> list[WatchEvent]:
        old = self._held[i].pop(node, None)
        chunks = (
            old.chunks(self._limit)
            if old is not None
            else chunks_of(mask_of(fallback), self._limit)
        )
        return [WatchEvent(WatchKind.EVICT, i, tuple(chunks), node, epoch, reason)]

    def _node_dead(self, event: IndexEvent) -> list[WatchEvent]:
        out: list[WatchEvent] = []
        reason = event.reason or "node dead"
        for i, holders in enumerate(self._held):
            old = holders.get(event.node_id)
            if old is not None and old.epoch <= event.epoch:
                out.extend(self._evict(i, event.node_id, old.epoch, reason))
        return out
